"""Log-probabilities of chosen tokens, and entropies, from logits: plain and memory-saving chunked paths.

With a large vocabulary the logits dominate activation memory: ``b * t * v`` values, and an fp32 copy of
bf16 logits doubles them, a full fp32 ``log_softmax`` kept for backward doubles them again. The chunked
path (``chunk_size=rows``) upcasts only ``chunk_size`` rows of the flattened ``(b t) v`` logits at a time
and runs through a custom ``torch.autograd.Function`` whose backward recomputes the softmax chunk by
chunk; the only tensors it saves are the logits as given (no copy, any dtype), plus the labels and one
fp32 log-normaliser per row for log-probs. Both paths compute in fp32 (fp64 logits stay fp64) and have the
same values and gradients.

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

    Computed in fp32 for bf16 / fp16 / fp32 logits (fp64 stays fp64). ``chunk_size=None`` is the plain autograd path; an
    int processes that many rows of the flattened ``(b t) v`` logits at a time and never holds more than one chunk in
    fp32 (forward and backward), with the same values and gradient.

    Same numbers as verl's ``verl.utils.torch_functional.logprobs_from_logits`` for fp32 logits. For bf16
    logits verl's fallback (``logprobs_from_logits_v2``) runs ``log_softmax`` in bf16 and returns bf16;
    here the softmax is always taken in fp32 (accurate to fp32, not to bf16's 3 significant digits).

    Labels are not range-checked (that would sync with the device); an out-of-range label makes
    ``torch.gather`` raise on CPU.
    """
    v = _check_logits_and_labels(logits, labels)
    if chunk_size is None:
        x = _upcast(logits)
        picked = torch.gather(x, -1, labels.long().unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(x, dim=-1)
    _check_chunk_size(chunk_size)
    lead = labels.shape
    logp, _ = _ChunkedLogprobs.apply(
        logits.reshape(1, v) if logits.dim() == 1 else logits, labels.reshape(-1).long(), chunk_size
    )
    return logp.reshape(lead)


def entropy_from_logits(logits: Tensor, *, chunk_size: int | None = None) -> Tensor:
    r"""Entropy of ``softmax(logits)`` per row: ``(b t v) -> (b t)`` in fp32 (fp64 logits stay fp64).

    .. math:: H_t = -\sum_k p_{t,k} \log p_{t,k} = \log \sum_k e^{c_{t,k}} - \sum_k p_{t,k} c_{t,k},
              \qquad c_{t,k} = z_{t,k} - \max_j z_{t,j}

    verl's ``entropy_from_logits`` evaluates the same expression on the unshifted logits ``z`` (in the
    logits' dtype); for fp32 logits the numbers agree to fp32 rounding (1e-5 on the golden file).
    Shifting by the row max keeps :math:`\sum_k p_k c_k` small when the softmax is peaked, where
    ``logsumexp(z) - sum p z`` is a difference of two large numbers; the same holds for the gradient
    :math:`\partial H / \partial z_k = p_k (\sum_j p_j c_j - c_k)`, which both paths get accurately.
    Logits of ``-inf`` (masked vocabulary entries) contribute 0 to the entropy and its gradient instead of
    ``0 * inf = nan``. ``chunk_size`` as in :func:`logprobs_from_logits`.
    """
    if not isinstance(logits, Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    check_floating("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have shape (..., v) with v >= 1, got {tuple(logits.shape)}")
    if chunk_size is None:
        return _entropy_rows(_upcast(logits))
    _check_chunk_size(chunk_size)
    lead = logits.shape[:-1]
    v = logits.shape[-1]
    ent = _ChunkedEntropy.apply(logits.reshape(1, v) if logits.dim() == 1 else logits, chunk_size)
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


def _upcast(x: Tensor) -> Tensor:
    """At least fp32 (fp64 stays fp64)."""
    return x if x.dtype == torch.float64 else x.float()


def _shifted(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(c, p, c_safe)``: logits minus their (constant) row max, the softmax, and ``c`` with 0 where ``p = 0``.

    Entropy is shift-invariant, and on shifted logits ``E_p[c]`` is small where the softmax is peaked,
    instead of a difference of two large numbers. ``c_safe`` (0 where ``p = 0``, i.e. logits of ``-inf``)
    makes ``p * c`` and its gradient 0 instead of ``0 * inf = nan``.
    """
    c = x - x.amax(dim=-1, keepdim=True).detach()
    p = torch.softmax(c, dim=-1)
    return c, p, torch.where(p > 0, c, torch.zeros((), dtype=c.dtype, device=c.device))


def _entropy_rows(x: Tensor) -> Tensor:
    """``H = logsumexp(c) - sum_k p_k c_k`` over the last dim of (already upcast) logits."""
    c, p, c_safe = _shifted(x)
    return torch.logsumexp(c, dim=-1) - (p * c_safe).sum(dim=-1)


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


def _chunked_grad(logits: Tensor, chunk_size: int, transformed: bool, chunk_grad: Any) -> Tensor:
    """Gradient shaped like ``logits``: ``chunk_grad(chunk, rows_slice)`` (fp32) chunk by chunk.

    Each chunk's gradient is cast and written into the result at once, so the peak is the result plus one
    chunk's temporaries. Under ``torch.func`` the chunks are wrapped tensors that cannot be written into
    a plain tensor: there they are concatenated instead.
    """
    grad = None if transformed else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    flat = None if grad is None else grad.view(-1, logits.shape[-1])
    pieces = []
    offset = 0
    for chunk in _row_chunks(logits, chunk_size):
        rows = chunk.shape[0]
        g = chunk_grad(chunk, slice(offset, offset + rows)).to(logits.dtype)
        if flat is None:
            pieces.append(g)
        else:
            flat[offset : offset + rows] = g
        offset += rows
        del g
    return grad if grad is not None else torch.cat(pieces).reshape(logits.shape)


class _ChunkedLogprobs(torch.autograd.Function):
    """``(logits (... v), labels (n,), chunk) -> (logp (n,), lse (n,))``, saving only logits, labels, lse."""

    generate_vmap_rule = True

    @staticmethod
    def forward(logits: Tensor, labels: Tensor, chunk_size: int) -> tuple[Tensor, Tensor]:
        logps, lses = [], []
        offset = 0
        for chunk in _row_chunks(logits, chunk_size):
            rows = chunk.shape[0]
            x = _upcast(chunk)
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

        def chunk_grad(chunk: Tensor, sl: slice) -> Tensor:
            # d logp_y / d z_k = 1[k = y] - softmax_k
            g = grad_logp[sl].unsqueeze(-1)
            p = torch.exp(_upcast(chunk) - lse[sl].unsqueeze(-1))
            return torch.scatter_add(-p * g, -1, labels[sl].unsqueeze(-1), g)

        transformed = is_transformed(logits) or is_transformed(grad_logp)
        return _chunked_grad(logits, ctx.chunk_size, transformed, chunk_grad), None, None


class _ChunkedEntropy(torch.autograd.Function):
    """``(logits (... v), chunk) -> entropy (n,)``, saving only the logits."""

    generate_vmap_rule = True

    @staticmethod
    def forward(logits: Tensor, chunk_size: int) -> Tensor:
        ents = []
        for chunk in _row_chunks(logits, chunk_size):
            ents.append(_entropy_rows(_upcast(chunk)))
        return torch.cat(ents)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        logits, chunk_size = inputs
        ctx.save_for_backward(logits)
        ctx.chunk_size = chunk_size

    @staticmethod
    def backward(ctx: Any, grad_ent: Tensor) -> tuple[Tensor | None, None]:
        (logits,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None

        def chunk_grad(chunk: Tensor, sl: slice) -> Tensor:
            # dH/dz_k = p_k (E_p[z] - z_k) = p_k (E_p[c] - c_k) on shifted logits (see _shifted)
            _, p, c = _shifted(_upcast(chunk))
            return p * ((p * c).sum(dim=-1, keepdim=True) - c) * grad_ent[sl].unsqueeze(-1)

        transformed = is_transformed(logits) or is_transformed(grad_ent)
        return _chunked_grad(logits, ctx.chunk_size, transformed, chunk_grad), None
