"""Adapter-only weight sync for a LoRA actor on the vLLM engine (``rollout.vllm.lora_sync=adapter``).

With ``lora_sync=merged`` (the default) a LoRA actor reaches the engine as merged full weights
(:func:`backends.rollout.vllm.sync_weights`), every tensor of the model at every step. With
``lora_sync=adapter`` the engine is built with vLLM's LoRA support (``enable_lora``), keeps the base weights
it loaded at build, and each sync sends only the adapter's factors (``lora_A``: ``rank x in``, ``lora_B``:
``out x rank`` per adapted layer): :func:`sync_adapter` checks them, writes them as a peft adapter dir
(``adapter_model.safetensors`` + ``adapter_config.json``) under a temporary root (``/dev/shm`` where it
exists, so nothing reaches a disk), has the engine load it as a new ``LoRARequest`` (``lora_int_id =
version + 1``) and then drops the previous one. :func:`backends.rollout.vllm.generate` (and scoring and
multi-turn sessions, through ``run_requests``) passes the rollout's active request to every call.

vLLM applies the adapter as ``x W^T + scaling * (x A^T) B^T`` with ``scaling = alpha / rank`` (read from
the written ``adapter_config.json``), the same function as the merged weights ``W + scaling * B @ A``, up
to rounding.

Failure. Names, shapes, dtypes, NaN / Inf and completeness are checked before anything is written, and
vLLM loads (and checks) the new adapter before the previous one is removed, so a refused sync leaves the
previous adapter active and the engine generating with it.

Sleep. The base weights are never sent again, so a sleep must keep them: a level-2 sleep (which drops
them) is refused with ``lora_sync=adapter`` where the platform sleeps; :func:`adapter_engine_config` turns
it into level 1 (weights offloaded to the host and restored on wake). vLLM's LoRA slot buffers live in the
weights pool (:mod:`backends.rollout.vllm_sleep`), and ``add_lora`` copies the new adapter into a slot at once
(``LRUCacheWorkerLoRAManager.add_adapter`` -> ``activate_adapter``), so :func:`sync_adapter` wakes the weights
pool before it; the KV cache wakes at the next generation.

:mod:`backends.rollout.vllm` imports this module, so its ``VLLMConfig`` / ``VLLMRollout`` are typed ``Any`` here.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

import attrs
import torch
from torch import Tensor

from backends.rollout.vllm_sleep import wake_pools

__all__ = [
    "LORA_SYNC_MODES",
    "VLLM_LORA_RANKS",
    "adapter_engine_config",
    "lora_engine_kwargs",
    "check_adapter",
    "adapter_config",
    "adapter_bytes",
    "sync_adapter",
]

log = logging.getLogger("rlfunc.rollout_vllm")

#: ``rollout.vllm.lora_sync``: merged full weights every sync, or the LoRA adapter only
LORA_SYNC_MODES = ("merged", "adapter")
#: the ``max_lora_rank`` values vLLM accepts (``vllm.config.lora.MaxLoRARanks``)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_PEFT_PREFIX = "base_model.model."
_FACTOR = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<kind>[AB])\.weight$")


def adapter_engine_config(config: Any, rank: int) -> Any:
    """``config`` for an adapter-synced engine of a rank-``rank`` LoRA actor: ``max_lora_rank`` set (when
    unset) and a level-2 sleep turned into level 1 (level 2 drops the base weights, which no sync resends)."""
    if config.lora_sync != "adapter":
        return config
    changes: dict[str, Any] = {}
    if config.max_lora_rank is None:
        changes["max_lora_rank"] = rank
    if config.sleep_level == 2:
        changes["sleep_level"] = 1
    return attrs.evolve(config, **changes)


def lora_engine_kwargs(config: Any, *, can_sleep: bool) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments of ``config``'s LoRA mode (``{}`` for merged sync); refuses, before vLLM
    starts, an adapter engine without a rank or with a sleep that drops the base weights."""
    if config.lora_sync != "adapter":
        return {}
    rank = config.max_lora_rank
    if rank is None or rank < 1:
        raise ValueError(
            f"rollout.vllm.lora_sync=adapter needs rollout.vllm.max_lora_rank >= 1 (the actor's "
            f"actor.lora.rank; the grpo recipe fills it in), got {rank}"
        )
    if rank > VLLM_LORA_RANKS[-1]:
        raise ValueError(f"rollout.vllm.max_lora_rank={rank}: vLLM supports LoRA ranks up to {VLLM_LORA_RANKS[-1]}")
    if can_sleep and config.sleep_between_steps and config.sleep_level == 2:
        raise ValueError(
            "rollout.vllm.lora_sync=adapter with rollout.vllm.sleep_level=2: a level-2 sleep drops the "
            "base weights and an adapter sync never resends them; set rollout.vllm.sleep_level=1"
        )
    # max_cpu_loras=2: the new adapter is loaded beside the active one before that one is removed
    return {
        "enable_lora": True,
        "max_lora_rank": next(r for r in VLLM_LORA_RANKS if r >= rank),
        "max_loras": 1,
        "max_cpu_loras": 2,
    }


def check_adapter(
    adapter_state: Mapping[str, Tensor],
    targets: Mapping[str, Tensor] | None,
    *,
    rank: int,
    target_modules: Sequence[str],
) -> None:
    """Refuse, naming the tensor, an adapter that is not a complete peft LoRA of rank ``rank`` over the
    layers of ``targets`` (the HF model's tensors by name, shapes on the meta device; None: unknown, then
    only the names and the factors' agreement are checked) whose last name part is in ``target_modules``."""
    if not adapter_state:
        raise ValueError("the adapter has no tensors")
    factors: dict[str, dict[str, Tensor]] = {}
    for name, tensor in adapter_state.items():
        match = _FACTOR.match(name)
        if match is None:
            raise ValueError(
                f"adapter tensor {name!r}: not a peft LoRA factor name "
                "(base_model.model.<layer>.lora_A.weight / lora_B.weight)"
            )
        module = match["module"]
        if module.rpartition(".")[2] not in target_modules:
            raise ValueError(
                f"adapter tensor {name!r}: layer {module!r} is not one of the target modules {list(target_modules)}"
            )
        if not isinstance(tensor, Tensor) or not tensor.is_floating_point() or tensor.dim() != 2:
            raise ValueError(
                f"adapter tensor {name!r}: expected a 2-d floating-point tensor, got "
                f"{getattr(tensor, 'dtype', type(tensor).__name__)} {tuple(getattr(tensor, 'shape', ()))}"
            )
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"adapter tensor {name!r} holds NaN or Inf")
        factors.setdefault(module, {})[match["kind"]] = tensor
    for module, pair in sorted(factors.items()):
        if len(pair) != 2:
            raise ValueError(
                f"adapter layer {module!r} has lora_{next(iter(pair))} "
                f"but not lora_{'AB'.replace(next(iter(pair)), '')}"
            )
        out_in = None if targets is None else targets.get(f"{module}.weight")
        if targets is not None and out_in is None:
            raise ValueError(f"adapter layer {module!r} is not a layer of the model")
        a_shape = (rank, out_in.shape[1] if out_in is not None else pair["A"].shape[1])
        b_shape = (out_in.shape[0] if out_in is not None else pair["B"].shape[0], rank)
        for kind, expected in (("A", a_shape), ("B", b_shape)):
            if tuple(pair[kind].shape) != expected:
                raise ValueError(
                    f"adapter tensor {_PEFT_PREFIX}{module}.lora_{kind}.weight has shape "
                    f"{tuple(pair[kind].shape)}, expected {expected} (rank {rank})"
                )
    if targets is not None:
        expected_layers = {
            n[: -len(".weight")]
            for n, t in targets.items()
            if n.endswith(".weight") and t.dim() == 2 and n[: -len(".weight")].rpartition(".")[2] in target_modules
        }
        missing = sorted(expected_layers - set(factors))
        if missing:
            raise ValueError(f"the adapter has no factors for {len(missing)} target layer(s), e.g. {missing[:3]}")


def adapter_config(*, rank: int, alpha: float, target_modules: Sequence[str], base_model: str = "") -> dict[str, Any]:
    """A peft ``adapter_config.json`` for a plain LoRA adapter (what vLLM's ``PEFTHelper`` reads)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": int(rank),
        "lora_alpha": alpha,
        "target_modules": sorted(target_modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def sync_adapter(
    rollout: Any,
    adapter_state: Mapping[str, Tensor],
    *,
    rank: int,
    alpha: float,
    target_modules: Sequence[str],
    version: int | None = None,
) -> Any:
    """Make ``adapter_state`` (peft names ``base_model.model.<layer>.lora_A.weight`` / ``lora_B.weight``, full
    tensors; ``backends.training.lora.adapter_state_dict``) the engine's active adapter.

    Checked (:func:`check_adapter`), written to a fresh peft adapter dir, loaded by vLLM as
    ``LoRARequest(f"actor_v{version}", version + 1, dir)``; only then is the previous adapter removed (from
    the engine and from the temporary root) and the prefix cache reset. Any failure raises and leaves the
    previous adapter active. ``version`` (default: ``weights_version``) must differ from the active one's.
    Returns the rollout with ``lora_request`` set and ``weights_version`` bumped.
    """
    from safetensors.torch import save_file
    from vllm.lora.request import LoRARequest

    if rollout.config.lora_sync != "adapter":
        raise ValueError(
            "sync_adapter needs an engine built with rollout.vllm.lora_sync=adapter "
            f"(this one has lora_sync={rollout.config.lora_sync!r})"
        )
    if rank > (rollout.config.max_lora_rank or 0):
        raise ValueError(f"adapter rank {rank} is more than the engine's max_lora_rank={rollout.config.max_lora_rank}")
    version = rollout.weights_version if version is None else int(version)
    previous = rollout.lora_request
    if previous is not None and previous.lora_int_id == version + 1:
        raise ValueError(f"adapter version {version} is the active one's: each sync needs a new version")
    check_adapter(adapter_state, rollout.weight_targets, rank=rank, target_modules=target_modules)
    path = Path(tempfile.mkdtemp(prefix=f"v{version}_", dir=_adapter_root()))
    try:
        save_file(
            {n: t.detach().to("cpu").contiguous() for n, t in adapter_state.items()},
            str(path / "adapter_model.safetensors"),
            metadata={"format": "pt"},
        )
        config = adapter_config(rank=rank, alpha=alpha, target_modules=target_modules)
        (path / "adapter_config.json").write_text(json.dumps(config, indent=1))
        request = LoRARequest(f"actor_v{version}", version + 1, str(path))
        if rollout.can_sleep:  # add_lora writes the adapter into its slot in the weights pool: map that first
            wake_pools(rollout.llm, rollout.sleep_state, ["weights"])
        rollout.llm.llm_engine.add_lora(request)  # vLLM loads and checks it now, beside the active one
    except Exception:
        shutil.rmtree(path, ignore_errors=True)
        raise
    if previous is not None:
        rollout.llm.llm_engine.remove_lora(previous.lora_int_id)
        shutil.rmtree(previous.lora_path, ignore_errors=True)
    rollout.llm.reset_prefix_cache()
    return attrs.evolve(rollout, lora_request=request, weights_version=rollout.weights_version + 1)


def adapter_bytes(adapter_state: Mapping[str, Tensor]) -> int:
    """Bytes of the adapter's tensors (what one adapter sync moves)."""
    return sum(t.numel() * t.element_size() for t in adapter_state.values())


_ROOT: list[Path] = []


def _adapter_root() -> Path:
    """This process's directory for adapter dirs (in ``/dev/shm`` where it exists), removed at exit."""
    if not _ROOT:
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        root = Path(tempfile.mkdtemp(prefix=f"rlfunc_lora_{os.getpid()}_", dir=base))
        atexit.register(shutil.rmtree, root, True)
        _ROOT.append(root)
    return _ROOT[0]
