"""Supervised fine-tuning (SFT) as a training stage: (prompt, response) token-id examples through the engine.

A stage of ``cfg.steps`` updates, each on ``cfg.batch_size`` examples (global; every data-parallel rank
trains on its share). The loss is the negative log-likelihood of the response tokens, aggregated with
the engine's global normalisers, so the stage runs through the same ``update`` (sharding, micro-batches,
optimizer) as the RL phase that usually follows it; a recipe uses it as a warm start, so that RL begins
from an imperfect policy as a real post-training run begins from an SFT model.

:func:`run_sft` asks ``next_examples(step)`` for each step's global batch, so a caller can draw its
examples however it likes; :func:`load_sft_examples` reads them from data files (``sft.files``): a
prompt (a string, or chat messages rendered by the chat template with the generation prompt) and a
response string, trained on the response tokens only (for a chat, the assistant turn as the template
renders it, end-of-turn included; for a string prompt, the response and EOS). With ``sft.messages_key`` a row
is instead a whole conversation (a multi-turn or tool-use trace): the tokens after the first assistant turn's
generation prompt are the response, and only the assistant turns' tokens are trained on (``loss_mask``); the
tool and user turns between them are read, not trained on, as in a multi-turn RL rollout.
"""

from __future__ import annotations

import bisect
import math
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import attrs
import torch
from tqdm import tqdm

import rlfunc as rf
from backends.data import DataError, column_value, prompt_token_ids, read_rows
from backends.distributed import watchdog
from backends.training.fsdp import update
from backends.training.optim import OptimConfig, with_total_steps

__all__ = ["SFTConfig", "SFTExample", "load_sft_examples", "nll_loss", "run_sft", "sft_batch", "sft_optim", "sft_steps"]


@attrs.frozen
class SFTConfig:
    """An optional supervised stage before RL (off unless ``sft.files`` names data); the state must be built
    with :func:`sft_optim` of it."""

    files: tuple[str, ...] = ()  #: SFT data (.jsonl / .parquet / saved datasets dir); empty: no SFT stage
    prompt_key: str = "prompt"  #: column of the prompt: a string or a list of chat messages
    response_key: str = "response"  #: column of the response string the model is trained to write
    #: column of a whole conversation (chat messages: system, user, assistant, tool) trained on its assistant turns
    #: only; when set, sft.prompt_key and sft.response_key are not read
    messages_key: str = ""
    #: passes over sft.files (when sft.steps is 0)
    epochs: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    #: SFT updates; 0: sft.epochs passes over the data
    steps: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    batch_size: int = attrs.field(default=64, validator=attrs.validators.ge(1))  #: global examples per SFT update
    #: longest prompt + response in tokens (longer rows are an error)
    max_length: int = attrs.field(default=1024, validator=attrs.validators.ge(2))
    #: the SFT stage's optimizer
    optim: OptimConfig = OptimConfig(
        lr=1e-5, weight_decay=0.0, lr_warmup_steps_ratio=0.1, lr_scheduler_type="cosine", min_lr_ratio=0.1
    )


def sft_steps(cfg: SFTConfig, num_examples: int) -> int:
    """The stage's number of updates: ``cfg.steps``, or ``cfg.epochs`` passes over ``num_examples``."""
    return cfg.steps or cfg.epochs * math.ceil(num_examples / cfg.batch_size)


@attrs.frozen
class SFTExample:
    """One supervised example: the model reads ``prompt_ids`` and is trained to continue with
    ``response_ids`` (include the EOS token there when the model should learn to stop); ``loss_mask``, when
    given, says which response tokens are trained on (the others are read only)."""

    prompt_ids: tuple[int, ...] = attrs.field(converter=tuple)
    response_ids: tuple[int, ...] = attrs.field(converter=tuple)
    loss_mask: tuple[bool, ...] | None = attrs.field(default=None, converter=attrs.converters.optional(tuple))

    def __attrs_post_init__(self) -> None:
        if not self.prompt_ids or not self.response_ids:
            raise ValueError("an SFT example needs at least one prompt token and one response token")
        if self.loss_mask is not None and (len(self.loss_mask) != len(self.response_ids) or not any(self.loss_mask)):
            raise ValueError(
                f"an SFT example's loss_mask must have one entry per response token "
                f"({len(self.response_ids)}) and at least one True, got {len(self.loss_mask)}"
            )


def sft_optim(cfg: SFTConfig, steps: int | None = None) -> OptimConfig:
    """The optimizer config to build the trained state with: ``cfg.optim`` scheduled over the stage's
    ``steps`` (default ``cfg.steps``)."""
    return with_total_steps(cfg.optim, cfg.steps if steps is None else steps)


def load_sft_examples(
    cfg: SFTConfig, tokenizer: Any, *, chat_template: str = "auto", tools: Sequence[Mapping[str, Any]] | None = None
) -> list[SFTExample]:
    """Every row of ``cfg.files`` as an :class:`SFTExample` (see the module doc; chats rendered with the ``tools``
    schemas, as the RL prompts are); a bad row is a :class:`backends.data.DataError` naming the file and row."""
    examples = []
    for path in cfg.files:
        if cfg.messages_key:  # conversations: tokenised a chunk of rows at a time (_conversations)
            rows = ((where, column_value(row, cfg.messages_key, where)) for where, row in read_rows(path))
            pairs = (
                pair
                for chunk in _chunks(rows, _CONVERSATION_CHUNK)
                for pair in _conversations(chunk, tokenizer, chat_template, tools)
            )
        else:
            pairs = (
                (
                    where,
                    _named(
                        where,
                        _tokenise,
                        column_value(row, cfg.prompt_key, where),
                        column_value(row, cfg.response_key, where),
                        tokenizer,
                        chat_template,
                        tools,
                    ),
                )
                for where, row in read_rows(path)
            )
        for where, example in pairs:
            if len(example.prompt_ids) + len(example.response_ids) > cfg.max_length:
                raise DataError(
                    f"{where}: prompt + response is {len(example.prompt_ids) + len(example.response_ids)} "
                    f"tokens, more than sft.max_length={cfg.max_length}"
                )
            examples.append(example)
    if not examples:
        raise DataError(f"no rows in sft.files {list(cfg.files)}")
    return examples


#: conversations rendered, then tokenised in one call, this many rows at a time
_CONVERSATION_CHUNK = 256


def _named(where: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, a failure re-raised as a :class:`DataError` naming the row."""
    try:
        return fn(*args)
    except (DataError, ValueError) as e:
        raise DataError(f"{where}: {e}") from None


def _chunks(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _tokenise(
    prompt: Any, response: Any, tokenizer: Any, chat_template: str, tools: Sequence[Mapping[str, Any]] | None = None
) -> SFTExample:
    if not isinstance(response, str) or not response:
        raise DataError(f"the response must be a non-empty string, got {response!r:.60}")
    if isinstance(prompt, str):
        if tokenizer.eos_token_id is None:
            raise DataError("the tokenizer has no EOS token to end a response with")
        ids = list(tokenizer(response, add_special_tokens=False)["input_ids"])
        return SFTExample(prompt_token_ids(prompt, tokenizer), ids + [tokenizer.eos_token_id])
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise DataError(f"a prompt must be a string or a non-empty list of messages, got {type(prompt).__name__}")
    messages = [dict(m) for m in prompt]
    prompt_ids = prompt_token_ids(messages, tokenizer, chat_template=chat_template, tools=tools)
    full = _render(messages + [{"role": "assistant", "content": response}], tokenizer, chat_template, tools)
    if full[: len(prompt_ids)] != prompt_ids:
        raise DataError(
            "the chat template renders the prompt differently when the assistant's answer follows it; "
            "the answer's tokens cannot be separated from the prompt's"
        )
    return SFTExample(prompt_ids, full[len(prompt_ids) :])


def _render(
    messages: list[dict],
    tokenizer: Any,
    chat_template: str,
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    generation_prompt: bool = False,
) -> list[int]:
    template = None if chat_template == "auto" else Path(chat_template).read_text()
    ids = tokenizer.apply_chat_template(
        messages,
        tokenize=True,
        chat_template=template,
        add_generation_prompt=generation_prompt,
        tools=list(tools) if tools else None,
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _conversations(
    rows: list[tuple[str, Any]], tokenizer: Any, chat_template: str, tools: Sequence[Mapping[str, Any]] | None
) -> list[tuple[str, SFTExample]]:
    """``(where, example)`` of each ``(where, messages)`` row: a conversation's tokens, cut where each assistant turn
    starts and ends (see the module doc), exactly what the template renders for the whole chat.

    Each row's renderings (before each assistant turn with the generation prompt, and through it) are text; the
    whole chats of the rows are tokenised in one call, and each is cut where its shorter renderings end
    (:func:`_token_cuts`). A row whose cuts cannot be taken from its whole chat's tokens is tokenised rendering by
    rendering (:func:`_tokenise_conversation_by_renders`), which names a template that changes earlier tokens."""
    template = None if chat_template == "auto" else Path(chat_template).read_text()
    rendered = []
    for where, messages in rows:
        messages, turns = _named(where, _conversation_turns, messages)
        texts = []
        for k in turns:
            texts += [
                _named(where, _render_text, messages[:k], tokenizer, template, tools, True),
                _named(where, _render_text, messages[: k + 1], tokenizer, template, tools, False),
            ]
        rendered.append((where, messages, turns, texts))
    try:
        encoded = tokenizer(
            [texts[-1] for *_, texts in rendered], add_special_tokens=False, return_offsets_mapping=True
        )
    except (NotImplementedError, ValueError, TypeError):  # no offsets (a slow tokenizer): rendering by rendering
        encoded = None
    added = set(getattr(tokenizer, "added_tokens_decoder", None) or ())
    out = []
    for i, (where, messages, turns, texts) in enumerate(rendered):
        cut = (
            None
            if encoded is None
            else _token_cuts(
                texts,
                list(encoded["input_ids"][i]),
                [int(end) for _, end in encoded["offset_mapping"][i]],
                tokenizer,
                added,
            )
        )
        if cut is None:
            out.append(
                (
                    where,
                    _named(where, _tokenise_conversation_by_renders, messages, turns, tokenizer, chat_template, tools),
                )
            )
            continue
        tokens, counts = cut
        mask = [False] * counts[0]
        for c in range(1, len(counts)):
            mask += [c % 2 == 1] * (counts[c] - counts[c - 1])  # an odd cut ends an assistant turn
        out.append((where, _named(where, SFTExample, tokens[: counts[0]], tokens[counts[0] :], mask[counts[0] :])))
    return out


def _conversation_turns(messages: Any) -> tuple[list[dict], list[int]]:
    """The messages, checked, and the indices of the assistant turns."""
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise DataError("a conversation must be a list of chat messages with a role each")
    messages = [dict(m) for m in messages]
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns or turns[0] == 0:
        raise DataError("a conversation needs a message before its first assistant turn, and an assistant turn")
    return messages, turns


def _render_text(
    messages: list[dict],
    tokenizer: Any,
    template: str | None,
    tools: Sequence[Mapping[str, Any]] | None,
    generation_prompt: bool,
) -> str:
    return tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        chat_template=template,
        add_generation_prompt=generation_prompt,
        tools=list(tools) if tools else None,
    )


def _token_cuts(
    texts: list[str], ids: list[int], ends: list[int], tokenizer: Any, added: set[int]
) -> tuple[list[int], list[int]] | None:
    """``(ids, how many of them each text holds)`` from ``ids`` and the character ``ends`` of the last text's tokens
    (``apply_chat_template``'s tokenisation: ``add_special_tokens=False``), or None when a text is not a prefix of the
    next or its tokens are not the head of the last text's.

    A text that ends at a token boundary beside an added (special) token holds exactly the tokens up to it: the
    tokenizer splits a text at its added tokens before anything else and tokenises the pieces between them on their
    own. Any other text is tokenised on its own and must be a head of the last text's tokens."""
    if any(not later.startswith(text) for text, later in zip(texts, texts[1:])):
        return None
    counts = []
    for text in texts:
        j = bisect.bisect_right(ends, len(text))  # the tokens that end within the text
        at_split = j > 0 and ends[j - 1] == len(text) and (ids[j - 1] in added or (j < len(ids) and ids[j] in added))
        if not (at_split or j == len(ids) and len(text) == len(texts[-1])):
            own = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            if ids[: len(own)] != own:
                return None
            j = len(own)
        counts.append(j)
    return ids, counts


def _tokenise_conversation_by_renders(
    messages: list[dict],
    turns: list[int],
    tokenizer: Any,
    chat_template: str,
    tools: Sequence[Mapping[str, Any]] | None,
) -> SFTExample:
    """A conversation (:func:`_conversations`) with every rendering tokenised on its own, each checked to be a prefix
    of the next."""
    tokens: list[int] = []
    mask: list[bool] = []
    for k in turns:
        # up to the assistant's generation prompt (read), then through the assistant's turn (trained)
        for ids, trained in (
            (_render(messages[:k], tokenizer, chat_template, tools, generation_prompt=True), False),
            (_render(messages[: k + 1], tokenizer, chat_template, tools), True),
        ):
            if ids[: len(tokens)] != tokens:
                raise DataError(
                    f"the chat template renders message {k}'s conversation so that an earlier part "
                    "changes; its turns' tokens cannot be cut apart"
                )
            mask += [trained] * (len(ids) - len(tokens))
            tokens = ids
    prompt_len = len(_render(messages[: turns[0]], tokenizer, chat_template, tools, generation_prompt=True))
    return SFTExample(tokens[:prompt_len], tokens[prompt_len:], loss_mask=mask[prompt_len:])


def sft_batch(examples: Sequence[SFTExample], pad_token_id: int) -> rf.RolloutBatch:
    """Examples as a RolloutBatch: prompts left-padded, responses (the trained tokens) right-padded."""
    p_len = max(len(e.prompt_ids) for e in examples)
    r_len = max(len(e.response_ids) for e in examples)
    prompt_ids = torch.tensor([[pad_token_id] * (p_len - len(e.prompt_ids)) + list(e.prompt_ids) for e in examples])
    prompt_mask = torch.tensor([[False] * (p_len - len(e.prompt_ids)) + [True] * len(e.prompt_ids) for e in examples])
    response_ids = torch.tensor(
        [list(e.response_ids) + [pad_token_id] * (r_len - len(e.response_ids)) for e in examples]
    )
    response_mask = torch.tensor(
        [[True] * len(e.response_ids) + [False] * (r_len - len(e.response_ids)) for e in examples]
    )
    loss_mask = None
    if any(e.loss_mask is not None for e in examples):
        loss_mask = torch.tensor(
            [
                list(e.loss_mask or [True] * len(e.response_ids)) + [False] * (r_len - len(e.response_ids))
                for e in examples
            ]
        )
    return rf.RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        loss_mask=loss_mask,
        group_ids=torch.arange(len(examples)),
    )


def nll_loss(out: Any, mb: rf.RolloutBatch, norms: rf.Normalizers) -> tuple[Any, dict]:
    """Token-mean negative log-likelihood of the trained tokens (``rf.loss_tokens``), over the global count."""
    return rf.aggregate(-out.logprobs, rf.loss_tokens(mb), mode="token-mean", norms=norms), {}


def run_sft(
    state: Any,
    next_examples: Callable[[int], Sequence[SFTExample]],
    cfg: SFTConfig,
    *,
    pad_token_id: int,
    data_parallel: tuple[int, int],
    update_fn: Callable[..., Any] = update,
    metrics_log: Any = None,
    show_progress: bool = False,
) -> Any:
    """``cfg.steps`` NLL updates of ``state``; returns the trained state.

    ``next_examples(step)`` gives the step's ``cfg.batch_size`` examples, the same on every rank (this
    rank trains on ``examples[dp_rank::dp_size]`` with ``data_parallel = (dp_rank, dp_size)``, the
    engine's data-parallel coordinates: megatron's tensor / pipeline peers share rows). ``update_fn``:
    the engine's ``update``. ``metrics_log`` gets ``sft_loss`` at negative steps (the last one at -1),
    so that a following RL curve starts at step 1.
    """
    dp_rank, dp_size = data_parallel
    for step in tqdm(range(cfg.steps), desc="sft", disable=not show_progress):
        examples = next_examples(step)
        if len(examples) != cfg.batch_size:
            raise ValueError(
                f"next_examples({step}) gave {len(examples)} examples, the stage's batch_size is {cfg.batch_size}"
            )
        # the RL loop's "update" deadline applies; steps count up to -1 as in the metrics log
        with watchdog.phase("update", step=step - cfg.steps, op=f"SFT update {step + 1} of {cfg.steps}"):
            state, metrics = update_fn(state, sft_batch(examples[dp_rank::dp_size], pad_token_id), nll_loss)
        if metrics_log is not None and (step % 20 == 0 or step == cfg.steps - 1):
            metrics_log.log(step - cfg.steps, {"sft_loss": metrics["loss"]})
    return state
