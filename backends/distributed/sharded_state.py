"""Sharded (FSDP2 / DTensor) module state: gathering full weights, freeing gathered parameters.

Full weights for a rollout engine travel in buckets: the local dim-0 shards of several parameters,
already cast to the rollout's dtype, are packed into one flat buffer and gathered with one
``all_gather_into_tensor`` over the parameters' own mesh group (in place, as FSDP2 gathers); the
full tensors are then cut out of the gathered buffer one at a time. That is one collective per bucket
instead of one per tensor, and a bf16 rollout moves half the bytes of the fp32 master weights.
"""

from __future__ import annotations

from typing import Any, Iterator, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

__all__ = ["DEFAULT_BUCKET_MB", "full_state_dict", "full_tensors", "lora_scaling", "merged_lora", "reshard"]

#: default size of a weight-sync bucket in MiB (verl's ``update_weights_bucket_megabytes``): large enough
#: that a model of a few billion parameters takes a handful of collectives, small enough that the one
#: bucket of gathered tensors alive at a time fits beside the training state
DEFAULT_BUCKET_MB = 512.0


def reshard(module: nn.Module) -> None:
    """Free gathered (unsharded) FSDP2 parameters: after forward-only passes (no backward reshards them),
    and before reading or writing the sharded parameters (checkpoints)."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def full_state_dict(
    state: Any,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    bucket_mb: float = DEFAULT_BUCKET_MB,
) -> Iterator[tuple[str, Tensor]]:
    """Stream ``(hf_name, full_tensor)`` of ``state.module`` (or of a bare module) one at a time, in
    ``module.state_dict()`` order.

    A collective: every rank of the module's mesh must consume the whole iterator, in step. Parameters
    sharded on dim 0 over a 1-D mesh (FSDP2) are gathered in buckets of at most ``bucket_mb`` MiB of
    gathered bytes (a tensor larger than that travels alone): each rank casts its local shards to
    ``dtype`` first, packs them into one flat buffer (each padded to ``torch.chunk``'s chunk size) and one
    ``all_gather_into_tensor`` over the mesh's process group fetches the bucket. About one bucket of full
    tensors is alive at a time. Plain tensors (an unsharded module, one rank) need no collective; other
    ``DTensor`` layouts are gathered one by one with ``full_tensor()``.

    A LoRA (peft) model streams its merged weights under the base model's names (:func:`merged_lora`).
    Tied weights appear under every name the HF model has (``model.embed_tokens.weight`` and
    ``lm_head.weight``), gathered once, as one tensor object. ``dtype`` (floating-point tensors only) /
    ``device`` convert each tensor (e.g. ``torch.bfloat16`` for a bf16 rollout engine); default: as
    stored. The result equals gathering each tensor and then converting it, bit for bit.
    """
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
    module = getattr(state, "module", state)
    stream = _full_tensors(module, dtype=dtype, device=device, bucket_bytes=int(bucket_mb * 2**20))
    if getattr(module, "peft_config", None) is not None:
        stream = merged_lora(stream, lora_scaling(module))
    yield from stream


def full_tensors(
    named: list[tuple[str, Tensor]], *, dtype: torch.dtype | None = None, bucket_mb: float = DEFAULT_BUCKET_MB
) -> Iterator[tuple[str, Tensor]]:
    """``(name, full tensor)`` of chosen state-dict entries, gathered in buckets as :func:`full_state_dict`
    gathers (a collective: every rank passes the same names in the same order), without its LoRA merging or
    tie handling; e.g. a LoRA adapter's factors alone."""
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
    return zip([n for n, _ in named], _gathered([t for _, t in named], dtype, int(bucket_mb * 2**20)))


def _full_tensors(
    module: nn.Module, *, dtype: torch.dtype | None, device: str | torch.device | None, bucket_bytes: int
) -> Iterator[tuple[str, Tensor]]:
    sd = module.state_dict()
    # Tied weights: one Parameter under several names. FSDP2's state_dict wraps each name in its own
    # DTensor, so ties are found through the module's parameters, not the state dict's values.
    canonical: dict[int, str] = {}
    tied_to = {
        name: canonical.setdefault(id(param), name) for name, param in module.named_parameters(remove_duplicate=False)
    }
    uses: dict[str, int] = {}
    first: dict[str, Tensor] = {}  # each distinct tensor once, in the order of its first name
    for name, value in sd.items():
        key = tied_to.get(name, name)
        uses[key] = uses.get(key, 0) + 1
        first.setdefault(key, value)
    gathered = zip(first, _gathered(list(first.values()), dtype, bucket_bytes))
    alive: dict[str, Tensor] = {}  # a tied tensor, until its last name has been yielded
    for name in sd:
        key = tied_to.get(name, name)
        if key not in alive:
            got, full = next(gathered)
            assert got == key, (got, key)
            if device is not None:
                full = full.to(device=device)
            alive[key] = full
        full = alive[key]
        uses[key] -= 1
        if uses[key] == 0:
            del alive[key]
        yield name, full


class _Shard(NamedTuple):
    """A parameter's place in a bucket: this rank's rows of it and how the full tensor is cut."""

    local: Tensor  #: this rank's rows (``torch.chunk``'s chunk of dim 0, unpadded)
    shape: torch.Size  #: the full tensor's shape
    chunk_rows: int  #: rows each rank holds in the flat buffer (the last ranks' parts are padded to it)
    mesh: Any  #: the 1-D DeviceMesh the tensor is sharded over

    @property
    def numel(self) -> int:
        """Elements per rank in the flat buffer, padding included."""
        return self.chunk_rows * self.shape[1:].numel()


def _dim0_shard(value: Tensor) -> _Shard | None:
    """``value`` as a dim-0 shard over a 1-D mesh of several ranks (FSDP2's layout); None otherwise."""
    if not isinstance(value, DTensor):
        return None
    mesh, placements = value.device_mesh, value.placements
    if mesh.ndim != 1 or mesh.size() == 1 or type(placements[0]) is not Shard or placements[0].dim != 0:
        return None
    local = value.to_local()
    rows, chunk = value.shape[0], -(-value.shape[0] // mesh.size())
    expected = min(chunk, max(0, rows - dist.get_rank(mesh.get_group()) * chunk))
    if local.shape[0] != expected:
        raise ValueError(f"a dim-0 shard of {rows} rows has {local.shape[0]} rows here, torch.chunk gives {expected}")
    return _Shard(local, value.shape, chunk, mesh)


def _gathered(values: list[Tensor], dtype: torch.dtype | None, bucket_bytes: int) -> Iterator[Tensor]:
    """The full tensor of each of ``values`` (cast to ``dtype`` if floating), in order; dim-0 shards are
    gathered in buckets of at most ``bucket_bytes`` gathered bytes (a larger one alone)."""
    bucket: list[_Shard] = []
    bucket_dtype, filled = None, 0
    for value in values:
        shard = _dim0_shard(value)
        target = dtype if dtype is not None and value.is_floating_point() else value.dtype
        nbytes = 0 if shard is None else shard.mesh.size() * shard.numel * target.itemsize
        if bucket and not (
            shard is not None
            and shard.mesh == bucket[0].mesh
            and shard.local.device == bucket[0].local.device
            and target == bucket_dtype
            and filled + nbytes <= bucket_bytes
        ):
            yield from _gather_bucket(bucket, bucket_dtype)
            bucket, filled = [], 0
        if shard is None:
            yield _full_alone(value, target)
            continue
        bucket.append(shard)
        bucket_dtype, filled = target, filled + nbytes
    if bucket:
        yield from _gather_bucket(bucket, bucket_dtype)


def _full_alone(value: Tensor, dtype: torch.dtype) -> Tensor:
    """A tensor that is not gathered in a bucket: plain, on a one-rank mesh, or another DTensor layout."""
    if isinstance(value, DTensor):
        value = value.to_local() if value.device_mesh.size() == 1 else value.full_tensor()
    return value.detach().to(dtype=dtype)


def _gather_bucket(bucket: list[_Shard], dtype: torch.dtype) -> Iterator[Tensor]:
    """One ``all_gather_into_tensor`` (``all_gather_single``) of the bucket's shards, cast to ``dtype``
    before they travel; then each full tensor in turn: a view of the gathered buffer when it is the
    bucket's only tensor, else a copy."""
    mesh = bucket[0].mesh
    world, group = mesh.size(), mesh.get_group()
    rank = dist.get_rank(group)
    per_rank = sum(s.numel for s in bucket)
    received = torch.empty(world * per_rank, dtype=dtype, device=bucket[0].local.device)
    # in place, as FSDP2's own all-gathers: this rank's section of the output is the input, so the bucket
    # needs no separate send buffer
    send = received[rank * per_rank : (rank + 1) * per_rank].zero_()
    offset = 0
    with torch.no_grad():
        for s in bucket:
            send[offset : offset + s.local.numel()].view(s.local.shape).copy_(s.local)
            offset += s.numel
    # all_gather_single is all_gather_into_tensor's name from torch 2.13 on (the old name warns there)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(received, send, group=group)
    by_rank = received.view(world, per_rank)  # group rank r sent the r-th chunks, as full_tensor() assumes
    offset = 0
    for s in bucket:
        rows = by_rank[:, offset : offset + s.numel].reshape(world * s.chunk_rows, *s.shape[1:])
        yield rows[: s.shape[0]]
        offset += s.numel


_PEFT_PREFIX = "base_model.model."


def lora_scaling(module: nn.Module) -> float:
    """The scale of a peft model's single adapter: ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA)."""
    configs = dict(module.peft_config)
    if len(configs) != 1:
        raise ValueError(f"merging needs exactly one LoRA adapter, the model has {sorted(configs)}")
    cfg = next(iter(configs.values()))
    return cfg.lora_alpha / (cfg.r**0.5 if getattr(cfg, "use_rslora", False) else cfg.r)


def merged_lora(named: Iterator[tuple[str, Tensor]], scaling: float) -> Iterator[tuple[str, Tensor]]:
    """peft's ``(name, tensor)`` stream as the base model's: ``W + scaling * B @ A`` under ``W``'s original name.

    peft names an adapted layer's weight ``<layer>.base_layer.weight`` and its factors
    ``<layer>.lora_A.<adapter>.weight`` (``r x in``) / ``<layer>.lora_B.<adapter>.weight`` (``out x r``);
    everything sits under ``base_model.model.``. A layer is emitted once its weight and both factors arrived.
    """
    pending: dict[str, dict[str, Tensor]] = {}
    for name, tensor in named:
        name = name[len(_PEFT_PREFIX) :] if name.startswith(_PEFT_PREFIX) else name
        for part, kind in ((".base_layer.", "W"), (".lora_A.", "A"), (".lora_B.", "B")):
            if part in name:
                layer, _, rest = name.partition(part)
                if kind == "W" and not rest.startswith("weight"):  # the base layer's bias: unchanged
                    yield f"{layer}.{rest}", tensor
                    break
                parts = pending.setdefault(layer, {})
                parts[kind] = tensor
                if len(parts) == 3:
                    w, a, b = pending.pop(layer)["W"], parts["A"], parts["B"]
                    delta = (b.float() @ a.float()) * scaling
                    yield f"{layer}.weight", (w.float() + delta).to(w.dtype)
                break
        else:
            yield name, tensor
    if pending:
        raise ValueError(f"LoRA layers without their base weight or both factors: {sorted(pending)[:3]}")
