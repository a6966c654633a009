r"""Decoupled PPO: the policy loss of asynchronous RL, where the tokens come from a stale policy.

AReaL (Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language
Reasoning", https://arxiv.org/abs/2505.24298) separates the two roles the "old" policy plays in PPO:

- the *behaviour* policy :math:`\pi_{behav}` sampled the tokens (the rollout engine, possibly several
  updates behind; ``behaviour_logprobs``, ``RolloutBatch.rollout_logprobs``);
- the *proximal* policy :math:`\pi_{prox}` is the trust-region centre the ratio is clipped against (the
  trainer's recompute with the weights at the start of the update; ``old_logprobs``,
  ``RolloutBatch.old_logprobs``).

The loss needs three log-probs (current, proximal, behaviour; see
:data:`rlfunc.policy_losses.POLICY_LOSS_LOGPROBS`): a recipe that skips the trainer's recompute and
passes the rollout log-probs as ``old_logprobs`` (verl's bypass mode) has no separate proximal policy,
and the loss degenerates to PPO. It lives in its own module so that
:mod:`rlfunc.policy_losses` can register it; it follows that module's conventions (signature, padding,
metrics) and is :func:`rlfunc.policy_losses.ppo_policy_loss` with per-token weights, tested to agree.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlfunc.aggregation import AggMode, Normalizers, aggregate
from rlfunc.checks import bind, check_floating, check_mask
from rlfunc.masked import masked_mean
from rlfunc.signatures import VERL_POLICY_LOSS_KEYWORDS, refuse_verl_keywords

__all__ = ["decoupled_ppo_policy_loss"]

# the +-20 clamp of log-ratios before exp, as rlfunc.policy_losses and verl
_MAX_LOG_RATIO = 20.0


def _check(logprobs: Tensor, knobs: dict[str, float | None], **tensors: Tensor | None) -> float:
    """Shapes, dtypes and knob ranges; returns ``clip_high`` (defaulting to ``clip_low``)."""
    bind({"logprobs": (logprobs, "b t"), **{name: (x, "b t") for name, x in tensors.items()}})
    check_mask("response_mask", tensors["response_mask"])
    check_floating("logprobs", logprobs)
    for name, x in tensors.items():
        if x is not None and name != "response_mask":
            check_floating(name, x)
    low, high, dual, cap = knobs["clip_low"], knobs["clip_high"], knobs["dual_clip"], knobs["behaviour_weight_cap"]
    high = low if high is None else high
    if not (0.0 <= low < 1.0 and high >= 0.0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={low}, clip_high={high}")
    if dual is not None and not dual > 1.0:
        raise ValueError(f"dual_clip must be > 1 (it bounds the ratio for negative advantages), got {dual}")
    if cap is not None and not cap > 0:
        raise ValueError(f"behaviour_weight_cap must be > 0, got {cap}")
    return high


@torch.no_grad()
def _behaviour_weights(
    old_logprobs: Tensor, behaviour_logprobs: Tensor | None, response_mask: Tensor, cap: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(log w, w after the cap, capped)`` with ``w = pi_prox / pi_behav``; log w is 0 outside the mask."""
    behaviour = old_logprobs if behaviour_logprobs is None else behaviour_logprobs
    log_weight = torch.where(response_mask, old_logprobs - behaviour, 0.0).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    weight = torch.exp(log_weight)
    capped = torch.zeros_like(response_mask)
    if cap is not None:
        capped = response_mask & (weight > cap)
        weight = torch.where(capped, 0.0, weight)
    return log_weight, weight, capped


@refuse_verl_keywords(**VERL_POLICY_LOSS_KEYWORDS)
def decoupled_ppo_policy_loss(
    logprobs: Tensor,
    *,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    behaviour_logprobs: Tensor | None = None,
    behaviour_weight_cap: float | None = None,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    seed: int = 0,
    agg: AggMode = "token-mean",
    norms: Normalizers | None = None,
    horizon: int | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""Decoupled PPO: clip against the proximal policy, reweight from the behaviour policy.

    ``old_logprobs`` is :math:`\log\pi_{prox}`, ``behaviour_logprobs`` :math:`\log\pi_{behav}` (module
    docstring). With :math:`r = \pi / \pi_{prox}`:

    .. math::
        w = \mathrm{sg}\big[\pi_{prox} / \pi_{behav}\big], \qquad
        \ell = -w\,\min\big(rA,\ \mathrm{clip}(r, 1-\epsilon_{low}, 1+\epsilon_{high})A\big)

    and for :math:`A < 0` with ``dual_clip`` = :math:`c`, :math:`\ell = \min(\ell, -wcA)`. This is
    :func:`~rlfunc.policy_losses.ppo_policy_loss` against ``old_logprobs`` with :math:`w` (times
    ``is_weights``) as per-token weights; :math:`\log r` and :math:`\log w` are clamped to +-20.

    ``behaviour_weight_cap`` = :math:`C`: tokens with :math:`w > C` get weight 0 (AReaL's
    ``behav_imp_weight_cap`` filters such tokens, it does not truncate them); they still count in the
    normalisers. ``behaviour_logprobs=None`` means :math:`\pi_{behav} = \pi_{prox}`, :math:`w = 1`: plain
    PPO (so the uniform call of every registered loss works; a recipe that wants the correction must
    supply the behaviour log-probs, see :func:`rlfunc.policy_losses.check_logprobs_supplied`). With
    :math:`\pi_{prox} = \pi_{behav}` the loss and its gradient equal PPO's.

    Padding, ``agg``/``norms``/``horizon`` and ``is_weights`` as in :mod:`rlfunc.policy_losses`; gradients
    flow through ``logprobs`` only (``old_logprobs``, ``behaviour_logprobs`` and ``is_weights`` are detached).

    Metrics: ``clip_frac``, ``dual_clip_frac``, ``ppo_kl`` as :func:`~rlfunc.policy_losses.ppo_policy_loss`
    (against :math:`\pi_{prox}`), plus ``behaviour_weight_mean`` (mean :math:`w` after the cap),
    ``behaviour_capped_frac`` (tokens whose :math:`w` exceeded the cap) and ``behaviour_kl`` (mean of
    :math:`\log\pi_{behav} - \log\pi_{prox}`; AReaL's ``behave_approx_kl`` with the opposite sign).
    """
    knobs = dict(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, behaviour_weight_cap=behaviour_weight_cap)
    high = _check(
        logprobs,
        knobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        response_mask=response_mask,
        behaviour_logprobs=behaviour_logprobs,
        is_weights=is_weights,
    )
    cap = behaviour_weight_cap
    log_weight, weight, capped = _behaviour_weights(old_logprobs, behaviour_logprobs, response_mask, cap)
    token_weight = weight if is_weights is None else weight * is_weights.detach()

    log_ratio = torch.where(response_mask, logprobs - old_logprobs.detach(), 0.0)
    ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1.0 - clip_low, 1.0 + high) * advantages)
    if dual_clip is not None:
        surrogate = torch.where(advantages < 0, torch.maximum(surrogate, dual_clip * advantages), surrogate)
    loss = -aggregate(surrogate * token_weight, response_mask, mode=agg, norms=norms, horizon=horizon)

    metrics = _decoupled_metrics(
        log_ratio, advantages, response_mask, clip_low, high, dual_clip, log_weight, weight, capped
    )
    return loss, metrics


def _decoupled_metrics(
    log_ratio: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    log_weight: Tensor,
    weight: Tensor,
    capped: Tensor,
) -> dict[str, Tensor]:
    """:func:`decoupled_ppo_policy_loss`'s metrics (no gradient): PPO's clip fractions and KL against the
    proximal policy, and the behaviour weights' mean, capped fraction and KL."""
    with torch.no_grad():
        count = response_mask.sum().clamp(min=1)
        lr = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        clipped = (advantages > 0) & (lr > math.log1p(clip_high)) | (advantages < 0) & (lr < math.log1p(-clip_low))
        clipped = response_mask & clipped
        dual = torch.zeros_like(response_mask)
        if dual_clip is not None:
            dual = response_mask & (advantages < 0) & (lr > math.log(dual_clip))
        metrics = {
            "clip_frac": clipped.sum() / count,
            "dual_clip_frac": dual.sum() / count,
            "ppo_kl": -lr.sum() / count,
            "behaviour_weight_mean": masked_mean(weight, response_mask),
            "behaviour_capped_frac": capped.sum() / count,
            "behaviour_kl": -log_weight.sum() / count,
        }
    return metrics
