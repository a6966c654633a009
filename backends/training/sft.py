"""Supervised fine-tuning (SFT) as a training stage: (prompt, response) token-id examples through the engine.

A stage of ``cfg.steps`` updates, each on ``cfg.batch_size`` examples (global; every data-parallel rank
trains on its share). The loss is the negative log-likelihood of the response tokens, aggregated with
the engine's global normalisers, so the stage runs through the same ``update`` (sharding, micro-batches,
optimizer) as the RL phase that usually follows it; a recipe uses it as a warm start, so that RL begins
from an imperfect policy as a real post-training run begins from an SFT model.

What the examples are is the caller's business: :func:`run_sft` asks ``next_examples(step)`` for each
step's global batch, so a task can draw, tokenise or corrupt its data however it likes.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs
import torch
from tqdm import tqdm

import rlfunc as rf
from backends.training.fsdp import update
from backends.training.optim import OptimConfig, with_total_steps

__all__ = ["SFTConfig", "SFTExample", "nll_loss", "run_sft", "sft_batch", "sft_optim"]


@attrs.frozen
class SFTConfig:
    """The stage's length, batch and optimizer (the state must be built with :func:`sft_optim` of it)."""

    steps: int = attrs.field(default=300, validator=attrs.validators.ge(0))
    batch_size: int = attrs.field(default=64, validator=attrs.validators.ge(1))  # global examples per step
    optim: OptimConfig = OptimConfig(lr=3e-3, weight_decay=0.0, lr_warmup_steps_ratio=0.1, lr_scheduler_type="cosine", min_lr_ratio=0.1)


@attrs.frozen
class SFTExample:
    """One supervised example: the model reads ``prompt_ids`` and is trained to continue with
    ``response_ids`` (include the EOS token there when the model should learn to stop)."""

    prompt_ids: tuple[int, ...] = attrs.field(converter=tuple)
    response_ids: tuple[int, ...] = attrs.field(converter=tuple)

    def __attrs_post_init__(self) -> None:
        if not self.prompt_ids or not self.response_ids:
            raise ValueError("an SFT example needs at least one prompt token and one response token")


def sft_optim(cfg: SFTConfig) -> OptimConfig:
    """The optimizer config to build the trained state with: ``cfg.optim`` scheduled over the stage."""
    return with_total_steps(cfg.optim, cfg.steps)


def sft_batch(examples: Sequence[SFTExample], pad_token_id: int) -> rf.RolloutBatch:
    """Examples as a RolloutBatch: prompts left-padded, responses (the trained tokens) right-padded."""
    p_len = max(len(e.prompt_ids) for e in examples)
    r_len = max(len(e.response_ids) for e in examples)
    prompt_ids = torch.tensor([[pad_token_id] * (p_len - len(e.prompt_ids)) + list(e.prompt_ids) for e in examples])
    prompt_mask = torch.tensor([[False] * (p_len - len(e.prompt_ids)) + [True] * len(e.prompt_ids) for e in examples])
    response_ids = torch.tensor([list(e.response_ids) + [pad_token_id] * (r_len - len(e.response_ids)) for e in examples])
    response_mask = torch.tensor([[True] * len(e.response_ids) + [False] * (r_len - len(e.response_ids)) for e in examples])
    return rf.RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
        response_mask=response_mask, group_ids=torch.arange(len(examples)),
    )


def nll_loss(out: Any, mb: rf.RolloutBatch, norms: rf.Normalizers) -> tuple[Any, dict]:
    """Token-mean negative log-likelihood of the response tokens, over the global token count."""
    return rf.aggregate(-out.logprobs, mb.response_mask, "token-mean", norms), {}


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
        state, metrics = update_fn(state, sft_batch(examples[dp_rank::dp_size], pad_token_id), nll_loss)
        if metrics_log is not None and (step % 20 == 0 or step == cfg.steps - 1):
            metrics_log.log(step - cfg.steps, {"sft_loss": metrics["loss"]})
    return state
