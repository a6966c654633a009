"""Bring your own task: a task that is not arithmetic (reversing words), from JSONL and from parquet, with a
reward function in the user's own file, through the general GRPO recipe: no rlfunc code written or copied.

The user's side is only what a researcher writes: data files and ``my_reward.py``. The learning runs are
slow tests (one process, and two torchrun ranks); the rest checks dynamic sampling on a real engine.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.recipes import GRPO, metrics, run, the_run_dir

pytestmark = pytest.mark.data

REWARD_FILE = '''
def reversed_word(response, ground_truth, *, word=None):
    """1 for the exact reversal of the row's word (the `word` column arrives as a keyword argument)."""
    assert word is None or word[::-1] == ground_truth
    return 1.0 if response.strip() == ground_truth else 0.0
'''

LETTERS = "abcdef"


def words() -> list[str]:
    return [a + b + c for a in LETTERS for b in LETTERS for c in LETTERS]


def write_task(root, *, parquet: bool, sft_examples: int = 4000, wrong: float = 0.5, heldout: int = 24):
    """train / val prompt files (JSONL or parquet), SFT examples with a share of wrong reversals, the reward."""
    rng = random.Random(0)
    pool = words()
    rng.shuffle(pool)
    val, train = pool[:heldout], pool[heldout:]
    row = lambda w: {
        "prompt": [{"role": "user", "content": f"rev {w}"}],
        "answer": w[::-1],
        "word": w,
        "data_source": "rev",
    }
    root.mkdir(parents=True, exist_ok=True)
    suffix = "parquet" if parquet else "jsonl"
    for name, part in (("train", train), ("val", val)):
        rows = [row(w) for w in part]
        if parquet:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows), root / f"{name}.{suffix}")
        else:
            (root / f"{name}.{suffix}").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sft = []
    for _ in range(sft_examples):
        w = rng.choice(train)
        answer = w[::-1] if rng.random() >= wrong else "".join(rng.sample(w, len(w)))
        sft.append({"prompt": [{"role": "user", "content": f"rev {w}"}], "response": answer})
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft))
    (root / "my_reward.py").write_text(REWARD_FILE)
    return [
        f"data.train_files={root / f'train.{suffix}'}",
        f"data.val_files={root / f'val.{suffix}'}",
        f"reward.fn={root / 'my_reward.py'}:reversed_word",
        f"sft.files={root / 'sft.jsonl'}",
    ]


#: the command line of the learning runs: a user's whole configuration, the own-task preset of the tiny model and
#: this task's lengths
LEARN = ["preset=own_task/tiny", "data.max_prompt_length=16", "rollout.max_new_tokens=5"]


def test_the_own_task_preset_fits_the_tiny_model_and_the_readme_names_it():
    """The preset's prompt and response fit the tiny model's context, it trains with an SFT stage and a learning rate
    a tiny model needs, and the README's "Your own task" section points a user without a model to it."""
    from backends.config import apply_overrides
    from experiments import grpo

    cfg = apply_overrides(grpo.Config(), ["preset=own_task/tiny"], presets_dir=grpo.PRESETS)
    assert cfg.data.max_prompt_length + cfg.rollout.max_new_tokens <= cfg.model.tiny.max_position_embeddings
    assert not cfg.model.path and cfg.actor.optim.lr >= 1e-4 and cfg.sft.optim.lr >= 1e-3 and cfg.rollout.n >= 2
    assert [cfg.model.tiny.hidden_size, cfg.prompts_per_step, cfg.steps] == [128, 32, 120]
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## Your own task") : readme.index("## The idea")]
    assert "preset=own_task/tiny" in section and "sft.files=" in section


def _learned(run_root) -> dict:
    run_dir = the_run_dir(run_root, "own_task_tiny")
    summary = json.loads((run_dir / "summary.json").read_text())
    rl = metrics(run_dir)
    assert len(rl) == 120 and all(r["reward/errors"] == 0.0 for r in rl)
    return summary


@pytest.mark.slow
def test_reverse_words_from_jsonl_learns_in_one_process(tmp_path):
    args = write_task(tmp_path / "task", parquet=False)
    out = run(GRPO, f"run_root={tmp_path / 'runs'}", *args, *LEARN, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    summary = _learned(tmp_path / "runs")
    assert summary["eval_after"] >= summary["eval_before"] + 0.15, summary


@pytest.mark.slow
@pytest.mark.distributed
def test_reverse_words_from_parquet_learns_on_two_ranks(tmp_path):
    args = write_task(tmp_path / "task", parquet=True)
    out = run(GRPO, f"run_root={tmp_path / 'runs'}", *args, *LEARN, nproc=2, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    summary = _learned(tmp_path / "runs")
    assert summary["eval_after"] >= summary["eval_before"] + 0.15, summary
