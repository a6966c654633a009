"""Issue 37's findings that one GPU can exercise (``make test-gpu``; skipped without CUDA). Each runs in seconds.

- finding 8: the free memory that sizes the vLLM engine counts the trainer's cached-but-free blocks as free;
- finding 7: the GPU default of the vLLM weight sync checks each bucket on the device, with no host copy;
- finding 11: an fp32 FSDP actor on a GPU loads with an attention that computes in fp32 and takes a step;
- finding 5, one rank: an offloaded trainer's CPU buckets leave from the GPU when the group has NCCL.

The multi-GPU halves (NCCL between ranks, vLLM's sleep mode) are not here: CPU tests cover their logic with gloo
ranks and a strict model of vLLM's sleep state (tests/test_multi_rank_paths.py, tests/test_vllm_sleep_sequences.py).
"""

from __future__ import annotations

import pytest
import torch

from backends.models import TinyModelConfig, write_tiny_model
from tests.distributed import run_distributed

pytestmark = pytest.mark.gpu

GIB = 2**30
TINY = TinyModelConfig(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=96, max_position_embeddings=64, seed=2
)


def test_free_memory_for_the_vllm_engine_counts_the_trainers_cached_blocks():
    from backends.rollout.vllm_memory import free_device_memory

    torch.cuda.empty_cache()
    block = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    free_while_held = torch.cuda.mem_get_info()[0]
    del block  # back to PyTorch's cache, still "used" for the driver
    assert torch.cuda.mem_get_info()[0] < free_while_held + GIB // 2
    free, total = free_device_memory()
    assert free >= free_while_held + int(0.9 * GIB) and total == torch.cuda.mem_get_info()[1]


def test_bucketed_sync_checks_device_tensors_without_a_host_copy():
    from backends.rollout.weight_sync import bucketed_weights, staged_weights

    weights = [(f"model.layers.{i}.mlp.up_proj.weight", torch.randn(256, 256, device="cuda")) for i in range(4)]
    passed = list(bucketed_weights(iter(weights), None, strict=True, bucket_bytes=2 * 256 * 256 * 4))
    assert [t.data_ptr() for _, t in passed] == [t.data_ptr() for _, t in weights]  # the same device memory
    bad = weights[:2] + [(weights[2][0], torch.full((256, 256), float("nan"), device="cuda")), weights[3]]
    seen = []
    with pytest.raises(ValueError, match=r"'model.layers.2.mlp.up_proj.weight' holds NaN or Inf"):
        for name, _ in bucketed_weights(iter(bad), None, strict=True, bucket_bytes=2 * 256 * 256 * 4):
            seen.append(name)
    assert seen == [weights[0][0], weights[1][0]]
    assert all(t.device.type == "cpu" for _, t in staged_weights(iter(weights), None, strict=True))  # what host costs


def test_vllm_weight_sync_defaults_to_bucket_checks_on_a_gpu():
    from backends.rollout.vllm import VLLMConfig

    assert VLLMConfig().resolved(on_gpu=torch.cuda.is_available()).sync_staging == "bucket"


def _fp32_actor_worker(rank, world_size, path):
    from backends.distributed.setup import init_distributed
    from backends.training.fsdp import FSDPConfig, build_actor, update
    from backends.training.fsdp_state import attention_implementation
    from backends.training.optim import OptimConfig
    from tests.test_reference import make_batch, pg_loss

    env = init_distributed(device="cuda")
    out = {}
    for dtype in ("float32", "bfloat16"):
        cfg = FSDPConfig(param_dtype=dtype)
        actor = build_actor(path, env, OptimConfig(lr=1e-3), cfg)
        actor, metrics = update(actor, make_batch(1), pg_loss)
        out[dtype] = {
            "chosen": attention_implementation(cfg, env.device),
            "loaded": actor.module.config._attn_implementation,
            "loss": float(metrics["loss"]),
        }
    return out


def test_an_fp32_actor_on_a_gpu_loads_with_an_attention_that_runs_fp32(tmp_path):
    path = write_tiny_model(tmp_path / "model", TINY)
    out = run_distributed(_fp32_actor_worker, 1, str(path), timeout=120)[0]
    assert out["float32"]["chosen"] == out["float32"]["loaded"] == "sdpa"
    assert out["bfloat16"]["loaded"] == out["bfloat16"]["chosen"]  # flash_attention_2 where installed, else sdpa
    assert all(torch.isfinite(torch.tensor(v["loss"])) for v in out.values())


def _cpu_bucket_worker(rank, world_size):
    import torch.distributed as dist

    from backends.distributed.weight_broadcast import broadcast_weights

    sent = []
    real = dist.broadcast

    def recording(tensor, *args, **kwargs):
        sent.append(tensor.device.type)
        return real(tensor, *args, **kwargs)

    dist.broadcast = recording
    try:
        weights = [(f"model.layers.{i}.mlp.up_proj.weight", torch.full((64, 64), float(i))) for i in range(3)]
        stats = broadcast_weights(iter(weights), group=None, src=0, bucket_bytes=64 * 64 * 4, version=1)
    finally:
        dist.broadcast = real
    return {"backend": str(dist.get_backend()), "devices": sent, "buckets": stats.buckets}


def test_an_offloaded_trainers_cpu_buckets_leave_from_the_gpu():
    out = run_distributed(_cpu_bucket_worker, 1, timeout=120)[0]
    assert "nccl" in out["backend"]
    assert out["devices"] == ["cuda"] * 3  # the three buckets' bytes (the headers travel as objects)
