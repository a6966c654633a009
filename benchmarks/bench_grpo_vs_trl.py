"""Our GRPO step (experiments/grpo.py) vs TRL 1.16 ``GRPOTrainer``: wall time per step, 1 thread.

Both sides get the same model dir, tokenizer, prompts and sizes: the two reference benchmark
configurations below. Both are a Qwen2 model at random init, fp32, with tied embeddings and our
character-level tokenizer (``backends.models.build_char_tokenizer``); prompts are ``a+b=`` with reward
1 for the exact sum; each GRPO step samples 16 prompts x 8 samples = 128 completions at temperature
1.0 and takes one optimizer step; one torch thread per process.

- Config A: hidden 64, 2 layers, 4 heads (head_dim 16), 2 KV heads, intermediate 256; at most 16 new
  tokens. Written directly with ``Qwen2Config`` because ``TinyModelConfig`` refuses head_dim < 32.
- Config B: ``TinyModelConfig()``: hidden 256, 4 layers, 4 heads (head_dim 64), 2 KV heads,
  intermediate 688; at most 32 new tokens.

TRL runs in its own virtual environment (BUILD.md, "Benchmarks", shows how to build it), named by
``--trl-python`` or the ``RLFUNC_TRL_PYTHON`` environment variable. Run from our venv:

    .venv/bin/python benchmarks/bench_grpo_vs_trl.py --trl-python peer-trl/bin/python   # A and B, fp32 and bf16
    .venv/bin/python benchmarks/bench_grpo_vs_trl.py --configs B --steps 8 --rounds 2 --precisions bf16
    .venv/bin/python benchmarks/bench_grpo_vs_trl.py --beta 0.04        # with a reference model / KL term
    .venv/bin/python benchmarks/bench_grpo_vs_trl.py --ours-override actor.fsdp.use_remove_padding=false  # padded
    .venv/bin/python benchmarks/bench_grpo_vs_trl.py --configs A --steps 3 --sides ours   # ours only, no TRL venv

Precision (``--precisions``, both by default; each case runs both sides):

- ``fp32``: both sides fp32 (TRL ``bf16=False``).
- ``bf16``: TRL ``bf16=True`` (accelerate's bf16 autocast over fp32 weights, generation included);
  ours ``actor.fsdp.param_dtype=bfloat16`` (FSDP2's MixedPrecisionPolicy: bf16 forward / backward,
  fp32 master weights, AdamW state and gradient reduction) and ``rollout.dtype=bfloat16``.

Besides the same-precision ratio per case, the summary prints each side at its fastest precision.
Our recipe runs with its defaults except: packed sequences (``actor.fsdp.use_remove_padding=true``,
exact), TRL's micro-batch (``per_device_train_batch_size=128``: ``actor.fsdp.micro_batch_size=128``),
no LR warm-up, and ``algo.skip_zero_advantage=false`` unless ``--skip-zero-advantage``: at random
init every reward is 0, so every GRPO advantage is 0 and the skip would drop the whole forward /
backward, which TRL runs.

Each side is its own subprocess (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``, world size 1), run
one after the other, never in parallel; with ``--rounds > 1`` the order alternates between rounds.

- **Ours**: this file re-invoked as ``--child-ours`` imports the recipe and calls its ``main`` with
  ``model.path=<dir> data.train_files=<the prompts> data.shuffle=false reward.fn=arithmetic steps=N ...``
  (no SFT stage, no evaluation); the step time is the recipe's own ``step_time_s`` (rollout -> reward ->
  log-probs -> advantages -> update -> weight sync) and the rollout time its ``rollout_time_s`` from
  ``metrics.jsonl``.
- **TRL**: benchmarks/trl_grpo_step.py with the TRL interpreter; step time from a ``TrainerCallback``
  (``on_step_begin`` -> ``on_step_end``), rollout time from ``_generate_single_turn``.

Both child processes time a fixed 512x512 fp32 matmul before and after their steps (``calib``, ms): the
``norm. ratio`` column divides each side's step time by its own calibration (median over the runs'
calibrations) before comparing, which corrects for the machine being slower during one side's run.
``CPU ratio`` compares process CPU time per step (from one step's end to the next: ours at the
recipe's metrics-log call, TRL's at ``on_step_end``), which other jobs disturb less than wall time.
Reported step times are medians over steps 2..N (step 1 pays one-off warm-up costs), pooled over
rounds; the rollout share is median rollout time / median step time. A side that fails is reported as
failed (the other side still runs). Results also go to ``<work-dir>/results.json``.

Last, the parent times the GEMMs alone of one step at the measured lengths in the case's precision
(:func:`gemm_floor_ms`): a lower bound on any implementation's step whose matmuls run through
``torch.matmul`` (or oneDNN's prepacked linear), printed as a multiple of TRL's step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIGS = {
    "A": {
        "hidden_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "intermediate_size": 256,
        "max_new_tokens": 16,
    },
    "B": {
        "hidden_size": 256,
        "num_layers": 4,
        "num_heads": 4,
        "num_kv_heads": 2,
        "intermediate_size": 688,
        "max_new_tokens": 32,
    },
}
PROMPTS_PER_STEP = 16
SAMPLES = 8
#: where the TRL interpreter comes from when ``--trl-python`` is not given
TRL_PYTHON_ENV = "RLFUNC_TRL_PYTHON"


def calibrate(reps: int = 60, size: int = 512) -> float:
    """Median ms of one ``size x size`` fp32 matmul (same routine as trl_grpo_step.calibrate)."""
    import torch

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


# --------------------------------------------------------------------------------------------------
# Inputs: model dirs and prompts, written once by the parent.


def write_model(name: str, out_dir: Path) -> Path:
    """The config's random-init Qwen2 HF dir (fp32, tied embeddings, our char tokenizer), seed 0."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from backends.models import build_char_tokenizer

    if (out_dir / "config.json").is_file() and (out_dir / "model.safetensors").is_file():
        return out_dir
    c = CONFIGS[name]
    tok = build_char_tokenizer(model_max_length=256)
    # the fields backends.models.write_tiny_model sets, without TinyModelConfig's head_dim >= 32 check
    hf_config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_layers"],
        num_attention_heads=c["num_heads"],
        num_key_value_heads=c["num_kv_heads"],
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(hf_config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return out_dir


def write_prompts(path: Path, steps: int, seed: int) -> Path:
    """``16 * steps`` training problems of the arithmetic task, in step order: a JSON list for TRL's side and the
    same rows as JSONL (``path`` with the suffix ``.jsonl``) for our recipe, which reads them unshuffled."""
    import random

    from experiments.tasks.arithmetic import ArithmeticTask

    rng = random.Random(f"bench-{seed}")
    problems = [rng.choice(ArithmeticTask().train()) for _ in range(PROMPTS_PER_STEP * steps)]
    rows = [{"prompt": p.prompt, "answer": str(p.answer)} for p in problems]
    path.write_text(json.dumps(rows))
    path.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def param_count(model_dir: Path) -> int:
    """Parameters in the checkpoint (tied embeddings counted once)."""
    from safetensors.torch import load_file

    return sum(t.numel() for t in load_file(str(model_dir / "model.safetensors")).values())


def gemm_floor_ms(
    name: str,
    prompt_tokens: float,
    completion_tokens: float,
    rows: int = PROMPTS_PER_STEP * SAMPLES,
    vocab: int = 66,
    reps: int = 5,
    dtype=None,
) -> tuple[float, float]:
    """Matmul time alone of one GRPO step, 1 thread: ``(rollout_ms, update_ms)``.

    A lower bound for any implementation of the step in ``dtype`` (default fp32) that runs its
    matmuls through ``torch.matmul`` or oneDNN's prepacked linear (each product with a weight through
    the faster of the two): it times only the linear layers' GEMMs
    (no attention, norms, activations, sampling or optimizer), for the mean real lengths (no padding):
    decoding = ``completion_tokens`` steps of ``rows`` tokens through every linear + lm_head (the
    prompt prefill is left out); update = forward + the two backward GEMMs over the fewest tokens an
    exact update needs: each prompt once per group of ``SAMPLES`` (shared-prefix training) and each
    completion less its last token (whose output predicts nothing), i.e.
    ``rows / SAMPLES * prompt + rows * (completion - 1)`` (lm_head over the predicted tokens only).
    """
    import torch

    from backends.rollout.decoder import Linear
    from benchmarks.timing import median_seconds

    c = CONFIGS[name]
    hidden, head_dim = c["hidden_size"], c["hidden_size"] // c["num_heads"]
    layer = [
        (hidden, hidden + 2 * c["num_kv_heads"] * head_dim),
        (hidden, hidden),
        (hidden, c["intermediate_size"]),
        (hidden, c["intermediate_size"]),
        (c["intermediate_size"], hidden),
    ]

    def timed(fn) -> float:
        return median_seconds(fn, reps) * 1e3

    def times_weight_ms(x: "torch.Tensor", w: "torch.Tensor") -> float:
        """``x @ w.T``: the faster of torch.matmul and the native rollout's oneDNN-prepacked linear."""
        prepacked = Linear(w, None, x.shape[0], prepack=True)
        with torch.inference_mode():
            return min(timed(lambda: x @ w.t()), timed(lambda: prepacked(x)))

    def linear_ms(m: int, k: int, n: int) -> tuple[float, float]:
        """(forward, backward) ms; grad input = gy @ w (a product with a fixed weight, w.T), grad weight = gy.T @ x"""
        x, w, gy = (torch.randn(shape, dtype=dtype or torch.float32) for shape in ((m, k), (n, k), (m, n)))
        return times_weight_ms(x, w), times_weight_ms(gy, w.t().contiguous()) + timed(lambda: gy.t() @ x)

    tokens = int(rows / SAMPLES * prompt_tokens + rows * (completion_tokens - 1))
    decode_step = c["num_layers"] * sum(linear_ms(rows, k, n)[0] for k, n in layer) + linear_ms(rows, hidden, vocab)[0]
    products = [linear_ms(tokens, k, n) for k, n in layer] * c["num_layers"]
    products.append(linear_ms(int(rows * completion_tokens), hidden, vocab))
    return decode_step * completion_tokens, sum(f + b for f, b in products)


# --------------------------------------------------------------------------------------------------
# Our side, in a child process.


#: our recipe's settings per precision. bf16 = FSDP2 MixedPrecisionPolicy (bf16 compute, fp32 master
#: weights, AdamW state and gradient reduction) plus a bf16 rollout engine; TRL's bf16=True is
#: accelerate's bf16 autocast over fp32 weights, its generation included.
PRECISION_OVERRIDES = {
    "fp32": ["actor.fsdp.param_dtype=float32", "rollout.dtype=float32"],
    "bf16": ["actor.fsdp.param_dtype=bfloat16", "rollout.dtype=bfloat16"],
}


def ours_argv(
    model_dir: Path,
    cfg: str,
    steps: int,
    beta: float,
    seed: int,
    run_root: Path,
    name: str,
    extra: list[str],
    prompts: Path,
    precision: str = "fp32",
    skip_zero_advantage: bool = False,
) -> list[str]:
    return [
        f"name={name}",
        f"run_root={run_root}",
        f"model.path={model_dir}",
        f"seed={seed}",
        f"steps={steps}",
        f"data.train_files={prompts.with_suffix('.jsonl')}",
        "data.shuffle=false",
        "reward.fn=arithmetic",
        "eval.before_training=false",
        "export.hf=false",
        "logger=jsonl",
        f"prompts_per_step={PROMPTS_PER_STEP}",
        f"rollout.n={SAMPLES}",
        "rollout.temperature=1.0",
        f"rollout.max_new_tokens={CONFIGS[cfg]['max_new_tokens']}",
        "actor.optim.lr=1e-3",
        "actor.optim.lr_scheduler_type=constant",
        "actor.optim.lr_warmup_steps=0",
        f"algo.kl_loss_coef={beta}",
        "algo.agg=token-mean",
        # TRL's per_device_train_batch_size=128: the 128 completions in one forward/backward
        f"actor.fsdp.micro_batch_size={PROMPTS_PER_STEP * SAMPLES}",
        "actor.fsdp.use_remove_padding=true",  # packed rows (exact; backends/packing.py)
        # At random init every reward is 0, so every advantage is 0 and the recipe's default skip of
        # zero-advantage rows would skip the whole update: off unless asked for, so that both sides
        # run the same forward / backward.
        f"algo.skip_zero_advantage={str(skip_zero_advantage).lower()}",
        *PRECISION_OVERRIDES[precision],
        *extra,
    ]


def child_ours(recipe_argv: list[str], out: Path) -> None:
    import importlib.util

    import torch

    torch.set_num_threads(1)  # OMP_NUM_THREADS=1 is also set in our environment by the parent
    calib_before = calibrate()
    spec = importlib.util.spec_from_file_location("grpo", REPO / "experiments" / "grpo.py")
    recipe = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = recipe  # attrs resolves the config classes' annotations through sys.modules
    spec.loader.exec_module(recipe)
    # process CPU time at each RL step's metrics log call: per-step CPU cost for steps 2..N (the recipe's
    # step_time_s is wall time; CPU time is less disturbed by other jobs)
    cpu_marks: list[float] = []

    from backends.metrics_log import MetricsLog

    logged = MetricsLog.log

    def cpu_marked_log(self, step, stats, *a, **kw):
        if step >= 1 and "step_time_s" in stats:
            cpu_marks.append(time.process_time())
        return logged(self, step, stats, *a, **kw)

    MetricsLog.log = cpu_marked_log
    t0 = time.perf_counter()
    summary = recipe.main(recipe_argv)
    wall = time.perf_counter() - t0
    calib_after = calibrate()
    rows = [json.loads(line) for line in open(Path(summary["run_dir"]) / "metrics.jsonl")]
    rows = [r for r in rows if r.get("step", 0) > 0 and "step_time_s" in r]
    out.write_text(
        json.dumps(
            {
                "side": "ours",
                "threads": torch.get_num_threads(),
                "calib_ms_before": calib_before,
                "calib_ms_after": calib_after,
                "step_ms": [r["step_time_s"] * 1e3 for r in rows],
                "rollout_ms": [r["rollout_time_s"] * 1e3 for r in rows],
                "cycle_cpu_ms": [(b - a) * 1e3 for a, b in zip(cpu_marks, cpu_marks[1:])],
                "completion_length": [r.get("response_length") for r in rows],
                "reward": [r.get("reward_mean") for r in rows],
                "recipe_wall_s": wall,
                "run_dir": summary["run_dir"],
            },
            indent=1,
        )
    )


# --------------------------------------------------------------------------------------------------
# The parent: run, collect, print.


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        TRANSFORMERS_VERBOSITY="error",
        PYTHONUNBUFFERED="1",
    )
    env.pop("WORLD_SIZE", None), env.pop("RANK", None), env.pop("LOCAL_RANK", None)
    return env


def run_child(cmd: list[str], log: Path, out: Path) -> dict:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=child_env(), stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0 or not out.is_file():
        lines = log.read_text(errors="replace").splitlines()
        error = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "no output")
        tail = "\n".join(lines[-15:])
        print(f"    FAILED (rc {proc.returncode}), see {log}:\n{tail}", flush=True)
        return {"failed": error.strip()}
    res = json.loads(out.read_text())
    res["process_wall_s"] = time.perf_counter() - t0
    return res


def summarize(runs: list[dict], skip: int) -> dict:
    steps = [t for r in runs for t in r["step_ms"][skip:]]
    rollouts = [t for r in runs for t in r["rollout_ms"][skip:]]
    # robust to one spike
    calib = statistics.median(c for r in runs for c in (r["calib_ms_before"], r["calib_ms_after"]))
    lengths = [x for r in runs for x in r["completion_length"][skip:] if x is not None]
    cpu = [t for r in runs for t in r.get("cycle_cpu_ms", [])]  # already steps 2..N
    step = statistics.median(steps)
    return {
        "cpu_ms": statistics.median(cpu) if cpu else float("nan"),
        "step_ms": step,
        "step_ms_min": min(steps),
        "step_ms_max": max(steps),
        "rollout_ms": statistics.median(rollouts),
        "rollout_share": statistics.median(rollouts) / step,
        "calib_ms": calib,
        "normalised_step": step / calib,
        "completion_length": statistics.mean(lengths) if lengths else float("nan"),
        "n_steps": len(steps),
        "threads": sorted({r.get("threads") for r in runs}),
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="A,B", help="comma-separated: A, B")
    ap.add_argument("--steps", type=int, default=10, help="GRPO steps per run (medians over steps 2..N)")
    ap.add_argument("--rounds", type=int, default=1, help="runs per side and config; order alternates")
    ap.add_argument("--beta", type=float, default=0.0, help="KL coefficient (TRL beta, our algo.kl_loss_coef)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", default=str(REPO / "runs" / "bench_grpo_vs_trl"))
    ap.add_argument(
        "--trl-python",
        default=os.environ.get(TRL_PYTHON_ENV),
        help=f"the python of the TRL venv (default: ${TRL_PYTHON_ENV}); needed unless --sides ours",
    )
    ap.add_argument("--sides", default="ours,trl", help="comma-separated: ours, trl")
    ap.add_argument("--ours-override", action="append", default=[], help="extra key=value for our recipe")
    ap.add_argument("--target", type=float, default=0.5, help="target ours/TRL ratio")
    ap.add_argument(
        "--skip-zero-advantage",
        action="store_true",
        help="keep our recipe's skip of zero-advantage rows (at random init: the whole update)",
    )
    ap.add_argument(
        "--precisions",
        default="fp32,bf16",
        help="comma-separated: fp32, bf16 (both sides run each; TRL's bf16 is bf16=True)",
    )
    args = ap.parse_args(argv)
    split = lambda text: [x.strip() for x in text.split(",") if x.strip()]
    args.configs, args.sides, args.precisions = split(args.configs), split(args.sides), split(args.precisions)
    for c in args.configs:
        if c not in CONFIGS:
            raise SystemExit(f"unknown config {c!r}; known: {', '.join(CONFIGS)}")
    for prec in args.precisions:
        if prec not in PRECISION_OVERRIDES:
            raise SystemExit(f"unknown precision {prec!r}; known: {', '.join(PRECISION_OVERRIDES)}")
    for side in args.sides:
        if side not in ("ours", "trl"):
            raise SystemExit(f"unknown side {side!r}; known: ours, trl")
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (step 1 is excluded from the medians)")
    if "trl" in args.sides:
        if not args.trl_python:
            raise SystemExit(
                f"the TRL side needs the python of a TRL venv: pass --trl-python PATH or set "
                f"{TRL_PYTHON_ENV} (BUILD.md, 'Benchmarks', shows how to build it), or run --sides ours"
            )
        if not os.access(args.trl_python, os.X_OK):
            raise SystemExit(f"--trl-python {args.trl_python!r} is not an executable file")
    return args


def case_name(config: str, precision: str) -> str:
    """A case is one config in one precision, e.g. ``B/bf16``."""
    return f"{config}/{precision}"


def side_command(
    side: str,
    args: argparse.Namespace,
    c: str,
    prec: str,
    model_dir: Path,
    prompts: Path,
    work: Path,
    tag: str,
    out: Path,
) -> list[str]:
    """The child process of one side for one case."""
    if side == "ours":
        recipe = ours_argv(
            model_dir,
            c,
            args.steps,
            args.beta,
            args.seed,
            work / "runs",
            tag,
            args.ours_override,
            prompts,
            precision=prec,
            skip_zero_advantage=args.skip_zero_advantage,
        )
        return [sys.executable, str(Path(__file__).resolve()), "--child-ours", str(out), *recipe]
    return [
        args.trl_python,
        str(REPO / "benchmarks" / "trl_grpo_step.py"),
        "--model-dir",
        str(model_dir),
        "--prompts",
        str(prompts),
        "--steps",
        str(args.steps),
        "--prompts-per-step",
        str(PROMPTS_PER_STEP),
        "--num-generations",
        str(SAMPLES),
        "--max-completion-length",
        str(CONFIGS[c]["max_new_tokens"]),
        "--beta",
        str(args.beta),
        "--lr",
        "1e-3",
        "--seed",
        str(args.seed),
        "--out",
        str(out),
        *(["--bf16"] if prec == "bf16" else []),
    ]


def run_cases(args: argparse.Namespace, work: Path, model_dirs: dict[str, Path], prompts: Path):
    """Every round x case x side, one child process each; returns (results, failures) keyed by case."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    cases = [(c, prec) for c in args.configs for prec in args.precisions]
    results: dict[str, dict[str, list[dict]]] = {case_name(*k): {s: [] for s in args.sides} for k in cases}
    failures: dict[str, dict[str, str]] = {}
    for r in range(args.rounds):
        for c, prec in cases:
            case = case_name(c, prec)
            for side in args.sides if r % 2 == 0 else args.sides[::-1]:
                tag = f"{side}_{c}_{prec}_r{r}_{stamp}"
                out, log = work / f"{tag}.json", work / f"{tag}.log"
                cmd = side_command(side, args, c, prec, model_dirs[c], prompts, work, tag, out)
                print(f"[round {r}] {case}: {side} ...", flush=True)
                res = run_child(cmd, log, out)
                if "failed" in res:
                    failures.setdefault(case, {})[side] = res["failed"]
                    continue
                med = statistics.median(res["step_ms"][1:])
                cpu = statistics.median(res["cycle_cpu_ms"]) if res.get("cycle_cpu_ms") else float("nan")
                print(
                    f"    median step {med:.1f} ms wall, {cpu:.1f} ms CPU (steps 2..{len(res['step_ms'])}), calib "
                    f"{res['calib_ms_before']:.2f}/{res['calib_ms_after']:.2f} ms, "
                    f"process {res['process_wall_s']:.0f} s",
                    flush=True,
                )
                results[case][side].append(res)
    return results, failures


def print_table(args: argparse.Namespace, summary: dict, model_dirs: dict[str, Path]) -> dict:
    """The per-case table, then each side at its fastest precision; adds the ratios to ``summary``."""
    print()
    print(
        f"GRPO step, {PROMPTS_PER_STEP} prompts x {SAMPLES} samples, 1 torch thread, beta={args.beta}, "
        f"median of steps 2..{args.steps} x {args.rounds} round(s)"
    )
    head = (
        f"{'case':<9}{'params':>10}{'new tok':>8}{'ours ms':>10}{'TRL ms':>10}{'ratio':>8}{'norm. ratio':>12}"
        f"{'CPU ratio':>10}"
        f"{'ours rollout':>13}{'TRL rollout':>12}{'ours len':>9}{'TRL len':>8}{'calib ours/TRL ms':>19}"
    )
    print(head)
    print("-" * len(head))
    fmt = lambda d, k, f: format(d[k], f) if d else "-"
    for c in args.configs:
        for prec in args.precisions:
            case = case_name(c, prec)
            s = summary[case]
            o, t = s.get("ours"), s.get("trl")
            ratio = o["step_ms"] / t["step_ms"] if o and t else float("nan")
            norm = o["normalised_step"] / t["normalised_step"] if o and t else float("nan")
            cpu_ratio = o["cpu_ms"] / t["cpu_ms"] if o and t else float("nan")
            s["ratio"], s["normalised_ratio"], s["cpu_ratio"] = ratio, norm, cpu_ratio
            print(
                f"{case:<9}{param_count(model_dirs[c]):>10,}{CONFIGS[c]['max_new_tokens']:>8}"
                f"{fmt(o, 'step_ms', '.1f'):>10}{fmt(t, 'step_ms', '.1f'):>10}"
                f"{ratio:>8.3f}{norm:>12.3f}{cpu_ratio:>10.3f}"
                f"{fmt(o, 'rollout_share', '.0%'):>13}{fmt(t, 'rollout_share', '.0%'):>12}"
                f"{fmt(o, 'completion_length', '.1f'):>9}{fmt(t, 'completion_length', '.1f'):>8}"
                f"{(fmt(o, 'calib_ms', '.2f') + '/' + fmt(t, 'calib_ms', '.2f')):>19}"
            )
    # each side at its fastest precision (what a user of either would pick on this CPU)
    fastest = {}
    for c in args.configs:
        best = {
            side: min(
                (
                    (summary[case_name(c, p)][side]["step_ms"], p)
                    for p in args.precisions
                    if side in summary[case_name(c, p)]
                ),
                default=None,
            )
            for side in args.sides
        }
        if all(best.get(side) for side in ("ours", "trl")):
            (o_ms, o_p), (t_ms, t_p) = best["ours"], best["trl"]
            fastest[c] = {"ours": [o_ms, o_p], "trl": [t_ms, t_p], "ratio": o_ms / t_ms}
            print(
                f"config {c}, each side at its fastest precision: ours {o_ms:.1f} ms ({o_p}) "
                f"/ TRL {t_ms:.1f} ms ({t_p}) "
                f"= {o_ms / t_ms:.3f} (target <= {args.target})"
            )
    return fastest


def print_gemm_floors(args: argparse.Namespace, summary: dict, model_dirs: dict[str, Path], prompts: Path) -> None:
    """For each case ours ran: the GEMM floor of one step at our measured lengths, against TRL's step."""
    import torch

    torch.set_num_threads(1)
    from backends.models import load_tokenizer

    prompts_list = json.loads(prompts.read_text())
    for c in args.configs:
        for prec in args.precisions:
            case = case_name(c, prec)
            o, trl = summary[case].get("ours"), summary[case].get("trl")
            if not o:
                continue
            tok = load_tokenizer(model_dirs[c])
            prompt_tokens = statistics.mean(len(tok.encode(p["prompt"])) for p in prompts_list)
            dtype = torch.bfloat16 if prec == "bf16" else torch.float32
            roll, upd = gemm_floor_ms(c, prompt_tokens, o["completion_length"], dtype=dtype)
            vs_trl = f" = {(roll + upd) / trl['step_ms']:.2f}x TRL's step" if trl else ""
            summary[case]["gemm_floor_ms"] = {"rollout": roll, "update": upd}
            print(
                f"{case}: {prec} GEMM floor of one step (linear layers only, no padding, 1 thread): rollout "
                f"{roll:.0f} ms + update {upd:.0f} ms = {roll + upd:.0f} ms{vs_trl}; ours spends {o['step_ms']:.0f} ms"
            )


def main(argv: list[str]) -> None:
    if argv[:1] == ["--child-ours"]:
        return child_ours(argv[2:], Path(argv[1]))
    args = parse_args(argv)
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    model_dirs = {c: write_model(c, work / f"config_{c}") for c in args.configs}
    prompts = write_prompts(work / f"prompts_{args.steps}.json", args.steps, args.seed)
    results, failures = run_cases(args, work, model_dirs, prompts)
    summary = {case: {s: summarize(runs[s], skip=1) for s in args.sides if runs[s]} for case, runs in results.items()}
    fastest = print_table(args, summary, model_dirs)
    print_gemm_floors(args, summary, model_dirs, prompts)
    for case, by_side in failures.items():
        for side, error in by_side.items():
            print(f"{case}: {side} FAILED: {error}")
    print(
        f"\nratio = ours / TRL wall ms per step, same precision on both sides (target <= {args.target}); norm. ratio "
        "divides each side by its own 512x512 matmul calibration first; CPU ratio compares process CPU ms per step "
        "(step end to step end); rollout = share of the step spent generating; len = mean completion tokens."
    )
    (work / "results.json").write_text(
        json.dumps(
            {"args": vars(args), "summary": summary, "fastest": fastest, "failures": failures, "runs": results},
            indent=1,
        )
    )
    print(f"raw results: {work / 'results.json'}")


if __name__ == "__main__":
    main(sys.argv[1:])
