"""LoRA actors from the config (``actor.lora.rank > 0``): only a low-rank adapter trains.

``LoraConfig`` becomes a ``peft.LoraConfig`` for the FSDP engine's ``build_actor(..., lora=...)``; the
frozen base weights get no gradients and no optimizer state. The rollout engine and HF exports receive
the merged weights (``W + alpha / rank * B @ A``, :func:`backends.distributed.sharded_state.full_state_dict`),
so they see an ordinary model.
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["LoraConfig"]


@attrs.frozen
class LoraConfig:
    """A LoRA adapter on the actor's linear layers (peft)."""

    rank: int = attrs.field(default=0, validator=attrs.validators.ge(0))  #: adapter rank; 0: train every weight (no LoRA)
    alpha: float = 16.0  #: the update is scaled by alpha / rank
    #: the linear layers that get an adapter (Llama / Qwen2 names)
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    dropout: float = attrs.field(default=0.0, validator=[attrs.validators.ge(0.0), attrs.validators.lt(1.0)])  #: dropout on the adapter's input

    def build_kwargs(self, backend: str) -> dict[str, Any]:
        """The engine's ``build_actor`` keyword arguments for this adapter (``{}`` without one); checked
        before any model is built."""
        if self.rank == 0:
            return {}
        if backend != "fsdp":
            raise ValueError(f"actor.lora needs actor.backend=fsdp (the {backend} engine trains full weights)")
        try:
            import peft
        except ImportError:
            raise ValueError("actor.lora.rank > 0 needs the peft package (the `lora` extra: pip install peft)") from None
        return {"lora": peft.LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=list(self.target_modules),
                                        lora_dropout=self.dropout, bias="none")}
