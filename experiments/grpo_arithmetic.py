"""GRPO on a synthetic verifiable task: a tiny language model learns integer addition.

Run:  python experiments/grpo_arithmetic.py                                        (one process)
      torchrun --standalone --nproc_per_node 2 experiments/grpo_arithmetic.py     (FSDP2 over 2 ranks)
      ... key=value overrides, e.g. steps=100 rollout.n=8 actor.optim.lr=5e-4 algo.kl_coef=0.01
      ... actor.backend=megatron actor.tp=2 (or actor.pp=2): megatron-core tensor / pipeline parallel
      --help lists every key.

Algorithm pieces by name or by reference (resolved at start-up, so a misspelling fails before any work):
      ... algo.estimator=rloo                                 (an outcome estimator of rlfunc.ADVANTAGE_ESTIMATORS)
      ... algo.policy_loss=gspo                               (a name of rlfunc.POLICY_LOSSES)
      ... algo.estimator=my_pkg.advantages:centered           (a function of an importable module)
      ... algo.estimator=path/to/my_estimator.py:centered     (a function of a file)
An estimator is called as ``fn(scores, group_ids=..., response_mask=...)`` and returns ``(advantages,
returns)``; a policy loss as ``fn(logprobs, old_logprobs=..., advantages=..., response_mask=..., clip_low=...,
clip_high=..., agg=..., norms=..., horizon=..., is_weights=...)`` and returns ``(loss, metrics)``.

Checkpoints and exact resume (FSDP, or megatron's CPU schedule with the same tp / pp):
      ... checkpoint.every=50 checkpoint.dir=/ckpt/grpo      (save every 50 steps and at the last)
      ... resume=auto checkpoint.dir=/ckpt/grpo              (after a crash: continue from the newest complete
                                                              checkpoint, in the same run dir)
      ... resume=/ckpt/grpo/step_100                         (from that checkpoint)
A checkpoint holds the actor (weights + AdamW, sharded), the step, every rank's RNG and the data-stream
position; a resumed run on the same world size logs the same metrics as an uninterrupted one.

Reads top to bottom: config -> [resume point] -> model -> supervised warm start -> held-out eval -> RL loop
[rollout -> reward -> log-probs -> advantages -> policy update -> weight sync -> log / checkpoint] -> held-out
eval -> summary.
"""

from __future__ import annotations

import functools
import inspect
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Literal

import attrs
import torch
from tqdm import tqdm

import rlfunc as rf
from backends.checkpoint.dcp import checkpoint_info, load_checkpoint, save_checkpoint
from backends.checkpoint.resume import CheckpointConfig, checkpoint_dir, resume_point, truncate_metrics
from backends.config import apply_overrides, config_keys, config_to_dict, resolve_function
from backends.cpu import tune_process
from backends.distributed.setup import all_reduce_sum, barrier, get_logger, init_distributed, seed_everything, shutdown
from backends.metrics_log import MetricsLog, plot_curves, read_jsonl
from backends.models import TinyModelConfig, build_char_tokenizer, load_tokenizer, write_tiny_model
from backends.rollout.api import RolloutConfig, build_rollout, generate, shutdown_rollout, sync_weights
from backends.training.engines import Engine, select_engine
from backends.training.fsdp import FSDPConfig
from backends.training.optim import OptimConfig, with_total_steps
from backends.training.sft import sft_optim
from experiments.tasks.arithmetic import ArithmeticTask, WarmStartConfig, evaluate, score_responses, warm_start


@attrs.frozen
class AlgoConfig:
    #: an outcome estimator over groups: a name of rlfunc.ADVANTAGE_ESTIMATORS that takes group_ids (grpo,
    #: rloo, reinforce_pp_baseline, ...) or a reference package.module:function / path/to/file.py:function
    estimator: str = "grpo"
    norm_by_std: bool = True  # grpo only; False is Dr.GRPO
    #: a name of rlfunc.POLICY_LOSSES (vanilla = PPO clip, gspo, cispo, gmpo, ...) or a reference
    policy_loss: str = "vanilla"
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
    #: Applied only when that is exact: an advantage-proportional built-in policy loss, kl_coef = entropy_coef = 0.
    #: The loss metrics (entropy, clip_frac) then cover the rows that ran; skipped_rows counts the rest.
    skip_zero_advantage: bool = True


@attrs.frozen
class ActorConfig:
    optim: OptimConfig = OptimConfig(lr=3e-4, weight_decay=0.0, clip_grad=1.0, lr_warmup_steps=10)
    fsdp: FSDPConfig = FSDPConfig(micro_batch_size=64)
    backend: str = "fsdp"  # "fsdp" or "megatron" (also runs the reference); tp / pp: megatron's sizes
    tp: int = 1
    pp: int = 1


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
    #: 16 samples per prompt: from a weak warm start, 8 left most groups without a correct sample (zero
    #: advantage, no signal) and made learning slow and seed-dependent (see README)
    rollout: RolloutConfig = RolloutConfig(n=16, temperature=1.0, max_new_tokens=6)  # rollout.engine=vllm for vLLM
    algo: AlgoConfig = AlgoConfig()


#: keys that may differ between a run and its resumption (where things go, not what is computed)
_RESUMABLE_KEYS = ("resume", "run_dir", "run_root", "checkpoint", "eval_every")


def main(argv: list[str]) -> dict:
    tune_process()  # process-wide allocator / oneDNN settings: before any model is built
    if "--help" in argv or "-h" in argv:
        print(__doc__ + "\nconfig keys:\n  " + "\n  ".join(config_keys(Config)))
        return {}
    cfg = apply_overrides(Config(), argv)  # an unknown key fails here, before any work
    estimator, estimator_kwargs, policy_loss = resolve_algorithm(cfg.algo)  # so does an unknown estimator / loss
    engine = select_engine(cfg.actor.backend, fsdp=cfg.actor.fsdp, tp=cfg.actor.tp, pp=cfg.actor.pp)
    env = init_distributed()
    log = get_logger("grpo", env)
    seed_everything(cfg.seed)
    if cfg.prompts_per_step % env.world_size:
        raise ValueError(f"prompts_per_step={cfg.prompts_per_step} must be divisible by the world size {env.world_size}")
    run = prepare_run(cfg, env)
    tokenizer = load_tokenizer(run.model_path)
    metrics_log = MetricsLog(run.run_dir, enabled=env.is_main)
    rl_optim = with_total_steps(cfg.actor.optim, cfg.steps * cfg.algo.ppo_epochs * cfg.algo.mini_batches)
    t_start = time.time()

    actor, stream = start_actor(cfg, engine, env, run, tokenizer, rl_optim, metrics_log)
    dp_rank, dp_size = engine.data_parallel(actor)  # megatron's TP / PP peers share their rows
    # this rank's name for the actor in checkpoints (megatron: one per tensor / pipeline shard); an engine
    # that cannot checkpoint says so here, before any RL work
    ckpt_name = engine.checkpoint_name(actor, "actor") if cfg.checkpoint.every or run.resume_from else "actor"
    rollout = build_rollout(cfg.rollout, run.warm_path, tokenizer, seed=cfg.seed)
    reference = None
    if cfg.algo.kl_coef > 0:
        reference = engine.build_reference(run.warm_path, env, engine.config, log_prob_micro_batch_size=cfg.ref_log_prob_micro_batch_size)
    heldout = cfg.task.heldout()
    if run.resume_from is None:
        first_step, wall_before = 1, 0.0
        before = evaluate_heldout(rollout, tokenizer, heldout, cfg, env)
    else:  # the actor's weights, AdamW state and step, every rank's RNG, and what the loop carries
        states, extra = load_checkpoint(run.resume_from, {ckpt_name: actor}, config=run.must_match)
        actor, first_step = states[ckpt_name], extra["step"] + 1
        stream = cfg.task.train_stream(seed=cfg.seed, drawn=extra["drawn"])
        before, wall_before = (extra["eval_before"], extra["greedy_before"]), extra["wall_seconds"]
        rollout = sync_weights(rollout, engine.full_state_dict(actor))
    log.info(f"held-out success before RL: {before[0]:.3f} sampled, {before[1]:.3f} greedy ({len(heldout)} prompts)")

    loss_fn = functools.partial(policy_loss_with_kl, policy_loss=policy_loss, algo=cfg.algo, horizon=cfg.rollout.max_new_tokens)
    skip_zero_rows = zero_advantage_rows_are_skippable(cfg.algo, policy_loss)
    # one update per batch: the rollout's log-probs are the current policy's (same weights; the rollout /
    # trainer agreement is tested), so no extra forward pass. TIS needs the trainer's next to the rollout's.
    on_policy = cfg.algo.ppo_epochs == 1 and cfg.algo.mini_batches == 1 and cfg.algo.rollout_is == "none"
    for step in tqdm(range(first_step, cfg.steps + 1), desc="GRPO", disable=not env.is_main, initial=first_step - 1, total=cfg.steps):
        t0 = time.time()
        # 1. rollout: n samples per prompt, for this rank's share of the prompts (explicit per-step seed)
        problems = stream.take(cfg.prompts_per_step)[dp_rank::dp_size]
        seed = (cfg.seed * 1_000_003 + step) * dp_size + dp_rank
        batch = generate(rollout, [tokenizer.encode(p.prompt) for p in problems], cfg.rollout, seed=seed)
        batch = engine.share_batch(actor, batch)
        t_rollout = time.time() - t0
        # 2. verifiable reward: one score per sequence, parsed from the text
        batch = batch.replace(scores=score_responses(batch, problems, tokenizer))
        # 3. log-probs of the sampled tokens under the current policy (and the reference)
        batch = batch.replace(old_logprobs=batch.rollout_logprobs if on_policy else engine.compute_logprobs(actor, batch).logprobs)
        if reference is not None:
            batch = batch.replace(ref_logprobs=engine.compute_logprobs(reference, batch).logprobs)
        # 4. group-relative advantages (pure rlfunc; all n samples of a prompt live on one rank)
        adv, ret = estimator(batch.scores, group_ids=batch.group_ids, response_mask=batch.response_mask, **estimator_kwargs)
        batch = batch.replace(advantages=adv, returns=ret)
        skip = rf.zero_advantage_rows(adv, mask=batch.response_mask) if skip_zero_rows else None
        # 5. policy update(s): ppo_epochs x mini_batches optimizer steps
        t_update = time.time()
        for _ in range(cfg.algo.ppo_epochs):
            for mini_batch, mini_skip in zip(rf.split(batch, cfg.algo.mini_batches), split_rows(skip, cfg.algo.mini_batches)):
                actor, metrics = engine.update(actor, mini_batch, loss_fn, with_entropy=True, skip_rows=mini_skip)
        # 6. weight sync: stream full tensors from the FSDP / megatron shards into the rollout engine
        t_sync = time.time()
        rollout = sync_weights(rollout, engine.full_state_dict(actor))
        times = {"step_time_s": time.time() - t0, "rollout_time_s": t_rollout, "update_time_s": t_sync - t_update,
                 "sync_time_s": time.time() - t_sync}

        # 7. log (and evaluate), checkpoint: the actor (sharded, with AdamW), RNG, and what the loop carries
        stats = {**step_stats(batch, skip, times, env, dp_size), **metrics}
        if cfg.eval_every and step % cfg.eval_every == 0:
            stats["eval_success"] = evaluate(rollout, tokenizer, heldout, attrs.evolve(cfg.rollout, n=cfg.eval_samples), env)
        metrics_log.log(step, stats)
        if env.is_main and (step % 10 == 0 or step == cfg.steps):
            keys = ("reward_mean", "success_rate", "kl", "entropy", "clip_frac", "grad_norm", "response_length", "tokens_per_s", "step_time_s")
            tqdm.write(f"step {step:4d} " + " ".join(f"{k}={stats[k]:.4g}" for k in keys if k in stats))
        if cfg.checkpoint.every and (step % cfg.checkpoint.every == 0 or step == cfg.steps):
            extra = {"step": step, "drawn": stream.drawn, "run_dir": str(run.run_dir), "eval_before": before[0],
                     "greedy_before": before[1], "wall_seconds": wall_before + time.time() - t_start}
            save_checkpoint(run.ckpt_dir, step, {ckpt_name: actor}, extra, keep_last=cfg.checkpoint.keep_last, config=run.must_match)

    after = evaluate_heldout(rollout, tokenizer, heldout, cfg, env)
    summary = summarize(cfg, run, env, before, after, wall=wall_before + time.time() - t_start, num_heldout=len(heldout))
    metrics_log.close()
    shutdown_rollout(rollout)
    shutdown(env)
    return summary


# ---------------------------------------------------------------------------------------------------
# Set-up, evaluation and summary.


def resolve_algorithm(algo: AlgoConfig) -> tuple[Callable, dict[str, Any], Callable]:
    """``(estimator, its extra keyword arguments, policy loss)`` from their config names or references."""
    # the built-ins that fit the loop: outcome estimators over groups of samples (not gae, reinforce_pp, remax)
    group_estimators = {name: fn for name, fn in rf.ADVANTAGE_ESTIMATORS.items() if "group_ids" in inspect.signature(fn).parameters}
    aliases = {alias: name for alias, name in rf.ADVANTAGE_ESTIMATOR_ALIASES.items() if name in group_estimators}
    estimator = resolve_function(algo.estimator, group_estimators, "algo.estimator", aliases=aliases)
    loss_aliases = {name.replace("_", "-"): name for name in rf.POLICY_LOSSES if "_" in name}  # clip-cov = clip_cov
    policy_loss = resolve_function(algo.policy_loss, rf.POLICY_LOSSES, "algo.policy_loss", aliases=loss_aliases)
    estimator_kwargs = {"norm_by_std": algo.norm_by_std} if estimator is rf.ADVANTAGE_ESTIMATORS["grpo"] else {}
    return estimator, estimator_kwargs, policy_loss


def zero_advantage_rows_are_skippable(algo: AlgoConfig, policy_loss: Callable) -> bool:
    """Whether zero-advantage rows add exactly nothing to the loss and its gradient: a built-in policy loss
    whose per-token term is a multiple of the advantage, and no KL or entropy term."""
    proportional = {rf.POLICY_LOSSES[name] for name in rf.ADVANTAGE_PROPORTIONAL_LOSSES}
    return algo.skip_zero_advantage and policy_loss in proportional and algo.kl_coef == 0 and algo.entropy_coef == 0


@attrs.frozen
class RunPaths:
    """Where this run reads and writes, and the checkpoint it resumes from (``None``: a fresh start)."""

    run_dir: Path
    ckpt_dir: Path
    model_path: Path  # the base model
    #: the warm-started policy as an HF dir: the rollout's start, the frozen reference and, on resume,
    #: the architecture the checkpoint's weights are loaded into
    warm_path: Path
    resume_from: Path | None
    must_match: dict  # the config a checkpoint must have been written with


def prepare_run(cfg: Config, env: Any) -> RunPaths:
    """The resume point (checked against this config before anything is built) and the run dir: rank 0
    writes the config and the tiny base model; a fresh start begins a new metrics log, a resumed one drops
    what the crashed run logged after its checkpoint."""
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


def start_actor(cfg: Config, engine: Engine, env: Any, run: RunPaths, tokenizer: Any, rl_optim: OptimConfig,
                metrics_log: MetricsLog) -> tuple[Any, Any]:
    """``(actor with the RL optimizer, training stream)``. A fresh start runs the supervised warm start
    (through the same engine and the same pure-loss interface as RL) and exports the warm-started policy;
    a resume builds the warm-started architecture that the checkpoint's weights then load into."""
    stream = cfg.task.train_stream(seed=cfg.seed)
    if run.resume_from is not None:
        return engine.build_actor(run.warm_path, env, rl_optim, engine.config), stream
    actor = engine.build_actor(run.model_path, env, sft_optim(cfg.warm_start) if cfg.warm_start.steps else rl_optim, engine.config)
    if cfg.warm_start.steps:
        actor = warm_start(actor, stream, tokenizer, cfg.warm_start, data_parallel=engine.data_parallel(actor),
                           update_fn=engine.update, metrics_log=metrics_log, show_progress=env.is_main)
        actor = engine.fresh_optimizer(actor, rl_optim)
        engine.export_hf(actor, run.warm_path, tokenizer=tokenizer)
    return actor, stream


def evaluate_heldout(rollout: Any, tokenizer: Any, heldout: list, cfg: Config, env: Any) -> tuple[float, float]:
    """Held-out success ``(sampled: mean over cfg.eval_samples samples per prompt, greedy)``."""
    sampled = evaluate(rollout, tokenizer, heldout, attrs.evolve(cfg.rollout, n=cfg.eval_samples), env)
    greedy = evaluate(rollout, tokenizer, heldout, attrs.evolve(cfg.rollout, n=1, temperature=0.0), env)
    return sampled, greedy


def step_stats(batch: rf.RolloutBatch, skip: torch.Tensor | None, times: dict[str, float], env: Any, dp_size: int) -> dict:
    """The step's reward, success, length, throughput and skipped-row share, averaged over the ranks."""
    local = torch.stack([
        batch.scores.mean(), (batch.scores > 0.5).float().mean(), batch.response_mask.sum(-1).float().mean(),
        (batch.prompt_mask.sum() + batch.response_mask.sum()).float(),
        skip.float().mean() if skip is not None else torch.zeros(()),
    ])
    reward_mean, success_rate, response_length, num_tokens, skipped_rows = (all_reduce_sum(local) / env.world_size).tolist()
    return {
        "reward_mean": reward_mean, "success_rate": success_rate, "response_length": response_length,
        "tokens_per_s": num_tokens * dp_size / times["step_time_s"], **times, "skipped_rows": skipped_rows,
    }


def split_rows(rows: torch.Tensor | None, parts: int) -> list[torch.Tensor | None]:
    """A per-row mask split like ``rf.split`` splits the batch (or ``None`` for every part)."""
    return [None] * parts if rows is None else list(torch.tensor_split(rows, parts))


def summarize(cfg: Config, run: RunPaths, env: Any, before: tuple[float, float], after: tuple[float, float], *,
              wall: float, num_heldout: int) -> dict:
    """The run's summary (rank 0 also writes summary.json, the reward curve and the verdict line)."""
    summary = {
        "eval_before": before[0],
        "eval_after": after[0],
        "eval_metric": f"held-out success: mean over {cfg.eval_samples} samples per prompt at temperature {cfg.rollout.temperature}",
        "eval_greedy_before": before[1],
        "eval_greedy_after": after[1],
        "num_heldout": num_heldout,
        "steps": cfg.steps,
        "resumed_from": str(run.resume_from) if run.resume_from is not None else None,
        "wall_seconds": round(wall, 1),
        "world_size": env.world_size,
        "run_dir": str(run.run_dir),
    }
    if env.is_main:
        (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        rows = [r for r in read_jsonl(run.run_dir / "metrics.jsonl") if r["step"] > 0]
        plot_curves(rows, ["reward_mean", "eval_success", "kl", "entropy", "clip_frac"], run.run_dir / "reward_curve.png", title=cfg.name)
        verdict = "rose" if after[0] > before[0] else "did NOT rise"
        print(
            f"\nheld-out success {before[0]:.1%} -> {after[0]:.1%} (greedy {before[1]:.1%} -> {after[1]:.1%}): "
            f"the reward {verdict} ({cfg.steps} GRPO steps, {wall:.0f} s, {env.world_size} rank(s)); see {run.run_dir}",
            flush=True,
        )
    return summary


# ---------------------------------------------------------------------------------------------------
# The loss: a composition of pure rlfunc functions. The engine passes the global normalisers.


def policy_loss_with_kl(out, mb: rf.RolloutBatch, norms: rf.Normalizers, *, policy_loss, algo: AlgoConfig, horizon: int):
    """Clipped policy loss, plus ``kl_coef`` times a k-estimator KL to the reference when one is given, minus
    ``entropy_coef`` times the entropy of the policy."""
    is_weights, is_metrics = None, {}
    if algo.rollout_is != "none":  # trainer / rollout log-prob mismatch: truncated importance weights
        is_weights, is_metrics = rf.rollout_is_weights(
            mb.old_logprobs, rollout_logprobs=mb.rollout_logprobs, response_mask=mb.response_mask,
            level=algo.rollout_is, upper=algo.rollout_is_cap,
        )
    loss, metrics = policy_loss(
        out.logprobs, old_logprobs=mb.old_logprobs, advantages=mb.advantages, response_mask=mb.response_mask,
        clip_low=algo.clip_low, clip_high=algo.clip_high, agg=algo.agg, norms=norms, horizon=horizon, is_weights=is_weights,
    )
    metrics = {**metrics, **is_metrics}
    # ppo_kl: KL(old || new) of the tokens being trained on; kl: to the reference when there is one
    metrics = {**metrics, "kl": metrics.get("ppo_kl", torch.zeros(()))}
    if mb.ref_logprobs is not None:
        kl, _ = rf.kl_loss(out.logprobs, ref_logprobs=mb.ref_logprobs, mask=mb.response_mask, kind=algo.kl_kind, agg=algo.agg,
                           norms=norms, horizon=horizon)
        loss = loss + algo.kl_coef * kl
        metrics["kl"] = kl.detach()
    if algo.entropy_coef > 0:  # exploration bonus: the entropy is differentiable (rlfunc.entropy_from_logits)
        loss = loss - algo.entropy_coef * rf.aggregate(out.entropy, mask=mb.response_mask, mode=algo.agg, norms=norms, horizon=horizon)
    if out.entropy is not None:
        metrics["entropy"] = rf.aggregate(out.entropy.detach(), mask=mb.response_mask, mode="token-mean", norms=norms)
    return loss, metrics


if __name__ == "__main__":
    main(sys.argv[1:])
