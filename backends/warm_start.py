"""Supervised warm start: fine-tune the actor on (prompt, answer) pairs before RL, through the same engine.

The recipes start RL from an imperfect policy, as a real post-training run starts from an SFT model.
The warm start is an ordinary ``update`` with a pure negative log-likelihood loss, so it uses the same
sharding, normalisers and optimizer code as the RL phase.
"""

from __future__ import annotations

from typing import Any

import attrs
from tqdm import tqdm

import rlfunc as rf
from backends.arithmetic_task import TrainStream, sft_batch
from backends.fsdp_engine import TrainState, update
from backends.optim import OptimConfig, build_optimizer, lr_schedule, with_total_steps

__all__ = ["WarmStartConfig", "fresh_optimizer", "nll_loss", "supervised_warm_start", "warm_start_optim"]


@attrs.frozen
class WarmStartConfig:
    """Supervised fine-tuning on (prompt, answer) pairs so that RL starts from an imperfect policy."""

    steps: int = 300
    batch_size: int = 64  # global rows per step
    optim: OptimConfig = OptimConfig(lr=3e-3, weight_decay=0.0, lr_warmup_steps_ratio=0.1, lr_scheduler_type="cosine", min_lr_ratio=0.1)


def nll_loss(out: Any, mb: rf.RolloutBatch, norms: rf.Normalizers) -> tuple[Any, dict]:
    """Token-mean negative log-likelihood of the answer tokens (the response slot of ``mb``)."""
    return rf.aggregate(-out.logprobs, mb.response_mask, "token-mean", norms), {}


def supervised_warm_start(
    actor: TrainState, stream: TrainStream, tokenizer: Any, cfg: WarmStartConfig, env: Any, metrics_log: Any = None,
    *, update_fn: Any = update, data_parallel: tuple[int, int] | None = None,
) -> TrainState:
    """``cfg.steps`` supervised updates on problems drawn from ``stream`` (each rank takes its share).

    ``actor`` must have been built with ``cfg.optim`` (see :func:`warm_start_optim`); logs ``sft_loss``
    at negative steps so that the RL curve starts at step 1. ``update_fn`` / ``data_parallel`` (rank,
    size; default every rank its own share) come from another engine (``backends.engines``).
    """
    dp_rank, dp_size = data_parallel if data_parallel is not None else (env.rank, env.world_size)
    for step in tqdm(range(cfg.steps), desc="warm start", disable=not env.is_main):
        problems = stream.take(cfg.batch_size)[dp_rank::dp_size]
        actor, m = update_fn(actor, sft_batch(problems, tokenizer), nll_loss)
        if metrics_log is not None and (step % 20 == 0 or step == cfg.steps - 1):
            metrics_log.log(step - cfg.steps, {"sft_loss": m["loss"]})
    return actor


def fresh_optimizer(state: TrainState, optim: OptimConfig) -> TrainState:
    """Same weights, a new AdamW and LR schedule (the RL phase does not inherit the warm start's moments)."""
    return state.replace(
        optimizer=build_optimizer(state.module.parameters(), optim), optim_cfg=optim, lr_schedule=lr_schedule(optim), step=0
    )


def warm_start_optim(cfg: WarmStartConfig) -> OptimConfig:
    return with_total_steps(cfg.optim, cfg.steps)
