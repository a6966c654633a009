r"""Importance weights and rejection masks for off-policy tokens, and the staleness of the tokens.

The rollout engine (vLLM, a bf16 engine, a stale copy of the weights) samples from
:math:`\pi_{rollout}`, while the loss is written for the trainer's :math:`\pi_{train}`: the same weights
in different kernels or precisions give slightly different probabilities, and an asynchronous recipe
trains on tokens sampled by weights several updates old. Weighting each token's loss by
:math:`w = \pi_{train}(y) / \pi_{rollout}(y)` corrects the gradient; *truncating* the weight from above
(TIS, F. Yao et al., "Your efficient RL framework secretly brings you off-policy RL training", 2025,
https://fengyao.notion.site/off-policy-rl) bounds its variance at the price of a small bias.

Three levels say which ratio a token is judged by (:data:`CORRECTION_LEVELS`):

- ``level="token"``: :math:`w_{i,j} = \exp(\log\pi_{train} - \log\pi_{rollout})` per token
  (biased, low variance; verl's ``rollout_is="token"`` / the original TIS).
- ``level="sequence"``: one weight per row, the product over its masked tokens,
  :math:`w_i = \exp\sum_j (\log\pi_{train} - \log\pi_{rollout})`, broadcast to every token
  (unbiased before truncation, high variance; verl's ``rollout_is="sequence"``).
- ``level="geometric"``: one weight per row, the geometric mean of its token ratios,
  :math:`w_i = \exp\big(\frac{1}{|y_i|}\sum_j (\log\pi_{train} - \log\pi_{rollout})\big)`, broadcast
  (length-independent; verl's ``rollout_rs="geometric"``). An empty row has :math:`w_i = 1`.

Two ways to use them:

- :func:`rollout_is_weights` (truncate, TIS): :math:`\min(w, C)`; with ``lower`` given, weights outside
  ``[lower, upper]`` are set to 0 instead (verl's ``"lower_upper"`` threshold, IcePop). Pass the result
  as ``is_weights`` to any policy loss of :mod:`rlfunc.policy_losses`.
- :func:`rollout_rejection_mask` (mask, MIS / rejection sampling): tokens (``"token"``) or whole rows
  (``"sequence"``, ``"geometric"``) whose ratio falls outside ``[lower, upper]`` leave the loss mask;
  the kept tokens keep weight 1 (verl's ``rollout_rs``).

The log-ratio is clamped to [-20, 20] before ``exp`` (verl's ``SAFETY_BOUND``), weights are 0 outside the
mask and carry no gradient (they change the measure, not the objective). The token and sequence weights
are verl 0.9.1's ``rollout_corr_helper.compute_rollout_correction_weights`` without batch normalisation;
the mask is verl's ``compute_rollout_rejection_mask`` plus the token veto of
``compute_rollout_correction_and_rejection_mask`` (tests/test_offpolicy_corrections.py re-derives both).

:func:`staleness` counts how many policy updates old each sampled token is
(``RolloutBatch.policy_version``).

Every argument after the first tensor is keyword-only: the two log-prob tensors are easy to swap,
which would invert every weight without an error.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from rlfunc.checks import check_finite, check_floating, check_mask, check_same_shape, check_shape
from rlfunc.masked import masked_fill_zero, masked_mean, masked_sum

__all__ = ["ISLevel", "IS_LEVELS", "CORRECTION_LEVELS", "rollout_is_weights", "rollout_rejection_mask", "staleness"]

ISLevel = Literal["token", "sequence", "geometric"]
#: the levels of verl's ``rollout_is`` (truncated weights)
IS_LEVELS: tuple[str, ...] = ("token", "sequence")
#: every level :func:`rollout_is_weights` and :func:`rollout_rejection_mask` accept (verl's ``rollout_rs`` levels)
CORRECTION_LEVELS: tuple[str, ...] = IS_LEVELS + ("geometric",)

# verl's SAFETY_BOUND: exp(20) ~ 4.9e8 is still finite in fp32 and far above any useful threshold.
_LOG_RATIO_BOUND = 20.0


def _token_log_ratio(trainer_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor, level: str) -> Tensor:
    """Checked inputs -> detached ``log pi_train - log pi_rollout`` in >= fp32, exactly 0 outside the mask."""
    if level not in CORRECTION_LEVELS:
        raise ValueError(f"unknown importance-sampling level {level!r}; known levels: {', '.join(CORRECTION_LEVELS)}")
    check_shape("trainer_logprobs", trainer_logprobs, "b t")
    check_same_shape(
        "trainer_logprobs", trainer_logprobs, rollout_logprobs=rollout_logprobs, response_mask=response_mask
    )
    check_floating("trainer_logprobs", trainer_logprobs)
    check_floating("rollout_logprobs", rollout_logprobs)
    check_mask("response_mask", response_mask)
    check_finite("trainer_logprobs", trainer_logprobs, response_mask)
    check_finite("rollout_logprobs", rollout_logprobs, response_mask)
    dtype = torch.promote_types(torch.promote_types(trainer_logprobs.dtype, rollout_logprobs.dtype), torch.float32)
    return masked_fill_zero(trainer_logprobs.detach().to(dtype) - rollout_logprobs.detach().to(dtype), response_mask)


def _level_log_ratio(log_ratio: Tensor, response_mask: Tensor, level: str) -> Tensor:
    """The log of each token's ratio at ``level`` (row sum or row mean broadcast), clamped to +-20."""
    if level == "sequence":
        log_ratio = masked_sum(log_ratio, response_mask, dim=-1)[:, None].expand_as(log_ratio)
    elif level == "geometric":
        log_ratio = masked_mean(log_ratio, response_mask, dim=-1)[:, None].expand_as(log_ratio)
    return log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)


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
    ``level`` is ``"token"``, ``"sequence"`` or ``"geometric"`` (module docstring).

    Metrics (detached scalars over this batch's mask, no host sync): ``is_weight_mean`` (mean weight after
    truncation), ``is_weight_max`` (largest weight before truncation), ``is_truncated_frac`` (fraction of
    tokens whose raw weight fell outside the bounds), ``is_log_ratio_mean`` (mean of
    :math:`\log\pi_{train} - \log\pi_{rollout}`), ``is_k3_mean`` (token mean of the k3 estimate of
    :math:`KL(\pi_{rollout} \| \pi_{train})`, the mismatch in one number).

    Raises ``ValueError`` for an unknown level, a non-positive ``upper``, ``lower > upper``, mismatched
    shapes, or a non-finite log-prob at a masked position; ``TypeError`` for a non-bool mask.
    """
    if not upper > 0:
        raise ValueError(f"upper must be > 0, got {upper}")
    if lower is not None and not 0 <= lower <= upper:
        raise ValueError(f"lower must be in [0, upper={upper}], got {lower}")
    log_ratio = _token_log_ratio(trainer_logprobs, rollout_logprobs, response_mask, level)
    raw = masked_fill_zero(torch.exp(_level_log_ratio(log_ratio, response_mask, level)), response_mask)
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
        "is_truncated_frac": masked_mean(outside.to(raw.dtype), response_mask),
        "is_log_ratio_mean": masked_mean(log_ratio, response_mask),
        "is_k3_mean": masked_mean(k3, response_mask),
    }
    return weights, metrics


def rollout_rejection_mask(
    trainer_logprobs: Tensor,
    *,
    rollout_logprobs: Tensor,
    response_mask: Tensor,
    level: ISLevel = "token",
    upper: float = 2.0,
    lower: float | None = None,
    token_veto: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""Masked importance sampling: drop the tokens (or rows) whose ratio is outside ``[lower, upper]``.

    With :math:`w` the ratio at ``level`` (module docstring; clamped to :math:`e^{\pm 20}`), a token stays
    in the loss iff it is in ``response_mask`` and :math:`\mathrm{lower} \le w \le \mathrm{upper}`
    (bounds included). ``lower=None`` means :math:`1/\mathrm{upper}` (verl's default). At the
    ``"sequence"`` and ``"geometric"`` levels a row is kept or dropped whole. ``token_veto`` = :math:`v`
    also drops every row holding a token whose own ratio is below :math:`v` (verl's
    ``rollout_token_veto_threshold``, whatever the level). Unlike :func:`rollout_is_weights` nothing is
    reweighted: pass the returned mask as the loss mask (``RolloutBatch.loss_mask``), alone or with
    truncated weights.

    Returns ``(mask (b t) bool, metrics)``; the mask is a subset of ``response_mask``. Metrics (detached
    scalars, no host sync): ``rs_masked_frac`` (fraction of the ``response_mask`` tokens dropped),
    ``rs_seq_masked_frac`` (fraction of the non-empty rows that lost at least one token), ``rs_frac_high`` /
    ``rs_frac_low`` (fraction of the tokens whose ratio is above ``upper`` / below ``lower``) and
    ``rs_veto_frac`` (fraction of the non-empty rows vetoed; 0 without ``token_veto``).

    Differences from verl: verl's ``rollout_rs_seq_masked_fraction`` divides by every row (empty ones
    too), here by the non-empty rows; verl returns a float mask, here a bool one.

    Raises as :func:`rollout_is_weights`, and for ``token_veto <= 0``.
    """
    lower = 1.0 / upper if lower is None and upper > 0 else lower
    if not upper > 0:
        raise ValueError(f"upper must be > 0, got {upper}")
    if not 0 <= lower <= upper:
        raise ValueError(f"lower must be in [0, upper={upper}], got {lower}")
    if token_veto is not None and not token_veto > 0:
        raise ValueError(f"token_veto must be > 0, got {token_veto}")
    log_ratio = _token_log_ratio(trainer_logprobs, rollout_logprobs, response_mask, level)
    ratio = torch.exp(_level_log_ratio(log_ratio, response_mask, level))
    high, low = ratio > upper, ratio < lower
    keep = response_mask & ~high & ~low
    rows = response_mask.any(dim=-1)
    if token_veto is None:
        vetoed = torch.zeros_like(rows)
    else:
        token_ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))
        vetoed = (response_mask & (token_ratio < token_veto)).any(dim=-1)
        keep = keep & ~vetoed[:, None]

    dtype = ratio.dtype
    metrics = {
        "rs_masked_frac": masked_mean((response_mask & ~keep).to(dtype), response_mask),
        "rs_seq_masked_frac": masked_mean((response_mask & ~keep).any(dim=-1).to(dtype), rows),
        "rs_frac_high": masked_mean(high.to(dtype), response_mask),
        "rs_frac_low": masked_mean(low.to(dtype), response_mask),
        "rs_veto_frac": masked_mean(vetoed.to(dtype), rows),
    }
    return keep, metrics


def staleness(
    policy_version: Tensor,
    *,
    current_version: int | Tensor,
    response_mask: Tensor,
    bins: int = 4,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""How many policy updates old each sampled token is: ``current_version - policy_version``.

    ``policy_version (b t)`` integer: the version of the weights that sampled each token
    (``RolloutBatch.policy_version``); ``current_version``: the version being trained now (an int or an
    integer scalar tensor); ``response_mask (b t)`` bool. Returns ``(staleness (b t) int64, metrics)``,
    staleness 0 outside the mask. A token from a version newer than ``current_version`` has a negative
    staleness (not checked: that would cost a host sync); the histogram counts it as 0.

    Metrics (detached scalars over the mask, no host sync; 0 for an empty mask): ``staleness_min``,
    ``staleness_mean``, ``staleness_max``, and a histogram of ``bins`` buckets as fractions of the
    masked tokens: ``staleness_frac_0`` ... ``staleness_frac_{bins-2}`` for those exact staleness values and
    ``staleness_frac_ge_{bins-1}`` for the rest.
    """
    check_shape("policy_version", policy_version, "b t")
    check_same_shape("policy_version", policy_version, response_mask=response_mask)
    check_mask("response_mask", response_mask)
    if policy_version.is_floating_point() or policy_version.dtype == torch.bool or policy_version.is_complex():
        raise TypeError(f"policy_version must be an integer tensor, got {policy_version.dtype}")
    if isinstance(current_version, Tensor) and (current_version.dim() != 0 or current_version.is_floating_point()):
        raise TypeError("current_version must be an int or an integer scalar tensor")
    if not bins >= 2:
        raise ValueError(f"bins must be >= 2, got {bins}")

    age = torch.where(response_mask, current_version - policy_version.to(torch.int64), 0)
    extreme = torch.iinfo(torch.int64)
    any_token = response_mask.any()
    fmask = response_mask.to(torch.float32)
    bucket = age.clamp(0, bins - 1).reshape(-1)
    hist = torch.zeros(bins, dtype=torch.float32, device=age.device).scatter_add(0, bucket, fmask.reshape(-1))
    hist = hist / fmask.sum().clamp(min=1)
    if age.numel():
        low = torch.where(any_token, torch.where(response_mask, age, extreme.max).amin(), 0)
        high = torch.where(any_token, torch.where(response_mask, age, extreme.min).amax(), 0)
    else:
        low = high = age.new_zeros(())
    metrics = {
        "staleness_min": low.to(torch.float32),
        "staleness_mean": masked_mean(age.to(torch.float32), response_mask),
        "staleness_max": high.to(torch.float32),
    }
    metrics.update({f"staleness_frac_{k}": hist[k] for k in range(bins - 1)})
    metrics[f"staleness_frac_ge_{bins - 1}"] = hist[bins - 1]
    return age, metrics
