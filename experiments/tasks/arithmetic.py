"""A synthetic verifiable task: integer addition prompts ``"a+b="`` answered by the sum.

The held-out prompts are a fixed random subset of all operand pairs that the training stream never
yields, so "held-out success" measures generalisation, not memorisation. Rewards come from
:func:`rlfunc.rewards.arithmetic_reward` (parsing, never evaluation).
"""

from __future__ import annotations

import random
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

from backends.rollout.api import SamplingConfig, decode_responses, generate  # either engine (native or vLLM)
from rlfunc.batch import RolloutBatch
from rlfunc.rewards import arithmetic_reward

__all__ = ["ArithmeticTask", "Problem", "TrainStream", "evaluate", "score_responses", "sft_batch"]


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
# The task as the recipes use it: supervised batches, rewards of sampled responses, held-out evaluation.


def sft_batch(problems: list[Problem], tokenizer: Any) -> RolloutBatch:
    """(prompt, answer + EOS) pairs as a RolloutBatch with the answer in the response slot."""
    prompts = [tokenizer.encode(p.prompt) for p in problems]
    answers = [tokenizer.encode(str(p.answer)) + [tokenizer.eos_token_id] for p in problems]
    p_len, r_len = max(map(len, prompts)), max(map(len, answers))
    pad = tokenizer.pad_token_id
    prompt_ids = torch.tensor([[pad] * (p_len - len(x)) + x for x in prompts])
    prompt_mask = torch.tensor([[False] * (p_len - len(x)) + [True] * len(x) for x in prompts])
    response_ids = torch.tensor([x + [pad] * (r_len - len(x)) for x in answers])
    response_mask = torch.tensor([[True] * len(x) + [False] * (r_len - len(x)) for x in answers])
    return RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
        response_mask=response_mask, group_ids=torch.arange(len(problems)),
    )


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
