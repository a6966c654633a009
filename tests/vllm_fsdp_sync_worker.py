"""Run by tests/test_rollout_vllm.py on 2 ranks (``tests.recipes.run``, torchrun's environment): FSDP2 actor -> vLLM
weight sync.

vLLM is built from model A; the FSDP actor holds model B (another init). After streaming the actor's
gathered weights into vLLM, vLLM's sampled-token log-probs must equal the actor's recomputed ones. Both sides
compute in fp32, also on a GPU (where their defaults are bf16), so the gap measures the sync, not the rounding.
Arguments: an output directory (each rank writes ``rank<R>.json``) and the vLLM tensor-parallel size
(1: one engine per rank; 2: one engine sharded over both ranks, each rank still passing its own prompts).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import attrs
import torch

from backends.distributed.collectives import all_reduce_sum, barrier
from backends.distributed.setup import init_distributed, shutdown
from backends.models import TinyModelConfig, write_tiny_model
from backends.rollout.native import SamplingConfig
from backends.rollout.vllm import VLLMConfig, build_vllm_rollout, generate, shutdown_vllm, sync_weights
from backends.training.fsdp import FSDPConfig, build_actor, compute_logprobs, full_state_dict

TINY = TinyModelConfig(
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=2,  # kv heads split over TP=2
    intermediate_size=128,
    max_position_embeddings=64,
    initializer_range=0.2,
)


def sync_and_check(out_dir: Path, tp: int) -> None:
    env = init_distributed()
    if env.is_main:
        write_tiny_model(out_dir / "model_a", TINY)
        write_tiny_model(out_dir / "model_b", attrs.evolve(TINY, seed=3))
    barrier()
    actor = build_actor(out_dir / "model_b", env, fsdp_cfg=FSDPConfig(micro_batch_size=64, param_dtype="float32"))
    rollout = build_vllm_rollout(out_dir / "model_a", config=VLLMConfig(tensor_parallel_size=tp, dtype="float32"))
    prompts = [[5 + env.rank, 6, 7], [8, 9], [10, 11, 12, 13]]
    sampling = SamplingConfig(n=4, max_new_tokens=16)

    before = generate(rollout, prompts, sampling, seed=env.rank)
    gap_before = (compute_logprobs(actor, before).logprobs - before.rollout_logprobs).abs().max().item()
    t0 = time.perf_counter()
    rollout = sync_weights(rollout, full_state_dict(actor))
    sync_s = time.perf_counter() - t0
    batch = generate(rollout, prompts, sampling, seed=env.rank)
    trainer = compute_logprobs(actor, batch).logprobs
    gap = (trainer - batch.rollout_logprobs)[batch.response_mask].abs().max().item()
    total = all_reduce_sum(torch.tensor(1.5, device=env.device)).item()
    result = {
        "rank": env.rank,
        "max_gap": gap,
        "gap_before_sync": gap_before,
        "changed": gap_before > 1e-2,
        "tokens": int(batch.response_mask.sum()),
        "sync_s": sync_s,
        "all_reduce_after_vllm": total,
        "prompt_rows_ok": batch.prompt_ids[0, -3:].tolist() == prompts[0][-3:],  # this rank's prompts came back
    }
    if tp > 1:  # a prompt too long on rank 1 only: both ranks raise, neither reaches the shared engine alone
        try:
            generate(rollout, prompts if env.rank == 0 else [[5] * 70], sampling, seed=env.rank)
            result["refused"] = None
        except ValueError as e:
            result["refused"] = str(e)
        result["generates_after_refusal"] = bool(
            generate(rollout, prompts, sampling, seed=env.rank).response_mask.any()
        )
    (out_dir / f"rank{env.rank}.json").write_text(json.dumps(result))
    shutdown_vllm(rollout)
    shutdown(env)


def main(argv: list[str]) -> None:
    sync_and_check(Path(argv[0]), int(argv[1]))


if __name__ == "__main__":
    main(sys.argv[1:])
