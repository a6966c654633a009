"""PPO (verl's default algorithm: actor + critic + GAE) on the synthetic integer-addition task.

Run:  python experiments/ppo_arithmetic.py                                         (one process)
      torchrun --standalone --nproc_per_node 2 experiments/ppo_arithmetic.py      (FSDP2 over 2 ranks)
      ... key=value overrides, e.g. steps=100 algo.kl_ctrl=adaptive algo.use_kl_loss=true
      --help lists every key and the config presets.
      ... preset=ref/dp_ref actor.optim=@optim/fsdp actor.optim.lr=1e-5     (presets, then overrides)
      ... actor.backend=megatron actor.tp=2 (or actor.pp=2): the actor and the critic on megatron-core
          tensor / pipeline parallel (colocated placement)

Placement (where the roles run):
      torchrun --standalone --nproc_per_node 4 experiments/ppo_arithmetic.py placement.mode=split \
          placement.actor_pool=2 placement.critic_pool=2
actor + rollout on ranks 0-1, critic + reference on ranks 2-3: batches cross between the pools, and the
critic update runs at the same time as the actor update and weight sync. Colocated (the default) runs
every role on every rank. Split runs checkpoint and resume too (each pool saves its own roles), and export
HF dirs and orbax (the actor pool gathers and writes the actor's).

Checkpoints and exact resume:
      ... checkpoint.every=10 checkpoint.dir=/ckpt/ppo run_dir=runs/ppo-1     (save every 10 steps)
      ... resume=auto checkpoint.dir=/ckpt/ppo                  (after a crash: continue from the newest
                                                                 complete checkpoint, in the same run dir)
      ... resume=/ckpt/ppo/step_20                              (from that checkpoint)
A checkpoint holds the actor and the critic (weights + AdamW, sharded), the step, every rank's RNG, the
data-stream position and the KL-controller state; a resumed run on the same world size logs the same
per-step metrics as an uninterrupted one. Resuming with a config that changes the run (another model,
task, algorithm or optimizer setting) fails before any work, naming the differing keys.

Reads top to bottom: config -> placement -> [resume point] -> model -> supervised warm start -> held-out eval
-> RL loop [rollout -> reward -> log-probs (actor, reference) -> values -> token rewards (score - beta * KL)
-> GAE -> critic update -> actor update -> weight sync -> log / checkpoint] -> held-out eval -> HF / orbax
export -> summary. The roles and the batch moves between their pools live in ``backends.training.roles``,
so the loop is the same under both placements: each phase runs on the ranks that hold its role.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import torch
from tqdm import tqdm

import rlfunc as rf
from backends.checkpoint.dcp import checkpoint_info, load_checkpoint, save_checkpoint
from backends.checkpoint.orbax import save_orbax
from backends.checkpoint.resume import CheckpointConfig, checkpoint_dir, resume_point, truncate_metrics
from backends.config import apply_overrides, available_presets, config_keys, config_to_dict
from backends.cpu import tune_process
from backends.distributed.placement import PlacementConfig
from backends.distributed.setup import all_reduce_sum, barrier, get_logger, global_masked_whiten, init_distributed, seed_everything, shutdown
from backends.metrics_log import MetricsLog, plot_curves, read_jsonl
from backends.models import TinyModelConfig, build_char_tokenizer, load_tokenizer, write_tiny_model
from backends.rollout.native import SamplingConfig, build_native_rollout, generate, sync_weights
from backends.training.engines import select_engine
from backends.training.fsdp import FSDPConfig, value_loss_fn
from backends.training.optim import OptimConfig, with_total_steps
from backends.training.reference import ReferenceConfig
from backends.training.roles import Roles, build_roles
from backends.training.sft import sft_optim
from experiments.tasks.arithmetic import ArithmeticTask, WarmStartConfig, evaluate, score_responses, warm_start


@attrs.frozen
class AlgoConfig:
    """verl's ``algorithm.*`` (adv_estimator=gae) and ``actor/critic`` PPO settings."""

    gamma: float = 1.0
    lam: float = 0.95
    clip_ratio: float = 0.2  # actor.clip_ratio_low / high
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages (verl's default)
    agg: str = "token-mean"  # actor.loss_agg_mode
    cliprange_value: float = 0.5  # critic.cliprange_value
    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 0  # prompts per optimizer step (global, x rollout.n rows); 0: the whole step's batch
    critic_warmup: int = 10  # steps that train only the critic (its value head starts random)
    # KL to the frozen warm-started reference: in the reward (InstructGPT) and/or as a loss term (GRPO-style)
    kl_in_reward: bool = True
    kl_penalty: str = "kl"  # estimator in the reward (k1 = "kl", abs, mse, low_var_kl, ...)
    kl_ctrl: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001  # (initial) beta of the controller
    target_kl: float = 0.1  # adaptive only
    horizon: int = 10000  # adaptive only
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"  # k1..k3 / low_var_kl, "+" for straight-through gradients


@attrs.frozen
class ActorConfig:
    optim: OptimConfig = OptimConfig(lr=3e-4, weight_decay=0.0, clip_grad=1.0)
    fsdp: FSDPConfig = FSDPConfig(micro_batch_size=64)
    #: "fsdp" or "megatron" for the actor *and the critic* (megatron keeps one tp / pp layout per process);
    #: tp / pp: megatron's tensor / pipeline-parallel sizes (data parallel = world / (tp * pp))
    backend: str = "fsdp"
    tp: int = 1
    pp: int = 1


@attrs.frozen
class CriticConfig:
    optim: OptimConfig = OptimConfig(lr=1e-3, weight_decay=0.0, clip_grad=1.0)
    fsdp: FSDPConfig = FSDPConfig(micro_batch_size=64)


@attrs.frozen
class ExportConfig:
    hf: bool = True  # actor and critic as HF dirs (transformers / vLLM load them)
    orbax: bool = False  # the gathered actor train state as an orbax PyTree (JAX interop)


@attrs.frozen
class Config:
    name: str = "ppo_arithmetic"
    seed: int = 0
    #: 400 steps x 32 prompts x 8 samples: fewer steps and prompts left too few samples for the critic and
    #: the policy to improve on the warm start (see README)
    steps: int = 400  # RL steps
    prompts_per_step: int = 32  # global, split over ranks
    eval_every: int = 0  # 0: only before and after
    eval_samples: int = 4  # samples per held-out prompt for the sampled success rate
    run_root: str = "runs"
    run_dir: str = ""  # empty: <run_root>/<name>-<time>, or the resumed checkpoint's run dir
    resume: str = "never"  # never | auto | <a step_N checkpoint dir>
    model_path: str = ""  # a local HF dir (Llama / Qwen2); empty: write a tiny random model into the run dir
    tiny: TinyModelConfig = TinyModelConfig(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=352)
    task: ArithmeticTask = ArithmeticTask()
    warm_start: WarmStartConfig = WarmStartConfig(steps=600)
    actor: ActorConfig = ActorConfig()
    critic: CriticConfig = CriticConfig()
    reference: ReferenceConfig = ReferenceConfig(log_prob_micro_batch_size=64)
    placement: PlacementConfig = PlacementConfig()
    rollout: SamplingConfig = SamplingConfig(n=8, temperature=1.0, max_new_tokens=6)
    algo: AlgoConfig = AlgoConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    export: ExportConfig = ExportConfig()


#: keys that may differ between a run and its resumption (where things go, not what is computed)
_RESUMABLE_KEYS = ("resume", "run_dir", "run_root", "checkpoint", "export", "eval_every")
PRESETS = Path(__file__).resolve().parent / "presets"


def main(argv: list[str]) -> dict:
    tune_process()  # process-wide allocator / oneDNN settings: before any model is built
    if "--help" in argv or "-h" in argv:
        print(__doc__ + "\nconfig keys:\n  " + "\n  ".join(config_keys(Config))
              + "\npresets (preset=<name> or <section>=@<name>):\n  " + "\n  ".join(available_presets(PRESETS)))
        return {}
    cfg = apply_overrides(Config(), argv, presets_dir=PRESETS)  # an unknown key fails here, before any work
    check_config(cfg)
    # the training engines of the actor and the critic (a bad name or size fails here, before any work)
    engine = select_engine(cfg.actor.backend, fsdp=cfg.actor.fsdp, tp=cfg.actor.tp, pp=cfg.actor.pp)
    critic_engine = select_engine(cfg.actor.backend, fsdp=cfg.critic.fsdp, tp=cfg.actor.tp, pp=cfg.actor.pp)
    env = init_distributed()
    log = get_logger("ppo", env)
    seed_everything(cfg.seed)
    roles = build_roles(cfg.placement, env, engine, critic_engine)  # which ranks hold which roles
    num_mini = num_mini_batches(cfg, roles.pool_size("actor"))
    run = prepare_run(cfg, env)
    metrics_log = MetricsLog(run.run_dir, enabled=env.is_main)
    rl_optim = with_total_steps(cfg.actor.optim, cfg.steps * cfg.algo.ppo_epochs * num_mini)
    critic_optim = with_total_steps(cfg.critic.optim, cfg.steps * cfg.algo.ppo_epochs * num_mini)
    t_start = time.time()

    # The actor (warm-started on a fresh run); the critic starts from the warm-started backbone with a fresh
    # (seeded) value head; the frozen reference is the warm-started policy; the rollout engine on the actor's
    # ranks holds an unsharded copy of the actor.
    stream, tokenizer = start_actor(cfg, roles, run, rl_optim, metrics_log)
    roles.build_critic(run.warm_path, critic_optim, seed=cfg.seed)
    if cfg.algo.kl_in_reward or cfg.algo.use_kl_loss:
        roles.build_reference(cfg.reference, run.warm_path, cfg.actor.fsdp)
    rollout = roles.run_on("actor", None, build_native_rollout, run.warm_path, tokenizer)
    if cfg.checkpoint.every or run.resume_from:
        roles.checkpoint_states()  # an engine that cannot checkpoint says so here, before any RL work
    kl_ctrl = (
        rf.adaptive_kl_controller(cfg.algo.kl_coef, target_kl=cfg.algo.target_kl, horizon=cfg.algo.horizon)
        if cfg.algo.kl_ctrl == "adaptive" else rf.fixed_kl_controller(cfg.algo.kl_coef)
    )
    heldout = cfg.task.heldout()
    if run.resume_from is None:
        first_step, wall_before = 1, 0.0
        before = roles.run_on("actor", None, evaluate_heldout, rollout, tokenizer, heldout, cfg, roles.env("actor"))
    else:  # each rank loads the roles it holds (split placement: one pool's)
        states, extra = load_checkpoint(run.resume_from, roles.checkpoint_states(), config=run.must_match)
        roles.load_checkpoint_states(states)
        stream = cfg.task.train_stream(seed=cfg.seed, drawn=extra["drawn"])
        kl_ctrl, first_step = rf.KLControllerState(**extra["kl_ctrl"]), extra["step"] + 1
        before, wall_before = (extra["eval_before"], extra["greedy_before"]), extra["wall_seconds"]
        rollout = roles.run_on("actor", None, lambda: sync_weights(rollout, roles.actor_weights()))
    roles.run_on("actor", None, lambda: log.info(
        f"held-out success before RL: {before[0]:.3f} sampled, {before[1]:.3f} greedy ({len(heldout)} prompts)"))

    actor_loss = functools.partial(ppo_loss, algo=cfg.algo, horizon=cfg.rollout.max_new_tokens)
    critic_loss = value_loss_fn(clip_range=cfg.algo.cliprange_value, agg="token-mean", horizon=cfg.rollout.max_new_tokens)
    for step in tqdm(range(first_step, cfg.steps + 1), desc="PPO", disable=not env.is_main, initial=first_step - 1, total=cfg.steps):
        t0 = time.time()
        # 1-2. rollout (n samples per prompt, this rank's share) and verifiable reward, on the actor's ranks
        batch = roles.run_on("actor", "rollout", sample_and_score, roles, rollout, stream, tokenizer, cfg, step)
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
        critic_metrics = roles.update_critic(critic_batch, critic_loss, epochs=cfg.algo.ppo_epochs, mini_batches=num_mini)
        actor_metrics = []
        if step > cfg.algo.critic_warmup:
            actor_metrics = roles.update_actor(batch, actor_loss, epochs=cfg.algo.ppo_epochs, mini_batches=num_mini, with_entropy=True)
            # 6. weight sync: stream full tensors from the FSDP / megatron shards into the rollout engine
            rollout = roles.run_on("actor", "weight_sync", lambda: sync_weights(rollout, roles.actor_weights()))
        # the critic's side of the step (KL statistics and controller, metrics, times) reaches the actor's ranks
        kl_stats, critic_metrics, kl_ctrl = roles.share((kl_stats, critic_metrics, kl_ctrl), "critic")
        times = roles.step_times()

        # 7. log (and evaluate) on the actor's ranks; checkpoint: every role (sharded, with AdamW), RNG, and
        #    what the loop carries as the actor's leader knows it (split: each pool saves its own roles)
        stats = {**kl_stats, **mean_metrics(actor_metrics), **{f"critic/{k}": v for k, v in mean_metrics(critic_metrics).items()},
                 "step_time_s": time.time() - t0, **{f"time/{k}_s": v for k, v in times.items()}}
        roles.run_on("actor", None, log_step, step, batch, stats, cfg, roles, rollout, tokenizer, heldout, metrics_log)
        if cfg.checkpoint.every and (step % cfg.checkpoint.every == 0 or step == cfg.steps):
            extra = roles.share({
                "step": step, "drawn": stream.drawn, "run_dir": str(run.run_dir),
                "kl_ctrl": {"beta": kl_ctrl.beta, "target_kl": kl_ctrl.target_kl, "horizon": kl_ctrl.horizon},
                "eval_before": before[0] if before else None, "greedy_before": before[1] if before else None,
                "wall_seconds": wall_before + time.time() - t_start,
            }, "actor")
            save_checkpoint(run.ckpt_dir, step, roles.checkpoint_states(), extra, keep_last=cfg.checkpoint.keep_last,
                            config=run.must_match)

    after = roles.run_on("actor", None, evaluate_heldout, rollout, tokenizer, heldout, cfg, roles.env("actor"))
    export(cfg, roles, run, tokenizer)
    summary = summarize(cfg, run, env, before, after, wall=wall_before + time.time() - t_start, num_heldout=len(heldout))
    barrier()  # both pools' exports are on disk before anyone returns
    metrics_log.close()
    shutdown(env)
    return summary


# ---------------------------------------------------------------------------------------------------
# Losses and rewards: compositions of pure rlfunc functions. The engine passes the global normalisers.


def ppo_loss(out, mb: rf.RolloutBatch, norms: rf.Normalizers, *, algo: AlgoConfig, horizon: int):
    """Clipped (dual-clip) PPO surrogate, plus ``kl_loss_coef`` times a KL estimate to the reference."""
    loss, metrics = rf.ppo_policy_loss(
        out.logprobs, old_logprobs=mb.old_logprobs, advantages=mb.advantages, response_mask=mb.response_mask,
        clip_low=algo.clip_ratio, clip_high=algo.clip_ratio, dual_clip=algo.clip_ratio_c, agg=algo.agg, norms=norms,
        horizon=horizon,
    )
    if algo.use_kl_loss:
        kl, _ = rf.kl_loss(out.logprobs, ref_logprobs=mb.ref_logprobs, mask=mb.response_mask, kind=algo.kl_loss_type,
                           agg=algo.agg, norms=norms, horizon=horizon)
        loss = loss + algo.kl_loss_coef * kl
        metrics = {**metrics, "kl_loss": kl.detach()}
    if out.entropy is not None:
        metrics = {**metrics, "entropy": rf.aggregate(out.entropy.detach(), mask=mb.response_mask, mode="token-mean", norms=norms)}
    return loss, metrics


def advantages(batch: rf.RolloutBatch, kl_ctrl: rf.KLControllerState, cfg: Config, env: Any):
    """Token rewards (score minus beta * KL to the reference) -> GAE -> whitened advantages, on the ranks
    of ``env`` (the critic's pool); the KL controller sees the KL averaged over those ranks.
    Returns ``(batch with token_rewards / advantages / returns, new controller, KL statistics)``."""
    token_rewards = outcome_token_rewards(batch.scores, response_mask=batch.response_mask)
    kl_stats = {}
    if cfg.algo.kl_in_reward:
        token_rewards, observed_kl = rf.apply_kl_penalty_to_rewards(
            token_rewards, logprobs=batch.old_logprobs, ref_logprobs=batch.ref_logprobs, mask=batch.response_mask,
            beta=kl_ctrl.beta, kind=cfg.algo.kl_penalty,
        )
        observed_kl = (all_reduce_sum(observed_kl.reshape(1), env.group) / env.world_size)[0]  # the same beta on every rank
        kl_stats = {"kl_reward": float(observed_kl), "kl_coef": float(kl_ctrl.beta)}
        kl_ctrl = rf.update_kl_controller(kl_ctrl, observed_kl=observed_kl, n_steps=cfg.prompts_per_step * cfg.rollout.n)
    adv, ret = rf.gae(token_rewards, values=batch.values, response_mask=batch.response_mask, gamma=cfg.algo.gamma, lam=cfg.algo.lam)
    adv = global_masked_whiten(adv, batch.response_mask, group=env.group)  # the whole batch, all ranks of the pool (as verl)
    return batch.replace(token_rewards=token_rewards, advantages=adv, returns=ret), kl_ctrl, kl_stats


def outcome_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``(b,), (b t) -> (b t)``: each sequence's score on its last response token, 0 elsewhere (verl's
    ``token_level_scores`` of a rule-based reward)."""
    last = (response_mask.long().cumsum(-1) == response_mask.sum(-1, keepdim=True)) & response_mask
    return torch.where(last, scores[:, None].to(torch.float32), torch.zeros((), dtype=torch.float32))


# ---------------------------------------------------------------------------------------------------
# Set-up, the actor pool's per-step work, export and summary.


def check_config(cfg: Config) -> None:
    """Settings that cannot work together fail here, on every rank, before any model is built."""
    if cfg.algo.kl_ctrl not in ("fixed", "adaptive"):
        raise ValueError(f"algo.kl_ctrl must be 'fixed' or 'adaptive', got {cfg.algo.kl_ctrl!r}")
    if cfg.actor.backend == "megatron" and (cfg.placement.mode == "split" or cfg.export.orbax or cfg.reference.ref_in_actor):
        raise ValueError(
            "actor.backend=megatron needs placement.mode=colocated (megatron's parallel layout spans every rank), "
            "export.orbax=false and reference.ref_in_actor=false (FSDP features)"
        )
    if cfg.placement.mode == "split" and cfg.reference.ref_in_actor:
        raise ValueError(
            "reference.ref_in_actor=true needs the actor and the reference on the same ranks; under placement.mode=split "
            "the reference lives on the critic pool: use placement.mode=colocated or a separate reference"
        )


def num_mini_batches(cfg: Config, actor_ranks: int) -> int:
    """Optimizer steps per epoch; the prompts are split over the actor's data-parallel ranks (megatron's
    TP / PP peers share rows)."""
    model_parallel = cfg.actor.tp * cfg.actor.pp
    if actor_ranks % model_parallel:
        raise ValueError(f"actor.tp * actor.pp = {model_parallel} must divide the actor's {actor_ranks} rank(s)")
    world_size = actor_ranks // model_parallel
    if cfg.prompts_per_step % world_size:
        raise ValueError(f"prompts_per_step={cfg.prompts_per_step} must be divisible by the world size {world_size}")
    size = cfg.algo.ppo_mini_batch_size or cfg.prompts_per_step
    if cfg.prompts_per_step % size or size % world_size:
        raise ValueError(
            f"algo.ppo_mini_batch_size={size} must divide prompts_per_step={cfg.prompts_per_step} and be divisible "
            f"by the world size {world_size}"
        )
    return cfg.prompts_per_step // size


@attrs.frozen
class RunPaths:
    """Where this run reads and writes, and the checkpoint it resumes from (``None``: a fresh start)."""

    run_dir: Path
    ckpt_dir: Path
    model_path: Path  # the base model
    warm_path: Path  # the warm-started policy (HF dir): the critic's backbone, the reference, the rollout's start
    resume_from: Path | None
    must_match: dict  # the config a checkpoint must have been written with


def prepare_run(cfg: Config, env: Any) -> RunPaths:
    """The resume point (checked against this config before anything is built) and the run dir: rank 0
    (the actor's first rank) writes the config and the tiny base model; a fresh start begins a new metrics
    log, a resumed one drops what the crashed run logged after its checkpoint."""
    must_match = {k: v for k, v in config_to_dict(cfg).items() if k not in _RESUMABLE_KEYS}
    resume_from, run_dir = resume_point(cfg.resume, cfg.checkpoint, run_dir=cfg.run_dir, run_root=cfg.run_root,
                                        name=cfg.name, must_match=must_match)
    model_path = Path(cfg.model_path) if cfg.model_path else run_dir / "base_model"
    run = RunPaths(run_dir=run_dir, ckpt_dir=checkpoint_dir(cfg.checkpoint, run_dir), model_path=model_path,
                   warm_path=run_dir / "warm_start_model" if cfg.warm_start.steps else model_path,
                   resume_from=resume_from, must_match=must_match)
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        truncate_metrics(run_dir / "metrics.jsonl", checkpoint_info(resume_from).step if resume_from else None)
        if resume_from is None:
            (run_dir / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2))
            if not cfg.model_path:
                write_tiny_model(model_path, cfg.tiny, build_char_tokenizer())
    barrier()
    return run


def start_actor(cfg: Config, roles: Roles, run: RunPaths, rl_optim: OptimConfig, metrics_log: MetricsLog) -> tuple[Any, Any]:
    """``(training stream, tokenizer)`` with the actor built on its ranks: on a fresh run, the supervised warm
    start, a fresh RL optimizer and the warm-started policy's HF dir (every pool builds from it); on a
    resume, the warm-started architecture that the checkpoint's weights then load into."""
    engine, stream = roles.actor_engine, cfg.task.train_stream(seed=cfg.seed)
    if run.resume_from is not None:
        roles.build_actor(run.warm_path, rl_optim)
        return stream, load_tokenizer(run.warm_path)
    tokenizer = load_tokenizer(run.model_path)
    roles.build_actor(run.model_path, sft_optim(cfg.warm_start) if cfg.warm_start.steps else rl_optim)
    if cfg.warm_start.steps:
        show = roles.placement.world.is_main
        roles.map_actor(lambda actor: warm_start(actor, stream, tokenizer, cfg.warm_start, data_parallel=engine.data_parallel(actor),
                                                 update_fn=engine.update, metrics_log=metrics_log, show_progress=show))
        roles.map_actor(lambda actor: engine.fresh_optimizer(actor, rl_optim))
        roles.run_on("actor", None, engine.export_hf, roles.actor, run.warm_path, tokenizer=tokenizer, overwrite=True)
    barrier()  # the warm-started model is on disk for every pool
    return stream, tokenizer


def sample_and_score(roles: Roles, rollout: Any, stream: Any, tokenizer: Any, cfg: Config, step: int) -> rf.RolloutBatch:
    """This data-parallel rank's share of the step's prompts, ``n`` samples each (explicit per-step seed),
    with one verifiable score per sample; megatron's TP / PP peers train on their replica's first rank's batch."""
    dp_rank, dp_size = roles.data_parallel()
    problems = stream.take(cfg.prompts_per_step)[dp_rank::dp_size]
    seed = (cfg.seed * 1_000_003 + step) * dp_size + dp_rank
    batch = roles.actor_engine.share_batch(roles.actor, generate(rollout, [tokenizer.encode(p.prompt) for p in problems], cfg.rollout, seed=seed))
    return batch.replace(scores=score_responses(batch, problems, tokenizer))


def evaluate_heldout(rollout: Any, tokenizer: Any, heldout: list, cfg: Config, env: Any) -> tuple[float, float]:
    """Held-out success ``(sampled: mean over cfg.eval_samples samples per prompt, greedy)`` over ``env``'s ranks."""
    sampled = evaluate(rollout, tokenizer, heldout, attrs.evolve(cfg.rollout, n=cfg.eval_samples), env)
    greedy = evaluate(rollout, tokenizer, heldout, attrs.evolve(cfg.rollout, n=1, temperature=0.0), env)
    return sampled, greedy


def log_step(step: int, batch: rf.RolloutBatch, stats: dict, cfg: Config, roles: Roles, rollout: Any, tokenizer: Any,
             heldout: list, metrics_log: MetricsLog) -> None:
    """On the actor's ranks: the batch's statistics averaged over them, the held-out success every
    ``eval_every`` steps, one metrics row, and a progress line every 10 steps."""
    env = roles.env("actor")
    local = torch.stack([
        batch.scores.mean(), (batch.scores > 0.5).float().mean(), batch.response_mask.sum(-1).float().mean(),
        rf.masked_mean(batch.values, batch.response_mask), rf.masked_mean(batch.returns, batch.response_mask),
        (batch.prompt_mask.sum() + batch.response_mask.sum()).float(),
    ])
    reward_mean, success_rate, response_length, values_mean, returns_mean, num_tokens = (
        all_reduce_sum(local, env.group) / env.world_size
    ).tolist()
    stats = {
        "reward_mean": reward_mean, "success_rate": success_rate, "response_length": response_length,
        "values_mean": values_mean, "returns_mean": returns_mean,
        "tokens_per_s": num_tokens * roles.data_parallel()[1] / stats["step_time_s"], **stats,
    }
    if cfg.eval_every and step % cfg.eval_every == 0:
        stats["eval_success"] = evaluate(rollout, tokenizer, heldout, attrs.evolve(cfg.rollout, n=cfg.eval_samples), env)
    metrics_log.log(step, stats)
    if roles.placement.world.is_main and (step % 10 == 0 or step == cfg.steps):
        keys = ("reward_mean", "success_rate", "kl_reward", "entropy", "clip_frac", "critic/loss", "grad_norm", "step_time_s")
        tqdm.write(f"step {step:4d} " + " ".join(f"{k}={stats[k]:.4g}" for k in keys if k in stats))


def mean_metrics(rows: list[dict]) -> dict:
    """Mean of each engine metric over this step's optimizer steps."""
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]} if rows else {}


def export(cfg: Config, roles: Roles, run: RunPaths, tokenizer: Any) -> None:
    """HF dirs of the actor (a causal LM) and the critic (a value model), orbax of the actor's train state
    (gathered over the actor's ranks)."""
    if cfg.export.hf:
        roles.export_hf(run.run_dir, tokenizer)
    if cfg.export.orbax:
        roles.run_on("actor", None, lambda: save_orbax(roles.actor, run.run_dir / "actor_orbax", overwrite=True))


def summarize(cfg: Config, run: RunPaths, env: Any, before: tuple | None, after: tuple | None, *, wall: float,
              num_heldout: int) -> dict:
    """The run's summary (rank 0 also writes summary.json, the reward curve and the verdict line); the
    held-out numbers are the actor's ranks' (None elsewhere)."""
    (eval_before, greedy_before), (eval_after, greedy_after) = before or (None, None), after or (None, None)
    summary = {
        "eval_before": eval_before,
        "eval_after": eval_after,
        "eval_metric": f"held-out success: mean over {cfg.eval_samples} samples per prompt at temperature {cfg.rollout.temperature}",
        "eval_greedy_before": greedy_before,
        "eval_greedy_after": greedy_after,
        "num_heldout": num_heldout,
        "steps": cfg.steps,
        "resumed_from": str(run.resume_from) if run.resume_from is not None else None,
        "wall_seconds": round(wall, 1),
        "world_size": env.world_size,
        "placement": cfg.placement.mode,
        "run_dir": str(run.run_dir),
    }
    if env.is_main:
        (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        rows = [r for r in read_jsonl(run.run_dir / "metrics.jsonl") if r["step"] > 0]
        plot_curves(rows, ["reward_mean", "eval_success", "kl_reward", "values_mean", "critic/loss"], run.run_dir / "reward_curve.png", title=cfg.name)
        verdict = "rose" if eval_after > eval_before else "did NOT rise"
        print(
            f"\nheld-out success {eval_before:.1%} -> {eval_after:.1%} (greedy {greedy_before:.1%} -> {greedy_after:.1%}): "
            f"the reward {verdict} ({cfg.steps} PPO steps, {wall:.0f} s, {env.world_size} rank(s)); see {run.run_dir}",
            flush=True,
        )
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
