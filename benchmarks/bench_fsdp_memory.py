"""Per-rank memory of the actor's training state under FSDP2, and fp32 vs bf16 step time on the CPU.

Run: ``.venv/bin/python benchmarks/bench_fsdp_memory.py [--steps 6] [--rows 128]``.

1. Memory. Bytes held by one rank for parameters + gradients + AdamW state, counted from the actual
   tensors' storages (``DTensor._local_tensor`` for sharded ones; each storage once, so tied weights
   count once, and FSDP's shard padding is included). Gradients are counted in an optimizer step
   pre-hook (the moment they peak), parameters and optimizer state right after the step. Compared:
   a single process with the plain HF model + AdamW, and each of 2 FSDP ranks (config-B model).
2. Time. One ``update`` on 2 ranks (1 torch thread each, the torchrun layout of ``make demo``)
   with param_dtype float32 vs bfloat16 (fp32 master weights, fp32 gradient reduction), on a GRPO-
   sized batch (16 prompts x 8 samples; prompts of ~4-8 tokens, responses of up to 32). Both actors
   live in the same processes and alternate step by step, so load from other work hits both alike;
   medians over steps 2..N.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.models import TinyModelConfig, write_tiny_model  # noqa: E402
from rlfunc.aggregation import aggregate  # noqa: E402
from rlfunc.batch import RolloutBatch, select  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shard)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        local = getattr(t, "_local_tensor", t)
        storage = local.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def optimizer_tensors(optimizer: torch.optim.Optimizer):
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def make_batch(rows: int, vocab: int, seed: int = 0, max_response: int = 32) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    p = 8
    prompt_lens = torch.randint(4, p + 1, (rows // 8,), generator=g).repeat_interleave(8)
    response_lens = torch.randint(1, max_response + 1, (rows,), generator=g)
    return RolloutBatch(
        prompt_ids=torch.randint(4, vocab, (rows, p), generator=g),
        prompt_mask=torch.arange(p).flip(0)[None, :] < prompt_lens[:, None],
        response_ids=torch.randint(4, vocab, (rows, max_response), generator=g),
        response_mask=torch.arange(max_response)[None, :] < response_lens[:, None],
        group_ids=torch.arange(rows) // 8,
        advantages=torch.randn(rows, max_response, generator=g),
    )


def pg_loss(outputs, mb, norms):
    return aggregate(-mb.advantages * outputs.logprobs, mb.response_mask, mode="token-mean", norms=norms), {}


def _memory_fsdp(rank: int, world_size: int, model_dir: str, vocab: int) -> dict:
    from backends.training.fsdp import FSDPConfig, build_actor, update
    from backends.training.optim import OptimConfig

    state = build_actor(model_dir, None, OptimConfig(lr=1e-5), FSDPConfig(micro_batch_size=8))
    grads = {}

    def record_grads(optimizer, args, kwargs):
        grads["bytes"] = storage_bytes(p.grad for group in optimizer.param_groups for p in group["params"])

    state.optimizer.register_step_pre_hook(record_grads)
    batch = make_batch(16, vocab)
    n = 16 // world_size
    state, _ = update(state, select(batch, slice(rank * n, (rank + 1) * n)), pg_loss)
    return {
        "params": storage_bytes(state.module.parameters()),
        "grads": grads["bytes"],
        "optimizer": storage_bytes(optimizer_tensors(state.optimizer)),
    }


def memory_single_process(model_dir: str, vocab: int) -> dict:
    from backends.models import load_causal_lm
    from backends.training.optim import OptimConfig, build_optimizer

    model, _ = load_causal_lm(model_dir)
    model.train()
    optimizer = build_optimizer(model.parameters(), OptimConfig(lr=1e-5))
    batch = make_batch(16, vocab)
    mask = batch.attention_mask.long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=batch.input_ids, attention_mask=mask, position_ids=positions).logits
    logits.float().logsumexp(-1).mean().backward()
    grads = storage_bytes(p.grad for p in model.parameters())
    optimizer.step()
    return {
        "params": storage_bytes(model.parameters()),
        "grads": grads,
        "optimizer": storage_bytes(optimizer_tensors(optimizer)),
    }


def _timing(rank: int, world_size: int, model_dir: str, vocab: int, rows: int, steps: int) -> dict:
    from backends.training.fsdp import FSDPConfig, build_actor, compute_logprobs, update
    from backends.training.optim import OptimConfig

    states = {
        dtype: build_actor(model_dir, None, OptimConfig(lr=1e-5), FSDPConfig(micro_batch_size=16, param_dtype=dtype))
        for dtype in ("float32", "bfloat16")
    }
    n = rows // world_size
    times = {f"{k}/{d}": [] for k in ("update", "logprobs") for d in states}
    # precision cost, same weights (before any update): |bf16 - fp32| log-prob of the response tokens
    local = select(make_batch(rows, vocab, seed=0), slice(rank * n, (rank + 1) * n))
    lp = {d: compute_logprobs(states[d], local).logprobs for d in states}
    gap = (lp["bfloat16"] - lp["float32"]).abs()[local.response_mask]
    times["logprob_gap"] = [float(gap.mean()), float(gap.max())]
    for step in range(steps):
        local = select(make_batch(rows, vocab, seed=step), slice(rank * n, (rank + 1) * n))
        for dtype in states:
            t0 = time.perf_counter()
            compute_logprobs(states[dtype], local)
            t1 = time.perf_counter()
            states[dtype], _ = update(states[dtype], local, pg_loss)
            t2 = time.perf_counter()
            times[f"logprobs/{dtype}"].append(t1 - t0)
            times[f"update/{dtype}"].append(t2 - t1)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rows", type=int, default=128, help="global batch rows (16 prompts x 8 samples)")
    parser.add_argument("--skip-timing", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        config = TinyModelConfig()  # config B: hidden 256, 4 layers, 4 heads, 2 kv heads, 688, tied
        model_dir = str(write_tiny_model(Path(tmp) / "config_b", config))
        from backends.models import load_causal_lm

        model, tokenizer = load_causal_lm(model_dir)
        vocab = len(tokenizer)
        n_params = sum(p.numel() for p in model.parameters())
        del model
        print(f"config-B model: {n_params / 1e6:.2f}M parameters, vocab {vocab}, tied embeddings")

        single = memory_single_process(model_dir, vocab)
        ranks = run_distributed(_memory_fsdp, 2, model_dir, vocab)
        mib = 2**20
        print("\nper-rank bytes of params + grads + AdamW state after one step (MiB)")
        print(f"{'':18s}{'params':>9s}{'grads':>9s}{'optim':>9s}{'total':>9s}")
        rows = [("single process", single)] + [(f"FSDP rank {r} / 2", m) for r, m in enumerate(ranks)]
        for name, m in rows:
            total = m["params"] + m["grads"] + m["optimizer"]
            cells = "".join(f"{v / mib:9.3f}" for v in (m["params"], m["grads"], m["optimizer"], total))
            print(f"{name:18s}{cells}")
        single_total = sum(single.values())
        worst = max(sum(m.values()) for m in ranks)
        print(f"ratio (largest FSDP rank / single process): {worst / single_total:.3f}  (target <= 0.55)")

        if args.skip_timing:
            return
        times = run_distributed(_timing, 2, model_dir, vocab, args.rows, args.steps)
        print(
            f"\nstep time on 2 ranks x 1 thread, {args.rows} rows (64 per rank, micro-batch 16), "
            f"median of steps 2..{args.steps} (seconds, rank 0 / rank 1)"
        )
        gap = times[0].pop("logprob_gap")
        times[1].pop("logprob_gap")
        print(f"  bf16 vs fp32 log-probs of the same tokens, same weights: mean |diff| {gap[0]:.2e}, max {gap[1]:.2e}")
        for key in times[0]:
            med = [statistics.median(t[key][1:]) for t in times]
            print(f"  {key:18s} {med[0]:7.3f} / {med[1]:7.3f}")
        for kind in ("update", "logprobs"):
            # paired by step (the two dtypes run back to back), so load drift cancels
            ratios = [b / f for f, b in zip(times[0][f"{kind}/float32"][1:], times[0][f"{kind}/bfloat16"][1:])]
            print(
                f"  {kind}: bf16 / fp32 time, median of per-step ratios = {statistics.median(ratios):.2f} "
                f"(range {min(ratios):.2f}-{max(ratios):.2f})"
            )


if __name__ == "__main__":
    main()
