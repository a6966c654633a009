"""Partial rollouts in the split loop (backends/loop/partial_rollouts.py): the GRPO recipe with 1 trainer rank and 1
rollout rank in the bounded mode, the rollout rank's generations taking newer weights at chunk boundaries; and the
settings it refuses before any work."""

import json

import pytest

from backends.config import ConfigError, apply_overrides
from backends.loop.split import check_offpolicy
from tests.recipes import arithmetic_data, metrics, the_run_dir
from tests.test_offpolicy_recipe import split_run

pytestmark = [pytest.mark.native_engine, pytest.mark.offpolicy]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return arithmetic_data(tmp_path_factory.mktemp("arithmetic"))


def _split_run(root, data_dir, *args: str, steps: int = 4):
    # a reward that differs within a group (the tiny random model never gets the arithmetic right): real updates,
    # so the versions a generation takes hold other weights
    reward = root / "length_reward.py"
    reward.parent.mkdir(parents=True, exist_ok=True)
    reward.write_text("def score(response, ground_truth, **columns):\n    return float(len(response) % 3)\n")
    extra = ("offpolicy.mode=bounded", f"reward.fn={reward}:score", "actor.optim.lr=1e-2", "eval.before_training=false")
    out = split_run(root, data_dir, *extra, *args, steps=steps)
    assert out.returncode == 0, out.stderr[-4000:]
    return the_run_dir(root, "grpo")


def _weights(run_dir):
    from safetensors.torch import load_file

    (path,) = (run_dir / "final_model").glob("*.safetensors")
    return load_file(path)


def _same_weights(a, b) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)


_TIMES = ("step_time_s", "rollout_time_s", "update_time_s", "sync_time_s", "tokens_per_s", "time", "wall_time")


def _untimed(run_dir):
    return [{k: v for k, v in r.items() if k not in _TIMES and not k.startswith("time/")} for r in metrics(run_dir)]


@pytest.mark.distributed
@pytest.mark.slow
def test_generations_take_one_version_a_boundary_and_runs_repeat(tmp_path, data_dir):
    """max_staleness=2, a boundary every 2 decode iterations of 6-token responses. Batch 1 has nothing newer to
    take (version 0 is the trainer's at its update); batch s > 1 starts with the version the rank holds and takes one
    more at its first boundary (up to s - 1), so its first two tokens are one update old and the rest are the
    trainer's own version: every step's tokens are of two ages (staleness min 0, max 1), where without partial
    rollouts the bound's lag builds up to 2. The per-token versions reach the trainer's staleness metrics, and
    truncated importance sampling runs on the per-token behaviour log-probs. Two runs end with the same weights and
    log the same metrics (the versions come on a fixed schedule). Two recipe runs of 4 steps on 2 ranks."""
    args = ("offpolicy.max_staleness=2", "offpolicy.partial_rollouts=true", "offpolicy.partial_chunk_tokens=2")
    args += ("algo.rollout_is=token", "eval.every=2")
    a = _split_run(tmp_path / "a", data_dir, *args)
    rl = metrics(a)
    assert [r["step"] for r in rl] == [1, 2, 3, 4]
    assert [r["partial/weight_loads"] for r in rl] == [0.0, 1.0, 1.0, 1.0]
    assert [r["staleness/max"] for r in rl] == [0.0, 1.0, 1.0, 1.0]
    assert [r["staleness/min"] for r in rl] == [0.0, 0.0, 0.0, 0.0]
    for r in rl[1:]:  # the tokens after the first boundary are the trainer's version
        assert 0.0 < r["staleness/frac_1"] < 0.5 < r["staleness/frac_0"], r
        assert r["staleness/frac_0"] + r["staleness/frac_1"] == pytest.approx(1.0)
    assert rl[0]["staleness/frac_0"] == 1.0
    assert all(r["staleness/rejected"] == 0.0 for r in rl) and max(r["staleness/run_max"] for r in rl) <= 2.0
    assert "is_weight_mean" in json.dumps(rl[-1]) and rl[0]["grad_norm"] > 0
    # version 2 is taken at a boundary of batch 3: its evaluation runs there, in the middle of that generation
    assert ["val/mean@1" in r for r in rl] == [False, True, False, True]
    b = _split_run(tmp_path / "b", data_dir, *args)
    assert _same_weights(a, b)
    assert _untimed(a) == _untimed(b)


@pytest.mark.distributed
@pytest.mark.slow
def test_with_nothing_to_take_partial_rollouts_change_nothing(tmp_path, data_dir):
    """bounded with max_staleness=0: every batch starts with the trainer's own version, so no boundary takes
    anything, and the run with partial rollouts ends with the weights of the run without them, bit for bit (which
    test_offpolicy_recipe.py shows equal to sync). Two recipe runs of 3 steps on 2 ranks."""
    common = ("offpolicy.max_staleness=0", "offpolicy.partial_chunk_tokens=1")
    a = _split_run(tmp_path / "partial", data_dir, *common, "offpolicy.partial_rollouts=true", steps=3)
    b = _split_run(tmp_path / "whole", data_dir, *common, steps=3)
    assert _same_weights(a, b)
    assert [r["partial/weight_loads"] for r in metrics(a)] == [0.0, 0.0, 0.0]
    assert all(r["staleness/max"] == 0.0 for r in metrics(a))


def _config(*overrides: str):
    from experiments import grpo

    return apply_overrides(grpo.Config(), list(overrides), presets_dir=grpo.PRESETS, renamed=grpo.RENAMED_GRPO)


PARTIAL = ("offpolicy.mode=bounded", "offpolicy.rollout_ranks=1", "offpolicy.partial_rollouts=true")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("offpolicy.mode=one_step_off", "offpolicy.rollout_ranks=1", "offpolicy.partial_rollouts=true"), None),
        ((*PARTIAL, "rollout.engine=vllm"), "with rollout.engine=vllm: it samples each response under one set"),
        ((*PARTIAL, "rollout.engine=vllm_server"), "with rollout.engine=vllm_server: it samples each response"),
        ((*PARTIAL, "rollout.native.batching=lockstep"), "rollout.native.batching=lockstep cannot recompute"),
        ((*PARTIAL, "offpolicy.rollout_ranks=2"), "does not support offpolicy.rollout_ranks=2 (one rollout rank)"),
        ((*PARTIAL, "rollout.multi_turn.max_turns=2"), "does not support multi-turn rollouts"),
    ],
    ids=["one_step_off", "vllm", "vllm_server", "lockstep", "two-rollout-ranks", "multi-turn"],
)
def test_what_partial_rollouts_refuse_before_any_work(overrides, message):
    """Refused at config time (the mode when the overrides are read, the rest by the split loop's start-up check,
    before any model is built), each naming the setting. No process group, no model: milliseconds each."""
    if message is None:
        with pytest.raises(ConfigError, match="offpolicy.partial_rollouts=true needs offpolicy.mode=bounded"):
            _config(*overrides)
        return
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_offpolicy(_config(*overrides), world_size=4)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.faults
def test_a_stop_at_a_boundary_drops_the_generation_and_stops_every_rank_after_the_same_step(tmp_path, data_dir):
    """SIGTERM reaches the rollout rank as it starts sampling batch 3 (with version 1); at its first boundary it
    takes version 2 and joins the trainers' stop agreement there, mid-generation: the generation is dropped, and
    every rank stops after step 2 with nothing in flight; exit code 0. One recipe run on 2 ranks."""
    import os
    from unittest import mock

    args = ("offpolicy.max_staleness=2", "offpolicy.partial_rollouts=true", "offpolicy.partial_chunk_tokens=2")
    with mock.patch.dict(os.environ, {"RLFUNC_FAULT": "term:rank=1:step=3:phase=rollout"}):
        out = split_run(tmp_path, data_dir, "offpolicy.mode=bounded", *args, steps=5)
    assert out.returncode == 0, out.stderr[-4000:]
    assert [r["step"] for r in metrics(the_run_dir(tmp_path, "grpo"))] == [1, 2]
    assert "stopped after step 2" in out.stdout + out.stderr
    assert "0 batch(es) from rank 1 in flight, dropped" in out.stdout + out.stderr
