"""How much of a GPU the vLLM engine may take, and whether it fits: checked before vLLM starts, so a run that
cannot fit says which numbers do not add up instead of failing inside vLLM's profiler.

The colocated trainer already holds its weights and optimizer state when the engine is built, so the engine's
share is taken from what is free then (:func:`free_device_memory`), not from the device's total.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

__all__ = ["free_device_memory", "checkpoint_bytes", "plan_gpu_memory"]


def free_device_memory() -> tuple[int, int]:
    """``(free, total)`` bytes of the current CUDA device once PyTorch's caching allocator has returned its unused
    blocks: blocks the trainer freed but the allocator keeps cached count as used in ``mem_get_info`` until then,
    and vLLM allocates outside that cache (its CuMem pools)."""
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()


def _dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def checkpoint_bytes(path: Path, hf_cfg: Any) -> int:
    """Parameter count of the checkpoint in ``path`` (from its safetensors headers; else estimated from the config)."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if files:
        count = 0
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                count += sum(_numel(f.get_slice(name).get_shape()) for name in f.keys())
        return count
    h, layers = hf_cfg.hidden_size, hf_cfg.num_hidden_layers
    kv = getattr(hf_cfg, "num_key_value_heads", hf_cfg.num_attention_heads) * (h // hf_cfg.num_attention_heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * hf_cfg.intermediate_size
    return layers * per_layer + hf_cfg.vocab_size * h * (1 if hf_cfg.tie_word_embeddings else 2)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def plan_gpu_memory(
    config: Any, hf_cfg: Any, path: Path, context: int, *, free_bytes: int, total_bytes: int, params: int | None = None
) -> float:
    """The ``gpu_memory_utilization`` to build with, or an error naming the numbers when the engine cannot fit.

    vLLM may use ``utilization x total`` bytes of the device and refuses to start when less is free. Its
    weights take ``params x bytes / tp`` and the KV cache must hold at least one sequence of ``context``
    tokens (``2 x layers x kv_heads x head_dim x bytes x context / tp``). ``None`` utilisation: 90% of the free
    memory. ``params``: the parameter count (default: read from the checkpoint).
    """
    gib = 2**30
    tp = config.tensor_parallel_size
    utilization = config.gpu_memory_utilization
    if utilization is None:
        utilization = round(0.9 * free_bytes / total_bytes, 3)
    elif not 0.0 < utilization <= 1.0:
        raise ValueError(f"rollout.vllm.gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = utilization * total_bytes
    if budget > free_bytes:
        raise ValueError(
            f"rollout.vllm.gpu_memory_utilization={utilization} asks for {budget / gib:.1f} GiB of the GPU's "
            f"{total_bytes / gib:.1f} GiB, but only {free_bytes / gib:.1f} GiB are free (the trainer holds the rest): "
            f"set it to at most {free_bytes / total_bytes:.2f}, or leave it unset to take 90% of what is free"
        )
    size = _dtype_bytes(config.dtype)
    weights = (params if params is not None else checkpoint_bytes(path, hf_cfg)) * size / tp
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    kv_heads = getattr(hf_cfg, "num_key_value_heads", hf_cfg.num_attention_heads)
    kv_per_token = 2 * hf_cfg.num_hidden_layers * kv_heads * head_dim * size / tp
    if weights + kv_per_token * context > budget:
        raise ValueError(
            f"the vLLM engine does not fit: {config.dtype} weights take {weights / gib:.2f} GiB per GPU (tp={tp}) and "
            f"one sequence of {context} tokens (longest prompt + response) needs "
            f"{kv_per_token * context / gib:.2f} GiB "
            f"of KV cache, but its share is {budget / gib:.2f} GiB (gpu_memory_utilization={utilization} of "
            f"{total_bytes / gib:.1f} GiB, {free_bytes / gib:.1f} GiB free): shorten the responses, raise "
            "rollout.vllm.tensor_parallel_size, or free trainer memory (actor.fsdp.offload)"
        )
    return utilization
