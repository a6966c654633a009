"""Reduce a per-token loss matrix to a scalar, with the global normalisers passed in explicitly.

With data parallelism and gradient accumulation every rank sees only a micro-batch. The loss of the
global batch is a sum of per-micro-batch terms only if each term is divided by the *global* count of
tokens (or sequences). :class:`Normalizers` carries those counts; the backend sums
:func:`local_normalizers` over micro-batches and all-reduces them over ranks, then calls the loss on each
micro-batch. Summing the resulting micro-batch losses (and gradients) over micro-batches and ranks gives
exactly the full-batch loss (and gradient).

Unlike verl's ``agg_loss`` nothing here multiplies by the data-parallel size: the backend owns the
gradient reduction (it sums, FSDP's default averages), and compensates there.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

from rlfunc.checks import check_mask, check_same_shape
from rlfunc.masked import masked_fill_zero
from rlfunc.signatures import refuse_verl_keywords
from rlfunc.tree import pytree_dataclass

__all__ = ["AggMode", "AGG_MODES", "Normalizers", "local_normalizers", "aggregate"]

AggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGG_MODES: tuple[str, ...] = get_args(AggMode)


@pytree_dataclass
class Normalizers:
    """Global counts a loss divides by: loss tokens, and sequences with at least one loss token."""

    num_tokens: Tensor  # () float
    num_seqs: Tensor  # () float

    def __add__(self, other: "Normalizers") -> "Normalizers":
        return Normalizers(num_tokens=self.num_tokens + other.num_tokens, num_seqs=self.num_seqs + other.num_seqs)


def local_normalizers(mask: Tensor) -> Normalizers:
    """Counts for one (micro-)batch; sum them over micro-batches and ranks for the global ones."""
    check_mask("mask", mask)
    return Normalizers(
        num_tokens=mask.sum().to(torch.float32),
        num_seqs=mask.any(dim=-1).sum().to(torch.float32),
    )


@refuse_verl_keywords(
    loss_mask="mask",
    loss_agg_mode="mode",
    dp_size="nothing: the backend owns the gradient reduction (module docstring); pass the global norms",
    batch_num_tokens="norms (the global counts, rlfunc.Normalizers)",
    global_batch_size="norms (the global counts, rlfunc.Normalizers)",
)
def aggregate(
    loss_mat: Tensor,
    mask: Tensor,
    *,
    mode: AggMode = "token-mean",
    norms: Normalizers | None = None,
    horizon: int | None = None,
) -> Tensor:
    r"""Aggregate ``loss_mat`` ``(b, t)`` over the true positions of ``mask`` ``(b, t)``.

    With :math:`\ell_{it}` the loss, :math:`m_{it}` the mask, :math:`N_{tok}`, :math:`N_{seq}` the global counts:

    - ``token-mean``: :math:`\sum_{it} m\ell / N_{tok}` (DAPO, https://arxiv.org/abs/2503.14476)
    - ``token-sum``: :math:`\sum_{it} m\ell`
    - ``seq-mean-token-sum``: :math:`\sum_i (\sum_t m\ell) / N_{seq}`
    - ``seq-mean-token-mean``: :math:`\sum_i (\sum_t m\ell / \sum_t m) / N_{seq}` (original GRPO)
    - ``seq-mean-token-sum-norm``: :math:`\sum_{it} m\ell / (N_{seq} H)` with a constant horizon
      :math:`H` (Dr.GRPO, https://arxiv.org/abs/2503.20783); ``horizon`` defaults to ``t``. Pass the
      configured maximum response length so that micro-batches padded to different lengths agree.

    ``norms=None`` uses this batch's own counts (no accumulation). Counts are clamped at 1, so an all-
    masked batch gives a loss of 0, not NaN.

    ``mode``, ``norms`` and ``horizon`` are keyword-only: verl's ``agg_loss(loss_mat, loss_mask, loss_agg_mode,
    dp_size, ...)`` has ``dp_size`` fourth, and a positional port would hand it to ``norms``; here it raises
    ``TypeError``, as do verl's keywords (``loss_agg_mode=``, ``dp_size=``, ...).
    """
    check_same_shape("loss_mat", loss_mat, mask=mask)
    check_mask("mask", mask)
    if loss_mat.dim() != 2:
        raise ValueError(f"loss_mat must have shape (b, t), got {tuple(loss_mat.shape)}")
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; known modes: {', '.join(AGG_MODES)}")
    masked = masked_fill_zero(loss_mat, mask)
    if mode == "token-sum":
        return masked.sum()
    if mode == "token-mean":
        num_tokens = mask.sum().to(masked.dtype) if norms is None else norms.num_tokens
        return masked.sum() / num_tokens.clamp(min=1)
    num_seqs = (mask.any(dim=-1).sum().to(masked.dtype) if norms is None else norms.num_seqs).clamp(min=1)
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1).to(masked.dtype)
        return per_seq.sum() / num_seqs
    total = masked.sum() / num_seqs
    if mode == "seq-mean-token-sum-norm":
        total = total / (loss_mat.shape[-1] if horizon is None else horizon)
    return total
