"""The memory planner's per-GPU verdicts: the GRPO recipe's GPU presets, and configurations verl publishes as
working or out of memory.

Run: ``.venv/bin/python benchmarks/planner_verdicts.py`` (no GPU, no download: the models' public
``config.json`` values are written into temporary dirs, and the planner reads nothing else).

Every configuration is one colocated RL step (``backends.training.memory_planner.colocated_step``): the
policy update with vLLM asleep, the log-prob passes (one forward micro-batch beside the resident state),
and the rollout (the resident trainer state plus vLLM's share of the device). Sequences are taken at
their full length (longest prompt + longest response), the worst case a step can draw; under a token
budget every position is counted as reaching the lm_head. The verdict compares the step's peak with the
device's memory as PyTorch reports it: "fits" within 90% of it (the planner's headroom for what it
does not count: allocator fragmentation, the CUDA context, vLLM's CUDA graphs, kernel temporaries),
"tight" within 100%, "OOM" beyond.

verl's configurations are judged as this repository's engine would run them (FSDP, fp32 master weights,
AdamW, bf16 compute), with verl's own choices where they change memory: log-probs of every position of a
packed row, entropy in the update where that verl version computed it, parameter offload where set.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import attrs

from backends.config import apply_overrides
from backends.training.memory_planner import (
    ModelShape,
    Parallelism,
    Workload,
    chunk_rows_for,
    colocated_step,
    estimate,
    largest_micro_batch,
)

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
H100_GIB = 79.1  # what PyTorch reports for an 80 GB H100 / H800 / A100 (79.1-79.2 GiB)
A10_GIB = 21.99  # an A10 as PyTorch reports it (verl issue 1141's own error message)

_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
}
_QWEN2_7B = dict(
    _QWEN2,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    tie_word_embeddings=False,
    max_position_embeddings=32768,
)
# The public config.json values (only what memory depends on, plus what transformers needs to load them).
MODELS = {
    "Qwen2.5-0.5B-Instruct": dict(
        _QWEN2,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    "Qwen2.5-7B-Instruct": _QWEN2_7B,
    "Qwen2-7B-Instruct": _QWEN2_7B,  # the same shape as Qwen2.5-7B-Instruct
    # Qwen2.5-14B-Instruct; Qwen2.5-Coder-14B-Instruct and DeepSeek-R1-Distill-Qwen-14B share its shape
    "Qwen2.5-14B-Instruct": dict(
        _QWEN2,
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
    ),
    "Qwen2-72B-Instruct": dict(
        _QWEN2,
        hidden_size=8192,
        intermediate_size=29568,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=152064,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
    ),
    "Llama-3.2-3B": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    },
}


@attrs.frozen
class Case:
    """One configuration: its model, devices, micro-batching and rollout engine."""

    label: str
    model: str
    gpus: int  #: data-parallel ranks sharding the trainer's state
    prompt_len: int
    response_len: int
    device_gib: float = H100_GIB
    rows: int | None = None  #: rows per update micro-batch (None: the token budget)
    tokens: int | None = None  #: tokens per update micro-batch and GPU
    packed: bool = True
    checkpointing: bool = True
    offload: bool = False  #: the actor's parameters, gradients and optimizer in host memory
    reference: str = "resident"  #: "resident", "offload" or "none"
    logprob_rows: int | None = None  #: rows per reference log-prob forward (None: the token budget)
    policy_logprob_rows: int | None = None  #: rows per policy log-prob forward (None: the token budget)
    all_positions: bool = False  #: log-probs of every position, prompt included (verl's packed path)
    with_entropy: bool = True  #: the update computes the entropy (a softmax kept for backward)
    critic: bool = False  #: PPO: a value model of the same shape trains on the same devices
    logits_chunk_mib: float = 256.0  #: FSDPConfig.logits_chunk_mib (0: the log-probs of a micro-batch at once)
    vllm_util: float | None = None
    vllm_tp: int = 1
    concurrent: int = 256  #: sequences one engine decodes together (max_num_seqs)
    seqs_per_engine: int = 0  #: sequences one engine samples per step
    source: str = ""
    reported: str = ""  #: what the source reports: "works" or "OOM"


def write_models(root: Path) -> dict[str, ModelShape]:
    shapes = {}
    for name, config in MODELS.items():
        path = root / name / "config.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(config, indent=1))
        shapes[name] = ModelShape.from_pretrained(path)
    return shapes


def _update_work(case: Case, role: str = "actor", chunk_rows: int | None = None) -> Workload:
    seq = case.prompt_len + case.response_len
    common = dict(
        role=role,
        compute_dtype="bfloat16",
        gradient_checkpointing=case.checkpointing,
        with_entropy=case.with_entropy and role == "actor",
        offload=case.offload,
        logits_chunk_rows=chunk_rows,
    )
    if case.tokens is not None:  # a token budget: one-token rows, every position reaching the head
        return Workload(micro_batch_rows=case.tokens, seq_len=1, response_len=1, padded=False, **common)
    keep = seq if case.all_positions else case.response_len
    return Workload(micro_batch_rows=case.rows, seq_len=seq, response_len=keep, padded=not case.packed, **common)


def _forward_work(case: Case, rows: int | None, chunk_rows: int | None = None) -> Workload:
    """A log-prob forward of ``rows`` full-length rows, or of the token budget when ``rows`` is None."""
    seq = case.prompt_len + case.response_len
    if rows is None:
        return Workload(
            role="reference",
            compute_dtype="bfloat16",
            micro_batch_rows=case.tokens,
            seq_len=1,
            response_len=1,
            padded=False,
            logits_chunk_rows=chunk_rows,
        )
    keep = seq if case.all_positions else case.response_len
    return Workload(
        role="reference",
        compute_dtype="bfloat16",
        micro_batch_rows=rows,
        seq_len=seq,
        response_len=keep,
        padded=not case.packed,
        logits_chunk_rows=chunk_rows,
    )


def _reference(case: Case, shape: ModelShape, parallel: Parallelism) -> tuple[int, int]:
    """``(bytes the reference keeps on the device, bytes it adds during its own forward)``: an offloaded
    reference gathers its weights only while it computes."""
    if case.reference == "none":
        return 0, 0
    offload = case.reference == "offload"
    weights = estimate(
        shape, parallel, Workload(role="reference", compute_dtype="bfloat16", micro_batch_rows=0, offload=offload)
    ).parameters
    return (0, weights) if offload else (weights, 0)


def judge(case: Case, shape: ModelShape) -> dict:
    """The planner's numbers for one case (bytes), its phases and verdict, and what would fit."""
    parallel, device = Parallelism(dp=case.gpus), int(case.device_gib * GIB)
    chunk_rows = chunk_rows_for(case.logits_chunk_mib, shape.vocab_size)
    work = _update_work(case, chunk_rows=chunk_rows)
    est = estimate(shape, parallel, work)
    ref, ref_gathered = _reference(case, shape, parallel)
    ref_logits = 0
    if case.reference != "none":
        ref_logits = estimate(shape, parallel, _forward_work(case, case.logprob_rows, chunk_rows)).logits
    policy_logits = estimate(shape, parallel, _forward_work(case, case.policy_logprob_rows, chunk_rows)).logits
    forward = max(ref_logits + ref_gathered, policy_logits)
    other, critic_update = ref, 0
    if case.critic:  # the critic keeps its weights and AdamW state beside the actor, and trains in turn
        critic = estimate(shape, parallel, _update_work(case, "critic", chunk_rows))
        other += critic.parameters + critic.optimizer
        critic_update = critic.total + est.parameters + est.optimizer + ref
    step = colocated_step(
        shape,
        parallel,
        work,
        device_bytes=device,
        vllm_utilization=case.vllm_util,
        vllm_tp=case.vllm_tp,
        resident_bytes=other,
        forward_bytes=forward,
    )
    phases = {"update": max(step.update, critic_update), "log-probs": step.logprob, "rollout": step.rollout}
    phase, peak = max(phases.items(), key=lambda kv: kv[1])
    verdict = "fits" if peak <= 0.9 * device else "tight" if peak <= device else "OOM"
    budget = 0.9 * device - other  # the update phase, within the planner's headroom
    rows_work = _update_work(attrs.evolve(case, tokens=None, rows=1), chunk_rows=chunk_rows)
    tokens_work = _update_work(attrs.evolve(case, tokens=1), chunk_rows=chunk_rows)
    # log-prob rows: the forward's logits grow linearly with rows, beside the resident state
    per_row = estimate(shape, parallel, _forward_work(case, 1, chunk_rows)).logits
    lp_budget = 0.9 * device - (est.parameters + est.optimizer + other + ref_gathered)
    needed = min(case.concurrent, case.seqs_per_engine) if case.seqs_per_engine else case.concurrent
    return {
        "case": case,
        "est": est,
        "ref": ref + ref_gathered,
        "forward": forward,
        "step": step,
        "phases": phases,
        "phase": phase,
        "peak": peak,
        "verdict": verdict,
        "kv_needed": needed * (case.prompt_len + case.response_len),
        "max_rows": largest_micro_batch(shape, parallel, rows_work, budget),
        "max_tokens": largest_micro_batch(shape, parallel, tokens_work, budget),
        "max_logprob_rows": int(lp_budget // per_row),
    }


def preset_case(preset: str, model: str, gpus: int, *overrides: str) -> Case:
    """A GPU preset stacked on the GSM8K one (then ``overrides``), read from the resolved recipe config."""
    from experiments import grpo

    # the planner reads the rollout.vllm settings but runs no engine: this also works where vLLM is not installed
    cfg = apply_overrides(
        grpo.Config(),
        ["preset=gsm8k/grpo_qwen2_5_0_5b", f"preset={preset}", "rollout.engine=native", *overrides],
        presets_dir=ROOT / "experiments" / "presets",
    )
    fsdp, vllm = cfg.actor.fsdp, cfg.rollout.vllm
    tokens = fsdp.max_tokens_per_micro_batch
    return Case(
        label=" ".join([preset, *overrides]),
        model=model,
        gpus=gpus,
        prompt_len=cfg.data.max_prompt_length,
        response_len=cfg.rollout.max_new_tokens,
        rows=None if tokens else fsdp.micro_batch_size,
        tokens=tokens,
        packed=fsdp.use_remove_padding,
        checkpointing=fsdp.gradient_checkpointing,
        offload=fsdp.offload,
        reference="resident" if cfg.algo.kl_loss_coef > 0 else "none",
        logprob_rows=cfg.reference.log_prob_micro_batch_size,
        policy_logprob_rows=None if tokens else fsdp.micro_batch_size,  # the policy's pass micro-batches as its update
        logits_chunk_mib=fsdp.logits_chunk_mib,
        vllm_util=vllm.gpu_memory_utilization,
        vllm_tp=vllm.tensor_parallel_size,
        concurrent=vllm.max_num_seqs,
        seqs_per_engine=cfg.prompts_per_step * cfg.rollout.n // gpus * vllm.tensor_parallel_size,
    )


PRESETS = [
    ("gpu/qwen2_5_0_5b_1gpu", "Qwen2.5-0.5B-Instruct", 1),
    ("gpu/qwen2_5_0_5b_8gpu", "Qwen2.5-0.5B-Instruct", 8),
    ("gpu/qwen2_5_7b_8gpu", "Qwen2.5-7B-Instruct", 8),
    # the recipe's default share: 90% of what is free when vLLM is built (after the weights and AdamW moments)
    ("gpu/qwen2_5_7b_8gpu", "Qwen2.5-7B-Instruct", 8, "rollout.vllm.gpu_memory_utilization=none"),
]

_VERL = "verl-project/verl"
VERL_CASES = [
    Case(
        "GRPO 7B, 8 x A100-80GB, token budget",
        "Qwen2-7B-Instruct",
        gpus=8,
        prompt_len=512,
        response_len=1024,
        tokens=24000,
        reference="offload",
        all_positions=True,
        vllm_util=0.6,
        vllm_tp=2,
        concurrent=1024,
        seqs_per_engine=1024 * 5 // 8 * 2,
        reported="works",
        source=f"{_VERL} examples/grpo_trainer/run_qwen2-7b_seq_balance.sh @695bdbb; issue 145: works on 8 x A100 80GB",
    ),
    Case(
        "GRPO 7B, 2 x H800, offload",
        "Qwen2-7B-Instruct",
        gpus=2,
        prompt_len=1024,
        response_len=1024,
        rows=16,
        offload=True,
        reference="offload",
        logprob_rows=16,
        policy_logprob_rows=16,
        all_positions=True,
        vllm_util=0.6,
        vllm_tp=2,
        concurrent=1024,
        seqs_per_engine=1024 * 5 // 2 * 2,
        reported="works",
        source=f"{_VERL} examples/tuning/7b/qwen2-7b_grpo_2_h800_fsdp_vllm.sh (docs/perf/device_tuning.rst: MIN)",
    ),
    Case(
        "GRPO 14B, 4 x H800, offload",
        "Qwen2.5-14B-Instruct",
        gpus=4,
        prompt_len=1024,
        response_len=1024,
        rows=16,
        offload=True,
        reference="offload",
        logprob_rows=16,
        policy_logprob_rows=16,
        all_positions=True,
        vllm_util=0.5,
        vllm_tp=4,
        concurrent=1024,
        seqs_per_engine=1024 * 5 // 4 * 4,
        reported="works",
        source=f"{_VERL} examples/tuning/14b/qwen2_14b_grpo_4_h800_fsdp_vllm.sh "
        "(Qwen2.5-Coder-14B-Instruct; docs/perf/device_tuning.rst: MIN)",
    ),
    Case(
        "GRPO 72B, 32 x H800, offload",
        "Qwen2-72B-Instruct",
        gpus=32,
        prompt_len=512,
        response_len=512,
        tokens=24000,
        offload=True,
        reference="offload",
        all_positions=True,
        vllm_util=0.6,
        vllm_tp=16,
        concurrent=1024,
        seqs_per_engine=1024 * 5 // 32 * 16,
        reported="works",
        source=f"{_VERL} examples/tuning/70b/qwen2-70b_grpo_32_h800_fsdp_vllm.sh (docs/perf/device_tuning.rst: MIN)",
    ),
    Case(
        "GRPO 7B, 2 nodes x 1 H100, offload",
        "Qwen2.5-7B-Instruct",
        gpus=2,
        prompt_len=256,
        response_len=256,
        rows=4,
        offload=True,
        reference="offload",
        logprob_rows=16,
        policy_logprob_rows=16,
        all_positions=True,
        with_entropy=False,
        vllm_util=0.4,
        vllm_tp=1,
        concurrent=256,
        seqs_per_engine=32 // 2,
        reported="works",
        source=f"{_VERL} examples/skypilot/verl-grpo.yaml (README: memory-optimized for 2 nodes)",
    ),
    Case(
        "PPO 3B, 4 x A10 (24 GB)",
        "Llama-3.2-3B",
        gpus=4,
        prompt_len=512,
        response_len=256,
        rows=1,
        packed=False,
        reference="none",
        logprob_rows=1,
        policy_logprob_rows=1,
        critic=True,
        device_gib=A10_GIB,
        vllm_util=0.4,
        vllm_tp=1,
        concurrent=1024,
        seqs_per_engine=64 // 4,
        reported="OOM",
        source=f"{_VERL} issue 1141: CUDA OOM right after training starts "
        "(a lower bound: checkpointing on, no reference)",
    ),
]


def _g(n: float) -> str:
    return f"{n / GIB:.1f}"


def preset_table(rows: list[dict]) -> str:
    head = (
        "| preset | model, GPUs | trainer state (params + grads + AdamW) | activations | logits | reference | "
        "log-prob forward | vLLM share (weights) | KV tokens: holds / needs | update / log-probs / rollout | "
        "verdict | largest micro-batch: full-length rows / token budget / log-prob rows |"
    )
    lines = [head, "|" + " --- |" * 12]
    for r in rows:
        c, e, s = r["case"], r["est"], r["step"]
        p = r["phases"]
        lines.append(
            f"| `{c.label}` | {c.model}, {c.gpus} | {_g(e.training_state)} | {_g(e.activations)} | {_g(e.logits)} | "
            f"{_g(r['ref'])} | {_g(r['forward'])} | {_g(s.vllm_share)} ({_g(s.vllm_weights)}) | "
            f"{s.kv_tokens:,} / {r['kv_needed']:,} | {_g(p['update'])} / {_g(p['log-probs'])} / {_g(p['rollout'])} | "
            f"{r['verdict']} ({r['phase']}, {100 * r['peak'] / (c.device_gib * GIB):.0f}%) | "
            f"{r['max_rows']} / {r['max_tokens']:,} / {r['max_logprob_rows']} |"
        )
    return "\n".join(lines)


def verl_table(rows: list[dict]) -> str:
    lines = [
        "| configuration | source | verl reports | planner: update / log-probs / rollout (GiB) | planner | right? |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        c, p = r["case"], r["phases"]
        predicted_oom = r["verdict"] == "OOM"
        right = "right" if predicted_oom == (c.reported == "OOM") else "wrong"
        lines.append(
            f"| {c.label} | {c.source} | {c.reported} | {_g(p['update'])} / {_g(p['log-probs'])} / "
            f"{_g(p['rollout'])} of {c.device_gib} | {r['verdict']} ({r['phase']}, "
            f"{100 * r['peak'] / (c.device_gib * GIB):.0f}%) | {right} |"
        )
    return "\n".join(lines)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        shapes = write_models(Path(tmp))
    for name, shape in shapes.items():
        print(f"{name}: {shape.num_params / 1e9:.2f}B parameters")
    presets = [judge(preset_case(p, m, g, *more), shapes[m]) for p, m, g, *more in PRESETS]
    print("\nGPU presets (GiB per GPU; sequences at full length, 80 GB GPUs = 79.1 GiB)\n")
    print(preset_table(presets))
    print("\nverl's published configurations\n")
    print(verl_table([judge(c, shapes[c.model]) for c in VERL_CASES]))


if __name__ == "__main__":
    main()
