"""A tool-use task, written as data files: products of two three-digit numbers, with a ``multiply`` tool.

A tiny model cannot multiply ``347*291``, but it can learn to call the tool with the two numbers and copy the
tool's answer::

    <|user|>347*291=<eos>
    <|assistant|><tool_call>{"name": "multiply", "arguments": {"a": 347, "b": 291}}</tool_call><eos>
    <|tool|>100977<eos>
    <|assistant|>100977<eos>

The task is a dataset generator and a tool function; the multi-turn recipe reads its files like any user's
data (``rollout.multi_turn.tools=[experiments.tasks.calculator:multiply]``) and the built-in ``arithmetic``
reward scores the last model turn::

    python -m experiments.tasks.calculator --out runs/data/calculator
    torchrun --standalone --nproc_per_node 2 experiments/grpo.py preset=demo/calculator

writes, and then trains on,

- ``train.jsonl`` / ``val.jsonl``: chat prompts ``a*b=`` with the product as ``answer``; the held-out pairs
  never appear in training;
- ``sft.jsonl``: noisy tool-use conversations (``messages``) for the SFT stage: some answer without the tool
  (a guess), some call it with a mistyped operand (and copy the wrong product it returns), some mistype the
  copied answer, so the SFT policy knows the format but often fails, and RL has something to fix.

The fixed parts of the call are single tokens of the tiny tokenizer (:data:`TOKENIZER_WORDS`,
``model.tiny_words`` in the preset), so a call costs a dozen tokens.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any, Iterator

import attrs

from experiments.tasks import write_jsonl_files

__all__ = ["CalculatorTask", "TOKENIZER_WORDS", "multiply", "tool_call", "write_dataset"]

#: the fixed text of a ``multiply`` call, one token each in the tiny char tokenizer
TOKENIZER_WORDS = ('{"name": "multiply", "arguments": {"a": ', ', "b": ', "}}")


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def tool_call(a: int, b: int) -> str:
    """The assistant's call of ``multiply`` in the Hermes / Qwen tool-call format."""
    return "<tool_call>" + json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}}) + "</tool_call>"


@attrs.frozen
class CalculatorTask:
    """Pairs of ``low``..``high`` integers; ``num_heldout`` pairs are evaluation-only, ``num_train`` others train."""

    low: int = 100
    high: int = 999
    num_train: int = 20_000
    num_heldout: int = 200
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        pairs = (self.high - self.low + 1) ** 2
        if not 0 < self.low <= self.high or self.num_train + self.num_heldout > pairs // 2:
            raise ValueError(
                f"{self.num_train} + {self.num_heldout} pairs need a wider range than {self.low}..{self.high}"
            )

    def split(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """``(train, heldout)`` pairs, disjoint, drawn from the seed."""
        rng = random.Random(f"calculator-{self.seed}")
        seen: set[tuple[int, int]] = set()
        while len(seen) < self.num_train + self.num_heldout:
            seen.add((rng.randint(self.low, self.high), rng.randint(self.low, self.high)))
        pairs = sorted(seen)
        rng.shuffle(pairs)
        return pairs[self.num_heldout :], pairs[: self.num_heldout]


def prompt_row(a: int, b: int) -> dict[str, Any]:
    return {"prompt": [{"role": "user", "content": f"{a}*{b}="}], "answer": str(a * b), "data_source": "calculator"}


def _mistype(number: int, rng: random.Random) -> int:
    """``number`` with one digit changed (never the leading digit to 0)."""
    digits = list(str(number))
    i = rng.randrange(len(digits))
    choices = [d for d in "0123456789" if d != digits[i] and not (i == 0 and d == "0")]
    digits[i] = rng.choice(choices)
    return int("".join(digits))


def sft_conversations(
    pairs: list[tuple[int, int]], count: int, *, direct: float, wrong_operand: float, wrong_copy: float, seed: int
) -> Iterator[dict[str, Any]]:
    """``count`` noisy traces (see the module doc): a direct guess with probability ``direct``; otherwise a call
    whose every operand is mistyped with probability ``wrong_operand``, and an answer that mistypes the tool's
    result with probability ``wrong_copy``."""
    rng = random.Random(f"calculator-sft-{seed}")
    for _ in range(count):
        a, b = rng.choice(pairs)
        user = {"role": "user", "content": f"{a}*{b}="}
        if rng.random() < direct:
            guess = _mistype(a * b, rng)
            yield {"messages": [user, {"role": "assistant", "content": str(guess)}]}
            continue
        x = _mistype(a, rng) if rng.random() < wrong_operand else a
        y = _mistype(b, rng) if rng.random() < wrong_operand else b
        answer = _mistype(x * y, rng) if rng.random() < wrong_copy else x * y
        yield {
            "messages": [
                user,
                {"role": "assistant", "content": tool_call(x, y)},
                {"role": "tool", "content": str(multiply(x, y))},
                {"role": "assistant", "content": str(answer)},
            ]
        }


def write_dataset(
    out_dir: str | Path,
    task: CalculatorTask = CalculatorTask(),
    *,
    sft_examples: int = 8_000,
    direct: float = 0.2,
    wrong_operand: float = 0.25,
    wrong_copy: float = 0.25,
    seed: int = 0,
) -> Path:
    """Write ``train.jsonl``, ``val.jsonl`` and ``sft.jsonl`` into ``out_dir`` (see the module doc)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, heldout = task.split()
    files = {
        "train.jsonl": (prompt_row(a, b) for a, b in train),
        "val.jsonl": (prompt_row(a, b) for a, b in heldout),
        "sft.jsonl": sft_conversations(
            train, sft_examples, direct=direct, wrong_operand=wrong_operand, wrong_copy=wrong_copy, seed=seed
        ),
    }
    return write_jsonl_files(out, files)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/data/calculator", help="directory for train.jsonl, val.jsonl, sft.jsonl")
    parser.add_argument("--num-train", type=int, default=20_000)
    parser.add_argument("--num-heldout", type=int, default=200)
    parser.add_argument("--sft-examples", type=int, default=8_000)
    parser.add_argument("--direct", type=float, default=0.2, help="share of SFT traces that guess without the tool")
    parser.add_argument(
        "--wrong-operand", type=float, default=0.25, help="chance that a traced call mistypes an operand"
    )
    parser.add_argument("--wrong-copy", type=float, default=0.25, help="chance that a trace mistypes the tool's answer")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    task = CalculatorTask(num_train=args.num_train, num_heldout=args.num_heldout, seed=args.seed)
    out = write_dataset(
        args.out,
        task,
        sft_examples=args.sft_examples,
        direct=args.direct,
        wrong_operand=args.wrong_operand,
        wrong_copy=args.wrong_copy,
        seed=args.seed,
    )
    print(
        f"wrote {out}/train.jsonl ({task.num_train} prompts), val.jsonl ({task.num_heldout}), "
        f"sft.jsonl ({args.sft_examples} conversations)"
    )


if __name__ == "__main__":
    main()
