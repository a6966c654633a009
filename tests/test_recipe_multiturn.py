"""The GRPO recipe with multi-turn tool use learns the calculator task under torchrun (2 gloo ranks)."""

from __future__ import annotations

import json

import pytest

from experiments.tasks import calculator
from tests.recipes import GRPO, metrics, run, the_run_dir


def calculator_run(tmp_path, *args: str, timeout: float = 600) -> tuple[dict, list[dict]]:
    """The calculator preset with a short SFT stage on noisy tool-use traces, then 20 GRPO steps on 2 ranks (sampled
    evaluations before and after), plus ``args``: the run's summary (its held-out success printed) and RL metrics."""
    data = calculator.write_dataset(
        tmp_path / "data", calculator.CalculatorTask(num_train=4000, num_heldout=64), sft_examples=4000
    )
    result = run(
        GRPO,
        "preset=demo/calculator",
        f"data.train_files={data / 'train.jsonl'}",
        f"data.val_files={data / 'val.jsonl'}",
        f"sft.files={data / 'sft.jsonl'}",
        "steps=20",
        "eval.every=0",
        "eval.greedy=false",
        f"run_root={tmp_path / 'runs'}",
        "export.hf=false",
        *args,
        nproc=2,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = the_run_dir(tmp_path / "runs", "grpo_calculator")
    summary = json.loads((run_dir / "summary.json").read_text())
    print(
        f"held-out success {summary['eval_before']:.3f} -> {summary['eval_after']:.3f} in {summary['wall_seconds']} s"
    )
    return summary, metrics(run_dir)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.multiturn
def test_grpo_learns_to_call_the_calculator_tool(tmp_path):
    """A short SFT stage on noisy tool-use traces, then 20 GRPO steps: held-out success rises by 30 points or
    more, and the run logs tool-call validity and turns per trajectory. (The full preset, demo/calculator,
    is the 10-minute run of benchmarks/RESULTS.md.)"""
    summary, rows = calculator_run(tmp_path)
    assert summary["eval_after"] >= summary["eval_before"] + 0.3, summary
    assert len(rows) == 20
    assert all(0.0 <= r["multi_turn/tool_call_validity"] <= 1.0 and 1.0 <= r["multi_turn/turns"] <= 3.0 for r in rows)
    assert rows[-1]["multi_turn/turns"] > 1.5  # it calls the tool, then answers
