"""Sharded (FSDP2 / DTensor) module state: gathering full weights, freeing gathered parameters."""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

__all__ = ["full_state_dict", "reshard"]


def reshard(module: nn.Module) -> None:
    """Free gathered (unsharded) FSDP2 parameters: after forward-only passes (no backward reshards them),
    and before reading or writing the sharded parameters (checkpoints)."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def full_state_dict(
    state: Any, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None
) -> Iterator[tuple[str, Tensor]]:
    """Stream ``(hf_name, full_tensor)`` of ``state.module`` (or of a bare module) one at a time, in
    ``module.state_dict()`` order.

    Each sharded tensor is gathered with ``DTensor.full_tensor()`` (a collective: every rank must
    consume the whole iterator, in step). Tied weights appear under every name the HF model has
    (``model.embed_tokens.weight`` and ``lm_head.weight``), gathered once. ``dtype`` / ``device``
    convert each tensor (e.g. ``torch.bfloat16`` for a bf16 rollout engine); default: as stored.
    """
    module = getattr(state, "module", state)
    sd = module.state_dict()
    # Tied weights: one Parameter under several names. FSDP2's state_dict wraps each name in its own
    # DTensor, so ties are found through the module's parameters, not the state dict's values.
    canonical: dict[int, str] = {}
    tied_to = {
        name: canonical.setdefault(id(param), name)
        for name, param in module.named_parameters(remove_duplicate=False)
    }
    counts: dict[str, int] = {}
    for name in sd:
        key = tied_to.get(name, name)
        counts[key] = counts.get(key, 0) + 1
    cache: dict[str, Tensor] = {}
    for name, value in sd.items():
        key = tied_to.get(name, name)
        if key in cache:
            full = cache[key]
        else:
            full = value.full_tensor() if isinstance(value, DTensor) else value
            full = full.detach()
            if dtype is not None or device is not None:
                full = full.to(dtype=dtype or full.dtype, device=device or full.device)
            if counts[key] > 1:
                cache[key] = full
        yield name, full
