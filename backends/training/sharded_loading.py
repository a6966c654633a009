"""Loading a Hugging Face checkpoint straight into FSDP2 shards: the model is built with its parameters on
the ``meta`` device, sharded, given empty storage on its device, and each local shard is filled from
the checkpoint's safetensors files, which only the first rank of the mesh reads.

Why: loading the whole model on every rank first (``from_pretrained`` per rank, then ``fully_shard``)
holds a whole copy per rank in host memory at once: for an fp32 actor from a bf16 checkpoint, 8 x 30 GB
for a 7B model on one node. Here the mesh's first rank holds its shards plus one full tensor at a time,
and every other rank its own shards plus at most one chunk in flight
(benchmarks/bench_loading_memory.py measures it).

The steps, in the order the FSDP engine runs them (:mod:`backends.training.fsdp`):

1. :func:`empty_causal_lm`: the model from its config under :func:`parameters_on_meta`; buffers
   computed in ``__init__`` (rotary ``inv_freq``), which no checkpoint stores, stay real;
2. :func:`checkpoint_plan`: which checkpoint tensor fills which parameter, checked against the
   checkpoint's headers on every rank (unknown or missing names and shape mismatches are errors that
   name them, raised on every rank alike before any collective);
3. the engine's own changes (packed attention, checkpointing) and ``fully_shard``;
4. :func:`materialize`: ``to_empty`` on the device (the CPU for offloaded shards), the real buffers
   put back on the device;
5. :func:`fill_shards`: per parameter, the first rank reads the tensor, casts it to the parameter's
   dtype into a reused staging buffer with dim 0 padded to a multiple of the mesh size, and scatters
   equal chunks over the mesh's own process group
   (FSDP2 shards dim 0 as ``torch.chunk`` does); a rank receives straight into its shard, or, where
   its shard is short of a whole chunk, into one chunk-sized buffer and copies its rows from there.

Tied parameters (``lm_head.weight`` is ``model.embed_tokens.weight``) are one parameter, filled once,
and stay tied. Persistent buffers are not read from the checkpoint (Llama and Qwen2 have none).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from backends.models import check_model_dir

__all__ = [
    "parameters_on_meta",
    "empty_causal_lm",
    "safetensors_files",
    "checkpoint_plan",
    "materialize",
    "fill_shards",
    "mesh_device",
]

_INDEX = "model.safetensors.index.json"
#: checkpoint names Hugging Face itself drops on load: old Llama checkpoints store each layer's
#: rotary ``inv_freq``, which models now compute in ``__init__``
_ALWAYS_IGNORED = (r"rotary_emb\.inv_freq$",)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside, every ``nn.Parameter`` a module registers is moved to the ``meta`` device (no storage);
    buffers stay where they were made. Like accelerate's ``init_empty_weights(include_buffers=False)``.

    A module's ``__init__`` still creates each parameter's tensor before it is registered, but that
    memory is never written (``torch.empty``), so it is not resident, and it is freed right away.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            kept = module._parameters[name]
            empty = type(kept)(kept.to("meta"), requires_grad=kept.requires_grad)
            empty.__dict__.update(kept.__dict__)  # attributes libraries set on a parameter (HF's init flags)
            module._parameters[name] = empty

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def safetensors_files(path: str | os.PathLike) -> dict[str, Path] | None:
    """``{tensor name: file}`` of a local HF dir's safetensors checkpoint (``model.safetensors.index.json``
    when the checkpoint is split, else the single ``*.safetensors`` file's header), or None when the dir
    holds no safetensors weights (a ``pytorch_model.bin`` checkpoint)."""
    path = Path(path)
    index = path / _INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{str(index)!r} has no weight_map: cannot tell which file holds which tensor")
        files = {name: path / file for name, file in weight_map.items()}
        absent = sorted({str(f) for f in files.values() if not f.is_file()})
        if absent:
            raise FileNotFoundError(f"{str(index)!r} names weight files that do not exist: {absent}")
        return files
    found = sorted(path.glob("*.safetensors"))
    if not found:
        return None
    if len(found) > 1:
        raise ValueError(
            f"{str(path)!r} holds {len(found)} safetensors files but no {_INDEX} saying which tensor is where"
        )
    with safe_open(found[0], framework="pt") as f:
        return {name: found[0] for name in f.keys()}


def empty_causal_lm(path: str | os.PathLike, dtype: torch.dtype, attn_implementation: str = "sdpa") -> nn.Module:
    """The causal LM of a local HF dir built from its config, parameters on ``meta`` in ``dtype``,
    buffers real, in eval mode (as :func:`backends.models.load_causal_lm` returns it, without weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    check_model_dir(Path(path))
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval()


def _ignored(model: nn.Module) -> re.Pattern:
    patterns = list(_ALWAYS_IGNORED) + list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    return re.compile("|".join(f"(?:{p})" for p in patterns))


def checkpoint_plan(model: nn.Module, files: dict[str, Path]) -> list[tuple[str, str, Path]]:
    """``(parameter name, checkpoint name, file)`` for every parameter of ``model``, in the model's order
    (the same on every rank), tied parameters once.

    A checkpoint may store a tied parameter under any of its names. Errors (each listing the names and
    the checkpoint dir): parameters the checkpoint lacks, checkpoint tensors the model has no place for
    (except the names Hugging Face ignores on load), and shape mismatches.
    """
    where = str(next(iter(files.values())).parent) if files else "the checkpoint"
    aliases: dict[int, list[str]] = {}
    params: dict[int, tuple[str, nn.Parameter]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
        params.setdefault(id(param), (name, param))
    known = {name for names in aliases.values() for name in names}
    ignored = _ignored(model)
    unknown = sorted(n for n in files if n not in known and not ignored.search(n))
    if unknown:
        raise ValueError(f"{where!r} holds tensors the {type(model).__name__} has no parameter for: {unknown}")
    plan, missing = [], []
    for key, (name, param) in params.items():
        stored = next((n for n in aliases[key] if n in files), None)
        if stored is None:
            missing.append(name)
        else:
            plan.append((name, stored, files[stored]))
    if missing:
        raise ValueError(f"{where!r} is missing the weights of {type(model).__name__} parameters {missing}")
    shapes = _stored_shapes(plan)
    by_name = dict(model.named_parameters())
    wrong = [
        f"{stored}: checkpoint {shapes[stored]}, model {tuple(by_name[name].shape)}"
        for name, stored, _ in plan
        if shapes[stored] != tuple(by_name[name].shape)
    ]
    if wrong:
        raise ValueError(f"{where!r} holds tensors of the wrong shape: {wrong}")
    return plan


def _stored_shapes(plan: list[tuple[str, str, Path]]) -> dict[str, tuple[int, ...]]:
    """The shapes of the plan's checkpoint tensors, from the files' headers (each file opened once)."""
    by_file: dict[Path, list[str]] = {}
    for _, stored, file in plan:
        by_file.setdefault(file, []).append(stored)
    shapes = {}
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in names})
    return shapes


def mesh_device(mesh: Any) -> torch.device:
    """The device a mesh's ranks compute on: the CPU, or the current device of the mesh's type (as FSDP2
    picks it: ``torch.cuda.current_device()``, which ``init_distributed`` sets to ``LOCAL_RANK``)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, getattr(torch, mesh.device_type).current_device())


def materialize(model: nn.Module, device: torch.device, *, params_device: torch.device | None = None) -> None:
    """Give a sharded meta-device model uninitialised parameter storage (``to_empty``) on ``params_device``
    (default ``device``; the CPU under FSDP2's CPU offload) and put its buffers back on ``device``:
    ``to_empty`` would leave them uninitialised too, and they hold values computed in ``__init__``, not
    read from the checkpoint."""
    owners = [
        (module, name, buf) for module in model.modules() for name, buf in module._buffers.items() if buf is not None
    ]
    model.to_empty(device=params_device if params_device is not None else device)
    for module, name, buf in owners:
        module._buffers[name] = buf.to(device)


def fill_shards(
    model: nn.Module, plan: list[tuple[str, str, Path]], mesh: Any, *, comm_device: torch.device | None = None
) -> None:
    """Fill the local shards of a materialised FSDP2 model from the checkpoint ``plan``.

    The mesh's first rank reads each tensor (one at a time), casts it to the parameter's dtype into one
    staging buffer sized for the largest (padded) tensor, and scatters its dim-0 chunks over
    ``mesh.get_group()``; the other ranks never hold a full tensor. Every rank of the mesh must call
    this with the same plan. ``comm_device``: where the chunks travel (the mesh's device by default; the
    process group's backend must take tensors there). Every rank sends and receives on that one device, also
    where its shards live elsewhere (FSDP2's CPU offload keeps them in host memory): under ``cpu:gloo,cuda:nccl``
    the device picks the backend of each collective, and a rank receiving a CPU shard over gloo while the first
    rank sends CUDA chunks over NCCL would wait forever. Such a rank receives into one chunk buffer on the
    device and copies its rows into the shard.
    """
    group = mesh.get_group()
    size = dist.get_world_size(group)
    first = dist.get_rank(group) == 0
    device = comm_device if comm_device is not None else mesh_device(mesh)
    params = dict(model.named_parameters())
    # one buffer reused for every tensor: fresh ones of varying sizes would fragment the host heap
    staging = _Staging(device) if first and size > 1 else None
    with torch.no_grad():
        for name, stored, file in plan:
            param = params[name]
            full = _read(file, stored) if first else None
            _scatter_rows(full, _local_shard(param, name), param, group, size, staging, device)


def _local_shard(param: nn.Parameter, name: str) -> Tensor:
    """The parameter's local rows (FSDP2 shards dim 0), or an error naming a layout this cannot fill."""
    if not isinstance(param, DTensor) or tuple(param.placements) != (Shard(0),):
        raise ValueError(
            f"cannot fill parameter {name!r}: expected an FSDP2 DTensor sharded on dim 0, got "
            f"{type(param).__name__} {getattr(param, 'placements', None)}"
        )
    return param.to_local()


def _scatter_rows(
    full: Tensor | None,
    local: Tensor,
    param: DTensor,
    group: Any,
    size: int,
    staging: _Staging | None,
    device: torch.device,
) -> None:
    """Scatter ``full`` (on the group's rank 0, which passes ``staging``; None elsewhere) as ``size``
    chunks of ``ceil(dim0 / size)`` rows, zero-padded at the end, into each rank's ``local`` rows; the
    chunks travel on ``device`` on every rank."""
    shape = tuple(param.shape)
    rows = math.ceil(shape[0] / size)
    rank = dist.get_rank(group)
    length = max(0, min(rows, shape[0] - rank * rows))
    if tuple(local.shape) != (length, *shape[1:]):
        raise AssertionError(f"FSDP2 local shard of shape {tuple(local.shape)}, expected {(length, *shape[1:])}")
    if size == 1:
        local.copy_(full)
        return
    chunks = list(staging.padded(full, param.dtype, rows * size).chunk(size)) if staging is not None else None
    if length == rows and local.is_contiguous() and local.device == device:
        dist.scatter(local, chunks, group=group, group_src=0)  # straight into the shard: no buffer
        return
    chunk = torch.empty((rows, *shape[1:]), dtype=param.dtype, device=device)
    dist.scatter(chunk, chunks, group=group, group_src=0)
    local.copy_(chunk[:length])


class _Staging:
    """The first rank's buffer for one full tensor at a time, cast and zero-padded along dim 0; it
    grows to the largest tensor and is reused."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffer: Tensor | None = None

    def padded(self, full: Tensor, dtype: torch.dtype, padded_rows: int) -> Tensor:
        shape = (padded_rows, *full.shape[1:])
        numel = math.prod(shape)
        if self._buffer is None or self._buffer.dtype != dtype or self._buffer.numel() < numel:
            self._buffer = None  # free the smaller one first
            self._buffer = torch.empty(numel, dtype=dtype, device=self.device)
        out = self._buffer[:numel].view(shape)
        out[: full.shape[0]].copy_(full)
        out[full.shape[0] :].zero_()
        return out


def _read(file: Path, name: str) -> Tensor:
    """One tensor of a safetensors file, as stored. The file is opened per tensor: its memory map
    counts in the process's resident memory for as long as the file stays open."""
    with safe_open(file, framework="pt") as f:
        return f.get_tensor(name)
