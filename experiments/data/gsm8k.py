"""GSM8K, as a user downloads it (parquet or JSONL with ``question`` / ``answer``), in the recipes' format.

As verl's ``examples/data_preprocess/gsm8k.py``: each question gets the instruction to end with ``#### <answer>``
and becomes a one-message chat prompt; the ground truth is the number after ``####`` in the reference
solution (commas removed), which the built-in ``gsm8k`` reward compares with the response's::

    python -m experiments.data.gsm8k --input gsm8k/main/train-00000-of-00001.parquet --output data/gsm8k/train.parquet
    python -m experiments.data.gsm8k --input gsm8k/main/test-00000-of-00001.parquet --output data/gsm8k/test.parquet
    torchrun --nproc_per_node 8 experiments/grpo.py preset=gsm8k/grpo_qwen2_5_0_5b \
        model.path=/models/Qwen2.5-0.5B-Instruct

Rows: ``prompt`` (``[{"role": "user", "content": ...}]``), ``answer``, ``data_source`` (``openai/gsm8k``) and
``extra_info`` (split, index, the original question and solution). The output format follows its extension
(``.parquet`` or ``.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from backends.data import DataError, column_value, read_rows

__all__ = ["INSTRUCTION", "convert", "convert_row", "final_answer"]

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_FINAL = re.compile(r"#### (-?[0-9.,]+)")


def final_answer(solution: str) -> str:
    """The number after ``####`` in a GSM8K reference solution, commas removed."""
    match = _FINAL.search(solution)
    if match is None:
        raise ValueError("the solution has no '#### <number>' final answer")
    return match.group(1).replace(",", "")


def convert_row(row: dict[str, Any], *, index: int, split: str, where: str) -> dict[str, Any]:
    question, solution = column_value(row, "question", where), column_value(row, "answer", where)
    if not isinstance(question, str) or not isinstance(solution, str):
        raise DataError(f"{where}: question and answer must be strings")
    try:
        answer = final_answer(solution)
    except ValueError as e:
        raise DataError(f"{where}: {e}") from None
    return {
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "answer": answer,
        "data_source": "openai/gsm8k",
        "extra_info": {"split": split, "index": index, "question": question, "solution": solution},
    }


def convert(input_path: str | Path, output_path: str | Path, *, split: str = "") -> int:
    """Convert one GSM8K file; returns the number of rows written."""
    output_path = Path(output_path)
    split = split or ("test" if "test" in Path(input_path).name else "train")
    rows = [convert_row(row, index=i, split=split, where=where) for i, (where, row) in enumerate(read_rows(input_path))]
    output_path.parent.mkdir(parents=True, exist_ok=True)
    if output_path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), output_path)
    elif output_path.suffix in (".jsonl", ".json"):
        output_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        raise ValueError(f"--output must end in .parquet or .jsonl, got {output_path}")
    return len(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="a GSM8K file (parquet or JSONL with question / answer)")
    parser.add_argument("--output", required=True, help="where to write (.parquet or .jsonl)")
    parser.add_argument("--split", default="", help="train or test (default: from the input's name)")
    args = parser.parse_args(argv)
    count = convert(args.input, args.output, split=args.split)
    print(f"wrote {count} rows to {args.output}")


if __name__ == "__main__":
    main()
