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

import math
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

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
    epochs: int = attrs.field(default=1, validator=attrs.validators.ge(1))  #: passes over sft.files (when sft.steps is 0)
    steps: int = attrs.field(default=0, validator=attrs.validators.ge(0))  #: SFT updates; 0: sft.epochs passes over the data
    batch_size: int = attrs.field(default=64, validator=attrs.validators.ge(1))  #: global examples per SFT update
    max_length: int = attrs.field(default=1024, validator=attrs.validators.ge(2))  #: longest prompt + response in tokens (longer rows are an error)
    optim: OptimConfig = OptimConfig(lr=1e-5, weight_decay=0.0, lr_warmup_steps_ratio=0.1, lr_scheduler_type="cosine", min_lr_ratio=0.1)  #: the SFT stage's optimizer


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
            raise ValueError(f"an SFT example's loss_mask must have one entry per response token "
                             f"({len(self.response_ids)}) and at least one True, got {len(self.loss_mask)}")


def sft_optim(cfg: SFTConfig, steps: int | None = None) -> OptimConfig:
    """The optimizer config to build the trained state with: ``cfg.optim`` scheduled over the stage's
    ``steps`` (default ``cfg.steps``)."""
    return with_total_steps(cfg.optim, cfg.steps if steps is None else steps)


def load_sft_examples(cfg: SFTConfig, tokenizer: Any, *, chat_template: str = "auto",
                      tools: Sequence[Mapping[str, Any]] | None = None) -> list[SFTExample]:
    """Every row of ``cfg.files`` as an :class:`SFTExample` (see the module doc; chats rendered with the ``tools``
    schemas, as the RL prompts are); a bad row is a :class:`backends.data.DataError` naming the file and row."""
    examples = []
    for path in cfg.files:
        for where, row in read_rows(path):
            try:
                if cfg.messages_key:
                    example = _tokenise_conversation(column_value(row, cfg.messages_key, where), tokenizer, chat_template,
                                                     tools)
                else:
                    example = _tokenise(column_value(row, cfg.prompt_key, where),
                                        column_value(row, cfg.response_key, where), tokenizer, chat_template, tools)
            except (DataError, ValueError) as e:
                raise DataError(f"{where}: {e}") from None
            if len(example.prompt_ids) + len(example.response_ids) > cfg.max_length:
                raise DataError(f"{where}: prompt + response is {len(example.prompt_ids) + len(example.response_ids)} "
                                f"tokens, more than sft.max_length={cfg.max_length}")
            examples.append(example)
    if not examples:
        raise DataError(f"no rows in sft.files {list(cfg.files)}")
    return examples


def _tokenise(prompt: Any, response: Any, tokenizer: Any, chat_template: str,
              tools: Sequence[Mapping[str, Any]] | None = None) -> SFTExample:
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
        raise DataError("the chat template renders the prompt differently when the assistant's answer follows it; "
                        "the answer's tokens cannot be separated from the prompt's")
    return SFTExample(prompt_ids, full[len(prompt_ids):])


def _render(messages: list[dict], tokenizer: Any, chat_template: str, tools: Sequence[Mapping[str, Any]] | None = None,
            *, generation_prompt: bool = False) -> list[int]:
    template = None if chat_template == "auto" else Path(chat_template).read_text()
    ids = tokenizer.apply_chat_template(messages, tokenize=True, chat_template=template,
                                        add_generation_prompt=generation_prompt, tools=list(tools) if tools else None)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _tokenise_conversation(messages: Any, tokenizer: Any, chat_template: str,
                           tools: Sequence[Mapping[str, Any]] | None = None) -> SFTExample:
    """A conversation's tokens, cut where each assistant turn starts and ends (see the module doc): every cut is
    a prefix of the next rendering, so the tokens are exactly what the template renders for the whole chat."""
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise DataError("a conversation must be a list of chat messages with a role each")
    messages = [dict(m) for m in messages]
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns or turns[0] == 0:
        raise DataError("a conversation needs a message before its first assistant turn, and an assistant turn")
    tokens: list[int] = []
    mask: list[bool] = []
    for k in turns:
        # up to the assistant's generation prompt (read), then through the assistant's turn (trained)
        for ids, trained in ((_render(messages[:k], tokenizer, chat_template, tools, generation_prompt=True), False),
                             (_render(messages[: k + 1], tokenizer, chat_template, tools), True)):
            if ids[: len(tokens)] != tokens:
                raise DataError(f"the chat template renders message {k}'s conversation so that an earlier part "
                                "changes; its turns' tokens cannot be cut apart")
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
    response_ids = torch.tensor([list(e.response_ids) + [pad_token_id] * (r_len - len(e.response_ids)) for e in examples])
    response_mask = torch.tensor([[True] * len(e.response_ids) + [False] * (r_len - len(e.response_ids)) for e in examples])
    loss_mask = None
    if any(e.loss_mask is not None for e in examples):
        loss_mask = torch.tensor([list(e.loss_mask or [True] * len(e.response_ids)) + [False] * (r_len - len(e.response_ids))
                                  for e in examples])
    return rf.RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
        response_mask=response_mask, loss_mask=loss_mask, group_ids=torch.arange(len(examples)),
    )


def nll_loss(out: Any, mb: rf.RolloutBatch, norms: rf.Normalizers) -> tuple[Any, dict]:
    """Token-mean negative log-likelihood of the trained tokens (``rf.loss_tokens``), over the global count."""
    return rf.aggregate(-out.logprobs, rf.loss_tokens(mb), "token-mean", norms), {}


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
            raise ValueError(f"next_examples({step}) gave {len(examples)} examples, the stage's batch_size is {cfg.batch_size}")
        # the RL loop's "update" deadline applies; steps count up to -1 as in the metrics log
        with watchdog.phase("update", step=step - cfg.steps, op=f"SFT update {step + 1} of {cfg.steps}"):
            state, metrics = update_fn(state, sft_batch(examples[dp_rank::dp_size], pad_token_id), nll_loss)
        if metrics_log is not None and (step % 20 == 0 or step == cfg.steps - 1):
            metrics_log.log(step - cfg.steps, {"sft_loss": metrics["loss"]})
    return state
