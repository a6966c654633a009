"""A fresh start never costs an existing run its records: nothing of a run dir is written or removed before every
start-up check has passed, and a finished run is not overwritten without ``resume`` or another ``run_dir``.

The recipe's own start-up runs in this process (``experiments.grpo.main``, one rank): the checks fail before any
model is built, so each case takes seconds.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from backends.config import ConfigError
from backends.data import DataError
from experiments import grpo

pytestmark = pytest.mark.badinput


@pytest.fixture(autouse=True)
def _keep_signal_handlers():
    """The recipe installs its SIGTERM / SIGINT handlers in this process; pytest keeps its own."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def existing_run(tmp_path: Path, *, finished: bool) -> dict[Path, bytes]:
    """A run dir as a run leaves it (config, metrics, base model, and with ``finished`` its summary); every file's
    bytes."""
    run = tmp_path / "run"
    (run / "base_model").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"name": "earlier", "seed": 3}))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward_mean": s / 10}) + "\n" for s in range(5)))
    (run / "base_model" / "config.json").write_text("{}")
    if finished:
        (run / "summary.json").write_text(json.dumps({"eval_after": 0.9}))
    return {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}


def data_file(tmp_path: Path) -> str:
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    return str(path)


def unchanged(files: dict[Path, bytes], run: Path) -> bool:
    now = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    return now == files


def test_a_misspelt_data_path_touches_nothing_of_the_run(tmp_path):
    files = existing_run(tmp_path, finished=False)
    with pytest.raises(DataError, match=r"nope\.jsonl: no such file"):
        grpo.main([f"run_dir={tmp_path / 'run'}", f"data.train_files=[{tmp_path / 'nope.jsonl'}]", "reward.fn=[exact]"])
    assert unchanged(files, tmp_path / "run")


def test_a_fresh_start_in_a_new_dir_writes_nothing_before_its_checks(tmp_path):
    with pytest.raises(DataError):
        grpo.main([f"run_dir={tmp_path / 'new'}", f"data.train_files=[{tmp_path / 'nope.jsonl'}]", "reward.fn=[exact]"])
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize(
    ("resume", "says"), [("never", "continue it with resume=auto"), ("auto", "it has no checkpoint to continue from")]
)
def test_a_finished_run_is_not_overwritten_by_a_fresh_start(tmp_path, resume, says):
    files = existing_run(tmp_path, finished=True)
    with pytest.raises(
        ConfigError,
        match=rf"run_dir='.*/run' holds a finished run \(its summary\.json\): a fresh start "
        rf"would overwrite its records; {says}.*, or give another run_dir",
    ):
        grpo.main(
            [
                f"run_dir={tmp_path / 'run'}",
                f"data.train_files=[{data_file(tmp_path)}]",
                "reward.fn=[exact]",
                f"resume={resume}",
            ]
        )
    assert unchanged(files, tmp_path / "run")
