"""Decode throughput of the native engine at a real model's shape on a GPU, against ``transformers`` ``generate`` in
the same run and against the device's memory-bandwidth bound.

Run (on a machine with CUDA; no download; ``make test-gpu`` runs it):

    python benchmarks/bench_decode_gpu.py                         # batches of 64 and 256 rows, 512 new tokens
    python benchmarks/bench_decode_gpu.py --batches 256 --profile  # and where one engine's decode time goes

The checkpoint is ``benchmarks/gpu_real_scale.py``'s: random weights with Qwen2.5-0.5B-Instruct's shape (hidden 896,
24 layers, GQA 14/2, vocabulary 151,936, tied embeddings) in bf16. Every engine samples (temperature 1) ``--n``
samples of ``rows / n`` short arithmetic prompts and every row runs to ``--max-new-tokens`` (the stop id is one the
model cannot sample; ``generate`` gets ``min_new_tokens``), so all engines produce the same number of tokens.

The bound: a decode step reads every weight once (the embedding table as the tied lm_head; the embedding lookup's
few rows are left out) and each row's keys and values so far, so one step takes at least
``(weight bytes + rows x mean context x KV bytes per token) / bandwidth``; ``bandwidth`` is measured here (a device
copy of 2 GiB: bytes read + written over its time), and the nominal figure of a known device is printed beside it.
Tokens/s of each engine are printed as a fraction of ``rows / that time``.

Engines: ``continuous`` (the default engine: continuous batching over the paged cache, its decode step replayed
from CUDA graphs, each step queued before the tokens sampled before it are read), ``continuous-eager`` (the same
without graphs), ``continuous-waiting`` (graphs, but each step waits for those tokens; not run by default),
``lockstep`` and ``generate``.

``--device cpu --tiny`` runs the same code on a tiny model (a check of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from backends.models import TinyModelConfig, load_causal_lm, write_tiny_model  # noqa: E402
from backends.rollout.common import SamplingConfig, left_pad  # noqa: E402
from backends.rollout.native import BatchingLimits, build_native_rollout, generate  # noqa: E402

#: bytes/s of HBM as the vendors state it (GPU name substring -> bandwidth)
NOMINAL_BANDWIDTH = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12, "A100-SXM4-80GB": 2.04e12}


def measured_bandwidth(device: torch.device, gib: float = 2.0, reps: int = 10) -> float:
    """Bytes/s of a device-to-device copy (each byte read once and written once)."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * src.numel() * reps / (time.perf_counter() - t0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_bytes(model: torch.nn.Module, rows: int, mean_context: float) -> tuple[int, float, int]:
    """(weight bytes read per decode step, KV bytes read per step, KV bytes per token)."""
    cfg = model.config
    embed = model.get_input_embeddings().weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not cfg.tie_word_embeddings:  # the untied lookup table is read a few rows at a time: leave it out
        weights -= embed.numel() * embed.element_size()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * embed.element_size()
    return weights, rows * mean_context * kv_per_token, kv_per_token


def hf_generate(model, prompts: list[list[int]], n: int, max_new: int, pad: int, seed: int) -> int:
    torch.manual_seed(seed)
    ids, mask = left_pad(prompts, pad)
    out = model.generate(
        input_ids=ids.to(model.device),
        attention_mask=mask.long().to(model.device),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new,
        min_new_tokens=max_new,
        num_return_sequences=n,
        pad_token_id=pad,
    )
    return (out.shape[1] - ids.shape[1]) * out.shape[0]


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256], help="rows decoded together")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (rows / n prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--runs", type=int, default=2, help="timed runs per engine and batch (after one warm-up)")
    ap.add_argument("--engines", nargs="+", default=["continuous", "continuous-eager", "lockstep", "generate"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny fp32 model (checks the script on a CPU)")
    ap.add_argument("--profile", action="store_true", help="profile one continuous-batching call per batch")
    return ap.parse_args()


def main() -> None:
    args = _args()
    device = torch.device(args.device)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            model_dir = write_tiny_model(tmp, TinyModelConfig(max_position_embeddings=1024))
        else:
            from gpu_real_scale import write_checkpoint

            model_dir = write_checkpoint(Path(tmp))
        model, tokenizer = load_causal_lm(model_dir, dtype=dtype, device=device)
        never = model.config.vocab_size + 5  # an id outside the vocabulary: no row stops before max_new_tokens
        variants = {
            "continuous": dict(batching="continuous"),
            "continuous-eager": dict(batching="continuous", batching_limits=BatchingLimits(cuda_graphs=False)),
            # graphs, but each step waits for the tokens sampled before it (no overlap of the host's bookkeeping)
            "continuous-waiting": dict(batching="continuous", batching_limits=BatchingLimits(overlap_steps=False)),
            "lockstep": dict(batching="lockstep"),
        }
        engines = {
            name: build_native_rollout(model_dir, tokenizer, dtype=dtype, device=device, eos_token_ids=[never], **kw)
            for name, kw in variants.items()
            if name in args.engines
        }
        pad = tokenizer.pad_token_id
        bandwidth = measured_bandwidth(device) if device.type == "cuda" else float("nan")
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        nominal = next((bw for key, bw in NOMINAL_BANDWIDTH.items() if key in name), float("nan"))
        params = sum(p.numel() for p in model.parameters())
        print(
            f"device {name}: copy bandwidth {bandwidth / 1e12:.2f} TB/s measured, {nominal / 1e12:.2f} TB/s nominal; "
            f"model {params / 1e6:.0f}M params {dtype}, torch {torch.__version__}",
            flush=True,
        )
        for rows in args.batches:
            rng = random.Random(rows)
            texts = [f"{rng.randint(0, 99)}+{rng.randint(0, 99)}=" for _ in range(rows // args.n)]
            prompts = [tokenizer.encode(t) for t in texts]

            def native_call(rollout, seed: int, max_new: int) -> int:
                sampling = SamplingConfig(n=args.n, temperature=1.0, max_new_tokens=max_new)
                return int(generate(rollout, prompts, sampling, seed=seed).response_mask.sum())

            calls = {engine: functools.partial(native_call, rollout) for engine, rollout in engines.items()}
            if "generate" in args.engines:
                calls["generate"] = lambda seed, max_new: hf_generate(model, prompts, args.n, max_new, pad, seed)
            rates: dict[str, list[float]] = {engine: [] for engine in calls}
            peaks: dict[str, float] = {}
            for engine, call in calls.items():
                call(-1, 8)  # warm-up: kernels and the allocator's first buffers
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                for r in range(args.runs):
                    sync(device)
                    t0 = time.perf_counter()
                    tokens = call(r, args.max_new_tokens)
                    sync(device)
                    dt = time.perf_counter() - t0
                    rates[engine].append(tokens / dt)
                    print(f"rows {rows} {engine:16s} run {r}: {tokens} tokens in {dt:.2f} s", flush=True)
                if device.type == "cuda":
                    peaks[engine] = torch.cuda.max_memory_allocated(device) / 2**30
            mean_context = statistics.mean(map(len, prompts)) + args.max_new_tokens / 2
            weights, kv, kv_per_token = decode_bytes(model, rows, mean_context)
            bound = rows * bandwidth / (weights + kv)
            print(
                f"rows {rows} ({len(prompts)} prompts x {args.n}), {args.max_new_tokens} new tokens: weights "
                f"{weights / 2**20:.0f} MiB + KV {kv / 2**20:.0f} MiB read per mean step ({kv_per_token} KV bytes per "
                f"token); bound {bound:,.0f} tokens/s at the measured bandwidth"
            )
            hf = statistics.median(rates["generate"]) if "generate" in rates else float("nan")
            for engine, values in rates.items():
                rate = statistics.median(values)
                print(
                    f"  {engine:16s}: {rate:10,.0f} tokens/s = {rate / hf:5.2f}x generate = {rate / bound:.3f} of the "
                    f"bound; peak memory {peaks.get(engine, float('nan')):.2f} GiB"
                )
            if args.profile and "continuous" in engines:
                profile(engines["continuous"], prompts, SamplingConfig(n=args.n, temperature=1.0, max_new_tokens=64))


def profile(rollout, prompts: list[list[int]], sampling: SamplingConfig) -> None:
    """Where one call's time goes: the top operators by their own host time, and the device's busy time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch_profile(activities=activities) as prof:
        t0 = time.perf_counter()
        generate(rollout, prompts, sampling, seed=0)
        sync(rollout.device)
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events)
    print(
        f"profile: {sampling.max_new_tokens} tokens per row, wall {wall * 1e3:.0f} ms, device busy "
        f"{device_us / 1e3:.0f} ms ({device_us / 1e6 / wall:.0%})"
    )
    print(events.table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
