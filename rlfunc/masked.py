"""Masked reductions over token tensors.

Positions outside the mask never reach a result, even when they hold NaN or inf: every op selects with
``torch.where`` before reducing, rather than multiplying by the mask (``0 * nan`` is ``nan``).
An empty mask gives 0 for sums and means, and 0 variance, never NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlfunc.checks import check_mask, check_same_shape

__all__ = ["masked_sum", "masked_mean", "masked_var", "masked_whiten", "masked_moments", "masked_fill_zero"]

Dim = int | tuple[int, ...] | None


def _check_dim(dim: Dim) -> None:
    """Reject ``dim=True/False``: ``bool`` is an ``int``, and torch would read it as dimension 1 or 0.

    The usual source is a verl port: verl's ``masked_var(values, mask, unbiased=True)`` is often called
    positionally as ``masked_var(x, mask, True)``, where ``True`` lands in ``dim`` here.
    """
    if isinstance(dim, bool) or (isinstance(dim, tuple) and any(isinstance(d, bool) for d in dim)):
        raise TypeError(
            f"dim must be an int, a tuple of ints or None, got {dim!r}; for a Bessel correction pass "
            "unbiased= by keyword (masked_var(x, mask, unbiased=True))"
        )


def mask_weights(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """The bool mask as 0/1 weights of ``dtype``, for multiplying where every value is known finite.

    Through a uint8 view: bool kernels are much slower than uint8 ones on CPU. Not a substitute for
    selecting when values outside the mask may be NaN or inf (``0 * nan`` is ``nan``).
    """
    return mask.view(torch.uint8).to(dtype)


def masked_fill_zero(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` where ``mask`` is true, 0 elsewhere (NaN outside the mask is dropped)."""
    check_mask("mask", mask)
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, *, dim: Dim = None) -> Tensor:
    """Sum of ``x`` over the positions where ``mask`` is true."""
    _check_dim(dim)
    check_same_shape("x", x, mask=mask)
    return masked_fill_zero(x, mask).sum(dim=dim)


def _count(mask: Tensor, dim: Dim, dtype: torch.dtype) -> Tensor:
    return mask.sum(dim=dim).to(dtype)


def masked_mean(x: Tensor, mask: Tensor, *, dim: Dim = None) -> Tensor:
    """Mean over the masked positions; 0 where the mask is empty."""
    _check_dim(dim)
    total = masked_sum(x, mask, dim=dim)
    count = _count(mask, dim, total.dtype)
    return total / count.clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, *, dim: Dim = None, unbiased: bool = True) -> Tensor:
    """Variance over the masked positions (Bessel-corrected when ``unbiased``; 0 with < 2 elements).

    verl's ``masked_var`` divides by ``count - 1`` and raises on an empty mask; here an empty or
    single-element mask gives 0, so a one-token batch cannot produce NaN. ``unbiased`` is keyword-only
    (verl's third positional argument): ``masked_var(x, mask, True)`` raises a TypeError naming it.
    """
    _check_dim(dim)
    x = masked_fill_zero(x, mask)  # NaN outside the mask would otherwise poison the gradient of the mean
    mean = masked_mean(x, mask, dim=dim)
    mean = mean if dim is None else mean.unsqueeze(dim) if isinstance(dim, int) else _unsqueeze_all(mean, dim)
    centered_sq = masked_fill_zero((x - mean) ** 2, mask)
    total = centered_sq.sum(dim=dim)
    count = _count(mask, dim, total.dtype)
    denom = (count - 1) if unbiased else count
    return torch.where(count > int(unbiased), total / denom.clamp(min=1), torch.zeros_like(total))


def _unsqueeze_all(x: Tensor, dims: tuple[int, ...]) -> Tensor:
    for d in sorted(d % (x.dim() + len(dims)) for d in dims):
        x = x.unsqueeze(d)
    return x


def masked_whiten(
    x: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8, stats: tuple[Tensor, Tensor] | None = None
) -> Tensor:
    r"""Normalise ``x`` to zero mean and unit variance over the masked positions.

    .. math:: \hat x = (x - \mu) / \sqrt{\sigma^2 + \epsilon}

    with :math:`\mu, \sigma^2` the masked mean and unbiased variance (as verl's ``masked_whiten``).
    With ``shift_mean=False`` the mean is added back (only the scale changes). Positions outside the
    mask come out as 0.

    ``stats = (mean, var)`` (0-d tensors) whitens with moments computed elsewhere, e.g. over the
    whole data-parallel batch (verl whitens the global batch; a backend all-reduces
    :func:`masked_moments` and passes the result here).
    """
    check_same_shape("x", x, mask=mask)
    check_mask("mask", mask)
    # Three passes over the data (select, centre, scale); NaN outside the mask is selected away first.
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    if stats is None:
        count = mask.sum().to(x.dtype)
        mean = torch.where(mask, x, zero).sum() / count.clamp(min=1)
        centered = torch.where(mask, x - mean, zero)
        var = torch.where(count > 1, centered.square().sum() / (count - 1).clamp(min=1), zero)
    else:
        mean, var = (torch.as_tensor(s, dtype=x.dtype, device=x.device) for s in stats)
        if mean.dim() != 0 or var.dim() != 0:
            raise ValueError(
                f"stats must be two 0-d tensors (mean, var), got shapes {tuple(mean.shape)}, {tuple(var.shape)}"
            )
        centered = torch.where(mask, x - mean, zero)
    whitened = centered * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = torch.where(mask, whitened + mean, zero)
    return whitened


def masked_moments(x: Tensor, mask: Tensor, *, center: Tensor | None = None) -> Tensor:
    """``[count, sum, sum of squares about center]`` over the masked positions, as one ``(3,)`` tensor.

    Summable across shards: all-reduce the first two with ``center=None`` to get the global mean, then
    pass that mean as ``center`` and all-reduce again for the global centred sum of squares (two passes
    keep the variance accurate where ``E[x^2] - E[x]^2`` would cancel).
    """
    check_same_shape("x", x, mask=mask)
    check_mask("mask", mask)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    selected = torch.where(mask, x, zero)
    c = zero if center is None else center.to(x.dtype)
    centered = torch.where(mask, x - c, zero)
    return torch.stack([mask.sum().to(x.dtype), selected.sum(), centered.square().sum()])
