"""Log-probabilities of chosen tokens, and entropies, from logits: plain and memory-saving chunked paths.

With a large vocabulary the logits dominate activation memory: ``b * t * v`` values, and an fp32 copy of
bf16 logits doubles them, a full fp32 ``log_softmax`` kept for backward doubles them again. The chunked
path (``chunk_size=rows``) upcasts only ``chunk_size`` rows of the flattened ``(b t) v`` logits at a time
and runs through a custom ``torch.autograd.Function`` whose backward recomputes the softmax chunk by
chunk; the only tensors it saves are the logits as given (no copy, any dtype) and one or two fp32 numbers
per row. Both paths return fp32 and have the same values and gradients.

Shapes: ``logits (... v)`` and ``labels (...)`` with the same leading dims, typically ``(b t v)`` and
``(b t)``; under ``torch.func.vmap`` that is ``(t v)`` per example. Non-contiguous logits (such as
``logits[:, :-1]``) are read in place, never copied.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlfunc.checks import check_floating, is_transformed

__all__ = ["logprobs_from_logits", "entropy_from_logits"]


def logprobs_from_logits(logits: Tensor, labels: Tensor, *, chunk_size: int | None = None) -> Tensor:
    r"""Log-probability of each label under ``softmax(logits)``: ``(b t v), (b t) -> (b t)`` in fp32.

    .. math:: \log \pi(y_{t}) = z_{t, y_t} - \log \sum_{k} \exp z_{t,k}

    Computed in fp32 whatever the logits' dtype. ``chunk_size=None`` is the plain autograd path; an int
    processes that many rows of the flattened ``(b t) v`` logits at a time and never holds more than one
    chunk in fp32 (forward and backward), with the same values and gradient.

    Same numbers as verl's ``verl.utils.torch_functional.logprobs_from_logits`` for fp32 logits. For bf16
    logits verl's fallback (``logprobs_from_logits_v2``) runs ``log_softmax`` in bf16 and returns bf16;
    here the softmax is always taken in fp32 (accurate to fp32, not to bf16's 3 significant digits).

    Labels are not range-checked (that would sync with the device); an out-of-range label makes
    ``torch.gather`` raise on CPU.
    """
    v = _check_logits_and_labels(logits, labels)
    if chunk_size is None:
        x = logits.float()
        picked = torch.gather(x, -1, labels.long().unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(x, dim=-1)
    _check_chunk_size(chunk_size)
    lead = labels.shape
    logp, _ = _ChunkedLogprobs.apply(logits.reshape(1, v) if logits.dim() == 1 else logits, labels.reshape(-1).long(), chunk_size)
    return logp.reshape(lead)


def entropy_from_logits(logits: Tensor, *, chunk_size: int | None = None) -> Tensor:
    r"""Entropy of ``softmax(logits)`` per row: ``(b t v) -> (b t)`` in fp32.

    .. math:: H_t = -\sum_k p_{t,k} \log p_{t,k} = \log \sum_k e^{z_{t,k}} - \sum_k p_{t,k} z_{t,k}

    (the second form is verl's ``entropy_from_logits``; same numbers for fp32 logits). verl computes in
    the logits' dtype; here always fp32. Logits of ``-inf`` (masked vocabulary entries) contribute 0 to
    the entropy and to its gradient instead of ``0 * inf = nan``. ``chunk_size`` as in
    :func:`logprobs_from_logits`; the gradient is :math:`\partial H / \partial z_k = p_k (\sum_j p_j z_j - z_k)`.
    """
    if not isinstance(logits, Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    check_floating("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have shape (..., v) with v >= 1, got {tuple(logits.shape)}")
    if chunk_size is None:
        x = logits.float()
        p = torch.softmax(x, dim=-1)
        return torch.logsumexp(x, dim=-1) - _expected_logit(p, x)
    _check_chunk_size(chunk_size)
    lead = logits.shape[:-1]
    v = logits.shape[-1]
    ent, _ = _ChunkedEntropy.apply(logits.reshape(1, v) if logits.dim() == 1 else logits, chunk_size)
    return ent.reshape(lead)


# ---------------------------------------------------------------------------------------------------------
# Helpers


def _check_logits_and_labels(logits: Tensor, labels: Tensor) -> int:
    if not isinstance(logits, Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if not isinstance(labels, Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    check_floating("logits", logits)
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor of token ids, got {labels.dtype}")
    if logits.dim() != labels.dim() + 1 or logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits must have shape labels.shape + (v,): got logits {tuple(logits.shape)} and labels "
            f"{tuple(labels.shape)} [(b t v) and (b t)]"
        )
    if logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty vocabulary dim, got {tuple(logits.shape)}")
    return logits.shape[-1]


def _check_chunk_size(chunk_size: Any) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int (rows per chunk) or None, got {chunk_size!r}")


def _expected_logit(p: Tensor, x: Tensor) -> Tensor:
    """``sum_k p_k x_k`` with ``0 * -inf`` read as 0 (and a finite gradient there)."""
    safe_x = torch.where(p > 0, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return (p * safe_x).sum(dim=-1)


def _row_chunks(x: Tensor, chunk_size: int) -> list[Tensor]:
    """Views ``(rows, v)`` covering the rows of ``x (... v)`` in row-major order, without copying.

    A ``(b t v)`` tensor that cannot be viewed as ``(b*t, v)`` (e.g. ``logits[:, :-1]``) is walked one
    leading index at a time, so a chunk never crosses such a boundary.
    """
    if x.dim() == 2:
        return list(x.split(chunk_size))
    try:
        return list(x.view(-1, x.shape[-1]).split(chunk_size))
    except RuntimeError:
        return [c for sub in x.unbind(0) for c in _row_chunks(sub, chunk_size)]


def _any_transformed(*xs: Tensor) -> bool:
    return any(is_transformed(x) for x in xs)


def _assemble_grad(logits: Tensor, chunk_grads: list[Tensor], transformed: bool) -> Tensor:
    """Stack per-chunk gradients into a tensor shaped like ``logits``."""
    if transformed:
        # Under torch.func the chunks are wrapped tensors: build out of place.
        return torch.cat(chunk_grads).reshape(logits.shape)
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    flat = grad.view(-1, logits.shape[-1])
    offset = 0
    for g in chunk_grads:
        flat[offset : offset + g.shape[0]] = g
        offset += g.shape[0]
    return grad


class _ChunkedLogprobs(torch.autograd.Function):
    """``(logits (... v), labels (n,), chunk) -> (logp (n,), lse (n,))``, saving only logits, labels, lse."""

    generate_vmap_rule = True

    @staticmethod
    def forward(logits: Tensor, labels: Tensor, chunk_size: int) -> tuple[Tensor, Tensor]:
        logps, lses = [], []
        offset = 0
        for chunk in _row_chunks(logits, chunk_size):
            rows = chunk.shape[0]
            x = chunk.float()
            lse = torch.logsumexp(x, dim=-1)
            picked = torch.gather(x, -1, labels[offset : offset + rows].unsqueeze(-1)).squeeze(-1)
            logps.append(picked - lse)
            lses.append(lse)
            offset += rows
        return torch.cat(logps), torch.cat(lses)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        logits, labels, chunk_size = inputs
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(logits, labels, output[1])
        ctx.chunk_size = chunk_size

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor, _grad_lse: Tensor | None) -> tuple[Tensor | None, None, None]:
        logits, labels, lse = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        grads = []
        offset = 0
        for chunk in _row_chunks(logits, ctx.chunk_size):
            rows = chunk.shape[0]
            sl = slice(offset, offset + rows)
            g = grad_logp[sl].unsqueeze(-1)
            # d logp_y / d z_k = 1[k = y] - softmax_k
            p = torch.exp(chunk.float() - lse[sl].unsqueeze(-1))
            grad = torch.scatter_add(-p * g, -1, labels[sl].unsqueeze(-1), g)
            grads.append(grad.to(logits.dtype))
            offset += rows
        return _assemble_grad(logits, grads, _any_transformed(logits, grad_logp)), None, None


class _ChunkedEntropy(torch.autograd.Function):
    """``(logits (... v), chunk) -> (entropy (n,), E_p[z] (n,))``, saving only logits and ``E_p[z]``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(logits: Tensor, chunk_size: int) -> tuple[Tensor, Tensor]:
        ents, means = [], []
        for chunk in _row_chunks(logits, chunk_size):
            x = chunk.float()
            p = torch.softmax(x, dim=-1)
            mean = _expected_logit(p, x)
            ents.append(torch.logsumexp(x, dim=-1) - mean)
            means.append(mean)
        return torch.cat(ents), torch.cat(means)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        logits, chunk_size = inputs
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(logits, output[1])
        ctx.chunk_size = chunk_size

    @staticmethod
    def backward(ctx: Any, grad_ent: Tensor, _grad_mean: Tensor | None) -> tuple[Tensor | None, None]:
        logits, mean = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None
        grads = []
        offset = 0
        for chunk in _row_chunks(logits, ctx.chunk_size):
            rows = chunk.shape[0]
            sl = slice(offset, offset + rows)
            x = chunk.float()
            p = torch.softmax(x, dim=-1)
            m = mean[sl].unsqueeze(-1)
            # dH/dz_k = p_k (E_p[z] - z_k); entries with p_k = 0 (z_k = -inf) get exactly 0.
            local = torch.where(p > 0, p * (m - x), torch.zeros((), dtype=x.dtype, device=x.device))
            grads.append((local * grad_ent[sl].unsqueeze(-1)).to(logits.dtype))
            offset += rows
        return _assemble_grad(logits, grads, _any_transformed(logits, grad_ent)), None
