r"""The PPO critic loss: squared error to the returns, with the prediction's move clipped around the old value.

Same conventions as :mod:`rlfunc.policy_losses`: ``(loss, metrics)`` with a scalar loss and detached
scalar-tensor metrics, the loss matrix reduced by :func:`rlfunc.aggregation.aggregate` with the global
``norms``, padding never reaching the loss or the gradient (NaN there included).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlfunc.aggregation import AggMode, Normalizers, aggregate
from rlfunc.checks import bind, check_floating, check_mask
from rlfunc.signatures import refuse_verl_keywords

__all__ = ["value_loss"]


@refuse_verl_keywords(
    vpreds="new_values (the first argument: the prediction being trained)",
    values="old_values (verl's `values` is the prediction when the batch was collected)",
    cliprange_value="clip_range",
    loss_agg_mode="agg",
)
def value_loss(
    new_values: Tensor,
    *,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    clip_range: float | None = 0.2,
    agg: AggMode = "token-mean",
    norms: Normalizers | None = None,
    horizon: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""Clipped value loss (PPO, https://arxiv.org/abs/1707.06347; as in OpenAI baselines / TRL / verl).

    With :math:`V` the new prediction, :math:`V_{old}` the prediction when the batch was collected,
    :math:`R` the return target and :math:`\epsilon` = ``clip_range``:

    .. math::
        V^{clip} = \mathrm{clamp}(V, V_{old} - \epsilon, V_{old} + \epsilon), \qquad
        \ell = \tfrac12 \max\big((V - R)^2,\ (V^{clip} - R)^2\big)

    aggregated with ``agg``. The max makes the clip pessimistic: a prediction may move past
    :math:`V_{old} \pm \epsilon` only where that reduces the error. ``clip_range=None`` gives the
    plain :math:`\tfrac12 (V - R)^2`.

    Shapes: ``new_values``, ``old_values``, ``returns``, ``response_mask`` (bool) all ``(b t)``.

    Metrics (verl's ``critic/*`` key in brackets): ``vf_clipfrac`` [``vf_clipfrac``]: tokens where the
    clipped error is the larger one (0 when unclipped); ``vpred_mean`` [``vpred_mean``]: masked mean of
    ``new_values``.

    Names that cannot be mixed up with verl's: verl's ``compute_value_loss(vpreds, returns, values, ...)``
    (verl/trainer/ppo/core_algos.py) calls the new prediction ``vpreds`` and the *old* one ``values``, in the
    order (new, returns, old). Here the tensors are ``new_values`` and ``old_values``, everything after
    ``new_values`` is keyword-only (a positional port raises ``TypeError``), and a by-name port with verl's
    keywords (``vpreds=``, ``values=``, ``cliprange_value=``, ``loss_agg_mode=``) raises ``TypeError`` naming
    these, instead of computing a different loss.

    Other differences from verl: ``clip_range`` defaults to 0.2 (verl's critic config
    default ``cliprange_value`` is 0.5) and may be ``None``; no ``dp_size`` factor (see
    :mod:`rlfunc.aggregation`).
    """
    bind(
        {
            "new_values": (new_values, "b t"),
            "old_values": (old_values, "b t"),
            "returns": (returns, "b t"),
            "response_mask": (response_mask, "b t"),
        }
    )
    check_mask("response_mask", response_mask)
    for name, x in (("new_values", new_values), ("old_values", old_values), ("returns", returns)):
        check_floating(name, x)
    if clip_range is not None and not clip_range >= 0:
        raise ValueError(f"clip_range must be >= 0 or None, got {clip_range}")

    # Select before squaring: NaN in padding stays out of the forward and the backward.
    error = torch.where(response_mask, new_values - returns, 0.0)
    sq_error = error.square()
    if clip_range is None:
        loss_mat = sq_error
        clipped_wins = None
    else:
        clipped_values = torch.clamp(new_values, old_values - clip_range, old_values + clip_range)
        clipped_sq_error = torch.where(response_mask, clipped_values - returns, 0.0).square()
        loss_mat = torch.maximum(sq_error, clipped_sq_error)
        clipped_wins = clipped_sq_error > sq_error  # padding: 0 > 0 is false
    loss = 0.5 * aggregate(loss_mat, response_mask, mode=agg, norms=norms, horizon=horizon)

    with torch.no_grad():
        count = response_mask.sum().clamp(min=1)
        metrics = {
            "vf_clipfrac": clipped_wins.sum() / count if clipped_wins is not None else torch.zeros_like(loss),
            "vpred_mean": torch.where(response_mask, new_values, 0.0).sum() / count,
        }
    return loss, metrics
