"""The reference role's options (verl's ``ref/*.yaml``) and the one builder the recipes call.

The reference is the frozen policy the KL term is measured against. Options:

- ``backend``: the training engine that holds it (:mod:`backends.training.engines`): ``fsdp`` (FSDP2) or
  ``megatron`` (megatron-core with ``tp`` / ``pp``; colocated placement only, since megatron's parallel state
  spans the whole world); its ``build_reference`` refuses the options it does not have;
- ``log_prob_micro_batch_size``: rows per forward when computing its log-probs (verl's
  ``ref.log_prob_micro_batch_size_per_gpu``), independent of the actor's micro-batches;
- ``use_torch_compile``: ``torch.compile`` of each decoder layer's forward (verl's
  ``ref.use_torch_compile``), eager with one warning where inductor has no C++ compiler;
- ``param_offload``: FSDP2 ``CPUOffloadPolicy`` for its parameters (verl's
  ``ref.fsdp_config.param_offload``), a GPU feature: refused on a CPU-only process;
- ``ref_in_actor``: when the actor trains a LoRA adapter, the reference is the actor's own module
  with the adapter disabled (verl's ``ref_in_actor``): no second copy of the weights.
"""

from __future__ import annotations

import os
from typing import Any

import attrs

from backends.distributed.setup import DistEnv
from backends.training.engine import TrainEngine
from backends.training.engines import TRAIN_ENGINES, select_engine
from backends.training.fsdp import FSDPConfig

__all__ = ["ReferenceConfig", "build_reference_role", "reference_engine"]


@attrs.frozen
class ReferenceConfig:
    """How the reference model is built and run (see the module docstring)."""

    #: actor (the actor's engine and layout, verl's default), fsdp (FSDP2) or megatron (tensor / pipeline parallel:
    #: reference.tp, reference.pp)
    backend: str = attrs.field(default="actor")
    tp: int = attrs.field(default=1, validator=attrs.validators.ge(1))  #: megatron only: tensor-parallel size
    pp: int = attrs.field(default=1, validator=attrs.validators.ge(1))  #: megatron only: pipeline stages
    #: rows per forward of its log-prob pass; None: the FSDP config's micro-batching
    log_prob_micro_batch_size: int | None = attrs.field(default=None)
    use_torch_compile: bool = False  #: torch.compile each decoder layer (eager, with a warning, without a C++ compiler)
    param_offload: bool = False  #: FSDP2 CPUOffloadPolicy for its parameters (GPU only)
    #: LoRA actor only: reference = the actor's module under ``disable_adapter()`` (no second copy)
    ref_in_actor: bool = False

    @backend.validator
    def _check_backend(self, attribute: attrs.Attribute, value: str) -> None:
        if value != "actor" and value not in TRAIN_ENGINES:
            raise ValueError(f"{value!r} is not one of 'actor', {', '.join(map(repr, TRAIN_ENGINES))}")

    @log_prob_micro_batch_size.validator
    def _check_mbs(self, attribute: attrs.Attribute, value: int | None) -> None:
        if value is not None and value < 1:
            raise ValueError(f"reference.log_prob_micro_batch_size must be >= 1 (or none), got {value}")


def reference_engine(
    cfg: ReferenceConfig, fsdp_cfg: FSDPConfig, actor_engine: TrainEngine | None = None
) -> TrainEngine:
    """The training engine ``reference.backend`` names, with the reference's sizes (a bad name or size fails here);
    ``actor``: ``actor_engine``, or FSDP where no actor engine is given (a reference built on its own)."""
    if cfg.backend == "actor" and actor_engine is not None:
        return actor_engine
    backend = "fsdp" if cfg.backend == "actor" else cfg.backend
    return select_engine(backend, fsdp=fsdp_cfg, tp=cfg.tp, pp=cfg.pp, key="reference")


def build_reference_role(
    cfg: ReferenceConfig,
    model_path: str | os.PathLike,
    env: DistEnv,
    fsdp_cfg: FSDPConfig,
    *,
    mesh: Any = None,
    actor: Any = None,
    engine: TrainEngine | None = None,
) -> Any:
    """The reference state ``cfg`` asks for; errors name the option before anything is loaded. Its log-probs of a
    rank's own rows: ``reference_engine(cfg, fsdp_cfg).own_rows_logprobs(state, batch)``.

    ``actor``: needed for ``ref_in_actor`` (a LoRA actor built with ``build_actor(..., lora=...)``); ``engine``: the
    engine that builds it (default: the one ``reference.backend`` names; the actor's for ``reference.backend=actor``).
    """
    engine = engine or reference_engine(cfg, fsdp_cfg)
    if cfg.ref_in_actor:
        if cfg.use_torch_compile or cfg.param_offload:
            raise ValueError(
                "reference.ref_in_actor=true shares the actor's module: reference.use_torch_compile and "
                "reference.param_offload do not apply (they are the actor's settings then)"
            )
        if actor is None:
            raise ValueError(
                "reference.ref_in_actor=true needs the actor on this rank (the reference is the actor's module with "
                "its LoRA adapter disabled); under placement=split the reference lives on the critic pool"
            )
        return engine.reference_from_actor(actor, log_prob_micro_batch_size=cfg.log_prob_micro_batch_size)
    return engine.build_reference(
        model_path,
        env,
        mesh=mesh,
        log_prob_micro_batch_size=cfg.log_prob_micro_batch_size,
        param_offload=cfg.param_offload,
        compile=cfg.use_torch_compile,
    )
