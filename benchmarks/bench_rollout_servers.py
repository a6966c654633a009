"""Sampling through vLLM rollout servers against the in-process vLLM engine, and the weight push against the
in-process weight sync, in one run on this machine.

    python benchmarks/bench_rollout_servers.py [--prompts 64] [--n 8] [--max-new-tokens 32] [--repeats 3]

The model is config B (``TinyModelConfig()``: Qwen2, hidden 256, 4 layers, about 2.9M parameters, fp32), written
once. Three ways of sampling the same prompts with the same per-prompt seeds, each given the same cores:

- ``in-process``: ``build_vllm_rollout`` (``rollout.engine=vllm``) in this process, ``generate``;
- ``1 server`` / ``2 servers``: vLLM's OpenAI server in processes of their own (``start_vllm_server``), each
  prompt one request of ``n`` samples to ``/inference/v1/generate``, sent 16 at a time, round robin over the
  servers (``rollout.engine=vllm_server``'s generate).

Each server process and the in-process engine run with one OpenMP thread, so ``2 servers`` uses two cores where the
others use one: the column says what a second server buys on this box. Printed: the median samples/s over
``repeats`` (after one warm-up), and the weight push: ``WeightPusher.push`` of the full set to one server
(pause, gloo broadcast, vLLM's layerwise reload, prefix-cache reset, resume) against the in-process engine's
``sync_weights``, in ms and ms per MB.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from backends.models import TinyModelConfig, build_char_tokenizer, write_tiny_model  # noqa: E402
from backends.rollout.common import SamplingConfig  # noqa: E402
from backends.rollout.server_auth import new_tokens  # noqa: E402
from backends.rollout.server_rollout import ServerRollout  # noqa: E402
from backends.rollout.vllm_server import (  # noqa: E402
    ServerClient,
    VLLMServerConfig,
    WeightPusher,
    checkpoint_shapes,
    start_vllm_server,
)


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="bench-servers-"))
    tokenizer = build_char_tokenizer()
    model_dir = write_tiny_model(work / "model", TinyModelConfig(), tokenizer)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(5, 200, (int(torch.randint(8, 16, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(args.prompts)
    ]
    sampling = SamplingConfig(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens)
    samples = args.prompts * args.n
    context = 16 + args.max_new_tokens + 1
    results = {}

    from backends.rollout.vllm import VLLMConfig, build_vllm_rollout, model_token_ids, read_hf_config

    hf_cfg = read_hf_config(model_dir)
    eos, pad = model_token_ids(model_dir, hf_cfg, tokenizer, None)

    engine = build_vllm_rollout(model_dir, tokenizer, VLLMConfig(), max_context=context)
    results["in-process"] = samples / timed(lambda: engine.generate(prompts, sampling, seed=1), args.repeats)
    named = [(n, t.detach().clone()) for n, t in _checkpoint(model_dir)]
    megabytes = sum(t.numel() * t.element_size() for _, t in named) / 2**20
    in_process_sync = timed(lambda: engine.sync_weights(named), args.repeats)
    engine.shutdown()

    tokens = new_tokens()
    cfg = VLLMServerConfig(max_model_len=context)
    servers = [
        start_vllm_server(model_dir, cfg, tokens, log_path=work / f"server{i}.log", wait=False) for i in range(2)
    ]
    for server in servers:
        server.wait_ready(cfg.startup_timeout_s)
    clients = [ServerClient(s.url, tokens.trainer) for s in servers]
    pushers = [WeightPusher(c, backend="rlfunc_gloo", expected=checkpoint_shapes(model_dir)) for c in clients]
    push = timed(lambda: pushers[0].push(named, 1), args.repeats)
    pushers[1].push(named, 1)  # both servers serve version 1: the engine checks every token's version
    for count in (1, 2):
        served = ServerRollout(
            clients=tuple(clients[:count]),
            pad_token_id=pad,
            eos_token_ids=eos,
            max_context=context,
            vocab_size=int(hf_cfg.vocab_size),
            weights_version=1,
        )
        label = f"{count} server" + ("s" if count > 1 else "")
        results[label] = samples / timed(lambda: served.generate(prompts, sampling, seed=1), args.repeats)
    for pusher in pushers:
        pusher.close()
    for server in servers:
        server.stop()

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"# {cpu}, {os.cpu_count()} cores, torch {torch.__version__}; config B, {args.prompts} prompts x {args.n}")
    print(f"# samples, {args.max_new_tokens} new tokens at most; medians of {args.repeats} after a warm-up")
    base = results["in-process"]
    print(f"{'sampling':<12} {'samples/s':>10} {'vs in-process':>14}")
    for label, rate in results.items():
        print(f"{label:<12} {rate:>10.1f} {rate / base:>13.2f}x")
    print(f"weights: {megabytes:.1f} MB")
    print(f"{'weight sync':<22} {'ms':>8} {'ms per MB':>10}")
    print(f"{'in-process sync':<22} {in_process_sync * 1e3:>8.1f} {in_process_sync * 1e3 / megabytes:>10.2f}")
    print(f"{'push to a server':<22} {push * 1e3:>8.1f} {push * 1e3 / megabytes:>10.2f}")


def _checkpoint(model_dir: Path) -> list:
    from safetensors.torch import load_file

    tensors = load_file(str(next(model_dir.glob("*.safetensors"))))
    tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"])
    return list(tensors.items())


if __name__ == "__main__":
    main()
