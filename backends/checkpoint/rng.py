"""Every RNG a training step draws from (torch CPU and CUDA, Python ``random``, NumPy), captured and
restored, and stored per rank in a checkpoint as ``rng/rank_<r>.safetensors``.

Exact resumption needs each rank to continue its own random streams (dropout, data shuffles), so each
rank writes and later reads back its own file; the states are tensors plus a little JSON, never pickles.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor

from backends.checkpoint.errors import CheckpointCorruptError

__all__ = ["capture_rng_state", "restore_rng_state", "rng_file", "write_rng_file", "read_rng_file"]


def capture_rng_state() -> tuple[dict[str, Tensor], dict[str, Any]]:
    """This process's RNG states: ``(tensors, json_meta)`` (torch CPU, CUDA, Python ``random``, NumPy)."""
    tensors: dict[str, Tensor] = {"torch_cpu": torch.get_rng_state()}
    meta: dict[str, Any] = {}
    version, internal, gauss = random.getstate()
    tensors["python"] = torch.tensor(internal, dtype=torch.int64)
    meta["python"] = {"version": version, "gauss_next": gauss}
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is installed with torch here
        np = None
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        tensors["numpy"] = torch.from_numpy(np.asarray(keys, dtype=np.int64).copy())
        meta["numpy"] = {"name": name, "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["cuda"] = torch.cuda.get_rng_state()
        meta["cuda_device"] = torch.cuda.current_device()
    return tensors, meta


def restore_rng_state(tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> None:
    """Set this process's RNG states from :func:`capture_rng_state`'s output."""
    torch.set_rng_state(tensors["torch_cpu"].to(torch.uint8))
    if "python" in tensors:
        py = meta["python"]
        random.setstate((py["version"], tuple(int(x) for x in tensors["python"].tolist()), py["gauss_next"]))
    if "numpy" in tensors:
        import numpy as np

        m = meta["numpy"]
        keys = tensors["numpy"].numpy().astype(np.uint32)
        np.random.set_state((m["name"], keys, m["pos"], m["has_gauss"], m["cached_gaussian"]))
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"].to(torch.uint8))


def rng_file(root: Path, rank: int) -> Path:
    """Where rank ``rank``'s RNG states go in the checkpoint dir ``root``."""
    return root / "rng" / f"rank_{rank}.safetensors"


def write_rng_file(root: Path, rank: int) -> None:
    """Write this process's RNG states as rank ``rank``'s file under ``root``."""
    from safetensors.torch import save_file

    tensors, meta = capture_rng_state()
    path = rng_file(root, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"rng": json.dumps(meta)})


def read_rng_file(root: Path, rank: int) -> tuple[dict[str, Tensor], dict[str, Any]] | None:
    """Rank ``rank``'s saved RNG states (for :func:`restore_rng_state`), or None if it has no file."""
    from safetensors import safe_open

    path = rng_file(root, rank)
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})["rng"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # a cut-off or overwritten file surfaces as whatever safetensors or json raises
        raise CheckpointCorruptError(
            f"the RNG file {str(path)!r} of rank {rank} cannot be read "
            f"({type(e).__name__}: {e}): the checkpoint is damaged"
        ) from None
    return tensors, meta
