"""Bit-identical runs and the bisection of two runs (``python -m backends.loop.bisect``).

Two runs with the same seed, world size and software log the same fingerprint of every step (samples, scores,
log-probs, advantages, losses, gradient norms, weights) in every mode of the loop tested here; three planted
differences are found by the bisection at the right step, stage and tensor. Each run is three steps of a one-layer
model on forked ranks (seconds).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backends.loop.bisect import first_difference, main, read_fingerprints
from backends.loop.fingerprints import fingerprint_tensors
from experiments.tasks import calculator
from tests.recipes import GRPO, PPO, TINY_MODEL, arithmetic_data, data_args, run, the_run_dir

pytestmark = pytest.mark.determinism

COMMON = [*TINY_MODEL, "steps=3", "prompts_per_step=2", "rollout.n=4", "eval.max_prompts=4", "eval.n=1"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return arithmetic_data(tmp_path_factory.mktemp("arithmetic"))


@pytest.fixture(scope="module")
def calculator_data(tmp_path_factory):
    task = calculator.CalculatorTask(num_train=64, num_heldout=8)
    return calculator.write_dataset(tmp_path_factory.mktemp("calculator"), task, sft_examples=64)


def _run(root, recipe, name, *args, nproc=1, environ=None):
    out = run(recipe, f"run_root={root}", *args, nproc=nproc, timeout=300, environ=environ)
    assert out.returncode == 0, out.stderr[-4000:]
    return the_run_dir(root, name)


def _twice(tmp_path, recipe, name, *args, nproc=1):
    return [_run(tmp_path / side, recipe, name, *args, nproc=nproc) for side in ("a", "b")]


def test_fingerprints_tell_bits_apart():
    import torch

    x = torch.tensor([1.0, 2.0, 3.0])
    same, swapped = fingerprint_tensors({"x": x.clone()}), fingerprint_tensors({"x": x[[1, 0, 2]]})
    assert fingerprint_tensors({"x": x}) == same and same["x"]["hash"] != swapped["x"]["hash"]
    nudged = fingerprint_tensors({"x": x + torch.tensor([0.0, 0.0, 1e-6])})
    assert nudged["x"]["hash"] != same["x"]["hash"] and nudged["x"]["absmax"] != 3.0
    assert fingerprint_tensors({"m": torch.tensor([True, False])})["m"]["sum"] == 1.0


def _reference_hash(x) -> str:
    """The documented hash, element by element: the tensor's bits as rows of up to 64 elements; the row sums (32-bit
    wrapping for elements of 4 bytes or fewer) weighted by their row, the column sums by their column, mod 2**64."""
    import torch

    flat = x.reshape(-1)
    width = flat.element_size()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
    bits = (flat.view(torch.uint8) if flat.dtype == torch.bool else flat.view(ints)).tolist()
    columns = next(c for c in (64, 32, 16, 8, 4, 2, 1) if len(bits) % c == 0)

    def wrap(v):
        return (v + 2**31) % 2**32 - 2**31 if width <= 4 else (v + 2**63) % 2**64 - 2**63

    rows = [wrap(sum(bits[r * columns : (r + 1) * columns])) for r in range(len(bits) // columns)]
    cols = [wrap(sum(bits[c::columns])) for c in range(columns)]
    by_row = sum(v * (r + 1) for r, v in enumerate(rows)) % 2**64
    by_col = sum(v * (c + 1) for c, v in enumerate(cols)) % 2**64
    return f"{by_row:016x}{by_col:016x}:{len(bits)}"


def test_fingerprints_follow_their_definition_alone_or_together():
    """Tensors are hashed in groups of one dtype; a tensor's hash is the documented one whatever else is hashed
    with it (of its dtype or another, before or after it)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    tensors = {
        "weights": torch.randn(96, 64, generator=gen) * 1e4,  # large values: the 32-bit row sums wrap
        "bias": torch.randn(7, generator=gen),
        "ids": torch.randint(0, 2**40, (3, 13), generator=gen),
        "mask": torch.rand(5, 3, generator=gen) > 0.5,
        "half": torch.randn(4, 6, generator=gen).bfloat16(),
        "wide": torch.randn(10, dtype=torch.float64, generator=gen),
        "empty": torch.empty(0, 4),
    }
    together = fingerprint_tensors(tensors)
    for name, x in tensors.items():
        assert together[name] == fingerprint_tensors({name: x})[name], name
        if x.numel():
            assert together[name]["hash"] == _reference_hash(x), name
    assert together["ids"]["sum"] == float(tensors["ids"].sum()) and together["mask"]["absmax"] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(("grpo", GRPO, 1, ["algo.kl_loss_coef=0.01"]), id="grpo-colocated"),
        pytest.param(
            ("grpo", GRPO, 2, ["algo.dynamic_sampling=true", "algo.max_sampling_rounds=2"]),
            id="grpo-2ranks-dynamic-sampling",
            marks=pytest.mark.distributed,
        ),
        pytest.param(("ppo", PPO, 1, ["algo.kl_ctrl=adaptive"]), id="ppo-colocated"),
        pytest.param(("grpo", GRPO, 1, ["rollout.engine=vllm"]), id="grpo-vllm-cpu", marks=pytest.mark.vllm),
        pytest.param(("grpo", GRPO, 1, ["actor.lora.rank=4", "actor.optim.lr=1e-3"]), id="grpo-lora"),
        pytest.param(
            ("grpo", GRPO, 2, ["offpolicy.rollout_ranks=1", "offpolicy.mode=one_step_off"]),
            id="grpo-one-step-off",
            marks=[pytest.mark.distributed, pytest.mark.offpolicy],
        ),
        pytest.param(
            ("ppo", PPO, 2, ["offpolicy.rollout_ranks=1", "offpolicy.mode=bounded", "offpolicy.max_staleness=2"]),
            id="ppo-bounded",
            marks=[pytest.mark.distributed, pytest.mark.offpolicy],
        ),
    ],
)
def test_two_runs_are_bit_identical(tmp_path, data_dir, mode):
    name, recipe, nproc, extra = mode
    a, b = _twice(tmp_path, recipe, name, *data_args(data_dir), *COMMON, *extra, nproc=nproc)
    fa, fb = read_fingerprints(a), read_fingerprints(b)
    assert sorted(fa) == [1, 2, 3] and all(fa[s]["weights"] and fa[s]["samples"] for s in fa)
    assert first_difference(fa, fb) is None
    assert main([str(a), str(b)]) == 0


@pytest.mark.slow
@pytest.mark.multiturn
def test_multi_turn_runs_with_tools_are_bit_identical(tmp_path, calculator_data):
    args = [
        *COMMON,
        f"data.train_files={calculator_data / 'train.jsonl'}",
        f"data.val_files={calculator_data / 'val.jsonl'}",
        "data.max_prompt_length=16",
        "reward.fn=arithmetic",
        "rollout.max_new_tokens=8",
        "rollout.multi_turn.max_turns=2",
        "rollout.multi_turn.max_total_tokens=40",
        "rollout.multi_turn.tools=[experiments.tasks.calculator:multiply]",
    ]
    a, b = _twice(tmp_path, GRPO, "grpo", *args)
    assert first_difference(read_fingerprints(a), read_fingerprints(b)) is None


PLANTED_REWARD = """
import os

CALLS = [0]


def score(response, ground_truth, **columns):
    CALLS[0] += 1
    planted = os.environ.get("PLANT_AT_CALL")
    return 0.5 if planted and CALLS[0] == int(planted) else float(len(response) % 2)
"""


@pytest.mark.slow
def test_bisect_names_the_step_stage_and_tensor_of_planted_differences(tmp_path, data_dir, capsys):
    """The issue's three planted differences, each found at its step, stage and tensor: a reward that scores one
    row of step 4 differently; a learning rate changed from step 7 on; another sampling seed from step 3. The
    changes are forks of one run (``fork_from``: its checkpoint, its logs up to there, any key changed), so
    each pair shares its history up to the change, as when a run is resumed with another setting."""
    reward = tmp_path / "reward.py"
    reward.write_text(PLANTED_REWARD)
    args = [
        *data_args(data_dir),
        *COMMON,
        f"reward.fn={reward}:score",
        "reward.workers=0",
        "eval.before_training=false",
        "checkpoint.every=2",
        "checkpoint.keep_last=4",
        "debug.record_steps=[7]",
    ]
    base = _run(tmp_path / "base", GRPO, "grpo", *args, "steps=7")
    checkpoints = base / "checkpoints"
    rows_per_step = 2 * 4  # prompts_per_step x rollout.n: the reward's calls per step, in row order
    planted = _run(  # from step 2: the fork's second step is step 4
        tmp_path / "reward",
        GRPO,
        "grpo",
        *args,
        "steps=4",
        f"fork_from={checkpoints / 'step_2'}",
        environ={"PLANT_AT_CALL": str(rows_per_step + 2)},
    )
    lr = _run(
        tmp_path / "lr", GRPO, "grpo", *args, "steps=7", "actor.optim.lr=3e-5", f"fork_from={checkpoints / 'step_6'}"
    )
    seed = _run(tmp_path / "seed", GRPO, "grpo", *args, "steps=3", "seed=1", f"fork_from={checkpoints / 'step_2'}")
    fp = read_fingerprints(base)
    found = {
        k: first_difference({s: fp[s] for s in read_fingerprints(d)}, read_fingerprints(d))
        for k, d in (("reward", planted), ("lr", lr), ("seed", seed))
    }
    assert (found["reward"].step, found["reward"].stage, found["reward"].tensor) == (4, "scores", "scores")
    assert found["reward"].b["sum"] != found["reward"].a["sum"]
    # the step-7 update is the first at the new rate: what it reads (samples ... gradient) is the same
    assert (found["lr"].step, found["lr"].stage, found["lr"].tensor) == (
        7,
        "weights",
        "actor.model.embed_tokens.weight",
    )
    assert (found["seed"].step, found["seed"].stage, found["seed"].tensor) == (3, "samples", "prompt_ids")
    assert main([str(base), str(lr)]) == 1
    report = capsys.readouterr().out.splitlines()
    assert report[0].startswith("first difference: step 7, stage weights, tensor actor.model.embed_tokens.weight: sum")
    # step 7 was recorded on both sides: each replays to its own run, and the first run's inputs under the second's
    # settings (its learning rate) give the second run's step: the cause is in step 7, not before it
    assert report[1] == f"replay of step 7 of {base}: identical to the run, every stage and tensor bit for bit"
    assert report[2] == f"replay of step 7 of {lr}: identical to the run, every stage and tensor bit for bit"
    assert report[3] == (
        f"replay of step 7 of {base} with actor.optim.lr=3e-05: identical to the step of {lr}, every stage "
        "and tensor bit for bit"
    )
    assert main([str(base), str(seed)]) == 1
    assert "(step 3 was not recorded in both runs" in capsys.readouterr().out
    summary = json.loads((lr / "summary.json").read_text())
    assert summary["steps"] == 7 and json.loads((lr / "config.json").read_text())["actor"]["optim"]["lr"] == 3e-5
    other_model = run(
        GRPO,
        f"run_root={tmp_path / 'x'}",
        *args,
        "model.tiny.num_layers=2",
        f"fork_from={checkpoints / 'step_2'}",
        timeout=300,
    )
    assert other_model.returncode != 0 and "model.tiny.num_layers: checkpoint 1, now 2" in other_model.stderr


REPLAY = Path(__file__).resolve().parents[1] / "backends" / "loop" / "replay.py"


def _replay(run_dir, step, *overrides, nproc=1) -> str:
    out = run(REPLAY, str(run_dir), "--step", str(step), *overrides, nproc=nproc, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


def _stages(report: str) -> dict[str, str]:
    """``{stage: "same" | "differs"}`` from a what-if replay's report."""
    return {line.split()[0]: line.split()[1] for line in report.splitlines() if line.startswith("  ")}


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe,name,nproc",
    [
        pytest.param(GRPO, "grpo", 1, id="grpo"),
        pytest.param(PPO, "ppo", 2, id="ppo-2ranks", marks=pytest.mark.distributed),
    ],
)
def test_a_recorded_step_replays_bit_for_bit_and_a_what_if_changes_what_it_should(
    tmp_path, data_dir, recipe, name, nproc
):
    reward = tmp_path / "reward.py"
    reward.write_text(PLANTED_REWARD)  # scores that differ within a group: advantages that are not all zero
    run_dir = _run(
        tmp_path,
        recipe,
        name,
        *data_args(data_dir),
        *COMMON,
        f"reward.fn={reward}:score",
        "reward.workers=0",
        "algo.kl_loss_coef=0.01",
        "debug.record_steps=[2]",
        nproc=nproc,
    )
    record = json.loads((run_dir / "records" / "step_2" / "record.json").read_text())
    assert record["world_size"] == nproc and len(record["seeds"]) == nproc
    assert not (run_dir / "records" / "step_1").exists() and not (run_dir / "records" / "step_3").exists()
    assert "identical to the run, every stage and tensor bit for bit" in _replay(run_dir, 2, nproc=nproc)
    entropy_bonus = _stages(_replay(run_dir, 2, "algo.entropy_coef=0.1", nproc=nproc))
    assert entropy_bonus == {
        "samples": "same",
        "scores": "same",
        "logprobs": "same",
        "advantages": "same",
        "loss": "differs",
        "gradient": "differs",
        "weights": "differs",
    }
    faster = _stages(_replay(run_dir, 2, "actor.optim.lr=0.1", nproc=nproc))
    assert [stage for stage, status in faster.items() if status == "differs"] == ["weights"]
    if name == "grpo":  # another estimator: the advantages and what follows, the log-probs untouched
        rloo = _stages(_replay(run_dir, 2, "algo.estimator=rloo"))
        assert rloo["logprobs"] == "same" and rloo["advantages"] == "differs" and rloo["weights"] == "differs"
