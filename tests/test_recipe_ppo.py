"""End-to-end smoke runs of experiments/ppo.py with both launchers (real processes), on the arithmetic task's files."""

import json
import math

import pytest

from tests.recipes import PPO, TINY_MODEL, arithmetic_data, data_args, metrics, run, the_run_dir

RECIPE = PPO


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return arithmetic_data(tmp_path_factory.mktemp("arithmetic"))


def tiny(data_dir) -> list[str]:
    return [
        *data_args(data_dir),
        *TINY_MODEL,
        "steps=3",
        "prompts_per_step=4",
        "rollout.n=4",
        "eval.max_prompts=8",
        "algo.ppo_mini_batch_size=2",
        "algo.ppo_epochs=2",
        "algo.critic_warmup=1",
    ]


def _check_run(tmp_path, world_size: int, *, orbax: bool) -> None:
    run_dir = the_run_dir(tmp_path, "ppo")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["world_size"] == world_size
    for key in ("eval_before", "eval_after"):
        assert 0.0 <= summary[key] <= 1.0
    assert 0.0 <= summary["after"]["val/greedy@1"] <= 1.0
    assert summary["wall_seconds"] > 0
    rl = [r for r in metrics(run_dir, rl_only=False) if r["step"] > 0 and "critic/loss" in r]
    assert [r["step"] for r in rl] == [1, 2, 3]
    for key in (
        "reward_mean",
        "success_rate",
        "kl_reward",
        "kl_coef",
        "critic/loss",
        "critic/grad_norm",
        "critic/vf_clipfrac",
        "values_mean",
        "returns_mean",
        "time/rollout_s",
        "time/reference_s",
        "time/values_s",
        "time/advantages_s",
        "time/critic_update_s",
        "time/actor_update_s",
        "time/weight_sync_s",
        "step_time_s",
        "entropy",
        "clip_frac",
        "grad_norm",
        "loss",
    ):
        assert key in rl[-1], key
    assert (run_dir / "reward_curve.png").stat().st_size > 0
    assert list((run_dir / "tensorboard").iterdir())
    assert (run_dir / "sft_model" / "config.json").exists()
    assert (run_dir / "final_model" / "config.json").exists() and (run_dir / "final_critic" / "config.json").exists()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_2", "step_3"]  # every=1, keep_last=2
    assert (run_dir / "actor_orbax").exists() == orbax


@pytest.mark.slow
def test_plain_python_launcher(tmp_path, data_dir):
    out = run(
        PPO,
        f"run_root={tmp_path}",
        *tiny(data_dir),
        "checkpoint.every=1",
        "checkpoint.keep_last=2",
        "export.orbax=true",
        "algo.kl_ctrl=adaptive",
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert "held-out success" in out.stdout
    _check_run(tmp_path, 1, orbax=True)
    # the exported critic is a value model transformers loads
    from transformers import AutoModelForTokenClassification

    critic = AutoModelForTokenClassification.from_pretrained(the_run_dir(tmp_path, "ppo") / "final_critic")
    assert critic.config.num_labels == 1


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_two_ranks_kl_loss(tmp_path, data_dir):
    out = run(
        PPO,
        f"run_root={tmp_path}",
        *tiny(data_dir),
        "checkpoint.every=1",
        "checkpoint.keep_last=2",
        "algo.kl_loss_coef=0.001",
        "algo.kl_loss_kind=k3+",
        "dump_generations_every=3",
        nproc=2,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    _check_run(tmp_path, 2, orbax=False)
    run_dir = the_run_dir(tmp_path, "ppo")
    assert "kl_loss" in [r for r in metrics(run_dir, rl_only=False) if "critic/loss" in r][-1]
    assert len((run_dir / "generations" / "step_3.jsonl").read_text().splitlines()) == 16


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.megatron
def test_torchrun_two_ranks_megatron_reference(tmp_path, data_dir):
    """The reference on megatron-core with TP=2 while actor and critic are FSDP: each rank's rows are
    gathered by the TP group, scored together and handed back."""
    out = run(
        PPO,
        f"run_root={tmp_path}",
        *tiny(data_dir),
        "model.tiny.num_kv_heads=2",
        "preset=ref/megatron_ref",
        "reference.tp=2",
        "algo.kl_loss_coef=0.001",
        nproc=2,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rows = metrics(the_run_dir(tmp_path, "ppo"), rl_only=False)
    kl = [r["kl_loss"] for r in rows if "kl_loss" in r]
    assert (
        kl and all(math.isfinite(v) for v in kl) and max(abs(v) for v in kl[1:]) > 0
    )  # the policy moved off the reference


def _fails_before_any_work(run_root, overrides: list[str], message: str) -> None:
    """The recipe exits non-zero with ``message`` on stderr and writes nothing under ``run_root``."""
    out = run(PPO, f"run_root={run_root}", "reward.fn=exact", *overrides, timeout=120)
    assert out.returncode != 0
    assert message in out.stderr
    assert not list(run_root.iterdir())


def test_bad_mini_batch_size_fails_before_any_work(tmp_path):
    _fails_before_any_work(
        tmp_path,
        ["prompts_per_step=4", "algo.ppo_mini_batch_size=3"],
        "algo.ppo_mini_batch_size=3 must divide prompts_per_step=4",
    )


def test_help_lists_keys():
    out = run(PPO, "--help", timeout=120)
    assert out.returncode == 0
    for key in (
        "algo.lam",
        "algo.kl_ctrl",
        "critic.optim.lr",
        "checkpoint.every",
        "checkpoint.dir",
        "resume",
        "export.orbax",
    ):
        assert key in out.stdout, key


def test_outcome_token_rewards():
    import torch

    from experiments.ppo import outcome_token_rewards

    mask = torch.tensor([[True, True, False], [True, True, True], [True, False, False]])
    out = outcome_token_rewards(torch.tensor([1.0, 0.5, -2.0]), mask)
    assert torch.equal(out, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.5], [-2.0, 0.0, 0.0]]))


def test_ref_in_actor_under_split_placement_fails_before_any_work(tmp_path):
    """Only the critic pool would reach the reference; the recipe refuses the pair on every rank first."""
    _fails_before_any_work(
        tmp_path,
        ["placement.mode=split", "reference.ref_in_actor=true"],
        "reference.ref_in_actor=true needs the actor and the reference on the same ranks",
    )
