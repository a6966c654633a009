"""What both rollout engines share: sampling options, input checks, the batch they return, token sampling.

The native engine (:mod:`backends.rollout.native`) and the vLLM engine (:mod:`backends.rollout.vllm`)
accept and refuse the same prompts, find the same EOS ids and assemble the same
:class:`rlfunc.RolloutBatch` (row order, padding, masks, ``group_ids``) from these helpers, so a recipe
can switch engines without seeing a difference in what it gets back.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs
import torch
from torch import Tensor

from rlfunc.batch import RolloutBatch, validate

__all__ = [
    "SamplingConfig",
    "TurnOutput",
    "EndedTurn",
    "EndedRequest",
    "checked_turn",
    "default_eos_token_ids",
    "prepare_prompts",
    "check_group_ids",
    "left_pad",
    "assemble_batch",
    "sample_tokens",
    "HostCopy",
    "on_device",
    "decode_responses",
    "answer_texts",
    "sampling_options",
]


def _at_least(minimum: float):
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value < minimum:
            raise ValueError(f"SamplingConfig.{attribute.name} must be >= {minimum}, got {value}")

    return check


def _check_top_p(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {value}")


@attrs.frozen
class SamplingConfig:
    """How ``generate`` samples. An unknown option is a ``TypeError`` naming it (attrs)."""

    n: int = attrs.field(default=8, validator=_at_least(1))  #: samples (rows) per prompt: one group each
    temperature: float = attrs.field(default=1.0, validator=_at_least(0.0))  #: 0 means greedy (argmax)
    top_k: int = attrs.field(default=0, validator=_at_least(0))  #: keep the k most likely tokens; 0 = off
    top_p: float = attrs.field(default=1.0, validator=_check_top_p)  #: nucleus mass; 1.0 = off
    max_new_tokens: int = attrs.field(default=16, validator=_at_least(1))  #: response length cap
    seed: int = 0  #: seed of the sampling generator (overridable per call: ``generate(..., seed=)``)
    truncate_prompts: bool = False  #: left-truncate prompts that do not fit the context (else raise)


@attrs.frozen
class TurnOutput:
    """What one model turn of a multi-turn rollout added, per row (what an engine's continue call returns).

    Token-in / token-out: these are the exact ids the engine fed and sampled, never re-encoded text.
    """

    #: per row: the tokens this call added: the forced ones first, then the sampled ones up to and
    #: including the end-of-turn (EOS) token, or cut at the row's budget
    tokens: list[list[int]]
    #: per row, per added token: the sampled token's raw log-prob (temperature 1, as generate's
    #: ``rollout_logprobs``); 0.0 for forced tokens
    logprobs: list[list[float]]
    #: per row, per added token: True for sampled (model) tokens, False for forced ones
    sampled: list[list[bool]]
    #: per row: the turn ended with an EOS token (False: cut by the budget, or inactive)
    finished: list[bool]


@attrs.frozen
class EndedTurn:
    """One row's model turn that ended (what a :class:`backends.rollout.engine.TurnStream` step returns): the
    tokens, log-probs and kinds of a :class:`TurnOutput` row."""

    row: int
    tokens: list[int]  #: the forced tokens first, then the sampled ones up to and including the EOS (or the cut)
    logprobs: list[float]  #: raw log-probs of the sampled tokens; 0.0 for forced ones
    sampled: list[bool]  #: True for sampled (model) tokens
    finished: bool  #: the turn ended with an EOS token (False: its token limit cut it)


def checked_turn(
    who: str,
    row: int,
    forced: Sequence[int],
    max_new_tokens: int,
    *,
    closed: Sequence[bool],
    in_turn: Callable[[int], bool],
    added: Callable[[int], int],
    vocab_size: int,
    max_slots: int,
) -> list[int]:
    """``forced`` as token ids, once a :class:`backends.rollout.engine.TurnStream`'s ``resume(row, forced,
    max_new_tokens)`` is checked: ``closed`` per row, whether a row's turn is under way (``in_turn``), the tokens after
    its prompt so far (``added``), and the stream's ``max_slots``. ``who`` names the call in the errors."""
    if not 0 <= row < len(closed):
        raise ValueError(f"{who}: row {row} is outside [0, {len(closed)})")
    if closed[row]:
        raise ValueError(f"{who}: row {row} was closed")
    if in_turn(row):
        raise ValueError(f"{who}: row {row} is still in its turn")
    ids = [int(t) for t in forced]
    if ids and not 0 <= min(ids) <= max(ids) < vocab_size:
        raise ValueError(f"{who}: row {row}'s forced tokens are outside [0, {vocab_size})")
    if max_new_tokens < 1:
        raise ValueError(f"{who}: max_new_tokens must be >= 1, got {max_new_tokens}")
    so_far = added(row)
    if so_far + len(ids) + max_new_tokens > max_slots:
        raise ValueError(
            f"{who}: row {row} has {so_far} tokens after its prompt; {len(ids)} forced and up to {max_new_tokens} "
            f"sampled tokens more would exceed max_slots={max_slots}"
        )
    return ids


@attrs.frozen
class EndedRequest:
    """A sampling request whose every row has ended (what a :class:`backends.rollout.engine.RequestStream` step
    returns): its rows as ``generate`` orders them, ``(rows t)`` right-padded, ``t`` the longest of them."""

    key: Any  #: the request's key, as it was added
    response_ids: Tensor  #: sampled tokens up to and including the EOS (or the cut), then padding
    response_mask: Tensor  #: bool: the row's own tokens
    logprobs: Tensor  #: fp32 raw log-probs of the sampled tokens, 0 where masked


def sampling_options(sampling: SamplingConfig) -> SamplingConfig:
    """The sampling options alone of a config that carries more (the rollout config's ``sampling()``): what an
    engine's ``generate`` maps; a plain sampling config as it is."""
    alone = getattr(sampling, "sampling", None)
    return alone() if callable(alone) else sampling


def default_eos_token_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    """The EOS ids of ``model`` (anything with ``config`` and ``generation_config``): the generation
    config's (else the config's), plus ``tokenizer.eos_token_id``, without repeats."""
    candidates: list[Any] = []
    gen_cfg = getattr(model, "generation_config", None)
    for source in (gen_cfg, model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            candidates.append(value)
            break
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        candidates.append(tokenizer.eos_token_id)
    ids: list[int] = []
    for c in candidates:
        for i in c if isinstance(c, (list, tuple)) else [c]:
            if int(i) not in ids:
                ids.append(int(i))
    if not ids:
        raise ValueError("no EOS token id: the model's generation_config, config and the tokenizer name none")
    return tuple(ids)


def prepare_prompts(
    prompts: Sequence[Sequence[int]], sampling: SamplingConfig, *, max_context: int, vocab_size: int
) -> list[list[int]]:
    """The prompts as lists of ints, checked (non-empty, ids in the vocabulary, room for
    ``max_new_tokens`` in ``max_context``) and left-truncated if ``sampling.truncate_prompts``."""
    if isinstance(prompts, Tensor) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a list of token-id lists (unpadded), got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: nothing to generate")
    budget = max_context - sampling.max_new_tokens
    if budget < 1:
        raise ValueError(
            f"max_new_tokens={sampling.max_new_tokens} leaves no room for a prompt in the context of "
            f"{max_context} positions"
        )
    out = []
    for i, prompt in enumerate(prompts):
        ids = prompt.tolist() if isinstance(prompt, Tensor) else [int(t) for t in prompt]
        if len(ids) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if len(ids) > budget:
            if not sampling.truncate_prompts:
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens; with max_new_tokens={sampling.max_new_tokens} it needs "
                    f"{len(ids) + sampling.max_new_tokens} positions, more than the context of {max_context} "
                    "(set truncate_prompts=True to keep the last tokens)"
                )
            ids = ids[-budget:]
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size}): min {lo}, max {hi}")
        out.append(ids)
    return out


def check_group_ids(group_ids: Tensor | None, num_prompts: int) -> Tensor | None:
    """``group_ids`` as a tensor, checked to be one integer per prompt (None stays None)."""
    if group_ids is None:
        return None
    group_ids = torch.as_tensor(group_ids)
    if group_ids.shape != (num_prompts,) or group_ids.is_floating_point() or group_ids.dtype == torch.bool:
        raise ValueError(
            f"group_ids must be an integer tensor of shape ({num_prompts},), "
            f"got {group_ids.dtype} {tuple(group_ids.shape)}"
        )
    return group_ids


def left_pad(prompts: list[list[int]], pad_token_id: int) -> tuple[Tensor, Tensor]:
    """``(num_prompts p)`` left-padded ids and their mask."""
    p = max(len(x) for x in prompts)
    prompt_ids = torch.full((len(prompts), p), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((len(prompts), p), dtype=torch.bool)
    for i, ids in enumerate(prompts):
        prompt_ids[i, p - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        prompt_mask[i, p - len(ids) :] = True
    return prompt_ids, prompt_mask


def assemble_batch(
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    rollout_logprobs: Tensor,
    *,
    n: int,
    group_ids: Tensor | None,
) -> RolloutBatch:
    """The validated batch: per-prompt ``(num_prompts p)`` tensors repeated for the ``n`` rows of each;
    ``group_ids`` per prompt (default: the prompt's index)."""
    num_prompts, device = prompt_ids.shape[0], prompt_ids.device
    if group_ids is None:
        prompt_groups = torch.arange(num_prompts, device=device)
    else:
        prompt_groups = group_ids.to(device=device, dtype=torch.long)
    return validate(
        RolloutBatch(
            prompt_ids=prompt_ids.repeat_interleave(n, dim=0),
            prompt_mask=prompt_mask.repeat_interleave(n, dim=0),
            response_ids=response_ids,
            response_mask=response_mask,
            group_ids=prompt_groups.repeat_interleave(n),
            rollout_logprobs=rollout_logprobs,
        )
    )


def sample_tokens(
    logits: Tensor, sampling: SamplingConfig, generator: torch.Generator | None, *, uniform: Tensor | None = None
) -> Tensor:
    """Draw one token per row from ``logits`` ``(b v)``: temperature, then top-k, then top-p (HF order).

    ``temperature == 0`` is greedy (``argmax``, first index on ties; top-k / top-p are then moot).
    Top-k keeps every token whose logit reaches the k-th largest (ties kept, like HF); top-p keeps the
    smallest set of most likely tokens whose mass reaches ``top_p`` (always at least one). Drawing is
    inverse-CDF sampling with one uniform per row (same distribution as ``torch.multinomial``, cheaper
    on CPU): ``uniform (b 1)`` in [0, 1) if given, else drawn from ``generator``.
    """
    logits = logits.float()
    if sampling.temperature == 0.0:
        return logits.argmax(dim=-1)
    scaled = logits if sampling.temperature == 1.0 else logits / sampling.temperature  # (b v): a pass saved at 1
    vocab = scaled.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(scaled, sampling.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    order = None
    if sampling.top_p < 1.0:
        scaled, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
        probs = torch.softmax(scaled, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        probs = probs.masked_fill(mass_before >= sampling.top_p, 0.0)
    else:
        probs = torch.softmax(scaled, dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    if uniform is None:
        uniform = torch.rand((cdf.shape[0], 1), generator=generator, device=cdf.device, dtype=cdf.dtype)
    choice = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).clamp_(max=vocab - 1)
    if order is not None:
        choice = order.gather(-1, choice)
    return choice.squeeze(-1)


def on_device(values: Sequence[Any] | Tensor, device: torch.device) -> Tensor:
    """``values`` (a host tensor, or ints, or equal-length lists of ints: int64) on ``device``. On CUDA the copy is
    queued from pinned memory: a plain copy from the host (``torch.tensor(values, device=...)``, ``.to(device)``)
    waits for everything queued on the stream first (PyTorch synchronises the stream after a blocking host-to-device
    copy), which would stall the host behind the decode step it just queued."""
    host = values if isinstance(values, Tensor) else torch.tensor(values, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """A device tensor's values on the host, copied now and waited for by :meth:`values`: on CUDA into pinned memory
    behind an event, so the host waits for the work queued before the copy and not for what it queues after (the
    next decode step); elsewhere the tensor itself."""

    def __init__(self, tensor: Tensor) -> None:
        self.event = None
        if tensor.device.type == "cuda":
            self.host = tensor.to("cpu", non_blocking=True)  # pinned: the copy is queued, not waited for
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tensor

    def values(self) -> list:
        """The tensor's ``tolist()``, once the copy has landed."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


def decode_responses(tokenizer: Any, batch: RolloutBatch, *, skip_special_tokens: bool = True) -> list[str]:
    """The text of each row's response (masked tokens only; EOS and other specials dropped by default)."""
    lengths = batch.response_mask.sum(-1).tolist()
    ids = batch.response_ids.tolist()
    return [
        tokenizer.decode(row[:length], skip_special_tokens=skip_special_tokens) for row, length in zip(ids, lengths)
    ]


def answer_texts(tokenizer: Any, batch: RolloutBatch) -> list[str]:
    """What a reward function reads of each row: its response, or for a multi-turn trajectory (``turn_ids``
    set) the model's last turn, its own tokens only (EOS and other specials dropped)."""
    if batch.turn_ids is None:
        return decode_responses(tokenizer, batch)
    own = batch.response_mask if batch.loss_mask is None else batch.loss_mask
    last = torch.where(own, batch.turn_ids, -1).amax(-1, keepdim=True)
    answer = own & (batch.turn_ids == last)
    return [
        tokenizer.decode(ids[keep].tolist(), skip_special_tokens=True) for ids, keep in zip(batch.response_ids, answer)
    ]
