"""The training half of an RL step, written once for every algorithm and placement: a sampled, scored batch in,
the updated roles and the step's metrics out.

    old log-probs (the actor's, or the rollout's where both engines compute the same numbers)
    -> the batch to the critic's pool -> reference log-probs, values -> rollout rejection -> advantages (the algorithm)
    -> back to the actor's pool -> critic update(s) -> actor update(s) (after the critic warm-up)

The roles and the moves between their pools are :class:`backends.training.roles.Roles`'s, so the same code runs
colocated (every role on every rank), with the critic and the reference on a pool of their own
(``placement.mode=split``), and on the trainer pool of an asynchronous run (:mod:`backends.loop.split`). What the
learner carries between steps is explicit: the roles' states and the algorithm's state (checkpointed together).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import attrs
import torch

import rlfunc as rf
from backends.checkpoint.orbax import save_orbax
from backends.distributed.collectives import all_reduce_sum, sum_and_max
from backends.loop.algorithm import Algorithm, reject_mismatched_tokens, zero_advantage_rows_are_skippable
from backends.loop.fingerprints import (
    STAGES,
    FingerprintLog,
    batch_tensors,
    fingerprint_stages,
    module_tensors,
    scalars,
)
from backends.loop.stages import RunData, RunPaths, start_actor
from backends.training.roles import Roles

__all__ = ["Learner", "build_learner", "learner_for", "mean_metrics", "step_stats"]


@attrs.define
class Learner:
    """This rank's roles, the algorithm and its state, and how a step trains them."""

    cfg: Any
    algorithm: Algorithm
    roles: Roles
    state: dict  #: the algorithm's state (:meth:`Algorithm.initial_state`), as the critic pool's leader has it
    mini_batches: int  #: optimizer steps per pass over a step's batch
    skip_zero_rows: bool  #: rows with all-zero advantages get no forward / backward (exact for the loss in use)
    fingerprints: FingerprintLog | None = None  #: where each step's fingerprints go (``debug.fingerprints``)

    @property
    def title(self) -> str:
        return self.algorithm.title

    def updates_actor(self, step: int) -> bool:
        """Whether ``step`` updates the actor (not during the critic's warm-up): the rollout needs new weights."""
        return step > self.cfg.algo.critic_warmup

    def train(
        self, batch: rf.RolloutBatch | None, step: int, *, seed: int, on_policy: bool = False
    ) -> tuple[rf.RolloutBatch | None, dict[str, float]]:
        """Train on the step's batch (``None`` on ranks without the actor); the batch with its advantages and the
        step's metrics on the actor's ranks. ``seed``: the step's seed for a random loss; ``on_policy``: the
        batch's rollout log-probs are the trainer's (the weight bridge checked that both engines agree)."""
        cfg, roles, algorithm = self.cfg, self.roles, self.algorithm
        if on_policy and batch is not None:
            batch = batch.replace(old_logprobs=batch.rollout_logprobs)
        elif not on_policy:
            batch = roles.old_logprobs(batch)
        critic_batch = roles.compute_values(roles.reference_logprobs(roles.to_critic(batch)))
        advantages = roles.run_on("critic", "advantages", self._advantages, critic_batch, otherwise=(critic_batch, {}))
        critic_batch, adv_metrics = advantages
        batch = roles.to_actor(critic_batch, like=batch)
        critic_metrics = []
        if algorithm.uses_critic:
            critic_metrics = roles.update_critic(
                critic_batch, algorithm.critic_loss, epochs=cfg.algo.ppo_epochs, mini_batches=self.mini_batches
            )
        actor_metrics, skip = [], None
        if self.updates_actor(step) and roles.on_actor:
            mask = rf.loss_tokens(batch)
            skip = rf.zero_advantage_rows(batch.advantages, mask=mask) if self.skip_zero_rows else None
            loss_fn = _with_seed(algorithm.actor_loss, seed)
            actor_metrics = roles.update_actor(
                batch,
                loss_fn,
                epochs=cfg.algo.ppo_epochs,
                mini_batches=self.mini_batches,
                skip_rows=skip,
                with_entropy=True,
            )
        # the critic pool's side of the step (its metrics and the algorithm's new state) reaches the actor's ranks
        adv_metrics, critic_metrics, self.state = roles.share((adv_metrics, critic_metrics, self.state), "critic")
        metrics = {
            **adv_metrics,
            **mean_metrics(actor_metrics),
            **{f"critic/{k}": v for k, v in mean_metrics(critic_metrics).items()},
        }
        if batch is not None:
            metrics["skipped_rows"] = _share_of_rows(skip, batch, roles)
            if self.fingerprints is not None:
                t = time.perf_counter()
                self.fingerprints.log(step, self.fingerprint(batch, metrics))
                metrics["time/fingerprint_s"] = time.perf_counter() - t
        return batch, metrics

    def fingerprint(self, batch: rf.RolloutBatch, metrics: dict[str, float]) -> dict[str, dict]:
        """This rank's fingerprints of the step (:mod:`backends.loop.fingerprints`): the batch by stage, the losses,
        the gradient norms and the updated weights (the actor's, and a critic's on the same ranks)."""
        roles = self.roles
        weights = module_tensors("actor", roles.actor.module)
        if roles.on_critic and roles.critic is not None:
            weights.update(module_tensors("critic", roles.critic.module))
        losses = ("loss", "pg_loss", "kl_loss", "critic/loss")
        stages = fingerprint_stages({**batch_tensors(batch), "weights": weights})
        stages["loss"] = scalars(metrics, losses)
        stages["gradient"] = scalars(metrics, ("grad_norm", "critic/grad_norm"))
        return {stage: stages[stage] for stage in STAGES}

    def _advantages(self, batch: rf.RolloutBatch) -> tuple[rf.RolloutBatch, dict[str, float]]:
        batch, rejected = reject_mismatched_tokens(batch, self.cfg.algo)
        batch, self.state, metrics = self.algorithm.advantages(batch, self.state, env=self.roles.env("critic"))
        return batch, {**metrics, **{k: float(v) for k, v in rejected.items()}}

    # -------------------------------------------------------------------------------- checkpoints and export

    def states(self) -> dict[str, Any]:
        """The trained states this rank holds, by their checkpoint names (sharded, with their optimizers)."""
        return self.roles.checkpoint_states()

    def load(self, states: dict[str, Any], algorithm_state: dict) -> None:
        """Take the trained states and the algorithm's state back from a checkpoint."""
        self.roles.load_checkpoint_states(states)
        self.state = dict(algorithm_state)

    def weights(self, bridge: Any) -> Any:
        """The policy's full tensors as ``bridge`` gathers them (a collective of the actor's pool)."""
        return bridge.weights(self.roles.actor_engine, self.roles.actor)

    def export(self, run: RunPaths, tokenizer: Any) -> None:
        """``export.hf``: the actor (``final_model``) and a critic (``final_critic``) as HF dirs; ``export.orbax``: the
        actor's gathered train state (``actor_orbax``)."""
        if self.cfg.export.hf:
            self.roles.export_hf(run.run_dir, tokenizer)
        if self.cfg.export.orbax:
            self.roles.run_on(
                "actor", None, lambda: save_orbax(self.roles.actor, run.run_dir / "actor_orbax", overwrite=True)
            )


def _with_seed(loss: Callable, seed: int) -> Callable:
    def loss_fn(out: Any, mini_batch: rf.RolloutBatch, norms: rf.Normalizers) -> Any:
        return loss(out, mini_batch, norms, seed=seed)

    return loss_fn


def _share_of_rows(skip: torch.Tensor | None, batch: rf.RolloutBatch, roles: Roles) -> float:
    """The share of the actor pool's rows that got no forward / backward this step."""
    env = roles.env("actor")
    local = torch.tensor([float(skip.sum()) if skip is not None else 0.0, float(rf.batch_size(batch))])
    skipped, rows = all_reduce_sum(local, group=env.group).tolist()
    return skipped / max(rows, 1.0)


def build_learner(
    cfg: Any,
    algorithm: Algorithm,
    roles: Roles,
    run: RunPaths,
    data: RunData,
    tokenizer: Any,
    *,
    rl_optim: Any,
    critic_optim: Any,
    mini_batches: int,
    metrics_log: Any,
    build_kwargs: dict,
    before_sft_update: Callable[[int], None] | None = None,
) -> Learner:
    """The roles built on their pools: the actor (after the SFT stage on a fresh run with SFT data), the critic from the
    policy's backbone with a seeded value head, the frozen reference; the algorithm's starting state."""
    start_actor(
        cfg,
        roles,
        run,
        data,
        tokenizer,
        rl_optim,
        metrics_log,
        build_kwargs=build_kwargs,
        before_sft_update=before_sft_update,
    )
    if algorithm.uses_critic:
        roles.build_critic(run.policy_path, critic_optim, seed=cfg.seed)
    if algorithm.uses_reference:
        roles.build_reference(cfg.reference, run.policy_path, cfg.actor.fsdp)
    fingerprints = None
    if cfg.debug.fingerprints and roles.on_actor:  # the actor pool's leader (global rank 0) writes them
        fingerprints = FingerprintLog(run.run_dir, enabled=True, rank=roles.env("actor").rank)
    return Learner(
        fingerprints=fingerprints,
        cfg=cfg,
        algorithm=algorithm,
        roles=roles,
        state=algorithm.initial_state(),
        mini_batches=mini_batches,
        skip_zero_rows=zero_advantage_rows_are_skippable(cfg.algo, algorithm.policy_loss),
    )


def learner_for(ctx: Any, roles: Roles, before_sft_update: Callable[[int], None] | None = None) -> Learner:
    """:func:`build_learner` with what the start-up prepared (``ctx``: :class:`backends.loop.rl_loop.RunContext`)."""
    return build_learner(
        ctx.cfg,
        ctx.algorithm,
        roles,
        ctx.run,
        ctx.data,
        ctx.tokenizer,
        rl_optim=ctx.rl_optim,
        critic_optim=ctx.critic_optim,
        mini_batches=ctx.mini_batches,
        metrics_log=ctx.metrics_log,
        build_kwargs=ctx.build_kwargs,
        before_sft_update=before_sft_update,
    )


def mean_metrics(rows: list[dict]) -> dict:
    """Mean of each engine metric over this step's optimizer steps (a running total: its last value)."""
    last = ("nonfinite_updates_skipped",)
    return {k: rows[-1][k] if k in last else sum(r[k] for r in rows) / len(rows) for k in rows[0]} if rows else {}


def step_stats(batch: rf.RolloutBatch, times: dict[str, float], dp_size: int, group: Any = None) -> dict[str, float]:
    """The step's reward, length (mean and longest), values and returns (with a critic) and throughput over every
    rank's rows (of ``group``)."""
    mask = batch.response_mask
    with_values = batch.values is not None
    local = torch.stack(
        [
            batch.scores.sum().float(),
            mask.sum(-1).float().sum(),
            torch.tensor(float(rf.batch_size(batch))),
            (batch.prompt_mask.sum() + mask.sum()).float(),
            (batch.values * mask).sum().float() if with_values else torch.zeros(()),
            (batch.returns * mask).sum().float() if with_values else torch.zeros(()),
            mask.sum().float(),
        ]
    )
    lengths = mask.sum(-1).float()
    local_longest = torch.cat([lengths, lengths.new_zeros(1)]).max()[None]  # a long tail's cost
    sums, longest = sum_and_max(local, local_longest, group=group)
    score_sum, length_sum, rows, num_tokens, values_sum, returns_sum, tokens = sums.tolist()
    longest = longest.item()
    world_per_replica = max(rows, 1.0) / max(float(rf.batch_size(batch)) * dp_size, 1.0)  # megatron peers repeat rows
    stats = {
        "reward_mean": score_sum / max(rows, 1.0),
        "response_length": length_sum / max(rows, 1.0),
        "response_length_max": longest,
        "tokens_per_s": num_tokens / world_per_replica / times["step_time_s"],
        **times,
    }
    if with_values:
        stats.update(values_mean=values_sum / max(tokens, 1.0), returns_mean=returns_sum / max(tokens, 1.0))
    return stats
