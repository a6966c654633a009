"""What the end-to-end recipe tests share: the recipes, a small arithmetic dataset on disk, tiny-model overrides."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from experiments.tasks.arithmetic import ArithmeticTask, write_dataset

ROOT = Path(__file__).resolve().parents[1]
GRPO = ROOT / "experiments" / "grpo.py"
PPO = ROOT / "experiments" / "ppo.py"
CUSTOM = ROOT / "experiments" / "custom_algorithm.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")

#: a one-layer model small enough for a few steps in seconds
TINY_MODEL = [
    "model.tiny.hidden_size=64", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "model.tiny.intermediate_size=96",
    "model.tiny.num_layers=1",
]


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def arithmetic_data(out_dir: Path, *, max_operand: int = 99, max_second_operand: int = 9, num_heldout: int = 8,
                    sft_examples: int = 64, wrong_answer_fraction: float = 0.5) -> Path:
    """The arithmetic task's train / val / sft JSONL files in ``out_dir``."""
    task = ArithmeticTask(max_operand=max_operand, max_second_operand=max_second_operand, num_heldout=num_heldout)
    return write_dataset(out_dir, task, sft_examples=sft_examples, wrong_answer_fraction=wrong_answer_fraction)


def data_args(data_dir: Path, *, sft_steps: int = 4) -> list[str]:
    """Overrides that point a recipe at ``data_dir``'s files, with a short SFT stage on them."""
    args = [f"data.train_files={data_dir / 'train.jsonl'}", f"data.val_files={data_dir / 'val.jsonl'}",
            "data.max_prompt_length=16", "reward.fn=arithmetic", "rollout.max_new_tokens=6", "eval.n=1"]
    if sft_steps:
        args += [f"sft.files={data_dir / 'sft.jsonl'}", f"sft.steps={sft_steps}", "sft.batch_size=8", "sft.optim.lr=3e-3"]
    return args


def run(recipe: Path, *args: str, nproc: int = 1, timeout: float = 600) -> subprocess.CompletedProcess:
    """The recipe as a plain script (``nproc=1``) or under ``torchrun --nproc_per_node nproc``."""
    launcher = [sys.executable] if nproc == 1 else [str(TORCHRUN), "--standalone", "--nproc_per_node", str(nproc)]
    return subprocess.run([*launcher, str(recipe), *args], env=env(), capture_output=True, text=True, timeout=timeout)


def the_run_dir(root: Path, name: str) -> Path:
    (run_dir,) = list(root.glob(f"{name}-*"))
    return run_dir


def metrics(run_dir: Path, *, rl_only: bool = True) -> list[dict]:
    """``metrics.jsonl``'s rows (by default the RL steps' only: not the SFT stage's, not the evaluations' rows)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if not rl_only:
        return rows
    return [r for r in rows if r["step"] > 0 and "step_time_s" in r]
