"""GRPO (and the other group-relative estimators and policy losses of rlfunc) on your data, your reward, your model.

Run:  python experiments/grpo.py data.train_files=train.jsonl data.val_files=val.jsonl reward.fn=my_reward.py:score
      torchrun --standalone --nproc_per_node 2 experiments/grpo.py ...          (FSDP2 over 2 ranks)
      ... model.path=/path/to/hf_dir            a local Llama / Qwen2 checkpoint (default: a tiny random model)
      ... preset=demo/arithmetic                the demo (`make demo` writes its data first)
      --help lists every key with its default and meaning.

Data: JSONL, parquet or a saved datasets dir; ``data.prompt_key`` holds a string or chat messages (rendered by
the tokenizer's chat template), ``data.answer_key`` the ground truth, every other column reaches the reward.
Reward: ``reward.fn`` names built-ins (exact, arithmetic, gsm8k, boxed, math, format) or your own
``fn(response, ground_truth, **columns) -> float | dict`` as ``package.module:function`` / ``file.py:function``.
Algorithm pieces by name or reference, resolved at start-up (a misspelling fails before any work):
      ... algo.estimator=rloo algo.policy_loss=gspo algo.estimator=my_pkg.advantages:centered
Multi-turn / tools: ``rollout.multi_turn.max_turns=4 rollout.multi_turn.tools=[my_tools.py:search]``: each sample
is a trajectory of model turns and tool results; the reward reads the last model turn (BUILD.md, "Multi-turn").
DAPO: ``algo.dynamic_sampling=true``, ``reward.overlong_buffer_len=...``, ``algo.overlong_filter=true``,
``algo.policy_loss_args.ppo.clip_high=0.28``, ``algo.agg=token-mean``.
Each loss's own knobs: ``algo.policy_loss=kl_cov algo.policy_loss_args.kl_cov.kl_cov_ratio=0.001`` (--help lists them).
Checkpoints and exact resume: ``checkpoint.every=50`` then ``resume=auto`` (same run dir, same metrics).

Reads top to bottom: config -> data and reward (checked) -> model -> [SFT] -> held-out eval -> RL loop
[rollout + reward (dynamic sampling) -> log-probs -> advantages -> policy update -> weight sync -> log / eval /
checkpoint] -> held-out eval -> HF export -> summary.
"""

from __future__ import annotations

import functools
import inspect
import sys
import time
from pathlib import Path
from typing import Any, Callable, Literal

import attrs
import torch

import rlfunc as rf
from backends.checkpoint.dcp import load_checkpoint, save_checkpoint
from backends.config import ConfigError, apply_overrides, recipe_help, resolve_function
from backends.cpu import tune_process
from backends.data import PromptStream
from backends.distributed import watchdog
from backends.distributed.collectives import all_reduce_max, all_reduce_sum, mean_over_ranks
from backends.distributed.setup import get_logger, init_distributed, seed_everything, shutdown
from backends.rewards import RewardScorer
from backends.rollout.agent_loop import sample
from backends.loop.weight_bridge import check_adapter_sync, logprob_gap, weight_bridge
from backends.rollout.api import build_rollout
from backends.rollout.common import answer_texts
from backends.rollout.environments import environment_factory
from backends.training.engines import TRAIN_ENGINES, registered_engine, select_engine
from backends.training.fsdp import FSDPConfig
from backends.training.lora import LoraConfig
from backends.training.optim import OptimConfig, with_total_steps
from backends.training.reward_model import RewardModelConfig, build_reward_model, combine_rewards
from backends.training.reference import ReferenceConfig
from backends.training.reward_model import score as reward_model_score
from experiments.actor_loss import loss_seed, make_actor_loss
from experiments.algorithm_checks import check_estimator, check_policy_loss, group_size_warnings
from experiments.dynamic_sampling import GroupFiller, any_short, round_seed, rounds_metrics
from experiments.offpolicy_loop import OffPolicyConfig, RecipeParts, check_offpolicy, run_split, stamp_policy_version
from experiments.vocabulary import (
    RENAMED_GRPO, EstimatorArgs, PolicyLossArgs, PolicyUpdateConfig, PPOArgs, RunConfig, estimator_knobs,
)
from experiments.stages import (
    SHARED_REGISTRIES, checkpoint_or_stop, commit_run, dump_generations, evaluate_policy, export_final, load_run_data,
    metrics_log, prepare_run, run_tokenizer, start_actor, summarize, warn_once,
)

PRESETS = Path(__file__).resolve().parent / "presets"


@attrs.frozen
class AlgoConfig(PolicyUpdateConfig):
    """The policy update's keys (experiments/vocabulary.py, shared with the other recipes) and GRPO's own."""

    #: an outcome estimator over groups (a built-in of rlfunc.ADVANTAGE_ESTIMATORS that takes group_ids; --help lists
    #: them) or a reference package.module:function / path/to/file.py:function (BUILD.md, "Your own estimator or loss")
    estimator: str = "grpo"
    estimator_args: EstimatorArgs = EstimatorArgs()  #: each built-in estimator's own knobs
    mini_batches: int = attrs.field(default=1, validator=attrs.validators.ge(1))  #: optimizer steps per pass
    #: rejection (masked importance sampling): tokens (token) or whole responses (sequence, geometric) whose trainer /
    #: rollout ratio lies outside [1 / rollout_rs_threshold, rollout_rs_threshold] leave the loss and its normalisers
    rollout_rs: Literal["none", "token", "sequence", "geometric"] = "none"
    rollout_rs_threshold: float = attrs.field(default=2.0, validator=attrs.validators.gt(1.0))  #: the rejection bound
    #: > 0 (with rollout_rs): a response with a token ratio below it leaves the loss
    rollout_token_veto: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    #: rows whose advantages are all 0 get no forward / backward (they still count in the normalisers, so the
    #: gradient is unchanged); applied only where exact: an advantage-proportional built-in loss, no KL / entropy
    skip_zero_advantage: bool = True
    #: DAPO: keep only groups whose samples got different scores, drawing more prompts until the batch is full
    dynamic_sampling: bool = False
    #: dynamic sampling's generation rounds per step at most (then the batch fills up with what was drawn)
    max_sampling_rounds: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    overlong_filter: bool = False  #: DAPO: responses cut off by rollout.max_new_tokens carry no loss


#: GRPO's clip above 1 defaults to DAPO's clip-higher for the PPO-family losses
GRPO_LOSS_ARGS = PolicyLossArgs(ppo=PPOArgs(clip_high=0.28))


@attrs.frozen
class ActorConfig:
    optim: OptimConfig = OptimConfig(lr=1e-6, weight_decay=0.0, clip_grad=1.0, lr_warmup_steps=0)  #: the RL optimizer
    fsdp: FSDPConfig = FSDPConfig(micro_batch_size=16)  #: sharding, micro-batches, precision (the reference uses it too)
    #: fsdp (data parallel) or megatron (tensor / pipeline parallel: actor.tp, actor.pp)
    backend: str = attrs.field(default="fsdp", validator=registered_engine)
    tp: int = 1  #: megatron tensor-parallel size
    pp: int = 1  #: megatron pipeline-parallel size
    lora: LoraConfig = LoraConfig()  #: train a LoRA adapter instead of every weight (actor.lora.rank > 0)


@attrs.frozen
class Config(RunConfig):
    name: str = "grpo"  #: the run's name (the run dir is <run_root>/<name>-<time>)
    export_hf: bool = True  #: write the trained actor as an HF dir (runs/<run>/final_model) at the end
    reward_model: RewardModelConfig = RewardModelConfig()  #: an optional learned reward, added to the reward functions' score
    actor: ActorConfig = ActorConfig()  #: the trained policy
    #: the frozen reference of the KL loss (algo.kl_loss_coef > 0), built by the actor's engine: only its
    #: log_prob_micro_batch_size applies here (the other keys are the PPO recipe's reference roles)
    reference: ReferenceConfig = ReferenceConfig(log_prob_micro_batch_size=64)
    algo: AlgoConfig = AlgoConfig(policy_loss_args=GRPO_LOSS_ARGS)  #: the algorithm
    #: asynchronous RL on a split placement: rollout ranks sample ahead while the trainer ranks update
    offpolicy: OffPolicyConfig = OffPolicyConfig()


#: keys that may differ between a run and its resumption (where things go and how they are logged)
RESUMABLE_KEYS = ("resume", "run_dir", "run_root", "checkpoint", "deadlines", "eval", "logger", "log_every",
                  "dump_generations_every")
CONSOLE_KEYS = ("reward_mean", "success_rate", "multi_turn/turns", "multi_turn/tool_call_validity", "kl_loss",
                "entropy",
                "clip_frac",
                "grad_norm", "response_length", "step_time_s")


def main(argv: list[str]) -> dict:
    tune_process()  # process-wide allocator / oneDNN settings: before any model is built
    if "--help" in argv or "-h" in argv:
        print(recipe_help(__doc__, Config(), presets_dir=PRESETS, registries=help_registries()))
        return {}
    # an unknown key, or an old spelling (experiments/vocabulary.py), fails here, before any work
    cfg = apply_overrides(Config(), argv, presets_dir=PRESETS, renamed=RENAMED_GRPO)
    check_reference(cfg.reference)
    estimator, estimator_kwargs, policy_loss = resolve_algorithm(cfg.algo)  # so does an unknown estimator / loss
    check_algorithm(cfg, estimator, estimator_kwargs, policy_loss)  # ... and one whose signature does not fit
    scorer = RewardScorer(cfg.reward)  # ... and an unknown reward function
    environments = environment_factory(cfg.rollout.multi_turn) if cfg.rollout.multi_turn.max_turns > 1 else None  # ... or tool
    engine = select_engine(cfg.actor.backend, fsdp=cfg.actor.fsdp, tp=cfg.actor.tp, pp=cfg.actor.pp)
    build_kwargs = cfg.actor.lora.build_kwargs(engine)
    # ... and rollout.vllm.lora_sync=adapter without a LoRA actor on an engine that takes adapters
    cfg = attrs.evolve(cfg, rollout=check_adapter_sync(cfg.rollout, cfg.actor.lora))
    env = init_distributed(timeout_s=cfg.deadlines.process_group or 1800.0)
    log = get_logger("grpo", env)
    warn_once(log, group_size_warnings(cfg.rollout.n, key="algo.estimator", spec=cfg.algo.estimator))
    watchdog.start(cfg.deadlines, env, role="grpo")  # deadlines per phase, and SIGTERM: stop at a step boundary
    seed_everything(cfg.seed)
    check_offpolicy(cfg, env.world_size, refused={
        "reward_model.shard=true (the rollout ranks hold a replicated reward model)": bool(cfg.reward_model.path)
        and cfg.reward_model.shard,
        "rollout.vllm.lora_sync=adapter (the pool receives merged weights)": cfg.rollout.vllm.lora_sync == "adapter",
    })
    check_batch_shape(cfg, env.world_size - cfg.offpolicy.rollout_ranks)  # the trainer ranks split the prompts
    run = prepare_run(cfg, env, RESUMABLE_KEYS)
    tokenizer = run_tokenizer(cfg, run)  # nothing of the run dir is written before the last check (commit_run)
    data = load_run_data(cfg, tokenizer, scorer, log, needs_train=cfg.steps != 0)  # bad data fails here, before any model
    if cfg.steps == 0:
        commit_run(cfg, env, run, tokenizer)
        return evaluate_only(cfg, run, data, tokenizer, scorer, env, environments)
    steps = cfg.steps or cfg.epochs * PromptStream(data.train, seed=cfg.seed).steps_per_epoch(cfg.prompts_per_step)
    rl_optim = with_total_steps(cfg.actor.optim, steps * cfg.algo.ppo_epochs * cfg.algo.mini_batches)
    commit_run(cfg, env, run, tokenizer)  # every start-up check passed: the run dir is written from here on
    mlog = metrics_log(cfg, run, env, CONSOLE_KEYS)
    t_start = time.time()
    if cfg.offpolicy.rollout_ranks:  # split placement: the rollout pool samples ahead while the trainer pool updates
        parts = RecipeParts(score_batch=score_batch, max_context=max_context(cfg), estimator=estimator,
                            estimator_kwargs=estimator_kwargs, dynamic_sampling=cfg.algo.dynamic_sampling,
                            max_sampling_rounds=cfg.algo.max_sampling_rounds, reward_model=cfg.reward_model)
        make_trainer = functools.partial(build_policy_trainer, cfg, engine, run, data, tokenizer, rl_optim, mlog,
                                         build_kwargs, estimator, estimator_kwargs, policy_loss)
        summary = run_split(cfg, env, log, run, data, tokenizer, scorer, environments, steps, mlog, parts, make_trainer,
                            t_start)
        scorer.close()
        shutdown(env)
        return summary

    actor = start_actor(cfg, engine, env, run, data, tokenizer, rl_optim, mlog, build_kwargs=build_kwargs)
    ckpt_name = engine.checkpoint_name(actor, "actor") if cfg.checkpoint.every or run.resume_from else "actor"
    reward_model = build_reward_model(cfg.reward_model.path, env, cfg.reward_model) if cfg.reward_model.path else None
    reference = None
    if cfg.algo.kl_loss_coef > 0:
        reference = engine.build_reference(run.policy_path, env,
                                           log_prob_micro_batch_size=cfg.reference.log_prob_micro_batch_size)
    # last: a GPU rollout engine takes its share of the memory the trainer's roles left free
    rollout = build_rollout(cfg.rollout, run.policy_path, tokenizer, seed=cfg.seed, device=env.device,
                            max_context=max_context(cfg))
    bridge = weight_bridge(cfg.rollout, cfg.actor.lora)  # how the weights reach it: dtype, buckets, full or adapter
    stream = PromptStream(data.train, seed=cfg.seed, shuffle=cfg.data.shuffle)
    first_step, wall_before, before, last_eval = 1, 0.0, {}, {}
    if run.resume_from is None:
        with watchdog.phase("eval", step=0):
            before = evaluate_policy(rollout, tokenizer, data, scorer, cfg, env, environments) if cfg.eval.before_training else {}
        mlog.log(0, before)
    else:  # the actor's weights, AdamW state and step, every rank's RNG, and what the loop carries
        with watchdog.phase("checkpoint", op=f"load_checkpoint({run.resume_from})"):
            states, extra = load_checkpoint(run.resume_from, {ckpt_name: actor}, config=run.must_match)
        actor, first_step, before, wall_before = states[ckpt_name], extra["step"] + 1, extra["eval_before"], extra["wall_seconds"]
        stream = PromptStream(data.train, seed=cfg.seed, shuffle=cfg.data.shuffle, drawn=extra["drawn"])
        with watchdog.phase("weight_sync", step=extra["step"]):
            rollout = bridge.sync(rollout, engine, actor, version=extra["step"])

    def save(step: int) -> None:  # the actor sharded with AdamW, RNG, the data position, what the loop carries
        extra = {"step": step, "drawn": stream.drawn, "run_dir": str(run.run_dir), "eval_before": before,
                 "wall_seconds": wall_before + time.time() - t_start}
        with watchdog.phase("checkpoint", step=step, op=f"save_checkpoint({run.ckpt_dir}/step_{step})"):
            save_checkpoint(run.ckpt_dir, step, {ckpt_name: actor}, extra, keep_last=cfg.checkpoint.keep_last, config=run.must_match)

    def rescue(step: int) -> None:  # the weights of a failed export, as a checkpoint (under the engine's own names)
        nonlocal ckpt_name
        ckpt_name = engine.checkpoint_name(actor, "actor")
        save(step)

    actor_loss = make_actor_loss(policy_loss, cfg.algo, horizon=response_horizon(cfg))
    skip_zero_rows = zero_advantage_rows_are_skippable(cfg.algo, policy_loss)
    # the rollout's log-probs are the old ones where both engines compute the same numbers; else recomputed
    on_policy = rollout_logprobs_suffice(cfg.algo, policy_loss) and bridge.logprobs_agree(engine, actor, rollout)
    preempted_at = None
    for step in range(first_step, steps + 1):
        t0 = time.time()
        # 1. rollout and reward: n samples for this rank's share of the prompts (dynamic sampling draws more)
        with watchdog.phase("rollout", step=step):
            batch, rows, sample_stats = sample_and_score(rollout, stream, scorer, tokenizer, cfg, step, engine, actor,
                                                         reward_model, environments)
            rollout = rollout.release_memory()  # a GPU engine frees its memory for the update until the sync
        t_rollout = time.time() - t0
        with watchdog.phase("update", step=step, op="log-probs (the policy's and the reference's forwards)"):
            # 2. log-probs of the sampled tokens under the current policy (and the reference)
            batch = batch.replace(old_logprobs=batch.rollout_logprobs if on_policy else engine.compute_logprobs(actor, batch).logprobs)
            if reference is not None:
                batch = batch.replace(ref_logprobs=engine.compute_logprobs(reference, batch).logprobs)
            batch, rejected = reject_mismatched_tokens(batch, cfg.algo)
            batch, provenance = stamp_policy_version(batch, step - 1)  # synchronous: sampled by the weights being updated
            # 3. group-relative advantages (pure rlfunc; all n samples of a prompt live on one rank)
            adv, ret = estimator(batch.scores, group_ids=batch.group_ids, response_mask=rf.loss_tokens(batch), **estimator_kwargs)
            batch = batch.replace(advantages=adv, returns=ret)
            skip = rf.zero_advantage_rows(adv, mask=rf.loss_tokens(batch)) if skip_zero_rows else None
            # 4. policy update(s): ppo_epochs x mini_batches optimizer steps (a random loss draws with the step's seed)
            replica = engine.data_parallel(actor)[0]
            loss_fn = functools.partial(actor_loss, seed=loss_seed(cfg.seed, step, replica=replica))
            t_update = time.time()
            watchdog.waiting_on("engine.update (forward, backward, optimizer step)")
            for _ in range(cfg.algo.ppo_epochs):
                for mini_batch, mini_skip in zip(rf.split(batch, cfg.algo.mini_batches), split_rows(skip, cfg.algo.mini_batches)):
                    actor, metrics = engine.update(actor, mini_batch, loss_fn, with_entropy=True, skip_rows=mini_skip)
        # 5. weight sync: full tensors from the FSDP / megatron shards into the rollout engine (or the LoRA adapter alone)
        t_sync = time.time()
        with watchdog.phase("weight_sync", step=step):
            rollout = bridge.sync(rollout, engine, actor, version=step)
        times = {"step_time_s": time.time() - t0, "rollout_time_s": t_rollout, "update_time_s": t_sync - t_update,
                 "sync_time_s": time.time() - t_sync}

        # 6. log, evaluate, dump generations, checkpoint
        stats = {**sample_stats, **step_stats(batch, skip, times, engine.data_parallel(actor)[1]), **metrics,
                 **logprob_gap(batch, on_policy), **device_memory(env),
                 **{k: float(v) for k, v in {**rejected, **provenance}.items()}}
        if cfg.eval.every and step % cfg.eval.every == 0:
            with watchdog.phase("eval", step=step):
                last_eval = {"step": step, **evaluate_policy(rollout, tokenizer, data, scorer, cfg, env, environments)}
            stats.update({k: v for k, v in last_eval.items() if k != "step"})
        mlog.log(step, stats)
        if cfg.dump_generations_every and step % cfg.dump_generations_every == 0:
            dump_generations(run, step, tokenizer, batch, rows)
        if checkpoint_or_stop(step, steps, cfg, run, save, log):  # SIGTERM on any rank: all stop here, checkpointed
            preempted_at = step
            break

    if preempted_at is not None:  # exit code 0, no final evaluation / export: resume=auto continues from here
        summary = {"preempted_at_step": preempted_at, "run_dir": str(run.run_dir)}
    else:
        if last_eval.get("step") == steps:  # the last step's evaluation is the final one
            after = {k: v for k, v in last_eval.items() if k != "step"}
        else:
            with watchdog.phase("eval", step=steps):
                after = evaluate_policy(rollout, tokenizer, data, scorer, cfg, env, environments)
            mlog.log(steps, after)
        if cfg.export_hf:
            with watchdog.phase("checkpoint", step=steps, op="export_hf(final_model)"):
                export_final(lambda: engine.export_hf(actor, run.run_dir / "final_model", tokenizer=tokenizer,
                                                      overwrite=True), run, steps, save=rescue)
        summary = summarize(cfg, run, env, before, after, steps=steps, wall=wall_before + time.time() - t_start, title="GRPO")
    mlog.close()
    scorer.close()
    rollout.shutdown()
    shutdown(env)
    return summary


# ---------------------------------------------------------------------------------------------------
# Set-up checks.


def group_estimators() -> tuple[dict[str, Callable], dict[str, str]]:
    """The built-in estimators that fit the loop, outcome estimators over groups of samples (not gae, reinforce_pp,
    remax), and their aliases."""
    estimators = {name: fn for name, fn in rf.ADVANTAGE_ESTIMATORS.items()
                  if "group_ids" in inspect.signature(fn).parameters}
    return estimators, {alias: name for alias, name in rf.ADVANTAGE_ESTIMATOR_ALIASES.items() if name in estimators}


def help_registries() -> dict[str, tuple[str, ...]]:
    """The names of the keys that take a built-in, for --help."""
    estimators, aliases = group_estimators()
    return {"algo.estimator": (*estimators, *(f"{alias}={name}" for alias, name in aliases.items())),
            "algo.policy_loss": tuple(rf.POLICY_LOSSES), "algo.agg": tuple(rf.AGG_MODES),
            "algo.kl_loss_kind": rf.KL_KINDS,
            "actor.backend": tuple(TRAIN_ENGINES), **SHARED_REGISTRIES}


def resolve_algorithm(algo: AlgoConfig) -> tuple[Callable, dict[str, Any], Callable]:
    """``(estimator, its extra keyword arguments, policy loss)`` from their config names or references."""
    estimators, aliases = group_estimators()
    estimator = resolve_function(algo.estimator, estimators, "algo.estimator", aliases=aliases)
    loss_aliases = {name.replace("_", "-"): name for name in rf.POLICY_LOSSES if "_" in name}  # clip-cov = clip_cov
    policy_loss = resolve_function(algo.policy_loss, rf.POLICY_LOSSES, "algo.policy_loss", aliases=loss_aliases)
    estimator_kwargs = estimator_knobs(algo.estimator_args, algo.estimator)
    try:  # every engine records the behaviour (rollout) log-probs; the trainer supplies proximal and current ones
        rf.check_logprobs_supplied(policy_loss, available=("current", "proximal", "behaviour"))
    except ValueError as e:
        raise ConfigError(f"algo.policy_loss={algo.policy_loss!r}: {e}") from None
    return estimator, estimator_kwargs, policy_loss


def check_algorithm(cfg: Config, estimator: Callable, estimator_kwargs: dict[str, Any], policy_loss: Callable) -> None:
    """The estimator and the policy loss called once as the loop calls them, on a synthetic batch with groups of
    ``rollout.n`` (experiments/algorithm_checks.py): a function that does not fit fails here, before any work."""
    check_estimator(estimator, estimator_kwargs, key="algo.estimator", spec=cfg.algo.estimator,
                    group_size=cfg.rollout.n)
    # the synthetic batch has no reference log-probs: the KL term is the recipe's, checked by its own tests
    algo = attrs.evolve(cfg.algo, kl_loss_coef=0.0)
    loss_fn = functools.partial(make_actor_loss(policy_loss, algo, horizon=response_horizon(cfg)), seed=0)
    check_policy_loss(loss_fn, key="algo.policy_loss", spec=cfg.algo.policy_loss)


def check_reference(reference: ReferenceConfig) -> None:
    """GRPO's reference is built by the actor's engine: of the ``reference`` keys only the log-prob micro-batch
    size applies; another one set is refused rather than ignored."""
    default = ReferenceConfig(log_prob_micro_batch_size=reference.log_prob_micro_batch_size)
    changed = [f.name for f in attrs.fields(ReferenceConfig) if getattr(reference, f.name) != getattr(default, f.name)]
    if changed:
        raise ConfigError(f"reference.{', reference.'.join(changed)}: the GRPO recipe builds its reference with the "
                          "actor's engine (actor.backend) and reads only reference.log_prob_micro_batch_size; the "
                          "reference roles' other keys are the PPO recipe's (experiments/ppo.py)")


def check_batch_shape(cfg: Config, world_size: int) -> None:
    if cfg.prompts_per_step % world_size:
        raise ConfigError(f"prompts_per_step={cfg.prompts_per_step} must be divisible by the world size {world_size}")
    if cfg.algo.mini_batches > cfg.prompts_per_step * cfg.rollout.n // world_size:
        raise ConfigError(f"algo.mini_batches={cfg.algo.mini_batches} is more than the rows a rank has per step")


def zero_advantage_rows_are_skippable(algo: AlgoConfig, policy_loss: Callable) -> bool:
    """Whether zero-advantage rows add exactly nothing to the loss and its gradient: a built-in policy loss
    whose per-token term is a multiple of the advantage, and no KL or entropy term."""
    proportional = {rf.POLICY_LOSSES[name] for name in rf.ADVANTAGE_PROPORTIONAL_LOSSES}
    return (algo.skip_zero_advantage and policy_loss in proportional and algo.kl_loss_coef == 0
            and algo.entropy_coef == 0)


def rollout_logprobs_suffice(algo: AlgoConfig, policy_loss: Callable) -> bool:
    """Whether the algorithm may take the rollout's log-probs as the old ones (where the weight bridge finds that both
    engines compute the same numbers): one update per batch and no trainer / rollout correction, which needs both."""
    corrections = algo.rollout_is != "none" or algo.rollout_rs != "none" or reads_behaviour_logprobs(policy_loss)
    return algo.ppo_epochs == 1 and algo.mini_batches == 1 and not corrections


def reads_behaviour_logprobs(policy_loss: Callable) -> bool:
    """Whether the loss reads the sampler's log-probs besides the trainer's (decoupled PPO), by its declared needs."""
    try:
        rf.check_logprobs_supplied(policy_loss, available=("current", "proximal"))
    except ValueError:
        return True
    return False


def reject_mismatched_tokens(batch: rf.RolloutBatch, algo: AlgoConfig) -> tuple[rf.RolloutBatch, dict[str, torch.Tensor]]:
    """``algo.rollout_rs``: the loss mask without the tokens (or responses) whose trainer / rollout ratio is out of
    bounds, before the update, so that the normalisers count only what stays."""
    if algo.rollout_rs == "none":
        return batch, {}
    keep, metrics = rf.rollout_rejection_mask(
        batch.old_logprobs, rollout_logprobs=batch.rollout_logprobs, response_mask=rf.loss_tokens(batch),
        level=algo.rollout_rs, upper=algo.rollout_rs_threshold, token_veto=algo.rollout_token_veto or None,
    )
    return batch.replace(loss_mask=keep), metrics


def max_context(cfg: Config) -> int:
    """The longest sequence the rollout engine holds: a prompt and its response, or a whole trajectory."""
    single = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    return single if cfg.rollout.multi_turn.max_turns == 1 else cfg.rollout.multi_turn.max_total_tokens


def response_horizon(cfg: Config) -> int:
    """The most response tokens a row can have (the constant of the seq-mean-token-sum-norm aggregation)."""
    return cfg.rollout.max_new_tokens if cfg.rollout.multi_turn.max_turns == 1 else cfg.rollout.multi_turn.max_total_tokens


def evaluate_only(cfg: Config, run: Any, data: Any, tokenizer: Any, scorer: RewardScorer, env: Any, environments: Any) -> dict:
    """``steps=0``: the starting policy's held-out metrics, and nothing else."""
    t0 = time.time()
    rollout = build_rollout(cfg.rollout, run.policy_path, tokenizer, seed=cfg.seed, device=env.device,
                            max_context=max_context(cfg))
    after = evaluate_policy(rollout, tokenizer, data, scorer, cfg, env, environments)
    summary = summarize(cfg, run, env, {}, after, steps=0, wall=time.time() - t0, title="GRPO")
    scorer.close()
    rollout.shutdown()
    shutdown(env)
    return summary


# ---------------------------------------------------------------------------------------------------
# Sampling: rollout, reward, DAPO's dynamic sampling and overlong shaping.


def sample_and_score(rollout: Any, stream: PromptStream, scorer: RewardScorer, tokenizer: Any, cfg: Config, step: int,
                     engine: Any, actor: Any, reward_model: Any = None,
                     environments: Any = None) -> tuple[rf.RolloutBatch, list, dict[str, float]]:
    """This rank's scored batch for ``step``, the example of each row, and sampling metrics (with
    ``environments``, multi-turn trajectories and their metrics).

    Every round draws ``prompts_per_step`` prompts; each rank samples and scores its shard of them (megatron's
    tensor / pipeline peers each one shard of their replica's prompts, gathered after: ``Engine.sample_shard``).
    With dynamic sampling, only groups whose scores differ are kept, and rounds continue until every replica holds
    its share of informative groups or ``algo.max_sampling_rounds`` is reached; a replica still short then fills up
    with the last round's other groups (zero advantage: no gradient under GRPO). Every rank runs the same number of
    rounds.
    """
    shard, shards = engine.sample_shard(actor)
    share = cfg.prompts_per_step // engine.data_parallel(actor)[1]
    filler, rounds, drawn = GroupFiller(share), 0, 0
    for rounds in range(1, cfg.algo.max_sampling_rounds + 1 if cfg.algo.dynamic_sampling else 2):
        examples = stream.take(cfg.prompts_per_step)[shard::shards]
        drawn += cfg.prompts_per_step
        seed = round_seed(cfg.seed, step, rounds, shards, shard)
        episodes = sample(rollout, examples, tokenizer, cfg.rollout, seed=seed, multi_turn=cfg.rollout.multi_turn,
                          environments=environments, group_ids=torch.arange(len(examples)),
                          chat_template=cfg.data.chat_template)
        rows = [examples[g] for g in episodes.batch.group_ids.tolist()]
        with watchdog.phase("reward", op="reward functions / reward model on the sampled responses"):
            batch, reward_metrics = score_batch(episodes.batch, rows, scorer, tokenizer, cfg, rollout.eos_token_ids,
                                                reward_model)
        reward_metrics.update(episodes.metrics)
        batch, rows = engine.replica_samples(actor, batch, rows)
        batch = batch.replace(group_ids=batch.group_ids + (rounds - 1) * share)
        if not cfg.algo.dynamic_sampling:
            return batch, rows, mean_over_ranks(reward_metrics)
        filler.add(batch, rows)
        if not any_short([filler]):
            break
    batch, rows, informative = filler.result()
    stats = {**rounds_metrics(rounds, drawn, informative), **reward_metrics}
    return batch, rows, mean_over_ranks(stats)


def score_batch(batch: rf.RolloutBatch, rows: list, scorer: RewardScorer, tokenizer: Any, cfg: Config,
                eos_token_ids: tuple[int, ...], reward_model: Any = None) -> tuple[rf.RolloutBatch, dict[str, float]]:
    """The batch with its scores (the reward functions on the answer, plus a reward model's weighted score, a
    multi-turn trajectory's turn rewards and DAPO's overlong shaping), the reward functions' success rate and, with
    the overlong filter, a loss mask without truncated responses."""
    result = scorer.score(answer_texts(tokenizer, batch), rows)
    scores, extra = result.scores, {}
    if batch.token_rewards is not None:  # the environment's per-turn rewards
        scores = scores + batch.token_rewards.sum(-1).to(scores.dtype)
    if reward_model is not None:
        learned = reward_model_score(reward_model, batch)
        scores, extra = combine_rewards(scores, learned, rm_weight=cfg.reward_model.weight), {"reward/model": learned.mean().item()}
    if cfg.reward.overlong_buffer_len:
        scores = scores + rf.overlong_penalty(batch.response_mask.sum(-1), max_response_length=cfg.rollout.max_new_tokens,
                                              buffer_length=cfg.reward.overlong_buffer_len,
                                              penalty_factor=cfg.reward.overlong_penalty_factor)
    truncated = rf.truncated_responses(batch.response_ids, response_mask=batch.response_mask, eos_token_ids=eos_token_ids)
    batch = batch.replace(scores=scores)
    if cfg.algo.overlong_filter:
        batch = batch.replace(loss_mask=rf.loss_tokens(batch) & ~truncated[:, None])
    success = (result.scores >= cfg.reward.max_score).float()
    metrics = {**result.metrics(), **extra, "success_rate": success.mean().item(), "truncated_rate": truncated.float().mean().item()}
    return batch, metrics


# ---------------------------------------------------------------------------------------------------
# Metrics and the loss.


def step_stats(batch: rf.RolloutBatch, skip: torch.Tensor | None, times: dict[str, float], dp_size: int,
               group: Any = None) -> dict:
    """The step's reward, length, throughput and skipped-row share over every rank's rows (of ``group``)."""
    local = torch.stack([
        batch.scores.sum(), batch.response_mask.sum(-1).float().sum(), torch.tensor(float(rf.batch_size(batch))),
        (batch.prompt_mask.sum() + batch.response_mask.sum()).float(), skip.float().sum() if skip is not None else torch.zeros(()),
    ])
    score_sum, length_sum, rows, num_tokens, skipped = all_reduce_sum(local, group=group).tolist()
    lengths = batch.response_mask.sum(-1).float()
    longest = all_reduce_max(torch.cat([lengths, lengths.new_zeros(1)]).max(), group=group).item()  # a long tail's cost
    world_per_replica = max(rows, 1.0) / max(float(rf.batch_size(batch)) * dp_size, 1.0)  # megatron peers repeat rows
    return {
        "reward_mean": score_sum / max(rows, 1.0), "response_length": length_sum / max(rows, 1.0),
        "response_length_max": longest,
        "tokens_per_s": num_tokens / world_per_replica / times["step_time_s"], **times, "skipped_rows": skipped / max(rows, 1.0),
    }


def device_memory(env: Any) -> dict[str, float]:
    """The step's peak GPU memory on this rank (GiB), then the peak is reset; nothing on a CPU."""
    if env.device.type != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated(env.device) / 2**30
    torch.cuda.reset_peak_memory_stats(env.device)
    return {"gpu_memory_gib": peak}


def split_rows(rows: torch.Tensor | None, parts: int) -> list[torch.Tensor | None]:
    """A per-row mask split like ``rf.split`` splits the batch (or ``None`` for every part)."""
    return [None] * parts if rows is None else list(torch.tensor_split(rows, parts))


# ---------------------------------------------------------------------------------------------------
# The trainer pool of a split run (experiments.offpolicy_loop): the actor and, with a KL loss, the reference.


@attrs.define
class PolicyTrainer:
    """GRPO's side of the split loop's trainer pool (:class:`experiments.offpolicy_loop.SplitTrainer`)."""

    cfg: Config
    engine: Any
    actor: Any
    reference: Any  #: the frozen starting policy (not checkpointed); None without a KL loss
    env: Any  #: the trainer pool's DistEnv
    estimator: Callable
    estimator_kwargs: dict
    loss_fn: Callable
    skip_zero_rows: bool
    ckpt_name: str
    title: str = "GRPO"

    def states(self) -> dict[str, Any]:
        return {self.ckpt_name: self.actor}

    def load(self, states: dict[str, Any], carried: dict) -> None:
        self.actor = states[self.ckpt_name]

    def carried(self) -> dict:
        return {}

    def weights(self, bridge: Any) -> Any:
        return bridge.weights(self.engine, self.actor)

    def train(self, batch: rf.RolloutBatch, step: int, waited: float) -> dict[str, float]:
        """Old log-probs (always recomputed: the batch is off-policy), the reference's, advantages, the update."""
        t0, cfg, engine = time.time(), self.cfg, self.engine
        batch = batch.replace(old_logprobs=engine.compute_logprobs(self.actor, batch).logprobs)
        if self.reference is not None:
            batch = batch.replace(ref_logprobs=engine.compute_logprobs(self.reference, batch).logprobs)
        adv, ret = self.estimator(batch.scores, group_ids=batch.group_ids, response_mask=rf.loss_tokens(batch),
                                  **self.estimator_kwargs)
        batch = batch.replace(advantages=adv, returns=ret)
        skip = rf.zero_advantage_rows(adv, mask=rf.loss_tokens(batch)) if self.skip_zero_rows else None
        t_update = time.time()
        loss_fn = functools.partial(self.loss_fn, seed=loss_seed(cfg.seed, step, replica=self.env.rank))
        for _ in range(cfg.algo.ppo_epochs):
            for mini_batch, mini_skip in zip(rf.split(batch, cfg.algo.mini_batches), split_rows(skip, cfg.algo.mini_batches)):
                self.actor, metrics = engine.update(self.actor, mini_batch, loss_fn, with_entropy=True,
                                                    skip_rows=mini_skip)
        times = {"step_time_s": time.time() - t0 + waited, "rollout_time_s": waited, "update_time_s": time.time() - t_update}
        return {**step_stats(batch, skip, times, self.env.world_size, group=self.env.group), **metrics}

    def export(self, run: Any, tokenizer: Any) -> None:
        if self.cfg.export_hf:
            self.engine.export_hf(self.actor, run.run_dir / "final_model", tokenizer=tokenizer, overwrite=True)


def build_policy_trainer(cfg: Config, engine: Any, run: Any, data: Any, tokenizer: Any, rl_optim: Any, mlog: Any,
                         build_kwargs: dict, estimator: Callable, estimator_kwargs: dict, policy_loss: Callable,
                         mesh: Any, env: Any, before_sft_update: Callable[[int], None]) -> PolicyTrainer:
    """The actor on the trainer pool (after the SFT stage on a fresh run with SFT data) and the reference."""
    actor = start_actor(cfg, engine, env, run, data, tokenizer, rl_optim, mlog, build_kwargs={**build_kwargs, "mesh": mesh},
                        before_sft_update=before_sft_update)
    reference = None
    if cfg.algo.kl_loss_coef > 0:  # the starting policy (frozen, not checkpointed), sharded over the trainer pool
        reference = engine.build_reference(run.policy_path, env, mesh=mesh,
                                           log_prob_micro_batch_size=cfg.reference.log_prob_micro_batch_size)
    return PolicyTrainer(
        cfg=cfg, engine=engine, actor=actor, reference=reference, env=env, estimator=estimator,
        estimator_kwargs=estimator_kwargs, skip_zero_rows=zero_advantage_rows_are_skippable(cfg.algo, policy_loss),
        loss_fn=make_actor_loss(policy_loss, cfg.algo, horizon=response_horizon(cfg)),
        ckpt_name=engine.checkpoint_name(actor, "actor") if cfg.checkpoint.every or run.resume_from else "actor",
    )


if __name__ == "__main__":
    main(sys.argv[1:])
