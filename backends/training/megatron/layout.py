"""How a micro-batch of (left-padded prompt, response) rows becomes megatron model input.

Megatron's rotary embedding numbers positions ``0 .. s-1`` and the core attention here is purely
causal, so rows are **left-aligned**: each row's real prompt tokens, then all its response tokens,
then padding. Position ``p`` of a row is then exactly HF's ``position_ids = cumsum(mask) - 1`` for the
left-padded row, and padding after the last token is invisible to every real token under the
causal mask (the same reason the FSDP engine can leave the response block unmasked).

Two layouts:

- ``bshd`` (rows): ``input_ids (b s)`` with ``s = max prompt length + t``;
- ``thd`` (packed, remove-padding): one row ``(1 T)`` holding each sequence's real prompt and its
  response up to its last loss token, back to back, with megatron's ``PackedSeqParams``
  (``cu_seqlens``): attention and RoPE restart at every boundary. No compute is spent on padding.

In both, response token ``j`` of row ``i`` is predicted by the model output at ``predict_index[i, j]``
(a flat index into the ``(b s)`` or ``(T)`` output) and is ``target_ids[i, j]``.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs
import torch
from torch import Tensor

from backends.packing import pad_layout
from rlfunc.batch import RolloutBatch

__all__ = ["ModelInput", "layout_micro_batch"]


@attrs.frozen
class ModelInput:
    input_ids: Tensor  #: (b s) rows, or (1 T) packed
    predict_index: Tensor  #: (b t) flat index of the output that predicts response token j of row i
    packed_seq_params: Any = None  #: megatron PackedSeqParams for "thd", else None

    @property
    def hidden_shape_prefix(self) -> tuple[int, int]:
        """(s, b) of the hidden states megatron passes between stages (``s b h``)."""
        b, s = self.input_ids.shape
        return (s, b)


def layout_micro_batch(mb: RolloutBatch, layout: Literal["bshd", "thd"] = "bshd", pad_id: int = 0) -> ModelInput:
    """Model input for ``mb`` (see the module docstring). Prompts may be left-padded or have holes:
    only ``prompt_mask`` positions are kept, in order."""
    b, p = mb.prompt_ids.shape
    t = mb.response_ids.shape[1]
    device = mb.prompt_ids.device
    keep = torch.cat([mb.prompt_mask, torch.ones_like(mb.response_mask)], dim=1)  # (b p+t)
    ids = torch.cat([mb.prompt_ids, mb.response_ids], dim=1)
    prompt_len = mb.prompt_mask.sum(-1)  # (b)
    j = torch.arange(t, device=device)
    if layout == "bshd":
        order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)  # kept tokens first, in order
        aligned = torch.where(torch.gather(keep, 1, order), torch.gather(ids, 1, order), torch.full_like(ids, pad_id))
        s = int(prompt_len.max()) + t
        aligned = aligned[:, :s]
        rows = torch.arange(b, device=device)[:, None]
        predict = rows * s + (prompt_len[:, None] + j[None, :] - 1)
        return ModelInput(input_ids=aligned, predict_index=predict)
    if layout != "thd":
        raise ValueError(f"layout must be 'bshd' or 'thd', got {layout!r}")
    from megatron.core.packed_seq_params import PackedSeqParams

    has_loss = mb.response_mask.any(-1)
    last = torch.where(has_loss, t - 1 - mb.response_mask.flip(-1).int().argmax(-1), torch.zeros_like(prompt_len))
    resp_len = last + 1  # responses are kept up to their last loss token (at least one token)
    seq_len = prompt_len + resp_len
    cu = torch.zeros(b + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(seq_len, 0).to(torch.int32)
    parts = []
    for i in range(b):  # host loop over rows: the lengths differ per row
        parts.append(mb.prompt_ids[i][mb.prompt_mask[i]])
        parts.append(mb.response_ids[i, : int(resp_len[i])])
    packed = torch.cat(parts).unsqueeze(0)
    # Response columns after a row's kept part predict nothing useful; point them at a valid index.
    predict = cu[:-1, None].long() + prompt_len[:, None] + j[None, :] - 1
    predict = torch.minimum(predict, cu[1:, None].long() - 1)
    max_len = int(seq_len.max())
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len, max_seqlen_kv=max_len
    )
    # the attention's block layout, made once here where the boundaries are on the host (every layer reads it)
    params.block_layout = pad_layout(tuple(int(x) for x in cu.tolist()), device)
    return ModelInput(input_ids=packed, predict_index=predict, packed_seq_params=params)
