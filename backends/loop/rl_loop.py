"""The RL loop's entry: a recipe (:class:`Recipe`: its config, its algorithm) in, a trained run out.

:func:`run_recipe` reads the config (an unknown key or an old spelling fails here), builds the algorithm (an unknown
or ill-fitting estimator / loss fails here), checks the data, the reward functions, the engines and the placement,
all before any model is built; then it writes the run dir and runs the RL stage on the placement the config names:

- colocated (the default; :mod:`backends.loop.colocated`): every rank samples and trains, the step runs on every
  rank, with the critic and the reference on a pool of their own under ``placement.mode=split``;
- asynchronous (``offpolicy.rollout_ranks=R``; :mod:`backends.loop.split`): the last R ranks sample ahead on the
  ``offpolicy.mode`` schedule (``sync``, ``one_step_off``, ``bounded``) while the others train.

Both drive the same :class:`backends.loop.learner.Learner` (the training half of the step) and the same sampling
(:mod:`backends.loop.sampling`), so an algorithm gets every placement, multi-turn and dynamic sampling.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable

import attrs

from backends.config import ConfigError, apply_overrides, recipe_help
from backends.cpu import tune_process
from backends.data import PromptStream
from backends.distributed import watchdog
from backends.distributed.setup import get_logger, init_distributed, seed_everything, shutdown
from backends.loop.algorithm import Algorithm, max_context
from backends.loop.colocated import run_colocated
from backends.loop.records import StepRecorder
from backends.loop.split import check_offpolicy, run_split
from backends.loop.stages import (
    SHARED_REGISTRIES,
    commit_run,
    evaluate_policy,
    load_run_data,
    metrics_log,
    prepare_run,
    run_tokenizer,
    summarize,
    warn_once,
)
from backends.loop.vocabulary import RESUMABLE_KEYS, RLConfig
from backends.loop.weight_bridge import check_adapter_sync
from backends.rewards import RewardScorer
from backends.rollout.agents import AgentRunner, agent_runner
from backends.rollout.api import build_rollout, refuse_on_a_pool
from backends.rollout.environments import environment_factory
from backends.training.engines import TRAIN_ENGINES, select_engine
from backends.training.optim import with_total_steps
from backends.training.roles import build_roles

__all__ = ["Recipe", "RunContext", "run_recipe"]


@attrs.frozen
class Recipe:
    """What a recipe hands the loop."""

    name: str  #: the logger's and the watchdog's name
    doc: str  #: the recipe's docstring (--help)
    config: RLConfig  #: the defaults
    #: the algorithm of a config: resolves and checks its pieces (a ConfigError before any work)
    algorithm: Callable[[Any], Algorithm]
    presets: Path | None = None  #: the preset dir (preset=...)
    renamed: dict[str, str] = attrs.field(factory=dict)  #: old spellings -> their keys
    registries: Callable[[], dict] = dict  #: the built-in names of the recipe's keys, for --help
    console_keys: tuple[str, ...] = ("reward_mean", "success_rate", "grad_norm", "step_time_s")
    #: warnings about the config (on the first rank, once)
    warnings: Callable[[Any], list[str]] = lambda cfg: []


@attrs.frozen
class RunContext:
    """What the RL stage gets from the start-up: the checked config and everything built from it."""

    cfg: Any
    algorithm: Algorithm
    env: Any
    log: Any
    run: Any
    data: Any
    tokenizer: Any
    scorer: RewardScorer
    environments: Any  #: the multi-turn environment factory (None: single-turn)
    engine: Any  #: the actor's training engine
    critic_engine: Any
    build_kwargs: dict  #: the actor's extra build options (a LoRA adapter)
    steps: int
    rl_optim: Any
    critic_optim: Any
    mini_batches: int  #: optimizer steps per pass over a step's batch
    metrics_log: Any
    t_start: float
    recorder: StepRecorder  #: which steps to record (``debug.record_*``)


def run_recipe(recipe: Recipe, argv: list[str]) -> dict:
    """The whole run of ``recipe`` with the command line ``argv``; its summary (``{}`` for --help)."""
    tune_process()  # process-wide allocator / oneDNN settings: before any model is built
    if "--help" in argv or "-h" in argv:
        registries = {"actor.backend": tuple(TRAIN_ENGINES), **recipe.registries(), **SHARED_REGISTRIES}
        print(recipe_help(recipe.doc, recipe.config, presets_dir=recipe.presets, registries=registries))
        return {}
    # an unknown key, an old spelling, an unknown estimator / loss or one that does not fit fail here, before any work
    cfg = apply_overrides(recipe.config, argv, presets_dir=recipe.presets, renamed=recipe.renamed)
    algorithm = recipe.algorithm(cfg)
    scorer = RewardScorer(cfg.reward)  # ... and an unknown reward function
    environments = trajectory_source(cfg)
    engine = select_engine(cfg.actor.backend, fsdp=cfg.actor.fsdp, tp=cfg.actor.tp, pp=cfg.actor.pp)
    critic_engine = select_engine(cfg.actor.backend, fsdp=cfg.critic.fsdp, tp=cfg.actor.tp, pp=cfg.actor.pp)
    build_kwargs = cfg.actor.lora.build_kwargs(engine)
    # ... and rollout.vllm.lora_sync=adapter without a LoRA actor on an engine that takes adapters
    cfg = attrs.evolve(cfg, rollout=check_adapter_sync(cfg.rollout, cfg.actor.lora))
    check_placement(cfg, engine, algorithm)
    env = init_distributed(timeout_s=cfg.deadlines.process_group or 1800.0)
    log = get_logger(recipe.name, env)
    warn_once(log, recipe.warnings(cfg))
    watchdog.start(cfg.deadlines, env, role=recipe.name)  # deadlines per phase, and SIGTERM: stop at a step boundary
    seed_everything(cfg.seed)
    check_offpolicy(cfg, env.world_size)
    roles = None
    if cfg.offpolicy.rollout_ranks:  # the trainer ranks split the prompts; the split loop places their roles
        mini_batches = num_mini_batches(cfg, env.world_size - cfg.offpolicy.rollout_ranks)
    else:
        roles = build_roles(cfg.placement, env, engine, critic_engine)  # which ranks hold which roles
        mini_batches = num_mini_batches(cfg, roles.pool_size("actor"))
    run = prepare_run(cfg, env, RESUMABLE_KEYS)
    tokenizer = run_tokenizer(cfg, run)  # nothing of the run dir is written before the last check (commit_run)
    data = load_run_data(cfg, tokenizer, scorer, log, needs_train=cfg.steps != 0)  # bad data fails here
    if cfg.steps == 0:
        commit_run(cfg, env, run, tokenizer)
        return evaluate_only(cfg, run, data, tokenizer, scorer, env, environments, algorithm.title)
    steps = cfg.steps or cfg.epochs * PromptStream(data.train, seed=cfg.seed).steps_per_epoch(cfg.prompts_per_step)
    updates = steps * cfg.algo.ppo_epochs * mini_batches
    commit_run(cfg, env, run, tokenizer)  # every start-up check passed: the run dir is written from here on
    ctx = RunContext(
        cfg=cfg,
        algorithm=algorithm,
        env=env,
        log=log,
        run=run,
        data=data,
        tokenizer=tokenizer,
        scorer=scorer,
        environments=environments,
        engine=engine,
        critic_engine=critic_engine,
        build_kwargs=build_kwargs,
        steps=steps,
        rl_optim=with_total_steps(cfg.actor.optim, updates),
        critic_optim=with_total_steps(cfg.critic.optim, updates),
        mini_batches=mini_batches,
        metrics_log=metrics_log(cfg, run, env, recipe.console_keys),
        t_start=time.time(),
        recorder=StepRecorder(
            run_dir=run.run_dir,
            steps=cfg.debug.record_steps,
            every=cfg.debug.record_every,
            recipe=recipe_module_name(recipe),
            argv=tuple(argv),
            must_match=run.must_match,
            total_steps=steps,
        ),
    )
    summary = run_split(ctx) if cfg.offpolicy.rollout_ranks else run_colocated(ctx, roles)
    scorer.close()
    if isinstance(environments, AgentRunner):
        environments.close()
    shutdown(env)
    return summary


def trajectory_source(cfg: Any) -> Any:
    """What samples a multi-turn trajectory: the user's agents (``rollout.agent``, through an endpoint of this
    process's engine), the environment factory (``rollout.multi_turn.max_turns`` > 1), or None (single-turn).
    Resolved here, at start-up, so a bad reference fails before any work."""
    if cfg.rollout.agent:
        return agent_runner(
            cfg.rollout.agent,
            deadline_s=cfg.rollout.agent_deadline_s,
            workers=cfg.rollout.agent_workers,
            chat_template=cfg.data.chat_template,
        )
    return environment_factory(cfg.rollout.multi_turn) if cfg.rollout.multi_turn.max_turns > 1 else None


def recipe_module_name(recipe: Recipe) -> str:
    """Where the recipe lives, for a replay to find it again: its module's name, or its file's path when it runs as a
    script outside the repository's packages."""
    name = recipe.algorithm.__module__
    if name != "__main__":
        return name
    path = Path(sys.modules["__main__"].__file__).resolve()
    root = Path(__file__).resolve().parents[2]
    if path.is_relative_to(root):
        return ".".join(path.relative_to(root).with_suffix("").parts)
    return str(path)


def check_placement(cfg: Any, engine: Any, algorithm: Algorithm) -> None:
    """Settings that cannot work together (or with the actor's training ``engine``) fail here, on every rank,
    before any model is built."""
    split = cfg.placement.mode == "split"
    refused = {
        "placement.mode=split (its roles span every rank)": split and not engine.runs_on_a_pool,
        "export.orbax=true": cfg.export.orbax and not engine.exports_orbax,
        "reference.ref_in_actor=true (it needs a LoRA actor)": cfg.reference.ref_in_actor and not engine.trains_lora,
    }
    if any(refused.values()):
        raise ConfigError(
            f"actor.backend={cfg.actor.backend} does not take {', '.join(what for what, bad in refused.items() if bad)}"
        )
    if split and not algorithm.uses_critic:
        raise ConfigError(
            f"placement.mode=split puts the critic and the reference on a pool of their own; "
            f"{algorithm.title} has no critic: use placement.mode=colocated, or offpolicy.rollout_ranks "
            "for rollout ranks of their own"
        )
    if split:
        refuse_on_a_pool(
            cfg.rollout, "placement.mode=split", setting="placement.mode=split", colocated="placement.mode=colocated"
        )
    if split and cfg.reference.ref_in_actor:
        raise ConfigError(
            "reference.ref_in_actor=true needs the actor and the reference on the same ranks; under "
            "placement.mode=split the reference lives on the critic pool: use placement.mode=colocated or a separate "
            "reference"
        )


def num_mini_batches(cfg: Any, actor_ranks: int) -> int:
    """Optimizer steps per pass over a step's batch; the prompts are split over the actor's data-parallel ranks
    (megatron's TP / PP peers share rows)."""
    model_parallel = cfg.actor.tp * cfg.actor.pp
    if actor_ranks % model_parallel:
        raise ConfigError(f"actor.tp * actor.pp = {model_parallel} must divide the actor's {actor_ranks} rank(s)")
    world_size = actor_ranks // model_parallel
    if cfg.prompts_per_step % world_size:
        raise ConfigError(f"prompts_per_step={cfg.prompts_per_step} must be divisible by the world size {world_size}")
    size = cfg.algo.ppo_mini_batch_size or cfg.prompts_per_step
    if cfg.prompts_per_step % size or size % world_size:
        raise ConfigError(
            f"algo.ppo_mini_batch_size={size} must divide prompts_per_step={cfg.prompts_per_step} and be divisible "
            f"by the world size {world_size}"
        )
    return cfg.prompts_per_step // size


def evaluate_only(
    cfg: Any, run: Any, data: Any, tokenizer: Any, scorer: RewardScorer, env: Any, environments: Any, title: str
) -> dict:
    """``steps=0``: the starting policy's held-out metrics, and nothing else."""
    t0 = time.time()
    rollout = build_rollout(
        cfg.rollout, run.policy_path, tokenizer, seed=cfg.seed, device=env.device, max_context=max_context(cfg)
    )
    after = evaluate_policy(rollout, tokenizer, data, scorer, cfg, env, environments)
    summary = summarize(cfg, run, env, {}, after, steps=0, wall=time.time() - t0, title=title)
    scorer.close()
    rollout.shutdown()
    shutdown(env)
    return summary
