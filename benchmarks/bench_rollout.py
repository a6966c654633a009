"""Native rollout engine vs ``transformers`` ``model.generate``: generated tokens per second.

Both sample (temperature 1, no top-k / top-p) up to ``--max-new-tokens`` tokens for the same batch of ``"a+b="`` prompts
on the same random-init model (config B of benchmarks/bench_grpo_vs_trl.py by default: Qwen2, hidden 256, 4 layers,
about 2.9M parameters, fp32), with one torch thread. A token counts when it is part of a response, i.e. up to and
including the first EOS. Runs alternate between the two engines (so a noisy neighbour hits both alike); the medians and
their ratio are printed.

    python benchmarks/bench_rollout.py                 # 128 prompts x 1 sample, 32 new tokens
    python benchmarks/bench_rollout.py --prompts 16 --n 8

Last, it times the decoding GEMMs alone (every linear layer and the lm_head for one token of every row,
through the faster of ``F.linear`` and the engine's oneDNN-prepacked path, in the native engine's
dtype) and prints the tokens/s they allow as a multiple of ``generate``'s: the most any implementation
whose matmuls run through those kernels could reach on the machine it runs on, attention, norms and
sampling costing nothing.
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
from backends.rollout.native import build_native_rollout, generate  # noqa: E402
from benchmarks.timing import median_seconds  # noqa: E402


def hf_generate(model, tokenizer, texts: list[str], n: int, max_new_tokens: int, seed: int) -> int:
    """Sample with ``model.generate``; return the number of response tokens (up to and incl. EOS)."""
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
            eos_token_id=tokenizer.eos_token_id,
        )
    response = out[:, enc.input_ids.shape[1] :]
    is_eos = response == tokenizer.eos_token_id
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--n", type=int, default=1, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=32)
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
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    tmp = None
    if args.model_dir is None:
        tmp = tempfile.TemporaryDirectory()
        model_dir = write_tiny_model(tmp.name, TinyModelConfig(arch=args.arch))
    else:
        model_dir = Path(args.model_dir)
    native_dtype = args.native_dtype or args.dtype
    model, tokenizer = load_causal_lm(model_dir, dtype=getattr(torch, args.dtype))
    rollout = build_native_rollout(model_dir, tokenizer, dtype=getattr(torch, native_dtype))
    params = sum(p.numel() for p in model.parameters())

    rng = random.Random(0)
    texts = [f"{rng.randint(0, 99)}+{rng.randint(0, 99)}=" for _ in range(args.prompts)]
    prompts = [tokenizer.encode(t) for t in texts]
    sampling = SamplingConfig(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens)

    def run_native(seed: int) -> int:
        return int(generate(rollout, prompts, sampling, seed=seed).response_mask.sum())

    def run_hf(seed: int) -> int:
        return hf_generate(model, tokenizer, texts, args.n, args.max_new_tokens, seed)

    rates: dict[str, list[float]] = {"native": [], "hf": []}
    run_native(-1), run_hf(-1)  # warm-up
    for r in range(args.runs):
        for name, fn in (("native", run_native), ("hf", run_hf)):
            t0 = time.perf_counter()
            tokens = fn(r)
            dt = time.perf_counter() - t0
            rates[name].append(tokens / dt)
            print(f"run {r} {name:6s}: {tokens:5d} tokens in {dt:.3f} s = {tokens / dt:8.0f} tokens/s", flush=True)

    native, hf = statistics.median(rates["native"]), statistics.median(rates["hf"])
    print(
        f"\nmodel {args.arch} {params / 1e6:.2f}M params, {args.prompts} prompts x {args.n}, "
        f"max_new_tokens {args.max_new_tokens}, {torch.get_num_threads()} thread(s), median of {args.runs}"
    )
    print(f"native rollout        ({native_dtype:8s}) : {native:8.0f} tokens/s")
    print(f"transformers generate ({args.dtype:8s}) : {hf:8.0f} tokens/s")
    paired = statistics.median(a / b for a, b in zip(rates["native"], rates["hf"]))
    print(
        f"ratio native / generate           : {native / hf:.2f}x of medians, {paired:.2f}x median of paired runs"
        " (target >= 2x)"
    )
    rows = args.prompts * args.n
    floor_ms = decode_gemm_ms(rollout.model, rows)
    ceiling = rows / floor_ms * 1e3
    print(
        f"decoding GEMMs alone ({native_dtype}, {rows} rows: {floor_ms:.2f} ms per step) : {ceiling:8.0f} tokens/s = "
        f"{ceiling / hf:.2f}x generate, the most an implementation through these GEMM kernels could reach"
    )
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
