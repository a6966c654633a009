"""End-to-end smoke runs of experiments/grpo_arithmetic.py with both launchers (real processes)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "experiments" / "grpo_arithmetic.py"
TINY = [
    "warm_start.steps=4", "steps=3", "prompts_per_step=4", "rollout.n=4", "eval_samples=1",
    "task.num_heldout=8", "tiny.hidden_size=64", "tiny.num_heads=2", "tiny.num_kv_heads=1",
    "tiny.intermediate_size=96", "tiny.num_layers=1", "algo.kl_coef=0.01",
]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def _check_run(tmp_path: Path, world_size: int) -> None:
    (run_dir,) = list(tmp_path.glob("grpo_arithmetic-*"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["world_size"] == world_size
    for key in ("eval_before", "eval_after", "eval_greedy_before", "eval_greedy_after"):
        assert 0.0 <= summary[key] <= 1.0
    assert summary["wall_seconds"] > 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in rl] == [1, 2, 3]
    for key in ("reward_mean", "success_rate", "kl", "entropy", "clip_frac", "grad_norm", "response_length",
                "tokens_per_s", "step_time_s", "rollout_time_s", "update_time_s", "sync_time_s", "skipped_rows"):
        assert key in rl[-1], key
    assert all(r["skipped_rows"] == 0.0 for r in rl)  # a KL term: zero-advantage rows are not skippable
    assert (run_dir / "reward_curve.png").stat().st_size > 0
    assert list((run_dir / "tensorboard").iterdir())
    assert (run_dir / "warm_start_model" / "config.json").exists()


@pytest.mark.slow
def test_plain_python_launcher(tmp_path):
    out = subprocess.run(
        [sys.executable, str(RECIPE), f"run_root={tmp_path}", *TINY],
        env=_env(), capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert "held-out success" in out.stdout
    _check_run(tmp_path, 1)


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_two_ranks(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    out = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "2", str(RECIPE), f"run_root={tmp_path}", *TINY],
        env=_env(), capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    _check_run(tmp_path, 2)


@pytest.mark.slow
def test_bf16_run_skips_zero_advantage_rows(tmp_path):
    """bf16 trainer and rollout, no KL term: rows of groups with one reward are skipped (and counted)."""
    args = [a for a in TINY if not a.startswith("algo.kl_coef")]
    out = subprocess.run(
        [sys.executable, str(RECIPE), f"run_root={tmp_path}", *args, "steps=4", "actor.fsdp.param_dtype=bfloat16",
         "rollout.dtype=bfloat16"],
        env=_env(), capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    (run_dir,) = list(tmp_path.glob("grpo_arithmetic-*"))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["step"] > 0]
    # tiny warm start: most groups get all-zero rewards, so rows are skipped
    assert any(r["skipped_rows"] > 0 for r in rl)
    assert all(0.0 <= r["skipped_rows"] <= 1.0 and r["update_skipped"] == 0.0 for r in rl)


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_two_ranks_resume(tmp_path):
    """Packed rows (FSDP2, 2 ranks), skipped zero-advantage rows (no KL term), resumed from a checkpoint:
    the resumed run logs the steps after its checkpoint again, and only those."""
    torchrun = Path(sys.executable).with_name("torchrun")
    args = [a for a in TINY if not a.startswith("algo.kl_coef")] + [
        "tiny.num_layers=2", "actor.fsdp.use_remove_padding=true", "checkpoint.every=2",
    ]
    base = [str(torchrun), "--standalone", "--nproc_per_node", "2", str(RECIPE), f"run_root={tmp_path}"]
    out = subprocess.run(base + args, env=_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    (run_dir,) = list(tmp_path.glob("grpo_arithmetic-*"))
    rl = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["step"] > 0]
    assert [r["step"] for r in rl] == [1, 2, 3] and all(r["update_skipped"] == 0.0 for r in rl)
    resumed = subprocess.run(base + args + [f"resume={run_dir / 'checkpoints' / 'step_2'}", f"run_dir={run_dir}"],
                             env=_env(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    rl = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["step"] > 0]
    assert [r["step"] for r in rl] == [1, 2, 3]
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
def test_file_referenced_estimator(tmp_path):
    """algo.estimator=path/to/file.py:function: the recipe runs the user's estimator."""
    est_dir = tmp_path / "user_code"
    est_dir.mkdir()
    (est_dir / "my_estimator.py").write_text(ESTIMATOR_FILE)
    runs = tmp_path / "runs"
    out = subprocess.run(
        [sys.executable, str(RECIPE), f"run_root={runs}", *TINY, "steps=2",
         f"algo.estimator={est_dir / 'my_estimator.py'}:centered"],
        env=_env(), capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert (est_dir / "called").exists()
    (run_dir,) = list(runs.glob("grpo_arithmetic-*"))
    rl = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["step"] > 0]
    assert [r["step"] for r in rl] == [1, 2]


@pytest.mark.parametrize(("override", "message"), [
    ("algo.estimator=grop", "algo.estimator='grop' is not a built-in name; did you mean grpo"),
    ("algo.estimator=gae", "algo.estimator='gae' is not a built-in name (built-ins: grpo, grpo_passk, rloo"),
    ("algo.policy_loss=no_such_module:loss", "algo.policy_loss='no_such_module:loss': no module named 'no_such_module'"),
])
def test_unknown_estimator_or_loss_fails_before_any_work(tmp_path, override, message):
    out = subprocess.run(
        [sys.executable, str(RECIPE), f"run_root={tmp_path}", override],
        env=_env(), capture_output=True, text=True, timeout=120,
    )
    assert out.returncode != 0
    assert message in out.stderr
    assert not list(tmp_path.iterdir())


def test_unknown_config_key_fails_before_any_work(tmp_path):
    out = subprocess.run(
        [sys.executable, str(RECIPE), f"run_root={tmp_path}", "actor.optim.lrr=1e-5"],
        env=_env(), capture_output=True, text=True, timeout=120,
    )
    assert out.returncode != 0
    assert "unknown config key 'actor.optim.lrr'; did you mean actor.optim.lr" in out.stderr
    assert not list(tmp_path.iterdir())


def test_help_lists_keys():
    out = subprocess.run([sys.executable, str(RECIPE), "--help"], env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "actor.optim.lr" in out.stdout and "rollout.n" in out.stdout


def test_entropy_bonus_is_subtracted_and_differentiable():
    import importlib.util

    import attrs
    import torch

    import rlfunc as rf

    spec = importlib.util.spec_from_file_location("grpo_arithmetic", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = recipe
    spec.loader.exec_module(recipe)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 7, generator=g, requires_grad=True)
    ids = torch.randint(0, 7, (3, 4), generator=g)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    from backends.training.fsdp import ModelOutputs

    out = ModelOutputs(logprobs=rf.logprobs_from_logits(logits, ids), entropy=rf.entropy_from_logits(logits))
    mb = rf.RolloutBatch(
        prompt_ids=torch.zeros(3, 1, dtype=torch.long), prompt_mask=torch.ones(3, 1, dtype=torch.bool),
        response_ids=ids, response_mask=mask, old_logprobs=out.logprobs.detach(),
        advantages=torch.randn(3, 4, generator=g) * mask, group_ids=torch.arange(3),
    )
    norms = rf.local_normalizers(mask)
    kw = dict(policy_loss=rf.POLICY_LOSSES["vanilla"], horizon=4)
    base, _ = recipe.policy_loss_with_kl(out, mb, norms, algo=recipe.AlgoConfig(), **kw)
    algo = attrs.evolve(recipe.AlgoConfig(), entropy_coef=0.1)
    with_bonus, m = recipe.policy_loss_with_kl(out, mb, norms, algo=algo, **kw)
    torch.testing.assert_close(with_bonus, base - 0.1 * m["entropy"])
    (grad,) = torch.autograd.grad(with_bonus - base, logits)
    assert grad[mask].abs().sum() > 0 and grad[~mask].abs().sum() == 0
