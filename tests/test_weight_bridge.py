"""backends.loop.weight_bridge: what the bridge sends (dtype, buckets, full weights or a LoRA adapter), that a sync
moves the trainer's weights into the rollout engine, and the trainer / rollout parity check. Single process, a
tiny model (about a second); the recipes' runs cover it under torchrun (tests/test_recipe_grpo.py, ...)."""

from __future__ import annotations

import types

import attrs
import pytest
import torch

from backends.config import ConfigError
from backends.loop.weight_bridge import check_adapter_sync, weight_bridge
from backends.models import TinyModelConfig, build_tiny_model
from backends.rollout.api import RolloutConfig
from backends.rollout.native import NativeRollout
from backends.rollout.vllm import VLLMConfig, VLLMRollout
from backends.training.engines import select_engine
from backends.training.fsdp import FSDPConfig
from backends.training.lora import LoraConfig

TINY = TinyModelConfig(
    hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_position_embeddings=32
)
CPU_ACTOR = types.SimpleNamespace(env=types.SimpleNamespace(device=torch.device("cpu")))  # what the check reads


def _native(dtype: torch.dtype = torch.float32, seed: int = 0) -> NativeRollout:
    torch.manual_seed(seed)
    return NativeRollout(
        model=build_tiny_model(TINY).to(dtype).eval(), pad_token_id=0, eos_token_ids=(1,), max_context=32
    )


def test_the_bridge_sends_what_the_rollout_engine_keeps():
    bridge = weight_bridge(RolloutConfig())
    assert (bridge.dtype, bridge.bucket_mb, bridge.adapter) == (torch.float32, 16.0, None)  # 16 MiB on CPU
    assert weight_bridge(RolloutConfig(dtype="bfloat16", sync_bucket_mb=4.0)).dtype == torch.bfloat16
    assert weight_bridge(RolloutConfig(sync_bucket_mb=4.0)).bucket_mb == 4.0
    lora = LoraConfig(rank=8)
    assert weight_bridge(RolloutConfig(vllm=VLLMConfig(lora_sync="adapter")), lora).adapter is None  # native: merged


def test_adapter_sync_needs_a_lora_actor_and_an_engine_that_takes_adapters():
    on_native = RolloutConfig(vllm=VLLMConfig(lora_sync="adapter"))
    with pytest.raises(ConfigError, match=r"needs a LoRA actor .*rollout.engine=vllm, got 'native'"):
        check_adapter_sync(on_native, LoraConfig(rank=8))
    assert check_adapter_sync(RolloutConfig(), LoraConfig()) == RolloutConfig()  # merged weights: nothing to check


def test_a_sync_moves_the_trainers_weights_into_the_rollout_engine():
    rollout, trained = _native(seed=0), _native(seed=1).model
    bridge = weight_bridge(RolloutConfig())
    synced = bridge.sync(rollout, select_engine("fsdp"), types.SimpleNamespace(module=trained), version=1)
    assert synced.weights_version == 1
    for name, value in trained.state_dict().items():
        assert torch.equal(synced.model.state_dict()[name], value), name


def test_rollout_logprobs_stand_in_only_where_both_engines_compute_the_same_numbers():
    bridge, fsdp = weight_bridge(RolloutConfig()), select_engine("fsdp")
    assert bridge.logprobs_agree(fsdp, CPU_ACTOR, _native())  # fp32 FSDP and the fp32 native engine
    assert not bridge.logprobs_agree(fsdp, CPU_ACTOR, _native(torch.bfloat16))
    assert not bridge.logprobs_agree(
        select_engine("fsdp", fsdp=FSDPConfig(param_dtype="bfloat16")), CPU_ACTOR, _native()
    )
    assert not bridge.logprobs_agree(select_engine("megatron"), CPU_ACTOR, _native())
    vllm = VLLMRollout(
        llm=object(),
        config=VLLMConfig(),
        pad_token_id=0,
        eos_token_ids=(1,),
        max_context=32,
        vocab_size=64,
        can_sleep=False,
    )
    assert not bridge.logprobs_agree(fsdp, CPU_ACTOR, vllm)
    assert attrs.evolve(bridge, bucket_mb=1.0).bucket_mb == 1.0
