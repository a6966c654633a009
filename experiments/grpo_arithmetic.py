"""GRPO on a synthetic verifiable task: a tiny language model learns integer addition.

Run:  python experiments/grpo_arithmetic.py                                        (one process)
      torchrun --standalone --nproc_per_node 2 experiments/grpo_arithmetic.py     (FSDP2 over 2 ranks)
      ... key=value overrides, e.g. steps=100 rollout.n=8 actor.optim.lr=5e-4 algo.kl_coef=0.01
      ... actor.backend=megatron actor.tp=2 (or actor.pp=2): megatron-core tensor / pipeline parallel
      --help lists every key.

Checkpoints and exact resume (FSDP, or megatron's CPU schedule with the same tp / pp):
      ... checkpoint.every=50 checkpoint.dir=/ckpt/grpo      (save every 50 steps and at the last)
      ... resume=auto checkpoint.dir=/ckpt/grpo              (after a crash: continue from the newest complete
                                                              checkpoint, in the same run dir)
      ... resume=/ckpt/grpo/step_100                         (from that checkpoint)
A checkpoint holds the actor (weights + AdamW, sharded), the step, every rank's RNG and the data-stream
position; a resumed run on the same world size logs the same metrics as an uninterrupted one.

Reads top to bottom: config -> [resume point] -> model -> supervised warm start -> held-out eval -> RL loop
[rollout -> reward -> log-probs -> advantages -> policy update -> weight sync -> checkpoint] -> held-out eval
-> summary.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path
from typing import Literal

import attrs
import torch
from tqdm import tqdm

import rlfunc as rf
from experiments.tasks.arithmetic import ArithmeticTask, evaluate, score_responses
from backends.checkpoint.dcp import checkpoint_info, load_checkpoint, save_checkpoint
from backends.config import apply_overrides, config_keys, config_to_dict
from backends.distributed.setup import all_reduce_sum, barrier, get_logger, init_distributed, seed_everything, shutdown
from backends.training.engines import select_engine
from backends.training.fsdp import FSDPConfig
from backends.metrics_log import MetricsLog, plot_curves, read_jsonl
from backends.models import TinyModelConfig, build_char_tokenizer, load_tokenizer, write_tiny_model
from backends.training.optim import OptimConfig, with_total_steps
from backends.checkpoint.resume import CheckpointConfig, checkpoint_dir, resume_point, truncate_metrics
from backends.rollout.api import RolloutConfig, build_rollout, generate, shutdown_rollout, sync_weights
from backends.rollout.native import generate_recording
from backends.training.sft import WarmStartConfig, supervised_warm_start, warm_start_optim


@attrs.frozen
class AlgoConfig:
    estimator: str = "grpo"  # an outcome estimator of rlfunc's registry: grpo, rloo, reinforce_pp_baseline, ...
    norm_by_std: bool = True  # grpo only; False is Dr.GRPO
    policy_loss: str = "vanilla"  # rlfunc's policy-loss registry: vanilla (PPO clip), gspo, cispo, gmpo, ...
    clip_low: float = 0.2
    clip_high: float = 0.28  # clip-higher (DAPO)
    agg: str = "token-mean"
    kl_coef: float = 0.0  # > 0 adds kl_coef * KL(policy || warm-started reference) to the loss
    kl_kind: str = "k3"
    entropy_coef: float = 0.0  # > 0 subtracts entropy_coef * (aggregated token entropy) from the loss (verl's entropy_coeff)
    ppo_epochs: int = 1
    mini_batches: int = 1  # optimizer steps per epoch
    rollout_is: Literal["none", "token", "sequence"] = "none"  # token | sequence: truncated IS weights for the rollout/trainer mismatch (TIS)
    rollout_is_cap: float = 2.0
    #: rows whose advantages are all 0 (groups whose samples all got the same reward) get no forward /
    #: backward in the update; they still count in the loss normalisers, so the gradient is unchanged.
    #: Applied only when that is exact: an advantage-proportional policy loss, kl_coef = entropy_coef = 0.
    #: The loss metrics (entropy, clip_frac) then cover the rows that ran; skipped_rows counts the rest.
    skip_zero_advantage: bool = True


@attrs.frozen
class ActorConfig:
    optim: OptimConfig = OptimConfig(lr=3e-4, weight_decay=0.0, clip_grad=1.0, lr_warmup_steps=10)
    fsdp: FSDPConfig = FSDPConfig(micro_batch_size=64)
    backend: str = "fsdp"  # "fsdp" or "megatron" (also runs the reference); tp / pp: megatron's sizes
    tp: int = 1
    pp: int = 1
    #: the update takes the linear layers' outputs from the rollout (which ran the same weights) instead of
    #: recomputing its forward pass: the backward's GEMMs only, the same gradient to float rounding
    #: (backends.rollout.native.generate_recording). Needs the fsdp backend with packed rows
    #: (fsdp.use_remove_padding=true), the native fp32 rollout, and one update per batch (ppo_epochs =
    #: mini_batches = 1, rollout_is = none); memory: every linear output of the rollout (BUILD.md).
    reuse_rollout_activations: bool = False


@attrs.frozen
class Config:
    name: str = "grpo_arithmetic"
    seed: int = 0
    steps: int = 1200  # RL steps
    prompts_per_step: int = 32  # global, split over ranks
    eval_every: int = 100  # 0: only before and after
    eval_samples: int = 4  # samples per held-out prompt for the sampled success rate
    run_root: str = "runs"
    run_dir: str = ""  # empty: <run_root>/<name>-<time>, or the resumed checkpoint's run dir
    resume: str = "never"  # never | auto | <a step_N checkpoint dir>
    checkpoint: CheckpointConfig = CheckpointConfig()
    model_path: str = ""  # a local HF dir (Llama / Qwen2); empty: write a tiny random model into the run dir
    tiny: TinyModelConfig = TinyModelConfig(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=352)
    task: ArithmeticTask = ArithmeticTask(max_operand=99, max_second_operand=9, num_heldout=100)
    #: half of the warm start's answers are wrong (off by 1..9): RL starts from a policy that spreads
    #: probability over wrong answers rather than one sharpened on its own mistakes (see README)
    warm_start: WarmStartConfig = WarmStartConfig(wrong_answer_fraction=0.5)
    actor: ActorConfig = ActorConfig()
    ref_log_prob_micro_batch_size: int = 64
    #: 16 samples per prompt: at the warm start's 5-8% success, 8 left most groups without a correct sample
    #: (zero advantage, no signal) and one seed in three learned slowly (see README)
    rollout: RolloutConfig = RolloutConfig(n=16, temperature=1.0, max_new_tokens=6)  # rollout.engine=vllm for vLLM
    algo: AlgoConfig = AlgoConfig()


#: keys that may differ between a run and its resumption (where things go, not what is computed)
_RESUMABLE_KEYS = ("resume", "run_dir", "run_root", "checkpoint", "eval_every")


def main(argv: list[str]) -> dict:
    if "--help" in argv or "-h" in argv:
        print(__doc__ + "\nconfig keys:\n  " + "\n  ".join(config_keys(Config)))
        return {}
    cfg = apply_overrides(Config(), argv)  # an unknown key fails here, before any work
    _check_reuse_rollout_activations(cfg)
    engine = select_engine(cfg.actor.backend, fsdp=cfg.actor.fsdp, tp=cfg.actor.tp, pp=cfg.actor.pp)
    env = init_distributed()
    log = get_logger("grpo", env)
    seed_everything(cfg.seed)
    if cfg.prompts_per_step % env.world_size:
        raise ValueError(f"prompts_per_step={cfg.prompts_per_step} must be divisible by the world size {env.world_size}")

    # Where to resume from (checked against this config before anything is built) and the run dir.
    must_match = {k: v for k, v in config_to_dict(cfg).items() if k not in _RESUMABLE_KEYS}
    resume_from, run_dir = resume_point(cfg.resume, cfg.checkpoint, run_dir=cfg.run_dir, run_root=cfg.run_root,
                                        name=cfg.name, must_match=must_match)
    ckpt_dir = checkpoint_dir(cfg.checkpoint, run_dir)
    model_path = Path(cfg.model_path) if cfg.model_path else run_dir / "base_model"
    # the warm-started policy, saved as an HF dir: the rollout's start, the frozen reference and, on resume,
    # the architecture the checkpoint's weights are loaded into
    warm_path = run_dir / "warm_start_model" if cfg.warm_start.steps else model_path
    rl_optim = with_total_steps(cfg.actor.optim, cfg.steps * cfg.algo.ppo_epochs * cfg.algo.mini_batches)
    t_start = time.time()

    # Run directory and base model: rank 0 writes them, everyone waits. A fresh start begins a new
    # metrics log; a resumed one drops what the crashed run logged after its checkpoint.
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        truncate_metrics(run_dir / "metrics.jsonl", checkpoint_info(resume_from).step if resume_from else None)
        if resume_from is None:
            (run_dir / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2))
            if not cfg.model_path:
                write_tiny_model(model_path, cfg.tiny, build_char_tokenizer())
    barrier()
    tokenizer = load_tokenizer(model_path)
    metrics_log = MetricsLog(run_dir, enabled=env.is_main)

    if resume_from is None:
        # Supervised warm start, through the same engine and the same pure-loss interface as RL.
        actor = engine.build_actor(model_path, env, warm_start_optim(cfg.warm_start) if cfg.warm_start.steps else rl_optim, engine.config)
        dp_rank, dp_size = engine.data_parallel(actor)  # megatron's TP / PP peers share their rows
        stream = cfg.task.train_stream(seed=cfg.seed)
        if cfg.warm_start.steps:
            actor = supervised_warm_start(actor, stream, tokenizer, cfg.warm_start, env, metrics_log,
                                          update_fn=engine.update, data_parallel=(dp_rank, dp_size))
            actor = engine.fresh_optimizer(actor, rl_optim)
            engine.export_hf(actor, warm_path, tokenizer=tokenizer)
    else:
        log.info(f"resuming from {resume_from} (run dir {run_dir})")
        actor = engine.build_actor(warm_path, env, rl_optim, engine.config)
        dp_rank, dp_size = engine.data_parallel(actor)
    # this rank's name for the actor in checkpoints (megatron: one per tensor / pipeline shard); an engine
    # that cannot checkpoint says so here, before any RL work
    ckpt_name = engine.checkpoint_name(actor, "actor") if cfg.checkpoint.every or resume_from else "actor"
    rollout = build_rollout(cfg.rollout, warm_path, tokenizer, seed=cfg.seed)
    # reused rollout activations must come from the actor's current weights: each sync says which they are
    tag = (lambda state: {"tag": state.step}) if cfg.actor.reuse_rollout_activations else (lambda state: {})
    if cfg.actor.reuse_rollout_activations:
        rollout = sync_weights(rollout, engine.full_state_dict(actor), **tag(actor))
    reference = None
    if cfg.algo.kl_coef > 0:
        reference = engine.build_reference(warm_path, env, engine.config, log_prob_micro_batch_size=cfg.ref_log_prob_micro_batch_size)

    heldout = cfg.task.heldout()
    sampled_eval = attrs.evolve(cfg.rollout, n=cfg.eval_samples)
    greedy_eval = attrs.evolve(cfg.rollout, n=1, temperature=0.0)
    if resume_from is None:
        first_step, wall_before = 1, 0.0
        eval_before = evaluate(rollout, tokenizer, heldout, sampled_eval, env)
        greedy_before = evaluate(rollout, tokenizer, heldout, greedy_eval, env)
    else:  # the actor's weights, AdamW state and step, every rank's RNG, and what the loop carries
        states, extra = load_checkpoint(resume_from, {ckpt_name: actor}, config=must_match)
        actor = states[ckpt_name]
        stream = cfg.task.train_stream(seed=cfg.seed, drawn=extra["drawn"])
        eval_before, greedy_before, wall_before = extra["eval_before"], extra["greedy_before"], extra["wall_seconds"]
        first_step = extra["step"] + 1
        rollout = sync_weights(rollout, engine.full_state_dict(actor), **tag(actor))
    log.info(f"held-out success before RL: {eval_before:.3f} sampled, {greedy_before:.3f} greedy ({len(heldout)} prompts)")

    loss_fn = functools.partial(
        policy_loss_with_kl, policy_loss=rf.get_policy_loss(cfg.algo.policy_loss), algo=cfg.algo,
        horizon=cfg.rollout.max_new_tokens,
    )
    # zero-advantage rows add exactly nothing to this loss (and its gradient) when it has no other term
    skip_exact = (
        cfg.algo.skip_zero_advantage and cfg.algo.policy_loss.replace("-", "_") in rf.ADVANTAGE_PROPORTIONAL_LOSSES
        and cfg.algo.kl_coef == 0 and cfg.algo.entropy_coef == 0
    )
    estimator = rf.get_advantage_estimator(cfg.algo.estimator)
    estimator_kwargs = {"norm_by_std": cfg.algo.norm_by_std} if cfg.algo.estimator == "grpo" else {}
    for step in tqdm(range(first_step, cfg.steps + 1), desc="GRPO", disable=not env.is_main, initial=first_step - 1, total=cfg.steps):
        t0 = time.time()
        # 1. rollout: n samples per prompt, for this rank's share of the prompts
        problems = stream.take(cfg.prompts_per_step)[dp_rank::dp_size]
        prompts = [tokenizer.encode(p.prompt) for p in problems]
        seed = (cfg.seed * 1_000_003 + step) * dp_size + dp_rank
        reuse = {}  # the rollout's linear outputs, for the update to use instead of a forward pass
        if cfg.actor.reuse_rollout_activations:
            batch, reuse["activations"] = generate_recording(rollout, prompts, cfg.rollout.sampling(), seed=seed)
        else:
            batch = generate(rollout, prompts, cfg.rollout, seed=seed)
        batch = engine.share_batch(actor, batch)
        t_rollout = time.time() - t0
        # 2. verifiable reward: one score per sequence, parsed from the text
        batch = batch.replace(scores=score_responses(batch, problems, tokenizer))
        # 3. log-probs of the sampled tokens under the current policy (and the reference). With a single
        #    update per batch the rollout's own log-probs are the current policy's (same weights; the
        #    rollout/trainer gap is tested to be ~1e-6), so the extra forward pass is skipped.
        #    TIS needs the trainer's own log-probs next to the rollout's.
        on_policy = cfg.algo.ppo_epochs == 1 and cfg.algo.mini_batches == 1 and cfg.algo.rollout_is == "none"
        batch = batch.replace(old_logprobs=batch.rollout_logprobs if on_policy else engine.compute_logprobs(actor, batch).logprobs)
        if reference is not None:
            batch = batch.replace(ref_logprobs=engine.compute_logprobs(reference, batch).logprobs)
        # 4. group-relative advantages (pure rlfunc; all n samples of a prompt live on one rank)
        adv, ret = estimator(batch.scores, batch.group_ids, batch.response_mask, **estimator_kwargs)
        batch = batch.replace(advantages=adv, returns=ret)
        skip = rf.zero_advantage_rows(adv, batch.response_mask) if skip_exact else None
        # 5. policy update(s)
        t_update = time.time()
        for _ in range(cfg.algo.ppo_epochs):
            for mini_batch, mini_skip in zip(rf.split(batch, cfg.algo.mini_batches), _split_rows(skip, cfg.algo.mini_batches)):
                actor, m = engine.update(actor, mini_batch, loss_fn, with_entropy=True, skip_rows=mini_skip, **reuse)
        del reuse  # the recorded activations: only the first update after the rollout may use them
        # 6. weight sync: stream full tensors from the FSDP / megatron shards into the rollout engine
        t_sync = time.time()
        rollout = sync_weights(rollout, engine.full_state_dict(actor), **tag(actor))
        t_update, t_sync = t_sync - t_update, time.time() - t_sync

        dt = time.time() - t0
        local = torch.stack([
            batch.scores.mean(), (batch.scores > 0.5).float().mean(), batch.response_mask.sum(-1).float().mean(),
            (batch.prompt_mask.sum() + batch.response_mask.sum()).float(),
            skip.float().mean() if skip is not None else torch.zeros(()),
        ])
        reward_mean, success_rate, response_length, num_tokens, skipped_rows = (all_reduce_sum(local) / env.world_size).tolist()
        stats = {
            "reward_mean": reward_mean, "success_rate": success_rate, "response_length": response_length,
            "tokens_per_s": num_tokens * dp_size / dt, "step_time_s": dt, "rollout_time_s": t_rollout,
            "update_time_s": t_update, "sync_time_s": t_sync,
            "skipped_rows": skipped_rows,
            **m,
        }
        if cfg.eval_every and step % cfg.eval_every == 0:
            stats["eval_success"] = evaluate(rollout, tokenizer, heldout, sampled_eval, env)
        metrics_log.log(step, stats)
        if env.is_main and (step % 10 == 0 or step == cfg.steps):
            keys = ("reward_mean", "success_rate", "kl", "entropy", "clip_frac", "grad_norm", "response_length", "tokens_per_s", "step_time_s")
            tqdm.write(f"step {step:4d} " + " ".join(f"{k}={stats[k]:.4g}" for k in keys if k in stats))

        # 7. checkpoint: the actor (sharded, with AdamW), RNG, and what the loop carries
        if cfg.checkpoint.every and (step % cfg.checkpoint.every == 0 or step == cfg.steps):
            extra = {
                "step": step, "drawn": stream.drawn, "run_dir": str(run_dir),
                "eval_before": eval_before, "greedy_before": greedy_before,
                "wall_seconds": wall_before + time.time() - t_start,
            }
            save_checkpoint(ckpt_dir, step, {ckpt_name: actor}, extra, keep_last=cfg.checkpoint.keep_last, config=must_match)

    eval_after = evaluate(rollout, tokenizer, heldout, sampled_eval, env)
    greedy_after = evaluate(rollout, tokenizer, heldout, greedy_eval, env)
    wall = wall_before + time.time() - t_start
    summary = {
        "eval_before": eval_before,
        "eval_after": eval_after,
        "eval_metric": f"held-out success: mean over {cfg.eval_samples} samples per prompt at temperature {cfg.rollout.temperature}",
        "eval_greedy_before": greedy_before,
        "eval_greedy_after": greedy_after,
        "num_heldout": len(heldout),
        "steps": cfg.steps,
        "resumed_from": str(resume_from) if resume_from is not None else None,
        "wall_seconds": round(wall, 1),
        "world_size": env.world_size,
        "run_dir": str(run_dir),
    }
    if env.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] > 0]
        plot_curves(rows, ["reward_mean", "eval_success", "kl", "entropy", "clip_frac"], run_dir / "reward_curve.png", title=cfg.name)
        verdict = "rose" if eval_after > eval_before else "did NOT rise"
        print(
            f"\nheld-out success {eval_before:.1%} -> {eval_after:.1%} (greedy {greedy_before:.1%} -> {greedy_after:.1%}): "
            f"the reward {verdict} ({cfg.steps} GRPO steps, {wall:.0f} s, {env.world_size} rank(s)); see {run_dir}",
            flush=True,
        )
    metrics_log.close()
    shutdown_rollout(rollout)
    shutdown(env)
    return summary


def _check_reuse_rollout_activations(cfg: Config) -> None:
    """``actor.reuse_rollout_activations`` needs a setting where the update's forward is the rollout's."""
    if not cfg.actor.reuse_rollout_activations:
        return
    needs = {
        "actor.backend=fsdp": cfg.actor.backend == "fsdp",
        "actor.fsdp.use_remove_padding=true": cfg.actor.fsdp.use_remove_padding,
        "actor.fsdp.balance_dp=false": not cfg.actor.fsdp.balance_dp,
        "rollout.engine=native": cfg.rollout.engine == "native",
        "rollout.dtype=float32": cfg.rollout.dtype == "float32",
        "actor.fsdp.param_dtype float32 or auto (float32 on CPU)": cfg.actor.fsdp.param_dtype in ("auto", "float32"),
        "algo.ppo_epochs=1": cfg.algo.ppo_epochs == 1,
        "algo.mini_batches=1": cfg.algo.mini_batches == 1,
        "algo.rollout_is=none": cfg.algo.rollout_is == "none",
    }
    unmet = [k for k, ok in needs.items() if not ok]
    if unmet:
        raise ValueError(f"actor.reuse_rollout_activations=true needs {', '.join(unmet)}")


def _split_rows(rows: torch.Tensor | None, parts: int) -> list[torch.Tensor | None]:
    """A per-row mask split like ``rf.split`` splits the batch (or ``None`` for every part)."""
    return [None] * parts if rows is None else list(torch.tensor_split(rows, parts))


# ---------------------------------------------------------------------------------------------------
# The loss: a composition of pure rlfunc functions. The engine passes the global normalisers.


def policy_loss_with_kl(out, mb: rf.RolloutBatch, norms: rf.Normalizers, *, policy_loss, algo: AlgoConfig, horizon: int):
    """Clipped policy loss, plus ``kl_coef`` times a k-estimator KL to the reference when one is given, minus
    ``entropy_coef`` times the entropy of the policy."""
    is_weights, is_metrics = None, {}
    if algo.rollout_is != "none":  # trainer / rollout log-prob mismatch: truncated importance weights
        is_weights, is_metrics = rf.rollout_is_weights(
            mb.old_logprobs, mb.rollout_logprobs, mb.response_mask, level=algo.rollout_is, upper=algo.rollout_is_cap
        )
    loss, metrics = policy_loss(
        out.logprobs, mb.old_logprobs, mb.advantages, mb.response_mask,
        clip_low=algo.clip_low, clip_high=algo.clip_high, agg=algo.agg, norms=norms, horizon=horizon, is_weights=is_weights,
    )
    metrics = {**metrics, **is_metrics}
    # ppo_kl: KL(old || new) of the tokens being trained on; kl: to the reference when there is one
    metrics = {**metrics, "kl": metrics.get("ppo_kl", torch.zeros(()))}
    if mb.ref_logprobs is not None:
        kl, _ = rf.kl_loss(out.logprobs, mb.ref_logprobs, mb.response_mask, kind=algo.kl_kind, agg=algo.agg, norms=norms, horizon=horizon)
        loss = loss + algo.kl_coef * kl
        metrics["kl"] = kl.detach()
    if algo.entropy_coef > 0:  # exploration bonus: the entropy is differentiable (rlfunc.entropy_from_logits)
        loss = loss - algo.entropy_coef * rf.aggregate(out.entropy, mb.response_mask, algo.agg, norms, horizon=horizon)
    if out.entropy is not None:
        metrics["entropy"] = rf.aggregate(out.entropy.detach(), mb.response_mask, "token-mean", norms)
    return loss, metrics


if __name__ == "__main__":
    main(sys.argv[1:])
