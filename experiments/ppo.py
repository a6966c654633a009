"""PPO (verl's default algorithm: actor + critic + GAE) on your data, your reward, your model.

Run:  python experiments/ppo.py data.train_files=train.jsonl data.val_files=val.jsonl reward.fn=gsm8k
      torchrun --standalone --nproc_per_node 2 experiments/ppo.py ...           (FSDP2 over 2 ranks)
      ... model.path=/path/to/hf_dir algo.kl_ctrl=adaptive algo.kl_loss_coef=0.001
      ... preset=ref/dp_ref actor.optim=@optim/fsdp actor.optim.lr=1e-5     (presets, then overrides)
      ... actor.backend=megatron actor.tp=2 (or actor.pp=2): the actor and the critic on megatron-core
      --help lists every key with its default and meaning, and the presets.

Data, reward, evaluation and SFT sections are the GRPO recipe's (``experiments/grpo.py``).

Placement (where the roles run):
      torchrun --standalone --nproc_per_node 4 experiments/ppo.py placement.mode=split \
          placement.actor_pool=2 placement.critic_pool=2
actor + rollout on ranks 0-1, critic + reference on ranks 2-3: batches cross between the pools, and the
critic update runs at the same time as the actor update and weight sync. Colocated (the default) runs
every role on every rank. Split runs checkpoint, resume and export like colocated ones.

Asynchronous (``experiments/offpolicy_loop.py``): ``offpolicy.rollout_ranks=1 offpolicy.mode=one_step_off`` gives the
rollout ranks of its own that sample the next batch while the other ranks, holding the actor, the critic and the
reference, train on this one (``algo.rollout_is=token`` corrects for the older sampling weights).

Checkpoints and exact resume: ``checkpoint.every=10`` then ``resume=auto``. A checkpoint holds the actor and
the critic (weights + AdamW, sharded), the step, every rank's RNG, the data position and the KL controller.

Reads top to bottom: config -> placement -> data and reward (checked) -> model -> [SFT] -> held-out eval -> RL
loop [rollout + reward -> log-probs (actor, reference) -> values -> token rewards (score - beta * KL) -> GAE ->
critic update -> actor update -> weight sync -> log / checkpoint] -> held-out eval -> HF / orbax export ->
summary. The roles and the batch moves between their pools live in ``backends.training.roles``, so the loop
is the same under both placements: each phase runs on the ranks that hold its role.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import torch

import rlfunc as rf
from backends.checkpoint.dcp import load_checkpoint, save_checkpoint
from backends.checkpoint.orbax import save_orbax
from backends.config import ConfigError, apply_overrides, recipe_help, resolve_function
from backends.cpu import tune_process
from backends.data import PromptStream
from backends.distributed import watchdog
from backends.distributed.collectives import all_reduce_max, all_reduce_sum, barrier, global_masked_whiten
from backends.distributed.placement import PlacementConfig, colocated_on_pool
from backends.distributed.setup import get_logger, init_distributed, seed_everything, shutdown
from backends.rewards import RewardScorer
from backends.loop.weight_bridge import weight_bridge
from backends.rollout.api import build_rollout, decode_responses, refuse_on_a_pool
from backends.training.engines import TRAIN_ENGINES, registered_engine, select_engine
from backends.training.fsdp import FSDPConfig, value_loss_fn
from backends.training.optim import OptimConfig, with_total_steps
from backends.training.reference import ReferenceConfig
from backends.training.roles import Roles, build_roles
from backends.training.sft import run_sft, sft_optim, sft_steps
from experiments.actor_loss import loss_seed, make_actor_loss
from experiments.algorithm_checks import check_policy_loss
from experiments.offpolicy_loop import OffPolicyConfig, RecipeParts, check_offpolicy, run_split
from experiments.stages import (
    SHARED_REGISTRIES, RunData, RunPaths, checkpoint_or_stop, commit_run, dump_generations, evaluate_policy, export_final,
    load_run_data, metrics_log, prepare_run, run_tokenizer, summarize,
)
from experiments.stages import start_actor as start_policy
from experiments.vocabulary import RENAMED_PPO, PolicyLossArgs, PolicyUpdateConfig, PPOArgs, RunConfig

PRESETS = Path(__file__).resolve().parent / "presets"


@attrs.frozen
class AlgoConfig(PolicyUpdateConfig):
    """The policy update's keys (experiments/vocabulary.py, shared with the other recipes; the actor's loss) and
    PPO's own: verl's ``algorithm.*`` (adv_estimator=gae, the in-reward KL) and the critic's settings."""

    gamma: float = 1.0  #: GAE discount
    lam: float = 0.95  #: GAE lambda
    cliprange_value: float = 0.5  #: the critic's value clip (verl's critic.cliprange_value)
    ppo_mini_batch_size: int = 0  #: prompts per optimizer step (global, x rollout.n rows); 0: the whole step's batch
    critic_warmup: int = 0  #: steps that train only the critic (its value head starts random)
    kl_in_reward: bool = True  #: subtract kl_reward_coef * KL(policy || reference) from the token rewards (InstructGPT)
    #: the KL estimator in the reward (rlfunc.KL_KINDS; kl = k1)
    kl_reward_kind: str = attrs.field(default="kl", validator=attrs.validators.in_(rf.KL_KINDS))
    kl_ctrl: str = "fixed"  #: fixed | adaptive: how the in-reward beta moves
    kl_reward_coef: float = 0.001  #: the (initial) in-reward beta of the controller (verl's algorithm.kl_ctrl.kl_coef)
    target_kl: float = 0.1  #: the adaptive controller's target KL
    horizon: int = 10000  #: the adaptive controller's horizon


#: verl's actor defaults: PPO clip 0.2 both sides, dual clip at 3.0 (clip_ratio_c), a low-variance KL loss when on
PPO_ALGO = AlgoConfig(policy_loss_args=PolicyLossArgs(ppo=PPOArgs(clip_high=0.2, dual_clip=3.0)),
                      kl_loss_kind="low_var_kl")


@attrs.frozen
class ActorConfig:
    optim: OptimConfig = OptimConfig(lr=1e-6, weight_decay=0.0, clip_grad=1.0)  #: the actor's RL optimizer
    fsdp: FSDPConfig = FSDPConfig(micro_batch_size=16)  #: the actor's sharding, micro-batches and precision
    #: fsdp or megatron, for the actor *and the critic* (megatron keeps one tp / pp layout per process)
    backend: str = attrs.field(default="fsdp", validator=registered_engine)
    tp: int = 1  #: megatron tensor-parallel size
    pp: int = 1  #: megatron pipeline-parallel size


@attrs.frozen
class CriticConfig:
    optim: OptimConfig = OptimConfig(lr=1e-5, weight_decay=0.0, clip_grad=1.0)  #: the critic's optimizer
    fsdp: FSDPConfig = FSDPConfig(micro_batch_size=16)  #: the critic's sharding and micro-batches


@attrs.frozen
class ExportConfig:
    hf: bool = True  #: actor and critic as HF dirs (actor_hf, critic_hf) that transformers / vLLM load
    orbax: bool = False  #: the gathered actor train state as an orbax PyTree (JAX interop)


@attrs.frozen
class Config(RunConfig):
    name: str = "ppo"  #: the run's name (the run dir is <run_root>/<name>-<time>)
    actor: ActorConfig = ActorConfig()  #: the policy
    critic: CriticConfig = CriticConfig()  #: the value model
    reference: ReferenceConfig = ReferenceConfig(log_prob_micro_batch_size=64)  #: the frozen reference (verl's ref/*.yaml)
    placement: PlacementConfig = PlacementConfig()  #: where the roles run
    algo: AlgoConfig = PPO_ALGO  #: the algorithm
    export: ExportConfig = ExportConfig()  #: what is written at the end
    offpolicy: OffPolicyConfig = OffPolicyConfig()  #: asynchronous training: the rollout on ranks of its own


#: keys that may differ between a run and its resumption (where things go and how they are logged)
RESUMABLE_KEYS = ("resume", "run_dir", "run_root", "checkpoint", "deadlines", "export", "eval", "logger", "log_every",
                  "dump_generations_every")
CONSOLE_KEYS = ("reward_mean", "success_rate", "kl_reward", "entropy", "clip_frac", "critic/loss", "grad_norm", "step_time_s")


def main(argv: list[str]) -> dict:
    tune_process()  # process-wide allocator / oneDNN settings: before any model is built
    if "--help" in argv or "-h" in argv:
        registries = {"algo.kl_reward_kind, algo.kl_loss_kind": rf.KL_KINDS, "algo.agg": tuple(rf.AGG_MODES),
                      "algo.policy_loss": tuple(rf.POLICY_LOSSES), "actor.backend": tuple(TRAIN_ENGINES),
                      **SHARED_REGISTRIES}
        print(recipe_help(__doc__, Config(), presets_dir=PRESETS, registries=registries))
        return {}
    # an unknown key, or an old spelling (experiments/vocabulary.py), fails here, before any work
    cfg = apply_overrides(Config(), argv, presets_dir=PRESETS, renamed=RENAMED_PPO)
    policy_loss = resolve_policy_loss(cfg.algo)  # ... and a policy loss that does not take the loop's call
    # the training engines of the actor and the critic (a bad name or size fails here, before any work)
    engine = select_engine(cfg.actor.backend, fsdp=cfg.actor.fsdp, tp=cfg.actor.tp, pp=cfg.actor.pp)
    critic_engine = select_engine(cfg.actor.backend, fsdp=cfg.critic.fsdp, tp=cfg.actor.tp, pp=cfg.actor.pp)
    check_config(cfg, engine)
    scorer = RewardScorer(cfg.reward)  # an unknown reward function fails here
    env = init_distributed(timeout_s=cfg.deadlines.process_group or 1800.0)
    log = get_logger("ppo", env)
    watchdog.start(cfg.deadlines, env, role="ppo")  # deadlines per phase, and SIGTERM: stop at a step boundary
    seed_everything(cfg.seed)
    check_offpolicy(cfg, env.world_size, refused={
        "placement.mode=split (the trainer pool holds the actor, the critic and the reference)": cfg.placement.mode == "split"})
    if cfg.offpolicy.rollout_ranks:  # the trainer pool's roles are placed by the split loop
        num_mini = num_mini_batches(cfg, env.world_size - cfg.offpolicy.rollout_ranks)
    else:
        roles = build_roles(cfg.placement, env, engine, critic_engine)  # which ranks hold which roles
        num_mini = num_mini_batches(cfg, roles.pool_size("actor"))
    run = prepare_run(cfg, env, RESUMABLE_KEYS)
    tokenizer = run_tokenizer(cfg, run)  # nothing of the run dir is written before the last check (commit_run)
    data = load_run_data(cfg, tokenizer, scorer, log)  # bad data fails here, before any model
    steps = cfg.steps or cfg.epochs * PromptStream(data.train, seed=cfg.seed).steps_per_epoch(cfg.prompts_per_step)
    rl_optim = with_total_steps(cfg.actor.optim, steps * cfg.algo.ppo_epochs * num_mini)
    critic_optim = with_total_steps(cfg.critic.optim, steps * cfg.algo.ppo_epochs * num_mini)
    commit_run(cfg, env, run, tokenizer)  # every start-up check passed: the run dir is written from here on
    mlog = metrics_log(cfg, run, env, CONSOLE_KEYS)
    t_start = time.time()
    if cfg.offpolicy.rollout_ranks:  # the rollout pool samples ahead while the trainer pool runs every role
        parts = RecipeParts(score_batch=score_responses, max_context=cfg.data.max_prompt_length + cfg.rollout.max_new_tokens)
        make_trainer = functools.partial(build_actor_critic_trainer, cfg, engine, critic_engine, run, data, tokenizer,
                                         rl_optim, critic_optim, mlog, num_mini, policy_loss)
        summary = run_split(cfg, env, log, run, data, tokenizer, scorer, None, steps, mlog, parts, make_trainer, t_start)
        scorer.close()
        shutdown(env)
        return summary

    # The actor (after the SFT stage on a fresh run with SFT data); the critic starts from the policy's backbone
    # with a fresh (seeded) value head; the frozen reference is the starting policy; the rollout engine on the
    # actor's ranks holds an unsharded copy of the actor.
    start_actor(cfg, roles, run, data, tokenizer, rl_optim, mlog)
    roles.build_critic(run.policy_path, critic_optim, seed=cfg.seed)
    if needs_reference(cfg.algo):
        roles.build_reference(cfg.reference, run.policy_path, cfg.actor.fsdp)
    rollout = roles.run_on("actor", None, build_rollout, cfg.rollout, run.policy_path, tokenizer, seed=cfg.seed,
                           device=env.device, max_context=cfg.data.max_prompt_length + cfg.rollout.max_new_tokens)
    bridge = weight_bridge(cfg.rollout)  # how the actor's weights reach it: in its dtype, in buckets
    if cfg.checkpoint.every or run.resume_from:
        roles.checkpoint_states()  # an engine that cannot checkpoint says so here, before any RL work
    kl_ctrl = kl_controller(cfg.algo)
    stream = PromptStream(data.train, seed=cfg.seed, shuffle=cfg.data.shuffle)
    first_step, wall_before, before = 1, 0.0, {}
    if run.resume_from is None:
        if cfg.eval.before_training:
            with watchdog.phase("eval", step=0):
                before = roles.run_on("actor", None, evaluate_policy, rollout, tokenizer, data, scorer, cfg, roles.env("actor"), otherwise={})
        mlog.log(0, before)
    else:  # each rank loads the roles it holds (split placement: one pool's)
        with watchdog.phase("checkpoint", op=f"load_checkpoint({run.resume_from})"):
            states, extra = load_checkpoint(run.resume_from, roles.checkpoint_states(), config=run.must_match)
        roles.load_checkpoint_states(states)
        stream = PromptStream(data.train, seed=cfg.seed, shuffle=cfg.data.shuffle, drawn=extra["drawn"])
        kl_ctrl, first_step = rf.KLControllerState(**extra["kl_ctrl"]), extra["step"] + 1
        before, wall_before = extra["eval_before"], extra["wall_seconds"]
        with watchdog.phase("weight_sync", step=extra["step"]):
            rollout = roles.run_on("actor", None, lambda: bridge.sync(rollout, roles.actor_engine, roles.actor,
                                                                      version=extra["step"]))

    def save(step: int) -> None:  # every role (sharded, with AdamW), RNG, what the loop carries (see 7. below)
        extra = roles.share({
            "step": step, "drawn": stream.drawn, "run_dir": str(run.run_dir),
            "kl_ctrl": {"beta": kl_ctrl.beta, "target_kl": kl_ctrl.target_kl, "horizon": kl_ctrl.horizon},
            "eval_before": before, "wall_seconds": wall_before + time.time() - t_start,
        }, "actor")
        with watchdog.phase("checkpoint", step=step, op=f"save_checkpoint({run.ckpt_dir}/step_{step})"):
            save_checkpoint(run.ckpt_dir, step, roles.checkpoint_states(), extra, keep_last=cfg.checkpoint.keep_last,
                            config=run.must_match)

    actor_loss = make_actor_loss(policy_loss, cfg.algo, horizon=cfg.rollout.max_new_tokens)
    critic_loss = value_loss_fn(clip_range=cfg.algo.cliprange_value, agg="token-mean", horizon=cfg.rollout.max_new_tokens)
    preempted_at = None
    for step in range(first_step, steps + 1):
        t0 = time.time()
        # 1-2. rollout (n samples per prompt, this rank's share) and reward, on the actor's ranks
        with watchdog.phase("rollout", step=step):
            batch, rows = roles.run_on("actor", "rollout", sample_and_score, roles, rollout, stream, scorer, tokenizer, cfg, step,
                                       otherwise=(None, None))
            if step > cfg.algo.critic_warmup:  # a GPU engine frees its memory for the updates, until the weight sync
                rollout = roles.run_on("actor", None, lambda: rollout.release_memory())
        with watchdog.phase("update", step=step, op="log-probs, values, advantages"):
            # 3. log-probs of the sampled tokens under the current policy
            batch = roles.old_logprobs(batch)
            # the batch crosses to the critic's ranks (colocated: nothing moves); reference log-probs, values
            critic_batch = roles.to_critic(batch)
            critic_batch = roles.compute_values(roles.reference_logprobs(critic_batch))
            # 4. token rewards (score on the last token, minus beta * KL per token) -> GAE -> whitened advantages
            critic_batch, kl_ctrl, kl_stats = roles.run_on("critic", "advantages", advantages, critic_batch, kl_ctrl, cfg,
                                                           roles.env("critic"), otherwise=(critic_batch, kl_ctrl, {}))
            # advantages (and reference log-probs) go back to the ranks that sampled the rows
            batch = roles.to_actor(critic_batch, like=batch)
            # 5. critic update and (after the critic warm-up) actor update, ppo_epochs x mini-batches each
            #    (split placement: the two pools run them at the same time)
            watchdog.waiting_on("critic / actor updates (forward, backward, optimizer steps)")
            critic_metrics = roles.update_critic(critic_batch, critic_loss, epochs=cfg.algo.ppo_epochs, mini_batches=num_mini)
            actor_metrics = []
            if step > cfg.algo.critic_warmup:
                replica = roles.data_parallel()[0] if roles.on_actor else 0  # the seed is read on the actor's ranks
                loss_fn = functools.partial(actor_loss, seed=loss_seed(cfg.seed, step, replica=replica))
                actor_metrics = roles.update_actor(batch, loss_fn, epochs=cfg.algo.ppo_epochs, mini_batches=num_mini,
                                                   with_entropy=True)
        if step > cfg.algo.critic_warmup:
            # 6. weight sync: full tensors from the FSDP / megatron shards into the rollout engine
            with watchdog.phase("weight_sync", step=step):
                rollout = roles.run_on("actor", "weight_sync",
                                       lambda: bridge.sync(rollout, roles.actor_engine, roles.actor, version=step))
        # the critic's side of the step (KL statistics and controller, metrics, times) reaches the actor's ranks
        kl_stats, critic_metrics, kl_ctrl = roles.share((kl_stats, critic_metrics, kl_ctrl), "critic")
        times = roles.step_times()

        # 7. log (and evaluate) on the actor's ranks; checkpoint: every role (sharded, with AdamW), RNG, and
        #    what the loop carries as the actor's leader knows it (split: each pool saves its own roles)
        stats = {**kl_stats, **mean_metrics(actor_metrics), **{f"critic/{k}": v for k, v in mean_metrics(critic_metrics).items()},
                 "step_time_s": time.time() - t0, **{f"time/{k}_s": v for k, v in times.items()}}
        with watchdog.phase("eval", step=step, op="log_step (held-out evaluation every eval.every steps)"):
            roles.run_on("actor", None, log_step, step, batch, rows, stats, cfg, roles, rollout, tokenizer, data, scorer, run, mlog)
        if checkpoint_or_stop(step, steps, cfg, run, save, log):  # SIGTERM on any rank: all stop here, checkpointed
            preempted_at = step
            break

    if preempted_at is not None:  # exit code 0, no final evaluation / export: resume=auto continues from here
        summary = {"preempted_at_step": preempted_at, "run_dir": str(run.run_dir)}
    else:
        with watchdog.phase("eval", step=steps):
            after = roles.run_on("actor", None, evaluate_policy, rollout, tokenizer, data, scorer, cfg, roles.env("actor"), otherwise={})
        mlog.log(steps, after)
        with watchdog.phase("checkpoint", step=steps, op="export (HF / orbax)"):
            export_final(lambda: export(cfg, roles, run, tokenizer), run, steps,
                         save=save if cfg.placement.mode == "colocated" else None)  # split: the pools export apart
        summary = summarize(cfg, run, env, before, after, steps=steps, wall=wall_before + time.time() - t_start, title="PPO",
                            extra={"placement": cfg.placement.mode})
    barrier()  # both pools' exports are on disk before anyone returns
    mlog.close()
    scorer.close()
    roles.run_on("actor", None, lambda: rollout.shutdown())
    shutdown(env)
    return summary


# ---------------------------------------------------------------------------------------------------
# Losses and rewards: compositions of pure rlfunc functions. The engine passes the global normalisers.


def resolve_policy_loss(algo: AlgoConfig) -> Any:
    """The actor's policy loss from ``algo.policy_loss`` (a built-in or a reference), checked with the uniform call
    on a synthetic batch before any work (experiments/algorithm_checks.py)."""
    loss_aliases = {name.replace("_", "-"): name for name in rf.POLICY_LOSSES if "_" in name}  # clip-cov = clip_cov
    policy_loss = resolve_function(algo.policy_loss, rf.POLICY_LOSSES, "algo.policy_loss", aliases=loss_aliases)
    try:  # the trainer supplies proximal and current log-probs, the rollout the behaviour ones
        rf.check_logprobs_supplied(policy_loss, available=("current", "proximal", "behaviour"))
    except ValueError as e:
        raise ConfigError(f"algo.policy_loss={algo.policy_loss!r}: {e}") from None
    check_policy_loss(functools.partial(make_actor_loss(policy_loss, attrs.evolve(algo, kl_loss_coef=0.0), horizon=4),
                                        seed=0), key="algo.policy_loss", spec=algo.policy_loss)
    return policy_loss


def needs_reference(algo: AlgoConfig) -> bool:
    """The reference is built for the in-reward KL or the KL loss."""
    return algo.kl_in_reward or algo.kl_loss_coef > 0


def advantages(batch: rf.RolloutBatch, kl_ctrl: rf.KLControllerState, cfg: Config, env: Any):
    """Token rewards (score minus beta * KL to the reference) -> GAE -> whitened advantages, on the ranks
    of ``env`` (the critic's pool); the KL controller sees the KL averaged over those ranks.
    Returns ``(batch with token_rewards / advantages / returns, new controller, KL statistics)``."""
    mask = rf.loss_tokens(batch)
    token_rewards = outcome_token_rewards(batch.scores, response_mask=batch.response_mask)
    kl_stats = {}
    if cfg.algo.kl_in_reward:
        token_rewards, observed_kl = rf.apply_kl_penalty_to_rewards(
            token_rewards, logprobs=batch.old_logprobs, ref_logprobs=batch.ref_logprobs, mask=batch.response_mask,
            beta=kl_ctrl.beta, kind=cfg.algo.kl_reward_kind,
        )
        observed_kl = (all_reduce_sum(observed_kl.reshape(1), env.group) / env.world_size)[0]  # the same beta on every rank
        kl_stats = {"kl_reward": float(observed_kl), "kl_coef": float(kl_ctrl.beta)}
        kl_ctrl = rf.update_kl_controller(kl_ctrl, observed_kl=observed_kl, n_steps=cfg.prompts_per_step * cfg.rollout.n)
    adv, ret = rf.gae(token_rewards, values=batch.values, response_mask=batch.response_mask, gamma=cfg.algo.gamma, lam=cfg.algo.lam)
    adv = global_masked_whiten(adv, mask, group=env.group)  # the whole batch, all ranks of the pool (as verl)
    return batch.replace(token_rewards=token_rewards, advantages=adv, returns=ret), kl_ctrl, kl_stats


def outcome_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``(b,), (b t) -> (b t)``: each sequence's score on its last response token, 0 elsewhere (verl's
    ``token_level_scores`` of a rule-based reward)."""
    last = (response_mask.long().cumsum(-1) == response_mask.sum(-1, keepdim=True)) & response_mask
    return torch.where(last, scores[:, None].to(torch.float32), torch.zeros((), dtype=torch.float32))


# ---------------------------------------------------------------------------------------------------
# Set-up, the actor pool's per-step work, export.


def check_config(cfg: Config, engine: Any) -> None:
    """Settings that cannot work together (or with the actor's training ``engine``) fail here, on every rank,
    before any model is built."""
    if cfg.algo.kl_ctrl not in ("fixed", "adaptive"):
        raise ConfigError(f"algo.kl_ctrl must be 'fixed' or 'adaptive', got {cfg.algo.kl_ctrl!r}")
    if cfg.rollout.multi_turn.max_turns > 1:
        raise ConfigError("rollout.multi_turn.max_turns > 1: the PPO recipe samples single-turn responses; multi-turn "
                          "and tool rollouts run in the GRPO recipe (experiments/grpo.py)")
    refused = {
        "placement.mode=split (its roles span every rank)": cfg.placement.mode == "split" and not engine.runs_on_a_pool,
        "export.orbax=true": cfg.export.orbax and not engine.exports_orbax,
        "reference.ref_in_actor=true (it needs a LoRA actor)": cfg.reference.ref_in_actor and not engine.trains_lora,
    }
    if any(refused.values()):
        raise ConfigError(f"actor.backend={cfg.actor.backend} does not take "
                          f"{', '.join(what for what, bad in refused.items() if bad)}")
    if cfg.placement.mode == "split":
        refuse_on_a_pool(cfg.rollout, "placement.mode=split", setting="placement.mode=split",
                         colocated="placement.mode=colocated")
    if cfg.placement.mode == "split" and cfg.reference.ref_in_actor:
        raise ConfigError(
            "reference.ref_in_actor=true needs the actor and the reference on the same ranks; under placement.mode=split "
            "the reference lives on the critic pool: use placement.mode=colocated or a separate reference"
        )


def num_mini_batches(cfg: Config, actor_ranks: int) -> int:
    """Optimizer steps per epoch; the prompts are split over the actor's data-parallel ranks (megatron's
    TP / PP peers share rows)."""
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


def start_actor(cfg: Config, roles: Roles, run: RunPaths, data: RunData, tokenizer: Any, rl_optim: OptimConfig, mlog: Any) -> None:
    """The actor on its ranks: on a fresh run with SFT data, the SFT stage, a fresh RL optimizer and the
    policy's HF dir (every pool builds from it); otherwise the policy that RL starts from."""
    if run.resume_from is not None or not data.sft:
        roles.build_actor(run.policy_path, rl_optim)
        return
    engine, sft_total = roles.actor_engine, sft_steps(cfg.sft, len(data.sft))
    roles.build_actor(run.model_path, sft_optim(cfg.sft, sft_total))
    examples = PromptStream(data.sft, seed=cfg.seed)
    roles.map_actor(lambda actor: run_sft(actor, lambda step: examples.take(cfg.sft.batch_size), attrs.evolve(cfg.sft, steps=sft_total),
                                          pad_token_id=tokenizer.pad_token_id, data_parallel=engine.data_parallel(actor),
                                          update_fn=engine.update, metrics_log=mlog, show_progress=roles.placement.world.is_main))
    roles.map_actor(lambda actor: engine.fresh_optimizer(actor, rl_optim))
    roles.run_on("actor", None, engine.export_hf, roles.actor, run.policy_path, tokenizer=tokenizer, overwrite=True)
    barrier()  # the policy is on disk for every pool


def sample_and_score(roles: Roles, rollout: Any, stream: PromptStream, scorer: RewardScorer, tokenizer: Any, cfg: Config,
                     step: int) -> tuple[rf.RolloutBatch, list]:
    """This data-parallel rank's share of the step's prompts, ``n`` samples each (explicit per-step seed),
    scored by the reward functions, and the example of each row. Megatron's TP / PP peers each sample and score
    one shard of their replica's share and train on the replica's gathered batch (``Engine.sample_shard``)."""
    engine = roles.actor_engine
    shard, shards = engine.sample_shard(roles.actor)
    examples = stream.take(cfg.prompts_per_step)[shard::shards]
    seed = (cfg.seed * 1_000_003 + step) * shards + shard
    batch = rollout.generate([list(e.prompt_ids) for e in examples], cfg.rollout, seed=seed)
    rows = [examples[g] for g in batch.group_ids.tolist()]
    with watchdog.phase("reward", op="reward functions on the sampled responses"):
        result = scorer.score(decode_responses(tokenizer, batch), rows)
    return engine.replica_samples(roles.actor, batch.replace(scores=result.scores), rows)


def log_step(step: int, batch: rf.RolloutBatch, rows: list, stats: dict, cfg: Config, roles: Roles, rollout: Any, tokenizer: Any,
             data: RunData, scorer: RewardScorer, run: RunPaths, mlog: Any) -> None:
    """On the actor's ranks: the batch's statistics averaged over them, the held-out metrics every
    ``eval.every`` steps, one metrics row, and the generations every ``dump_generations_every`` steps."""
    env = roles.env("actor")
    stats = {**batch_stats(batch, cfg, env, roles.data_parallel()[1], stats["step_time_s"]), **stats}
    if cfg.eval.every and step % cfg.eval.every == 0:
        stats.update(evaluate_policy(rollout, tokenizer, data, scorer, cfg, env))
    mlog.log(step, stats)
    if cfg.dump_generations_every and step % cfg.dump_generations_every == 0:
        dump_generations(run, step, tokenizer, batch, rows, group=env.group)


def batch_stats(batch: rf.RolloutBatch, cfg: Config, env: Any, dp_size: int, step_time_s: float) -> dict:
    """The step's reward, success, length (mean and largest), values, returns and throughput over the ranks of ``env``."""
    local = torch.stack([
        batch.scores.mean(), (batch.scores >= cfg.reward.max_score).float().mean(), batch.response_mask.sum(-1).float().mean(),
        rf.masked_mean(batch.values, batch.response_mask), rf.masked_mean(batch.returns, batch.response_mask),
        (batch.prompt_mask.sum() + batch.response_mask.sum()).float(),
    ])
    reward_mean, success_rate, response_length, values_mean, returns_mean, num_tokens = (
        all_reduce_sum(local, env.group) / env.world_size
    ).tolist()
    lengths = batch.response_mask.sum(-1).float()
    longest = all_reduce_max(torch.cat([lengths, lengths.new_zeros(1)]).max(), env.group).item()  # a long tail's cost
    return {"reward_mean": reward_mean, "success_rate": success_rate, "response_length": response_length,
            "response_length_max": longest, "values_mean": values_mean, "returns_mean": returns_mean,
            "tokens_per_s": num_tokens * dp_size / step_time_s}


def mean_metrics(rows: list[dict]) -> dict:
    """Mean of each engine metric over this step's optimizer steps (a running total: its last value)."""
    last = ("nonfinite_updates_skipped",)
    return {k: rows[-1][k] if k in last else sum(r[k] for r in rows) / len(rows) for k in rows[0]} if rows else {}


def export(cfg: Config, roles: Roles, run: RunPaths, tokenizer: Any) -> None:
    """HF dirs of the actor (a causal LM) and the critic (a value model), orbax of the actor's train state
    (gathered over the actor's ranks)."""
    if cfg.export.hf:
        roles.export_hf(run.run_dir, tokenizer)
    if cfg.export.orbax:
        roles.run_on("actor", None, lambda: save_orbax(roles.actor, run.run_dir / "actor_orbax", overwrite=True))


# ---------------------------------------------------------------------------------------------------
# Asynchronous training (offpolicy.rollout_ranks > 0, experiments.offpolicy_loop): the rollout pool samples and
# scores; the trainer pool holds every role, colocated over its ranks.


def score_responses(batch: rf.RolloutBatch, rows: list, scorer: RewardScorer, tokenizer: Any, cfg: Config,
                    eos_token_ids: tuple[int, ...]) -> tuple[rf.RolloutBatch, dict[str, float]]:
    """The batch with the reward functions' scores, and their metrics (on the rollout pool)."""
    result = scorer.score(decode_responses(tokenizer, batch), rows)
    success = (result.scores >= cfg.reward.max_score).float().mean().item()
    return batch.replace(scores=result.scores), {**result.metrics(), "success_rate": success}


@attrs.define
class ActorCriticTrainer:
    """PPO's side of the split loop's trainer pool (:class:`experiments.offpolicy_loop.SplitTrainer`): the actor,
    the critic and the reference, colocated over the pool; the KL controller is what the loop carries."""

    cfg: Config
    roles: Roles
    kl_ctrl: rf.KLControllerState
    num_mini: int
    actor_loss: Any
    critic_loss: Any
    title: str = "PPO"

    def states(self) -> dict[str, Any]:
        return self.roles.checkpoint_states()

    def load(self, states: dict[str, Any], carried: dict) -> None:
        self.roles.load_checkpoint_states(states)
        self.kl_ctrl = rf.KLControllerState(**carried["kl_ctrl"])

    def carried(self) -> dict:
        return {"kl_ctrl": {"beta": self.kl_ctrl.beta, "target_kl": self.kl_ctrl.target_kl, "horizon": self.kl_ctrl.horizon}}

    def weights(self, bridge: Any) -> Any:
        return bridge.weights(self.roles.actor_engine, self.roles.actor)

    def train(self, batch: rf.RolloutBatch, step: int, waited: float) -> dict[str, float]:
        """The colocated step's phases 3-5 on the received batch: old log-probs (recomputed: the batch is
        off-policy), the reference's, values, token rewards -> GAE, critic update, actor update after the warm-up."""
        t0, cfg, roles = time.time(), self.cfg, self.roles
        batch = roles.compute_values(roles.reference_logprobs(roles.old_logprobs(batch)))
        env = roles.env("critic")
        batch, self.kl_ctrl, kl_stats = advantages(batch, self.kl_ctrl, cfg, env)
        critic_metrics = roles.update_critic(batch, self.critic_loss, epochs=cfg.algo.ppo_epochs, mini_batches=self.num_mini)
        actor_metrics = []
        if step > cfg.algo.critic_warmup:
            loss_fn = functools.partial(self.actor_loss, seed=loss_seed(cfg.seed, step, replica=env.rank))
            actor_metrics = roles.update_actor(batch, loss_fn, epochs=cfg.algo.ppo_epochs, mini_batches=self.num_mini,
                                               with_entropy=True)
        step_time = time.time() - t0 + waited
        return {**batch_stats(batch, cfg, env, env.world_size, step_time), **kl_stats, **mean_metrics(actor_metrics),
                **{f"critic/{k}": v for k, v in mean_metrics(critic_metrics).items()},
                "step_time_s": step_time, "rollout_time_s": waited, **{f"time/{k}_s": v for k, v in roles.step_times().items()}}

    def export(self, run: RunPaths, tokenizer: Any) -> None:
        export(self.cfg, self.roles, run, tokenizer)


def build_actor_critic_trainer(cfg: Config, engine: Any, critic_engine: Any, run: RunPaths, data: RunData, tokenizer: Any,
                               rl_optim: OptimConfig, critic_optim: OptimConfig, mlog: Any, num_mini: int,
                               policy_loss: Any, mesh: Any, env: Any, before_sft_update: Any) -> ActorCriticTrainer:
    """The roles on the trainer pool: the actor (after the SFT stage on a fresh run with SFT data), the critic from the
    policy's backbone with a seeded value head, the frozen reference; a fresh KL controller."""
    roles = Roles(placement=colocated_on_pool(env, mesh), actor_engine=engine, critic_engine=critic_engine)
    roles.actor = start_policy(cfg, engine, env, run, data, tokenizer, rl_optim, mlog, build_kwargs={"mesh": mesh},
                               before_sft_update=before_sft_update)
    roles.build_critic(run.policy_path, critic_optim, seed=cfg.seed)
    if needs_reference(cfg.algo):
        roles.build_reference(cfg.reference, run.policy_path, cfg.actor.fsdp)
    return ActorCriticTrainer(
        cfg=cfg, roles=roles, kl_ctrl=kl_controller(cfg.algo), num_mini=num_mini,
        actor_loss=make_actor_loss(policy_loss, cfg.algo, horizon=cfg.rollout.max_new_tokens),
        critic_loss=value_loss_fn(clip_range=cfg.algo.cliprange_value, agg="token-mean", horizon=cfg.rollout.max_new_tokens),
    )


def kl_controller(algo: AlgoConfig) -> rf.KLControllerState:
    """The KL controller's starting state (fixed or adaptive beta)."""
    if algo.kl_ctrl == "adaptive":
        return rf.adaptive_kl_controller(algo.kl_reward_coef, target_kl=algo.target_kl, horizon=algo.horizon)
    return rf.fixed_kl_controller(algo.kl_reward_coef)


if __name__ == "__main__":
    main(sys.argv[1:])
