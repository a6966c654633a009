"""A new algorithm in a few lines: compose pure rlfunc functions, hand the loss to the engine.

The template for your own algorithm: copy this file and change ``advantages`` and ``loss_fn``. Two variants,
picked with ``algo.name``:

- ``reinforce_pp_baseline`` (default): REINFORCE++-baseline advantages (score minus the group mean,
  then whitened over the batch) with a k3 KL loss to the frozen starting policy;
- ``dr_grpo``: Dr.GRPO (https://arxiv.org/abs/2503.20783): group-mean advantages without the std
  division, and the ``seq-mean-token-sum-norm`` aggregation (no length normalisation bias).

Data, reward, model, evaluation and SFT sections are the GRPO recipe's (``experiments/grpo.py``).

Run:  python experiments/custom_algorithm.py data.train_files=train.jsonl data.val_files=val.jsonl reward.fn=exact
      torchrun --standalone --nproc_per_node 2 experiments/custom_algorithm.py algo.name=dr_grpo ...
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import attrs

import rlfunc as rf
from backends.config import ConfigError, apply_overrides, recipe_help
from backends.cpu import tune_process
from backends.data import PromptStream
from backends.distributed import watchdog
from backends.distributed.collectives import all_reduce_sum, global_masked_whiten
from backends.distributed.setup import get_logger, init_distributed, seed_everything, shutdown
from backends.rewards import RewardScorer
from backends.loop.weight_bridge import weight_bridge
from backends.rollout.api import build_rollout, decode_responses
from backends.training.engines import select_engine
from backends.training.fsdp import FSDPConfig
from backends.training.optim import OptimConfig, with_total_steps
from experiments.algorithm_checks import group_size_warnings
from experiments.vocabulary import RENAMED_CUSTOM, PolicyLossArgs, PPOArgs, RunConfig
from experiments.stages import (
    SHARED_REGISTRIES, commit_run, dump_generations, evaluate_policy, load_run_data, metrics_log, prepare_run,
    run_tokenizer, start_actor, summarize, warn_once,
)

PRESETS = Path(__file__).resolve().parent / "presets"


@attrs.frozen
class AlgoConfig:
    name: str = "reinforce_pp_baseline"  #: reinforce_pp_baseline | dr_grpo
    #: the loss is PPO's: its clip is read from algo.policy_loss_args.ppo (the key GRPO and PPO use)
    policy_loss_args: PolicyLossArgs = PolicyLossArgs(ppo=PPOArgs(clip_high=0.2))
    kl_loss_coef: float = 0.001  #: reinforce_pp_baseline: weight of the k3 KL loss (the key GRPO and PPO use)


@attrs.frozen
class ActorConfig:
    optim: OptimConfig = OptimConfig(lr=1e-6, weight_decay=0.0)  #: the RL optimizer
    fsdp: FSDPConfig = FSDPConfig(micro_batch_size=16)  #: sharding and micro-batches


@attrs.frozen
class Config(RunConfig):
    name: str = "custom_algorithm"  #: the run's name (the run dir is <run_root>/<name>-<time>)
    #: prompts per RL step, over all ranks
    prompts_per_step: int = attrs.field(default=16, validator=attrs.validators.ge(1))
    actor: ActorConfig = ActorConfig()  #: the policy (the keys of the GRPO and PPO recipes' actor.optim / actor.fsdp)
    algo: AlgoConfig = AlgoConfig()  #: the algorithm


# ---------------------------------------------------------------------------------------------------
# The algorithm: advantages and a loss, each a pure function of tensors.


def advantages(batch: rf.RolloutBatch, algo: AlgoConfig, whiten=rf.masked_whiten) -> rf.RolloutBatch:
    """``whiten``: the recipe passes backends.distributed.collectives.global_masked_whiten (the whole batch, all ranks)."""
    if algo.name == "reinforce_pp_baseline":
        adv, ret = rf.reinforce_pp_baseline(batch.scores, group_ids=batch.group_ids, response_mask=batch.response_mask)
        adv = whiten(adv, batch.response_mask)
    else:  # dr_grpo
        adv, ret = rf.grpo(batch.scores, group_ids=batch.group_ids, response_mask=batch.response_mask, norm_by_std=False)
    return batch.replace(advantages=adv, returns=ret)


def loss_fn(out, mb: rf.RolloutBatch, norms: rf.Normalizers, *, algo: AlgoConfig, horizon: int):
    agg = "token-mean" if algo.name == "reinforce_pp_baseline" else "seq-mean-token-sum-norm"
    clip = algo.policy_loss_args.ppo
    loss, metrics = rf.ppo_policy_loss(
        out.logprobs, old_logprobs=mb.old_logprobs, advantages=mb.advantages, response_mask=mb.response_mask,
        clip_low=clip.clip_low, clip_high=clip.clip_high, dual_clip=clip.dual_clip, agg=agg, norms=norms,
        horizon=horizon,
    )
    if uses_kl(algo):
        kl, kl_metrics = rf.kl_loss(out.logprobs, ref_logprobs=mb.ref_logprobs, mask=mb.response_mask, kind="k3",
                                    agg=agg, norms=norms)
        loss, metrics = loss + algo.kl_loss_coef * kl, {**metrics, **kl_metrics}
    return loss, metrics


def uses_kl(algo: AlgoConfig) -> bool:
    return algo.name == "reinforce_pp_baseline" and algo.kl_loss_coef > 0


# ---------------------------------------------------------------------------------------------------
# The loop: backends do the stateful work.


def main(argv: list[str]) -> dict:
    tune_process()  # process-wide allocator / oneDNN settings: before any model is built
    if "--help" in argv or "-h" in argv:
        print(recipe_help(__doc__, Config(), presets_dir=PRESETS,
                          registries={"algo.name": ("reinforce_pp_baseline", "dr_grpo"), **SHARED_REGISTRIES}))
        return {}
    cfg = apply_overrides(Config(), argv, presets_dir=PRESETS, renamed=RENAMED_CUSTOM)
    if cfg.algo.name not in ("reinforce_pp_baseline", "dr_grpo"):
        raise ConfigError(f"algo.name must be reinforce_pp_baseline or dr_grpo, got {cfg.algo.name!r}")
    scorer = RewardScorer(cfg.reward)
    engine = select_engine("fsdp", fsdp=cfg.actor.fsdp)
    env = init_distributed(timeout_s=cfg.deadlines.process_group or 1800.0)
    watchdog.start(cfg.deadlines, env, role="custom")  # a stuck phase ends the job with its name and stacks
    seed_everything(cfg.seed)
    run = prepare_run(cfg, env, resumable_keys=())
    tokenizer = run_tokenizer(cfg, run)  # nothing of the run dir is written before the last check (commit_run)
    warn_once(get_logger("custom", env), group_size_warnings(cfg.rollout.n, key="algo.name", spec=cfg.algo.name))
    data = load_run_data(cfg, tokenizer, scorer, get_logger("custom", env))
    stream = PromptStream(data.train, seed=cfg.seed, shuffle=cfg.data.shuffle)
    steps = cfg.steps or cfg.epochs * stream.steps_per_epoch(cfg.prompts_per_step)
    commit_run(cfg, env, run, tokenizer)  # every start-up check passed: the run dir is written from here on
    mlog, t_start = metrics_log(cfg, run, env, ("reward_mean", "kl_mean", "grad_norm")), time.time()

    # [SFT], then the policy, the frozen reference it starts from and (last: it takes the memory left) the rollout engine
    actor = start_actor(cfg, engine, env, run, data, tokenizer, with_total_steps(cfg.actor.optim, steps), mlog)
    reference = engine.build_reference(run.policy_path, env) if uses_kl(cfg.algo) else None
    rollout = build_rollout(cfg.rollout, run.policy_path, tokenizer, seed=cfg.seed, device=env.device,
                            max_context=cfg.data.max_prompt_length + cfg.rollout.max_new_tokens)
    bridge = weight_bridge(cfg.rollout)  # how the policy's weights reach the rollout engine

    before = evaluate_policy(rollout, tokenizer, data, scorer, cfg, env)
    preempted = False
    for step in range(1, steps + 1):
        t0 = time.time()
        with watchdog.phase("rollout", step=step):
            examples = stream.take(cfg.prompts_per_step)[env.rank :: env.world_size]
            batch = rollout.generate([list(e.prompt_ids) for e in examples], cfg.rollout,
                                     seed=(cfg.seed * 1_000_003 + step) * env.world_size + env.rank)
            rollout = rollout.release_memory()
            rows = [examples[g] for g in batch.group_ids.tolist()]
            batch = batch.replace(scores=scorer.score(decode_responses(tokenizer, batch), rows).scores)
        with watchdog.phase("update", step=step):
            batch = batch.replace(old_logprobs=engine.compute_logprobs(actor, batch).logprobs)
            if reference is not None:
                batch = batch.replace(ref_logprobs=engine.compute_logprobs(reference, batch).logprobs)
            batch = advantages(batch, cfg.algo, whiten=global_masked_whiten)
            actor, m = engine.update(actor, batch, lambda out, mb, norms: loss_fn(out, mb, norms, algo=cfg.algo, horizon=cfg.rollout.max_new_tokens))
        with watchdog.phase("weight_sync", step=step):
            rollout = bridge.sync(rollout, engine, actor, version=step)
        reward_mean = all_reduce_sum(batch.scores.mean().reshape(1)).item() / env.world_size
        mlog.log(step, {"reward_mean": reward_mean, "step_time_s": time.time() - t0, **m})
        if cfg.dump_generations_every and step % cfg.dump_generations_every == 0:
            dump_generations(run, step, tokenizer, batch, rows)
        if watchdog.stop_agreed(step):  # SIGTERM on any rank: all stop after this step (this template does not checkpoint)
            get_logger("custom", env).warning(watchdog.preemption_note(step, None))
            steps, preempted = step, True
            break

    summary = {"preempted_at_step": steps}
    if not preempted:  # a preempted job leaves quickly: no final evaluation
        after = evaluate_policy(rollout, tokenizer, data, scorer, cfg, env)
        mlog.log(steps, after)
        summary = summarize(cfg, run, env, before, after, steps=steps, wall=time.time() - t_start, title=cfg.algo.name,
                            extra={"algorithm": cfg.algo.name})
    mlog.close()
    scorer.close()
    watchdog.stop()
    rollout.shutdown()  # after the last collective, before the process group goes
    shutdown(env)
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
