r"""Policy-gradient losses for language-model RL: PPO and its relatives, over per-token tensors.

Every loss takes one uniform call, what a training loop passes, plus its own knobs::

    loss, metrics = loss_fn(logprobs, *, old_logprobs=..., advantages=..., response_mask=...,
                            behaviour_logprobs=None, is_weights=None, agg=..., norms=None, horizon=None,
                            seed=0, <its own knobs>)

so a loop calls every loss the same way and never tests a loss's name; a loss ignores the keywords it has
no use for (``behaviour_logprobs`` is read by ``decoupled_ppo`` only, ``seed`` by ``clip_cov`` only, the one
loss that draws random numbers: pass a different seed per step). A user's own loss takes the same call.

Everything after ``logprobs`` is keyword-only. verl's ``compute_policy_loss_*(old_log_prob, log_prob,
advantages, response_mask, ...)`` puts the old log-probs first: a positional port of such a call would
swap the two and silently give a different loss; here it raises ``TypeError``, and so does a by-name port
with verl's keywords (``old_log_prob=``, ``loss_agg_mode=``, ``config=``, ...), naming the keywords to use.

- ``behaviour_logprobs`` ``(b t)``: log-probs of the policy that sampled the tokens (asynchronous RL);
  ``seed``: the random loss's seed (the loop passes one per step, so steps draw different tokens and a
  resumed run draws what an uninterrupted one would).

- ``logprobs`` ``(b t)``: log-probabilities of the sampled tokens under the policy being trained
  (differentiable); ``old_logprobs`` ``(b t)``: the same under the policy that produced the batch;
  ``advantages`` ``(b t)``; ``response_mask`` ``(b t)`` ``torch.bool``: the tokens the loss is over.
- The per-token loss matrix goes through :func:`rlfunc.aggregation.aggregate` with ``agg``, ``norms`` and
  ``horizon``: pass the *global* :class:`~rlfunc.aggregation.Normalizers` (summed over micro-batches and
  ranks) and summing the micro-batch losses gives the full-batch loss and gradient.
- ``is_weights`` ``(b t)``: optional per-token importance weights (rollout / trainer mismatch
  correction); they are detached and multiply the per-token loss.
- ``loss`` is a scalar tensor; ``metrics`` is a dict of detached scalar tensors (never ``Tensor.item``: the
  caller decides when to sync). Metrics are means over this call's masked tokens.
- Positions outside ``response_mask`` may hold anything, NaN and inf included, in ``logprobs``,
  ``old_logprobs``, ``advantages`` and ``is_weights``: they never reach the loss, the metrics or the
  gradients. An all-false mask gives a loss of 0 and zero gradients.
- No finite-ness checks on values (that would cost a pass and a host sync per call): shapes and dtypes
  are checked.

Parity with verl 0.9.1 (``verl.trainer.ppo.core_algos.compute_policy_loss_*``): same numbers in fp32 for
the same settings (tests/golden/losses.safetensors). Differences that hold for every loss here:

- verl reads its knobs from an ``ActorConfig`` (and its global batch info from a field the trainer
  mutates before each call); here they are explicit keyword arguments and a ``norms`` value.
- verl returns Python floats (via ``Tensor.item``) under keys like ``"actor/pg_clipfrac"``; here metrics are
  tensors with short names. Each docstring maps them to verl's keys.
- verl's ``agg_loss`` multiplies by ``dp_size``; :func:`~rlfunc.aggregation.aggregate` never does (the
  backend owns the gradient reduction).
- verl's masked means divide by ``count + 1e-8``; ours by ``max(count, 1)`` (same value for a
  non-empty mask up to float rounding; exactly 0, not NaN-prone, for an empty one).
- verl lets NaN in padded positions leak into the gradients (``0 * nan``); here padding is selected
  away with ``torch.where`` before any arithmetic.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from rlfunc.aggregation import AggMode, Normalizers, aggregate
from rlfunc.checks import bind, check_floating, check_mask
from rlfunc.masked import masked_mean, masked_sum
from rlfunc.offpolicy import decoupled_ppo_policy_loss
from rlfunc.signatures import VERL_POLICY_LOSS_KEYWORDS, refuse_verl_keywords, with_defaults

__all__ = [
    "ppo_policy_loss",
    "vanilla_policy_loss",
    "gspo_policy_loss",
    "sapo_policy_loss",
    "cispo_policy_loss",
    "gpg_policy_loss",
    "clip_cov_policy_loss",
    "kl_cov_policy_loss",
    "gmpo_policy_loss",
    "decoupled_ppo_policy_loss",
]

Metrics = dict[str, Tensor]
PolicyLossFn = Callable[..., tuple[Tensor, Metrics]]

# verl clamps log-ratios to +-20 before ``exp`` in PPO, SAPO and CISPO (not in GSPO, GMPO, Clip-/KL-Cov).
_MAX_LOG_RATIO = 20.0


# ----------------------------------------------------------------------------------------------------
# shared pieces


def _check_inputs(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    is_weights: Tensor | None,
) -> None:
    bind(
        {
            "logprobs": (logprobs, "b t"),
            "old_logprobs": (old_logprobs, "b t"),
            "advantages": (advantages, "b t"),
            "response_mask": (response_mask, "b t"),
            "is_weights": (is_weights, "b t"),
        }
    )
    check_mask("response_mask", response_mask)
    for name, x in (("logprobs", logprobs), ("old_logprobs", old_logprobs), ("advantages", advantages)):
        check_floating(name, x)
    if is_weights is not None:
        check_floating("is_weights", is_weights)


def _clip_bounds(clip_low: float, clip_high: float | None) -> tuple[float, float]:
    """``(clip_low, clip_high)`` with ``clip_high`` defaulting to ``clip_low``, validated."""
    high = clip_low if clip_high is None else clip_high
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if not high >= 0.0:
        raise ValueError(f"clip_high must be >= 0, got {high}")
    return float(clip_low), float(high)


def _log_ratio(logprobs: Tensor, old_logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """``log pi - log pi_old`` on the mask, exactly 0 outside it.

    Selecting (rather than multiplying by the mask) keeps NaN in padding out of the forward *and*
    out of the backward: ``torch.where`` sends a zero gradient to the unselected branch.
    """
    return torch.where(response_mask, logprobs - old_logprobs, 0.0)


def _token_count(response_mask: Tensor) -> Tensor:
    """Number of loss tokens in this call, at least 1 (the denominator of the metrics)."""
    return response_mask.sum().clamp(min=1)


def _apply_is_weights(loss_mat: Tensor, is_weights: Tensor | None) -> Tensor:
    return loss_mat if is_weights is None else loss_mat * is_weights.detach()


def _scalar(value: float, like: Tensor) -> Tensor:
    return torch.tensor(value, dtype=like.dtype, device=like.device)


def _zero(like: Tensor) -> Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device)


# ----------------------------------------------------------------------------------------------------
# PPO


@refuse_verl_keywords(**VERL_POLICY_LOSS_KEYWORDS)
def ppo_policy_loss(
    logprobs: Tensor,
    *,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    behaviour_logprobs: Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    seed: int = 0,
    agg: AggMode = "token-mean",
    norms: Normalizers | None = None,
    horizon: int | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    r"""Clipped-surrogate PPO loss, with asymmetric (clip-higher) and dual clipping.

    With :math:`r = \exp(\log\pi - \log\pi_{old})` and advantage :math:`A` per token
    (PPO, https://arxiv.org/abs/1707.06347):

    .. math::
        \ell = -\min\big(rA,\ \mathrm{clip}(r, 1-\epsilon_{low}, 1+\epsilon_{high})A\big)

    ``clip_high`` > ``clip_low`` is DAPO's clip-higher (https://arxiv.org/abs/2503.14476).
    ``dual_clip`` = :math:`c > 1` also bounds the loss of negative-advantage tokens,
    :math:`\ell = \min(\ell, -cA)` for :math:`A < 0` (dual-clip PPO, https://arxiv.org/abs/1912.09729).

    Computed in one fused form: per token the clipped surrogate is :math:`-A\,\tilde r` with
    :math:`\tilde r = \exp(\mathrm{clamp}(\log r, l, u))`, where :math:`(l, u)` is
    :math:`(-20, \log(1+\epsilon_{high}))` for :math:`A \ge 0` and
    :math:`(\log(1-\epsilon_{low}), \log c)` for :math:`A < 0` (:math:`\log c` is 20 without dual
    clip). That is the value (up to float rounding of :math:`\exp\log(1\pm\epsilon)`) and the gradient
    of the min/max form with verl's +-20 clamp of :math:`\log r`, with one ``exp``, no unused branch
    and no boolean ``torch.where`` on the advantage signs.

    Metrics (verl's ``compute_policy_loss_vanilla`` key in brackets):

    - ``clip_frac`` [``actor/pg_clipfrac``]: tokens where the clipped term is active
      (:math:`A > 0, r > 1+\epsilon_{high}` or :math:`A < 0, r < 1-\epsilon_{low}`);
    - ``dual_clip_frac`` [``actor/pg_clipfrac_lower``]: tokens with :math:`A < 0, r > c`
      (0 without dual clip);
    - ``ppo_kl`` [``actor/ppo_kl``]: mean of :math:`\log\pi_{old} - \log\pi`.

    Differences from verl: verl always applies dual clip (``clip_ratio_c``, default 3.0); here ``dual_clip=None``
    (the default) is off; :data:`vanilla_policy_loss` (``POLICY_LOSSES["vanilla"]``) has verl's 3.0.
    """
    _check_inputs(logprobs, old_logprobs, advantages, response_mask, is_weights)
    low, high = _clip_bounds(clip_low, clip_high)
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (it bounds the ratio for negative advantages), got {dual_clip}")

    log_ratio = _log_ratio(logprobs, old_logprobs, response_mask)
    # Per-token clamp bounds on log r: (-20, log(1+eps_high)) where A >= 0, (log(1-eps_low), log c)
    # where A < 0. Selected with 0/1 float weights (each term is exactly 0 or the bound, so the sum is
    # exact): torch.where on a bool of unpredictable signs is slower on CPU than a few vectorised
    # multiply-adds.
    pos_lower, pos_upper = -_MAX_LOG_RATIO, min(math.log1p(high), _MAX_LOG_RATIO)
    neg_lower = math.log1p(-low)
    neg_upper = _MAX_LOG_RATIO if dual_clip is None else min(math.log(dual_clip), _MAX_LOG_RATIO)
    with torch.no_grad():
        negative = (advantages < 0).to(log_ratio.dtype)
        non_negative = 1.0 - negative
        lower = negative * neg_lower + non_negative * pos_lower
        upper = negative * neg_upper + non_negative * pos_upper
    clipped_log_ratio = torch.clamp(log_ratio, lower, upper)
    surrogate = _apply_is_weights(torch.exp(clipped_log_ratio) * advantages, is_weights)
    loss = -aggregate(surrogate, response_mask, mode=agg, norms=norms, horizon=horizon)

    with torch.no_grad():
        count = _token_count(response_mask)
        # A * (log r - clamped log r): > 0 where the PPO clip bites (either side), < 0 with A < 0
        # where the dual clip (or verl's +-20 clamp) bites. Padding has log r = 0 inside the bounds.
        excess = advantages * (log_ratio - clipped_log_ratio)
        metrics = {
            "clip_frac": (excess > 0).sum() / count,
            "dual_clip_frac": ((excess < 0) & (advantages < 0)).sum() / count if dual_clip is not None else _zero(loss),
            "ppo_kl": -log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).sum() / count,
        }
    return loss, metrics


# ----------------------------------------------------------------------------------------------------
# GSPO


@refuse_verl_keywords(**VERL_POLICY_LOSS_KEYWORDS)
def gspo_policy_loss(
    logprobs: Tensor,
    *,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    behaviour_logprobs: Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    seed: int = 0,
    agg: AggMode = "seq-mean-token-mean",
    norms: Normalizers | None = None,
    horizon: int | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    r"""Group Sequence Policy Optimization: PPO clipping on a length-normalised sequence ratio.

    GSPO (https://arxiv.org/abs/2507.18071), token-level form (GSPO-token):

    .. math::
        s_i = \exp\Big(\frac{1}{|y_i|}\sum_t \log\frac{\pi(y_{it})}{\pi_{old}(y_{it})}\Big), \quad
        s_{it} = \mathrm{sg}[s_i]\,\frac{\pi(y_{it})}{\mathrm{sg}[\pi(y_{it})]}, \quad
        \ell_{it} = -\min\big(s_{it}A_{it},\ \mathrm{clip}(s_{it}, 1-\epsilon_{low}, 1+\epsilon_{high})A_{it}\big)

    :math:`s_{it}` equals :math:`s_i` in value; its gradient is that of :math:`\log\pi(y_{it})`
    scaled by :math:`s_i`. :math:`\log s_{it}` is clamped at 10 (as verl). The paper's clip ranges are
    tiny (e.g. 3e-4 / 4e-4) because the ratio is a per-token geometric mean.

    ``agg`` defaults to ``"seq-mean-token-mean"`` (the paper's sequence-level average, and the
    default of verl's ``compute_policy_loss_gspo``; verl's trainer passes its configured mode).

    Metrics: ``clip_frac`` [``actor/pg_clipfrac``], ``ppo_kl`` [``actor/ppo_kl``, no +-20 clamp];
    verl's ``actor/pg_clipfrac_lower`` is a constant 0 and is left out.
    """
    _check_inputs(logprobs, old_logprobs, advantages, response_mask, is_weights)
    low, high = _clip_bounds(clip_low, clip_high)

    log_ratio = _log_ratio(logprobs, old_logprobs, response_mask)
    seq_log_ratio = log_ratio.sum(dim=-1) / response_mask.sum(dim=-1).clamp(min=1)
    safe_logprobs = torch.where(response_mask, logprobs, 0.0)
    token_log_ratio = safe_logprobs - safe_logprobs.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(token_log_ratio.clamp(max=10.0))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - low, 1.0 + high)
    loss_mat = _apply_is_weights(torch.maximum(unclipped, clipped), is_weights)
    loss = aggregate(loss_mat, response_mask, mode=agg, norms=norms, horizon=horizon)

    with torch.no_grad():
        count = _token_count(response_mask)
        metrics = {
            "clip_frac": ((clipped > unclipped) & response_mask).sum() / count,
            "ppo_kl": -log_ratio.sum() / count,
        }
    return loss, metrics


# ----------------------------------------------------------------------------------------------------
# SAPO


@refuse_verl_keywords(**VERL_POLICY_LOSS_KEYWORDS)
def sapo_policy_loss(
    logprobs: Tensor,
    *,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    behaviour_logprobs: Tensor | None = None,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    seed: int = 0,
    agg: AggMode = "seq-mean-token-mean",
    norms: Normalizers | None = None,
    horizon: int | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    r"""Soft Adaptive Policy Optimization: a smooth sigmoid gate in place of the hard clip.

    SAPO (https://arxiv.org/abs/2511.20347). With :math:`r = \exp(\log\pi - \log\pi_{old})` and
    :math:`\tau = \tau_{pos}` if :math:`A > 0` else :math:`\tau_{neg}`:

    .. math::
        f_\tau(r) = \frac{4}{\tau}\,\sigma\big(\tau (r - 1)\big), \qquad \ell = -f_\tau(r)\,A

    :math:`f'_\tau(1) = 1`, so on-policy the gradient is the plain policy gradient; away from
    :math:`r = 1` it decays smoothly instead of being cut off. :math:`\tau_{neg} > \tau_{pos}`
    damps negative-advantage updates faster. :math:`\log r` is clamped to +-20 (as verl).

    Difference from verl: verl's ``compute_policy_loss_sapo`` ignores its ``loss_agg_mode`` and
    always uses ``"seq-mean-token-mean"``; here that is the default of ``agg``, which can be changed.

    Metrics: ``ppo_kl`` [``actor/ppo_kl``]; verl's clip fractions are constant 0 and left out.
    """
    _check_inputs(logprobs, old_logprobs, advantages, response_mask, is_weights)
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"tau_pos and tau_neg must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")

    log_ratio = _log_ratio(logprobs, old_logprobs, response_mask).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, _scalar(tau_pos, ratio), _scalar(tau_neg, ratio))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss_mat = _apply_is_weights(-gate * advantages, is_weights)
    loss = aggregate(loss_mat, response_mask, mode=agg, norms=norms, horizon=horizon)

    with torch.no_grad():
        metrics = {"ppo_kl": -log_ratio.sum() / _token_count(response_mask)}
    return loss, metrics


# ----------------------------------------------------------------------------------------------------
# CISPO


@refuse_verl_keywords(**VERL_POLICY_LOSS_KEYWORDS)
def cispo_policy_loss(
    logprobs: Tensor,
    *,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    behaviour_logprobs: Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    seed: int = 0,
    agg: AggMode = "token-mean",
    norms: Normalizers | None = None,
    horizon: int | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    r"""Clipped IS-weight Policy Optimization: REINFORCE with a clipped, stop-gradient ratio.

    CISPO (MiniMax-M1, https://arxiv.org/abs/2506.13585):

    .. math::
        \ell = -\,\mathrm{sg}\big[\mathrm{clip}(r, 1-\epsilon_{low}, 1+\epsilon_{high})\big]\,A\,\log\pi

    Unlike PPO no token's gradient is dropped: clipping only bounds its weight. The paper uses no
    lower bound (a large ``clip_low`` close to 1) and a modest ``clip_high``; the defaults here are
    verl's (0.2 / 0.2). :math:`\log r` is clamped to +-20 (as verl).

    Metrics: ``clip_frac`` [``actor/pg_clipfrac``]: tokens whose ratio was clipped (either side);
    ``ppo_kl`` [``actor/ppo_kl``]. verl's ``actor/pg_clipfrac_lower`` is a constant 0 and left out.
    """
    _check_inputs(logprobs, old_logprobs, advantages, response_mask, is_weights)
    low, high = _clip_bounds(clip_low, clip_high)

    log_ratio = _log_ratio(logprobs, old_logprobs, response_mask).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        weight = ratio.clamp(1.0 - low, 1.0 + high)
    safe_logprobs = torch.where(response_mask, logprobs, 0.0)
    loss_mat = _apply_is_weights(-(weight * advantages) * safe_logprobs, is_weights)
    loss = aggregate(loss_mat, response_mask, mode=agg, norms=norms, horizon=horizon)

    with torch.no_grad():
        count = _token_count(response_mask)
        metrics = {
            # padding has ratio exactly 1, never clipped
            "clip_frac": (ratio != weight).sum() / count,
            "ppo_kl": -log_ratio.sum() / count,
        }
    return loss, metrics


# ----------------------------------------------------------------------------------------------------
# GPG


@refuse_verl_keywords(**VERL_POLICY_LOSS_KEYWORDS)
def gpg_policy_loss(
    logprobs: Tensor,
    *,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    behaviour_logprobs: Tensor | None = None,
    seed: int = 0,
    agg: AggMode = "token-mean",
    norms: Normalizers | None = None,
    horizon: int | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    r"""Group Policy Gradient: the plain REINFORCE loss, no ratio and no clipping.

    GPG (https://arxiv.org/abs/2504.02546): :math:`\ell = -A\,\log\pi`. ``old_logprobs`` is accepted
    for a uniform signature and only shape-checked. Metrics: none (as verl).
    """
    _check_inputs(logprobs, old_logprobs, advantages, response_mask, is_weights)
    safe_logprobs = torch.where(response_mask, logprobs, 0.0)
    loss_mat = _apply_is_weights(-safe_logprobs * advantages, is_weights)
    return aggregate(loss_mat, response_mask, mode=agg, norms=norms, horizon=horizon), {}


# ----------------------------------------------------------------------------------------------------
# Clip-Cov and KL-Cov (covariance-based token selection)


def _centered_covariance(advantages: Tensor, logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """Per-token :math:`(A - \\bar A)(\\log\\pi - \\overline{\\log\\pi})` with masked means (no grad)."""
    adv_mean = masked_mean(advantages, response_mask)
    logp_mean = masked_mean(logprobs, response_mask)
    return (advantages - adv_mean) * (logprobs - logp_mean)


def _rank(keys: Tensor, *, descending: bool) -> Tensor:
    """Position of each element of ``keys`` (any shape) in its sorted order, as int64 of the same shape."""
    flat = keys.reshape(-1)
    order = torch.argsort(flat, descending=descending, stable=True)
    return torch.argsort(order).reshape(keys.shape)


def _selection_size(ratio: float, response_mask: Tensor) -> Tensor:
    """``max(floor(ratio * n_tokens), 1)`` computed in float64, as verl's Python ``int(ratio * n)``."""
    return torch.floor(response_mask.sum().to(torch.float64) * ratio).clamp(min=1)


@refuse_verl_keywords(**VERL_POLICY_LOSS_KEYWORDS)
def clip_cov_policy_loss(
    logprobs: Tensor,
    *,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    behaviour_logprobs: Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    seed: int = 0,
    generator: torch.Generator | None = None,
    agg: AggMode = "token-mean",
    norms: Normalizers | None = None,
    horizon: int | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    r"""Clip-Cov: PPO loss with the gradient cut for a few random high-covariance tokens.

    From "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models"
    (https://arxiv.org/abs/2505.22617). Per token the centred covariance
    :math:`c_{it} = (A_{it} - \bar A)(\log\pi_{it} - \overline{\log\pi})` (masked means over this call)
    drives entropy collapse. Among tokens not already clipped by PPO and with
    :math:`lb < c_{it} < ub`, :math:`k = \max(\lfloor \rho N \rfloor, 1)` are picked uniformly at random
    (:math:`N` tokens in the mask, :math:`\rho` = ``clip_cov_ratio``) and their loss (and gradient) is
    set to 0. The rest get the PPO clipped surrogate (no dual clip, no +-20 clamp, as verl).

    Randomness is explicit: the pick uses ``generator`` if given, else a fresh generator seeded with
    ``seed``, so the function is deterministic in its arguments. Pass a different ``seed`` per step
    (e.g. the global step) so different tokens are picked over training. verl draws from torch's global
    RNG (``torch.randperm``); the distribution of the pick is the same (a uniform k-subset of the
    candidates) but not the draws, so parity holds exactly when all candidates are picked.

    The covariance means and :math:`N` are per call (per micro-batch), as in verl: this loss is not
    exactly additive over micro-batches.

    Metrics: ``clip_frac`` [``actor/pg_clipfrac``]: fraction of tokens picked by the covariance rule;
    ``ppo_kl`` [``actor/ppo_kl``].
    """
    _check_inputs(logprobs, old_logprobs, advantages, response_mask, is_weights)
    low, high = _clip_bounds(clip_low, clip_high)
    if not clip_cov_ratio > 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {clip_cov_ratio}")

    log_ratio = _log_ratio(logprobs, old_logprobs, response_mask)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - low, 1.0 + high)

    with torch.no_grad():
        cov = _centered_covariance(advantages, logprobs.detach(), response_mask)
        candidate = response_mask & ~(clipped > unclipped) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
        if generator is None:
            generator = torch.Generator(device=advantages.device).manual_seed(seed)
        keys = torch.rand(advantages.shape, generator=generator, device=advantages.device)
        keys = torch.where(candidate, keys, 2.0)  # non-candidates sort last
        picked = candidate & (_rank(keys, descending=False) < _selection_size(clip_cov_ratio, response_mask))

    loss_mat = torch.where(picked, 0.0, torch.maximum(unclipped, clipped))
    loss_mat = _apply_is_weights(loss_mat, is_weights)
    loss = aggregate(loss_mat, response_mask, mode=agg, norms=norms, horizon=horizon)

    with torch.no_grad():
        count = _token_count(response_mask)
        metrics = {"clip_frac": picked.sum() / count, "ppo_kl": -log_ratio.sum() / count}
    return loss, metrics


@refuse_verl_keywords(**VERL_POLICY_LOSS_KEYWORDS)
def kl_cov_policy_loss(
    logprobs: Tensor,
    *,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    behaviour_logprobs: Tensor | None = None,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 0.1,
    seed: int = 0,
    agg: AggMode = "token-mean",
    norms: Normalizers | None = None,
    horizon: int | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    r"""KL-Cov: unclipped policy gradient plus a KL penalty on the highest-covariance tokens.

    From https://arxiv.org/abs/2505.22617. With :math:`r = \pi / \pi_{old}` and the centred covariance
    :math:`c_{it}` (as in :func:`clip_cov_policy_loss`), the :math:`k = \max(\lfloor \rho N \rfloor, 1)`
    tokens with the largest :math:`c_{it}` (:math:`\rho` = ``kl_cov_ratio``) get

    .. math:: \ell = -rA + \beta\,|\log r|

    and the rest :math:`\ell = -rA` (:math:`\beta` = ``ppo_kl_coef``; no clipping, no +-20 clamp).
    Deterministic: the top-k is a stable sort (ties go to the earlier token; verl's ``torch.topk`` does
    not specify its tie order). Selection statistics are per call, as in verl.

    Metrics: ``ppo_kl_abs`` [verl's ``actor/ppo_kl``, which for this loss is the mean of
    :math:`|\log r|`]; ``kl_cov_frac``: fraction of tokens given the penalty (not in verl).
    """
    _check_inputs(logprobs, old_logprobs, advantages, response_mask, is_weights)
    if not kl_cov_ratio > 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {kl_cov_ratio}")

    log_ratio = _log_ratio(logprobs, old_logprobs, response_mask)
    abs_log_ratio = log_ratio.abs()
    surrogate = -advantages * torch.exp(log_ratio)

    with torch.no_grad():
        cov = _centered_covariance(advantages, logprobs.detach(), response_mask)
        keys = torch.where(response_mask, cov, -math.inf)
        picked = response_mask & (_rank(keys, descending=True) < _selection_size(kl_cov_ratio, response_mask))

    loss_mat = torch.where(picked, surrogate + ppo_kl_coef * abs_log_ratio, surrogate)
    loss_mat = _apply_is_weights(loss_mat, is_weights)
    loss = aggregate(loss_mat, response_mask, mode=agg, norms=norms, horizon=horizon)

    with torch.no_grad():
        count = _token_count(response_mask)
        metrics = {"ppo_kl_abs": abs_log_ratio.sum() / count, "kl_cov_frac": picked.sum() / count}
    return loss, metrics


# ----------------------------------------------------------------------------------------------------
# GMPO


@refuse_verl_keywords(**VERL_POLICY_LOSS_KEYWORDS)
def gmpo_policy_loss(
    logprobs: Tensor,
    *,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    behaviour_logprobs: Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    seed: int = 0,
    agg: AggMode = "seq-mean-token-mean",
    norms: Normalizers | None = None,
    horizon: int | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    r"""Geometric-Mean Policy Optimization: the sequence ratio is the geometric mean of token ratios.

    GMPO (https://arxiv.org/abs/2507.20673; verl's ``"geo_mean"``). Token log-ratios are clipped in
    log space, on the side the advantage's sign selects, then averaged over the sequence:

    .. math::
        \rho_{it} = \mathrm{sgn}(A_{it}) \min\big(\mathrm{sgn}(A_{it}) \log r_{it},\
                    \mathrm{sgn}(A_{it}) \,\mathrm{clamp}(\log r_{it}, -\epsilon_{low}, \epsilon_{high})\big)

    .. math::
        \ell_i = -\bar A_i \exp\Big(\frac{1}{|y_i|}\sum_t \rho_{it}\Big), \qquad
        \bar A_i = \frac{1}{|y_i|}\sum_t A_{it}

    Note the clip range is on :math:`\log r` (the paper uses :math:`\epsilon = 0.4`; the default here
    is verl's shared ``clip_ratio`` 0.2). ``advantages`` should be constant along a sequence
    (outcome advantages); the mean is taken anyway. With ``is_weights`` the sequence loss is
    multiplied by their masked geometric mean :math:`\exp(\mathrm{mean}_t \log(w_{it} + 10^{-10}))`
    (as verl). The per-sequence loss is broadcast over the sequence's tokens and aggregated with
    ``agg``.

    Difference from verl: verl's ``compute_policy_loss_geo_mean`` ignores its ``loss_agg_mode`` and
    the global batch info and returns the plain mean over the micro-batch's rows, counting rows with
    an empty mask. Here the default ``"seq-mean-token-mean"`` gives that same mean over non-empty
    rows, divided by the global sequence count from ``norms``, so it accumulates over micro-batches.

    Metrics: ``clip_frac`` [``actor/pg_clipfrac``]: tokens with :math:`A > 0` whose log-ratio is
    outside :math:`[-\epsilon_{low}, \epsilon_{high}]`; ``clip_frac_lower`` [``actor/pg_clipfrac_lower``]:
    the same for :math:`A < 0`. As in verl, either side counts, though only one side changes the
    loss for a given sign. ``ppo_kl`` [``actor/ppo_kl``].
    """
    _check_inputs(logprobs, old_logprobs, advantages, response_mask, is_weights)
    low, high = _clip_bounds(clip_low, clip_high)

    log_ratio = _log_ratio(logprobs, old_logprobs, response_mask)
    clamped = log_ratio.clamp(-low, high)
    sign = torch.sign(advantages)
    token_log_ratio = sign * torch.minimum(sign * log_ratio, sign * clamped)
    token_log_ratio = torch.where(response_mask, token_log_ratio, 0.0)  # sign(NaN) is NaN in padding
    lengths = response_mask.sum(dim=-1).clamp(min=1)
    seq_ratio = torch.exp(token_log_ratio.sum(dim=-1) / lengths)
    seq_adv = masked_sum(advantages, response_mask, dim=-1) / lengths
    seq_loss = -seq_adv * seq_ratio
    if is_weights is not None:
        log_w = torch.log(is_weights.detach() + 1e-10)
        seq_loss = seq_loss * torch.exp(masked_sum(log_w, response_mask, dim=-1) / lengths)
    loss_mat = seq_loss.unsqueeze(-1).expand_as(log_ratio)
    loss = aggregate(loss_mat, response_mask, mode=agg, norms=norms, horizon=horizon)

    with torch.no_grad():
        count = _token_count(response_mask)
        was_clipped = log_ratio != clamped  # padding: 0 is inside the range
        metrics = {
            "clip_frac": (was_clipped & (advantages > 0)).sum() / count,
            "clip_frac_lower": (was_clipped & (advantages < 0)).sum() / count,
            "ppo_kl": -log_ratio.sum() / count,
        }
    return loss, metrics


vanilla_policy_loss = with_defaults(
    ppo_policy_loss,
    "vanilla_policy_loss",
    """verl's ``vanilla`` policy loss: :func:`ppo_policy_loss` with verl's defaults, dual clip on at 3.0.

    verl's ``compute_policy_loss_vanilla`` (verl/trainer/ppo/core_algos.py) reads
    ``config.get("clip_ratio_c", 3.0)`` and always applies the dual clip; a port that asks for ``"vanilla"``
    gets that behaviour here too (``dual_clip=None`` turns it off, which verl cannot). Everything else,
    arguments and metrics included, is :func:`ppo_policy_loss`'s.
    """,
    dual_clip=3.0,
)
