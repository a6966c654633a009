"""A micro-batch through a Hugging Face model: the response tokens' log-probs, entropies or values.

Two layouts with the same numbers: left-padded rows (:func:`forward_micro_batch`'s default), or the
micro-batch packed into one row without padding (``packed``, backends/packing.py), where each distinct
prompt may be held once (``share_prompts``) when the model runs the packed-aware attention of
:mod:`backends.training.packed_attention`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from backends.packing import PackedRows, model_kwargs, pack_rows, unpack
from backends.training.common import ModelOutputs
from backends.training.packed_attention import VARLEN_SDPA
from rlfunc.batch import RolloutBatch
from rlfunc.logits import entropy_from_logits, logprobs_from_logits

__all__ = ["forward_micro_batch"]


def forward_micro_batch(
    module: nn.Module,
    mb: RolloutBatch,
    *,
    with_entropy: bool,
    role: str = "actor",
    packed: bool = False,
    share_prompts: bool = False,
    chunk_rows: int | None = None,
) -> ModelOutputs:
    """Log-probs (and entropies) of the response tokens, or a critic's values; prompts are left-padded.

    The input is the prompt and all response columns but the last: position ``p - 1 + j`` predicts
    response token ``j``, and the last column's output would predict nothing (nor does any earlier
    token attend to it), so it is not computed. The response block is fully visible to attention:
    under the causal mask a real response token only sees tokens before it, so padding after it
    changes nothing, and this keeps the result independent of loss-masking edits to
    ``response_mask``. ``packed``: the same numbers from one packed row (:func:`_forward_packed`),
    with each distinct prompt held once if ``share_prompts``. ``chunk_rows``: the log-probs and entropies
    are taken that many logit rows at a time (``rlfunc.logprobs_from_logits``'s ``chunk_size``).
    """
    if packed:
        return _forward_packed(
            module, mb, with_entropy=with_entropy, role=role, share_prompts=share_prompts, chunk_rows=chunk_rows
        )
    t = mb.response_ids.shape[1]
    input_ids = torch.cat([mb.prompt_ids, mb.response_ids[:, :-1]], dim=1)
    attention_mask = torch.cat([mb.prompt_mask, torch.ones_like(mb.response_mask[:, :-1])], dim=1)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    if role == "critic":
        return _forward_values(module, input_ids, attention_mask, position_ids, t)
    out = module(
        input_ids=input_ids,
        attention_mask=attention_mask.long(),
        position_ids=position_ids,
        use_cache=False,
        logits_to_keep=t,
    )
    logits = out.logits  # (b t v): position p-1+j predicts response token j
    logprobs = logprobs_from_logits(logits, mb.response_ids, chunk_size=chunk_rows)
    entropy = entropy_from_logits(logits, chunk_size=chunk_rows) if with_entropy else None
    return ModelOutputs(logprobs=logprobs, entropy=entropy)


def _forward_packed(
    module: nn.Module,
    mb: RolloutBatch,
    *,
    with_entropy: bool,
    role: str,
    share_prompts: bool = False,
    chunk_rows: int | None = None,
) -> ModelOutputs:
    """The micro-batch as one packed row (backends/packing.py): no compute on padding.

    Outputs are ``(b t)`` like the padded path's; positions after a row's last loss token hold 0
    (the padded path computes them and the losses mask them out). Only the positions that predict
    response tokens reach the lm_head (``logits_to_keep`` as an index tensor). ``share_prompts`` holds
    each distinct prompt once, when the model runs the packed-aware SDPA attention (which reads the
    shared layout; flash-attention varlen cannot).
    """
    reads_layouts = getattr(getattr(module, "config", None), "_attn_implementation", None) == VARLEN_SDPA
    packed: PackedRows = pack_rows(
        mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask, share_prompts=share_prompts and reads_layouts
    )
    if role == "critic":
        out = module(**model_kwargs(packed, block_layout=reads_layouts))
        logits = out.logits
        if logits.dim() != 3 or logits.shape[-1] != 1:
            raise ValueError(f"a critic's model must output one value per token (b, s, 1), got {tuple(logits.shape)}")
        return ModelOutputs(values=unpack(logits[0, packed.predict_index, 0].float(), packed))
    out = module(**model_kwargs(packed, block_layout=reads_layouts), logits_to_keep=packed.predict_index)
    logits = out.logits[0]  # (N v): one row per kept response token
    logprobs = unpack(logprobs_from_logits(logits, packed.labels, chunk_size=chunk_rows), packed)
    entropy = unpack(entropy_from_logits(logits, chunk_size=chunk_rows), packed) if with_entropy else None
    return ModelOutputs(logprobs=logprobs, entropy=entropy)


def _forward_values(
    module: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, t: int
) -> ModelOutputs:
    """Values of the response tokens: the head's output at positions p-1 .. p+t-2 (those that predict
    the response tokens; the input ends there), as verl's critic (``values[:, -t-1:-1]``). Same inputs
    as the log-prob pass."""
    out = module(input_ids=input_ids, attention_mask=attention_mask.long(), position_ids=position_ids, use_cache=False)
    logits = out.logits
    if logits.dim() != 3 or logits.shape[-1] != 1:
        raise ValueError(f"a critic's model must output one value per token (b, s, 1), got {tuple(logits.shape)}")
    return ModelOutputs(values=logits[:, -t:, 0].float())
