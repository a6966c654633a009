"""The FSDP2 engine as a :class:`backends.training.engine.TrainEngine`: the functions of
:mod:`backends.training.fsdp` (and its checkpoint / export helpers) behind the engine's methods, with the
:class:`~backends.training.fsdp.FSDPConfig` the engine was made with. Every rank is data-parallel.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar, Iterable

import torch
from torch import Tensor

from backends.checkpoint.hf_export import export_hf
from backends.distributed.sharded_state import DEFAULT_BUCKET_MB
from backends.training import fsdp
from backends.training.common import LossFn, ModelOutputs
from backends.training.engine import TrainEngine
from backends.training.fsdp import FSDPConfig
from backends.training.fsdp_state import compute_dtype
from backends.training.optim import fresh_optimizer
from rlfunc.batch import RolloutBatch

__all__ = ["FSDPEngine", "make_fsdp_engine"]


class FSDPEngine(TrainEngine):
    """FSDP2 over a 1-D mesh of data-parallel ranks (every rank, or a role's pool)."""

    name: ClassVar[str] = "fsdp"
    runs_on_a_pool: ClassVar[bool] = True
    trains_lora: ClassVar[bool] = True
    exports_orbax: ClassVar[bool] = True

    def __init__(self, config: FSDPConfig | None = None) -> None:
        self.config = config if config is not None else FSDPConfig()

    def __repr__(self) -> str:
        return f"FSDPEngine({self.config!r})"

    def build_actor(
        self, model_path: str | os.PathLike, env: Any, optim: Any, *, mesh: Any = None, lora: Any = None
    ) -> Any:
        return fsdp.build_actor(model_path, env, optim, self.config, mesh=mesh, lora=lora)

    def build_critic(
        self, model_path: str | os.PathLike, env: Any, optim: Any, *, seed: int = 0, mesh: Any = None
    ) -> Any:
        return fsdp.build_critic(model_path, env, optim, self.config, seed=seed, mesh=mesh)

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
        return fsdp.build_reference(
            model_path,
            env,
            self.config,
            log_prob_micro_batch_size,
            mesh=mesh,
            param_offload=param_offload,
            compile=compile,
        )

    def reference_from_actor(self, actor: Any, *, log_prob_micro_batch_size: int | None = None) -> Any:
        return fsdp.reference_from_lora_actor(actor, log_prob_micro_batch_size)

    def compute_logprobs(
        self, state: Any, batch: RolloutBatch, *, with_entropy: bool = False, micro_batch_size: int | None = None
    ) -> ModelOutputs:
        return fsdp.compute_logprobs(state, batch, with_entropy=with_entropy, micro_batch_size=micro_batch_size)

    def own_rows_logprobs(self, state: Any, batch: RolloutBatch) -> Tensor:
        return fsdp.compute_logprobs(state, batch).logprobs  # every rank is its own replica

    def compute_values(self, state: Any, batch: RolloutBatch, *, micro_batch_size: int | None = None) -> Tensor:
        return fsdp.compute_values(state, batch, micro_batch_size=micro_batch_size)

    def update(
        self,
        state: Any,
        batch: RolloutBatch,
        loss_fn: LossFn,
        *,
        with_entropy: bool = False,
        skip_rows: Tensor | None = None,
    ) -> tuple[Any, dict[str, float]]:
        return fsdp.update(state, batch, loss_fn, with_entropy=with_entropy, skip_rows=skip_rows)

    def full_state_dict(
        self, state: Any, *, dtype: torch.dtype | None = None, bucket_mb: float | None = None
    ) -> Iterable[tuple[str, Tensor]]:
        return fsdp.full_state_dict(state, dtype=dtype, bucket_mb=DEFAULT_BUCKET_MB if bucket_mb is None else bucket_mb)

    def export_hf(
        self, state: Any, out_dir: str | os.PathLike, *, tokenizer: Any = None, overwrite: bool = False
    ) -> Any:
        return export_hf(state, out_dir, tokenizer=tokenizer, overwrite=overwrite)

    def fresh_optimizer(self, state: Any, optim: Any) -> Any:
        return fresh_optimizer(state, optim)

    def data_parallel(self, state: Any) -> tuple[int, int]:
        return state.env.rank, state.env.world_size

    def share_batch(self, state: Any, batch: RolloutBatch) -> RolloutBatch:
        return batch  # no model-parallel peers: each rank trains on its own rows

    def checkpoint_name(self, state: Any, role: str) -> str:
        return role

    def replica_group(self, state: Any) -> Any:
        return None

    def logprob_numerics(self, state: Any) -> str | None:
        # the HF module's own forward; mixed precision (bf16 compute) rounds differently from any rollout engine
        dtype = compute_dtype(self.config, state.env.device)
        return "hf-float32" if dtype == torch.float32 else None


def make_fsdp_engine(
    *, fsdp: FSDPConfig | None = None, tp: int = 1, pp: int = 1, micro_batch_size: int | None = None, key: str = "actor"
) -> FSDPEngine:
    """The registry's factory (:mod:`backends.training.engines`); ``key``: the config section, for messages."""
    if tp != 1 or pp != 1:
        raise ValueError(
            f"{key}.tp={tp} / {key}.pp={pp} need {key}.backend=megatron (the fsdp backend is data parallel only)"
        )
    return FSDPEngine(fsdp)
