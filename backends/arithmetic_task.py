"""A synthetic verifiable task: integer addition prompts ``"a+b="`` answered by the sum.

The held-out prompts are a fixed random subset of all operand pairs that the training stream never
yields, so "held-out success" measures generalisation, not memorisation. Rewards come from
:func:`rlfunc.rewards.arithmetic_reward` (parsing, never evaluation).
"""

from __future__ import annotations

import random

import attrs

__all__ = ["ArithmeticTask", "Problem"]


@attrs.frozen
class Problem:
    prompt: str
    answer: int


@attrs.frozen
class ArithmeticTask:
    """All pairs ``0 <= a, b <= max_operand``; ``num_heldout`` of them are reserved for evaluation."""

    max_operand: int = 99
    num_heldout: int = 200
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        total = (self.max_operand + 1) ** 2
        if not 0 < self.num_heldout < total:
            raise ValueError(f"num_heldout must be in (0, {total}) for max_operand={self.max_operand}, got {self.num_heldout}")

    @staticmethod
    def make(a: int, b: int) -> Problem:
        return Problem(prompt=f"{a}+{b}=", answer=a + b)

    def _heldout_pairs(self) -> set[tuple[int, int]]:
        rng = random.Random(f"heldout-{self.seed}")
        side = self.max_operand + 1
        return {divmod(i, side) for i in rng.sample(range(side * side), self.num_heldout)}

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
            b = self._rng.randint(0, self.task.max_operand)
            if (a, b) not in self._excluded:
                self.drawn += 1
                return self.task.make(a, b)

    def take(self, n: int) -> list[Problem]:
        return [self._next() for _ in range(n)]
