"""The model's attention implementation is a config key, checked before any model is built."""

from __future__ import annotations

import pytest
import torch

from backends.distributed.setup import init_distributed
from backends.models import TinyModelConfig, write_tiny_model
from backends.training.fsdp import build_actor
from backends.training.fsdp_state import FSDPConfig, attention_implementation
from backends.training.packed_attention import VARLEN_SDPA

CPU = torch.device("cpu")


def test_auto_is_sdpa_on_a_cpu_and_flash_is_refused_there():
    assert attention_implementation(FSDPConfig(), CPU) == "sdpa"
    assert attention_implementation(FSDPConfig(attn_implementation="eager"), CPU) == "eager"
    with pytest.raises(ValueError, match="attn_implementation=flash_attention_2 needs a CUDA device"):
        attention_implementation(FSDPConfig(attn_implementation="flash_attention_2"), CPU)
    with pytest.raises(ValueError, match="FSDPConfig.attn_implementation must be auto or one of sdpa"):
        FSDPConfig(attn_implementation="flash")


def test_the_model_is_loaded_with_it(tmp_path):
    path = write_tiny_model(
        tmp_path / "m", TinyModelConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=96)
    )
    env = init_distributed(device="cpu")
    eager = build_actor(path, env, fsdp_cfg=FSDPConfig(attn_implementation="eager"))
    assert eager.module.config._attn_implementation == "eager"
    packed = build_actor(path, env, fsdp_cfg=FSDPConfig(use_remove_padding=True))
    assert packed.module.config._attn_implementation == VARLEN_SDPA  # packed rows: the packed-aware attention
    with pytest.raises(ValueError, match="needs a CUDA device"):
        build_actor(path, env, fsdp_cfg=FSDPConfig(attn_implementation="flash_attention_2"))


def test_auto_takes_sdpa_where_flash_attention_cannot_compute(monkeypatch):
    """flash-attn runs fp16 / bf16 only: on a GPU with it installed, ``auto`` picks it for bf16 compute and SDPA for
    fp32 (issue 37, finding 11); asking for it with fp32 is refused before any model is built."""
    import backends.training.fsdp_state as fsdp_state

    monkeypatch.setattr(fsdp_state, "_flash_attention_installed", lambda name="flash_attention_2": True)
    gpu = torch.device("cuda", 0)  # a device object only: the choice reads its type
    assert attention_implementation(FSDPConfig(), gpu) == "flash_attention_2"  # auto computes in bf16 on a GPU
    assert attention_implementation(FSDPConfig(param_dtype="bfloat16"), gpu) == "flash_attention_2"
    assert attention_implementation(FSDPConfig(param_dtype="float32"), gpu) == "sdpa"
    with pytest.raises(ValueError, match=r"flash_attention_2 computes in fp16 / bf16 only, and param_dtype=float32"):
        attention_implementation(FSDPConfig(param_dtype="float32", attn_implementation="flash_attention_2"), gpu)
    monkeypatch.setattr(fsdp_state, "_flash_attention_installed", lambda name="flash_attention_2": False)
    assert attention_implementation(FSDPConfig(param_dtype="bfloat16"), gpu) == "sdpa"
