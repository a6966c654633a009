"""SFT data loading per row: conversations (multi-turn tool-use traces) against single-turn (prompt, response) rows.

Run: ``.venv/bin/python benchmarks/bench_sft_loading.py [--rows 8000] [--repeats 3]``.

Writes the calculator task's SFT conversations (``experiments/tasks/calculator.py``: a user turn, an assistant tool
call, the tool's answer, the assistant's answer; some traces answer directly) and the arithmetic task's single-turn
SFT rows, ``--rows`` of each, then times ``backends.training.sft.load_sft_examples`` on each file with the tiny char
tokenizer and the multiply tool's schema (as ``preset=demo/calculator`` loads them). Prints seconds per 1,000 rows
(the median of ``--repeats``, each kind alternating with the other so that load from other work hits both alike)
and the ratio conversation / single-turn.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.models import build_char_tokenizer  # noqa: E402
from backends.rollout.environments import MultiTurnConfig, tool_schemas  # noqa: E402
from backends.training.sft import SFTConfig, load_sft_examples  # noqa: E402
from experiments.tasks import arithmetic, calculator  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench_sft_loading_"))
    conv = (
        calculator.write_dataset(
            root / "calc", calculator.CalculatorTask(num_train=4000, num_heldout=16), sft_examples=args.rows
        )
        / "sft.jsonl"
    )
    single = arithmetic.write_dataset(root / "arith", sft_examples=args.rows) / "sft.jsonl"
    tok = build_char_tokenizer(words=calculator.TOKENIZER_WORDS)
    tools = tool_schemas(MultiTurnConfig(max_turns=3, tools=("experiments.tasks.calculator:multiply",)))
    kinds = {
        "single-turn": (SFTConfig(files=(str(single),)), None),
        "conversation": (SFTConfig(files=(str(conv),), messages_key="messages"), tools),
    }
    times: dict[str, list[float]] = {name: [] for name in kinds}
    for _ in range(args.repeats):
        for name, (cfg, schemas) in kinds.items():
            t0 = time.perf_counter()
            examples = load_sft_examples(cfg, tok, tools=schemas)
            times[name].append(time.perf_counter() - t0)
            assert len(examples) == args.rows
    per_k = {name: 1000 * statistics.median(t) / args.rows for name, t in times.items()}
    for name, seconds in per_k.items():
        print(f"{name:>12}: {seconds:.3f} s per 1,000 rows ({statistics.median(times[name]):.1f} s for {args.rows})")
    print(f"conversation / single-turn: {per_k['conversation'] / per_k['single-turn']:.2f}x")


if __name__ == "__main__":
    main()
