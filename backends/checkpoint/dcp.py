"""Crash-safe, resumable checkpoints of a whole run with ``torch.distributed.checkpoint`` (DCP).

API (every function is called on **all** ranks, in step, unless it says otherwise)::

    path = save_checkpoint(ckpt_dir, step, {"actor": actor, "critic": critic}, extra,
                           keep_last=3, config=must_match)            # -> Path (or PendingCheckpoint)
    path = resolve_resume(resume, ckpt_dir)      # "auto" | "never" | None | a step_N dir -> Path | None
    states, extra = load_checkpoint(path, {"actor": actor, "critic": critic}, config=must_match)
    latest_checkpoint(ckpt_dir) / list_checkpoints(ckpt_dir) / checkpoint_info(path)   # any rank
    wait_for_pending_save()                      # before exit when saving with async_save=True

- ``states``: named train states (``backends.training.fsdp.TrainState`` or anything with ``module``,
  ``optimizer`` (or None) and ``step``, plus ``replace(step=...)``). Model and optimizer are saved
  sharded (``get_state_dict`` / ``set_state_dict``: FSDP2 ``DTensor``s, or plain tensors at world size
  1) and loaded back in place; ``load_checkpoint`` returns new state objects carrying the saved
  ``step``. A checkpoint holds several states; loading may ask for a subset of them.
- ``extra``: a small JSON-like tree the recipe owns (data position, KL-controller state, counters):
  dicts with ``str`` keys, lists (tuples come back as lists), ``None``/bool/int/float/str, and
  ``torch.Tensor`` leaves. Scalars are stored as JSON, tensors through DCP (they come back on the CPU
  with their dtype and shape). It must be the same on every rank (one copy is stored).
- RNG: each rank's torch CPU, CUDA (if initialised), Python ``random`` and NumPy global states are
  saved to ``rng/rank_<r>.safetensors`` and restored on that rank by ``load_checkpoint``
  (``restore_rng=False`` to skip). A rank absent from the checkpoint (more ranks than when saved)
  keeps its RNG and gets a warning: exact resumption needs the same world size.
- ``config``: the config keys that must match on resume (nested dicts / attrs objects are
  flattened to dotted keys). A mismatch raises :class:`CheckpointMismatchError` naming every
  differing key, before any weight is loaded.

Layout and atomicity::

    <ckpt_dir>/step_<N>/            a complete checkpoint (has COMPLETE)
        COMPLETE                    JSON marker, written last: step, world size, per-state model
                                    fingerprint (parameter names + shapes), config + its hash,
                                    optimizer hyper-parameters, the extra tree's JSON skeleton
        .metadata, __<r>_0.distcp   DCP files (tensors only)
        rng/rank_<r>.safetensors    per-rank RNG states
    <ckpt_dir>/step_<N>.tmp-<hex>/  a save in progress (or one that crashed): ignored, removed by the
                                    next save

Every rank writes into the temp dir; after all ranks are done (a barrier; for async saves, the DCP
future of rank 0, which completes only after every rank's shard is written), rank 0 writes
``COMPLETE`` and renames the dir to ``step_<N>`` (``os.replace`` of a directory is atomic on
POSIX). A crash at any point leaves every earlier checkpoint intact; :func:`latest_checkpoint` only
sees dirs named ``step_<N>`` that hold ``COMPLETE``. Retention (``keep_last``) renames an old
checkpoint out of the ``step_<N>`` namespace before deleting it, so a crash mid-delete never leaves
a half-deleted dir that looks complete. ``ckpt_dir`` must be visible to every rank (one node, or a
shared filesystem).

Async (``async_save=True``): the state is copied to CPU memory (the call blocks for that), the files
are written by a background thread over a dedicated gloo group, and rank 0 renames the dir as soon
as the write completes. Call ``pending.wait()`` (or :func:`wait_for_pending_save`) before exiting;
the next ``save_checkpoint`` / ``load_checkpoint`` waits for a pending save first. A process that
exits without waiting leaves only a temp dir, never a damaged checkpoint.

Nothing is unpickled beyond ``torch.load(weights_only=True)``: only tensors go through DCP (its
``.metadata`` index is read with an unpickler that accepts only DCP's own metadata classes), the rest
is JSON, RNG states are safetensors.

An optimizer that has never stepped has no state; DCP's ``get_state_dict`` would initialise it by
stepping with zero gradients (setting Adam's step counter to 1 and changing the next update), so such
an optimizer is recorded as ``"empty"`` and restored as empty.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

from backends.distributed.sharded_state import reshard

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CheckpointInfo",
    "PendingCheckpoint",
    "save_checkpoint",
    "load_checkpoint",
    "resolve_resume",
    "latest_checkpoint",
    "list_checkpoints",
    "checkpoint_info",
    "wait_for_pending_save",
    "model_fingerprint",
    "flatten_config",
    "config_hash",
    "config_diff",
    "capture_rng_state",
    "restore_rng_state",
]

FORMAT = "rlfunc.dcp-checkpoint"
FORMAT_VERSION = 1
MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_STALE_DIR = re.compile(r"^step_\d+\.(tmp|old|deleting)-[0-9a-f]+$")
_STATE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_TENSOR_TAG = "__tensor__"


# ---------------------------------------------------------------------------------------------- errors


class CheckpointError(RuntimeError):
    """Base class of every checkpoint error raised here."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint path does not exist (or is not a directory)."""


class CheckpointCorruptError(CheckpointError):
    """The directory is not a complete checkpoint (no COMPLETE marker, no DCP metadata, bad JSON)."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint does not fit what it is loaded into (other model, other config, missing state)."""


# -------------------------------------------------------------------------------------------- configs


def _json_value(value: Any) -> Any:
    """A JSON-safe version of a config value (tuples -> lists, dtypes / paths / enums -> strings)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if attrs.has(type(value)):
        return {f.name: _json_value(getattr(value, f.name)) for f in attrs.fields(type(value))}
    if isinstance(value, Mapping):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if hasattr(value, "value") and type(value).__module__ == "enum":  # pragma: no cover - rare
        return _json_value(value.value)
    return str(value)


def flatten_config(config: Mapping[str, Any] | Any | None) -> dict[str, Any]:
    """Flatten a config (nested dicts and attrs objects) to ``{"dotted.key": json_value}``.

    ``flatten_config({"actor": OptimConfig(lr=1e-5)})["actor.lr"] == 1e-5``. Lists and tuples are
    leaves (as JSON lists).
    """
    if config is None:
        return {}
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if attrs.has(type(value)):
            value = {f.name: getattr(value, f.name) for f in attrs.fields(type(value))}
        if isinstance(value, Mapping):
            if not value and prefix:
                out[prefix] = {}
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
            return
        out[prefix] = _json_value(value)

    if not (isinstance(config, Mapping) or attrs.has(type(config))):
        raise TypeError(f"config must be a mapping or an attrs object, got {type(config).__name__}")
    walk("", config)
    return out


def config_hash(flat_config: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of a flattened config."""
    return hashlib.sha256(json.dumps(dict(flat_config), sort_keys=True).encode()).hexdigest()


def config_diff(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """One line per key whose value differs: ``key: checkpoint <saved>, now <current>``."""
    missing = object()
    lines = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, missing), current.get(key, missing)
        if a != b:
            fa = "<not set>" if a is missing else json.dumps(a)
            fb = "<not set>" if b is missing else json.dumps(b)
            lines.append(f"{key}: checkpoint {fa}, now {fb}")
    return lines


# ------------------------------------------------------------------------------------- fingerprints


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _fingerprint_of(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    params = [
        [name, list(value.shape), _dtype_name(value.dtype)]
        for name, value in state_dict.items()
        if isinstance(value, Tensor)
    ]
    digest = hashlib.sha256(json.dumps([[n, s] for n, s, _ in sorted(params)]).encode()).hexdigest()
    return {"sha256": digest, "params": params}


def model_fingerprint(module: torch.nn.Module) -> dict[str, Any]:
    """``{"sha256", "params": [[name, global_shape, dtype], ...], "model_type"}`` of a (sharded) model.

    The hash covers names and global shapes (not dtypes, not values): two checkpoints of the same
    architecture have the same fingerprint.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    fp = _fingerprint_of(get_model_state_dict(module))
    fp["model_type"] = getattr(getattr(module, "config", None), "model_type", None)
    return fp


#: HF config entries that do not change the model's function (runtime switches, bookkeeping)
_VOLATILE_CONFIG_KEYS = frozenset({
    "use_cache", "dtype", "torch_dtype", "transformers_version", "_name_or_path", "architectures",
    "attn_implementation", "_attn_implementation", "_attn_implementation_autoset", "_commit_hash",
    "output_attentions", "output_hidden_states", "return_dict", "gradient_checkpointing",
})


def _model_config(module: torch.nn.Module) -> dict[str, Any] | None:
    """The module's HF config as JSON, without runtime switches (compared on load: a warning if it differs)."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    return {k: _json_value(v) for k, v in sorted(config.to_dict().items()) if k not in _VOLATILE_CONFIG_KEYS}


def _fingerprint_diff(saved: list, current: list, limit: int = 6) -> list[str]:
    a = {n: s for n, s, _ in saved}
    b = {n: s for n, s, _ in current}
    lines = []
    missing = sorted(set(a) - set(b))
    unexpected = sorted(set(b) - set(a))
    shapes = sorted(n for n in set(a) & set(b) if list(a[n]) != list(b[n]))
    if missing:
        lines.append(f"{len(missing)} parameter(s) in the checkpoint but not in the model: {', '.join(missing[:limit])}"
                     + (" ..." if len(missing) > limit else ""))
    if unexpected:
        lines.append(f"{len(unexpected)} parameter(s) in the model but not in the checkpoint: {', '.join(unexpected[:limit])}"
                     + (" ..." if len(unexpected) > limit else ""))
    for n in shapes[:limit]:
        lines.append(f"shape of {n}: checkpoint {tuple(a[n])}, model {tuple(b[n])}")
    if len(shapes) > limit:
        lines.append(f"... and {len(shapes) - limit} more shape mismatches")
    return lines


# --------------------------------------------------------------------------------------- extra tree


def _split_extra(extra: Any) -> tuple[Any, dict[str, Tensor]]:
    """Replace tensor leaves with ``{"__tensor__": key}``; return (JSON skeleton, {key: tensor})."""
    tensors: dict[str, Tensor] = {}

    def walk(value: Any, where: str) -> Any:
        if isinstance(value, Tensor):
            if type(value) is not Tensor and not isinstance(value, torch.nn.Parameter):
                raise TypeError(f"extra{where} is a {type(value).__name__}; only plain tensors can go in extra")
            key = f"t{len(tensors)}"
            tensors[key] = value.detach().cpu().clone()
            return {_TENSOR_TAG: key}
        if isinstance(value, Mapping):
            out = {}
            for k, v in value.items():
                if not isinstance(k, str):
                    raise TypeError(f"extra{where} has a {type(k).__name__} key {k!r}; keys must be str (JSON)")
                if k == _TENSOR_TAG:
                    raise ValueError(f"extra{where} uses the reserved key {_TENSOR_TAG!r}")
                out[k] = walk(v, f"{where}[{k!r}]")
            return out
        if isinstance(value, (list, tuple)):
            return [walk(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            return float(value)
        if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():
            return value.item()
        raise TypeError(
            f"extra{where} is a {type(value).__name__}; extra holds dicts, lists, None, bool, int, float, str "
            "and torch tensors (convert arrays to tensors)"
        )

    skeleton = walk({} if extra is None else extra, "")
    return skeleton, tensors


def _join_extra(skeleton: Any, tensors: Mapping[str, Tensor]) -> Any:
    if isinstance(skeleton, dict):
        if set(skeleton) == {_TENSOR_TAG}:
            return tensors[skeleton[_TENSOR_TAG]]
        return {k: _join_extra(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [_join_extra(v, tensors) for v in skeleton]
    return skeleton


# --------------------------------------------------------------------------------------------- RNG


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


def _rng_file(root: Path, rank: int) -> Path:
    return root / "rng" / f"rank_{rank}.safetensors"


def _write_rng(root: Path, rank: int) -> None:
    from safetensors.torch import save_file

    tensors, meta = capture_rng_state()
    path = _rng_file(root, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"rng": json.dumps(meta)})


def _read_rng(root: Path, rank: int) -> tuple[dict[str, Tensor], dict[str, Any]] | None:
    from safetensors import safe_open

    path = _rng_file(root, rank)
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {})["rng"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return tensors, meta


# ------------------------------------------------------------------------------------ safe DCP reads


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` index: DCP metadata classes, ``torch.Size``, dtypes, paths only."""

    _ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if (module, name) in self._ALLOWED:
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
                return getattr(torch, name)
            if module.startswith("torch.distributed.checkpoint."):
                obj = super().find_class(module, name)
                if isinstance(obj, type) and obj.__module__.startswith("torch.distributed.checkpoint."):
                    return obj
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a checkpoint's DCP metadata")


def _safe_reader(path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(str(path))


def _tensor_only_planner() -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class TensorOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            raise CheckpointCorruptError(
                f"checkpoint item {read_item.dest_index.fqn!r} is a pickled object, not a tensor; refusing to unpickle it"
            )

    return TensorOnlyLoadPlanner()


# -------------------------------------------------------------------------------- process coordination


_GLOO_GROUPS: dict[int, Any] = {}


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gloo_group() -> Any:
    """A gloo group over all ranks for our small CPU collectives and async DCP saves (created once)."""
    key = id(dist.distributed_c10d._get_default_group())
    if key not in _GLOO_GROUPS:
        _GLOO_GROUPS[key] = dist.new_group(backend="gloo")
    return _GLOO_GROUPS[key]


def _barrier() -> None:
    if _world()[1] > 1:
        dist.barrier(group=_gloo_group())


def _broadcast_hex(value: str) -> str:
    """Rank 0's 32-hex-digit string on every rank (sent as bytes in a tensor: no pickling)."""
    if _world()[1] == 1:
        return value
    buf = torch.tensor(list(bytes.fromhex(value)) if value else [0] * 16, dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=_gloo_group())
    return bytes(buf.tolist()).hex()


def _all_ok(ok: bool) -> bool:
    if _world()[1] == 1:
        return ok
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
    dist.all_reduce(flag, group=_gloo_group())
    return int(flag) == 0


def _all_state_meta(state_meta: dict[str, Any]) -> dict[str, Any]:
    """Every rank's ``{state name: metadata}`` merged, in rank order (a state held by several ranks is
    described alike by each). Under split placement a rank holds only its pool's states, and rank 0
    writes the marker for all of them."""
    world = _world()[1]
    if world == 1:
        return state_meta
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, json.dumps(state_meta), group=_gloo_group())
    merged: dict[str, Any] = {}
    for text in gathered:
        for name, meta in json.loads(text).items():
            merged.setdefault(name, meta)
    return merged


@contextlib.contextmanager
def _quiet_no_dist() -> Iterator[None]:
    """Silence DCP's "assuming the intent is to save in a single process" (that is the intent here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _remove_dir(path: Path) -> None:
    """Rename out of the ``step_<N>`` namespace (atomic), then delete."""
    doomed = path.with_name(f"{path.name}.deleting-{uuid.uuid4().hex}")
    try:
        os.replace(path, doomed)
    except FileNotFoundError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


# ------------------------------------------------------------------------------------------ listing


@attrs.frozen
class CheckpointInfo:
    """What a complete checkpoint's ``COMPLETE`` marker says."""

    path: Path
    step: int
    world_size: int
    state_names: tuple[str, ...]
    config: dict = attrs.field(eq=False)
    config_hash: str
    marker: dict = attrs.field(eq=False, repr=False)


def _step_of(path: Path) -> int | None:
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def list_checkpoints(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints (``step_<N>`` dirs holding ``COMPLETE``) under ``ckpt_dir``, oldest first."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        step = _step_of(entry)
        if step is not None and entry.is_dir() and (entry / MARKER).is_file():
            found.append((step, entry))
    return [p for _, p in sorted(found)]


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``ckpt_dir``, or None (no dir, or nothing complete)."""
    found = list_checkpoints(ckpt_dir)
    return found[-1] if found else None


def checkpoint_info(path: str | os.PathLike) -> CheckpointInfo:
    """Validate a checkpoint dir's files and read its marker; clear errors for a missing / corrupt one."""
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"checkpoint {str(path)!r} does not exist")
    if not path.is_dir():
        raise CheckpointNotFoundError(f"checkpoint {str(path)!r} is not a directory")
    marker_file = path / MARKER
    if not marker_file.is_file():
        if list_checkpoints(path):
            raise CheckpointCorruptError(
                f"{str(path)!r} is a checkpoint root, not a checkpoint: pass one of its step_<N> dirs "
                f"(newest: {latest_checkpoint(path).name}) or resume='auto'"
            )
        raise CheckpointCorruptError(
            f"{str(path)!r} is not a complete checkpoint: it has no {MARKER} marker (the save was interrupted, "
            "or this is not a checkpoint dir)"
        )
    try:
        marker = json.loads(marker_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"{str(marker_file)!r} is not valid JSON: {e}") from None
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{str(marker_file)!r} is not an rlfunc checkpoint marker (format {FORMAT!r})")
    if marker.get("version") != FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"{str(path)!r} has checkpoint format version {marker.get('version')}; this code reads version {FORMAT_VERSION}"
        )
    if not (path / ".metadata").is_file():
        raise CheckpointCorruptError(f"{str(path)!r} has a {MARKER} marker but no DCP .metadata file: the checkpoint is damaged")
    return CheckpointInfo(
        path=path,
        step=int(marker["step"]),
        world_size=int(marker["world_size"]),
        state_names=tuple(marker["states"]),
        config=marker.get("config", {}),
        config_hash=marker.get("config_hash", ""),
        marker=marker,
    )


def resolve_resume(resume: str | os.PathLike | bool | None, ckpt_dir: str | os.PathLike | None = None) -> Path | None:
    """Which checkpoint to resume from.

    - ``"auto"`` (or True): the newest complete checkpoint under ``ckpt_dir``; None (start fresh) if there
      is none;
    - ``None`` / False / ``""`` / ``"never"`` / ``"none"`` / ``"off"``: None;
    - a path: that checkpoint (validated: a clear error if it is missing or incomplete).
    """
    if resume is None or resume is False or (isinstance(resume, str) and resume.lower() in ("", "never", "none", "off", "false")):
        return None
    if resume is True or (isinstance(resume, str) and resume.lower() == "auto"):
        if ckpt_dir is None:
            raise ValueError("resume='auto' needs the checkpoint directory (ckpt_dir)")
        wait_for_pending_save()
        return latest_checkpoint(ckpt_dir)
    return checkpoint_info(resume).path


# ----------------------------------------------------------------------------- state dicts of states


def _check_states(states: Mapping[str, Any]) -> None:
    if not isinstance(states, Mapping) or not states:
        raise ValueError("states must be a non-empty dict of {name: train state}")
    for name, state in states.items():
        if not isinstance(name, str) or not _STATE_NAME.match(name):
            raise ValueError(f"state name {name!r} must be a non-empty str of letters, digits, '_', '.', '-'")
        if not isinstance(getattr(state, "module", None), torch.nn.Module):
            raise TypeError(f"states[{name!r}] has no .module (an nn.Module); got {type(state).__name__}")


def _optimizer_status(state: Any) -> str:
    opt = getattr(state, "optimizer", None)
    if opt is None:
        return "none"
    return "saved" if len(opt.state) > 0 else "empty"


def _state_dicts(state: Any, with_optimizer: bool) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    optimizers = [state.optimizer] if with_optimizer else []
    msd, osd = get_state_dict(state.module, optimizers, options=options)
    return msd, (osd if with_optimizer else {})


def _restore_type(loaded: Any, template: Any) -> Any:
    if isinstance(template, tuple) and isinstance(loaded, list):
        return tuple(loaded)
    return loaded




# --------------------------------------------------------------------------------------------- save


@attrs.define
class PendingCheckpoint:
    """An async save in flight. ``wait()`` (on every rank) returns the final ``step_<N>`` path."""

    path: Path
    _future: Any
    _tmp: Path
    _marker: dict
    _keep_last: int | None
    _finalized: threading.Event = attrs.field(factory=threading.Event)
    _error: BaseException | None = None
    _waited: bool = False

    def _on_done(self, future: Any) -> None:  # rank 0, in the writer thread
        try:
            if future.exception() is None:
                _finalize(self._tmp, self.path, self._marker, self._keep_last)
        except BaseException as e:  # noqa: BLE001 - reported by wait()
            self._error = e
        finally:
            self._finalized.set()

    def done(self) -> bool:
        """True once this rank's write finished (and, on rank 0, the rename happened)."""
        return self._future.done() and (_world()[0] != 0 or self._finalized.is_set())

    def wait(self) -> Path:
        global _PENDING
        if self._waited:
            return self.path
        self._waited = True
        if _PENDING is self:
            _PENDING = None
        self._future.result()  # re-raises a failed write
        if _world()[0] == 0:
            self._finalized.wait()
            if self._error is not None:
                raise CheckpointError(f"finalising checkpoint {str(self.path)!r} failed: {self._error}") from self._error
        _barrier()
        return self.path


_PENDING: PendingCheckpoint | None = None


def wait_for_pending_save() -> Path | None:
    """Wait for this process's in-flight async save, if any (call on every rank). Returns its path."""
    pending = _PENDING
    return pending.wait() if pending is not None else None


def _finalize(tmp: Path, final: Path, marker: dict, keep_last: int | None) -> None:
    """Rank 0: write COMPLETE into the temp dir, rename it into place, apply retention."""
    _write_json_atomic(tmp / MARKER, marker)
    _fsync_dir(tmp)
    if final.exists():  # re-saving a step (e.g. after resuming from an older checkpoint)
        aside = final.with_name(f"{final.name}.old-{uuid.uuid4().hex}")
        os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)
    if keep_last is not None:
        for old in list_checkpoints(final.parent)[:-keep_last]:
            _remove_dir(old)


def _clean_stale(root: Path) -> None:
    for entry in root.iterdir():
        if _STALE_DIR.match(entry.name) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


def save_checkpoint(
    ckpt_dir: str | os.PathLike,
    step: int,
    states: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
    *,
    keep_last: int | None = None,
    config: Mapping[str, Any] | Any | None = None,
    async_save: bool = False,
    save_rng: bool = True,
) -> Path | PendingCheckpoint:
    """Save ``states`` (model + optimizer, sharded), ``extra`` and every rank's RNG as ``ckpt_dir/step_<step>``.

    Call on every rank, each with the states it holds: all of them, or under split placement its pool's
    roles (the checkpoint then holds every pool's, and each rank loads its own). ``extra`` must be the
    same on every rank. Returns the checkpoint path (all ranks, after the rename), or with
    ``async_save=True`` a :class:`PendingCheckpoint` whose ``wait()`` returns it. ``keep_last``: keep
    only the newest K complete checkpoints (None: keep all). ``config``: the settings a resume must
    match (see :func:`load_checkpoint`). Any earlier async save is waited for first; leftover temp dirs
    of crashed saves are removed.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be None (keep all) or an int >= 1, got {keep_last!r}")
    _check_states(states)
    skeleton, extra_tensors = _split_extra(extra)
    flat_config = flatten_config(config)
    wait_for_pending_save()

    rank, world = _world()
    root = Path(ckpt_dir)
    final = root / f"step_{step}"
    token = ""
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        _clean_stale(root)
        token = uuid.uuid4().hex
        (root / f"step_{step}.tmp-{token}").mkdir()
    token = _broadcast_hex(token)
    tmp = root / f"step_{step}.tmp-{token}"
    if not _all_ok(tmp.is_dir()):
        raise CheckpointError(
            f"the temp dir {str(tmp)!r} made by rank 0 is not visible on every rank: {str(root)!r} must be on a "
            "filesystem shared by all ranks"
        )

    flat: dict[str, Tensor] = {}
    state_meta: dict[str, Any] = {}
    for name, state in states.items():
        reshard(state.module)
        status = _optimizer_status(state)
        msd, osd = _state_dicts(state, with_optimizer=status == "saved")
        optim_json = {}
        for k, v in msd.items():
            if v is None:  # an empty extra state (megatron's ``_extra_state`` without TransformerEngine)
                continue
            if not isinstance(v, Tensor):
                raise TypeError(f"model state of {name!r} has a non-tensor entry {k!r} ({type(v).__name__})")
            flat[f"{name}/model/{k}"] = v
        for k, v in osd.items():
            if isinstance(v, Tensor):
                flat[f"{name}/optim/{k}"] = v
            else:
                optim_json[k] = _json_value(v)
        fp = _fingerprint_of(msd)
        state_meta[name] = {
            "step": int(getattr(state, "step", 0)),
            "fingerprint": fp["sha256"],
            "params": fp["params"],
            "model_type": getattr(getattr(state.module, "config", None), "model_type", None),
            "model_config": _model_config(state.module),
            "optimizer": status,
            "optimizer_class": None if status == "none" else type(state.optimizer).__name__,
            "optimizer_values": optim_json,
        }
    for key, tensor in extra_tensors.items():
        flat[f"extra/{key}"] = tensor
    state_meta = _all_state_meta(state_meta)

    marker = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": step,
        "world_size": world,
        "created_unix": time.time(),
        "states": state_meta,
        "config": flat_config,
        "config_hash": config_hash(flat_config),
        "extra": skeleton,
        "rng_saved": bool(save_rng),
        "torch_version": torch.__version__,
    }

    if save_rng:
        _write_rng(tmp, rank)

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    writer = FileSystemWriter(str(tmp))
    if async_save:
        global _PENDING
        group = _gloo_group() if dist.is_initialized() else None
        with _quiet_no_dist():
            future = dcp.async_save(flat, storage_writer=writer, process_group=group, no_dist=group is None)
        future = getattr(future, "upload_completion", future)  # AsyncSaveResponse on newer torch
        pending = PendingCheckpoint(final, future, tmp, marker, keep_last)
        if rank == 0:
            future.add_done_callback(pending._on_done)
        _PENDING = pending
        return pending

    with _quiet_no_dist():
        dcp.save(flat, storage_writer=writer, no_dist=not dist.is_initialized())
    _barrier()  # every rank's shard and RNG file is on disk
    if rank == 0:
        _finalize(tmp, final, marker, keep_last)
    _barrier()  # the renamed checkpoint is visible to everyone
    return final


# --------------------------------------------------------------------------------------------- load


def _validate_against(info: CheckpointInfo, states: Mapping[str, Any], config: Any | None, fingerprints: dict[str, dict]) -> None:
    marker = info.marker
    saved_states = marker["states"]
    missing = [n for n in states if n not in saved_states]
    if missing:
        raise CheckpointMismatchError(
            f"checkpoint {str(info.path)!r} has no state named {', '.join(map(repr, missing))}; "
            f"it holds: {', '.join(map(repr, saved_states))}"
        )
    for name, state in states.items():
        saved = saved_states[name]
        current = fingerprints[name]
        if saved["fingerprint"] != current["sha256"]:
            details = _fingerprint_diff(saved["params"], current["params"])
            raise CheckpointMismatchError(
                f"checkpoint {str(info.path)!r} state {name!r} is of another model "
                f"(saved model_type {saved.get('model_type')!r}, fingerprint {saved['fingerprint'][:12]}; "
                f"this model: {current['sha256'][:12]}):\n  " + "\n  ".join(details)
            )
        saved_cfg, current_cfg = saved.get("model_config"), _model_config(state.module)
        if saved_cfg is not None and current_cfg is not None and saved_cfg != current_cfg:
            diff = config_diff(saved_cfg, current_cfg)
            warnings.warn(
                f"checkpoint {str(info.path)!r} state {name!r}: same parameter names and shapes, but the model "
                f"config differs in {len(diff)} key(s):\n  " + "\n  ".join(diff),
                stacklevel=3,
            )
        if getattr(state, "optimizer", None) is not None:
            if saved["optimizer"] == "none":
                raise CheckpointMismatchError(
                    f"checkpoint {str(info.path)!r} state {name!r} has no optimizer state, but the state being "
                    "restored has an optimizer"
                )
            if saved["optimizer_class"] != type(state.optimizer).__name__:
                raise CheckpointMismatchError(
                    f"checkpoint {str(info.path)!r} state {name!r} was saved with optimizer {saved['optimizer_class']}, "
                    f"the state being restored uses {type(state.optimizer).__name__}"
                )
    if config is not None:
        diff = config_diff(info.config, flatten_config(config))
        if diff:
            raise CheckpointMismatchError(
                f"checkpoint {str(info.path)!r} was written with a different config ({len(diff)} key(s) differ):\n  "
                + "\n  ".join(diff)
            )


def load_checkpoint(
    path: str | os.PathLike,
    states: Mapping[str, Any],
    *,
    config: Mapping[str, Any] | Any | None = None,
    restore_rng: bool = True,
) -> tuple[dict[str, Any], Any]:
    """Load a checkpoint into ``states`` (in place) and return ``(new_states, extra)``.

    Call on every rank. ``new_states[name]`` is ``states[name].replace(step=saved_step)``. ``extra`` is
    the tree given to :func:`save_checkpoint` (tensors on the CPU). Before anything is loaded, raises
    :class:`CheckpointNotFoundError` (missing path), :class:`CheckpointCorruptError` (incomplete or
    damaged dir) or :class:`CheckpointMismatchError` (a state not in the checkpoint, a different model:
    parameter names / shapes, a different optimizer class, or, when ``config`` is given, any differing
    config key, each named). Same parameter names and shapes under a different HF model config (say
    ``rope_theta``) loads, with a warning naming the keys. Resharding to another world size is handled
    by DCP. A state that has no optimizer (a reference) loads only the model.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_state_dict

    _check_states(states)
    wait_for_pending_save()
    info = checkpoint_info(path)
    marker = info.marker
    saved_states = marker["states"]

    # Fingerprints from the model alone: nothing is initialised or changed until validation passed.
    model_sds = {}
    for name, state in states.items():
        reshard(state.module)
        model_sds[name] = get_model_state_dict(state.module)
    fingerprints = {name: _fingerprint_of(sd) for name, sd in model_sds.items()}
    _validate_against(info, states, config, fingerprints)

    reader = _safe_reader(info.path)
    try:
        metadata = reader.read_metadata()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
        raise CheckpointCorruptError(f"cannot read the DCP metadata of {str(info.path)!r}: {e}") from None
    available = metadata.state_dict_metadata

    flat: dict[str, Tensor] = {}
    plans: dict[str, tuple[dict, dict]] = {}
    for name, state in states.items():
        load_optim = getattr(state, "optimizer", None) is not None and saved_states[name]["optimizer"] == "saved"
        if load_optim:
            msd, osd = _state_dicts(state, with_optimizer=True)
        else:
            msd, osd = model_sds[name], {}
        for k, v in msd.items():
            if v is not None:  # empty extra states were not saved, and stay empty
                flat[f"{name}/model/{k}"] = v
        saved_values = saved_states[name]["optimizer_values"]
        for k, v in osd.items():
            if isinstance(v, Tensor):
                flat[f"{name}/optim/{k}"] = v
            elif k not in saved_values:
                raise CheckpointMismatchError(f"checkpoint state {name!r} has no optimizer entry {k!r}")
            else:
                osd[k] = _restore_type(saved_values[k], v)
        plans[name] = (msd, osd)

    extra_tensors: dict[str, Tensor] = {}
    for key in available:
        if key.startswith("extra/"):
            md = available[key]
            if isinstance(md, BytesStorageMetadata):
                raise CheckpointCorruptError(f"checkpoint item {key!r} is not a tensor")
            extra_tensors[key[len("extra/"):]] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            flat[key] = extra_tensors[key[len("extra/"):]]
    absent = [k for k in flat if k not in available]
    if absent:
        raise CheckpointCorruptError(
            f"checkpoint {str(info.path)!r} lacks {len(absent)} tensor(s) its marker promises, e.g. {absent[:3]}"
        )

    with _quiet_no_dist():
        dcp.load(flat, storage_reader=reader, planner=_tensor_only_planner(), no_dist=not dist.is_initialized())

    new_states: dict[str, Any] = {}
    for name, state in states.items():
        msd, osd = plans[name]
        optimizers = [state.optimizer] if osd else []
        set_state_dict(
            state.module, optimizers, model_state_dict=msd, optim_state_dict=osd if osd else {},
            options=StateDictOptions(flatten_optimizer_state_dict=True),
        )
        if getattr(state, "optimizer", None) is not None and saved_states[name]["optimizer"] == "empty":
            state.optimizer.state.clear()  # never stepped when saved: restore that, not a zero-step state
        saved_step = int(saved_states[name]["step"])
        if hasattr(state, "replace"):
            new_states[name] = state.replace(step=saved_step)
        elif attrs.has(type(state)):
            new_states[name] = attrs.evolve(state, step=saved_step)
        else:
            state.step = saved_step
            new_states[name] = state

    if restore_rng and marker.get("rng_saved", False):
        rank = _world()[0]
        rng = _read_rng(info.path, rank)
        if rng is None:
            warnings.warn(
                f"checkpoint {str(info.path)!r} has no RNG state for rank {rank} (saved by {info.world_size} ranks); "
                "this rank keeps its current RNG, so the run is not an exact continuation",
                stacklevel=2,
            )
        else:
            restore_rng_state(*rng)
    _barrier()
    return new_states, _join_extra(marker["extra"], extra_tensors)
