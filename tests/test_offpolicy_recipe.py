"""The GRPO recipe on a split placement (backends/loop/split.py): 1 trainer rank + 1 rollout rank under
torchrun, the rollout pool sampling ahead by a fixed lag."""

import json
import re

import pytest
import torch

from tests.recipes import GRPO, TINY_MODEL, arithmetic_data, data_args, metrics, run, the_run_dir

pytestmark = [pytest.mark.offpolicy, pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return arithmetic_data(tmp_path_factory.mktemp("arithmetic"))


def split_run(root, data_dir, *args: str, steps: int = 4):
    out = run(
        GRPO,
        f"run_root={root}",
        *data_args(data_dir, sft_steps=0),
        *TINY_MODEL,
        f"steps={steps}",
        "prompts_per_step=4",
        "rollout.n=4",
        "eval.max_prompts=8",
        "offpolicy.rollout_ranks=1",
        *args,
        nproc=2,
    )
    return out


def test_one_step_off_runs_one_version_behind(tmp_path, data_dir):
    out = split_run(tmp_path, data_dir, "offpolicy.mode=one_step_off", "eval.every=2", "dump_generations_every=2")
    assert out.returncode == 0, out.stderr[-4000:]
    run_dir = the_run_dir(tmp_path, "grpo")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["wall_seconds"] > 0
    for key in ("eval_before", "eval_after"):
        assert 0.0 <= summary[key] <= 1.0
    rl = metrics(run_dir)
    assert [r["step"] for r in rl] == [1, 2, 3, 4]
    assert [r["staleness/max"] for r in rl] == [0.0, 1.0, 1.0, 1.0]
    assert [r["staleness/run_max"] for r in rl] == [0.0, 1.0, 1.0, 1.0]
    for key in (
        "reward_mean",
        "grad_norm",
        "staleness/run_mean",
        "staleness/rejected",
        "sync_time_s",
        "reward/arithmetic",
    ):
        assert key in rl[-1], key
    assert all(r["staleness/rejected"] == 0.0 for r in rl)
    assert (run_dir / "final_model" / "config.json").exists()
    # eval.every=2: the rollout pool evaluates the weights of steps 2 and 4; the last one is the final evaluation
    assert ["val/mean@1" in r for r in rl] == [False, True, False, True]
    assert summary["eval_after"] == rl[-1]["val/mean@1"]
    # the rollout pool dumps its samples of steps 2 and 4, with the advantages the trainer computed from their scores
    assert sorted(p.name for p in (run_dir / "generations").glob("*.jsonl")) == ["step_2.jsonl", "step_4.jsonl"]
    dumped = [json.loads(line) for line in (run_dir / "generations" / "step_4.jsonl").read_text().splitlines()]
    assert len(dumped) == 16 and {"prompt", "response", "ground_truth", "score", "advantage"} <= set(dumped[0])
    assert sum(r["score"] for r in dumped) / 16 == pytest.approx(rl[-1]["reward_mean"])


def _final_weights(root):
    from safetensors.torch import load_file

    (path,) = (the_run_dir(root, "grpo") / "final_model").glob("*.safetensors")
    return load_file(path)


def test_bounded_zero_is_sync_on_the_split(tmp_path, data_dir):
    a, b = tmp_path / "bounded", tmp_path / "sync"
    # a reward that differs within a group (the tiny random model never gets the arithmetic right): real updates
    reward = tmp_path / "length_reward.py"
    reward.write_text("def score(response, ground_truth, **columns):\n    return float(len(response) % 3)\n")
    out = split_run(
        a, data_dir, "offpolicy.mode=bounded", "offpolicy.max_staleness=0", f"reward.fn={reward}:score", steps=3
    )
    assert out.returncode == 0, out.stderr[-4000:]
    out = split_run(b, data_dir, "offpolicy.mode=sync", f"reward.fn={reward}:score", steps=3)
    assert out.returncode == 0, out.stderr[-4000:]
    wa, wb = _final_weights(a), _final_weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert (wa[name] == wb[name]).all(), name
    drop = ("step_time_s", "rollout_time_s", "update_time_s", "sync_time_s", "tokens_per_s", "time", "wall_time")
    ma = [
        {k: v for k, v in r.items() if k not in drop and not k.startswith("time/")}
        for r in metrics(the_run_dir(a, "grpo"))
    ]
    mb = [
        {k: v for k, v in r.items() if k not in drop and not k.startswith("time/")}
        for r in metrics(the_run_dir(b, "grpo"))
    ]
    assert [r["reward_mean"] for r in ma] == [r["reward_mean"] for r in mb]
    assert all(r["staleness/max"] == 0.0 for r in ma)
    assert any(r["grad_norm"] > 0 for r in ma)  # the weights compared did move


def test_bounded_two_stays_within_the_bound(tmp_path, data_dir):
    """Also with a KL loss to the reference, which lives on the trainer pool: zero at the first update (the policy is
    the reference), positive once the weights moved."""
    reward = tmp_path / "length_reward.py"
    reward.write_text("def score(response, ground_truth, **columns):\n    return float(len(response) % 3)\n")
    out = split_run(
        tmp_path,
        data_dir,
        "offpolicy.mode=bounded",
        "offpolicy.max_staleness=2",
        "algo.kl_loss_coef=0.05",
        f"reward.fn={reward}:score",
        "actor.optim.lr=1e-2",
        steps=5,
    )  # a step the KL can see
    assert out.returncode == 0, out.stderr[-4000:]
    rl = metrics(the_run_dir(tmp_path, "grpo"))
    assert [r["staleness/max"] for r in rl] == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert max(r["staleness/run_max"] for r in rl) <= 2.0
    assert rl[0]["kl_loss"] == 0.0 and rl[-1]["kl_loss"] > 0.0 and rl[0]["grad_norm"] > 0


def test_a_dead_rollout_rank_is_named(tmp_path, data_dir):
    """The rollout rank dies while sampling step 2; the trainer fails at once, naming it (no hang)."""
    import os
    from unittest import mock

    with mock.patch.dict(os.environ, {"RLFUNC_FAULT": "kill:rank=1:step=2:phase=rollout"}):
        out = split_run(tmp_path, data_dir, "offpolicy.mode=one_step_off", "deadlines.process_group=60", steps=4)
    assert out.returncode != 0
    # the trainer meets the dead rank either pushing version 1 or, when the kill cut off the batch of step 1 that
    # was still being sent, receiving it: both errors name rank 1
    named = re.search(
        r"RolloutPoolError: pushing weights version 1 to rollout rank\(s\) 1 failed|"
        r"ChannelError: sample channel on rank 0: .*rank 1 (failed|did not complete)",
        out.stderr,
    )
    assert named, out.stderr[-4000:]


def test_an_sft_stage_runs_on_the_trainer_pool(tmp_path, data_dir):
    """sft.files on the split: the trainer pool runs the SFT stage (the rollout rank waits update by update) and
    exports the policy, which is the colocated recipe's SFT policy to the bit; the rollout pool samples from it."""
    split, colocated = tmp_path / "split", tmp_path / "colocated"
    sft = (f"sft.files={data_dir / 'sft.jsonl'}", "sft.steps=3", "sft.batch_size=8", "sft.optim.lr=3e-3")
    out = split_run(split, data_dir, "offpolicy.mode=one_step_off", *sft, steps=2)
    assert out.returncode == 0, out.stderr[-4000:]
    out = run(
        GRPO,
        f"run_root={colocated}",
        *data_args(data_dir, sft_steps=0),
        *TINY_MODEL,
        "steps=1",
        "prompts_per_step=4",
        "rollout.n=4",
        "eval.max_prompts=8",
        *sft,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    from safetensors.torch import load_file

    (a,), (b,) = ((the_run_dir(root, "grpo") / "sft_model").glob("*.safetensors") for root in (split, colocated))
    wa, wb = load_file(a), load_file(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    rows = [json.loads(line) for line in (the_run_dir(split, "grpo") / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "sft_loss" in r] == [-3, -1]
    rl = metrics(the_run_dir(split, "grpo"))
    assert [r["step"] for r in rl] == [1, 2] and all(r["staleness/rejected"] == 0.0 for r in rl)


def test_a_rollout_rank_dead_during_the_sft_stage_is_named(tmp_path, data_dir):
    """The rollout rank dies while it waits for SFT update 2 of 3; trainer rank 0 fails at its next word to the
    pool, naming the rollout rank (no hang)."""
    import os
    from unittest import mock

    sft = (f"sft.files={data_dir / 'sft.jsonl'}", "sft.steps=3", "sft.batch_size=8")
    with mock.patch.dict(os.environ, {"RLFUNC_FAULT": "kill:rank=1:step=-2:phase=update"}):
        out = split_run(tmp_path, data_dir, "offpolicy.mode=one_step_off", "deadlines.process_group=60", *sft, steps=2)
    assert out.returncode != 0
    assert re.search(r"RolloutPoolError: telling rollout rank\(s\) 1 SFT update \d starts failed", out.stderr), (
        out.stderr[-4000:]
    )


def test_a_reward_model_scores_on_the_rollout_pool(tmp_path, data_dir):
    """reward_model.path on the split: each rollout rank holds a replica and adds its weighted score to the
    reward functions' (a random model: nonzero); a sharded reward model is refused before any work."""
    from backends.models import TinyModelConfig, build_char_tokenizer, write_tiny_reward_model

    rm = write_tiny_reward_model(
        tmp_path / "rm",
        TinyModelConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=96, seed=7),
        build_char_tokenizer(),
    )
    runs = tmp_path / "runs"
    out = split_run(
        runs, data_dir, "offpolicy.mode=one_step_off", f"reward_model.path={rm}", "reward_model.weight=0.5", steps=2
    )
    assert out.returncode == 0, out.stderr[-4000:]
    for row in metrics(the_run_dir(runs, "grpo")):
        assert row["reward/model"] != 0.0
        assert row["reward_mean"] == pytest.approx(row["reward/arithmetic"] + 0.5 * row["reward/model"], abs=1e-5)
    out = split_run(
        tmp_path / "sharded",
        data_dir,
        "offpolicy.mode=one_step_off",
        f"reward_model.path={rm}",
        "reward_model.shard=true",
    )
    assert out.returncode != 0 and "does not support reward_model.shard=true" in out.stderr


def test_async_modes_refuse_what_they_do_not_support(tmp_path, data_dir):
    out = run(
        GRPO, f"run_root={tmp_path}", *data_args(data_dir, sft_steps=0), *TINY_MODEL, "offpolicy.mode=one_step_off"
    )
    assert out.returncode != 0 and "offpolicy.rollout_ranks >= 1" in out.stderr


def test_sigterm_on_the_rollout_rank_stops_every_rank_after_the_same_step(tmp_path, data_dir):
    """SIGTERM reaches the rollout rank while it samples step 3; it joins the agreement when it takes version 2,
    so the trainer stops after step 2 and drains the batch sampled ahead; exit code 0."""
    import os
    from unittest import mock

    with mock.patch.dict(os.environ, {"RLFUNC_FAULT": "term:rank=1:step=3:phase=rollout"}):
        out = split_run(tmp_path, data_dir, "offpolicy.mode=one_step_off", steps=5)
    assert out.returncode == 0, out.stderr[-4000:]
    assert [r["step"] for r in metrics(the_run_dir(tmp_path, "grpo"))] == [1, 2]
    assert "stopped after step 2" in out.stdout + out.stderr
    assert "1 batch(es) from rank 1 in flight, dropped" in out.stdout + out.stderr


@pytest.mark.checkpoint
def test_one_step_off_resumes_exactly_from_a_checkpoint(tmp_path, data_dir):
    """A checkpoint drains the pipeline (the batch after it is sampled with its weights, staleness 0), so a run
    resumed from it trains on the same batches: the same metrics and the same final weights."""
    reward = tmp_path / "length_reward.py"
    reward.write_text("def score(response, ground_truth, **columns):\n    return float(len(response) % 3)\n")
    args = ("offpolicy.mode=one_step_off", "checkpoint.every=2", f"reward.fn={reward}:score")
    out = split_run(tmp_path, data_dir, *args, steps=5)
    assert out.returncode == 0, out.stderr[-4000:]
    run_dir = the_run_dir(tmp_path, "grpo")
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_2", "step_4", "step_5"]
    drop = ("step_time_s", "rollout_time_s", "update_time_s", "sync_time_s", "tokens_per_s", "time", "wall_time")
    first = [{k: v for k, v in r.items() if k not in drop and not k.startswith("time/")} for r in metrics(run_dir)]
    assert [r["staleness/max"] for r in first] == [0.0, 1.0, 0.0, 1.0, 0.0]
    weights = _final_weights(tmp_path)
    resumed = split_run(
        tmp_path, data_dir, *args, f"resume={run_dir / 'checkpoints' / 'step_2'}", f"run_dir={run_dir}", steps=5
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    again = [{k: v for k, v in r.items() if k not in drop and not k.startswith("time/")} for r in metrics(run_dir)]
    assert [r["step"] for r in again] == [1, 2, 3, 4, 5]
    differ = [
        (r["step"], k, f.get(k), r.get(k))
        for f, r in zip(first, again)
        for k in sorted(set(f) | set(r))
        if f.get(k) != r.get(k)
    ]
    assert not differ, differ  # (step, metric, uninterrupted, resumed)
    assert any(r["grad_norm"] > 0 for r in again[2:])  # the weights compared did move after the resume point
    resumed_weights = _final_weights(tmp_path)
    assert all(torch.equal(weights[k], resumed_weights[k]) for k in weights)
    assert json.loads((run_dir / "summary.json").read_text())["resumed_from"].endswith("step_2")


@pytest.mark.checkpoint
def test_sigterm_with_checkpoints_saves_where_it_stops_and_resumes(tmp_path, data_dir):
    """SIGTERM on the rollout rank while it samples step 3 (batch 3 drawn ahead of the stop): every rank stops after
    step 2 and saves there; resume=auto samples step 3 again with the weights of step 2 and finishes the run."""
    import os
    from unittest import mock

    args = ("offpolicy.mode=one_step_off", "checkpoint.every=10")
    with mock.patch.dict(os.environ, {"RLFUNC_FAULT": "term:rank=1:step=3:phase=rollout"}):
        out = split_run(tmp_path, data_dir, *args, steps=5)
    assert out.returncode == 0, out.stderr[-4000:]
    run_dir = the_run_dir(tmp_path, "grpo")
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_2"]
    resumed = split_run(tmp_path, data_dir, *args, "resume=auto", f"run_dir={run_dir}", steps=5)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    rl = metrics(run_dir)
    assert [r["step"] for r in rl] == [1, 2, 3, 4, 5]
    assert [r["staleness/max"] for r in rl] == [0.0, 1.0, 0.0, 1.0, 1.0]  # step 3: sampled by the saved weights
    assert json.loads((run_dir / "summary.json").read_text())["resumed_from"].endswith("step_2")


DIGIT_REWARD = """
def starts_with_a_digit(response, ground_truth, **columns):
    return 1.0 if response[:1].isdigit() else 0.0
"""


@pytest.mark.checkpoint
def test_dynamic_sampling_on_the_split_resumes_exactly(tmp_path, data_dir):
    """Dynamic sampling draws a varying number of prompts per step (a reward most groups agree on); the batch carries
    the stream's position, so a run resumed from a checkpoint draws the same prompts: the same metrics and weights."""
    reward = tmp_path / "digit_reward.py"
    reward.write_text(DIGIT_REWARD)
    args = (
        "offpolicy.mode=one_step_off",
        "checkpoint.every=2",
        "algo.dynamic_sampling=true",
        "algo.max_sampling_rounds=3",
        f"reward.fn={reward}:starts_with_a_digit",
    )
    out = split_run(tmp_path, data_dir, *args, steps=4)
    assert out.returncode == 0, out.stderr[-4000:]
    run_dir = the_run_dir(tmp_path, "grpo")
    drop = ("step_time_s", "rollout_time_s", "update_time_s", "sync_time_s", "tokens_per_s", "time", "wall_time")
    first = [{k: v for k, v in r.items() if k not in drop and not k.startswith("time/")} for r in metrics(run_dir)]
    rounds = [r["sampling/rounds"] for r in first]
    assert [r["sampling/prompts_drawn"] for r in first] == [4.0 * n for n in rounds]
    assert all(1 <= n <= 3 for n in rounds), rounds  # never past the cap
    assert sum(rounds[:2]) > 2, rounds  # the resume point is not at 2 x prompts_per_step: the position travelled
    assert [r["staleness/max"] for r in first] == [0.0, 1.0, 0.0, 1.0]
    weights = _final_weights(tmp_path)
    resumed = split_run(
        tmp_path, data_dir, *args, f"resume={run_dir / 'checkpoints' / 'step_2'}", f"run_dir={run_dir}", steps=4
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    again = [{k: v for k, v in r.items() if k not in drop and not k.startswith("time/")} for r in metrics(run_dir)]
    differ = [
        (r["step"], k, f.get(k), r.get(k))
        for f, r in zip(first, again)
        for k in sorted(set(f) | set(r))
        if f.get(k) != r.get(k)
    ]
    assert not differ, differ  # (step, metric, uninterrupted, resumed)
    resumed_weights = _final_weights(tmp_path)
    assert all(torch.equal(weights[k], resumed_weights[k]) for k in weights)


def test_the_data_split_does_not_depend_on_the_number_of_rollout_ranks(tmp_path, data_dir):
    """2 trainer ranks served by 1 rollout rank, or by 2 (each its own trainer): trainer t's share is sampled with the
    seed the colocated loop gives data rank t, and dynamic sampling's rounds are agreed over the whole rollout pool, so
    both runs train on the same batches and end with the same weights."""
    reward = tmp_path / "digit_reward.py"
    reward.write_text(DIGIT_REWARD)
    args = (
        *data_args(data_dir, sft_steps=0),
        *TINY_MODEL,
        "steps=3",
        "prompts_per_step=4",
        "rollout.n=4",
        "eval.max_prompts=4",
        "offpolicy.mode=one_step_off",
        "algo.dynamic_sampling=true",
        "algo.max_sampling_rounds=3",
        f"reward.fn={reward}:starts_with_a_digit",
        "actor.optim.lr=1e-2",
    )
    runs = {}
    for rollout_ranks, nproc in ((1, 3), (2, 4)):
        root = tmp_path / f"r{rollout_ranks}"
        out = run(GRPO, f"run_root={root}", *args, f"offpolicy.rollout_ranks={rollout_ranks}", nproc=nproc)
        assert out.returncode == 0, out.stderr[-4000:]
        runs[rollout_ranks] = (metrics(the_run_dir(root, "grpo")), _final_weights(root))
    (m1, w1), (m2, w2) = runs[1], runs[2]
    assert [r["sampling/rounds"] for r in m1] == [r["sampling/rounds"] for r in m2]
    assert [r["reward_mean"] for r in m1] == [r["reward_mean"] for r in m2]
    assert any(r["grad_norm"] > 0 for r in m1)
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
