"""The training engine interface: what a recipe, the roles and the weight bridge call, whichever engine trains.

:class:`TrainEngine` is a :class:`typing.Protocol`. An engine object holds its configuration (``config``) and
no training state: every method takes the explicit state it works on (``state, metrics = engine.update(state,
batch, loss_fn)``), as the rest of the shim does. FSDP2 (:class:`backends.training.fsdp_engine.FSDPEngine`) and
megatron-core (:class:`backends.training.megatron.train_engine.MegatronEngine`) implement it; engines are made by
name through the registry in :mod:`backends.training.engines`, and nothing outside an engine's own modules asks
which engine it has: a difference that matters is a method or a feature flag here.

The one difference a caller must respect is which ranks share data: FSDP ranks are all data-parallel, while
megatron's tensor- and pipeline-parallel peers must see the *same* rows. :meth:`TrainEngine.data_parallel` gives
the data-parallel (rank, size) to split training rows by; :meth:`TrainEngine.sample_shard` the shard of the step's
prompts this rank samples (every rank samples a different one, megatron's peers included) and
:meth:`TrainEngine.replica_samples` the replica's batch gathered from its ranks' shards
(:mod:`backends.distributed.sample_shards`). :meth:`TrainEngine.share_batch` makes a batch sampled whole on one
rank identical on a replica's ranks.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar, Iterable, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor

from backends.distributed.sample_shards import gather_shards, sampling_shard
from backends.training.common import LossFn, ModelOutputs
from rlfunc.batch import RolloutBatch

__all__ = ["TrainEngine"]


@runtime_checkable
class TrainEngine(Protocol):
    """A training engine: builds the roles' states and runs their forwards, updates and weight gathers."""

    name: ClassVar[str]  #: the registry name (``actor.backend``); for messages, never for dispatch
    config: Any  #: the engine's own settings (FSDPConfig, MegatronConfig)
    #: whether a role may live on a subset of the ranks (a split placement's pool, given as ``mesh``)
    runs_on_a_pool: ClassVar[bool]
    trains_lora: ClassVar[bool]  #: whether ``build_actor`` takes a LoRA adapter (``lora=``)
    #: whether :func:`backends.checkpoint.orbax.save_orbax` can gather a state (one module sharded over a 1-D mesh)
    exports_orbax: ClassVar[bool]

    def build_actor(
        self, model_path: str | os.PathLike, env: Any, optim: Any, *, mesh: Any = None, lora: Any = None
    ) -> Any:
        """The trained policy with its optimizer (``optim``), from an HF dir; ``mesh``: its pool (None: every rank);
        ``lora``: a :class:`backends.training.lora.LoraConfig` with rank > 0 (only where ``trains_lora``)."""
        ...

    def build_critic(
        self, model_path: str | os.PathLike, env: Any, optim: Any, *, seed: int = 0, mesh: Any = None
    ) -> Any:
        """The value model: the backbone of ``model_path`` under a value head seeded by ``seed``."""
        ...

    def build_reference(
        self,
        model_path: str | os.PathLike,
        env: Any,
        *,
        mesh: Any = None,
        log_prob_micro_batch_size: int | None = None,
        param_offload: bool = False,
        compile: bool = False,
    ) -> Any:
        """A frozen, forward-only copy of a model (no optimizer); an engine refuses options it does not have."""
        ...

    def reference_from_actor(self, actor: Any, *, log_prob_micro_batch_size: int | None = None) -> Any:
        """The reference as a LoRA actor's own module with its adapter disabled (no second copy)."""
        ...

    def compute_logprobs(
        self, state: Any, batch: RolloutBatch, *, with_entropy: bool = False, micro_batch_size: int | None = None
    ) -> ModelOutputs:
        """Log-probs ``(b t)`` (and entropy) of the response tokens, no gradients; a collective of the replica."""
        ...

    def own_rows_logprobs(self, state: Any, batch: RolloutBatch) -> Tensor:
        """Log-probs ``(b t)`` of *this rank's* rows when every rank brings different rows (a reference serving a
        data-parallel recipe)."""
        ...

    def compute_values(self, state: Any, batch: RolloutBatch, *, micro_batch_size: int | None = None) -> Tensor:
        """A critic's values ``(b t)`` at the positions that predict the response tokens."""
        ...

    def update(
        self,
        state: Any,
        batch: RolloutBatch,
        loss_fn: LossFn,
        *,
        with_entropy: bool = False,
        skip_rows: Tensor | None = None,
    ) -> tuple[Any, dict[str, float]]:
        """One optimizer step on this rank's share of the global batch: ``(new state, metrics)``."""
        ...

    def full_state_dict(
        self, state: Any, *, dtype: torch.dtype | None = None, bucket_mb: float | None = None
    ) -> Iterable[tuple[str, Tensor]]:
        """``(hf_name, full tensor)`` pairs on every rank (a collective), cast to ``dtype``, gathered in buckets of
        about ``bucket_mb`` MiB where the engine gathers in buckets."""
        ...

    def export_hf(
        self, state: Any, out_dir: str | os.PathLike, *, tokenizer: Any = None, overwrite: bool = False
    ) -> Any:
        """Write the state as an HF dir (every rank calls it)."""
        ...

    def fresh_optimizer(self, state: Any, optim: Any) -> Any:
        """Same weights, a new optimizer and LR schedule (RL after an SFT stage)."""
        ...

    def data_parallel(self, state: Any) -> tuple[int, int]:
        """This rank's data-parallel (rank, size): training rows are split by it."""
        ...

    def share_batch(self, state: Any, batch: RolloutBatch) -> RolloutBatch:
        """The batch every rank of the replica trains on (the replica's first rank's)."""
        ...

    def checkpoint_name(self, state: Any, role: str) -> str:
        """The name this rank's part of ``role`` has in a checkpoint."""
        ...

    def replica_group(self, state: Any) -> Any:
        """The model-parallel group of this rank's replica, whose ranks sample shards of its prompts (None: a
        replica of one rank)."""
        ...

    def logprob_numerics(self, state: Any) -> str | None:
        """A label of how the engine computes log-probs (``"hf-float32"``: the HF model's own fp32 forward): a
        rollout engine that gives the same label computes the same numbers, so its log-probs can stand in for the
        trainer's (the weight bridge's parity check). None: numerics of the engine's own."""
        ...

    def sample_shard(self, state: Any) -> tuple[int, int]:
        """``(shard, shards)``: this rank samples ``prompts[shard::shards]`` of a step (see the module doc)."""
        dp_rank, dp_size = self.data_parallel(state)
        return sampling_shard(dp_rank, dp_size, self.replica_group(state))

    def replica_samples(self, state: Any, batch: RolloutBatch, rows: Sequence[Any]) -> tuple[RolloutBatch, list]:
        """The replica's batch (and each row's example) from the shards its ranks sampled and scored."""
        return gather_shards(batch, rows, self.replica_group(state))
