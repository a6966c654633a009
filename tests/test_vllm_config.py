"""The vLLM engine's GPU settings, worked out before vLLM starts: defaults, the memory plan, the version floor.

No vLLM and no GPU needed: these are the checks that run before ``vllm.LLM`` is built, on the numbers a GPU
would report (``torch.cuda.mem_get_info``) and on real checkpoints.
"""

from __future__ import annotations

import types

import pytest

from backends.models import TinyModelConfig, write_tiny_model
from backends.rollout.vllm import VLLMConfig, check_vllm_version, checkpoint_bytes, plan_gpu_memory

GIB = 2**30
#: Qwen2.5-7B's shape (hidden 3584, 28 layers, 4 KV heads of 128, intermediate 18944, vocab 152064, untied)
QWEN_7B = types.SimpleNamespace(
    hidden_size=3584,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=18944,
    vocab_size=152064,
    tie_word_embeddings=False,
)


def test_gpu_defaults_resolve_per_platform():
    gpu, cpu = VLLMConfig().resolved(on_gpu=True), VLLMConfig().resolved(on_gpu=False)
    assert (gpu.dtype, gpu.enforce_eager, gpu.sleep_level) == ("bfloat16", False, 2)
    assert (cpu.dtype, cpu.enforce_eager) == ("float32", True)
    assert VLLMConfig(dtype="float16", enforce_eager=True).resolved(on_gpu=True).enforce_eager is True


def test_the_parameter_count_comes_from_the_checkpoint(tmp_path):
    cfg = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=96)
    path = write_tiny_model(tmp_path / "m", cfg)
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    assert checkpoint_bytes(path, AutoConfig.from_pretrained(path)) == sum(p.numel() for p in model.parameters())
    estimate = checkpoint_bytes(tmp_path, QWEN_7B)  # no safetensors there: from the config
    assert 7.0e9 < estimate < 7.8e9


def test_the_default_share_is_most_of_what_is_free():
    # an 80 GiB GPU where the trainer holds 30 GiB: 90% of the 50 GiB free
    share = plan_gpu_memory(
        VLLMConfig(dtype="bfloat16"),
        QWEN_7B,
        None,
        1536,
        free_bytes=50 * GIB,
        total_bytes=80 * GIB,
        params=7_600_000_000,
    )
    assert share == pytest.approx(0.9 * 50 / 80, abs=1e-3)


def test_a_share_larger_than_the_free_memory_names_the_numbers():
    with pytest.raises(
        ValueError,
        match=r"gpu_memory_utilization=0.8 asks for 64.0 GiB of the GPU's 80.0 GiB, but only "
        r"50.0 GiB are free .* set it to at most 0.62",
    ):
        plan_gpu_memory(
            VLLMConfig(dtype="bfloat16", gpu_memory_utilization=0.8),
            QWEN_7B,
            None,
            1536,
            free_bytes=50 * GIB,
            total_bytes=80 * GIB,
            params=7_600_000_000,
        )


def test_a_model_that_cannot_fit_names_weights_kv_and_share():
    # 7.6B bf16 weights (14.2 GiB) on a 24 GiB card with 16 GiB free: 14.4 GiB share, and a 131072-token context
    # (Llama-3.1's max_position_embeddings, the old default) needs 7 GiB of KV for one sequence
    with pytest.raises(
        ValueError,
        match=r"weights take 14.16 GiB per GPU \(tp=1\) and one sequence of 131072 tokens "
        r"\(longest prompt \+ response\) needs 7.00 GiB of KV cache",
    ):
        plan_gpu_memory(
            VLLMConfig(dtype="bfloat16"),
            QWEN_7B,
            None,
            131072,
            free_bytes=16 * GIB,
            total_bytes=24 * GIB,
            params=7_600_000_000,
        )
    # the recipe's lengths (512 + 1024) fit, and so does the long context over 2 tensor-parallel GPUs
    plan_gpu_memory(
        VLLMConfig(dtype="bfloat16"),
        QWEN_7B,
        None,
        1536,
        free_bytes=16 * GIB,
        total_bytes=24 * GIB,
        params=7_600_000_000,
    )
    plan_gpu_memory(
        VLLMConfig(dtype="bfloat16", tensor_parallel_size=2),
        QWEN_7B,
        None,
        131072,
        free_bytes=16 * GIB,
        total_bytes=24 * GIB,
        params=7_600_000_000,
    )


def test_the_version_floor():
    check_vllm_version("0.16.0")
    check_vllm_version("0.32.0")
    check_vllm_version("0.33.0rc1")
    with pytest.raises(RuntimeError, match=r"vLLM 0.14.1 is too old: rollout.engine=vllm needs vLLM >= 0.16.0"):
        check_vllm_version("0.14.1")
