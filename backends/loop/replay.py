"""Run a recorded step again and compare it with the run: the same inputs give the same step, bit for bit, or the
first tensor that differs; with overrides, a what-if on the step's real batch (another loss, clip, estimator, KL
weight or learning rate) without sampling again.

    python -m backends.loop.replay runs/grpo-<time> --step 7                       # one-process runs
    torchrun --nproc_per_node 2 -m backends.loop.replay runs/grpo-<time> --step 7 algo.policy_loss=gspo
    python -m backends.loop.replay runs/grpo-A --step 7 --against runs/grpo-B actor.optim.lr=1e-4

The step must have been recorded (``debug.record_steps=[7]`` or ``debug.record_every=N``, see
:mod:`backends.loop.records`); the replay runs on as many ranks as the run did. It builds the recipe's roles from
the run's command line (plus the overrides), loads the recorded weights, optimizer state, RNG and algorithm state,
trains on the recorded batch with the recorded seeds through the loop's :class:`~backends.loop.learner.Learner`,
and compares every stage's fingerprints with the run's (``fingerprints/``), or with another run's (``--against``: do
this run's recorded inputs, under that run's settings, give that run's step?).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from backends.checkpoint.dcp import load_checkpoint
from backends.config import ConfigError, apply_overrides, resolve_function
from backends.distributed.setup import init_distributed, shutdown
from backends.loop.bisect import first_difference, read_fingerprints
from backends.loop.fingerprints import STAGES, gather_fingerprints
from backends.loop.learner import build_learner
from backends.loop.records import load_batch, read_record, record_dir
from backends.loop.rl_loop import num_mini_batches
from backends.loop.stages import RunData, RunPaths
from backends.training.engines import select_engine
from backends.training.optim import with_total_steps
from backends.training.roles import build_roles

__all__ = ["main", "replay_step", "stage_changes"]


def replay_step(run_dir: Path, step: int, overrides: list[str]) -> tuple[dict | None, dict]:
    """The recorded step run again (every rank): ``(the replayed fingerprints on rank 0 / None elsewhere, the run's
    config)``."""
    record = read_record(run_dir, step)
    recipe = recipe_module(record["recipe"]).RECIPE
    cfg = apply_overrides(
        recipe.config, [*record["argv"], *overrides], presets_dir=recipe.presets, renamed=recipe.renamed
    )
    algorithm = recipe.algorithm(cfg)
    env = init_distributed(timeout_s=cfg.deadlines.process_group or 1800.0)
    if env.world_size != record["world_size"]:
        raise ConfigError(
            f"step {step} of {run_dir} was recorded on {record['world_size']} rank(s); replay it on as "
            f"many (torchrun --nproc_per_node {record['world_size']}), not {env.world_size}"
        )
    engine = select_engine(cfg.actor.backend, fsdp=cfg.actor.fsdp, tp=cfg.actor.tp, pp=cfg.actor.pp)
    critic_engine = select_engine(cfg.actor.backend, fsdp=cfg.critic.fsdp, tp=cfg.actor.tp, pp=cfg.actor.pp)
    roles = build_roles(cfg.placement, env, engine, critic_engine)
    mini_batches = num_mini_batches(cfg, roles.pool_size("actor"))
    updates = record["total_steps"] * cfg.algo.ppo_epochs * mini_batches
    weights = record_dir(run_dir, step) / "weights" / f"step_{step - 1}"
    model_path = Path(cfg.model.path) if cfg.model.path else run_dir / "base_model"
    run = RunPaths(
        run_dir=run_dir,
        ckpt_dir=weights.parent,
        model_path=model_path,
        resume_from=weights,
        policy_path=run_dir / "sft_model" if cfg.sft.files else model_path,
        must_match={},
    )
    learner = build_learner(
        cfg,
        algorithm,
        roles,
        run,
        RunData(train=[], val=[], sft=[]),
        None,
        rl_optim=with_total_steps(cfg.actor.optim, updates),
        critic_optim=with_total_steps(cfg.critic.optim, updates),
        mini_batches=mini_batches,
        metrics_log=None,
        build_kwargs=cfg.actor.lora.build_kwargs(engine),
    )
    learner.fingerprints = None  # the replay compares, it does not append to the run's log
    states, extra = load_checkpoint(weights, learner.states())
    learner.load(states, extra["algorithm_state"])
    batch = load_batch(run_dir, step, env.rank) if roles.on_actor else None
    batch, metrics = learner.train(batch, step, seed=record["seeds"][env.rank], on_policy=record["on_policy"])
    replayed = None
    if batch is not None:
        replayed = gather_fingerprints(learner.fingerprint(batch, metrics), roles.env("actor").group)
    shutdown(env)
    return replayed, cfg


def recipe_module(ref: str) -> Any:
    """The recipe's module, a module name (``experiments.grpo``) or a recipe file's path, loaded by the config's
    reference resolver (through the recipe's ``main``)."""
    main = resolve_function(f"{ref}:main", {}, "the recorded recipe")
    return sys.modules[main.__module__]


def stage_changes(original: dict, replayed: dict) -> list[str]:
    """One line per stage: ``same``, or how many of its tensors differ and the first one's sums."""
    lines = []
    for stage in STAGES:
        a, b = original.get(stage, {}), replayed.get(stage, {})
        changed = [
            n for n in [*a, *(n for n in b if n not in a)] if a.get(n, {}).get("hash") != b.get(n, {}).get("hash")
        ]
        if not changed:
            lines.append(f"  {stage:<11} same ({len(a)} tensor(s))")
            continue
        first, fa, fb = changed[0], a.get(changed[0]), b.get(changed[0])
        size = f"sum {fa['sum']:.6g} -> {fb['sum']:.6g}" if fa and fb else "present in one side only"
        lines.append(
            f"  {stage:<11} differs in {len(changed)} of {len(set(a) | set(b))} tensor(s); first {first}: {size}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backends.loop.replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the run dir (runs/<name>-<time>)")
    parser.add_argument("--step", type=int, required=True, help="the recorded step to run again")
    parser.add_argument(
        "--against",
        type=Path,
        default=None,
        help="compare with this run's fingerprints of the step instead (with overrides: does this run's step "
        "come from the recorded inputs under the overridden settings?)",
    )
    parser.add_argument("overrides", nargs="*", help="key=value settings that replace the run's (a what-if)")
    args = parser.parse_intermixed_args(argv)  # --step may come between the run dir and the overrides
    replayed, _ = replay_step(args.run_dir, args.step, args.overrides)
    if replayed is None:  # not the first rank: rank 0 reports
        return 0
    against = args.against or args.run_dir
    original = read_fingerprints(against)[args.step]
    what = f"step {args.step} of {args.run_dir}" + (f" with {' '.join(args.overrides)}" if args.overrides else "")
    difference = first_difference({args.step: original}, {args.step: replayed})
    if args.overrides and args.against is None:
        print(f"replay of {what}, against the run:")
        print("\n".join(stage_changes(original, replayed)))
        return 0
    run = "the run" if args.against is None else f"the step of {against}"
    if difference is None:
        print(f"replay of {what}: identical to {run}, every stage and tensor bit for bit")
        return 0
    print(f"replay of {what}: differs from {run}; first difference: {difference.describe()}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
