"""Attention over packed rows (:mod:`backends.packing`): each query sees its own sequence only.

- GPU with ``attn_implementation="flash_attention_2"`` / ``"flash_attention_3"``: Hugging Face's flash
  path reads ``cu_seq_lens_q/k`` and ``max_length_q/k`` from the forward kwargs and calls the varlen
  kernel; nothing here replaces it.
- Everywhere else (the exact CPU path): :func:`varlen_sdpa_attention`, registered with Hugging Face's
  ``AttentionInterface`` under :data:`VARLEN_SDPA` by :func:`enable_packed_attention`. It finds the
  sequences (a ``packed_layout``, ``cu_seq_lens_q`` or restarting ``position_ids``) and hands them to
  one of the backends of :data:`BACKENDS`; without any of them it is Hugging Face's ``sdpa`` with the
  given mask, so a padded forward through the same model is unchanged.

The backends, in the order they are tried (:func:`packed_rows_attention` is the one place that chooses):

- ``"matmul"``: the PyTorch block path (below) with the attention as two batched matmuls in the input
  dtype, for short blocks on CPU (:data:`MATMUL_ATTENTION_MAX_LEN`), the usual case in RL: PyTorch's
  CPU SDPA kernels pay a large per-block overhead there, and their bf16 flash-attention backward is
  several times slower than fp32.
- ``"sdpa"``: the PyTorch block path with one causal SDPA call; bf16 / fp16 inputs on CPU are upcast
  to fp32 first. Always applies: the last resort.

The block path gathers the packed ``q, k, v`` into a ``(n, heads, max_len, d)`` block (each sequence
left-aligned, filler after it), runs one causal attention over it and gathers the real positions
back: a real query at position ``j`` sees keys ``0..j`` of its own sequence only, so the filler is
never read (and the filler queries' outputs are dropped, so no gradient flows from them). The linear
layers, the bulk of the work, still run on the ``T`` real tokens only; attention costs
``n * max_len^2``, in one call per layer rather than one per sequence. Hugging Face's own alternative
(``sdpa`` with restarting position ids and no attention mask, which builds a block-diagonal causal
mask) is exact too, but builds a dense ``T x T`` mask and does ``T^2`` attention work; the tests use
it as an independent check.

:func:`only_backends` restricts the choice (tests force each backend with it, so both are tested whatever
the automatic choice would be).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, Optional

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backends.packing import BlockLayout, boundaries_from_positions, pad_layout

__all__ = [
    "BACKENDS",
    "MATMUL_ATTENTION_MAX_LEN",
    "VARLEN_SDPA",
    "PackedAttentionBackend",
    "enable_packed_attention",
    "only_backends",
    "packed_rows_attention",
    "varlen_sdpa_attention",
]

#: name of the packed-aware attention in transformers' AttentionInterface
VARLEN_SDPA = "rlfunc_varlen_sdpa"
_FLASH = ("flash_attention_2", "flash_attention_3")

#: On CPU, the longest block (sequence) for which the two-matmul attention runs instead of SDPA, per
#: input dtype. In fp32 SDPA's per-call overhead stops mattering early; in bf16 the matmul form also
#: saves the upcast and SDPA's slow bf16 backward, so it stays ahead to much longer blocks, until its
#: ``L^2`` score matrix costs more than SDPA's tiled kernel.
MATMUL_ATTENTION_MAX_LEN = {torch.float32: 48, torch.bfloat16: 512}

#: ``run(query, key, value, layout, scale, dropout)``: ``(1 T h d)``
AttentionRun = Callable[[Tensor, Tensor, Tensor, BlockLayout, Optional[float], float], Tensor]


@attrs.frozen
class PackedAttentionBackend:
    """One way to compute causal attention over a packed row.

    ``applies(query, layout, dropout)``: whether the automatic choice takes it for these inputs;
    ``run``: the attention (``q (1 h T d), k v (1 kv T d) -> (1 T h d)`` in the query's dtype).
    """

    name: str
    applies: Callable[[Tensor, BlockLayout, float], bool]
    run: AttentionRun


def _through_block(
    query: Tensor, key: Tensor, value: Tensor, layout: BlockLayout, attend: Callable[[Tensor, Tensor, Tensor], Tensor]
) -> Tensor:
    """``attend`` over the left-aligned ``(n h L d)`` block of each of ``q, k, v``, back to ``(1 T h d)``."""
    flat_gather, max_len = layout.gather.reshape(-1), layout.max_len
    n, heads, head_dim = layout.gather.shape[0], query.shape[1], query.shape[3]

    def padded(x: Tensor) -> Tensor:  # (1 h T d) -> (n h L d), each sequence left-aligned
        # row gathers over (T h d): HF's q / k / v are T-major in memory (views of the projections'
        # output), and index_select (backward: index_add) is much cheaper than advanced indexing
        rows = x[0].transpose(0, 1).index_select(0, flat_gather)
        return rows.view(n, max_len, x.shape[1], x.shape[3]).transpose(1, 2)

    out = attend(padded(query), padded(key), padded(value))  # (n h L d)
    return out.transpose(1, 2).reshape(n * max_len, heads, head_dim).index_select(0, layout.scatter)[None]


def _matmul_applies(query: Tensor, layout: BlockLayout, dropout: float) -> bool:
    return query.device.type == "cpu" and layout.max_len <= MATMUL_ATTENTION_MAX_LEN.get(query.dtype, 0)


def _matmul_run(
    query: Tensor, key: Tensor, value: Tensor, layout: BlockLayout, scale: float | None, dropout: float
) -> Tensor:
    return _through_block(query, key, value, layout, lambda q, k, v: causal_matmul_attention(q, k, v, scale, dropout))


def _sdpa_run(
    query: Tensor, key: Tensor, value: Tensor, layout: BlockLayout, scale: float | None, dropout: float
) -> Tensor:
    # upcast before the gather, so that a shared prompt's gradient is summed over its group in fp32
    query, key, value, dtype = _cpu_fp32(query, key, value)
    gqa = query.shape[1] != key.shape[1]
    out = _through_block(
        query,
        key,
        value,
        layout,
        lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=gqa
        ),
    )
    return out.to(dtype)


#: the packed-row attention backends, in the order the automatic choice tries them
BACKENDS: dict[str, PackedAttentionBackend] = {
    backend.name: backend
    for backend in (
        PackedAttentionBackend("matmul", applies=_matmul_applies, run=_matmul_run),
        PackedAttentionBackend("sdpa", applies=lambda query, layout, dropout: True, run=_sdpa_run),
    )
}

#: the backends :func:`packed_rows_attention` may choose from (None: all of them)
_ALLOWED: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar(
    "rlfunc_packed_attention_backends", default=None
)


@contextlib.contextmanager
def only_backends(*names: str) -> Iterator[None]:
    """Within the block, packed attention chooses among the backends ``names`` only, as it chooses
    among all of them otherwise; a single name forces that backend, whether or not it would be chosen."""
    unknown = [name for name in names if name not in BACKENDS]
    if unknown or not names:
        raise ValueError(f"only_backends: unknown packed attention backends {unknown} (known: {list(BACKENDS)})")
    token = _ALLOWED.set(tuple(names))
    try:
        yield
    finally:
        _ALLOWED.reset(token)


def packed_rows_attention(
    query: Tensor, key: Tensor, value: Tensor, layout: BlockLayout, scale: float | None, dropout: float = 0.0
) -> Tensor:
    """Causal attention within each sequence of ``layout``: ``q (1 h T d), k v (1 kv T d) -> (1 T h d)``,
    by the first backend of :data:`BACKENDS` (among those :func:`only_backends` allows) that applies."""
    allowed = _ALLOWED.get()
    candidates = [b for b in BACKENDS.values() if allowed is None or b.name in allowed]
    forced = len(candidates) == 1
    for backend in candidates:
        if forced or backend.applies(query, layout, dropout):
            return backend.run(query, key, value, layout, scale, dropout)
    raise RuntimeError(
        f"no packed attention backend of {[b.name for b in candidates]} applies to these inputs "
        f"({query.dtype} on {query.device.type}, dropout {dropout})"
    )


def _cpu_fp32(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor, torch.dtype]:
    """bf16 / fp16 attention inputs on CPU as fp32 (PyTorch's reduced-precision CPU SDPA is slow and
    no more exact); the original dtype."""
    dtype = query.dtype
    if query.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return query.float(), key.float(), value.float(), dtype
    return query, key, value, dtype


def causal_matmul_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None, dropout: float) -> Tensor:
    """Causal attention ``q (n h L d), k v (n kv L d) -> (n h L d)`` as two batched matmuls.

    The ``h / kv`` query heads that share a key/value head are stacked along the query axis, so every
    matmul reads each key/value block once (no GQA expansion). Softmax accumulates in fp32 and returns
    the input dtype, so bf16 needs no upcast of ``q``, ``k``, ``v``. (With shared prompts the gather's
    backward then sums a prompt's gradient over its group in bf16: as close to the exact sum as one
    bf16 rounding.)
    """
    n, h, length, d = q.shape
    kv = k.shape[1]  # divides h (checked by varlen_sdpa_attention)
    scale = d**-0.5 if scale is None else scale
    future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu_(1)
    scores = torch.matmul(q.reshape(n, kv, h // kv * length, d), k.transpose(-1, -2)).view(
        n, kv, h // kv, length, length
    )
    scores = scores.mul(scale).masked_fill_(future, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # bf16 / fp16 in and out, fp32 inside (PyTorch's CPU kernel)
    if dropout:
        probs = F.dropout(probs, p=dropout)
    return torch.matmul(probs.view(n, kv, h // kv * length, length), v).view(n, h, length, d)


def _packed_layout(
    query: Tensor,
    attention_mask: Tensor | None,
    cu_seq_lens_q: Tensor | None,
    packed_layout: BlockLayout | None,
    kwargs: dict[str, Any],
) -> BlockLayout | None:
    """The sequences of a packed forward, or None for a padded one."""
    if packed_layout is not None:
        if packed_layout.scatter.shape[0] != query.shape[2]:
            raise ValueError(
                f"packed_layout places {packed_layout.scatter.shape[0]} tokens but the packed row has {query.shape[2]}"
            )
        return packed_layout
    bounds = None
    if cu_seq_lens_q is not None:
        bounds = [int(x) for x in cu_seq_lens_q.tolist()]
    elif attention_mask is None and kwargs.get("position_ids") is not None:
        bounds = boundaries_from_positions(kwargs["position_ids"])
    if bounds is None:
        return None
    if bounds[-1] != query.shape[2]:
        raise ValueError(f"cu_seq_lens_q ends at {bounds[-1]} but the packed row has {query.shape[2]} tokens")
    return pad_layout(tuple(bounds), query.device)


def varlen_sdpa_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    cu_seq_lens_q: Tensor | None = None,
    packed_layout: BlockLayout | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Causal attention within each packed sequence: ``q (1 h T d), k v (1 kv T d) -> (1 T h d)``.

    The sequences come from ``packed_layout`` (shared prompts, ``backends.packing.pack_rows``), else
    from ``cu_seq_lens_q``, else from restarting ``position_ids``. Without any of them it is Hugging
    Face's ``sdpa`` with the given mask (a padded forward). Sliding-window attention is not supported
    on the packed path.
    """
    layout = _packed_layout(query, attention_mask, cu_seq_lens_q, packed_layout, kwargs)
    if layout is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        query, key, value, dtype = _cpu_fp32(query, key, value)
        out, weights = sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            **kwargs,
        )
        return out.to(dtype), weights
    if query.shape[0] != 1:
        raise ValueError(f"packed attention needs one packed row, got a batch of {query.shape[0]}")
    if sliding_window is not None:
        raise NotImplementedError("packed sequences do not support sliding-window attention layers")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"{query.shape[1]} query heads are not a multiple of {key.shape[1]} key/value heads")
    dropout = dropout if module.training else 0.0
    return packed_rows_attention(query, key, value, layout, scaling, dropout), None


def _varlen_sdpa_mask(*args: Any, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor | None:
    """Mask builder for :data:`VARLEN_SDPA`: HF's sdpa mask for a padded forward; none for a packed one
    (it would be a dense T x T block-diagonal mask that the varlen attention does not read)."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
    AttentionMaskInterface.register(VARLEN_SDPA, _varlen_sdpa_mask)


def enable_packed_attention(model: nn.Module) -> str:
    """Make an (unsharded) HF model's attention packed-aware; returns the implementation in use.

    Flash-attention models keep their implementation (HF's varlen path); any other (``sdpa``,
    ``eager``) switches to :data:`VARLEN_SDPA`, which behaves like ``sdpa`` on padded input.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise ValueError(
            f"packed sequences need a Hugging Face model with an attention interface, got {type(model).__name__}"
        )
    current = config._attn_implementation
    if current in _FLASH:
        return current
    if getattr(config, "use_sliding_window", False):
        raise NotImplementedError(
            "packed sequences do not support sliding-window attention (config.use_sliding_window)"
        )
    _register()
    model.set_attn_implementation(VARLEN_SDPA)
    return VARLEN_SDPA
