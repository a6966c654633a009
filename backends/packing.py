"""Packed sequences (verl's ``use_remove_padding``): a micro-batch's rows concatenated into one row.

A padded micro-batch ``(b, p + t)`` spends compute on left-padding of the prompts and on response
columns after each row's last real token. Packing keeps, per row, the real prompt tokens and the
response tokens that predict the rest of it, up to its last ``response_mask`` token (the last one
itself predicts nothing and is dropped; a row always predicts at least its first response token),
and concatenates them into one row ``(1, T)``, ``T = sum_i (p_i + r_i - 1)``:

- ``position_ids`` restart at 0 for every sequence (so rotary embeddings see what they see padded);
- ``cu_seqlens`` ``(n + 1)`` are the cumulative sequence lengths (flash-attention's varlen format);
- attention never crosses a sequence boundary.

Attention on the packed row needs the sequences apart: ``cu_seqlens`` for flash-attention's varlen
kernels, or a :class:`BlockLayout` (where each sequence sits in a left-aligned ``(n, max_len)`` block)
for the packed-aware attention of ``backends.training.packed_attention``. This module is the layout
only; it computes no attention.

Outputs are gathered at the positions that predict the response tokens and scattered back to
``(b t)`` (zeros after a row's last kept token), so losses written for padded batches are unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import torch
from torch import Tensor

__all__ = [
    "BlockLayout",
    "PackedRows",
    "boundaries_from_positions",
    "model_kwargs",
    "pack_rows",
    "pad_layout",
    "unpack",
]


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
    #: (n + 1) int32: start of each sequence in the row, then T. None when prompts are shared: the
    #: sequences are then not contiguous in the row, and ``layout`` says where they are.
    cu_seqlens: Tensor | None
    max_seqlen: int  # max_i L_i
    predict_index: Tensor  # (N): packed positions whose next-token output belongs to a response token
    rows: Tensor  # (N): micro-batch row of each kept response token
    cols: Tensor  # (N): response column of each kept response token
    labels: Tensor  # (N): the kept response token ids
    shape: tuple[int, int]  # (b, t) of the micro-batch's response block
    layout: BlockLayout | None = None  # set when prompts are shared (see pack_rows)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def pack_rows(
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    *,
    share_prompts: bool = False,
    with_last_token: bool = False,
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
    attention (``backends.training.packed_attention``) reads ``layout``, flash-attention varlen cannot.
    """
    _check_rows(prompt_ids, prompt_mask, response_ids, response_mask)
    b, p = prompt_ids.shape
    t = response_ids.shape[1]
    prompt_mask = prompt_mask.bool()
    prompt_len = prompt_mask.sum(-1)
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
    # the stream: flat (row, column) indices of the stored tokens in packed order, rows grouped
    # behind their leader, leaders in order of first appearance
    width = p + t
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
        input_ids=packed_input_ids,
        position_ids=packed_position_ids,
        max_seqlen=int(seqlens.max()),
        predict_index=predict_index,
        rows=rows,
        cols=resp_cols,
        labels=response_ids[response_keep],
        shape=(b, t),
    )
    if not share_prompts:
        cu_seqlens = torch.cat([seqlens.new_zeros(1), seqlens.cumsum(0)]).to(torch.int32)
        return PackedRows(cu_seqlens=cu_seqlens, **common)
    return PackedRows(cu_seqlens=None, layout=_shared_layout(index, stored, prompt_len, seqlens, p), **common)


def _check_rows(prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor) -> None:
    b, p = prompt_ids.shape
    t = response_ids.shape[1]
    if response_ids.shape[0] != b or prompt_mask.shape != (b, p) or response_mask.shape != (b, t):
        raise ValueError(
            f"pack_rows: shapes disagree: prompt_ids {tuple(prompt_ids.shape)}, "
            f"prompt_mask {tuple(prompt_mask.shape)}, "
            f"response_ids {tuple(response_ids.shape)}, response_mask {tuple(response_mask.shape)}"
        )
    if t == 0:
        raise ValueError("pack_rows: the response block has no columns")
    prompt_mask = prompt_mask.bool()
    if bool((prompt_mask.sum(-1) == 0).any()):
        raise ValueError("pack_rows: a row has an empty prompt (prompt_mask all false)")
    if bool((prompt_mask[:, 1:] < prompt_mask[:, :-1]).any()):
        raise ValueError("pack_rows: prompts must be left-padded (a padding token follows a real prompt token)")


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
    # (b, p + t): the block slot of each column (valid on the row's sequence)
    slot = torch.arange(b, device=index.device)[:, None] * max_len + (
        torch.arange(index.shape[1], device=index.device)[None] - (p - prompt_len)[:, None]
    )
    scatter = torch.empty(int(stored.sum()), dtype=torch.long, device=index.device)
    scatter[index[stored]] = slot[stored]
    return BlockLayout(gather=gather, scatter=scatter, max_len=max_len, lengths=seqlens.to(torch.long))


def unpack(values: Tensor, packed: PackedRows) -> Tensor:
    """Scatter per-kept-token ``values`` ``(N)`` back to ``(b t)``, zeros elsewhere (differentiable)."""
    if values.shape != packed.rows.shape:
        raise ValueError(f"unpack: values must have shape {tuple(packed.rows.shape)}, got {tuple(values.shape)}")
    out = values.new_zeros(packed.shape)
    return out.index_put((packed.rows, packed.cols), values)


def model_kwargs(packed: PackedRows, *, block_layout: bool = False) -> dict[str, Any]:
    """Keyword arguments of a Hugging Face forward over the packed row (no attention mask: the
    sequences are delimited by ``cu_seq_lens_*``, read by flash-attention's varlen kernel, or by a
    ``packed_layout``, which ``backends.training.packed_attention.varlen_sdpa_attention`` reads).

    ``block_layout`` (a model whose attention reads layouts): the layout of contiguous sequences is made
    here, once per forward, so no layer has to read ``cu_seq_lens`` back to the host; shared prompts
    always come as a layout."""
    layout = packed.layout
    if layout is None and block_layout:
        layout = pad_layout(tuple(int(x) for x in packed.cu_seqlens.tolist()), packed.input_ids.device)
    if layout is not None:
        return dict(input_ids=packed.input_ids, position_ids=packed.position_ids, packed_layout=layout, use_cache=False)
    return dict(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        cu_seq_lens_q=packed.cu_seqlens,
        cu_seq_lens_k=packed.cu_seqlens,
        max_length_q=packed.max_seqlen,
        max_length_k=packed.max_seqlen,
        use_cache=False,
    )


def boundaries_from_positions(position_ids: Tensor) -> list[int] | None:
    """Sequence starts of a packed row from restarting position ids (as HF's find_packed_sequence_indices)."""
    if position_ids.shape[0] != 1:
        return None
    pos = position_ids[0]
    starts = (torch.diff(pos, prepend=pos[:1] - 1) != 1).nonzero().flatten().tolist()
    if not starts or starts == [0]:
        return None
    return ([0] if starts[0] != 0 else []) + starts + [int(pos.shape[0])]


@functools.lru_cache(maxsize=16)
def pad_layout(bounds: tuple[int, ...], device: torch.device) -> BlockLayout:
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
    return BlockLayout(
        gather=gather.to(device), scatter=scatter.to(device), max_len=max_len, lengths=lengths.to(device)
    )
