"""The GRPO recipe at a real model's size on one GPU, and the memory planner's prediction beside what it measured.

Run (on a machine with CUDA; no download):

    .venv/bin/python benchmarks/gpu_real_scale.py                       # 3 steps, 64 prompts x 5, 512 new tokens
    .venv/bin/python benchmarks/gpu_real_scale.py --steps 5 --max-new-tokens 1024

A random-init checkpoint with Qwen2.5-0.5B-Instruct's public shape (hidden 896, 24 layers, GQA 14/2, vocabulary
151,936, tied embeddings) is written in bf16 safetensors, as a real checkpoint is, with the char tokenizer (its
ids are a small part of the vocabulary; the logits still span all of it). The recipe then runs from that
directory with the one-GPU preset stacked on the GSM8K one (`preset=gsm8k/grpo_qwen2_5_0_5b
preset=gpu/qwen2_5_0_5b_1gpu`: bf16 FSDP, gradient checkpointing, packed sequences, micro-batches of 16 rows,
the KL reference resident) on the synthetic arithmetic prompts, with the native engine in bf16 (vLLM's CUDA
wheel is not always at hand). A random model almost never samples EOS, so every response reaches
``--max-new-tokens``: each step is the full-length worst case the planner assumes.

It prints the medians of steps 2..N (step, rollout and update time, tokens/s) and each step's peak GPU memory
(``torch.cuda.max_memory_allocated``) beside the planner's peak for the update and the log-prob phases of the
same configuration (the rollout phase is not compared: the planner models vLLM's share of the device, not the
native engine's cache).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

MODEL = "Qwen2.5-0.5B-Instruct"
PRESET = "gpu/qwen2_5_0_5b_1gpu"


def write_checkpoint(out: Path) -> Path:
    """A random ``MODEL``-shaped Qwen2 in bf16 safetensors with the char tokenizer (and its chat template)."""
    import torch
    from planner_verdicts import MODELS
    from transformers import AutoModelForCausalLM, Qwen2Config

    from backends.models import build_char_tokenizer

    tokenizer = build_char_tokenizer(model_max_length=4096)
    fields = {k: v for k, v in MODELS[MODEL].items() if k not in ("architectures", "model_type", "torch_dtype")}
    config = Qwen2Config(
        **fields,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def planner_phases(overrides: list[str], prompt_len: int) -> dict[str, float]:
    """The planner's per-phase peaks (GiB) for the preset with ``overrides``, at the prompts' real length."""
    import attrs
    from planner_verdicts import GIB, judge, preset_case, write_models

    with tempfile.TemporaryDirectory() as tmp:
        shapes = write_models(Path(tmp))
    case = attrs.evolve(preset_case(PRESET, MODEL, 1, *overrides), prompt_len=prompt_len)
    verdict = judge(case, shapes[MODEL])
    return {phase: value / GIB for phase, value in verdict["phases"].items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=64, help="prompts per step (5 samples each)")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--keep", default="", help="keep the run under this dir (default: a temporary one)")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_real_scale.py needs CUDA: no GPU is visible to torch here")
    from experiments.tasks.arithmetic import write_dataset

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="rlfunc-real-"))
    data = write_dataset(root / "data", sft_examples=64)
    model = write_checkpoint(root / "model")
    prompt_len = 32
    overrides = [
        f"prompts_per_step={args.prompts}",
        f"algo.ppo_mini_batch_size={max(args.prompts // 2, 1)}",  # the preset's two optimizer steps per RL step
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"data.max_prompt_length={prompt_len}",
    ]
    cmd = [
        str(Path(sys.executable).with_name("torchrun")),
        "--standalone",
        "--nproc_per_node",
        "1",
        str(ROOT / "experiments" / "grpo.py"),
        "preset=gsm8k/grpo_qwen2_5_0_5b",
        f"preset={PRESET}",
        f"model.path={model}",
        f"run_root={root / 'runs'}",
        "name=real_scale",
        f"steps={args.steps}",
        f"data.train_files={data / 'train.jsonl'}",
        f"data.val_files={data / 'val.jsonl'}",
        "reward.fn=arithmetic",
        "eval.max_prompts=64",
        "eval.n=1",
        "eval.every=0",
        "rollout.engine=native",
        "rollout.dtype=bfloat16",
        "logger=console,jsonl",
        *overrides,
    ]
    print("$ " + " ".join(cmd), flush=True)
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": pythonpath}, cwd=ROOT)
    if out.returncode != 0:
        sys.exit(f"the recipe failed with exit code {out.returncode}")
    (run_dir,) = sorted((root / "runs").glob("real_scale-*"))[-1:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step_time_s" in r]
    later = steps[1:] or steps

    def median(key: str) -> float:
        return statistics.median(r[key] for r in later if key in r) if any(key in r for r in later) else float("nan")

    print(
        f"\n{MODEL} shape, random init, 1 x {torch.cuda.get_device_name(0)} (torch {torch.__version__}), "
        f"{args.prompts} prompts x 5 samples, {args.max_new_tokens} new tokens, {args.steps} steps"
    )
    print(
        f"step {median('step_time_s'):.2f} s | rollout {median('rollout_time_s'):.2f} s | "
        f"update {median('update_time_s'):.2f} s | {median('tokens_per_s'):.0f} tokens/s | "
        f"mean response {median('response_length'):.0f} tokens"
    )
    print("peak GPU memory per step (GiB): " + ", ".join(f"{r.get('gpu_memory_gib', float('nan')):.1f}" for r in steps))
    plan = planner_phases(overrides, prompt_len)
    print(
        "planner (GiB): "
        + ", ".join(f"{phase} {value:.1f}" for phase, value in plan.items())
        + " (rollout: vLLM's share, not comparable)"
    )


if __name__ == "__main__":
    main()
