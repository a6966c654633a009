"""rlfunc's pure core vs verl 0.9.1's ``core_algos``: wall time of the same computation, same inputs.

Run with the verl venv (rlfunc is installed editable there):

    /work/peer-verl/bin/python benchmarks/bench_core_vs_verl.py            # 1 thread, then default threads
    /work/peer-verl/bin/python benchmarks/bench_core_vs_verl.py --threads 1 --quick

Sections:

- GAE at (256, 512) and (1024, 2048), fp32, gamma 1.0, lam 0.95: ``rlfunc.gae`` + ``masked_whiten``
  (verl whitens inside, so this is the same output), and ``rlfunc.gae`` alone, vs
  ``compute_gae_advantage_return`` (a Python loop over time).
- GRPO and RLOO for 4096 responses (groups of 8, T = 1024): ours (including the ``sum(-1)`` of the
  token rewards verl does inside) vs verl's vectorised and loop versions, with a float mask and ids as
  an int64 numpy array (verl's fastest path) and, for information, with what verl's trainer passes:
  uid strings, and an int64 response mask (``attention_mask[:, -T:]``), whose multiply is slower.
- PPO clipped policy loss forward + backward at (256, 2048): ``rlfunc.ppo_policy_loss`` vs
  ``compute_policy_loss_vanilla``.

Each timing is the median of several runs; ours and verl's alternate, so a noisy neighbour hits both
alike. ``--clock cpu`` times 1-thread runs in process CPU time, which a busy shared machine disturbs
less. ``ours/verl`` < 1 means rlfunc is faster; ``speedup`` is its inverse. Max abs differences are
printed (on the response mask) and checked.

rlfunc's losses and estimators take every argument after the first tensor by keyword; verl's are
positional (and ordered differently), which is why the two calls below look different.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

try:
    from verl.trainer.ppo import core_algos as ca  # noqa: E402
except ImportError as exc:  # pragma: no cover
    raise SystemExit(f"needs verl (run with /work/peer-verl/bin/python): {exc}")

import rlfunc as rf  # noqa: E402

ROWS: list[tuple[str, str, float, float | None, str]] = []
CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCK["wall"]


def times_ms(fn: Callable[[], object], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        t0 = clock()
        fn()
        times.append((clock() - t0) * 1e3)
    return times


def compare(
    section: str, label: str, ours: Callable[[], object], theirs: Callable[[], object], runs: int, note: str = ""
) -> None:
    ours(), theirs()  # warm-up
    t_ours, t_theirs = [], []
    for _ in range(runs):  # alternate
        t_ours += times_ms(ours, 1)
        t_theirs += times_ms(theirs, 1)
    ROWS.append((section, label, statistics.median(t_ours), statistics.median(t_theirs), note))


def diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    a, b = a.detach().float(), b.detach().float()
    if mask is not None:
        a, b = a[mask], b[mask]
    return float((a - b).abs().max()) if a.numel() else 0.0


def prefix_mask(b: int, t: int, gen: torch.Generator) -> torch.Tensor:
    lengths = torch.randint(t // 4, t + 1, (b,), generator=gen)
    return torch.arange(t)[None, :] < lengths[:, None]


def bench_gae(b: int, t: int, runs: int, gen: torch.Generator) -> None:
    rewards = torch.randn(b, t, generator=gen)
    values = torch.randn(b, t, generator=gen)
    mask = prefix_mask(b, t, gen)
    maskf = mask.float()
    gamma, lam = 1.0, 0.95

    def ours():
        a, r = rf.gae(rewards, values=values, response_mask=mask, gamma=gamma, lam=lam)
        return rf.masked_whiten(a, mask), r

    def theirs():
        return ca.compute_gae_advantage_return(rewards, values, maskf, gamma, lam)

    def ours_no_whiten():
        return rf.gae(rewards, values=values, response_mask=mask, gamma=gamma, lam=lam)

    (oa, orr), (va, vr) = ours(), theirs()
    d = max(diff(oa, va, mask), diff(orr, vr, mask))
    scale = float(vr[mask].abs().max())
    assert d <= 1e-5 * max(1.0, scale), f"GAE differs from verl by {d} (|returns| up to {scale})"
    compare("GAE", f"({b}, {t}) gae + masked_whiten", ours, theirs, runs, f"max|diff| {d:.1e} (|R|<={scale:.0f})")
    compare("GAE", f"({b}, {t}) gae alone (verl: its whole fn)", ours_no_whiten, theirs, runs)


def outcome_inputs(n: int, group: int, t: int, gen: torch.Generator):
    scores = (torch.rand(n, generator=gen) < 0.5).float() + 0.1 * torch.randn(n, generator=gen)
    mask = prefix_mask(n, t, gen)
    last = mask & (mask.cumsum(1) == mask.sum(1, keepdim=True))
    token_rewards = torch.zeros(n, t)
    token_rewards[last] = scores
    # Shuffled, non-contiguous ids (as after a shuffle / balance step).
    ids = (torch.arange(n) // group) * 17 + 5
    ids = ids[torch.randperm(n, generator=gen)]
    ids_np = ids.numpy().astype(np.int64)
    uids = {int(i): str(uuid.UUID(int=int(i))) for i in ids.unique()}
    ids_str = np.array([uids[int(i)] for i in ids], dtype=object)
    return token_rewards, mask, ids, ids_np, ids_str


def bench_outcome(n: int, group: int, t: int, runs: int, loop_runs: int, gen: torch.Generator) -> None:
    token_rewards, mask, ids, ids_np, ids_str = outcome_inputs(n, group, t, gen)
    maskf = mask.float()
    maski = mask.long()  # verl's trainer passes attention_mask[:, -T:], an int64 tensor
    shape = f"{n} seq, group {group}, T={t}"
    cases = [
        (
            "GRPO",
            lambda: rf.grpo(token_rewards.sum(-1), group_ids=ids, response_mask=mask),
            ca.compute_grpo_vectorized_outcome_advantage,
            ca.compute_grpo_outcome_advantage,
        ),
        (
            "RLOO",
            lambda: rf.rloo(token_rewards.sum(-1), group_ids=ids, response_mask=mask),
            ca.compute_rloo_vectorized_outcome_advantage,
            ca.compute_rloo_outcome_advantage,
        ),
    ]
    for name, ours, vec, loop in cases:
        d_vec = diff(ours()[0], vec(token_rewards, maskf, ids_np)[0])
        d_loop = diff(ours()[0], loop(token_rewards, maskf, ids_np)[0])
        assert max(d_vec, d_loop) <= 1e-5, (name, d_vec, d_loop)
        compare(
            name,
            f"{shape} vs verl vectorized",
            ours,
            lambda: vec(token_rewards, maskf, ids_np),
            runs,
            f"max|diff| {d_vec:.1e}",
        )
        compare(name, "   vs verl vectorized, uid strings", ours, lambda: vec(token_rewards, maskf, ids_str), runs)
        compare(name, "   vs verl vectorized, int64 mask", ours, lambda: vec(token_rewards, maski, ids_np), runs)
        compare(
            name,
            "   vs verl loop",
            ours,
            lambda: loop(token_rewards, maskf, ids_np),
            loop_runs,
            f"max|diff| {d_loop:.1e}",
        )


def bench_policy_loss(b: int, t: int, runs: int, gen: torch.Generator) -> None:
    old = -torch.rand(b, t, generator=gen) * 3
    new = (old + 0.1 * torch.randn(b, t, generator=gen)).requires_grad_()
    advantages = torch.randn(b, t, generator=gen)
    mask = prefix_mask(b, t, gen)
    maskf = mask.float()
    cfg = OmegaConf.create(
        {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0, "global_batch_info": {}}
    )

    def ours():
        new.grad = None
        loss, metrics = rf.ppo_policy_loss(
            new,
            old_logprobs=old,
            advantages=advantages,
            response_mask=mask,
            clip_low=0.2,
            clip_high=0.2,
            dual_clip=3.0,
            agg="token-mean",
        )
        loss.backward()
        return loss.detach(), new.grad.clone()

    def theirs():
        new.grad = None
        loss, metrics = ca.compute_policy_loss_vanilla(old, new, advantages, maskf, "token-mean", cfg)
        loss.backward()
        return loss.detach(), new.grad.clone()

    (lo, go), (lv, gv) = ours(), theirs()
    d = max(diff(lo, lv), diff(go, gv))
    assert d <= 1e-5, f"PPO loss differs from verl by {d}"
    compare("PPO loss", f"({b}, {t}) fwd+bwd, dual clip 3", ours, theirs, runs, f"max|diff| loss+grad {d:.1e}")


def print_table(threads: int, clock_name: str) -> None:
    print(f"\n## torch threads = {threads} (torch {torch.__version__}, median {clock_name} ms)\n")
    header = f"| {'section':<8} | {'case':<44} | {'rlfunc ms':>9} | {'verl ms':>9} | "
    header += f"{'ours/verl':>9} | {'speedup':>8} |"
    print(header + " note")
    print(f"|{'-' * 10}|{'-' * 46}|{'-' * 11}|{'-' * 11}|{'-' * 11}|{'-' * 10}|------")
    for section, label, ours, theirs, note in ROWS:
        if theirs is None:
            print(f"| {section:<8} | {label:<44} | {'-':>9} | {'-':>9} | {'-':>9} | {'-':>8} | {note}")
            continue
        print(
            f"| {section:<8} | {label:<44} | {ours:9.2f} | {theirs:9.2f} | {ours / theirs:9.3f} | "
            f"{theirs / ours:7.1f}x | {note}"
        )
    ROWS.clear()


def run_all(threads: int, quick: bool, clock_name: str) -> None:
    global clock
    clock = CLOCK[clock_name]
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    runs = 3 if quick else 9
    loop_runs = 1 if quick else 3
    bench_gae(256, 512, runs, gen)
    bench_gae(1024, 2048, max(3, runs // 2), gen)
    bench_outcome(4096, 8, 1024, runs, loop_runs, gen)
    bench_policy_loss(256, 2048, runs, gen)
    print_table(threads, clock_name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--threads", type=int, default=None, help="only this thread count (default: 1, then torch's default)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCK),
        default="wall",
        help="wall (default) or this process's CPU time: steadier on a shared machine, but with more than one "
        "thread it adds up the threads' time, so it is used for 1-thread runs only",
    )
    args = parser.parse_args()
    default_threads = torch.get_num_threads()
    for threads in [args.threads] if args.threads else sorted({1, default_threads}):
        run_all(threads, args.quick, args.clock if threads == 1 else "wall")


if __name__ == "__main__":
    main()
