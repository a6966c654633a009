"""A synthetic verifiable task, written as data files: integer addition prompts ``a+b=`` answered by the sum.

The task is only a dataset generator; the recipes read its files like any user's data, and the built-in
``arithmetic`` reward scores it (:func:`rlfunc.rewards.arithmetic_reward`: parsing, never evaluation)::

    python -m experiments.tasks.arithmetic --out runs/data/arithmetic
    torchrun --standalone --nproc_per_node 2 experiments/grpo.py preset=demo/arithmetic

writes, and then trains on,

- ``train.jsonl``: every operand pair except the held-out ones, as chat prompts with the sum as ``answer``;
- ``val.jsonl``: the held-out pairs (a fixed random subset that training never sees, so held-out success
  measures generalisation, not memorisation);
- ``sft.jsonl``: (prompt, response) examples for the SFT stage, drawn from the training pairs with a
  controlled share of wrong answers (off by 1..9): the policy learns the answer format without being
  sharpened on one answer, so RL's samples still disagree within a group.

With ``--think-mean M`` the SFT responses put a "thought" before the final answer: the answer restated ``k`` times
(``42,42,42,####42``, which the reward accepts), ``k`` drawn from a heavy-tailed (Lomax) distribution with mean
``M``, at most ``--think-max``. The first number is computed right after the prompt, as in the plain task, and the
rest is copying, so the task stays as learnable while the policy learns long-tailed response lengths: the workload
where a batch's generation waits for its longest response (``benchmarks/bench_async.py --long-tail``).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any, Iterator

import attrs

from experiments.tasks import write_jsonl_files

__all__ = ["ArithmeticTask", "Problem", "write_dataset", "chat_row"]


@attrs.frozen
class Problem:
    prompt: str
    answer: int


@attrs.frozen
class ArithmeticTask:
    """All pairs ``0 <= a <= max_operand``, ``0 <= b <= max_second_operand``; ``num_heldout`` of them
    are reserved for evaluation and never written to the training files.

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
            raise ValueError(
                f"num_heldout must be in (0, {self.num_pairs}) for these operand ranges, got {self.num_heldout}"
            )

    @property
    def num_pairs(self) -> int:
        return (self.max_operand + 1) * (self.max_second_operand + 1)

    @staticmethod
    def make(a: int, b: int) -> Problem:
        return Problem(prompt=f"{a}+{b}=", answer=a + b)

    def heldout_pairs(self) -> set[tuple[int, int]]:
        rng = random.Random(f"heldout-{self.seed}")
        side = self.max_second_operand + 1
        return {divmod(i, side) for i in rng.sample(range(self.num_pairs), self.num_heldout)}

    def heldout(self) -> list[Problem]:
        return [self.make(a, b) for a, b in sorted(self.heldout_pairs())]

    def train(self) -> list[Problem]:
        excluded = self.heldout_pairs()
        return [
            self.make(a, b)
            for a in range(self.max_operand + 1)
            for b in range(self.max_second_operand + 1)
            if (a, b) not in excluded
        ]


def chat_row(problem: Problem) -> dict[str, Any]:
    """One prompt row: the sum as the answer, a user message as the prompt."""
    return {
        "prompt": [{"role": "user", "content": problem.prompt}],
        "answer": str(problem.answer),
        "data_source": "arithmetic",
    }


def thought_length(rng: random.Random, mean: float, cap: int) -> int:
    """A heavy-tailed length: Lomax (Pareto II) with shape 2 and scale ``mean`` (so its mean is ``mean``; the tail
    falls off as a power, not exponentially), rounded down and capped at ``cap``."""
    return min(cap, int(mean * ((1.0 - rng.random()) ** -0.5 - 1.0)))


def sft_rows(
    problems: list[Problem],
    count: int,
    wrong_answer_fraction: float,
    seed: int,
    *,
    think_mean: float = 0.0,
    think_max: int = 12,
) -> Iterator[dict[str, Any]]:
    """``count`` (prompt, response) rows drawn from ``problems``; each answer is, with probability
    ``wrong_answer_fraction``, moved by a nonzero offset in [-9, 9] (reflected to stay >= 0). With ``think_mean > 0``
    a response is ``<answer>,`` ``k`` times, then ``####<answer>``, ``k`` from :func:`thought_length`."""
    if not 0.0 <= wrong_answer_fraction < 1.0:
        raise ValueError(f"wrong_answer_fraction must be in [0, 1), got {wrong_answer_fraction}")
    if think_mean < 0 or think_max < 0:
        raise ValueError(f"think_mean and think_max must be >= 0, got {think_mean} and {think_max}")
    rng, thoughts = (
        random.Random(f"sft-{seed}"),
        random.Random(f"think-{seed}"),
    )  # the answers do not depend on thoughts
    for _ in range(count):
        p = rng.choice(problems)
        answer = p.answer
        if rng.random() < wrong_answer_fraction:
            offset = rng.choice([d for d in range(-9, 10) if d != 0])
            answer = answer + offset if answer + offset >= 0 else answer - offset
        response = str(answer)
        if think_mean > 0:
            response = f"{response}," * thought_length(thoughts, think_mean, think_max) + "####" + response
        yield {"prompt": [{"role": "user", "content": p.prompt}], "response": response}


def write_dataset(
    out_dir: str | Path,
    task: ArithmeticTask = ArithmeticTask(),
    *,
    sft_examples: int = 19_200,
    wrong_answer_fraction: float = 0.5,
    seed: int = 0,
    think_mean: float = 0.0,
    think_max: int = 12,
) -> Path:
    """Write ``train.jsonl``, ``val.jsonl`` and ``sft.jsonl`` into ``out_dir`` (see the module doc)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train = task.train()
    files = {
        "train.jsonl": map(chat_row, train),
        "val.jsonl": map(chat_row, task.heldout()),
        "sft.jsonl": sft_rows(
            train, sft_examples, wrong_answer_fraction, seed, think_mean=think_mean, think_max=think_max
        ),
    }
    return write_jsonl_files(out, files)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/data/arithmetic", help="directory for train.jsonl, val.jsonl, sft.jsonl")
    parser.add_argument("--max-operand", type=int, default=99)
    parser.add_argument("--max-second-operand", type=int, default=9)
    parser.add_argument("--num-heldout", type=int, default=100)
    parser.add_argument("--sft-examples", type=int, default=19_200)
    parser.add_argument("--wrong-answer-fraction", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--think-mean",
        type=float,
        default=0.0,
        help="SFT answers restated this many times on average first (0: no thought)",
    )
    parser.add_argument("--think-max", type=int, default=12, help="the most restatements of a thought")
    args = parser.parse_args(argv)
    task = ArithmeticTask(
        max_operand=args.max_operand, max_second_operand=args.max_second_operand, num_heldout=args.num_heldout
    )
    out = write_dataset(
        args.out,
        task,
        sft_examples=args.sft_examples,
        wrong_answer_fraction=args.wrong_answer_fraction,
        seed=args.seed,
        think_mean=args.think_mean,
        think_max=args.think_max,
    )
    print(
        f"wrote {out}/train.jsonl ({task.num_pairs - task.num_heldout} prompts), val.jsonl ({task.num_heldout}), "
        f"sft.jsonl ({args.sft_examples})"
    )


if __name__ == "__main__":
    main()
