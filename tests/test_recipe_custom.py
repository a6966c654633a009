"""End-to-end smoke runs of experiments/custom_algorithm.py (both variants, both launchers)."""

import json

import pytest

from tests.recipes import CUSTOM, TINY_MODEL, arithmetic_data, data_args, metrics, run, the_run_dir

RECIPE = CUSTOM


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return arithmetic_data(tmp_path_factory.mktemp("arithmetic"))


def tiny(data_dir) -> list[str]:
    return [*data_args(data_dir), *TINY_MODEL, "steps=2", "prompts_per_step=4", "rollout.n=4", "eval.max_prompts=8"]


def _check_run(tmp_path, world_size: int, algorithm: str) -> None:
    run_dir = the_run_dir(tmp_path, "custom_algorithm")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["algorithm"] == algorithm and summary["steps"] == 2 and summary["world_size"] == world_size
    assert 0.0 <= summary["eval_before"] <= 1.0 and 0.0 <= summary["eval_after"] <= 1.0
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("reward_mean", "loss", "grad_norm", "clip_frac"):
        assert key in rows[-1], key
    if algorithm == "reinforce_pp_baseline":
        assert "kl_loss" in rows[-1]
    assert (run_dir / "reward_curve.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["dr_grpo", "reinforce_pp_baseline"])
def test_plain_python_launcher(tmp_path, data_dir, algorithm):
    out = run(CUSTOM, f"run_root={tmp_path}", *tiny(data_dir), f"algo.name={algorithm}")
    assert out.returncode == 0, out.stderr[-4000:]
    assert "held-out success" in out.stdout
    _check_run(tmp_path, 1, algorithm)


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_two_ranks(tmp_path, data_dir):
    out = run(CUSTOM, f"run_root={tmp_path}", *tiny(data_dir), nproc=2)
    assert out.returncode == 0, out.stderr[-4000:]
    _check_run(tmp_path, 2, "reinforce_pp_baseline")


def test_unknown_algorithm_fails_before_any_work(tmp_path):
    out = run(CUSTOM, f"run_root={tmp_path}", "algo.name=ppo2", timeout=120)
    assert out.returncode != 0 and "algo.name: 'name' must be in ('reinforce_pp_baseline', 'dr_grpo')" in out.stderr
    assert not list(tmp_path.iterdir())


def test_loss_is_a_pure_function_of_tensors():
    """The highlight: the algorithm's loss runs on plain tensors, no model, no process group."""
    import torch

    import rlfunc as rf
    from experiments.custom_algorithm import AlgoConfig, advantages, loss_fn

    torch.manual_seed(0)
    b, t = 8, 5
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[:, 3:] = torch.rand(b, 2) < 0.5
    mask = torch.cumprod(mask.int(), -1).bool()
    batch = rf.RolloutBatch(
        prompt_ids=torch.zeros(b, 2, dtype=torch.long),
        prompt_mask=torch.ones(b, 2, dtype=torch.bool),
        response_ids=torch.zeros(b, t, dtype=torch.long),
        response_mask=mask,
        group_ids=torch.arange(b) // 4,
        scores=(torch.arange(b) % 3 == 0).float(),
        old_logprobs=-torch.rand(b, t),
        ref_logprobs=-torch.rand(b, t),
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
