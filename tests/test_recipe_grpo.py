"""End-to-end smoke runs of experiments/grpo.py with both launchers (real processes), on the arithmetic task's files."""

import json

import pytest

from tests.recipes import GRPO, TINY_MODEL, arithmetic_data, data_args, metrics, run, the_run_dir


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
        "algo.kl_loss_coef=0.01",
    ]


def _check_run(root, world_size: int) -> None:
    run_dir = the_run_dir(root, "grpo")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["world_size"] == world_size
    for key in ("eval_before", "eval_after"):
        assert 0.0 <= summary[key] <= 1.0
    for key in ("val/mean@1", "val/score@1", "val/greedy@1"):
        assert 0.0 <= summary["before"][key] <= 1.0 and 0.0 <= summary["after"][key] <= 1.0
    assert summary["wall_seconds"] > 0
    rl = metrics(run_dir)
    assert [r["step"] for r in rl] == [1, 2, 3]
    for key in (
        "reward_mean",
        "success_rate",
        "kl_loss",
        "entropy",
        "clip_frac",
        "grad_norm",
        "response_length",
        "tokens_per_s",
        "step_time_s",
        "rollout_time_s",
        "update_time_s",
        "sync_time_s",
        "skipped_rows",
        "reward/arithmetic",
        "reward/errors",
        "truncated_rate",
    ):
        assert key in rl[-1], key
    assert all(r["skipped_rows"] == 0.0 for r in rl)  # a KL term: zero-advantage rows are not skippable
    rows = metrics(run_dir, rl_only=False)
    assert rows[0]["step"] < 0 and "sft_loss" in rows[0]  # the SFT stage logs before step 0
    assert any(r["step"] == 0 and "val/mean@1" in r for r in rows)  # the evaluation before training
    assert (run_dir / "reward_curve.png").stat().st_size > 0
    assert list((run_dir / "tensorboard").iterdir())
    assert (run_dir / "sft_model" / "config.json").exists()
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run_dir / "final_model", local_files_only=True)  # the trained actor


@pytest.mark.slow
def test_plain_python_launcher(tmp_path, data_dir):
    out = run(GRPO, f"run_root={tmp_path}", *tiny(data_dir))
    assert out.returncode == 0, out.stderr[-4000:]
    assert "held-out success" in out.stdout
    _check_run(tmp_path, 1)


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_two_ranks(tmp_path, data_dir):
    out = run(GRPO, f"run_root={tmp_path}", *tiny(data_dir), "dump_generations_every=2", nproc=2)
    assert out.returncode == 0, out.stderr[-4000:]
    _check_run(tmp_path, 2)
    dump = [
        json.loads(line)
        for line in (the_run_dir(tmp_path, "grpo") / "generations" / "step_2.jsonl").read_text().splitlines()
    ]
    assert len(dump) == 16  # 4 prompts x 4 samples, both ranks' rows
    assert set(dump[0]) == {"prompt", "response", "ground_truth", "data_source", "score", "advantage"}


@pytest.mark.slow
def test_bf16_run_skips_zero_advantage_rows(tmp_path, data_dir):
    """bf16 trainer and rollout, no KL term: rows of groups with one reward are skipped (and counted)."""
    args = [a for a in tiny(data_dir) if not a.startswith("algo.kl_loss_coef")]
    out = run(
        GRPO, f"run_root={tmp_path}", *args, "steps=4", "actor.fsdp.param_dtype=bfloat16", "rollout.dtype=bfloat16"
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rl = metrics(the_run_dir(tmp_path, "grpo"))
    # a tiny SFT stage: most groups get all-zero rewards, so rows are skipped
    assert any(r["skipped_rows"] > 0 for r in rl)
    assert all(0.0 <= r["skipped_rows"] <= 1.0 and r["update_skipped"] == 0.0 for r in rl)
    # bf16 on both sides: the trainer recomputes the log-probs (no on-policy shortcut) and the gap is logged
    assert all(0.0 <= r["logprob_gap/mean"] <= r["logprob_gap/max"] < 1.0 for r in rl)


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_two_ranks_resume(tmp_path, data_dir):
    """Packed rows (FSDP2, 2 ranks), skipped zero-advantage rows (no KL term), resumed from a checkpoint:
    the resumed run logs the steps after its checkpoint again, and only those."""
    args = [a for a in tiny(data_dir) if not a.startswith("algo.kl_loss_coef")] + [
        "model.tiny.num_layers=2",
        "actor.fsdp.use_remove_padding=true",
        "checkpoint.every=2",
    ]
    out = run(GRPO, f"run_root={tmp_path}", *args, nproc=2)
    assert out.returncode == 0, out.stderr[-4000:]
    run_dir = the_run_dir(tmp_path, "grpo")
    first = metrics(run_dir)
    assert [r["step"] for r in first] == [1, 2, 3] and all(r["update_skipped"] == 0.0 for r in first)
    resumed = run(
        GRPO,
        f"run_root={tmp_path}",
        *args,
        f"resume={run_dir / 'checkpoints' / 'step_2'}",
        f"run_dir={run_dir}",
        nproc=2,
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    again = metrics(run_dir)
    assert [r["step"] for r in again] == [1, 2, 3]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"].endswith("step_2")


ESTIMATOR_FILE = """
from pathlib import Path

import rlfunc as rf


def centered(scores, *, group_ids, response_mask):
    \"\"\"Dr.GRPO's group-mean baseline; leaves a mark that the recipe called it.\"\"\"
    Path(__file__).with_name("called").touch()
    return rf.grpo(scores, group_ids=group_ids, response_mask=response_mask, norm_by_std=False)
"""


@pytest.mark.slow
def test_file_referenced_estimator(tmp_path, data_dir):
    """algo.estimator=path/to/file.py:function: the recipe runs the user's estimator."""
    est_dir = tmp_path / "user_code"
    est_dir.mkdir()
    (est_dir / "my_estimator.py").write_text(ESTIMATOR_FILE)
    runs = tmp_path / "runs"
    out = run(
        GRPO, f"run_root={runs}", *tiny(data_dir), "steps=2", f"algo.estimator={est_dir / 'my_estimator.py'}:centered"
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert (est_dir / "called").exists()
    assert [r["step"] for r in metrics(the_run_dir(runs, "grpo"))] == [1, 2]


@pytest.mark.slow
def test_evaluation_only_run(tmp_path, data_dir):
    """steps=0: the starting policy's held-out metrics, no training, no training data needed."""
    out = run(
        GRPO,
        f"run_root={tmp_path}",
        f"data.val_files={data_dir / 'val.jsonl'}",
        "reward.fn=arithmetic",
        "data.max_prompt_length=16",
        "rollout.max_new_tokens=6",
        "eval.n=2",
        *TINY_MODEL,
        "steps=0",
    )
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads((the_run_dir(tmp_path, "grpo") / "summary.json").read_text())
    assert summary["steps"] == 0 and summary["eval_before"] is None and 0.0 <= summary["eval_after"] <= 1.0


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algo.estimator=grop", "algo.estimator='grop' is not a built-in name; did you mean grpo"),
        ("algo.estimator=gae", "algo.estimator='gae' is not a built-in name (built-ins: grpo, grpo_passk, rloo"),
        (
            "algo.policy_loss=no_such_module:loss",
            "algo.policy_loss='no_such_module:loss': no module named 'no_such_module'",
        ),
        ("reward.fn=gsm8", "reward.fn='gsm8' is not a built-in name; did you mean gsm8k"),
    ],
)
def test_unknown_estimator_loss_or_reward_fails_before_any_work(tmp_path, override, message):
    out = run(GRPO, f"run_root={tmp_path}", "reward.fn=exact", override, timeout=120)
    assert out.returncode != 0
    assert message in out.stderr
    assert not list(tmp_path.iterdir())


def test_unknown_config_key_fails_before_any_work(tmp_path):
    out = run(GRPO, f"run_root={tmp_path}", "actor.optim.lrr=1e-5", timeout=120)
    assert out.returncode != 0
    assert "unknown config key 'actor.optim.lrr'; did you mean actor.optim.lr" in out.stderr
    assert not list(tmp_path.iterdir())


def test_missing_training_data_is_named(tmp_path):
    out = run(GRPO, f"run_root={tmp_path}", "reward.fn=exact", *TINY_MODEL, timeout=120)
    assert out.returncode != 0
    assert "data.train_files is empty" in out.stderr


def test_help_lists_keys_with_defaults_and_meanings():
    out = run(GRPO, "--help", timeout=120)
    assert out.returncode == 0
    assert "actor.optim.lr = 1e-06" in out.stdout and "rollout.n = 8" in out.stdout
    line = next(line for line in out.stdout.splitlines() if line.strip().startswith("reward.fn ="))
    assert "built-in names" in line


def test_entropy_bonus_is_subtracted_and_differentiable():
    import attrs
    import torch

    import rlfunc as rf
    from backends.training.fsdp import ModelOutputs
    from experiments import grpo as recipe

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 7, generator=g, requires_grad=True)
    ids = torch.randint(0, 7, (3, 4), generator=g)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    out = ModelOutputs(logprobs=rf.logprobs_from_logits(logits, ids), entropy=rf.entropy_from_logits(logits))
    mb = rf.RolloutBatch(
        prompt_ids=torch.zeros(3, 1, dtype=torch.long),
        prompt_mask=torch.ones(3, 1, dtype=torch.bool),
        response_ids=ids,
        response_mask=mask,
        old_logprobs=out.logprobs.detach(),
        advantages=torch.randn(3, 4, generator=g) * mask,
        group_ids=torch.arange(3),
    )
    norms = rf.local_normalizers(mask)
    from backends.loop.actor_loss import make_actor_loss

    base, _ = make_actor_loss(rf.POLICY_LOSSES["vanilla"], recipe.AlgoConfig(), horizon=4)(out, mb, norms, seed=0)
    algo = attrs.evolve(recipe.AlgoConfig(), entropy_coef=0.1)
    with_bonus, m = make_actor_loss(rf.POLICY_LOSSES["vanilla"], algo, horizon=4)(out, mb, norms, seed=0)
    torch.testing.assert_close(with_bonus, base - 0.1 * m["entropy"])
    (grad,) = torch.autograd.grad(with_bonus - base, logits)
    assert grad[mask].abs().sum() > 0 and grad[~mask].abs().sum() == 0
    assert "kl_loss" not in m  # logged only against a reference


@pytest.mark.slow
def test_a_reward_model_adds_to_the_reward_functions(tmp_path, data_dir):
    """reward_model.path: a learned reward (a tiny random sequence classifier) on top of the rule-based one."""
    from backends.models import TinyModelConfig, build_char_tokenizer, write_tiny_reward_model

    rm = write_tiny_reward_model(
        tmp_path / "rm",
        TinyModelConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=96, seed=7),
        build_char_tokenizer(),
    )
    runs = tmp_path / "runs"
    out = run(
        GRPO, f"run_root={runs}", *tiny(data_dir), "steps=2", f"reward_model.path={rm}", "reward_model.weight=0.5"
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rl = metrics(the_run_dir(runs, "grpo"))
    for row in rl:
        # the step's reward is the rule-based one plus half the reward model's (a random model: nonzero)
        assert row["reward/model"] != 0.0
        assert row["reward_mean"] == pytest.approx(row["reward/arithmetic"] + 0.5 * row["reward/model"], abs=1e-5)


@pytest.mark.slow
@pytest.mark.offpolicy
def test_bf16_run_with_rejection_geometric_weights_and_decoupled_ppo(tmp_path, data_dir):
    """A bf16 trainer and rollout (a real log-prob mismatch) with every correction on: token rejection (MIS),
    geometric-mean TIS and AReaL's decoupled PPO; each logs its numbers, and every token carries its policy
    version (staleness 0 in the synchronous loop)."""
    out = run(
        GRPO,
        f"run_root={tmp_path}",
        *tiny(data_dir),
        "actor.fsdp.param_dtype=bfloat16",
        "rollout.dtype=bfloat16",
        "algo.rollout_rs=token",
        "algo.rollout_rs_threshold=1.5",
        "algo.rollout_is=geometric",
        "algo.policy_loss=decoupled_ppo",
        "algo.policy_loss_args.decoupled_ppo.behaviour_weight_cap=5",
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rl = metrics(the_run_dir(tmp_path, "grpo"))
    for row in rl:
        assert 0.0 <= row["rs_masked_frac"] <= 1.0 and row["is_weight_mean"] > 0.0
        assert row["staleness/max"] == 0.0 and row["staleness/frac_0"] == 1.0
        assert row["update_skipped"] == 0.0 and row["grad_norm"] >= 0.0


def test_algorithm_settings_are_checked_at_start_up(tmp_path):
    from backends.config import ConfigError
    from backends.loop.vocabulary import PPOArgs
    from experiments.grpo import AlgoConfig, resolve_algorithm

    for bad in ({"agg": "token-meen"}, {"kl_loss_kind": "k9"}, {"rollout_rs_threshold": 0.5}, {"kl_loss_coef": -1.0}):
        with pytest.raises(ValueError):
            AlgoConfig(**bad)
    with pytest.raises(ValueError, match="clip_low"):
        PPOArgs(clip_low=1.5)
    loss = tmp_path / "my_loss.py"
    loss.write_text(
        "def teacher_forced(logprobs, **kwargs):\n    return logprobs.sum(), {}\n\n"
        "teacher_forced.logprobs_needed = ('current', 'teacher')\n"
    )
    with pytest.raises(ConfigError, match="algo.policy_loss=.*teacher"):
        resolve_algorithm(AlgoConfig(policy_loss=f"{loss}:teacher_forced"))
    resolve_algorithm(AlgoConfig(policy_loss="decoupled_ppo"))
