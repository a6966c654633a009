"""Checked weight streams for the rollout engines' ``sync_weights``: what a sync may apply, and when.

A sync receives full tensors with Hugging Face names, one at a time (a generator of gathered FSDP tensors,
bucketed). Each tensor is checked against the engine's own tensor of that name (or a meta tensor of its
shape and dtype) before it is applied: a known name, the same shape, a floating tensor for a floating
parameter, no NaN or Inf. The engines differ in what they can undo:

- the native engine saves each parameter's previous value just before overwriting it and puts them back
  on any failure (see :func:`backends.rollout.native.sync_weights`);
- vLLM's loaders cannot be undone, so :func:`staged_weights` receives and checks the whole set before the
  first load (one host copy of the weights), :func:`bucketed_weights` checks each bucket of tensors before any
  of it reaches the loader (no host copy; at most one bucket held on the device), and :func:`streamed_weights`
  checks each tensor as it passes into the loader (no copy; NaN / Inf found only after the last). A failure
  part-way through the last two leaves a mix, which the engine then refuses to generate with until a sync
  succeeds. ``rollout.vllm.sync_staging`` chooses.
"""

from __future__ import annotations

import difflib
from typing import Iterable, Iterator

import torch
from torch import Tensor

__all__ = [
    "CHECK_BUCKET_BYTES",
    "check_sync_tensor",
    "missing_targets",
    "staged_weights",
    "bucketed_weights",
    "streamed_weights",
]

#: :func:`bucketed_weights`: bytes of tensors held (where the producer made them) for one NaN / Inf check
CHECK_BUCKET_BYTES = 512 * 2**20


def check_sync_tensor(name: str, tensor: Tensor, targets: dict[str, Tensor], *, check_finite: bool = True) -> Tensor:
    """``tensor`` (gathered when a DTensor) once it may be copied into ``targets[name]`` (the engine's tensor, or
    a meta tensor of its shape and dtype); else an error naming it and the reason. ``check_finite=False``
    leaves the NaN / Inf check to the caller (one device sync per tensor is what it costs)."""
    target = targets.get(name)
    if target is None:
        close = difflib.get_close_matches(name, targets, n=3)
        hint = f"; did you mean {close}?" if close else ""
        raise KeyError(f"sync_weights: the rollout model has no parameter {name!r}{hint}")
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    if tuple(tensor.shape) != tuple(target.shape):
        raise ValueError(
            f"sync_weights: {name!r} has shape {tuple(tensor.shape)}, the rollout model expects {tuple(target.shape)}"
        )
    if target.is_floating_point():
        if not tensor.is_floating_point():
            raise TypeError(
                f"sync_weights: {name!r} has dtype {tensor.dtype}, the rollout model's parameter is {target.dtype}"
            )
        if check_finite and not bool(torch.isfinite(tensor).all()):
            raise ValueError(
                f"sync_weights: {name!r} holds NaN or Inf values; the rollout engine keeps its previous weights"
            )
    return tensor


def missing_targets(targets: dict[str, Tensor], received: set[int]) -> list[str]:
    """The names of ``targets`` whose tensor (by ``id``; tied names share one) was not received, sorted."""
    return sorted(n for n, t in targets.items() if id(t) not in received)


def staged_weights(
    named_tensors: Iterable[tuple[str, Tensor]], targets: dict[str, Tensor] | None, *, strict: bool
) -> list[tuple[str, Tensor]]:
    """Every ``(name, tensor)`` received and checked, device tensors copied to host memory (tied names share one
    copy): nothing is applied before the whole set has passed. ``targets`` None: names are checked by prefix."""
    staged, host = [], {}  # host: id(target) (or the name) -> its staged tensor
    for name, tensor in named_tensors:
        if not name.startswith(("model.", "lm_head.")):
            raise KeyError(f"sync_weights: {name!r} is not a Hugging Face parameter name of a causal LM")
        tensor = check_sync_tensor(name, tensor, targets) if targets is not None else tensor
        tensor = getattr(tensor, "full_tensor", lambda: tensor)().detach()
        key = id(targets[name]) if targets is not None else name
        if tensor.device.type != "cpu":
            tensor = host[key] if key in host else tensor.to("cpu")
        staged.append((name, host.setdefault(key, tensor)))
    missing = missing_targets(targets or {}, set(host))
    if strict and missing:
        raise ValueError(
            f"sync_weights: {len(missing)} parameters were not received, e.g. {missing[:5]}; the "
            "engine keeps its previous weights"
        )
    return staged


def streamed_weights(
    named_tensors: Iterable[tuple[str, Tensor]], targets: dict[str, Tensor] | None, *, strict: bool
) -> Iterator[tuple[str, Tensor]]:
    """``named_tensors`` checked as they pass (names, shapes, dtypes at once; NaN / Inf accumulated on the device
    and checked once, after the last tensor, like missing names): the loader sees each tensor once, with no
    copy, and an error raised from this iterator reaches it part-way through."""
    received: set[int] = set()
    finite: Tensor | None = None
    for name, tensor in named_tensors:
        tensor = _arrived(name, tensor, targets, received)
        if tensor.is_floating_point():
            ok = torch.isfinite(tensor).all()
            finite = ok if finite is None else finite & ok.to(finite.device)
        yield name, tensor
    if finite is not None and not bool(finite):
        raise ValueError("sync_weights: the weights hold NaN or Inf values")
    _check_complete(targets, received, strict)


def _arrived(name: str, tensor: Tensor, targets: dict[str, Tensor] | None, received: set[int]) -> Tensor:
    """``tensor`` gathered and detached once its name, shape and dtype fit ``targets`` (recorded in ``received``)."""
    if not name.startswith(("model.", "lm_head.")):
        raise KeyError(f"sync_weights: {name!r} is not a Hugging Face parameter name of a causal LM")
    if targets is not None:
        tensor = check_sync_tensor(name, tensor, targets, check_finite=False)
        received.add(id(targets[name]))
    return getattr(tensor, "full_tensor", lambda: tensor)().detach()


def _check_complete(targets: dict[str, Tensor] | None, received: set[int], strict: bool) -> None:
    missing = missing_targets(targets or {}, received)
    if strict and missing:
        raise ValueError(f"sync_weights: {len(missing)} parameters were not received, e.g. {missing[:5]}")


def bucketed_weights(
    named_tensors: Iterable[tuple[str, Tensor]],
    targets: dict[str, Tensor] | None,
    *,
    strict: bool,
    bucket_bytes: int = CHECK_BUCKET_BYTES,
) -> Iterator[tuple[str, Tensor]]:
    """``named_tensors`` checked in buckets of about ``bucket_bytes``: names, shapes and dtypes as each arrives,
    NaN / Inf once per bucket (one device sync) before any tensor of the bucket is yielded, missing names after
    the last. Nothing is copied: a bucket's tensors stay where the producer made them until the loader takes
    them. A bad tensor stops the stream before its bucket is loaded; the buckets before it are."""
    received: set[int] = set()
    pending: list[tuple[str, Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        tensor = _arrived(name, tensor, targets, received)
        pending.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield from _finite(pending)
            pending, size = [], 0
    yield from _finite(pending)
    _check_complete(targets, received, strict)


def _finite(bucket: list[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
    """``bucket`` once its floating tensors hold no NaN / Inf (one host sync per device), else an error naming one."""
    ok: dict[torch.device, Tensor] = {}
    for _, tensor in bucket:
        if tensor.is_floating_point():
            finite = torch.isfinite(tensor).all()
            ok[tensor.device] = finite if tensor.device not in ok else ok[tensor.device] & finite
    if all(bool(v) for v in ok.values()):
        return bucket
    bad = next(n for n, t in bucket if t.is_floating_point() and not bool(torch.isfinite(t).all()))
    raise ValueError(f"sync_weights: {bad!r} holds NaN or Inf values; it and the rest of the set were not loaded")
