r"""KL divergence between the policy and the reference policy: per-token estimators, the KL loss, the KL
reward penalty, and KL coefficient controllers (as pure ``state -> state`` functions).

Only the log-probabilities of the *sampled* tokens are available, so ``KL(pi || pi_ref)`` is estimated
from :math:`\log r = \log \pi_{ref}(y) - \log \pi(y)` with ``y ~ pi`` (J. Schulman, "Approximating KL
divergence", 2020, http://joschu.net/blog/kl-approx.html):

- ``k1`` :math:`= -\log r`: unbiased, high variance, can be negative.
- ``k2`` :math:`= \tfrac12 (\log r)^2`: biased, low variance, always >= 0; its *gradient* is an unbiased
  estimate of the gradient of ``KL`` (with samples from the current policy).
- ``k3`` :math:`= r - 1 - \log r`: unbiased, low variance, always >= 0.
- ``abs`` :math:`= |\log r|`.

In :func:`kl_penalty`, :func:`kl_loss` and :func:`apply_kl_penalty_to_rewards` every argument after the
first tensor is keyword-only, so a call ported from verl cannot pair the tensors in the wrong order.
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Literal

import torch
from torch import Tensor

from rlfunc.aggregation import AggMode, Normalizers, aggregate
from rlfunc.checks import check_floating, check_mask, check_same_shape, is_transformed
from rlfunc.masked import masked_fill_zero, masked_mean
from rlfunc.tree import pytree_dataclass

__all__ = [
    "KLKind",
    "KL_KINDS",
    "kl_penalty",
    "kl_loss",
    "apply_kl_penalty_to_rewards",
    "KLControllerState",
    "fixed_kl_controller",
    "adaptive_kl_controller",
    "update_kl_controller",
]

KLKind = Literal[
    "k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl",
    "k1+", "kl+", "abs+", "k2+", "mse+", "k3+", "low_var_kl+",
]  # fmt: skip

# Canonical name of each base kind (verl's aliases on the right).
_BASE_KINDS = MappingProxyType(
    {"k1": "k1", "kl": "k1", "abs": "abs", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}
)
KL_KINDS: tuple[str, ...] = tuple(_BASE_KINDS) + tuple(k + "+" for k in _BASE_KINDS)

# verl clamps log r to [-20, 20] before exp and k3 to [-10, 10]: a token whose log-ratio is beyond e^10
# contributes a bounded penalty (and no gradient) instead of overflowing.
_K3_LOG_RATIO_CLAMP = 20.0
_K3_CLAMP = 10.0


def _resolve_kind(kind: str) -> tuple[str, bool]:
    """``kind -> (canonical base kind, straight_through)``; ``ValueError`` listing the known kinds."""
    if not isinstance(kind, str) or kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator kind {kind!r}; known kinds: {', '.join(KL_KINDS)}")
    straight_through = kind.endswith("+")
    return _BASE_KINDS[kind.rstrip("+")], straight_through


def _kl_value(logprobs: Tensor, ref_logprobs: Tensor, base: str) -> Tensor:
    diff = logprobs - ref_logprobs  # log pi - log pi_ref = -log r
    if base == "k1":
        return diff
    if base == "abs":
        return diff.abs()
    if base == "k2":
        return 0.5 * diff.square()
    # k3 = r - 1 - log r with log r = -diff
    log_ratio = torch.clamp(-diff, min=-_K3_LOG_RATIO_CLAMP, max=_K3_LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-_K3_CLAMP, max=_K3_CLAMP)


def kl_penalty(logprobs: Tensor, *, ref_logprobs: Tensor, kind: KLKind = "k1") -> Tensor:
    r"""Per-token estimate of :math:`KL(\pi \| \pi_{ref})` from sampled-token log-probs: ``(b t), (b t) -> (b t)``.

    With :math:`\log r = \log\pi_{ref}(y) - \log\pi(y)` (http://joschu.net/blog/kl-approx.html):

    - ``"k1"`` / ``"kl"``: :math:`-\log r`
    - ``"abs"``: :math:`|\log r|`
    - ``"k2"`` / ``"mse"``: :math:`\tfrac12 (\log r)^2`
    - ``"k3"`` / ``"low_var_kl"``: :math:`r - 1 - \log r`, with :math:`\log r` clamped to [-20, 20] and the
      result to [-10, 10] (as verl; outside the clamps the gradient is 0)
    - ``"<kind>+"`` (straight-through): the *value* of ``<kind>`` with the *gradient* of ``k2``,
      :math:`\nabla \tfrac12(\log r)^2`, whose expectation under :math:`\pi` is the true gradient of the KL
      (k1's and k3's expected gradients are not). Computed as ``k2 - k2.detach() + value.detach()``.

    Elementwise, so any shape works (the two inputs must match); NaN in gives NaN out at that position
    only (no host sync here; :func:`kl_loss` checks the masked positions). Inputs below fp32 are computed in
    fp32 (the estimators need the precision). Same numbers as verl 0.9.1's
    ``core_algos.kl_penalty`` in fp32; ``"full"`` (the exact KL over the vocabulary) is not provided
    here, as verl raises ``NotImplementedError`` for it.
    """
    base, straight_through = _resolve_kind(kind)
    _check_logprob_pair(logprobs, ref_logprobs)
    logprobs, ref_logprobs = _at_least_fp32(logprobs), _at_least_fp32(ref_logprobs)
    value = _kl_value(logprobs, ref_logprobs, base)
    if not straight_through or base == "k2":
        return value
    k2 = _kl_value(logprobs, ref_logprobs, "k2")
    return k2 - k2.detach() + value.detach()


def kl_loss(
    logprobs: Tensor,
    *,
    ref_logprobs: Tensor,
    mask: Tensor,
    kind: KLKind = "low_var_kl",
    agg: AggMode = "token-mean",
    norms: Normalizers | None = None,
    horizon: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""KL regulariser of the policy loss: :func:`kl_penalty` aggregated over the loss mask.

    ``logprobs (b t)`` (differentiable, current policy), ``ref_logprobs (b t)``, ``mask (b t)`` bool.
    Returns ``(loss, metrics)``; the loss is *not* multiplied by the KL coefficient (the caller adds
    ``kl_coef * loss``, as verl's ``actor.kl_loss_coef``). ``agg``, ``norms`` and ``horizon`` go to
    :func:`rlfunc.aggregation.aggregate` (global normalisers for accumulation / data parallelism).

    Metrics (detached tensors): ``kl_loss`` (the loss) and ``kl_mean`` (token mean of the estimate over
    this batch's mask). verl 0.9.1 (``workers/utils/losses.py``) computes the same loss with its
    ``kl_loss_type`` default ``"low_var_kl"``, the default here too.

    Raises ``ValueError`` on a shape mismatch or NaN at a masked position (outside the mask anything goes).
    """
    _check_logprob_pair(logprobs, ref_logprobs)
    check_same_shape("logprobs", logprobs, mask=mask)
    check_mask("mask", mask)
    _check_no_nan("logprobs", logprobs, mask)
    _check_no_nan("ref_logprobs", ref_logprobs, mask)
    kld = kl_penalty(logprobs, ref_logprobs=ref_logprobs, kind=kind)
    loss = aggregate(kld, mask, mode=agg, norms=norms, horizon=horizon)
    metrics = {"kl_loss": loss.detach(), "kl_mean": masked_mean(kld.detach(), mask)}
    return loss, metrics


def apply_kl_penalty_to_rewards(
    token_rewards: Tensor,
    *,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    beta: float | Tensor,
    kind: KLKind = "k1",
) -> tuple[Tensor, Tensor]:
    r"""Subtract a KL penalty from per-token rewards (KL in the reward, as in InstructGPT / PPO-RLHF).

    .. math:: \tilde r_{it} = r_{it} - \beta\, m_{it}\, \widehat{KL}_{it}, \qquad
              \overline{KL} = \frac1B \sum_i \frac{\sum_t m_{it} \widehat{KL}_{it}}{\sum_t m_{it}}

    ``token_rewards, logprobs, ref_logprobs (b t)``, ``mask (b t)`` bool, ``beta`` a float or a 0-d tensor
    (e.g. ``KLControllerState.beta``). Returns ``(new token_rewards, observed KL)``, the observed KL being
    the batch mean of per-sequence mean KL (0-d tensor), which is what :func:`update_kl_controller` takes
    (with ``n_steps = b``). Pure: nothing is updated here.

    Same numbers as verl 0.9.1's ``ray_trainer.apply_kl_penalty`` (default kind ``"kl"``), except that
    positions outside the mask are selected away (verl multiplies by the mask, so a NaN there would leak)
    and the per-sequence mean divides by ``max(count, 1)`` rather than ``count + 1e-8`` (a relative
    difference below fp32 epsilon; an empty sequence gives 0 in both).

    Raises ``ValueError`` on a shape mismatch, NaN at a masked position, or non-finite rewards there.
    """
    _check_logprob_pair(logprobs, ref_logprobs)
    if not isinstance(token_rewards, Tensor):
        raise TypeError(f"token_rewards must be a torch.Tensor, got {type(token_rewards).__name__}")
    check_floating("token_rewards", token_rewards)
    check_same_shape("logprobs", logprobs, token_rewards=token_rewards, mask=mask)
    check_mask("mask", mask)
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must have shape (b, t), got {tuple(logprobs.shape)}")
    _check_no_nan("logprobs", logprobs, mask)
    _check_no_nan("ref_logprobs", ref_logprobs, mask)
    _check_all_finite("token_rewards", token_rewards, mask)
    if isinstance(beta, Tensor):
        if beta.dim() != 0:
            raise ValueError(f"beta must be a float or a 0-d tensor, got shape {tuple(beta.shape)}")
    elif not isinstance(beta, (int, float)) or isinstance(beta, bool) or not math.isfinite(beta):
        raise ValueError(f"beta must be a finite float or a 0-d tensor, got {beta!r}")
    kld = masked_fill_zero(kl_penalty(logprobs, ref_logprobs=ref_logprobs, kind=kind), mask)
    new_rewards = token_rewards - beta * kld
    observed_kl = masked_mean(kld, mask, dim=-1).mean()
    return new_rewards, observed_kl


# ---------------------------------------------------------------------------------------------------------
# KL coefficient controllers


@pytree_dataclass
class KLControllerState:
    """State of a KL coefficient controller: every field is a 0-d float64 tensor (or ``None``).

    - ``beta``: the current coefficient.
    - ``target_kl``, ``horizon``: set for the adaptive controller, ``None`` for the fixed one (``None``
      fields are empty subtrees, so a fixed controller's only leaf is ``beta``).

    Why tensors, not Python floats: the observed KL comes out of the batch as a device tensor, so the
    update ``beta *= 1 + err * n / horizon`` and the use of ``beta`` in the reward need no ``Tensor.item`` call
    (the only host read is :func:`update_kl_controller`'s finiteness check of the observed KL, one per
    step); every leaf is a tensor, so ``tree_map`` (``.to(device)``, checkpoint state dicts) and
    ``torch.func`` apply. float64 so that a long run tracks verl's Python-float arithmetic (and a 0-d
    tensor does not promote the fp32 tensors it multiplies). Read it with ``float(state.beta)`` when
    logging.
    """

    beta: Tensor
    target_kl: Tensor | None = None
    horizon: Tensor | None = None

    @property
    def is_adaptive(self) -> bool:
        return self.target_kl is not None


def _scalar(name: str, value: float | Tensor) -> Tensor:
    if isinstance(value, Tensor):
        if value.dim() != 0:
            raise ValueError(f"{name} must be a scalar, got shape {tuple(value.shape)}")
        return value.to(torch.float64)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return torch.tensor(float(value), dtype=torch.float64)


def fixed_kl_controller(beta: float) -> KLControllerState:
    """A constant coefficient (verl's ``FixedKLController``; ``algorithm.kl_ctrl.type=fixed``)."""
    if not isinstance(beta, Tensor) and isinstance(beta, (int, float)) and beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    return KLControllerState(beta=_scalar("beta", beta))


def adaptive_kl_controller(init_beta: float, *, target_kl: float, horizon: int | float) -> KLControllerState:
    r"""Adaptive coefficient of Ziegler et al. 2019 (https://arxiv.org/abs/1909.08593), verl's
    ``AdaptiveKLController`` (``algorithm.kl_ctrl.type=adaptive``, ``kl_coef``, ``target_kl``, ``horizon``).

    See :func:`update_kl_controller` for the update rule. Requires ``init_beta >= 0``, ``target_kl > 0``
    and ``horizon > 0``.
    """
    for name, value, positive in (
        ("init_beta", init_beta, False),
        ("target_kl", target_kl, True),
        ("horizon", horizon, True),
    ):
        if not isinstance(value, Tensor) and isinstance(value, (int, float)) and not isinstance(value, bool):
            if (value <= 0) if positive else (value < 0):
                raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'}, got {value}")
    return KLControllerState(
        beta=_scalar("init_beta", init_beta),
        target_kl=_scalar("target_kl", target_kl),
        horizon=_scalar("horizon", horizon),
    )


def update_kl_controller(
    state: KLControllerState, *, observed_kl: float | Tensor, n_steps: int | Tensor
) -> KLControllerState:
    r"""Return the controller state after observing ``observed_kl`` over ``n_steps`` samples.

    Adaptive (Ziegler et al. 2019, https://arxiv.org/abs/1909.08593):

    .. math:: e = \mathrm{clip}(KL_{obs} / KL_{target} - 1, -0.2, 0.2), \qquad
              \beta \leftarrow \beta\,(1 + e\, n / H)

    Fixed: the state is returned unchanged. Same numbers as verl's ``AdaptiveKLController.update`` /
    ``FixedKLController.update`` (verl calls it with ``n_steps = batch size``). The input state is not
    modified. Raises ``ValueError`` on a non-finite observed KL (outside ``torch.func`` transforms).
    """
    if not isinstance(state, KLControllerState):
        raise TypeError(f"state must be a KLControllerState, got {type(state).__name__}")
    kl = observed_kl if isinstance(observed_kl, Tensor) else torch.tensor(float(observed_kl), dtype=torch.float64)
    if kl.dim() != 0:
        raise ValueError(f"observed_kl must be a scalar, got shape {tuple(kl.shape)}")
    if not is_transformed(kl) and not bool(torch.isfinite(kl)):
        raise ValueError(f"observed_kl must be finite, got {kl}")
    if not state.is_adaptive:
        return state
    error = torch.clamp(kl.to(torch.float64) / state.target_kl - 1.0, -0.2, 0.2)
    return state.replace(beta=state.beta * (1.0 + error * n_steps / state.horizon))


# ---------------------------------------------------------------------------------------------------------
# Checks


def _check_logprob_pair(logprobs: Tensor, ref_logprobs: Tensor) -> None:
    for name, x in (("logprobs", logprobs), ("ref_logprobs", ref_logprobs)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        check_floating(name, x)
    check_same_shape("logprobs", logprobs, ref_logprobs=ref_logprobs)


def _at_least_fp32(x: Tensor) -> Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _check_no_nan(name: str, x: Tensor, mask: Tensor) -> None:
    """NaN at a masked position is a bug upstream; ``-inf`` is legal (a token the reference rules out)."""
    if is_transformed(x) or is_transformed(mask):
        return
    bad = torch.isnan(x) & mask
    if bool(bad.any()):
        idx = tuple(bad.nonzero()[0].tolist())
        raise ValueError(f"{name} contains NaN at index {idx} inside the mask")


def _check_all_finite(name: str, x: Tensor, mask: Tensor) -> None:
    if is_transformed(x) or is_transformed(mask):
        return
    bad = ~torch.isfinite(x) & mask
    if bool(bad.any()):
        idx = tuple(bad.nonzero()[0].tolist())
        raise ValueError(f"{name} contains a non-finite value ({x[idx]}) at index {idx} inside the mask")
