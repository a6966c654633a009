r"""Importance weights for the rollout / trainer log-prob mismatch (truncated importance sampling).

The rollout engine (vLLM, a bf16 engine, a stale copy of the weights) samples from
:math:`\pi_{rollout}`, while the loss is written for the trainer's :math:`\pi_{train}`: the same weights
in different kernels or precisions give slightly different probabilities. Weighting each token's loss by
:math:`w = \pi_{train}(y) / \pi_{rollout}(y)` corrects the gradient; *truncating* the weight from above
(TIS, F. Yao et al., "Your efficient RL framework secretly brings you off-policy RL training", 2025,
https://fengyao.notion.site/off-policy-rl) bounds its variance at the price of a small bias.

- ``level="token"``: :math:`w_{i,j} = \min(\exp(\log\pi_{train} - \log\pi_{rollout}), C)` per token
  (biased, low variance; verl's ``rollout_is="token"`` / the original TIS).
- ``level="sequence"``: one weight per row, the product over its masked tokens,
  :math:`w_i = \min(\exp\sum_j (\log\pi_{train} - \log\pi_{rollout}), C)`, broadcast to every token
  (unbiased before truncation, high variance; verl's ``rollout_is="sequence"``).
- ``lower`` given: instead of truncating, weights outside ``[lower, upper]`` are set to 0 (verl's
  ``"lower_upper"`` threshold, IcePop).

The log-ratio is clamped to [-20, 20] before ``exp`` (verl's ``SAFETY_BOUND``), weights are 0 outside the
mask and carry no gradient (they change the measure, not the objective). Same numbers as verl 0.9.1's
``rollout_corr_helper.compute_rollout_correction_weights`` without batch normalisation. Pass the result
as ``is_weights`` to any policy loss of :mod:`rlfunc.policy_losses`.

Every argument after ``trainer_logprobs`` is keyword-only: the two log-prob tensors are easy to swap,
which would invert every weight without an error.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from rlfunc.checks import check_finite, check_floating, check_mask, check_same_shape, check_shape
from rlfunc.masked import masked_fill_zero, masked_mean, masked_sum

__all__ = ["ISLevel", "IS_LEVELS", "rollout_is_weights"]

ISLevel = Literal["token", "sequence"]
IS_LEVELS: tuple[str, ...] = ("token", "sequence")

# verl's SAFETY_BOUND: exp(20) ~ 4.9e8 is still finite in fp32 and far above any useful threshold.
_LOG_RATIO_BOUND = 20.0


def rollout_is_weights(
    trainer_logprobs: Tensor,
    *,
    rollout_logprobs: Tensor,
    response_mask: Tensor,
    level: ISLevel = "token",
    upper: float = 2.0,
    lower: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""Truncated importance weights :math:`\pi_{train} / \pi_{rollout}` of the sampled tokens.

    ``trainer_logprobs (b t)`` (the trainer's recomputed log-probs, e.g. ``batch.old_logprobs``),
    ``rollout_logprobs (b t)`` (the rollout engine's, ``batch.rollout_logprobs``), ``response_mask (b t)``
    bool. Returns ``(weights (b t), metrics)``: weights are detached, >= 0, 0 outside the mask; with
    ``lower=None`` they are truncated at ``upper`` (TIS), else zeroed outside ``[lower, upper]`` (IcePop).
    ``level`` is ``"token"`` or ``"sequence"`` (module docstring).

    Metrics (detached scalars over this batch's mask, no host sync): ``is_weight_mean`` (mean weight after
    truncation), ``is_weight_max`` (largest weight before truncation), ``is_truncated_frac`` (fraction of
    tokens whose raw weight fell outside the bounds), ``is_log_ratio_mean`` (mean of
    :math:`\log\pi_{train} - \log\pi_{rollout}`), ``is_k3_mean`` (token mean of the k3 estimate of
    :math:`KL(\pi_{rollout} \| \pi_{train})`, the mismatch in one number).

    Raises ``ValueError`` for an unknown level, a non-positive ``upper``, ``lower > upper``, mismatched
    shapes, or a non-finite log-prob at a masked position; ``TypeError`` for a non-bool mask.
    """
    if level not in IS_LEVELS:
        raise ValueError(f"unknown importance-sampling level {level!r}; known levels: {', '.join(IS_LEVELS)}")
    if not upper > 0:
        raise ValueError(f"upper must be > 0, got {upper}")
    if lower is not None and not 0 <= lower <= upper:
        raise ValueError(f"lower must be in [0, upper={upper}], got {lower}")
    check_shape("trainer_logprobs", trainer_logprobs, "b t")
    check_same_shape("trainer_logprobs", trainer_logprobs, rollout_logprobs=rollout_logprobs, response_mask=response_mask)
    check_floating("trainer_logprobs", trainer_logprobs)
    check_floating("rollout_logprobs", rollout_logprobs)
    check_mask("response_mask", response_mask)
    check_finite("trainer_logprobs", trainer_logprobs, response_mask)
    check_finite("rollout_logprobs", rollout_logprobs, response_mask)

    dtype = torch.promote_types(torch.promote_types(trainer_logprobs.dtype, rollout_logprobs.dtype), torch.float32)
    log_ratio = masked_fill_zero(trainer_logprobs.detach().to(dtype) - rollout_logprobs.detach().to(dtype), response_mask)
    if level == "sequence":
        log_ratio_used = masked_sum(log_ratio, response_mask, dim=-1)[:, None].expand_as(log_ratio)
    else:
        log_ratio_used = log_ratio
    raw = masked_fill_zero(torch.exp(log_ratio_used.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)), response_mask)
    if lower is None:
        outside = raw > upper
        weights = raw.clamp(max=upper)
    else:
        outside = (raw < lower) | (raw > upper)
        weights = torch.where(outside, torch.zeros_like(raw), raw)
    weights = masked_fill_zero(weights, response_mask)

    clamped = log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    k3 = torch.exp(clamped) - 1 - clamped  # r - 1 - log r with r = pi_train / pi_rollout, y ~ pi_rollout
    metrics = {
        "is_weight_mean": masked_mean(weights, response_mask),
        "is_weight_max": masked_fill_zero(raw, response_mask).amax() if raw.numel() else raw.new_zeros(()),
        "is_truncated_frac": masked_mean(outside.to(dtype), response_mask),
        "is_log_ratio_mean": masked_mean(log_ratio, response_mask),
        "is_k3_mean": masked_mean(k3, response_mask),
    }
    return weights, metrics
