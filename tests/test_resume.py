"""Kill-and-resume exactness of the PPO (FSDP colocated and split, megatron TP) and GRPO (FSDP, megatron
PP and TP) recipes on 2 ranks (real processes and gloo groups, started by ``tests.recipes.start``).

For each recipe:
1. run it uninterrupted (it also saves checkpoints: saving consumes no randomness);
2. run it again, SIGKILL every rank as soon as step K's checkpoint is complete;
3. rerun with resume=auto: the per-step metrics of every step equal the uninterrupted run's.
Plus: an incompatible config and a missing checkpoint path fail clearly before any work.
"""

import json
import time
from pathlib import Path

import attrs
import pytest

from backends.loop.bisect import first_difference, read_fingerprints
from tests.recipes import GRPO, PPO, arithmetic_data, run, start

STEPS, KILL_AFTER = 6, 2
#: a tiny model, task and SFT stage on which some rewards are already 1, checkpointing every step ({data}: the
#: arithmetic files of the ``data_dir`` fixture)
COMMON = [
    f"steps={STEPS}",
    "sft.files={data}/sft.jsonl",
    "sft.steps=30",
    "sft.batch_size=32",
    "sft.optim.lr=1e-2",
    "data.train_files={data}/train.jsonl",
    "data.val_files={data}/val.jsonl",
    "data.max_prompt_length=16",
    "reward.fn=arithmetic",
    "prompts_per_step=4",
    "rollout.n=4",
    "rollout.max_new_tokens=6",
    "eval.n=1",
    "model.tiny.num_heads=2",
    "model.tiny.num_kv_heads=1",
    "model.tiny.hidden_size=64",
    "model.tiny.intermediate_size=96",
    "model.tiny.num_layers=1",
    "checkpoint.every=1",
    "checkpoint.keep_last=10",
]


def _with(args: list[str], *overrides: str) -> list[str]:
    """``args`` with the ``key=value`` entries of ``overrides`` replacing those of the same key (or added)."""
    keys = {o.split("=", 1)[0] for o in overrides}
    return [a for a in args if a.split("=", 1)[0] not in keys] + list(overrides)


@attrs.frozen
class Recipe:
    path: Path
    args: list
    logged: frozenset  #: metrics the comparison must cover (besides every other logged one)
    min_ranks: int = 1  #: 2 where the layout needs them (split placement, megatron TP / PP)
    #: the states a checkpoint holds: one per role, megatron one per tensor / pipeline shard
    states: tuple = ("actor", "critic")


RECIPES = {
    "ppo": Recipe(
        PPO,
        [
            *COMMON,
            "algo.ppo_mini_batch_size=2",
            "algo.critic_warmup=1",
            "algo.kl_ctrl=adaptive",
            "algo.target_kl=0.001",
            "algo.horizon=100",
            "algo.kl_loss_coef=0.001",
            "export.hf=false",
        ],
        frozenset({"reward_mean", "loss", "grad_norm", "critic/loss", "kl_coef", "kl_loss", "entropy"}),
    ),
    # the actor and the critic on megatron with 2 tensor-parallel ranks (one data-parallel replica)
    "ppo-megatron-tp2": Recipe(
        PPO,
        _with(
            [
                *COMMON,
                "algo.ppo_mini_batch_size=2",
                "algo.critic_warmup=1",
                "algo.kl_ctrl=adaptive",
                "algo.target_kl=0.001",
                "algo.horizon=100",
                "algo.kl_loss_coef=0.001",
                "export.hf=false",
            ],
            "model.tiny.num_kv_heads=2",
            "actor.backend=megatron",
            "actor.tp=2",
        ),
        frozenset({"reward_mean", "loss", "grad_norm", "critic/loss", "kl_coef", "kl_loss", "entropy"}),
        min_ranks=2,
        states=("actor.tp0.pp0", "actor.tp1.pp0", "critic.tp0.pp0", "critic.tp1.pp0"),
    ),
    # split placement: the actor on rank 0, the critic and the reference on rank 1, each pool saving and
    # loading its own roles (and the KL controller, which lives on the critic pool, kept exact)
    "ppo-split": Recipe(
        PPO,
        [
            *COMMON,
            "algo.ppo_mini_batch_size=2",
            "algo.critic_warmup=1",
            "algo.kl_ctrl=adaptive",
            "algo.target_kl=0.001",
            "algo.horizon=100",
            "algo.kl_loss_coef=0.001",
            "export.hf=false",
            "placement.mode=split",
        ],
        frozenset({"reward_mean", "loss", "grad_norm", "critic/loss", "kl_coef", "kl_loss", "entropy"}),
        min_ranks=2,
    ),
    # a KL term to the reference, and two optimizer steps per RL step (so the trainer's old log-probs are used)
    "grpo": Recipe(
        GRPO,
        [*COMMON, "algo.kl_loss_coef=0.01", "algo.ppo_mini_batch_size=2"],
        frozenset({"reward_mean", "loss", "grad_norm", "kl_loss", "entropy", "clip_frac"}),
        states=("actor",),
    ),
    # the actor (and the reference) on megatron, 2 pipeline stages (different tensors per rank) or 2
    # tensor-parallel ranks (the same names, different shards): each rank saves and loads its own shard
    **{
        f"grpo-megatron-{layout}": Recipe(
            GRPO,
            _with(
                [*COMMON, "algo.kl_loss_coef=0.01", "algo.ppo_mini_batch_size=2"],
                "model.tiny.num_layers=2",
                "model.tiny.num_kv_heads=2",
                "actor.backend=megatron",
                f"actor.{layout[:2]}=2",
            ),
            frozenset({"reward_mean", "loss", "grad_norm", "kl_loss", "entropy", "clip_frac"}),
            min_ranks=2,
            states=("actor.tp0.pp0", "actor.tp0.pp1") if layout == "pp2" else ("actor.tp0.pp0", "actor.tp1.pp0"),
        )
        for layout in ("pp2", "tp2")
    },
}
#: metrics that depend on the clock, not on the computation
TIMING = ("tokens_per_s", "step_time_s", "rollout_time_s", "update_time_s", "sync_time_s")

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.checkpoint]


def _args(recipe: Recipe, data_dir: Path) -> list[str]:
    return [a.replace("{data}", str(data_dir)) for a in recipe.args]


def _two_ranks(recipe: Recipe, data_dir: Path, *args: str, timeout: float = 600):
    return run(recipe.path, *_args(recipe, data_dir), *args, nproc=2, timeout=timeout)


def _direct(recipe: Recipe, data_dir: Path, *args: str):
    """The recipe in one process, or on 2 ranks where its layout needs 2."""
    return run(recipe.path, *_args(recipe, data_dir), *args, nproc=recipe.min_ranks, timeout=120)


def _rows(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] > 0 and "step_time_s" in r]  # the RL steps (not SFT, not evaluations)
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, STEPS + 1)), steps  # no step missing, none logged twice
    return {r["step"]: r for r in rows}


def _complete(ckpt_dir: Path, step: int) -> bool:
    return (ckpt_dir / f"step_{step}" / "COMPLETE").is_file()


@pytest.fixture(scope="module", params=sorted(RECIPES))
def recipe(request) -> Recipe:
    return RECIPES[request.param]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return arithmetic_data(
        tmp_path_factory.mktemp("arithmetic"),
        max_operand=4,
        max_second_operand=4,
        num_heldout=5,
        sft_examples=960,
        wrong_answer_fraction=0.0,
    )


@pytest.fixture(scope="module")
def uninterrupted(recipe, data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    out = _two_ranks(recipe, data_dir, f"run_dir={root / 'run'}", f"checkpoint.dir={root / 'ckpt'}")
    assert out.returncode == 0, out.stderr[-4000:]
    return root


def test_sigkill_and_resume_is_exact(recipe, data_dir, uninterrupted, tmp_path):
    run_dir, ckpt_dir = tmp_path / "run", tmp_path / "ckpt"
    job = start(recipe.path, *_args(recipe, data_dir), f"run_dir={run_dir}", f"checkpoint.dir={ckpt_dir}", nproc=2)
    deadline = time.time() + 300
    try:
        while not _complete(ckpt_dir, KILL_AFTER):
            assert job.poll() is None, (
                f"the run ended before step {KILL_AFTER}'s checkpoint: {job.output('err')[-4000:]}"
            )
            assert time.time() < deadline, "no checkpoint appeared in time"
            time.sleep(0.02)
    finally:
        job.kill()  # both ranks, mid-run, as a machine failure would
    # a kill mid-save leaves a step_<N>.tmp-<hex> dir: only step_<N> dirs with their marker count
    steps = [int(p.name[len("step_") :]) for p in ckpt_dir.glob("step_*") if p.name[len("step_") :].isdigit()]
    newest = max(step for step in steps if _complete(ckpt_dir, step))
    assert newest < STEPS and not (run_dir / "summary.json").exists(), "the run finished before it was killed"
    # every rank's part is in the checkpoint, under its own name (split: each pool's roles; megatron: each shard)
    marker = json.loads((ckpt_dir / f"step_{newest}" / "COMPLETE").read_text())
    assert sorted(marker["states"]) == sorted(recipe.states)

    # resume=auto: the run dir comes from the checkpoint, the metrics log is cut back to the checkpoint's step
    out = _two_ranks(recipe, data_dir, "resume=auto", f"checkpoint.dir={ckpt_dir}")
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"].endswith(f"step_{newest}")

    expected, resumed = _rows(uninterrupted / "run"), _rows(run_dir)
    worst, compared = 0.0, 0
    for step in range(1, STEPS + 1):
        a, b = expected[step], resumed[step]
        keys = sorted(k for k in a if k not in TIMING and not k.startswith("time/"))
        assert keys == sorted(k for k in b if k not in TIMING and not k.startswith("time/"))
        for k in keys:
            diff = abs(a[k] - b[k])
            worst = max(worst, diff)
            compared += 1
            assert diff <= 1e-6, f"step {step} {k}: uninterrupted {a[k]}, resumed {b[k]}"
    assert recipe.logged <= set(expected[STEPS]), recipe.logged - set(expected[STEPS])
    # bit for bit: every step's samples, scores, log-probs, advantages, losses and weights (the fingerprints the
    # crashed run logged after its checkpoint are cut back with the metrics)
    difference = first_difference(read_fingerprints(uninterrupted / "run"), read_fingerprints(run_dir))
    assert difference is None, difference.describe()
    assert any(expected[s]["reward_mean"] > 0 for s in expected)  # the comparison covers non-trivial rewards
    first = json.loads((uninterrupted / "run" / "summary.json").read_text())
    for key in ("eval_before", "eval_after", "before", "after"):
        assert summary[key] == first[key], key
    print(f"\nresumed from step {newest}: {compared} metric values compared, max |diff| = {worst:g}")


def test_resume_with_another_model_size_fails_before_any_work(recipe, data_dir, uninterrupted, tmp_path):
    ckpt = uninterrupted / "ckpt" / f"step_{KILL_AFTER}"
    out = _direct(recipe, data_dir, "model.tiny.hidden_size=128", f"resume={ckpt}", f"run_dir={tmp_path / 'run'}")
    assert out.returncode != 0
    assert "CheckpointMismatchError" in out.stderr and "different config" in out.stderr
    assert "model.tiny.hidden_size: checkpoint 64, now 128" in out.stderr
    assert not (tmp_path / "run").exists()


def test_resume_from_missing_path_fails_clearly(recipe, data_dir, tmp_path):
    missing = tmp_path / "nowhere" / "step_3"
    out = _direct(recipe, data_dir, f"resume={missing}", f"run_dir={tmp_path / 'run'}")
    assert out.returncode != 0
    assert f"checkpoint {str(missing)!r} does not exist" in out.stderr
    assert not (tmp_path / "run").exists()


def test_resume_auto_without_a_checkpoint_dir_fails_clearly(recipe, tmp_path):
    out = run(recipe.path, "resume=auto", "reward.fn=exact", f"run_root={tmp_path}", timeout=120)
    assert out.returncode != 0 and "resume=auto needs checkpoint.dir" in out.stderr
    assert not list(tmp_path.iterdir())
