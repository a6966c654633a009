"""GRPO on a synthetic verifiable task: a tiny language model learns integer addition.

Run:  python experiments/grpo_arithmetic.py                      (one process)
      torchrun --nproc_per_node 2 experiments/grpo_arithmetic.py  (FSDP2 over 2 ranks)
      ... key=value overrides, e.g. steps=40 rollout.n=8 actor.optim.lr=5e-4 algo.kl_coef=0.01

Reads top to bottom: config -> model -> supervised warm start -> (held-out eval) -> RL loop
[rollout -> reward -> log-probs -> advantages -> policy update -> weight sync] -> (held-out eval) -> summary.
"""

from __future__ import annotations

import functools
import json
import math
import sys
import time
from pathlib import Path

import attrs
import torch
import torch.distributed as dist
from tqdm import tqdm

import rlfunc as rf
from backends.arithmetic_task import ArithmeticTask, Problem
from backends.config import apply_overrides, config_keys, config_to_dict
from backends.distributed import barrier, broadcast_object, get_logger, init_distributed, seed_everything, shutdown
from backends.hf_export import export_hf
from backends.fsdp_engine import FSDPConfig, TrainState, build_actor, build_reference, compute_logprobs, full_state_dict, update
from backends.metrics_log import MetricsLog, plot_curves, read_jsonl
from backends.models import TinyModelConfig, build_char_tokenizer, load_tokenizer, write_tiny_model
from backends.optim import OptimConfig, build_optimizer, lr_schedule
from backends.rollout_native import SamplingConfig, build_native_rollout, decode_responses, generate, sync_weights


@attrs.frozen
class WarmStartConfig:
    """Supervised fine-tuning on (prompt, answer) pairs so the model starts imperfect, not random."""

    steps: int = 300
    batch_size: int = 64  # global rows per step
    optim: OptimConfig = OptimConfig(lr=2e-3, weight_decay=0.0, lr_warmup_steps_ratio=0.1, lr_scheduler_type="cosine", min_lr_ratio=0.1)


@attrs.frozen
class AlgoConfig:
    estimator: str = "grpo"  # any name in rlfunc's advantage registry with outcome scores
    norm_by_std: bool = True  # False: Dr.GRPO
    policy_loss: str = "vanilla"  # any name in rlfunc's policy-loss registry
    clip_low: float = 0.2
    clip_high: float = 0.28  # clip-higher (DAPO)
    agg: str = "token-mean"
    kl_coef: float = 0.0  # > 0 adds a KL-to-reference loss term
    kl_kind: str = "k3"
    ppo_epochs: int = 1
    mini_batches: int = 1  # optimizer steps per RL step (per epoch)


@attrs.frozen
class Config:
    name: str = "grpo_arithmetic"
    seed: int = 0
    steps: int = 30  # RL steps
    prompts_per_step: int = 16  # global, split over ranks
    eval_every: int = 0  # 0: only before and after
    run_root: str = "runs"
    model_path: str = ""  # a local HF dir; empty: write a tiny random model into the run dir
    tiny: TinyModelConfig = TinyModelConfig()
    task: ArithmeticTask = ArithmeticTask()
    warm_start: WarmStartConfig = WarmStartConfig()
    actor: "ActorConfig" = attrs.Factory(lambda: ActorConfig())
    rollout: SamplingConfig = SamplingConfig(n=8, temperature=1.0, max_new_tokens=6)
    ref_log_prob_micro_batch_size: int = 64
    algo: AlgoConfig = AlgoConfig()


@attrs.frozen
class ActorConfig:
    optim: OptimConfig = OptimConfig(lr=1e-3, weight_decay=0.0, clip_grad=1.0)
    fsdp: FSDPConfig = FSDPConfig(micro_batch_size=64)


def main(argv: list[str]) -> dict:
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        print("config keys:\n  " + "\n  ".join(config_keys(Config)))
        return {}
    cfg = apply_overrides(Config(), argv)
    env = init_distributed()
    log = get_logger("grpo", env)
    seed_everything(cfg.seed)
    if cfg.prompts_per_step % env.world_size:
        raise ValueError(f"prompts_per_step={cfg.prompts_per_step} must be divisible by world size {env.world_size}")

    # Run directory and base model: rank 0 creates them, everyone waits.
    run_dir = Path(broadcast_object(str(Path(cfg.run_root) / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")))
    model_path = Path(cfg.model_path) if cfg.model_path else run_dir / "base_model"
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2))
        if not cfg.model_path:
            write_tiny_model(model_path, cfg.tiny, build_char_tokenizer())
    barrier()
    tokenizer = load_tokenizer(model_path)
    metrics_log = MetricsLog(run_dir, enabled=env.is_main)
    t_start = time.time()

    # Supervised warm start, through the same engine and the same pure-loss interface as RL.
    actor = build_actor(model_path, env, _with_total(cfg.warm_start.optim, cfg.warm_start.steps), cfg.actor.fsdp)
    stream = cfg.task.train_stream(seed=cfg.seed)
    for step in tqdm(range(cfg.warm_start.steps), desc="warm start", disable=not env.is_main):
        problems = _shard(stream.take(cfg.warm_start.batch_size), env)
        actor, m = update(actor, _sft_batch(problems, tokenizer), _nll_loss)
        if step % 20 == 0 or step == cfg.warm_start.steps - 1:
            metrics_log.log(step - cfg.warm_start.steps, {"sft_loss": m["loss"]})
    rl_updates = cfg.steps * cfg.algo.ppo_epochs * cfg.algo.mini_batches
    actor = _fresh_optimizer(actor, _with_total(cfg.actor.optim, rl_updates))

    # The warm-started policy is an HF checkpoint: the RL phase's starting point and its frozen reference.
    warm_path = export_hf(actor, run_dir / "warm_start_model", tokenizer=tokenizer) if cfg.warm_start.steps else model_path
    rollout = build_native_rollout(warm_path, tokenizer)
    reference = None
    if cfg.algo.kl_coef > 0:
        reference = build_reference(warm_path, env, cfg.actor.fsdp, log_prob_micro_batch_size=cfg.ref_log_prob_micro_batch_size)

    heldout = cfg.task.heldout()
    eval_before = evaluate(rollout, tokenizer, heldout, cfg, env)
    log.info(f"held-out success before RL: {eval_before:.3f} ({len(heldout)} prompts)")

    loss_fn = functools.partial(
        policy_and_kl_loss, policy_loss=rf.get_policy_loss(cfg.algo.policy_loss), cfg=cfg.algo,
        horizon=cfg.rollout.max_new_tokens,
    )
    estimator = rf.get_advantage_estimator(cfg.algo.estimator)
    for step in tqdm(range(1, cfg.steps + 1), desc="GRPO", disable=not env.is_main):
        t0 = time.time()
        # 1. rollout: n samples per prompt, on this rank's share of the prompts
        problems = _shard(stream.take(cfg.prompts_per_step), env)
        prompts = [tokenizer.encode(p.prompt) for p in problems]
        batch = generate(rollout, prompts, cfg.rollout, seed=(cfg.seed * 1_000_003 + step) * env.world_size + env.rank)
        t_rollout = time.time() - t0
        # 2. verifiable reward, one score per sequence
        answers = [problems[g].answer for g in batch.group_ids.tolist()]
        texts = decode_responses(tokenizer, batch)
        scores = torch.tensor([rf.arithmetic_reward(t, a) for t, a in zip(texts, answers)])
        batch = batch.replace(scores=scores)
        # 3. log-probs of the sampled tokens under the current policy (and the reference)
        batch = batch.replace(old_logprobs=compute_logprobs(actor, batch).logprobs)
        if reference is not None:
            batch = batch.replace(ref_logprobs=compute_logprobs(reference, batch).logprobs)
        # 4. advantages from group-relative scores (pure rlfunc)
        adv, ret = estimator(scores, batch.group_ids, batch.response_mask, **_estimator_kwargs(cfg.algo))
        batch = batch.replace(advantages=adv, returns=ret)
        # 5. policy update(s)
        for _ in range(cfg.algo.ppo_epochs):
            for mini in rf.split(batch, cfg.algo.mini_batches):
                actor, m = update(actor, mini, loss_fn)
        # 6. weight sync: stream the full tensors from the FSDP shards into the rollout engine
        rollout = sync_weights(rollout, full_state_dict(actor))
        dt = time.time() - t0
        n_tokens = _all_sum(batch.response_mask.sum().float() + batch.prompt_mask.sum().float(), env)
        stats = {
            "reward_mean": _all_mean(scores.mean(), env),
            "success_rate": _all_mean((scores > 0.5).float().mean(), env),
            "response_length": _all_mean(batch.response_mask.sum(-1).float().mean(), env),
            "tokens_per_s": n_tokens / dt,
            "step_time_s": dt,
            "rollout_time_s": t_rollout,
            **m,
        }
        if cfg.eval_every and step % cfg.eval_every == 0:
            stats["eval_success"] = evaluate(rollout, tokenizer, heldout, cfg, env)
        metrics_log.log(step, stats)
        log.info(" ".join(f"{k}={v:.4g}" for k, v in stats.items() if isinstance(v, float)) + f" step={step}")

    eval_after = evaluate(rollout, tokenizer, heldout, cfg, env)
    wall = time.time() - t_start
    summary = {
        "eval_before": eval_before,
        "eval_after": eval_after,
        "steps": cfg.steps,
        "wall_seconds": round(wall, 1),
        "world_size": env.world_size,
        "run_dir": str(run_dir),
    }
    if env.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] > 0]
        plot_curves(rows, ["reward_mean", "success_rate", "kl", "entropy"], run_dir / "reward_curve.png", title=cfg.name)
        verdict = "rose" if eval_after > eval_before else "did NOT rise"
        print(
            f"\nheld-out success {eval_before:.1%} -> {eval_after:.1%}: the reward {verdict} "
            f"({cfg.steps} GRPO steps, {wall:.0f} s, {env.world_size} rank(s)); run dir {run_dir}",
            flush=True,
        )
    metrics_log.close()
    shutdown(env)
    return summary


# ---------------------------------------------------------------------------------------------------
# The pieces the loop above calls. Losses are pure rlfunc compositions; the rest is plumbing.


def policy_and_kl_loss(out, mb: rf.RolloutBatch, norms: rf.Normalizers, *, policy_loss, cfg: AlgoConfig, horizon: int):
    """Clipped policy loss (+ k-estimator KL to the reference); the backend passes global normalisers."""
    loss, metrics = policy_loss(
        out.logprobs, mb.old_logprobs, mb.advantages, mb.response_mask,
        clip_low=cfg.clip_low, clip_high=cfg.clip_high, agg=cfg.agg, norms=norms, horizon=horizon,
    )
    if mb.ref_logprobs is not None:
        kl, _ = rf.kl_loss(out.logprobs, mb.ref_logprobs, mb.response_mask, kind=cfg.kl_kind, agg=cfg.agg, norms=norms, horizon=horizon)
        loss = loss + cfg.kl_coef * kl
        metrics = {**metrics, "kl": kl.detach()}
    if out.entropy is not None:
        metrics = {**metrics, "entropy": rf.aggregate(out.entropy.detach(), mb.response_mask, "token-mean", norms)}
    return loss, metrics


def _nll_loss(out, mb: rf.RolloutBatch, norms: rf.Normalizers):
    """Supervised warm start: token-mean negative log-likelihood of the answer tokens."""
    loss = rf.aggregate(-out.logprobs, mb.response_mask, "token-mean", norms)
    return loss, {}


def _estimator_kwargs(cfg: AlgoConfig) -> dict:
    return {"norm_by_std": cfg.norm_by_std} if cfg.estimator == "grpo" else {}


def _sft_batch(problems: list[Problem], tokenizer) -> rf.RolloutBatch:
    """(prompt, answer + EOS) pairs as a RolloutBatch, the answer in the response slot."""
    prompts = [tokenizer.encode(p.prompt) for p in problems]
    answers = [tokenizer.encode(str(p.answer)) + [tokenizer.eos_token_id] for p in problems]
    p_len, r_len = max(map(len, prompts)), max(map(len, answers))
    pad = tokenizer.pad_token_id
    prompt_ids = torch.tensor([[pad] * (p_len - len(x)) + x for x in prompts])
    response_ids = torch.tensor([x + [pad] * (r_len - len(x)) for x in answers])
    return rf.RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_ids != pad, response_ids=response_ids,
        response_mask=torch.tensor([[True] * len(x) + [False] * (r_len - len(x)) for x in answers]),
        group_ids=torch.arange(len(problems)),
    )


@torch.no_grad()
def evaluate(rollout, tokenizer, problems: list[Problem], cfg: Config, env) -> float:
    """Greedy held-out success rate, each rank scoring its share of the problems."""
    mine = problems[env.rank :: env.world_size]
    greedy = attrs.evolve(cfg.rollout, n=1, temperature=0.0)
    batch = generate(rollout, [tokenizer.encode(p.prompt) for p in mine], greedy)
    texts = decode_responses(tokenizer, batch)
    correct = torch.tensor(float(sum(rf.arithmetic_reward(t, p.answer) for t, p in zip(texts, mine))))
    return _all_sum(correct, env) / len(problems)


def _with_total(optim: OptimConfig, total_steps: int) -> OptimConfig:
    return attrs.evolve(optim, total_training_steps=total_steps)


def _fresh_optimizer(state: TrainState, optim: OptimConfig) -> TrainState:
    """Same weights, a new AdamW and LR schedule (the RL phase does not inherit the warm start's moments)."""
    return state.replace(
        optimizer=build_optimizer(state.module.parameters(), optim), optim_cfg=optim, lr_schedule=lr_schedule(optim), step=0
    )


def _shard(items: list, env) -> list:
    return items[env.rank :: env.world_size]


def _all_sum(x: torch.Tensor, env) -> float:
    x = x.detach().float().clone()
    if env.world_size > 1:
        dist.all_reduce(x)
    return float(x)


def _all_mean(x: torch.Tensor, env) -> float:
    return _all_sum(x, env) / env.world_size


if __name__ == "__main__":
    main(sys.argv[1:])
