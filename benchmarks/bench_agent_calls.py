"""What an agent's model call costs through the endpoint, against the engine's own generate.

Run: ``.venv/bin/python benchmarks/bench_agent_calls.py [--trajectories 64] [--repeats 3] [--agents 1 8 32]``.

On the calculator preset's model size (hidden 128, 3 layers, random init, the task's tiny tokenizer), with the
native engine in this process, it times (median of ``--repeats``):

- ``generate``: the engine's ``generate`` of one chat prompt, one row, ``max_new_tokens=16``, per call;
- ``openai``: the same through an in-process rollout server (``backends.rollout.server.ThreadedServer``), one
  ``openai`` client reused, calls one after another;
- ``agents xK <batching>``: ``--trajectories`` trajectories of the calculator ReAct agent (``experiments/agents/
  calculator_react.py``: a client per trajectory over one shared connection pool) through ``AgentRunner`` with K
  agents at a time (``--agents``), per model call (registration and the read-back of every trajectory's tokens
  included), and as model calls (requests) and sampled tokens per second of the whole round; once with the server's
  calls joining the engine's running batch (``stream``), the same without the stream's prefix cache (``uncached``:
  every call's whole conversation computed again), and gathered into engine calls (``gathered``), each repeat
  running all on the same seeds, and the ratios to gathered.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import attrs  # noqa: E402
import openai  # noqa: E402

from backends.data import Example, prompt_token_ids  # noqa: E402
from backends.models import TinyModelConfig, build_char_tokenizer, load_tokenizer, write_tiny_model  # noqa: E402
from backends.rollout.agents import agent_runner  # noqa: E402
from backends.rollout.api import RolloutConfig, build_rollout  # noqa: E402
from backends.rollout.common import SamplingConfig  # noqa: E402
from backends.rollout.server import ServedPolicy, ThreadedServer  # noqa: E402
from backends.rollout.server_weights import WeightStaging  # noqa: E402
from experiments.tasks import calculator  # noqa: E402

CALCULATOR_MODEL = TinyModelConfig(hidden_size=128, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=352)


def _examples(tokenizer, count: int) -> list[Example]:
    out = []
    for i in range(count):
        messages = [{"role": "user", "content": f"{100 + i}*{200 + i}="}]
        ids = tuple(prompt_token_ids(messages, tokenizer))
        answer = str((100 + i) * (200 + i))
        out.append(Example(ids, answer, "calculator", {}, f"row {i}", prompt=messages))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=20, help="calls per repeat of generate / openai")
    parser.add_argument("--agents", type=int, nargs="+", default=[1, 8, 32], help="agents at a time (threads)")
    parser.add_argument(
        "--batching",
        nargs="+",
        default=["stream", "uncached", "gathered"],
        choices=["stream", "uncached", "gathered"],
        help="how the server runs concurrent calls: a request stream they join (uncached: without its prefix cache), "
        "or gathered engine calls",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build_char_tokenizer(words=calculator.TOKENIZER_WORDS)
        model_dir = write_tiny_model(Path(tmp) / "model", CALCULATOR_MODEL, tokenizer)
        tokenizer = load_tokenizer(model_dir)
        engine = build_rollout(RolloutConfig(), model_dir, tokenizer)
        sampling = SamplingConfig(n=1, max_new_tokens=16)
        examples = _examples(tokenizer, max(1, args.trajectories // 8))
        prompt = list(examples[0].prompt_ids)
        policy = ServedPolicy(
            engine=engine,
            tokenizer=tokenizer,
            model_name="policy",
            trainer_token="bench",
            staging=WeightStaging(expected={}),
            defaults=sampling,
        )
        server = ThreadedServer(policy)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="bench", max_retries=0)
        agent = "experiments/agents/calculator_react.py:run"
        runners = {
            f"agents x{k} {mode}": attrs.evolve(
                agent_runner(agent, deadline_s=120.0, workers=k), request_streams=mode != "gathered"
            )
            for k in args.agents
            for mode in args.batching
        }
        uncached = attrs.evolve(engine, batching_limits=attrs.evolve(engine.batching_limits, prefix_cache=False))
        results: dict[str, list[float]] = {"generate": [], "openai": [], **{name: [] for name in runners}}
        rates: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
        try:
            for repeat in range(args.repeats):
                start = time.perf_counter()
                for i in range(args.calls):
                    engine.generate([prompt], sampling, seed=i)
                results["generate"].append((time.perf_counter() - start) / args.calls)
                start = time.perf_counter()
                for i in range(args.calls):
                    client.chat.completions.create(model="policy", messages=examples[0].prompt, seed=i)
                results["openai"].append((time.perf_counter() - start) / args.calls)
                for name, runner in runners.items():
                    start = time.perf_counter()
                    episodes = runner.sample(
                        uncached if name.endswith(" uncached") else engine,
                        examples,
                        tokenizer,
                        SamplingConfig(n=8, max_new_tokens=16),
                        seed=repeat,
                    )
                    wall = time.perf_counter() - start
                    calls = episodes.metrics["agent/calls"] * len(examples) * 8
                    tokens = int(episodes.batch.loss_mask.sum())  # the sampled ones; tool results carry no loss
                    results[name].append(wall / calls)
                    rates[name].append((calls / wall, tokens / wall))
            cached = {
                name: runner.server.policy.batcher.stats["engine/prefix_cached_tokens"]
                for name, runner in runners.items()
                if name.endswith(" stream")
            }
        finally:
            for runner in runners.values():
                runner.close()
            server.stop()
    base = statistics.median(results["generate"])
    for name, values in results.items():
        median = statistics.median(values)
        line = f"{name:22s} {median * 1000:7.1f} ms per model call ({median / base:.2f}x generate)"
        if name in rates:
            requests = statistics.median(r for r, _ in rates[name])
            tokens = statistics.median(t for _, t in rates[name])
            line += f"; {requests:6.1f} requests/s, {tokens:7.1f} sampled tokens/s"
            gathered = name.rsplit(" ", 1)[0] + " gathered"
            if not name.endswith(" gathered") and gathered in rates:
                ratio = requests / statistics.median(r for r, _ in rates[gathered])
                line += f" ({ratio:.2f}x gathered)"
        print(line)
    for name, counts in cached.items():
        print(f"{name}: {counts} prompt tokens read from the prefix cache over the rounds")


if __name__ == "__main__":
    main()
