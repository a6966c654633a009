"""Host memory per rank while the FSDP engine loads a model: every rank loading the whole checkpoint
(``FSDPConfig(load_on_every_rank=True)``) vs the sharded loader (meta-device build, the mesh's first rank
reads the safetensors files and scatters each rank's shards: backends/training/sharded_loading.py).

Run: ``.venv/bin/python benchmarks/bench_loading_memory.py [--nproc 2] [--hidden 1536 --layers 16
--intermediate 4096] [--max-shard-size 400MB] [--checkpoint-dtype float32|bfloat16] [--role reference|actor]``.

A random Qwen2 (default: hidden 1536, 16 layers, intermediate 4096, the char tokenizer: about 1.6 GB in
fp32) is written once to a temporary dir (split into several safetensors files, with an index). Then
each path runs in fresh processes, one after the other: ``torchrun --standalone --nproc_per_node N``
of this file's ``--worker`` mode, which builds the role in fp32 on the CPU and reports, per rank:

- ``torch``: peak RSS right after ``import torch`` (``ru_maxrss``), the floor of any process;
- ``ready``: peak RSS after importing the engine and joining the process group, before loading;
- ``peak``: peak RSS once the role is built, and ``peak - ready``, what loading cost;
- ``shard``: the bytes of this rank's parameter shards; the model's size is printed once.

The goal: a rank other than the mesh's first holds at most its shard plus a bounded buffer (one padded
chunk of the largest tensor) above ``ready``.

The default role is the reference (``param_dtype=float32``): forward-only, so its peak is the loading
alone. The actor loads the same way, but ``build_optimizer`` also allocates AdamW's two moments (and
zero gradients) up front, which adds about three times the shard to both paths' peaks.
"""

from __future__ import annotations

import resource

import torch

RSS_AFTER_TORCH_KB = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

import argparse  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _local_bytes(module: torch.nn.Module) -> tuple[int, int]:
    """(bytes of this rank's parameter shards, bytes of the full parameters); tied parameters once."""
    local = full = 0
    for p in module.parameters():
        shard = p.to_local() if hasattr(p, "to_local") else p
        local += shard.numel() * shard.element_size()
        full += p.numel() * p.element_size()
    return local, full


def worker(mode: str, model_dir: str, role: str, out_dir: str) -> None:
    sys.path.insert(0, str(ROOT))
    from backends.distributed.setup import init_distributed, shutdown
    from backends.training.fsdp import FSDPConfig, build_actor, build_reference

    for code in ("llama", "qwen2"):  # importing the model code is not loading: count it in "ready"
        importlib.import_module(f"transformers.models.{code}.modeling_{code}")

    torch.set_num_threads(1)
    env = init_distributed(device="cpu")
    ready = _peak_rss_bytes()
    cfg = FSDPConfig(param_dtype="float32", load_on_every_rank=mode == "every-rank")
    start = time.perf_counter()
    state = build_actor(model_dir, env, fsdp_cfg=cfg) if role == "actor" else build_reference(model_dir, env, cfg)
    seconds = time.perf_counter() - start
    peak = _peak_rss_bytes()
    shard, full = _local_bytes(state.module)
    result = {
        "rank": env.rank,
        "torch": RSS_AFTER_TORCH_KB * 1024,
        "ready": ready,
        "peak": peak,
        "shard": shard,
        "model": full,
        "seconds": seconds,
    }
    (Path(out_dir) / f"{mode}-rank{env.rank}.json").write_text(json.dumps(result))
    shutdown(env)


def write_model(out: Path, args: argparse.Namespace) -> Path:
    sys.path.insert(0, str(ROOT))
    from backends.models import TinyModelConfig, build_char_tokenizer, build_tiny_model

    config = TinyModelConfig(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.hidden // 128,
        num_kv_heads=2,
        intermediate_size=args.intermediate,
        tie_word_embeddings=True,
    )
    tokenizer = build_char_tokenizer(model_max_length=config.max_position_embeddings)
    model = build_tiny_model(config, tokenizer).to(getattr(torch, args.checkpoint_dtype))
    model.save_pretrained(out, safe_serialization=True, max_shard_size=args.max_shard_size)
    tokenizer.save_pretrained(out)
    del model
    return out


def run_mode(mode: str, model_dir: Path, args: argparse.Namespace, out_dir: Path) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        str(Path(__file__).resolve()),
        "--worker",
        mode,
        "--model-dir",
        str(model_dir),
        "--role",
        args.role,
        "--out",
        str(out_dir),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    return [json.loads((out_dir / f"{mode}-rank{r}.json").read_text()) for r in range(args.nproc)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=("every-rank", "sharded"), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help="an existing HF dir to load instead of writing a random model")
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--role", choices=("reference", "actor"), default="reference")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--max-shard-size", default="400MB", help="safetensors file size of the written model")
    parser.add_argument(
        "--checkpoint-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of the written checkpoint (the actor loads it as fp32 either way)",
    )
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.model_dir, args.role, args.out)
        return
    with tempfile.TemporaryDirectory(prefix="bench_loading_") as tmp:
        model_dir = Path(args.model_dir) if args.model_dir else write_model(Path(tmp) / "model", args)
        files = sorted(model_dir.glob("*.safetensors"))
        print(
            f"model: {model_dir} ({len(files)} safetensors files, {sum(f.stat().st_size for f in files) / MIB:.0f} MiB)"
        )
        results = {mode: run_mode(mode, model_dir, args, Path(tmp)) for mode in ("every-rank", "sharded")}
    model = results["sharded"][0]["model"]
    print(
        f"\n{args.role} built in fp32 from a {args.checkpoint_dtype} checkpoint, {args.nproc} ranks; "
        f"model parameters {model / MIB:.0f} MiB; RSS in MiB"
    )
    print(
        f"{'path':<11} {'rank':>4} {'torch':>7} {'ready':>7} {'peak':>7} {'peak-ready':>10} {'shard':>7} {'load s':>7}"
    )
    for mode, ranks in results.items():
        for r in ranks:
            print(
                f"{mode:<11} {r['rank']:>4} {r['torch'] / MIB:>7.0f} {r['ready'] / MIB:>7.0f} {r['peak'] / MIB:>7.0f} "
                f"{(r['peak'] - r['ready']) / MIB:>10.0f} {r['shard'] / MIB:>7.0f} {r['seconds']:>7.1f}"
            )


if __name__ == "__main__":
    main()
