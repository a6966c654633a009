"""Choosing the training engine of a role by name: ``fsdp`` (FSDP2, data parallel) or ``megatron``
(megatron-core tensor / pipeline / data parallel). Both have the same explicit-state functions; a
recipe calls them through the :class:`Engine` it gets here, so ``actor.backend=megatron actor.tp=2``
is the only change a run needs.

The one difference a recipe must respect is which ranks share data: FSDP ranks are all
data-parallel, while megatron's tensor- and pipeline-parallel peers must see the *same* rows.
:meth:`Engine.data_parallel` gives the data-parallel (rank, size) to split training rows by;
:meth:`Engine.sample_shard` the shard of the step's prompts this rank samples (every rank samples a different
one, megatron's peers included) and :meth:`Engine.replica_samples` the replica's batch gathered from its ranks'
shards (:mod:`backends.distributed.sample_shards`). :meth:`Engine.share_batch` makes a batch sampled whole on
one rank identical on a replica's ranks.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs

from backends.distributed.sample_shards import gather_shards, sampling_shard

__all__ = ["BACKENDS", "Engine", "select_engine"]

BACKENDS = ("fsdp", "megatron")


@attrs.frozen
class Engine:
    name: str
    config: Any  #: FSDPConfig or MegatronConfig: the engine-specific argument of build_actor / build_reference
    build_actor: Callable[..., Any]
    build_reference: Callable[..., Any]
    build_critic: Callable[..., Any]
    compute_logprobs: Callable[..., Any]
    compute_values: Callable[..., Any]
    update: Callable[..., Any]
    full_state_dict: Callable[..., Any]
    export_hf: Callable[..., Any]
    fresh_optimizer: Callable[..., Any]
    data_parallel: Callable[[Any], "tuple[int, int]"]  #: state -> (data-parallel rank, size)
    share_batch: Callable[[Any, Any], Any]  #: (state, batch) -> the batch every rank of the replica trains on
    #: (state, role) -> the name this rank's part of the role has in a checkpoint (megatron: one per shard)
    checkpoint_name: Callable[[Any, str], str]
    #: state -> the model-parallel group of this rank's replica, whose ranks sample shards of its prompts
    #: (None: a replica of one rank)
    replica_group: Callable[[Any], Any] = lambda state: None

    def sample_shard(self, state: Any) -> tuple[int, int]:
        """``(shard, shards)``: this rank samples ``prompts[shard::shards]`` of a step (see the module doc)."""
        dp_rank, dp_size = self.data_parallel(state)
        return sampling_shard(dp_rank, dp_size, self.replica_group(state))

    def replica_samples(self, state: Any, batch: Any, rows: Sequence[Any]) -> tuple[Any, list]:
        """The replica's batch (and each row's example) from the shards its ranks sampled and scored."""
        return gather_shards(batch, rows, self.replica_group(state))


def select_engine(backend: str, *, fsdp: Any = None, tp: int = 1, pp: int = 1, micro_batch_size: int | None = None) -> Engine:
    """The engine called ``backend``; ``fsdp`` is the FSDPConfig (its micro-batch size is reused by
    megatron unless ``micro_batch_size`` is given), ``tp`` / ``pp`` megatron's sizes."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if backend == "fsdp":
        if tp != 1 or pp != 1:
            raise ValueError(f"tp={tp} / pp={pp} need backend=megatron (the fsdp backend is data parallel only)")
        from backends.training import fsdp as F
        from backends.checkpoint.hf_export import export_hf
        from backends.training.optim import fresh_optimizer

        return Engine(
            name="fsdp", config=fsdp if fsdp is not None else F.FSDPConfig(), build_actor=F.build_actor,
            build_reference=F.build_reference, build_critic=F.build_critic, compute_logprobs=F.compute_logprobs,
            compute_values=F.compute_values, update=F.update,
            full_state_dict=F.full_state_dict, export_hf=export_hf, fresh_optimizer=fresh_optimizer,
            data_parallel=lambda state: (state.env.rank, state.env.world_size), share_batch=lambda state, batch: batch,
            checkpoint_name=lambda state, role: role,
        )
    from backends.training.megatron import engine as M

    mbs = micro_batch_size or (fsdp.micro_batch_size if fsdp is not None else 8)
    cfg = M.MegatronConfig(tp=tp, pp=pp, micro_batch_size=mbs)
    return Engine(
        name="megatron", config=cfg, build_actor=M.build_actor, build_reference=M.build_reference,
        build_critic=M.build_critic, compute_logprobs=M.compute_logprobs, compute_values=M.compute_values,
        update=M.update, full_state_dict=M.full_state_dict,
        export_hf=M.export_hf, fresh_optimizer=M.fresh_optimizer,
        data_parallel=lambda state: (state.dims.dp_rank, state.dims.dp), share_batch=M.broadcast_batch,
        checkpoint_name=M.checkpoint_name, replica_group=lambda state: state.dims.model_parallel_group,
    )
