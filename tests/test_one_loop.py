"""Every recipe gets every capability of the one loop (backends/loop): PPO samples multi-turn trajectories with tools
and runs dynamic sampling with GRPO's keys, and the custom-algorithm template trains asynchronously on rollout ranks
of its own. Each run is two or three steps of a one-layer model (seconds)."""

from __future__ import annotations

import json

import pytest

from experiments.tasks import calculator
from tests.recipes import CUSTOM, PPO, TINY_MODEL, arithmetic_data, data_args, metrics, run, the_run_dir


@pytest.fixture(scope="module")
def calculator_data(tmp_path_factory):
    task = calculator.CalculatorTask(num_train=64, num_heldout=8)
    return calculator.write_dataset(tmp_path_factory.mktemp("calculator"), task, sft_examples=64)


@pytest.mark.slow
@pytest.mark.multiturn
def test_ppo_samples_tool_trajectories_with_grpos_keys(tmp_path, calculator_data):
    """PPO with the multi-turn, tool and dynamic-sampling keys the GRPO recipe reads: the critic trains on the
    trajectories, the tool results stay out of the loss, the turns and the sampling rounds are logged."""
    out = run(
        PPO,
        f"run_root={tmp_path}",
        *TINY_MODEL,
        f"data.train_files={calculator_data / 'train.jsonl'}",
        f"data.val_files={calculator_data / 'val.jsonl'}",
        "data.max_prompt_length=16",
        "reward.fn=arithmetic",
        "steps=2",
        "prompts_per_step=2",
        "rollout.n=4",
        "rollout.max_new_tokens=8",
        "rollout.multi_turn.max_turns=2",
        "rollout.multi_turn.max_total_tokens=40",
        "rollout.multi_turn.tools=[experiments.tasks.calculator:multiply]",
        "algo.dynamic_sampling=true",
        "algo.max_sampling_rounds=2",
        "eval.max_prompts=4",
        "eval.n=1",
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    run_dir = the_run_dir(tmp_path, "ppo")
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert 1.0 <= row["multi_turn/turns"] <= 2.0
        assert 1.0 <= row["sampling/rounds"] <= 2.0
        assert "critic/loss" in row and "values_mean" in row and "kl_reward" in row
    assert (run_dir / "final_model" / "config.json").exists() and (run_dir / "final_critic" / "config.json").exists()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.offpolicy
def test_the_custom_template_trains_one_step_off(tmp_path):
    """The template's algorithm on a rollout rank of its own, one step behind: the batches it trains on are
    sampled by the weights one update older, and the run checkpoints and exports like GRPO's."""
    data_dir = arithmetic_data(tmp_path / "data")
    out = run(
        CUSTOM,
        f"run_root={tmp_path}",
        *data_args(data_dir),
        *TINY_MODEL,
        "steps=3",
        "prompts_per_step=2",
        "rollout.n=4",
        "eval.max_prompts=4",
        "offpolicy.rollout_ranks=1",
        "offpolicy.mode=one_step_off",
        "checkpoint.every=3",
        nproc=2,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    run_dir = the_run_dir(tmp_path, "custom_algorithm")
    rows = metrics(run_dir)
    assert [r["staleness/max"] for r in rows] == [0.0, 1.0, 1.0]
    assert all("kl_loss" in r or "kl" in r for r in rows)  # the template's k3 KL to the reference
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["algorithm"] == "reinforce_pp_baseline" and summary["steps"] == 3
    assert (run_dir / "checkpoints" / "step_3").is_dir() and (run_dir / "final_model" / "config.json").exists()
