"""The trained roles of an actor-critic recipe (actor, critic, reference) and where they live.

:class:`Roles` owns the placement (``backends.distributed.placement``), the roles' explicit states and
the moves of a batch between the roles' rank pools, so that a recipe's loop reads the same whether
every role runs on every rank (colocated) or the actor and the critic run on two pools (split):

    batch = roles.run_on("actor", "rollout", sample, step)          # None on ranks without the actor
    batch = roles.old_logprobs(batch)
    critic_batch = roles.to_critic(batch)                            # identity when colocated
    critic_batch = roles.compute_values(roles.reference_logprobs(critic_batch))
    ...
    batch = roles.to_actor(critic_batch, like=batch)
    critic_metrics = roles.update_critic(critic_batch, critic_loss, epochs=..., mini_batches=...)
    actor_metrics = roles.update_actor(batch, actor_loss, epochs=..., mini_batches=...)

Each method does its work on the ranks that hold the role and passes its input through (or returns
``None`` / ``[]``) elsewhere; the moves are collectives of every rank. Each method also records how long
its work took on this rank (:meth:`step_times`), so the pools' phases can be reported side by side.
The rollout engine is not a role here (training never imports the rollout package): a recipe builds
and drives it on the actor's ranks with :meth:`run_on`.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import attrs
import torch
from torch import Tensor

import rlfunc as rf
from backends.distributed.placement import ROLE_POOL, Placement, PlacementConfig, build_placement
from backends.distributed.setup import DistEnv
from backends.training.engine import TrainEngine
from backends.training.reference import ReferenceConfig, build_reference_role, reference_engine

__all__ = ["Roles", "build_roles"]


@attrs.define
class Roles:
    """This rank's part of the actor / critic / reference roles (``None`` for a role it does not hold)."""

    placement: Placement
    actor_engine: TrainEngine
    critic_engine: TrainEngine
    actor: Any = None
    critic: Any = None
    reference: Any = None
    reference_engine: TrainEngine | None = None  #: the engine ``reference.backend`` names (set with the reference)
    #: the reference is laid out as the actor (``reference.backend=actor``): a rank's rows are its replica's batch
    reference_rows_are_replicas: bool = False
    #: seconds of work per phase on this rank since the last :meth:`step_times`
    times: dict[str, float] = attrs.field(factory=dict)

    # -------------------------------------------------------------------------------- where things are

    @property
    def on_actor(self) -> bool:
        return self.placement.has("actor")

    @property
    def on_critic(self) -> bool:
        return self.placement.has("critic")

    def env(self, role: str) -> DistEnv | None:
        """This rank's DistEnv within ``role``'s pool (the world's when colocated); None outside it."""
        return self.placement.env(role) if self.placement.has(role) else None

    def pool_size(self, role: str) -> int:
        """Ranks in ``role``'s pool."""
        return len(self.placement.pools[ROLE_POOL[role]])

    def data_parallel(self) -> tuple[int, int]:
        """The actor's data-parallel (rank, size): prompts are split by it (megatron's TP / PP peers share rows)."""
        return self.actor_engine.data_parallel(self.actor)

    @contextlib.contextmanager
    def timed(self, phase: str | None) -> Iterator[None]:
        """Add the block's wall time to ``phase`` (nothing for ``None``)."""
        t = time.perf_counter()
        yield
        if phase is not None:
            self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - t

    def run_on(
        self, role: str, phase: str | None, fn: Callable[..., Any], *args: Any, otherwise: Any = None, **kwargs: Any
    ) -> Any:
        """``fn(*args, **kwargs)`` on the ranks that hold ``role`` (timed as ``phase``); ``otherwise`` elsewhere."""
        if not self.placement.has(role):
            return otherwise
        with self.timed(phase):
            return fn(*args, **kwargs)

    def share(self, obj: Any, role: str) -> Any:
        """``role``'s pool leader's ``obj`` (picklable) on every rank; identity when colocated."""
        return self.placement.share(obj, role)

    # -------------------------------------------------------------------------------- building

    def build_actor(self, model_path: str | os.PathLike, optim: Any, **build_kwargs: Any) -> None:
        """The actor (with ``optim``) on its pool, from an HF dir; ``build_kwargs``: the engine's own (a LoRA
        adapter)."""
        if self.on_actor:
            engine = self.actor_engine
            self.actor = engine.build_actor(
                model_path, self.placement.env("actor"), optim, mesh=self.placement.mesh("actor"), **build_kwargs
            )

    def build_critic(self, model_path: str | os.PathLike, optim: Any, *, seed: int) -> None:
        """The critic on its pool: the backbone of ``model_path`` with a fresh value head seeded by ``seed``."""
        if self.on_critic:
            engine = self.critic_engine
            self.critic = engine.build_critic(
                model_path, self.placement.world, optim, seed=seed, mesh=self.placement.mesh("critic")
            )

    def build_reference(self, cfg: ReferenceConfig, model_path: str | os.PathLike, fsdp_cfg: Any) -> None:
        """The frozen reference on its pool (the critic's under split placement); ``reference.backend=actor`` builds
        it with the actor's engine and layout."""
        if self.placement.has("reference"):
            same = cfg.backend == "actor"
            self.reference_engine = reference_engine(cfg, fsdp_cfg, self.actor_engine)
            self.reference = build_reference_role(
                cfg,
                model_path,
                self.placement.world,
                fsdp_cfg,
                mesh=self.placement.mesh("reference"),
                actor=self.actor,
                engine=self.reference_engine,
            )
            self.reference_rows_are_replicas = same

    def map_actor(self, fn: Callable[[Any], Any]) -> None:
        """Replace the actor by ``fn(actor)`` on its pool (a warm-start stage, a fresh optimizer, ...)."""
        if self.on_actor:
            self.actor = fn(self.actor)

    # -------------------------------------------------------------------------------- the step's work

    def to_critic(self, batch: Any) -> Any:
        """The actor pool's rows, as this rank's share on the critic pool (a collective; colocated: ``batch``)."""
        with self.timed("to_critic_pool"):
            return self.placement.move(batch, "actor", "critic")

    def to_actor(self, batch: Any, *, like: Any) -> Any:
        """The critic pool's rows back on the ranks that sampled them (``like``: the batch this rank sent)."""
        with self.timed("to_actor_pool"):
            return self.placement.move(batch, "critic", "actor", like=like)

    def old_logprobs(self, batch: Any) -> Any:
        """``batch`` with the log-probs of its tokens under the current policy (actor pool)."""
        if not self.on_actor:
            return batch
        with self.timed("old_logprob"):
            return batch.replace(old_logprobs=self.actor_engine.compute_logprobs(self.actor, batch).logprobs)

    def reference_logprobs(self, batch: Any) -> Any:
        """``batch`` with the reference's log-probs, where a reference was built; else ``batch``."""
        if self.reference is None:
            return batch
        with self.timed("reference"):
            if self.reference_rows_are_replicas:
                return batch.replace(
                    ref_logprobs=self.reference_engine.compute_logprobs(self.reference, batch).logprobs
                )
            return batch.replace(ref_logprobs=self.reference_engine.own_rows_logprobs(self.reference, batch))

    def compute_values(self, batch: Any) -> Any:
        """``batch`` with the critic's values (also kept as ``old_values`` for the clipped value loss)."""
        if not self.on_critic or self.critic is None:
            return batch
        with self.timed("values"):
            values = self.critic_engine.compute_values(self.critic, batch)
            return batch.replace(values=values, old_values=values)

    def update_critic(self, batch: Any, loss_fn: Callable, *, epochs: int, mini_batches: int) -> list[dict]:
        """``epochs`` x ``mini_batches`` critic optimizer steps; their metrics (``[]`` off the critic pool)."""
        if not self.on_critic or self.critic is None:
            return []
        metrics = []
        with self.timed("critic_update"):
            for _ in range(epochs):
                for mini_batch in rf.split(batch, mini_batches):
                    self.critic, m = self.critic_engine.update(self.critic, mini_batch, loss_fn)
                    metrics.append(m)
        return metrics

    def update_actor(
        self,
        batch: Any,
        loss_fn: Callable,
        *,
        epochs: int,
        mini_batches: int,
        skip_rows: Tensor | None = None,
        **update_kwargs: Any,
    ) -> list[dict]:
        """``epochs`` x ``mini_batches`` actor optimizer steps; their metrics (``[]`` off the actor pool).
        ``skip_rows``: rows that get no forward / backward (split with the batch)."""
        if not self.on_actor:
            return []
        metrics = []
        skips = [None] * mini_batches if skip_rows is None else list(torch.tensor_split(skip_rows, mini_batches))
        with self.timed("actor_update"):
            for _ in range(epochs):
                for mini_batch, skip in zip(rf.split(batch, mini_batches), skips):
                    self.actor, m = self.actor_engine.update(
                        self.actor, mini_batch, loss_fn, skip_rows=skip, **update_kwargs
                    )
                    metrics.append(m)
        return metrics

    def actor_weights(self, **gather: Any) -> Any:
        """The actor's full HF-named tensors (a collective of the actor pool; None off it), for a weight sync;
        ``gather``: the engine's ``full_state_dict`` options (``dtype``, ``bucket_mb``)."""
        return self.actor_engine.full_state_dict(self.actor, **gather) if self.on_actor else None

    def step_times(self) -> dict[str, float]:
        """Every phase's time this step: the critic pool leader's for its phases, this rank's for the rest
        (colocated: all this rank's). Call on every rank (a collective under split placement); resets."""
        mine, self.times = self.times, {}
        return {**self.share(dict(mine), "critic"), **mine}

    # -------------------------------------------------------------------------------- checkpoints and export

    def checkpoint_states(self) -> dict[str, Any]:
        """The states this rank holds, by their checkpoint names (megatron: one per tensor / pipeline shard)."""
        states = {}
        if self.on_actor:
            states[self.actor_engine.checkpoint_name(self.actor, "actor")] = self.actor
        if self.on_critic and self.critic is not None:
            states[self.critic_engine.checkpoint_name(self.critic, "critic")] = self.critic
        return states

    def load_checkpoint_states(self, states: dict[str, Any]) -> None:
        """Take the roles back from ``states`` (what ``load_checkpoint`` returned for :meth:`checkpoint_states`)."""
        if self.on_actor:
            self.actor = states[self.actor_engine.checkpoint_name(self.actor, "actor")]
        if self.on_critic and self.critic is not None:
            self.critic = states[self.critic_engine.checkpoint_name(self.critic, "critic")]

    def export_hf(self, run_dir: str | os.PathLike, tokenizer: Any) -> None:
        """HF dirs ``final_model`` (the actor, a causal LM) and, with a critic, ``final_critic`` (a value model),
        each written by its pool."""
        if self.on_actor:
            self.actor_engine.export_hf(self.actor, Path(run_dir) / "final_model", tokenizer=tokenizer, overwrite=True)
        if self.on_critic and self.critic is not None:
            self.critic_engine.export_hf(
                self.critic, Path(run_dir) / "final_critic", tokenizer=tokenizer, overwrite=True
            )


def build_roles(cfg: PlacementConfig, env: DistEnv, actor_engine: TrainEngine, critic_engine: TrainEngine) -> Roles:
    """The placement of ``cfg`` on this world (a collective of all ranks) with no role built yet."""
    return Roles(placement=build_placement(cfg, env), actor_engine=actor_engine, critic_engine=critic_engine)
