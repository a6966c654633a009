"""Log-probabilities of chosen tokens and entropies from logits (placeholder: helper C replaces this)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["logprobs_from_logits", "entropy_from_logits"]


def logprobs_from_logits(logits: Tensor, labels: Tensor, *, chunk_size: int | None = None) -> Tensor:
    """``log softmax(logits)[..., labels]``: ``(b t v), (b t) -> (b t)`` in fp32."""
    logits = logits.float()
    return torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: Tensor, *, chunk_size: int | None = None) -> Tensor:
    """Entropy of ``softmax(logits)``: ``(b t v) -> (b t)`` in fp32."""
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)
