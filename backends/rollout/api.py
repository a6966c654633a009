"""Rollout engines by name (``rollout.engine=native|vllm``) and the rollout config that chooses one.

``build_rollout(cfg, model_path, tokenizer, max_context=..., device=...)`` builds the engine ``cfg.engine`` names
through its registration in :data:`ROLLOUT_ENGINES` (a :class:`backends.rollout.engine.RolloutEngineSpec`); what
comes back is a :class:`backends.rollout.engine.RolloutEngine`, whose methods (``generate``, ``start_session``,
``sync_weights``, ``release_memory``, ``shutdown``) every caller uses, so a recipe (and
``backends.rollout.evaluation``, ``backends.rollout.agent_loop``) is written once for every engine. vLLM is imported
only when its engine is built: the native path needs no vLLM install.

A new engine: a module with its state class, its session class and its ``ENGINE_SPEC``, one entry in
:data:`ROLLOUT_ENGINES`, and (for settings of its own) a section in :class:`RolloutConfig`.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import attrs
import torch

from backends.config import ConfigError
from backends.rollout import native as rollout_native
from backends.rollout import server_rollout
from backends.rollout import vllm as rollout_vllm
from backends.rollout.common import SamplingConfig, TurnOutput, decode_responses
from backends.rollout.engine import RolloutEngine, RolloutEngineSpec
from backends.rollout.environments import MultiTurnConfig
from backends.rollout.server_rollout import ServerRolloutConfig
from backends.rollout.vllm import VLLMConfig

__all__ = [
    "MultiTurnConfig",
    "ROLLOUT_ENGINES",
    "RolloutConfig",
    "SamplingConfig",
    "TurnOutput",
    "build_rollout",
    "decode_responses",
    "refuse_on_a_pool",
    "rollout_engine_spec",
]

#: name -> registration (``rollout.engine``)
ROLLOUT_ENGINES: dict[str, RolloutEngineSpec] = {
    "native": rollout_native.ENGINE_SPEC,
    "vllm": rollout_vllm.ENGINE_SPEC,
    "vllm_server": server_rollout.ENGINE_SPEC,
}


@attrs.frozen
class RolloutConfig(SamplingConfig):
    """Sampling options (:class:`SamplingConfig`) plus which engine runs them."""

    #: native: torch KV-cache engine; vllm: in-process vLLM; vllm_server: vLLM servers in processes of their own
    engine: str = attrs.field(default="native")
    #: the native engine's weight dtype (synced weights are cast to it); the vLLM engine's is vllm.dtype
    dtype: Literal["float32", "bfloat16"] = attrs.field(default="float32")
    vllm: VLLMConfig = VLLMConfig()  #: how the vLLM engine is built (ignored by the native engine)
    native: rollout_native.NativeConfig = rollout_native.NativeConfig()  #: how the native engine batches
    #: rollout.engine=vllm_server: vLLM servers in processes of their own (started, or pointed at by URL)
    vllm_server: ServerRolloutConfig = ServerRolloutConfig()
    #: weight sync: MiB of gathered weights per all-gather (verl's update_weights_bucket_megabytes); none: 512 on
    #: GPU, 16 on CPU (where gloo moves small buffers faster)
    sync_bucket_mb: float | None = None
    #: multi-turn / tool rollouts (max_turns > 1); see BUILD.md's multi-turn section
    multi_turn: MultiTurnConfig = MultiTurnConfig()
    #: your agent function (path/to/agent.py:run or package.module:run), called per trajectory with the data row,
    #: a base_url and an api_key for the openai client; none: the engine samples (backends.rollout.agents)
    agent: str | None = None
    #: seconds an agent's trajectory may take from its start; later, its calls are refused and it is dropped
    agent_deadline_s: float = attrs.field(default=120.0, validator=attrs.validators.gt(0))
    agent_workers: int = attrs.field(default=32, validator=attrs.validators.ge(1))  #: agents run at a time (threads)

    @dtype.validator
    def _known_dtype(self, attribute: attrs.Attribute, value: str) -> None:
        if value not in ("float32", "bfloat16"):
            raise ValueError(f"rollout.dtype must be 'float32' or 'bfloat16', got {value!r}")

    @engine.validator
    def _engine_takes_the_settings(self, attribute: attrs.Attribute, value: str) -> None:
        # fail when the config is read, not after the SFT stage
        rollout_engine_spec(self).check_config(self)

    def sampling(self) -> SamplingConfig:
        """The sampling options alone (what the engines' ``generate`` takes)."""
        return SamplingConfig(**{f.name: getattr(self, f.name) for f in attrs.fields(SamplingConfig)})


def rollout_engine_spec(cfg: RolloutConfig) -> RolloutEngineSpec:
    """The registration of the engine ``cfg.engine`` names; an unknown name is an error listing the known ones."""
    spec = ROLLOUT_ENGINES.get(cfg.engine)
    if spec is None:
        raise ValueError(
            f"unknown rollout engine {cfg.engine!r} (rollout.engine); known engines: {', '.join(ROLLOUT_ENGINES)}"
        )
    return spec


def build_rollout(
    cfg: RolloutConfig,
    model_path: str | os.PathLike,
    tokenizer: Any = None,
    *,
    seed: int = 0,
    max_context: int | None = None,
    device: str | torch.device | None = None,
    group: Any = None,
) -> RolloutEngine:
    """The engine ``cfg.engine`` names, over a local HF dir (every rank calls it under torchrun).

    ``max_context``: the longest prompt plus response the recipe samples (its ``data.max_prompt_length +
    rollout.max_new_tokens``): vLLM sizes its KV cache for it (default: the model's max_position_embeddings).
    ``device``: where an engine that runs in torch places itself (the trainer's device: ``cuda:LOCAL_RANK`` on a
    GPU node); vLLM places itself. ``group``: the ranks that build it together (a rollout pool's group; None: every
    rank), for an engine whose ranks share servers.
    """
    spec = rollout_engine_spec(cfg)
    extra = {"group": group} if spec.takes_group else {}
    return spec.build(cfg, model_path, tokenizer, seed=seed, max_context=max_context, device=device, **extra)


def refuse_on_a_pool(cfg: RolloutConfig, placement: str, *, setting: str, colocated: str) -> None:
    """Refuse an engine that cannot be built on a subset of the ranks, before any work: ``placement`` names the
    setting that puts it there (``offpolicy.rollout_ranks=1``), ``setting`` its key (``offpolicy.rollout_ranks``),
    ``colocated`` the setting that keeps the engine on every rank."""
    reason = rollout_engine_spec(cfg).pool_refusal
    if reason is not None:
        fits = " or ".join(name for name, spec in ROLLOUT_ENGINES.items() if spec.pool_refusal is None)
        raise ConfigError(
            f"rollout.engine={cfg.engine} with {placement}: {reason}. What works: rollout.engine={fits} with {setting} "
            f"(an engine that samples on a pool of the ranks), or rollout.engine={cfg.engine} with {colocated} (on "
            "every rank, colocated with the trainer)"
        )
