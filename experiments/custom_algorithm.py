"""A new algorithm in a few lines: compose pure rlfunc functions, hand the loss to the engine.

Two variants on the integer-addition task, picked with ``algo.name``:

- ``reinforce_pp_baseline`` (default): REINFORCE++-baseline advantages (score minus the group mean,
  then whitened over the batch) with a k3 KL loss to the frozen warm-started reference;
- ``dr_grpo``: Dr.GRPO (https://arxiv.org/abs/2503.20783): group-mean advantages without the std
  division, and the ``seq-mean-token-sum-norm`` aggregation (no length normalisation bias).

Run:  python experiments/custom_algorithm.py [key=value ...]
      torchrun --standalone --nproc_per_node 2 experiments/custom_algorithm.py algo.name=dr_grpo
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import attrs
import torch.distributed as dist

import rlfunc as rf
from backends.checkpoint.hf_export import export_hf
from backends.config import apply_overrides, config_keys, config_to_dict
from backends.cpu import tune_process
from backends.distributed.setup import barrier, broadcast_object, global_masked_whiten, init_distributed, seed_everything, shutdown
from backends.metrics_log import MetricsLog, plot_curves, read_jsonl
from backends.models import TinyModelConfig, build_char_tokenizer, load_tokenizer, write_tiny_model
from backends.rollout.native import SamplingConfig, build_native_rollout, generate, sync_weights
from backends.training.fsdp import FSDPConfig, build_actor, build_reference, compute_logprobs, full_state_dict, update
from backends.training.optim import OptimConfig, fresh_optimizer
from backends.training.sft import sft_optim
from experiments.tasks.arithmetic import ArithmeticTask, WarmStartConfig, evaluate, score_responses, warm_start


@attrs.frozen
class AlgoConfig:
    name: str = "reinforce_pp_baseline"  # reinforce_pp_baseline | dr_grpo
    clip: float = 0.2
    kl_coef: float = 0.001  # reinforce_pp_baseline: weight of the k3 KL loss


@attrs.frozen
class Config:
    name: str = "custom_algorithm"
    seed: int = 0
    steps: int = 150
    prompts_per_step: int = 16
    warm_start: WarmStartConfig = WarmStartConfig(steps=600)
    optim: OptimConfig = OptimConfig(lr=1e-3, weight_decay=0.0)
    fsdp: FSDPConfig = FSDPConfig(micro_batch_size=64)
    run_root: str = "runs"
    tiny: TinyModelConfig = TinyModelConfig(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=352)
    task: ArithmeticTask = ArithmeticTask()
    rollout: SamplingConfig = SamplingConfig(n=8, max_new_tokens=6)
    algo: AlgoConfig = AlgoConfig()


# ---------------------------------------------------------------------------------------------------
# The algorithm: advantages and a loss, each a pure function of tensors.


def advantages(batch: rf.RolloutBatch, algo: AlgoConfig, whiten=rf.masked_whiten) -> rf.RolloutBatch:
    """``whiten``: the recipe passes backends.distributed.setup.global_masked_whiten (the whole batch, all ranks)."""
    if algo.name == "reinforce_pp_baseline":
        adv, ret = rf.reinforce_pp_baseline(batch.scores, group_ids=batch.group_ids, response_mask=batch.response_mask)
        adv = whiten(adv, batch.response_mask)
    else:  # dr_grpo
        adv, ret = rf.grpo(batch.scores, group_ids=batch.group_ids, response_mask=batch.response_mask, norm_by_std=False)
    return batch.replace(advantages=adv, returns=ret)


def loss_fn(out, mb: rf.RolloutBatch, norms: rf.Normalizers, *, algo: AlgoConfig, horizon: int):
    agg = "token-mean" if algo.name == "reinforce_pp_baseline" else "seq-mean-token-sum-norm"
    loss, metrics = rf.ppo_policy_loss(
        out.logprobs, old_logprobs=mb.old_logprobs, advantages=mb.advantages, response_mask=mb.response_mask,
        clip_low=algo.clip, clip_high=algo.clip, agg=agg, norms=norms, horizon=horizon,
    )
    if _uses_kl(algo):
        kl, kl_metrics = rf.kl_loss(out.logprobs, ref_logprobs=mb.ref_logprobs, mask=mb.response_mask, kind="k3", agg=agg, norms=norms)
        loss, metrics = loss + algo.kl_coef * kl, {**metrics, **kl_metrics}
    return loss, metrics


def _uses_kl(algo: AlgoConfig) -> bool:
    return algo.name == "reinforce_pp_baseline" and algo.kl_coef > 0


# ---------------------------------------------------------------------------------------------------
# The loop: backends do the stateful work.


def main(argv: list[str]) -> dict:
    tune_process()  # process-wide allocator / oneDNN settings: before any model is built
    if "--help" in argv or "-h" in argv:
        print(__doc__ + "\nconfig keys:\n  " + "\n  ".join(config_keys(Config)))
        return {}
    cfg = apply_overrides(Config(), argv)
    if cfg.algo.name not in ("reinforce_pp_baseline", "dr_grpo"):
        raise SystemExit(f"error: algo.name must be reinforce_pp_baseline or dr_grpo, got {cfg.algo.name!r}")
    env = init_distributed()
    seed_everything(cfg.seed)
    run_dir = Path(broadcast_object(str(Path(cfg.run_root) / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")))
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2))
        write_tiny_model(run_dir / "base_model", cfg.tiny, build_char_tokenizer())
    barrier()
    tokenizer, log, t_start = load_tokenizer(run_dir / "base_model"), MetricsLog(run_dir, enabled=env.is_main), time.time()

    # Supervised warm start (same as the GRPO recipe), then a fresh optimizer for RL.
    actor = build_actor(run_dir / "base_model", env, sft_optim(cfg.warm_start), cfg.fsdp)
    stream = cfg.task.train_stream(seed=cfg.seed)
    actor = warm_start(actor, stream, tokenizer, cfg.warm_start, data_parallel=(env.rank, env.world_size),
                       show_progress=env.is_main)
    actor = fresh_optimizer(actor, cfg.optim)
    warm_path = export_hf(actor, run_dir / "warm_start_model", tokenizer=tokenizer)
    rollout = build_native_rollout(warm_path, tokenizer)
    reference = build_reference(warm_path, env, cfg.fsdp) if _uses_kl(cfg.algo) else None

    heldout, eval_sampling = cfg.task.heldout(), attrs.evolve(cfg.rollout, n=4)
    eval_before = evaluate(rollout, tokenizer, heldout, eval_sampling, env)
    for step in range(1, cfg.steps + 1):
        problems = stream.take(cfg.prompts_per_step)[env.rank :: env.world_size]
        batch = generate(rollout, [tokenizer.encode(p.prompt) for p in problems], cfg.rollout,
                         seed=(cfg.seed * 1_000_003 + step) * env.world_size + env.rank)
        batch = batch.replace(scores=score_responses(batch, problems, tokenizer))
        batch = batch.replace(old_logprobs=compute_logprobs(actor, batch).logprobs)
        if reference is not None:
            batch = batch.replace(ref_logprobs=compute_logprobs(reference, batch).logprobs)
        batch = advantages(batch, cfg.algo, whiten=global_masked_whiten)
        actor, m = update(actor, batch, lambda out, mb, norms: loss_fn(out, mb, norms, algo=cfg.algo, horizon=cfg.rollout.max_new_tokens))
        rollout = sync_weights(rollout, full_state_dict(actor))
        reward = batch.scores.mean().reshape(1)
        if env.world_size > 1:
            dist.all_reduce(reward)
        log.log(step, {"reward_mean": float(reward) / env.world_size, **m})

    eval_after = evaluate(rollout, tokenizer, heldout, eval_sampling, env)
    summary = {"algorithm": cfg.algo.name, "eval_before": eval_before, "eval_after": eval_after, "steps": cfg.steps,
               "wall_seconds": round(time.time() - t_start, 1), "world_size": env.world_size, "run_dir": str(run_dir)}
    if env.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        plot_curves([r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] > 0], ["reward_mean", "kl_mean"], run_dir / "reward_curve.png", title=cfg.algo.name)
        print(f"{cfg.algo.name}: held-out success {eval_before:.1%} -> {eval_after:.1%} ({cfg.steps} steps); see {run_dir}", flush=True)
    log.close()
    shutdown(env)
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
