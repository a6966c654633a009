"""The colocated RL loop: every rank samples and trains, one step after another.

    for each step:
        sample + score (the actor's ranks; dynamic sampling, multi-turn)      backends.loop.sampling
        log-probs -> reference / values -> advantages -> update(s)           backends.loop.learner
        weight sync into the rollout engine                                  backends.loop.weight_bridge
        log / evaluate / dump generations / checkpoint or stop (SIGTERM)

Each phase runs under its watchdog deadline. A checkpoint holds every trained role (sharded, with its optimizer),
every rank's RNG, the prompt stream's position and the algorithm's state, so a resumed run continues as the
uninterrupted one would have.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from backends.checkpoint.dcp import load_checkpoint, save_checkpoint
from backends.data import PromptStream
from backends.distributed import watchdog
from backends.loop.actor_loss import loss_seed
from backends.loop.algorithm import max_context, rollout_logprobs_suffice, stamp_policy_version
from backends.loop.learner import Learner, learner_for, step_stats
from backends.loop.sampling import sample_and_score
from backends.loop.stages import checkpoint_or_stop, dump_generations, evaluate_policy, export_final, summarize
from backends.loop.weight_bridge import logprob_gap, weight_bridge
from backends.rollout.api import build_rollout
from backends.training.reward_model import build_reward_model

__all__ = ["run_colocated"]


def run_colocated(ctx: Any, roles: Any) -> dict:
    """The RL stage on ``roles`` (:class:`backends.training.roles.Roles`, built on the world); the summary."""
    cfg, run, env = ctx.cfg, ctx.run, ctx.env
    learner = learner_for(ctx, roles)
    if cfg.checkpoint.every or run.resume_from:
        roles.checkpoint_states()  # an engine that cannot checkpoint says so here, before any RL work
    actor_env = roles.env("actor")
    reward_model = None
    if cfg.reward_model.path:
        reward_model = roles.run_on(
            "actor", None, build_reward_model, cfg.reward_model.path, actor_env, cfg.reward_model
        )
    # last: a GPU rollout engine takes its share of the memory the trainer's roles left free
    rollout = roles.run_on(
        "actor",
        None,
        build_rollout,
        cfg.rollout,
        run.policy_path,
        ctx.tokenizer,
        seed=cfg.seed,
        device=env.device,
        max_context=max_context(cfg),
        group=actor_env.group if actor_env is not None else None,  # the ranks that build it (the actor's pool)
    )
    loop = ColocatedLoop(
        ctx=ctx,
        learner=learner,
        rollout=rollout,
        reward_model=reward_model,
        bridge=weight_bridge(cfg.rollout, cfg.actor.lora),
    )
    return loop.run()


class ColocatedLoop:
    """The loop's state between steps (the rollout engine, the prompt stream, the evaluations) and its phases."""

    def __init__(self, ctx: Any, learner: Learner, rollout: Any, reward_model: Any, bridge: Any) -> None:
        self.ctx, self.learner, self.roles, self.rollout = ctx, learner, learner.roles, rollout
        self.reward_model, self.bridge = reward_model, bridge
        cfg = ctx.cfg
        self.stream = PromptStream(ctx.data.train, seed=cfg.seed, shuffle=cfg.data.shuffle)
        self.first_step, self.wall_before, self.before, self.last_eval = 1, 0.0, {}, {}

    def run(self) -> dict:
        ctx, cfg, roles = self.ctx, self.ctx.cfg, self.roles
        self.start()
        engine, actor = roles.actor_engine, roles.actor
        # the rollout's log-probs are the old ones where both engines compute the same numbers; else recomputed
        on_policy = roles.run_on(
            "actor",
            None,
            lambda: rollout_logprobs_suffice(cfg.algo, ctx.algorithm.policy_loss, ctx.mini_batches)
            and self.bridge.logprobs_agree(engine, actor, self.rollout),
            otherwise=False,
        )
        preempted_at = None
        for step in range(self.first_step, ctx.steps + 1):
            stats = self.step(step, on_policy)
            self.log(step, stats)
            if checkpoint_or_stop(step, ctx.steps, cfg, ctx.run, self.save, ctx.log):  # SIGTERM on any rank
                preempted_at = step
                break
        if preempted_at is not None:  # exit code 0, no final evaluation / export: resume=auto continues from here
            summary = {"preempted_at_step": preempted_at, "run_dir": str(ctx.run.run_dir)}
        else:
            summary = self.finish()
        ctx.metrics_log.close()
        roles.run_on("actor", None, lambda: self.rollout.shutdown())
        return summary

    def step(self, step: int, on_policy: bool) -> dict[str, float]:
        """One RL step: sample and score, train, sync the new weights; the step's metrics (on the actor's ranks)."""
        ctx, cfg, roles, learner = self.ctx, self.ctx.cfg, self.roles, self.learner
        t0 = time.time()
        with watchdog.phase("rollout", step=step):
            batch, self.rows, sample_stats = roles.run_on(
                "actor",
                "rollout",
                sample_and_score,
                self.rollout,
                self.stream,
                ctx.scorer,
                ctx.tokenizer,
                cfg,
                step,
                roles.actor_engine,
                roles.actor,
                env=roles.env("actor"),
                reward_model=self.reward_model,
                environments=ctx.environments,
                otherwise=(None, None, {}),
            )
            if learner.updates_actor(step):  # a GPU engine frees its memory for the update until the sync
                self.rollout = roles.run_on("actor", None, lambda: self.rollout.release_memory())
        t_rollout = time.time() - t0
        provenance = {}
        if batch is not None:  # synchronous: sampled by the weights being updated
            batch, provenance = stamp_policy_version(batch, step - 1)
        t_update = time.time()
        replica = roles.data_parallel()[0] if roles.on_actor else 0
        seed = loss_seed(cfg.seed, step, replica=replica)
        if ctx.recorder.wants(step):  # the step's complete inputs, for backends.loop.replay
            ctx.recorder.save(step, learner, batch, seed=seed, on_policy=on_policy)
        with watchdog.phase("update", step=step, op="log-probs, values, advantages and the update(s)"):
            batch, metrics = learner.train(batch, step, seed=seed, on_policy=on_policy)
        t_sync = time.time()
        if learner.updates_actor(step):  # full tensors from the shards into the rollout engine (or the adapter alone)
            with watchdog.phase("weight_sync", step=step):
                self.rollout = roles.run_on(
                    "actor",
                    "weight_sync",
                    lambda: self.bridge.sync(self.rollout, roles.actor_engine, roles.actor, version=step),
                    otherwise=self.rollout,
                )
        times = {
            "step_time_s": time.time() - t0,
            "rollout_time_s": t_rollout,
            "update_time_s": t_sync - t_update,
            "sync_time_s": time.time() - t_sync,
            **{f"time/{k}_s": v for k, v in roles.step_times().items()},
        }
        self.batch = batch
        if batch is None:
            return {}
        actor_env = roles.env("actor")
        return {
            **sample_stats,
            **step_stats(batch, times, roles.data_parallel()[1], group=actor_env.group),
            **metrics,
            **logprob_gap(batch, on_policy, group=actor_env.group),
            **device_memory(ctx.env),
            **{k: float(v) for k, v in provenance.items()},
        }

    def log(self, step: int, stats: dict[str, float]) -> None:
        """On the actor's ranks: the held-out metrics every ``eval.every`` steps, one metrics row, and the
        generations every ``dump_generations_every`` steps."""
        ctx, cfg, roles = self.ctx, self.ctx.cfg, self.roles
        if not roles.on_actor:
            return
        if cfg.eval.every and step % cfg.eval.every == 0:
            with watchdog.phase("eval", step=step):
                self.last_eval = {"step": step, **self.evaluate()}
            stats.update({k: v for k, v in self.last_eval.items() if k != "step"})
        ctx.metrics_log.log(step, stats)
        if cfg.dump_generations_every and step % cfg.dump_generations_every == 0:
            dump_generations(ctx.run, step, ctx.tokenizer, self.batch, self.rows, group=roles.env("actor").group)

    def evaluate(self) -> dict[str, float]:
        ctx = self.ctx
        return evaluate_policy(
            self.rollout, ctx.tokenizer, ctx.data, ctx.scorer, ctx.cfg, self.roles.env("actor"), ctx.environments
        )

    def start(self) -> None:
        """A fresh start evaluates the starting policy; a resume loads every role's state (with its optimizer), every
        rank's RNG, the prompt stream's position and the algorithm's state, and syncs the loaded weights."""
        ctx, cfg, roles = self.ctx, self.ctx.cfg, self.roles
        if ctx.run.resume_from is None:
            if cfg.eval.before_training:
                with watchdog.phase("eval", step=0):
                    self.before = roles.run_on("actor", None, self.evaluate, otherwise={})
            ctx.metrics_log.log(0, self.before)
            return
        with watchdog.phase("checkpoint", op=f"load_checkpoint({ctx.run.resume_from})"):
            states, extra = load_checkpoint(ctx.run.resume_from, self.learner.states(), config=ctx.run.loaded_config)
        self.learner.load(states, extra["algorithm_state"])
        self.stream = PromptStream(ctx.data.train, seed=cfg.seed, shuffle=cfg.data.shuffle, drawn=extra["drawn"])
        self.first_step, self.before, self.wall_before = extra["step"] + 1, extra["eval_before"], extra["wall_seconds"]
        with watchdog.phase("weight_sync", step=extra["step"]):
            self.rollout = roles.run_on(
                "actor",
                None,
                lambda: self.bridge.sync(self.rollout, roles.actor_engine, roles.actor, version=extra["step"]),
                otherwise=self.rollout,
            )

    def save(self, step: int) -> None:
        """Every role (sharded, with its optimizer), RNG, the data position and what the loop carries, as the actor's
        leader knows them (split placement: each pool saves its own roles)."""
        ctx = self.ctx
        extra = self.roles.share(
            {
                "step": step,
                "drawn": self.stream.drawn,
                "run_dir": str(ctx.run.run_dir),
                "eval_before": self.before,
                "wall_seconds": self.wall_before + time.time() - ctx.t_start,
                "algorithm_state": self.learner.state,
            },
            "actor",
        )
        with watchdog.phase("checkpoint", step=step, op=f"save_checkpoint({ctx.run.ckpt_dir}/step_{step})"):
            save_checkpoint(
                ctx.run.ckpt_dir,
                step,
                self.learner.states(),
                extra,
                keep_last=ctx.cfg.checkpoint.keep_last,
                config=ctx.run.must_match,
            )

    def finish(self) -> dict:
        """The held-out evaluation after training (the last step's when it evaluated), the export, the summary."""
        ctx, cfg, roles, steps = self.ctx, self.ctx.cfg, self.roles, self.ctx.steps
        if self.last_eval.get("step") == steps:  # the last step's evaluation is the final one
            after = {k: v for k, v in self.last_eval.items() if k != "step"}
        else:
            with watchdog.phase("eval", step=steps):
                after = roles.run_on("actor", None, self.evaluate, otherwise={})
            ctx.metrics_log.log(steps, after)
        with watchdog.phase("checkpoint", step=steps, op="export (HF / orbax)"):
            colocated = cfg.placement.mode == "colocated"  # split: the pools export apart, a save cannot join them
            export_final(
                lambda: self.learner.export(ctx.run, ctx.tokenizer),
                ctx.run,
                steps,
                save=self.save if colocated else None,
            )
        roles.placement.barrier()  # every pool's export is on disk before anyone returns
        return summarize(
            cfg,
            ctx.run,
            ctx.env,
            self.before,
            after,
            steps=steps,
            wall=self.wall_before + time.time() - ctx.t_start,
            title=self.learner.title,
            extra={"placement": cfg.placement.mode},
        )


def device_memory(env: Any) -> dict[str, float]:
    """The step's peak GPU memory on this rank (GiB), then the peak is reset; nothing on a CPU."""
    if env.device.type != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated(env.device) / 2**30
    torch.cuda.reset_peak_memory_stats(env.device)
    return {"gpu_memory_gib": peak}
