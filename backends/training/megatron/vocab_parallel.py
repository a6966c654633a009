"""Log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds the logits of its slice of the (padded) vocabulary,
``logits[..., v_local]`` for ids ``vocab_start .. vocab_start + v_local``. With ``m`` the global max
(an all-reduce MAX, no gradient needed: it cancels), ``Z = sum_r sum_v exp(l - m)`` and
``S = sum_r sum_v p * (l - m)`` are sums over the TP group taken with megatron's
``reduce_from_tensor_model_parallel_region`` (forward all-reduce, backward identity: every TP rank
computes the same replicated loss, so the gradient of the sum w.r.t. a rank's own terms is the
upstream gradient). Then

    log p(y) = (l_y - m) - log Z          (l_y lives on one rank; the others contribute 0)
    H        = log Z - S

Ids ``>= vocab_size`` (the padding that makes the vocabulary divisible by ``tp``) are masked out of
every sum. Each rank's memory is ``O(b s v/tp)``; nothing of size ``v`` is ever materialised.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["vocab_parallel_logprobs"]


def _sum_over_tp(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return x
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x.contiguous(), group=group)


def vocab_parallel_logprobs(
    logits: Tensor,
    targets: Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``(logprobs, entropy)`` of shape ``(...)`` from this rank's ``logits (... v_local)``, fp32.

    ``targets (...)`` are global token ids; ``vocab_size`` is the real (unpadded) vocabulary;
    ``group`` the TP group (None: the whole vocabulary is local). Differentiable; a collective over
    ``group`` (every TP rank calls it with its own slice and the same targets).
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree on the leading dims"
        )
    v_local = logits.shape[-1]
    logits = logits.float()
    ids = torch.arange(vocab_start, vocab_start + v_local, device=logits.device)
    valid = ids < vocab_size
    if not bool(valid.all()):
        logits = logits.masked_fill(~valid, float("-inf"))
    with torch.no_grad():
        m = logits.max(dim=-1).values
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - m.unsqueeze(-1)
    log_z = torch.log(_sum_over_tp(shifted.exp().sum(-1), group))
    local_t = targets - vocab_start
    mine = (local_t >= 0) & (local_t < v_local)
    picked = shifted.gather(-1, local_t.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = _sum_over_tp(torch.where(mine, picked, torch.zeros_like(picked)), group)
    logprobs = target_logit - log_z
    entropy = None
    if with_entropy:
        p = torch.exp(shifted - log_z.unsqueeze(-1))
        # padded ids have p = 0 and l = -inf: zero l there first (0 * -inf would be NaN, also in backward)
        p_l = (p * torch.where(valid, shifted, torch.zeros_like(shifted))).sum(-1)
        entropy = log_z - _sum_over_tp(p_l, group)
    return logprobs, entropy
