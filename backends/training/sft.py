"""Supervised warm start: fine-tune the actor on (prompt, answer) pairs before RL, through the same engine.

The recipes start RL from an imperfect policy, as a real post-training run starts from an SFT model.
The warm start is an ordinary ``update`` with a pure negative log-likelihood loss, so it uses the same
sharding, normalisers and optimizer code as the RL phase.
"""

from __future__ import annotations

import random
from typing import Any

import attrs
from tqdm import tqdm

import rlfunc as rf
from experiments.tasks.arithmetic import Problem, TrainStream, sft_batch
from backends.training.fsdp import TrainState, update
from backends.training.optim import OptimConfig, build_optimizer, lr_schedule, with_total_steps

__all__ = ["WarmStartConfig", "nll_loss", "supervised_warm_start", "warm_start_optim", "with_wrong_answers"]


@attrs.frozen
class WarmStartConfig:
    """Supervised fine-tuning on (prompt, answer) pairs so that RL starts from an imperfect policy."""

    steps: int = 300
    batch_size: int = 64  # global rows per step
    optim: OptimConfig = OptimConfig(lr=3e-3, weight_decay=0.0, lr_warmup_steps_ratio=0.1, lr_scheduler_type="cosine", min_lr_ratio=0.1)
    #: fraction of the supervised examples whose answer is replaced by a wrong one (the right sum plus
    #: or minus 1..9): a controlled imperfection. The policy learns the answer format without being
    #: sharpened on its own mistakes, so RL's samples still disagree within a group (measured in the
    #: GRPO demo: 4 of 4 runs gained 32-75 held-out points from it; see README)
    wrong_answer_fraction: float = attrs.field(default=0.0)

    @wrong_answer_fraction.validator
    def _check_fraction(self, attribute: attrs.Attribute, value: float) -> None:
        if not 0.0 <= value < 1.0:
            raise ValueError(f"warm_start.wrong_answer_fraction must be in [0, 1), got {value}")


def with_wrong_answers(problems: list[Problem], fraction: float, rng: random.Random) -> list[Problem]:
    """``problems`` with each answer, with probability ``fraction``, moved by a nonzero offset in
    [-9, 9] (reflected to stay >= 0). The prompts are unchanged."""
    out = []
    for p in problems:
        if rng.random() < fraction:
            offset = rng.choice([d for d in range(-9, 10) if d != 0])
            wrong = p.answer + offset if p.answer + offset >= 0 else p.answer - offset
            p = attrs.evolve(p, answer=wrong)
        out.append(p)
    return out


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
    size; default every rank its own share) come from another engine (``backends.training.engines``).
    """
    dp_rank, dp_size = data_parallel if data_parallel is not None else (env.rank, env.world_size)
    noise = random.Random(f"wrong-answers-{stream.seed}-{stream.drawn}")  # same draws on every rank
    for step in tqdm(range(cfg.steps), desc="warm start", disable=not env.is_main):
        problems = stream.take(cfg.batch_size)
        if cfg.wrong_answer_fraction > 0:
            problems = with_wrong_answers(problems, cfg.wrong_answer_fraction, noise)
        problems = problems[dp_rank::dp_size]
        actor, m = update_fn(actor, sft_batch(problems, tokenizer), nll_loss)
        if metrics_log is not None and (step % 20 == 0 or step == cfg.steps - 1):
            metrics_log.log(step - cfg.steps, {"sft_loss": m["loss"]})
    return actor


def warm_start_optim(cfg: WarmStartConfig) -> OptimConfig:
    return with_total_steps(cfg.optim, cfg.steps)
