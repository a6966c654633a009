"""Metric sinks: console, metrics.jsonl, TensorBoard and Weights & Biases (offline), and generation dumps."""

from __future__ import annotations

import json

import pytest

from backends.metrics_log import MetricsLog, read_jsonl, write_generations


def test_jsonl_tensorboard_and_console(tmp_path, capsys):
    log = MetricsLog(
        tmp_path,
        loggers=("console", "jsonl", "tensorboard"),
        console_keys=("reward_mean",),
        console_every=2,
        always_keys=("val/mean@4",),
    )
    for step in range(1, 5):
        log.log(step, {"reward_mean": step / 10, "loss": float("nan")})
    log.log(4, {"val/mean@4": 0.5})
    log.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 4] and rows[0]["loss"] == "nan"  # non-finite kept as text
    assert list((tmp_path / "tensorboard").iterdir())
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["step     2 reward_mean=0.2", "step     4 reward_mean=0.4", "step     4 val/mean@4=0.5"]


def test_a_disabled_log_writes_nothing(tmp_path):
    log = MetricsLog(tmp_path / "run", enabled=False, loggers=("jsonl", "tensorboard", "wandb"))
    log.log(1, {"x": 1.0})
    log.close()
    assert not (tmp_path / "run").exists()


def test_unknown_sink_is_named(tmp_path):
    with pytest.raises(ValueError, match="logger: unknown sink\\(s\\) \\['mlflow'\\]"):
        MetricsLog(tmp_path, loggers=("jsonl", "mlflow"))


def test_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = MetricsLog(tmp_path, loggers=("wandb",), run_name="test-run", config={"algo": {"kl_coef": 0.1}})
    for step in range(3):
        log.log(step, {"reward_mean": 0.1 * step, "text": "not a number"})
    log.close()
    (run,) = list((tmp_path / "wandb").glob("offline-run-*"))
    assert list(run.glob("*.wandb")) and not (tmp_path / "metrics.jsonl").exists()


def test_generation_dumps_are_written_whole(tmp_path):
    path = write_generations(
        tmp_path / "generations" / "step_3.jsonl", [{"prompt": "a", "response": "b", "score": 1.0}]
    )
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"prompt": "a", "response": "b", "score": 1.0}
    ]
    assert not list(path.parent.glob("*.tmp"))


def test_the_plot_leaves_out_constant_curves_and_shows_sft_and_multi_turn(tmp_path):
    """reward_curve.png: the SFT loss (negative steps), multi-turn turns and tool-call validity are drawn; a metric
    constant for the run (clip_frac of an on-policy run) is not."""
    from backends.metrics_log import plot_curves, plot_panels

    rows = [{"step": -2, "sft_loss": 2.5}, {"step": -1, "sft_loss": 1.9}]
    rows += [
        {
            "step": s,
            "reward_mean": 0.1 * s,
            "clip_frac": 0.0,
            "kl": 0.01,
            "multi_turn/turns": 1.0 + 0.2 * s,
            "multi_turn/tool_call_validity": 0.8 + 0.05 * s,
            "update_skipped": False,
        }
        for s in range(1, 4)
    ]
    keys = [
        "sft_loss",
        "reward_mean",
        "val/mean@4",
        "kl",
        "entropy",
        "clip_frac",
        "multi_turn/turns",
        "multi_turn/tool_call_validity",
    ]
    assert plot_panels(rows, keys) == ["sft_loss", "reward_mean", "multi_turn/turns", "multi_turn/tool_call_validity"]
    plot_curves(rows, keys, tmp_path / "curve.png", title="GRPO")
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
