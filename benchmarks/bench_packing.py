"""Packed vs padded actor update on long-tailed response lengths; balanced token budgets on 2 ranks.

Run: ``.venv/bin/python benchmarks/bench_packing.py [--steps 8] [--rows 128] [--skip-ranks]``.

1. One process, one torch thread, config-B model (benchmarks/bench_grpo_vs_trl.py: Qwen2, hidden 256, 4 layers, ~2.9M
   parameters, fp32). A GRPO-shaped batch: 16 prompts x 8 samples, prompts of 4-8 tokens, response
   lengths log-normal (median 12 tokens) with a few long ones (up to ``--max-response``): the shape of
   a real RL batch, where most samples stop early and a few run long. Compared, on the same batches:
   ``update`` with padded micro-batches of 16 rows (trimmed to the longest row of each micro-batch,
   the engine's default) and with ``use_remove_padding=True`` (same micro-batches, packed). The
   actors alternate step by step in the same process so that load from other work hits both alike;
   medians over steps 2..N and the median of per-step ratios.
2. Two gloo ranks (1 thread each), packed in both cases: fixed 16-row micro-batches on each rank's
   half of the batch as given (long groups bunched on one rank), vs ``balance_dp=True`` plus a
   balanced token budget (``token_budget_grouping="balanced"``). Step time of rank 0 (the ranks
   synchronise every step, so both see the slower one's time), and the tokens of the busiest rank
   before and after balancing (deterministic: the bound on the speed-up).
On a small shared machine timings are noisy: read the ratios, measured in the same run.
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


def long_tail_batch(rows: int, vocab: int, seed: int, max_response: int, group: int = 8) -> RolloutBatch:
    """Log-normal response lengths (median 12; a group shares a scale, so long groups bunch up)."""
    g = torch.Generator().manual_seed(seed)
    p = 8
    groups = rows // group
    prompt_lens = torch.randint(4, p + 1, (groups,), generator=g).repeat_interleave(group)
    group_scale = torch.exp(0.6 * torch.randn(groups, generator=g)).repeat_interleave(group)
    lengths = 12.0 * group_scale * torch.exp(0.7 * torch.randn(rows, generator=g))
    response_lens = lengths.round().clamp(1, max_response).long()
    t = int(response_lens.max())
    return RolloutBatch(
        prompt_ids=torch.randint(4, vocab, (rows, p), generator=g),
        prompt_mask=torch.arange(p).flip(0)[None, :] < prompt_lens[:, None],
        response_ids=torch.randint(4, vocab, (rows, t), generator=g),
        response_mask=torch.arange(t)[None, :] < response_lens[:, None],
        group_ids=torch.arange(rows) // group,
        advantages=torch.randn(rows, t, generator=g),
    )


def pg_loss(outputs, mb, norms):
    return aggregate(-mb.advantages * outputs.logprobs, mb.response_mask, mode="token-mean", norms=norms), {}


def _time_updates(states: dict, batches: list[RolloutBatch]) -> dict[str, list[float]]:
    from backends.training.fsdp import update

    times = {name: [] for name in states}
    for batch in batches:
        for name in states:
            t0 = time.perf_counter()
            states[name], _ = update(states[name], batch, pg_loss)
            times[name].append(time.perf_counter() - t0)
    return times


def _report(times: dict[str, list[float]], base: str, other: str, label: str) -> None:
    for name, ts in times.items():
        print(f"  {name:34s} median {statistics.median(ts[1:]):7.3f} s  (steps 2..{len(ts)})")
    ratios = [b / o for b, o in zip(times[base][1:], times[other][1:])]
    print(
        f"  {label}: {base} / {other} time, median of per-step ratios = {statistics.median(ratios):.2f}x "
        f"(range {min(ratios):.2f}-{max(ratios):.2f})"
    )


def single_process(model_dir: str, vocab: int, rows: int, steps: int, max_response: int) -> None:
    from backends.training.fsdp import FSDPConfig, build_actor
    from backends.training.optim import OptimConfig

    optim = OptimConfig(lr=1e-5)
    states = {
        "padded (16-row micro-batches)": build_actor(model_dir, None, optim, FSDPConfig(micro_batch_size=16)),
        "packed (16-row micro-batches)": build_actor(
            model_dir, None, optim, FSDPConfig(micro_batch_size=16, use_remove_padding=True)
        ),
    }
    batches = [long_tail_batch(rows, vocab, seed, max_response) for seed in range(steps)]
    real = [int(b.prompt_mask.sum() + b.response_mask.sum()) for b in batches]
    padded = [b.prompt_ids.numel() + b.response_ids.numel() for b in batches]
    longest = [int(b.response_mask.sum(-1).max()) for b in batches]
    print(
        f"\n1 process x 1 thread, {rows} rows per step: real tokens {statistics.median(real):.0f}, "
        f"padded (b x (p + t)) {statistics.median(padded):.0f}, longest response {statistics.median(longest):.0f} "
        f"(medians over steps)"
    )
    times = _time_updates(states, batches)
    _report(times, "padded (16-row micro-batches)", "packed (16-row micro-batches)", "packed speed-up (target >= 1.5x)")


def _two_ranks(rank: int, world_size: int, model_dir: str, vocab: int, rows: int, steps: int, max_response: int):
    from backends.training.fsdp import FSDPConfig, build_actor
    from backends.training.optim import OptimConfig

    optim = OptimConfig(lr=1e-5)
    budget = 8 * (8 + max_response)
    states = {
        "fixed rows": build_actor(model_dir, None, optim, FSDPConfig(micro_batch_size=16, use_remove_padding=True)),
        "balanced budget": build_actor(
            model_dir,
            None,
            optim,
            FSDPConfig(
                max_tokens_per_micro_batch=budget,
                token_budget_grouping="balanced",
                balance_dp=True,
                use_remove_padding=True,
            ),
        ),
    }
    n = rows // world_size
    # sorted by group length, so that rank 1 gets the long groups: the imbalance balancing removes
    batches = []
    for seed in range(steps):
        b = long_tail_batch(rows, vocab, seed, max_response)
        per_group = b.response_mask.sum(-1).reshape(-1, 8).sum(-1)
        order = torch.argsort(per_group).repeat_interleave(8) * 8 + torch.arange(rows) % 8
        batches.append(select(select(b, order), slice(rank * n, (rank + 1) * n)))
    from backends.training.dp_balance import balance_across_ranks

    count = lambda b: int(b.prompt_mask.sum() + b.response_mask.sum())
    tokens = sum(count(b) for b in batches) / steps
    balanced = sum(count(balance_across_ranks(b, states["balanced budget"])) for b in batches) / steps
    return {"times": _time_updates(states, batches), "tokens": int(tokens), "balanced_tokens": int(balanced)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rows", type=int, default=128, help="global batch rows (16 prompts x 8 samples)")
    parser.add_argument("--max-response", type=int, default=160)
    parser.add_argument("--skip-ranks", action="store_true", help="skip the 2-rank balancing comparison")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        config = TinyModelConfig()  # config B
        model_dir = str(write_tiny_model(Path(tmp) / "config_b", config))
        from backends.models import load_causal_lm

        model, tokenizer = load_causal_lm(model_dir)
        vocab = len(tokenizer)
        print(f"config-B model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, fp32")
        del model
        single_process(model_dir, vocab, args.rows, args.steps, args.max_response)
        if args.skip_ranks:
            return
        out = run_distributed(_two_ranks, 2, model_dir, vocab, args.rows, args.steps, args.max_response)
        before = [o["tokens"] for o in out]
        after = [o["balanced_tokens"] for o in out]
        print(
            f"\n2 gloo ranks x 1 thread, packed, {args.rows} rows: real tokens per rank (mean per step) "
            f"{before[0]} / {before[1]} as given, {after[0]} / {after[1]} balanced: the slowest rank's "
            f"work shrinks {max(before) / max(after):.2f}x (the bound on the speed-up when the ranks run "
            f"in parallel; with fewer free cores than ranks they do not)"
        )
        _report(out[0]["times"], "fixed rows", "balanced budget", "balanced speed-up (rank 0)")


if __name__ == "__main__":
    main()
