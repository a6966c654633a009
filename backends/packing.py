"""Packed sequences (verl's ``use_remove_padding``): a micro-batch's rows concatenated into one row.

A padded micro-batch ``(b, p + t)`` spends compute on left-padding of the prompts and on response
columns after each row's last real token. Packing keeps, per row, the real prompt tokens and the
response tokens that predict the rest of it, up to its last ``response_mask`` token (the last one
itself predicts nothing and is dropped; a row always predicts at least its first response token),
and concatenates them into one row ``(1, T)``, ``T = sum_i (p_i + r_i - 1)``:

- ``position_ids`` restart at 0 for every sequence (so rotary embeddings see what they see padded);
- ``cu_seqlens`` ``(n + 1)`` are the cumulative sequence lengths (flash-attention's varlen format);
- attention never crosses a sequence boundary.

Attention on the packed row:

- GPU with ``attn_implementation="flash_attention_2"`` / ``"flash_attention_3"``: Hugging Face's flash
  path reads ``cu_seq_lens_q/k`` and ``max_length_q/k`` from the forward kwargs and calls the varlen
  kernel; nothing here replaces it.
- Everywhere else (the exact CPU path): :func:`varlen_sdpa_attention`, registered with Hugging Face's
  ``AttentionInterface`` under :data:`VARLEN_SDPA`. Only attention needs the sequences apart, so it
  gathers the packed ``q, k, v`` into a ``(n, heads, max_len, d)`` block (each sequence left-aligned,
  filler after it), runs one causal SDPA call over it and gathers the real positions back: a real
  query at position ``j`` sees keys ``0..j`` of its own sequence only, so the filler is never read
  (and the filler queries' outputs are dropped, so no gradient flows from them).
  The linear layers, the bulk of the work, still run on the ``T`` real tokens only; attention costs
  ``n * max_len^2``. (One SDPA call per sequence, the first version, was as exact but paid the
  per-call overhead ``n`` times per layer.) Hugging Face's own alternative (``sdpa`` with restarting
  position ids and no attention mask: ``masking_utils.find_packed_sequence_indices`` builds a
  block-diagonal causal mask) is exact too, but builds a dense ``T x T`` mask and does ``T^2``
  attention work; it is used in the tests as an independent check of this path. Without
  ``cu_seq_lens_q`` the function falls back to HF's ``sdpa`` with the given mask, so a padded forward
  through the same model is unchanged.

On CPU the block attention is two batched matmuls (:func:`_causal_matmul_attention`, in the input
dtype) for short blocks, the usual case in RL (:data:`MATMUL_ATTENTION_MAX_LEN`): PyTorch's CPU SDPA
kernels pay a large per-block overhead there, and its bf16 flash-attention backward is about 4x slower
than fp32 (torch 2.13: 52 vs 12 ms for a (64, 4, 38, 64) fwd+bwd). Longer blocks, and the padded
forward, run SDPA, with bf16 / fp16 inputs upcast to fp32 on CPU (:func:`_cpu_fp32`).

Outputs are gathered at the positions that predict the response tokens and scattered back to
``(b t)`` (zeros after a row's last kept token), so losses written for padded batches are unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backends.cpu.fused_modules import packed_attention

__all__ = ["VARLEN_SDPA", "BlockLayout", "PackedRows", "pack_rows", "unpack", "varlen_sdpa_attention", "enable_packed_attention",
           "model_kwargs"]

#: name of the packed-aware SDPA attention in transformers' AttentionInterface
VARLEN_SDPA = "rlfunc_varlen_sdpa"
_FLASH = ("flash_attention_2", "flash_attention_3")


@attrs.frozen
class BlockLayout:
    """Where each attention sequence of a packed row sits in a left-aligned ``(n, max_len)`` block.

    ``gather (n L)``: the packed position read by each block slot (past a sequence's end its last
    token again, which no real query of the sequence can see under the causal mask); ``scatter (T)``:
    the flat block slot ``i * L + j`` whose attention output each packed position takes; ``lengths (n)``:
    the number of real tokens of each sequence.
    """

    gather: Tensor
    scatter: Tensor
    max_len: int
    lengths: Tensor


@attrs.frozen
class PackedRows:
    """One micro-batch packed into a single row, and how to map outputs back to ``(b t)``."""

    input_ids: Tensor  # (1 T)
    position_ids: Tensor  # (1 T): 0 .. L_i - 1 per sequence
    #: (n + 1) int32: start of each sequence in the row, then T. None when prompts are shared or the
    #: order is step-major: the sequences are then not contiguous in the row, and ``layout`` says where they are.
    cu_seqlens: Tensor | None
    max_seqlen: int  # max_i L_i
    predict_index: Tensor  # (N): packed positions whose next-token output belongs to a response token
    rows: Tensor  # (N): micro-batch row of each kept response token
    cols: Tensor  # (N): response column of each kept response token
    labels: Tensor  # (N): the kept response token ids
    shape: tuple[int, int]  # (b, t) of the micro-batch's response block
    token_rows: Tensor  # (T): the micro-batch row of each packed token (a shared prompt's: its first row)
    layout: BlockLayout | None = None  # set when prompts are shared or the order is step-major (see pack_rows)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def pack_rows(
    prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor, *,
    share_prompts: bool = False, with_last_token: bool = False, step_major: bool = False,
) -> PackedRows:
    """Pack ``(b p)`` prompts (real tokens where ``prompt_mask``) and ``(b t)`` responses into one row,
    for predicting each row's response tokens up to its last ``response_mask`` token (at least one).
    Row order is kept.

    Every row needs at least one prompt token (the first response token's context). The last
    predicted token of a row is left out of the packed input: its output predicts nothing and no
    other token attends to it, so dropping it changes no log-prob, value or gradient and saves one
    token of compute per row. ``with_last_token`` keeps it (for a caller that reads its output).

    ``share_prompts``: rows with the same prompt (a GRPO group's ``n`` samples) hold its tokens once:
    the row is ``[prompt, response_1, ..., response_k]`` per distinct prompt, each response keeps the
    RoPE positions that follow its prompt, and ``layout`` lets attention read the shared prompt into
    every sequence of the group (the "shared prefix" of Prefix Grouper-style GRPO training). Outputs
    and gradients are the same as without sharing (the prompt's activations are computed once and
    its gradient is the sum over the group, as it is when computed ``k`` times); only the packed-aware
    attention (:func:`varlen_sdpa_attention`) reads ``layout``, flash-attention varlen cannot.

    ``step_major``: the tokens in the order a batched decoder produced them: every stored prompt
    (rows in order), then response column 0 of every row that has it in the input, column 1, and so
    on (rows ascending in each). This is the order of the native rollout's recorded activations
    (``backends.rollout.native.generate_recording``), which a trainer can then read without a gather.
    The sequences are not contiguous, so the row always carries a ``layout`` (the packed-aware
    attention reads it; flash-attention varlen cannot).
    """
    b, p = prompt_ids.shape
    t = response_ids.shape[1]
    if response_ids.shape[0] != b or prompt_mask.shape != (b, p) or response_mask.shape != (b, t):
        raise ValueError(
            f"pack_rows: shapes disagree: prompt_ids {tuple(prompt_ids.shape)}, prompt_mask {tuple(prompt_mask.shape)}, "
            f"response_ids {tuple(response_ids.shape)}, response_mask {tuple(response_mask.shape)}"
        )
    if t == 0:
        raise ValueError("pack_rows: the response block has no columns")
    prompt_mask = prompt_mask.bool()
    prompt_len = prompt_mask.sum(-1)
    if bool((prompt_len == 0).any()):
        raise ValueError("pack_rows: a row has an empty prompt (prompt_mask all false)")
    if bool((prompt_mask[:, 1:] < prompt_mask[:, :-1]).any()):
        raise ValueError("pack_rows: prompts must be left-padded (a padding token follows a real prompt token)")
    cols = torch.arange(t, device=response_ids.device)
    # last loss column + 1, at least 1: a row with no loss token still reaches the logits (zero weight)
    last = torch.where(response_mask, cols + 1, torch.zeros_like(cols)).amax(-1)
    response_len = last.clamp(min=1)
    response_keep = cols[None, :] < response_len[:, None]  # (b t): the predicted response tokens
    input_len = response_len if with_last_token else response_len - 1  # response tokens in the input
    input_keep = cols[None, :] < input_len[:, None]
    seq_keep = torch.cat([prompt_mask, input_keep], dim=1)  # (b, p + t): each row's whole sequence
    seqlens = prompt_len + input_len
    position_ids = seq_keep.long().cumsum(-1) - 1  # (b, p + t), valid where seq_keep
    rows_b = torch.arange(b, device=prompt_ids.device)
    # each row's prompt is stored by its leader: the first row with the same prompt, or itself
    leader = _first_row_with_same_prompt(prompt_ids, prompt_mask) if share_prompts else rows_b
    stored = torch.cat([prompt_mask & (leader == rows_b)[:, None], input_keep], dim=1)  # tokens held in the row
    # the stream: flat (row, column) indices of the stored tokens in packed order
    width = p + t
    if step_major:
        column = torch.arange(width, device=prompt_ids.device)[None]
        key = torch.where(column < p, rows_b[:, None] * p + column, b * p + (column - p) * b + rows_b[:, None])
        candidates = stored.reshape(-1).nonzero().squeeze(-1)
        stream = candidates[torch.argsort(key.reshape(-1)[candidates])]
    else:  # rows grouped behind their leader, leaders in order of first appearance
        order = torch.sort(leader, stable=True).indices
        flat = order[:, None] * width + torch.arange(width, device=prompt_ids.device)
        stream = flat[stored[order]]
    packed_input_ids = torch.cat([prompt_ids, response_ids], dim=1).reshape(-1)[stream][None]
    packed_position_ids = position_ids.reshape(-1)[stream][None]
    # packed position of every stored token; a row's prompt columns point at its leader's tokens
    index = torch.full((b * width,), -1, dtype=torch.long, device=stream.device)
    index[stream] = torch.arange(stream.shape[0], device=stream.device)
    index = index.view(b, width)
    index[:, :p] = index[leader, :p]
    # the token before each kept response token predicts it (the prompt's last token for column 0;
    # prompts are left-padded, so column p - 1 is real in every row)
    predict_index = index[:, p - 1 : p + t - 1][response_keep]
    rows, resp_cols = response_keep.nonzero(as_tuple=True)
    common = dict(
        input_ids=packed_input_ids, position_ids=packed_position_ids, max_seqlen=int(seqlens.max()),
        predict_index=predict_index, rows=rows, cols=resp_cols, labels=response_ids[response_keep], shape=(b, t),
        token_rows=torch.div(stream, width, rounding_mode="floor"),
    )
    if not (share_prompts or step_major):
        cu_seqlens = torch.cat([seqlens.new_zeros(1), seqlens.cumsum(0)]).to(torch.int32)
        return PackedRows(cu_seqlens=cu_seqlens, **common)
    return PackedRows(cu_seqlens=None, layout=_shared_layout(index, stored, prompt_len, seqlens, p), **common)


def _first_row_with_same_prompt(prompt_ids: Tensor, prompt_mask: Tensor) -> Tensor:
    """``(b)``: for each row, the first row whose real prompt tokens are the same (itself if none before)."""
    b = prompt_ids.shape[0]
    key = torch.where(prompt_mask, prompt_ids, torch.full_like(prompt_ids, -1))
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), b, dtype=torch.long, device=key.device)
    first.scatter_reduce_(0, inverse, torch.arange(b, device=key.device), reduce="amin")
    return first[inverse]


def _shared_layout(index: Tensor, stored: Tensor, prompt_len: Tensor, seqlens: Tensor, p: int) -> BlockLayout:
    """The attention block of a prompt-shared packed row: row ``i`` of the block is sequence ``i`` (its
    prompt, read from the leader's tokens, then its response), left-aligned; each stored token's
    output comes from the slot of the row that stores it."""
    b = index.shape[0]
    max_len = int(seqlens.max())
    j = torch.arange(max_len, device=index.device)
    # a sequence's tokens are the contiguous columns [p - prompt_len, p - prompt_len + seqlen) of its row
    col = (p - prompt_len)[:, None] + torch.minimum(j[None], (seqlens - 1)[:, None])
    gather = index.gather(1, col)  # (b L)
    slot = torch.arange(b, device=index.device)[:, None] * max_len + (
        torch.arange(index.shape[1], device=index.device)[None] - (p - prompt_len)[:, None]
    )  # (b, p + t): the block slot of each column (valid on the row's sequence)
    scatter = torch.empty(int(stored.sum()), dtype=torch.long, device=index.device)
    scatter[index[stored]] = slot[stored]
    return BlockLayout(gather=gather, scatter=scatter, max_len=max_len, lengths=seqlens.to(torch.long))


def unpack(values: Tensor, packed: PackedRows) -> Tensor:
    """Scatter per-kept-token ``values`` ``(N)`` back to ``(b t)``, zeros elsewhere (differentiable)."""
    if values.shape != packed.rows.shape:
        raise ValueError(f"unpack: values must have shape {tuple(packed.rows.shape)}, got {tuple(values.shape)}")
    out = values.new_zeros(packed.shape)
    return out.index_put((packed.rows, packed.cols), values)


def model_kwargs(packed: PackedRows) -> dict[str, Any]:
    """Keyword arguments of a Hugging Face forward over the packed row (no attention mask: the
    sequences are delimited by ``cu_seq_lens_*``, read by flash-attention and :func:`varlen_sdpa_attention`,
    or, for shared prompts, by ``packed_layout``, which only :func:`varlen_sdpa_attention` reads)."""
    if packed.layout is not None:
        return dict(input_ids=packed.input_ids, position_ids=packed.position_ids, packed_layout=packed.layout,
                    use_cache=False)
    return dict(
        input_ids=packed.input_ids, position_ids=packed.position_ids,
        cu_seq_lens_q=packed.cu_seqlens, cu_seq_lens_k=packed.cu_seqlens,
        max_length_q=packed.max_seqlen, max_length_k=packed.max_seqlen, use_cache=False,
    )


def _boundaries_from_positions(position_ids: Tensor) -> list[int] | None:
    """Sequence starts of a packed row from restarting position ids (as HF's find_packed_sequence_indices)."""
    if position_ids.shape[0] != 1:
        return None
    pos = position_ids[0]
    starts = (torch.diff(pos, prepend=pos[:1] - 1) != 1).nonzero().flatten().tolist()
    if not starts or starts == [0]:
        return None
    return ([0] if starts[0] != 0 else []) + starts + [int(pos.shape[0])]


@functools.lru_cache(maxsize=16)
def _pad_layout(bounds: tuple[int, ...], device: torch.device) -> BlockLayout:
    """The block of contiguous sequences ``[bounds[i], bounds[i+1])`` of a packed row of ``T = bounds[-1]``
    tokens (empty sequences hold no block row)."""
    starts = torch.tensor(bounds[:-1], dtype=torch.long)
    lengths = torch.tensor(bounds[1:], dtype=torch.long) - starts
    starts, lengths = starts[lengths > 0], lengths[lengths > 0]  # empty sequences hold no token
    max_len = int(lengths.max())
    cols = torch.arange(max_len)
    inside = cols[None] < lengths[:, None]
    gather = starts[:, None] + torch.minimum(cols[None], lengths[:, None] - 1)
    scatter = inside.reshape(-1).nonzero().squeeze(-1)  # row-major over (n, L): the packed order
    return BlockLayout(gather=gather.to(device), scatter=scatter.to(device), max_len=max_len, lengths=lengths.to(device))


def _cpu_fp32(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor, torch.dtype]:
    """bf16 / fp16 attention inputs on CPU as fp32 (see the module docstring); the original dtype."""
    dtype = query.dtype
    if query.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return query.float(), key.float(), value.float(), dtype
    return query, key, value, dtype


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
    """Causal SDPA within each packed sequence: ``q (1 h T d), k v (1 kv T d) -> (1 T h d)``.

    The sequences come from ``packed_layout`` (shared prompts, :func:`pack_rows`), else from
    ``cu_seq_lens_q``, else from restarting ``position_ids``. Without any of them it is Hugging Face's
    ``sdpa`` with the given mask (a padded forward). Sliding-window attention is not supported on the
    packed path.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layout = packed_layout
    if layout is None:
        bounds = None
        if cu_seq_lens_q is not None:
            bounds = [int(x) for x in cu_seq_lens_q.tolist()]
        elif attention_mask is None and kwargs.get("position_ids") is not None:
            bounds = _boundaries_from_positions(kwargs["position_ids"])
        if bounds is None:
            query, key, value, dtype = _cpu_fp32(query, key, value)
            out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                                  scaling=scaling, sliding_window=sliding_window, **kwargs)
            return out.to(dtype), weights
        if bounds[-1] != query.shape[2]:
            raise ValueError(f"cu_seq_lens_q ends at {bounds[-1]} but the packed row has {query.shape[2]} tokens")
        layout = _pad_layout(tuple(bounds), query.device)
    elif layout.scatter.shape[0] != query.shape[2]:
        raise ValueError(f"packed_layout places {layout.scatter.shape[0]} tokens but the packed row has {query.shape[2]}")
    if query.shape[0] != 1:
        raise ValueError(f"packed attention needs one packed row, got a batch of {query.shape[0]}")
    if sliding_window is not None:
        raise NotImplementedError("packed sequences do not support sliding-window attention layers")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"{query.shape[1]} query heads are not a multiple of {key.shape[1]} key/value heads")
    dropout = dropout if module.training else 0.0
    if not dropout:
        fused = packed_attention(query, key, value, layout, scaling)  # the C kernels on CPU, when they can run
        if fused is not None:
            return fused, None
    flat_gather, max_len = layout.gather.reshape(-1), layout.max_len
    n, heads, head_dim = layout.gather.shape[0], query.shape[1], query.shape[3]

    def padded(x: Tensor) -> Tensor:  # (1 h T d) -> (n h L d), each sequence left-aligned
        # row gathers over (T h d): HF's q / k / v are T-major in memory (views of the projections'
        # output), and index_select (backward: index_add) is several times faster than advanced indexing
        rows = x[0].transpose(0, 1).index_select(0, flat_gather)
        return rows.view(n, max_len, x.shape[1], x.shape[3]).transpose(1, 2)

    dtype = query.dtype
    use_matmul = _use_matmul_attention(query, max_len)
    if not use_matmul:
        # upcast before the gather, so that a shared prompt's gradient is summed over its group in fp32
        query, key, value, dtype = _cpu_fp32(query, key, value)
    q, k, v = padded(query), padded(key), padded(value)
    if use_matmul:
        out = _causal_matmul_attention(q, k, v, scaling, dropout)
    else:
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=heads != k.shape[1]
        )  # (n h L d)
    out = out.transpose(1, 2).reshape(n * max_len, heads, head_dim).index_select(0, layout.scatter).to(dtype)  # (T h d)
    return out[None], None


#: On CPU, the longest block (sequence) for which :func:`_causal_matmul_attention` beats SDPA, per
#: input dtype (torch 2.13, one thread, fwd+bwd of (n, 4 heads, L, 64) with 2 KV heads). bf16: the
#: matmul form at L = 33 / 256 / 1024 takes 8 / 38 / 224 ms against 18 / 51 / 151 ms for fp32 SDPA
#: (the upcast path) and 52 / 61 / 127 ms for bf16 SDPA. fp32: 15 vs 18 ms at L = 33, 23 vs 19 at 64.
#: In a whole GRPO update (benchmarks' config B, bf16) it took 519 instead of 576 ms.
MATMUL_ATTENTION_MAX_LEN = {torch.float32: 48, torch.bfloat16: 512}


def _use_matmul_attention(query: Tensor, max_len: int) -> bool:
    return query.device.type == "cpu" and max_len <= MATMUL_ATTENTION_MAX_LEN.get(query.dtype, 0)


def _causal_matmul_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None, dropout: float) -> Tensor:
    """Causal attention ``q (n h L d), k v (n kv L d) -> (n h L d)`` as two batched matmuls.

    The ``h / kv`` query heads that share a key/value head are stacked along the query axis, so every
    matmul reads each key/value block once (no GQA expansion). Softmax accumulates in fp32 and returns
    the input dtype. Cheaper than PyTorch's CPU SDPA kernels for the short blocks of RL micro-batches
    (:data:`MATMUL_ATTENTION_MAX_LEN`), and in bf16 it needs no upcast of ``q``, ``k``, ``v``. (With
    shared prompts the gather's backward then sums a prompt's gradient over its group in bf16; on CPU
    the result is as close as one rounding of the exact sum: 0.28% max relative error for 8 copies,
    measured.)
    """
    n, h, length, d = q.shape
    kv = k.shape[1]  # divides h (checked by the caller)
    scale = d**-0.5 if scale is None else scale
    future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu_(1)
    scores = torch.matmul(q.reshape(n, kv, h // kv * length, d), k.transpose(-1, -2)).view(n, kv, h // kv, length, length)
    scores = scores.mul(scale).masked_fill_(future, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # bf16 / fp16 in and out, fp32 inside (PyTorch's CPU kernel)
    if dropout:
        probs = F.dropout(probs, p=dropout)
    return torch.matmul(probs.view(n, kv, h // kv * length, length), v).view(n, h, length, d)


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
        raise ValueError(f"packed sequences need a Hugging Face model with an attention interface, got {type(model).__name__}")
    current = config._attn_implementation
    if current in _FLASH:
        return current
    if getattr(config, "use_sliding_window", False):
        raise NotImplementedError("packed sequences do not support sliding-window attention (config.use_sliding_window)")
    _register()
    model.set_attn_implementation(VARLEN_SDPA)
    return VARLEN_SDPA
