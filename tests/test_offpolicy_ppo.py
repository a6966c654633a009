"""The PPO recipe on a split placement (backends/loop/split.py with experiments/ppo.py's trainer): 1 trainer
rank holding the actor, the critic and the reference + 1 rollout rank, under torchrun."""

import json

import pytest
import torch

from tests.recipes import PPO, TINY_MODEL, arithmetic_data, data_args, metrics, run, the_run_dir

pytestmark = [pytest.mark.offpolicy, pytest.mark.distributed, pytest.mark.slow]

#: timings differ between two runs of the same schedule
TIMES = ("step_time_s", "rollout_time_s", "sync_time_s", "update_time_s", "tokens_per_s", "time", "wall_time")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return arithmetic_data(tmp_path_factory.mktemp("arithmetic"))


@pytest.fixture
def length_reward(tmp_path):
    """A reward that differs within a group (the tiny random model never gets the arithmetic right): real updates."""
    path = tmp_path / "length_reward.py"
    path.write_text("def score(response, ground_truth, **columns):\n    return float(len(response) % 3)\n")
    return f"reward.fn={path}:score"


def split_run(root, data_dir, *args: str, steps: int = 4, nproc: int = 2):
    return run(
        PPO,
        f"run_root={root}",
        *data_args(data_dir, sft_steps=0),
        *TINY_MODEL,
        f"steps={steps}",
        "prompts_per_step=4",
        "rollout.n=4",
        "eval.max_prompts=8",
        "offpolicy.rollout_ranks=1",
        *args,
        nproc=nproc,
    )


def final_weights(root) -> dict[str, torch.Tensor]:
    """The exported actor's and critic's tensors, by role and name."""
    from safetensors.torch import load_file

    run_dir = the_run_dir(root, "ppo")
    return {
        f"{role}/{name}": t
        for role in ("final_model", "final_critic")
        for path in (run_dir / role).glob("*.safetensors")
        for name, t in load_file(path).items()
    }


def without_times(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMES and not k.startswith("time/")} for r in rows]


def test_one_step_off_ppo_trains_actor_and_critic_one_version_behind(tmp_path, data_dir, length_reward):
    out = split_run(
        tmp_path,
        data_dir,
        "offpolicy.mode=one_step_off",
        "eval.every=2",
        "dump_generations_every=2",
        length_reward,
        "actor.optim.lr=1e-3",
        "algo.rollout_is=token",
    )
    assert out.returncode == 0, out.stderr[-4000:]
    run_dir = the_run_dir(tmp_path, "ppo")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and 0.0 <= summary["eval_after"] <= 1.0
    rl = metrics(run_dir)
    assert [r["step"] for r in rl] == [1, 2, 3, 4]
    assert [r["staleness/max"] for r in rl] == [0.0, 1.0, 1.0, 1.0]
    assert [r["staleness/run_max"] for r in rl] == [0.0, 1.0, 1.0, 1.0]
    for key in (
        "reward_mean",
        "values_mean",
        "returns_mean",
        "critic/loss",
        "grad_norm",
        "kl_reward",
        "kl_coef",
        "sync_time_s",
        "time/critic_update_s",
        "time/actor_update_s",
        "reward/score",
    ):
        assert key in rl[-1], key
    # the policy moved (the KL to the reference, in the token rewards, is no longer zero) and so did the critic
    assert rl[0]["kl_reward"] == 0.0 and rl[-1]["kl_reward"] != 0.0
    assert all(r["critic/grad_norm"] > 0 for r in rl)
    # token TIS: the sampler's log-probs against the trainer's; one version behind, they differ from step 2 on
    assert rl[0]["is_weight_mean"] == pytest.approx(1.0, abs=1e-4) and rl[-1]["is_k3_mean"] > 10 * rl[0]["is_k3_mean"]
    # the mean score of the batch the trainer received is what the rollout pool scored
    assert all(r["reward_mean"] == pytest.approx(r["reward/score"]) for r in rl)
    assert ["val/mean@1" in r for r in rl] == [False, True, False, True]
    assert (run_dir / "final_model" / "config.json").exists() and (run_dir / "final_critic" / "config.json").exists()
    # the rollout pool dumps its samples; their advantages come from the critic on the trainer pool: not known there
    dumped = [json.loads(line) for line in (run_dir / "generations" / "step_4.jsonl").read_text().splitlines()]
    assert len(dumped) == 16 and all(r["advantage"] is None for r in dumped)
    assert sum(r["score"] for r in dumped) / 16 == pytest.approx(rl[-1]["reward_mean"])


def test_bounded_zero_is_sync_for_ppo(tmp_path, data_dir, length_reward):
    a, b = tmp_path / "bounded", tmp_path / "sync"
    out = split_run(a, data_dir, "offpolicy.mode=bounded", "offpolicy.max_staleness=0", length_reward, steps=3)
    assert out.returncode == 0, out.stderr[-4000:]
    out = split_run(b, data_dir, "offpolicy.mode=sync", length_reward, steps=3)
    assert out.returncode == 0, out.stderr[-4000:]
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys() and any(k.startswith("final_critic/") for k in wa)
    assert [k for k in wa if not torch.equal(wa[k], wb[k])] == []
    ma, mb = without_times(metrics(the_run_dir(a, "ppo"))), without_times(metrics(the_run_dir(b, "ppo")))
    assert ma == mb
    assert all(r["staleness/max"] == 0.0 for r in ma) and any(r["grad_norm"] > 0 for r in ma)


@pytest.mark.checkpoint
def test_one_step_off_ppo_resumes_exactly(tmp_path, data_dir, length_reward):
    """The checkpoint holds the actor and the critic with their optimizers and the adaptive KL controller's beta: the
    resumed run logs the same metrics and ends with the same actor and critic."""
    args = (
        "offpolicy.mode=one_step_off",
        "checkpoint.every=2",
        length_reward,
        "algo.kl_ctrl=adaptive",
        "algo.kl_reward_coef=0.05",
        "actor.optim.lr=1e-3",
    )
    out = split_run(tmp_path, data_dir, *args, steps=5)
    assert out.returncode == 0, out.stderr[-4000:]
    run_dir = the_run_dir(tmp_path, "ppo")
    first, weights = without_times(metrics(run_dir)), final_weights(tmp_path)
    assert [r["staleness/max"] for r in first] == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert len({r["kl_coef"] for r in first}) > 1  # the adaptive controller moved: its state must be restored
    resumed = split_run(
        tmp_path, data_dir, *args, f"resume={run_dir / 'checkpoints' / 'step_2'}", f"run_dir={run_dir}", steps=5
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    again = without_times(metrics(run_dir))
    differ = [
        (r["step"], k, f.get(k), r.get(k))
        for f, r in zip(first, again)
        for k in sorted(set(f) | set(r))
        if f.get(k) != r.get(k)
    ]
    assert not differ, differ  # (step, metric, uninterrupted, resumed)
    resumed_weights = final_weights(tmp_path)
    assert [k for k in weights if not torch.equal(weights[k], resumed_weights[k])] == []


def test_ppo_on_the_split_refuses_what_it_does_not_support(tmp_path, data_dir):
    out = split_run(tmp_path, data_dir, "offpolicy.mode=one_step_off", "placement.mode=split", steps=1)
    assert out.returncode != 0 and "does not support placement.mode=split" in out.stderr, out.stderr[-2000:]
    out = run(
        PPO, f"run_root={tmp_path}", *data_args(data_dir, sft_steps=0), *TINY_MODEL, "rollout.multi_turn.max_turns=2"
    )
    assert out.returncode != 0 and "rollout.multi_turn.max_turns > 1" in out.stderr, out.stderr[-2000:]
