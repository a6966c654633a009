"""A synthetic verifiable task: integer addition prompts ``"a+b="`` answered by the sum.

The held-out prompts are a fixed random subset of all operand pairs that the training stream never
yields, so "held-out success" measures generalisation, not memorisation. Rewards come from
:func:`rlfunc.rewards.arithmetic_reward` (parsing, never evaluation).

The task also feeds the recipes' supervised warm start (the generic stage of
:mod:`backends.training.sft`): :func:`warm_start` draws its problems from the training stream, makes a
controlled fraction of the answers wrong (:func:`with_wrong_answers`) and tokenises them as
(prompt, answer + EOS) examples.
"""

from __future__ import annotations

import random
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

from backends.rollout.api import SamplingConfig, decode_responses, generate  # either engine (native or vLLM)
from backends.training.fsdp import update
from backends.training.sft import SFTConfig, SFTExample, run_sft
from rlfunc.batch import RolloutBatch
from rlfunc.rewards import arithmetic_reward

__all__ = [
    "ArithmeticTask", "Problem", "TrainStream", "WarmStartConfig", "evaluate", "score_responses", "sft_examples",
    "warm_start", "with_wrong_answers",
]


@attrs.frozen
class Problem:
    prompt: str
    answer: int


@attrs.frozen
class ArithmeticTask:
    """All pairs ``0 <= a <= max_operand``, ``0 <= b <= max_second_operand``; ``num_heldout`` of them
    are reserved for evaluation and never drawn for training.

    The default (two-digit plus one-digit sums) is learnable by a tiny model in a couple of hundred
    supervised steps, with the carry as the part it gets wrong longest.
    """

    max_operand: int = 99
    max_second_operand: int = 9
    num_heldout: int = 100
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        if self.max_operand < 0 or self.max_second_operand < 0:
            raise ValueError("operand ranges must be non-negative")
        if not 0 < self.num_heldout < self.num_pairs:
            raise ValueError(f"num_heldout must be in (0, {self.num_pairs}) for these operand ranges, got {self.num_heldout}")

    @property
    def num_pairs(self) -> int:
        return (self.max_operand + 1) * (self.max_second_operand + 1)

    @staticmethod
    def make(a: int, b: int) -> Problem:
        return Problem(prompt=f"{a}+{b}=", answer=a + b)

    def _heldout_pairs(self) -> set[tuple[int, int]]:
        rng = random.Random(f"heldout-{self.seed}")
        side = self.max_second_operand + 1
        return {divmod(i, side) for i in rng.sample(range(self.num_pairs), self.num_heldout)}

    def heldout(self) -> list[Problem]:
        return [self.make(a, b) for a, b in sorted(self._heldout_pairs())]

    def train_stream(self, seed: int, drawn: int = 0) -> "TrainStream":
        """An endless, seeded stream of training problems (never a held-out pair), ``drawn`` already taken."""
        return TrainStream(self, seed, drawn)


class TrainStream:
    """Seeded sampler of training problems; its position is ``(seed, drawn)`` for exact resume."""

    def __init__(self, task: ArithmeticTask, seed: int, drawn: int = 0) -> None:
        self.task = task
        self.seed = seed
        self._excluded = task._heldout_pairs()
        self._rng = random.Random(f"train-{seed}")
        self.drawn = 0
        for _ in range(drawn):
            self._next()

    def _next(self) -> Problem:
        while True:
            a = self._rng.randint(0, self.task.max_operand)
            b = self._rng.randint(0, self.task.max_second_operand)
            if (a, b) not in self._excluded:
                self.drawn += 1
                return self.task.make(a, b)

    def take(self, n: int) -> list[Problem]:
        return [self._next() for _ in range(n)]


# --------------------------------------------------------------------------------------------------
# The task as the recipes use it: rewards of sampled responses, held-out evaluation, the warm start.


def score_responses(batch: RolloutBatch, problems: list[Problem], tokenizer: Any) -> Tensor:
    """Rule-based reward per row: 1.0 for the exact sum, else 0.0 (row i answers ``problems[group_ids[i]]``)."""
    texts = decode_responses(tokenizer, batch)
    answers = [problems[g].answer for g in batch.group_ids.tolist()]
    return torch.tensor([arithmetic_reward(t, a) for t, a in zip(texts, answers)], dtype=torch.float32)


@torch.no_grad()
def evaluate(rollout: Any, tokenizer: Any, problems: list[Problem], sampling: SamplingConfig, env: Any, *, seed: int = 10_007) -> float:
    """Success rate on ``problems`` (each rank scores its share; counts are all-reduced over ``env.group``).

    With ``sampling.temperature == 0`` this is greedy accuracy; otherwise the mean over ``sampling.n``
    samples per problem.
    """
    mine = problems[env.rank :: env.world_size]
    batch = generate(rollout, [tokenizer.encode(p.prompt) for p in mine], sampling, seed=seed + env.rank)
    correct = score_responses(batch, mine, tokenizer).sum()
    if env.world_size > 1:
        dist.all_reduce(correct, group=getattr(env, "group", None))
    return float(correct) / (len(problems) * sampling.n)


@attrs.frozen
class WarmStartConfig(SFTConfig):
    """The generic SFT stage's settings (``steps``, ``batch_size``, ``optim``) plus the task's label noise."""

    #: fraction of the supervised examples whose answer is replaced by a wrong one (the right sum plus
    #: or minus 1..9): a controlled imperfection. The policy learns the answer format without being
    #: sharpened on its own mistakes, so RL's samples still disagree within a group (see README)
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


def sft_examples(problems: list[Problem], tokenizer: Any) -> list[SFTExample]:
    """(prompt, answer + EOS) token-id examples: the model learns to write the answer, then stop."""
    return [
        SFTExample(tokenizer.encode(p.prompt), tokenizer.encode(str(p.answer)) + [tokenizer.eos_token_id])
        for p in problems
    ]


def warm_start(
    state: Any, stream: TrainStream, tokenizer: Any, cfg: WarmStartConfig, *, data_parallel: tuple[int, int],
    update_fn: Any = update, metrics_log: Any = None, show_progress: bool = False,
) -> Any:
    """The SFT stage on ``cfg.steps`` batches of problems drawn from ``stream`` (the same on every rank),
    with ``cfg.wrong_answer_fraction`` of the answers made wrong. ``state`` must have been built with
    ``backends.training.sft.sft_optim(cfg)``; ``update_fn`` / ``data_parallel``: the engine's."""
    noise = random.Random(f"wrong-answers-{stream.seed}-{stream.drawn}")  # the same draws on every rank

    def next_examples(step: int) -> list[SFTExample]:
        problems = stream.take(cfg.batch_size)
        if cfg.wrong_answer_fraction > 0:
            problems = with_wrong_answers(problems, cfg.wrong_answer_fraction, noise)
        return sft_examples(problems, tokenizer)

    return run_sft(state, next_examples, cfg, pad_token_id=tokenizer.pad_token_id, data_parallel=data_parallel,
                   update_fn=update_fn, metrics_log=metrics_log, show_progress=show_progress)
