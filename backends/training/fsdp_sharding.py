"""Sharding a role's module with FSDP2: ``fully_shard`` per decoder layer, then the root, over a 1-D mesh.

A role read from a local HF dir is built on the meta device, sharded, and filled from the safetensors files
that only the mesh's first rank reads (:mod:`backends.training.sharded_loading`); a given module, a
``load`` callable, a plain world-size-1 module, a checkpoint without safetensors files or
``FSDPConfig.load_on_every_rank`` load the whole model on every rank first. Before sharding, the engine
prepares the module: packed-aware attention where needed, activation checkpointing (trainable roles) or
frozen weights (the reference).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from backends.distributed.setup import DistEnv
from backends.training.fsdp_state import FSDPConfig, attention_implementation, needs_own_attention
from backends.training.hf_modules import decoder_layers, enable_checkpointing, load_model, outputs_without_views
from backends.training.packed_attention import enable_packed_attention
from backends.training.sharded_loading import (
    checkpoint_plan,
    empty_causal_lm,
    fill_shards,
    materialize,
    mesh_device,
    safetensors_files,
)

__all__ = ["shard_module", "sharded_module", "check_offload"]


def shard_module(
    model: nn.Module, mesh: Any, cfg: FSDPConfig, param_dtype: torch.dtype | None, *, param_offload: bool = False
) -> nn.Module:
    """``fully_shard`` every decoder layer, then the root, over ``mesh``, computing in ``param_dtype``
    (None: the stored dtype) and reducing gradients in ``cfg.reduce_dtype``; ``param_offload`` keeps the
    shards in host memory. Returns the module (sharded in place), or, when there is nothing to shard,
    cast or offload, the plain module moved to the mesh's device (``fully_shard`` moves the sharded
    one there itself)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if _stays_plain(mesh, param_dtype, param_offload):
        # One rank, no cast, no offload: FSDP2 would only add its hooks and DTensor dispatch, a cost with
        # nothing in return, so the module stays plain. Everything downstream (gradient sync, full
        # weights, DCP checkpoints, which reshard across world sizes) takes both.
        return model.to(mesh_device(mesh))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=getattr(torch, cfg.reduce_dtype))
    # parameter offload keeps the shards in (pinned) host memory and copies them to the GPU per layer
    offload = CPUOffloadPolicy() if param_offload else OffloadPolicy()
    for layer in decoder_layers(model):
        outputs_without_views(layer)
        fully_shard(
            layer, mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward, offload_policy=offload
        )
    # The root keeps its parameters (embeddings, final norm, lm_head) gathered after forward: backward
    # starts with the lm_head, so resharding it would only gather it again right away.
    outputs_without_views(model)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False, offload_policy=offload)
    return model


def _stays_plain(mesh: Any, param_dtype: torch.dtype | None, param_offload: bool) -> bool:
    return mesh.size() == 1 and param_dtype in (None, torch.float32) and not param_offload


def check_offload(env: DistEnv, offload: bool, option: str) -> None:
    """Offload is a GPU feature: refuse it on a CPU-only process, before anything is loaded."""
    if offload and env.device.type != "cuda":
        raise ValueError(
            f"{option} needs a CUDA device: FSDP2's CPUOffloadPolicy keeps the shards in host memory and copies "
            f"them to the GPU per layer; this process runs on {env.device.type!r} (on a CPU the parameters are "
            "already in host memory: leave it off)"
        )


def sharded_module(
    source: str | os.PathLike | nn.Module,
    dtype: torch.dtype,
    env: DistEnv,
    mesh: Any,
    cfg: FSDPConfig,
    *,
    param_dtype: torch.dtype | None,
    trainable: bool,
    param_offload: bool = False,
    load: Any = None,
) -> nn.Module:
    """The role's module in ``dtype``, made ready for the engine (:func:`_prepare`) and sharded on ``mesh``.

    From a local HF dir whose module gets sharded: built on the meta device and filled from the
    checkpoint (read by the mesh's first rank only). Otherwise (a given module, ``load`` given, a plain
    module at world size 1, no safetensors files, ``cfg.load_on_every_rank``) the whole model is loaded
    on every rank first: ``load()`` when given, else :func:`load_model`.
    """
    files = None
    if (
        load is None
        and not isinstance(source, nn.Module)
        and not cfg.load_on_every_rank
        and not _stays_plain(mesh, param_dtype, param_offload)
    ):
        files = safetensors_files(source)
    if files is None:
        model = load() if load is not None else load_model(source, dtype, attention_implementation(cfg, env.device))
        _prepare(model, env, cfg, trainable=trainable)
        return shard_module(model, mesh, cfg, param_dtype, param_offload=param_offload)
    model = empty_causal_lm(source, dtype, attention_implementation(cfg, env.device))
    plan = checkpoint_plan(model, files)  # the same errors on every rank, before any collective
    _prepare(model, env, cfg, trainable=trainable)
    model = shard_module(model, mesh, cfg, param_dtype, param_offload=param_offload)
    # offloaded shards live in host memory (FSDP2 pins them there); the buffers on the device
    materialize(model, mesh_device(mesh), params_device=torch.device("cpu") if param_offload else None)
    fill_shards(model, plan, mesh)
    return model


def _prepare(model: nn.Module, env: DistEnv, cfg: FSDPConfig, *, trainable: bool) -> None:
    """What the engine does to a model before sharding it: packed-aware attention where needed, activation
    checkpointing (trainable roles) or frozen weights (the reference)."""
    if needs_own_attention(cfg, env.device):
        enable_packed_attention(model)
    if trainable and cfg.gradient_checkpointing:
        enable_checkpointing(model)
    if not trainable:
        model.requires_grad_(False)
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False
