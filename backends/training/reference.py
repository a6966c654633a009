"""The reference role's options (verl's ``ref/*.yaml``) and the one builder the recipes call.

The reference is the frozen policy the KL term is measured against. Options:

- ``backend``: ``fsdp`` (FSDP2, :func:`backends.training.fsdp.build_reference`) or ``megatron``
  (megatron-core with ``tp`` / ``pp``, :func:`backends.training.megatron.engine.build_reference`; colocated
  placement only, since megatron's parallel state spans the whole world);
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
from typing import Any, Literal

import attrs

from backends.distributed.setup import DistEnv
from backends.training.fsdp import FSDPConfig, TrainState, build_reference, reference_from_lora_actor

__all__ = ["ReferenceConfig", "build_reference_role", "reference_logprobs"]


@attrs.frozen
class ReferenceConfig:
    """How the reference model is built and run (see the module docstring)."""

    backend: Literal["fsdp", "megatron"] = "fsdp"  #: fsdp (FSDP2) or megatron (tensor / pipeline parallel: reference.tp, reference.pp)
    tp: int = attrs.field(default=1, validator=attrs.validators.ge(1))  #: megatron only: tensor-parallel size
    pp: int = attrs.field(default=1, validator=attrs.validators.ge(1))  #: megatron only: pipeline stages
    #: rows per forward of its log-prob pass; None: the FSDP config's micro-batching
    log_prob_micro_batch_size: int | None = attrs.field(default=None)
    use_torch_compile: bool = False  #: torch.compile each decoder layer (eager, with a warning, without a C++ compiler)
    param_offload: bool = False  #: FSDP2 CPUOffloadPolicy for its parameters (GPU only)
    #: LoRA actor only: reference = the actor's module under ``disable_adapter()`` (no second copy)
    ref_in_actor: bool = False

    @log_prob_micro_batch_size.validator
    def _check_mbs(self, attribute: attrs.Attribute, value: int | None) -> None:
        if value is not None and value < 1:
            raise ValueError(f"reference.log_prob_micro_batch_size must be >= 1 (or none), got {value}")


def build_reference_role(
    cfg: ReferenceConfig,
    model_path: str | os.PathLike,
    env: DistEnv,
    fsdp_cfg: FSDPConfig,
    *,
    mesh: Any = None,
    actor: TrainState | None = None,
) -> Any:
    """The reference state ``cfg`` asks for; errors name the option before anything is loaded.

    ``actor``: needed for ``ref_in_actor`` (a LoRA actor built with ``build_actor(..., lora=...)``).
    """
    if cfg.backend not in ("fsdp", "megatron"):
        raise ValueError(f"reference.backend must be 'fsdp' or 'megatron', got {cfg.backend!r}")
    if cfg.backend == "fsdp" and (cfg.tp != 1 or cfg.pp != 1):
        raise ValueError(f"reference.tp={cfg.tp} / reference.pp={cfg.pp} need reference.backend=megatron")
    if cfg.backend == "megatron":
        if cfg.ref_in_actor or cfg.use_torch_compile or cfg.param_offload:
            raise ValueError(
                "reference.backend=megatron does not take ref_in_actor, use_torch_compile or param_offload "
                "(FSDP options)"
            )
        if mesh is not None and mesh.size() != env.world_size:
            raise ValueError(
                "reference.backend=megatron needs placement=colocated: megatron's parallel state spans every "
                f"rank, but this reference pool has {mesh.size()} of {env.world_size} ranks"
            )
        from backends.training.megatron.engine import MegatronConfig
        from backends.training.megatron.engine import build_reference as build_megatron_reference

        megatron_cfg = MegatronConfig(tp=cfg.tp, pp=cfg.pp, micro_batch_size=fsdp_cfg.micro_batch_size)
        return build_megatron_reference(model_path, env, megatron_cfg, cfg.log_prob_micro_batch_size)
    if cfg.ref_in_actor:
        if actor is None:
            raise ValueError(
                "reference.ref_in_actor=true needs the actor on this rank (the reference is the actor's module with "
                "its LoRA adapter disabled); under placement=split the reference lives on the critic pool"
            )
        if cfg.use_torch_compile or cfg.param_offload:
            raise ValueError(
                "reference.ref_in_actor=true shares the actor's module: reference.use_torch_compile and "
                "reference.param_offload do not apply (they are the actor's settings then)"
            )
        return reference_from_lora_actor(actor, cfg.log_prob_micro_batch_size)
    return build_reference(
        model_path, env, fsdp_cfg, cfg.log_prob_micro_batch_size, mesh=mesh,
        param_offload=cfg.param_offload, compile=cfg.use_torch_compile,
    )


def reference_logprobs(reference: Any, batch: Any) -> Any:
    """Log-probs ``(b t)`` of this rank's rows under the reference, whichever engine holds it.

    Every rank brings its own rows (data-parallel recipes); a Megatron reference with TP / PP gathers
    the rows of its replica's ranks, runs them together and hands each rank its own.
    """
    if type(reference).__module__.startswith("backends.training.megatron"):
        from backends.training.megatron.engine import compute_logprobs_of_own_rows

        return compute_logprobs_of_own_rows(reference, batch)
    from backends.training.fsdp import compute_logprobs

    return compute_logprobs(reference, batch).logprobs
