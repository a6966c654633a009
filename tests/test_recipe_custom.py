"""End-to-end smoke runs of experiments/custom_algorithm.py (both variants, both launchers)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "experiments" / "custom_algorithm.py"
TINY = [
    "warm_start.steps=4", "steps=2", "prompts_per_step=4", "rollout.n=4", "task.num_heldout=8",
    "tiny.num_heads=2", "tiny.num_kv_heads=1", "tiny.hidden_size=64", "tiny.intermediate_size=96", "tiny.num_layers=1",
]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def _check_run(tmp_path: Path, world_size: int, algorithm: str) -> None:
    (run_dir,) = list(tmp_path.glob("custom_algorithm-*"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["algorithm"] == algorithm and summary["steps"] == 2 and summary["world_size"] == world_size
    assert 0.0 <= summary["eval_before"] <= 1.0 and 0.0 <= summary["eval_after"] <= 1.0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("reward_mean", "loss", "grad_norm", "clip_frac"):
        assert key in rows[-1], key
    if algorithm == "reinforce_pp_baseline":
        assert "kl_loss" in rows[-1]
    assert (run_dir / "reward_curve.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["dr_grpo", "reinforce_pp_baseline"])
def test_plain_python_launcher(tmp_path, algorithm):
    out = subprocess.run(
        [sys.executable, str(RECIPE), f"run_root={tmp_path}", *TINY, f"algo.name={algorithm}"],
        env=_env(), capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert "held-out success" in out.stdout
    _check_run(tmp_path, 1, algorithm)


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_two_ranks(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    out = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "2", str(RECIPE), f"run_root={tmp_path}", *TINY],
        env=_env(), capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    _check_run(tmp_path, 2, "reinforce_pp_baseline")


def test_unknown_algorithm_fails_before_any_work(tmp_path):
    out = subprocess.run(
        [sys.executable, str(RECIPE), f"run_root={tmp_path}", "algo.name=ppo2"],
        env=_env(), capture_output=True, text=True, timeout=120,
    )
    assert out.returncode != 0 and "algo.name must be reinforce_pp_baseline or dr_grpo" in out.stderr
    assert not list(tmp_path.iterdir())


def test_loss_is_a_pure_function_of_tensors():
    """The highlight: the algorithm's loss runs on plain tensors, no model, no process group."""
    import torch

    sys.path.insert(0, str(ROOT))
    import rlfunc as rf
    from experiments.custom_algorithm import AlgoConfig, advantages, loss_fn

    torch.manual_seed(0)
    b, t = 8, 5
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[:, 3:] = torch.rand(b, 2) < 0.5
    mask = torch.cumprod(mask.int(), -1).bool()
    batch = rf.RolloutBatch(
        prompt_ids=torch.zeros(b, 2, dtype=torch.long), prompt_mask=torch.ones(b, 2, dtype=torch.bool),
        response_ids=torch.zeros(b, t, dtype=torch.long), response_mask=mask,
        group_ids=torch.arange(b) // 4, scores=(torch.arange(b) % 3 == 0).float(),
        old_logprobs=-torch.rand(b, t), ref_logprobs=-torch.rand(b, t),
    )
    logprobs = (batch.old_logprobs + 0.05 * torch.randn(b, t)).requires_grad_()

    class Out:
        pass

    out = Out()
    out.logprobs = logprobs
    for name in ("reinforce_pp_baseline", "dr_grpo"):
        algo = AlgoConfig(name=name)
        adv_batch = advantages(batch, algo)
        loss, metrics = loss_fn(out, adv_batch, rf.local_normalizers(mask), algo=algo, horizon=t)
        (grad,) = torch.autograd.grad(loss, logprobs)
        assert loss.shape == () and torch.isfinite(grad).all()
        assert torch.equal(grad[~mask], torch.zeros_like(grad[~mask]))
        assert ("kl_loss" in metrics) == (name == "reinforce_pp_baseline")
