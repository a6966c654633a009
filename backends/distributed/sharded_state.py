"""Sharded (FSDP2 / DTensor) module state: gathering full weights, freeing gathered parameters."""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

__all__ = ["full_state_dict", "lora_scaling", "merged_lora", "reshard"]


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
    consume the whole iterator, in step). A LoRA (peft) model streams its merged weights under the base
    model's names (:func:`merged_lora`). Tied weights appear under every name the HF model has
    (``model.embed_tokens.weight`` and ``lm_head.weight``), gathered once. ``dtype`` / ``device``
    convert each tensor (e.g. ``torch.bfloat16`` for a bf16 rollout engine); default: as stored.
    """
    module = getattr(state, "module", state)
    stream = _full_tensors(module, dtype=dtype, device=device)
    if getattr(module, "peft_config", None) is not None:
        stream = merged_lora(stream, lora_scaling(module))
    yield from stream


def _full_tensors(module: nn.Module, *, dtype: torch.dtype | None, device: str | torch.device | None) -> Iterator[tuple[str, Tensor]]:
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


_PEFT_PREFIX = "base_model.model."


def lora_scaling(module: nn.Module) -> float:
    """The scale of a peft model's single adapter: ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA)."""
    configs = dict(module.peft_config)
    if len(configs) != 1:
        raise ValueError(f"merging needs exactly one LoRA adapter, the model has {sorted(configs)}")
    cfg = next(iter(configs.values()))
    return cfg.lora_alpha / (cfg.r ** 0.5 if getattr(cfg, "use_rslora", False) else cfg.r)


def merged_lora(named: Iterator[tuple[str, Tensor]], scaling: float) -> Iterator[tuple[str, Tensor]]:
    """peft's ``(name, tensor)`` stream as the base model's: ``W + scaling * B @ A`` under ``W``'s original name.

    peft names an adapted layer's weight ``<layer>.base_layer.weight`` and its factors
    ``<layer>.lora_A.<adapter>.weight`` (``r x in``) / ``<layer>.lora_B.<adapter>.weight`` (``out x r``);
    everything sits under ``base_model.model.``. A layer is emitted once its weight and both factors arrived.
    """
    pending: dict[str, dict[str, Tensor]] = {}
    for name, tensor in named:
        name = name[len(_PEFT_PREFIX):] if name.startswith(_PEFT_PREFIX) else name
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
