"""LoRA actors from the config (``actor.lora.rank > 0``): only a low-rank adapter trains.

``LoraConfig`` becomes a ``peft.LoraConfig`` for the FSDP engine's ``build_actor(..., lora=...)``; the
frozen base weights get no gradients and no optimizer state. The rollout engine and HF exports receive
the merged weights (``W + alpha / rank * B @ A``, :func:`backends.distributed.sharded_state.full_state_dict`),
so they see an ordinary model; with ``rollout.vllm.lora_sync=adapter`` the vLLM engine instead receives
the adapter alone (:func:`adapter_state_dict`, ``backends.rollout.vllm_lora``).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch import Tensor

from backends.distributed.sharded_state import DEFAULT_BUCKET_MB, full_tensors

__all__ = ["LoraConfig", "adapter_state_dict"]


@attrs.frozen
class LoraConfig:
    """A LoRA adapter on the actor's linear layers (peft)."""

    #: adapter rank; 0: train every weight (no LoRA)
    rank: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    alpha: float = 16.0  #: the update is scaled by alpha / rank
    #: the linear layers that get an adapter (Llama / Qwen2 names)
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    #: dropout on the adapter's input
    dropout: float = attrs.field(default=0.0, validator=[attrs.validators.ge(0.0), attrs.validators.lt(1.0)])

    def build_kwargs(self, engine: Any) -> dict[str, Any]:
        """The ``build_actor`` keyword arguments of ``engine`` (a :class:`backends.training.engine.TrainEngine`) for
        this adapter (``{}`` without one); checked before any model is built."""
        if self.rank == 0:
            return {}
        if not engine.trains_lora:
            raise ValueError(
                f"actor.lora needs an engine that trains LoRA adapters (actor.backend=fsdp); the "
                f"{engine.name} engine trains full weights"
            )
        try:
            import peft
        except ImportError:
            raise ValueError(
                "actor.lora.rank > 0 needs the peft package (the `lora` extra: pip install peft)"
            ) from None
        return {
            "lora": peft.LoraConfig(
                r=self.rank,
                lora_alpha=self.alpha,
                target_modules=list(self.target_modules),
                lora_dropout=self.dropout,
                bias="none",
            )
        }


def adapter_state_dict(
    state: Any, *, dtype: torch.dtype | None = None, bucket_mb: float = DEFAULT_BUCKET_MB
) -> dict[str, Tensor]:
    """The LoRA adapter of a peft actor (``state`` or its ``.module``) alone, not merged: its ``lora_A`` /
    ``lora_B`` factors gathered to full tensors (cast to ``dtype``; default as stored) under the names of a
    peft-saved adapter, ``base_model.model.<layer>.lora_A.weight`` (what vLLM's LoRA loader reads).

    A collective over the actor's mesh (every rank calls it); every rank gets the whole adapter.
    """
    module = getattr(state, "module", state)
    configs = dict(getattr(module, "peft_config", None) or {})
    if len(configs) != 1:
        raise ValueError(f"adapter_state_dict needs a peft model with exactly one LoRA adapter, got {sorted(configs)}")
    adapter = next(iter(configs))
    factors = [
        (name, value)
        for name, value in module.state_dict().items()
        if f".lora_A.{adapter}." in name or f".lora_B.{adapter}." in name
    ]
    if not factors:
        raise ValueError(f"the peft model has no lora_A / lora_B factors for its adapter {adapter!r}")
    return {
        name.replace(f".{adapter}.weight", ".weight"): full.detach().clone()
        for name, full in full_tensors(factors, dtype=dtype, bucket_mb=bucket_mb)
    }
