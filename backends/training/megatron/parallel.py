"""Megatron's model-parallel groups (tensor, pipeline, data) on top of the default process group.

Megatron-core keeps its groups in module-level globals (``megatron.core.parallel_state``): a process
has one layout at a time. :func:`init_model_parallel` sets it up (or checks that the one already set up
is the same) and :func:`destroy_model_parallel` tears it down, so a test or a recipe can own the
lifetime explicitly. The default group must exist first (``backends.distributed.setup.init_distributed``);
on CPU it is gloo and megatron's groups are gloo too.

Rank layout (megatron's default order ``tp-cp-ep-dp-pp``): tensor-parallel ranks are adjacent, then
data-parallel replicas, then pipeline stages. ``dp = world / (tp * pp)``.
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist

__all__ = ["ParallelDims", "init_model_parallel", "destroy_model_parallel"]


@attrs.frozen
class ParallelDims:
    """This process's place in the (tp, pp, dp) grid and the groups to talk over."""

    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    model_parallel_group: dist.ProcessGroup  #: tp x pp ranks of one replica (for the grad norm)
    pp_ranks: tuple[int, ...]  #: global ranks of this pipeline, stage order

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def next_rank(self) -> int:
        return self.pp_ranks[self.pp_rank + 1]

    @property
    def prev_rank(self) -> int:
        return self.pp_ranks[self.pp_rank - 1]

    @property
    def last_stage_rank(self) -> int:
        return self.pp_ranks[-1]


def check_sizes(world_size: int, tp: int, pp: int) -> int:
    """``dp = world_size / (tp * pp)``; a clear error when the sizes do not fit."""
    if tp < 1 or pp < 1:
        raise ValueError(f"tensor / pipeline parallel sizes must be >= 1, got tp={tp}, pp={pp}")
    if world_size % (tp * pp):
        raise ValueError(
            f"world size {world_size} is not divisible by tp * pp = {tp} * {pp}: megatron needs world = tp * pp * dp"
        )
    return world_size // (tp * pp)


def init_model_parallel(tp: int = 1, pp: int = 1, *, seed: int = 0) -> ParallelDims:
    """Create megatron's groups for (tp, pp) over the default group and seed its RNG tracker.

    Idempotent for the same sizes; a different layout while one is live is an error (call
    :func:`destroy_model_parallel` first). The RNG tracker is megatron's inference tracker on CPU (the
    default one asks for the CUDA RNG state) and the CUDA one on GPU; it only matters for dropout and
    for megatron's own initialisation, both unused here (weights come from the HF checkpoint).
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not dist.is_initialized():
        raise RuntimeError(
            "init_model_parallel needs the default process group (backends.distributed.setup.init_distributed)"
        )
    check_sizes(dist.get_world_size(), tp, pp)
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if have != (tp, pp):
            raise RuntimeError(
                f"megatron's parallel state is already set up for (tp, pp) = {have}, asked for {(tp, pp)}: "
                "one layout per process (destroy_model_parallel() first)"
            )
    else:
        # Megatron's extra gloo groups are for its distributed-optimizer checkpointing; on CPU every
        # group is gloo already.
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            create_gloo_process_groups=torch.cuda.is_available(),
        )
        tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not torch.cuda.is_available())
    pp_group = ps.get_pipeline_model_parallel_group()
    return ParallelDims(
        tp=tp,
        pp=pp,
        dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=pp_group,
        dp_group=ps.get_data_parallel_group(),
        model_parallel_group=ps.get_model_parallel_group(),
        pp_ranks=tuple(dist.get_process_group_ranks(pp_group)),
    )


def destroy_model_parallel() -> None:
    """Tear megatron's groups down (safe to call when none exist)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
