"""The megatron-core engine as a :class:`backends.training.engine.TrainEngine`: the functions of
:mod:`backends.training.megatron.engine` and :mod:`backends.training.megatron.update` behind the engine's
methods, with the :class:`~backends.training.megatron.engine.MegatronConfig` (tensor / pipeline sizes,
micro-batches) the engine was made with. Megatron's parallel state spans every rank, so its roles are never
built on a pool of some of them, and it trains full weights (no LoRA adapter).
"""

from __future__ import annotations

import os
from typing import Any, ClassVar, Iterable

import torch
from torch import Tensor

from backends.training.common import LossFn, ModelOutputs
from backends.training.engine import TrainEngine
from backends.training.megatron import engine as M
from backends.training.megatron import update as U
from rlfunc.batch import RolloutBatch

__all__ = ["MegatronEngine", "make_megatron_engine"]


def _refuse_a_pool(mesh: Any, env: Any, role: str) -> None:
    """Megatron builds its groups over the whole world: a role on a pool of some ranks cannot be."""
    if mesh is not None and mesh.size() != env.world_size:
        raise ValueError(
            f"the megatron {role} needs placement=colocated: megatron's parallel state spans every "
            f"rank, but this {role} pool has {mesh.size()} of {env.world_size} ranks"
        )


class MegatronEngine(TrainEngine):
    """Megatron-core tensor / pipeline / data parallel over every rank of the world."""

    name: ClassVar[str] = "megatron"
    runs_on_a_pool: ClassVar[bool] = False
    trains_lora: ClassVar[bool] = False
    exports_orbax: ClassVar[bool] = False

    def __init__(self, config: M.MegatronConfig | None = None) -> None:
        self.config = config if config is not None else M.MegatronConfig()

    def __repr__(self) -> str:
        return f"MegatronEngine({self.config!r})"

    def build_actor(
        self, model_path: str | os.PathLike, env: Any, optim: Any, *, mesh: Any = None, lora: Any = None
    ) -> Any:
        if lora is not None:
            raise ValueError("actor.lora needs an engine that trains LoRA adapters (megatron trains full weights)")
        _refuse_a_pool(mesh, env, "actor")
        return M.build_actor(model_path, env, optim, self.config)

    def build_critic(
        self, model_path: str | os.PathLike, env: Any, optim: Any, *, seed: int = 0, mesh: Any = None
    ) -> Any:
        _refuse_a_pool(mesh, env, "critic")
        return M.build_critic(model_path, env, optim, self.config, seed=seed)

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
        if param_offload or compile:
            raise ValueError(
                "reference.backend=megatron does not take ref_in_actor, use_torch_compile or "
                "param_offload (FSDP options)"
            )
        _refuse_a_pool(mesh, env, "reference")
        return M.build_reference(model_path, env, self.config, log_prob_micro_batch_size)

    def reference_from_actor(self, actor: Any, *, log_prob_micro_batch_size: int | None = None) -> Any:
        raise ValueError(
            "reference.backend=megatron does not take ref_in_actor, use_torch_compile or param_offload (FSDP options)"
        )

    def compute_logprobs(
        self, state: Any, batch: RolloutBatch, *, with_entropy: bool = False, micro_batch_size: int | None = None
    ) -> ModelOutputs:
        return M.compute_logprobs(state, batch, with_entropy=with_entropy, micro_batch_size=micro_batch_size)

    def own_rows_logprobs(self, state: Any, batch: RolloutBatch) -> Tensor:
        return M.compute_logprobs_of_own_rows(state, batch)

    def compute_values(self, state: Any, batch: RolloutBatch, *, micro_batch_size: int | None = None) -> Tensor:
        return M.compute_values(state, batch, micro_batch_size=micro_batch_size)

    def update(
        self,
        state: Any,
        batch: RolloutBatch,
        loss_fn: LossFn,
        *,
        with_entropy: bool = False,
        skip_rows: Tensor | None = None,
    ) -> tuple[Any, dict[str, float]]:
        return U.update(state, batch, loss_fn, with_entropy=with_entropy, skip_rows=skip_rows)

    def full_state_dict(
        self, state: Any, *, dtype: torch.dtype | None = None, bucket_mb: float | None = None
    ) -> Iterable[tuple[str, Tensor]]:
        return M.full_state_dict(state, dtype=dtype, bucket_mb=bucket_mb)

    def export_hf(
        self, state: Any, out_dir: str | os.PathLike, *, tokenizer: Any = None, overwrite: bool = False
    ) -> Any:
        return M.export_hf(state, out_dir, tokenizer=tokenizer, overwrite=overwrite)

    def fresh_optimizer(self, state: Any, optim: Any) -> Any:
        return M.fresh_optimizer(state, optim)

    def data_parallel(self, state: Any) -> tuple[int, int]:
        return state.dims.dp_rank, state.dims.dp

    def share_batch(self, state: Any, batch: RolloutBatch) -> RolloutBatch:
        return M.broadcast_batch(state, batch)

    def checkpoint_name(self, state: Any, role: str) -> str:
        return M.checkpoint_name(state, role)

    def replica_group(self, state: Any) -> Any:
        return state.dims.model_parallel_group

    def logprob_numerics(self, state: Any) -> str | None:
        return None  # megatron's own layers and vocab-parallel log-softmax: close to an HF forward, not equal


def make_megatron_engine(
    *, fsdp: Any = None, tp: int = 1, pp: int = 1, micro_batch_size: int | None = None, key: str = "actor"
) -> MegatronEngine:
    """The registry's factory (:mod:`backends.training.engines`): ``tp`` / ``pp`` are megatron's sizes; the
    micro-batch size is ``micro_batch_size``, else the FSDPConfig's (``fsdp``), else 8."""
    mbs = micro_batch_size or (fsdp.micro_batch_size if fsdp is not None else 8)
    return MegatronEngine(M.MegatronConfig(tp=tp, pp=pp, micro_batch_size=mbs))
