"""TRL's side of benchmarks/bench_grpo_vs_trl.py: time TRL 1.16 ``GRPOTrainer`` steps on CPU.

Run with the python of the TRL venv (BUILD.md, "Benchmarks"); bench_grpo_vs_trl.py starts it as a
subprocess (``--trl-python`` / ``RLFUNC_TRL_PYTHON``), or by hand:

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 peer-trl/bin/python benchmarks/trl_grpo_step.py \\
        --model-dir runs/bench_grpo_vs_trl/config_A --prompts prompts.json --steps 10 \\
        --max-completion-length 16 --out trl_A.json

``prompts.json`` is a list of ``{"prompt": "12+34=", "answer": 46}`` (the bench writes the first
``16 * steps`` problems of the recipe's training stream, so both sides see the same prompts in the same
order). One optimizer step consumes 16 prompts x ``num_generations=8`` = 128 completions
(``per_device_train_batch_size=128``, one generation batch per step, one iteration), ``beta=0`` (or
``--beta``, which loads a reference model), ``loss_type="dapo"``, constant LR, fp32, no gradient
checkpointing, ``use_cpu=True``, one torch thread.

Per-step wall time is taken by a ``TrainerCallback`` (``on_step_begin`` -> ``on_step_end``: generation,
reward, advantages, forward/backward, optimizer step); the generation share by timing
``GRPOTrainer._generate_single_turn`` (``model.generate``). A fixed 512x512 fp32 matmul loop is timed in
this process before and after training, as a machine-speed calibration, and the process CPU time
between consecutive ``on_step_end`` calls is recorded too (steps 2..N; less disturbed by other jobs
than wall time). Results are written as JSON.
This file imports only torch, transformers, trl and datasets (not rlfunc: the TRL venv lacks attrs).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402


def calibrate(reps: int = 60, size: int = 512) -> float:
    """Median ms of one ``size x size`` fp32 matmul (after a warm-up): the machine's current speed."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g)
    b = torch.randn(size, size, generator=g)
    for _ in range(5):
        torch.mm(a, b)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


_ANSWER = re.compile(r"([+-]?[0-9]+)\.?")


def exact_sum_reward(completions: list[str], answer: list[int], **_: object) -> list[float]:
    """1.0 when the completion is the integer sum (``rlfunc.rewards.arithmetic_reward``'s bare-integer rule)."""
    out = []
    for text, want in zip(completions, answer):
        m = _ANSWER.fullmatch(text.strip())
        out.append(1.0 if m is not None and int(m.group(1)) == int(want) else 0.0)
    return out


def main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--prompts", required=True, help="JSON list of {prompt, answer}")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prompts-per-step", type=int, default=16)
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--max-completion-length", type=int, default=16)
    ap.add_argument("--beta", type=float, default=0.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bf16", action="store_true", help="TRL's bf16=True (accelerate's bf16 autocast; fp32 weights)")
    ap.add_argument("--out", required=True, help="JSON result file")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    calib_before = calibrate()

    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    transformers.utils.logging.set_verbosity_error()

    problems = json.load(open(args.prompts))
    need = args.prompts_per_step * args.steps
    if len(problems) < need:
        raise SystemExit(f"{args.prompts} has {len(problems)} prompts, {need} needed")
    dataset = Dataset.from_dict(
        {
            "prompt": [p["prompt"] for p in problems[:need]],
            "answer": [int(p["answer"]) for p in problems[:need]],
        }
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir, local_files_only=True)

    completions = args.prompts_per_step * args.num_generations
    out_dir = tempfile.mkdtemp(prefix="trl_grpo_bench_")
    config = GRPOConfig(
        output_dir=out_dir,
        max_steps=args.steps,
        per_device_train_batch_size=completions,  # one optimizer step = one generation batch = 128 completions
        gradient_accumulation_steps=1,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=args.beta,
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,  # our recipe's clip-higher
        scale_rewards="group",
        num_iterations=1,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        bf16=args.bf16,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        shuffle_dataset=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=args.seed,
        model_init_kwargs={"dtype": torch.float32},
        log_completions=False,
    )

    step_ms: list[float] = []
    gen_ms: list[float] = [0.0] * (args.steps + 1)
    state = {"t0": None, "last_end": None, "cycle_ms": [], "last_cpu": None, "cycle_cpu_ms": []}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args_, st, control, **kw):
            state["t0"] = time.perf_counter()

        def on_step_end(self, args_, st, control, **kw):
            now = time.perf_counter()
            step_ms.append((now - state["t0"]) * 1e3)
            cpu = time.process_time()
            if state["last_end"] is not None:  # end-to-end, incl. logging and the data loader
                state["cycle_ms"].append((now - state["last_end"]) * 1e3)
                state["cycle_cpu_ms"].append((cpu - state["last_cpu"]) * 1e3)
            state["last_end"], state["last_cpu"] = now, cpu

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_single_turn(self, *a, **kw):
            t0 = time.perf_counter()
            try:
                return super()._generate_single_turn(*a, **kw)
            finally:
                gen_ms[min(len(step_ms), args.steps)] += (time.perf_counter() - t0) * 1e3

    trainer = TimedGRPOTrainer(
        model=args.model_dir,
        reward_funcs=exact_sum_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimer()],
    )
    t_train = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t_train
    calib_after = calibrate()

    logs = [r for r in trainer.state.log_history if "loss" in r or "reward" in r]
    result = {
        "side": "trl",
        "trl_version": trl.__version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "calib_ms_before": calib_before,
        "calib_ms_after": calib_after,
        "step_ms": step_ms,
        "rollout_ms": gen_ms[: len(step_ms)],
        "cycle_ms": state["cycle_ms"],  # steps 2..N, on_step_end to on_step_end
        "cycle_cpu_ms": state["cycle_cpu_ms"],  # the same in process CPU time
        "train_s": train_s,
        "completion_length": [r.get("completions/mean_length") for r in logs],
        "reward": [r.get("reward") for r in logs],
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
