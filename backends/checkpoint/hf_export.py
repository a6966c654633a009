"""Export a train state's model as a Hugging Face checkpoint dir that ``transformers`` and vLLM load.

API (call on **every** rank: gathering the full weights is a collective)::

    path = export_hf(state, out_dir, tokenizer=tokenizer)        # -> Path, on every rank
    model = AutoModelForCausalLM.from_pretrained(path)           # the trained actor

The weights are streamed as full (unsharded) tensors by
``backends.distributed.sharded_state.full_state_dict`` (one ``DTensor.full_tensor()`` at a time); rank 0
keeps them on the CPU and writes them with the model class's own ``save_pretrained`` (safetensors, tied
weights stored once, sharded above ``max_shard_size``), together with the model config, its generation
config and the tokenizer. The
model class and config come from the module itself (the FSDP2 wrapper class is looked through), so a
causal LM, a value model (``*ForTokenClassification``, ``num_labels=1``) or any other HF
``PreTrainedModel`` exports the same way. The exported config has ``use_cache=True`` (training turns
the KV cache off) and, when ``dtype`` is given, that dtype.

The directory appears atomically: it is written as ``<out_dir>.tmp-<hex>`` and renamed when complete.
An existing ``out_dir`` is an error unless ``overwrite=True``. A failed write (a full disk) is an
:class:`ExportError` on every rank of the state, naming the dir and the cause; an earlier export in
``out_dir`` stays as it was.
"""

from __future__ import annotations

import copy
import errno
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from backends.distributed.collectives import state_ranks
from backends.distributed.sharded_state import full_state_dict

__all__ = ["ExportError", "export_hf", "hf_model_class"]


class ExportError(RuntimeError):
    """Writing the HF dir failed (raised on every rank of the exported state)."""


def hf_model_class(module: torch.nn.Module) -> type:
    """The Hugging Face class of ``module``, looking through FSDP2's dynamic ``FSDP<Class>`` wrapper."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        FSDPModule = ()  # type: ignore[assignment]
    for cls in type(module).__mro__:
        if FSDPModule and issubclass(cls, FSDPModule):
            continue
        return cls
    raise TypeError(f"cannot find the model class of {type(module).__name__}")  # pragma: no cover


def _check_exportable(module: Any) -> None:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"export_hf needs a train state with a .module (nn.Module), got {type(module).__name__}")
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_json_string") or not hasattr(module, "save_pretrained"):
        raise TypeError(
            f"{hf_model_class(module).__name__} is not a Hugging Face PreTrainedModel (no .config / .save_pretrained); "
            "export_hf writes HF checkpoint dirs only"
        )


def export_hf(
    state: Any,
    out_dir: str | os.PathLike,
    *,
    tokenizer: Any = None,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    max_shard_size: str | int = "5GB",
) -> Path:
    """Write ``state.module`` (FSDP2-sharded or plain) as a HF checkpoint dir; returns ``out_dir`` on every rank.

    ``tokenizer``: saved alongside (``save_pretrained``) when given. ``dtype``: cast the weights (e.g.
    ``torch.bfloat16`` for serving); default: as trained. Errors (on every rank, before any gathering):
    a module that is not a HF ``PreTrainedModel``; an existing ``out_dir`` without ``overwrite``.
    """
    module = getattr(state, "module", state)
    _check_exportable(module)
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"export dir {str(out)!r} already exists (pass overwrite=True to replace it)")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")

    # the writer is the first rank of the state's own ranks (a role's pool under split placement)
    group, rank, size = state_ranks(state)
    tensors: dict[str, torch.Tensor] = {}
    shared: dict[int, torch.Tensor] = {}
    for name, tensor in full_state_dict(module, dtype=dtype, device="cpu"):
        if rank == 0:
            # tied weights come as one tensor object under two names: keep them one tensor
            tensors[name] = shared.setdefault(id(tensor), tensor)

    failure = None
    if rank == 0:
        try:
            _write(
                module,
                tensors,
                out,
                tokenizer=tokenizer,
                dtype=dtype,
                overwrite=overwrite,
                max_shard_size=max_shard_size,
            )
        except Exception as e:  # noqa: BLE001 - every rank raises it below, not only the writer
            failure = e
    cause = _cause(failure) if failure is not None else None
    if size > 1:  # also the barrier: no rank returns before the dir is complete
        said = [cause]
        dist.broadcast_object_list(said, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        cause = said[0]
    if cause is not None:
        raise ExportError(f"exporting the model to {str(out)!r} failed: {cause}") from failure
    return out


def _cause(error: BaseException) -> str:
    """What went wrong, with the path; a full disk said as such (safetensors' and torch's errors often name neither)."""
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return f"no space left on device ({error.filename or 'writing the files'})"
    if "StorageFull" in str(error) or "No space left on device" in str(error):  # safetensors' Rust I/O error
        return f"no space left on device ({type(error).__name__}: {error})"
    if isinstance(error, FileExistsError):
        return str(error)
    return f"{type(error).__name__}: {error}"


def _share_tied(skeleton: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Make tied names (one parameter in the model, e.g. embed_tokens / lm_head) one tensor object.

    FSDP2's ``state_dict()`` returns a separate DTensor per name even for a tied parameter, so the
    streamed full tensors arrive as equal copies; ``save_pretrained`` drops a tied duplicate only when
    it is the same storage.
    """
    groups: dict[int, list[str]] = {}
    for name, param in skeleton.state_dict(keep_vars=True).items():
        groups.setdefault(id(param), []).append(name)
    for names in groups.values():
        present = [n for n in names if n in tensors]
        for n in present[1:]:
            if not torch.equal(tensors[n], tensors[present[0]]):
                raise ValueError(f"{n} and {present[0]} are tied in {type(skeleton).__name__} but their values differ")
            tensors[n] = tensors[present[0]]


def _write(
    module: torch.nn.Module,
    tensors: dict,
    out: Path,
    *,
    tokenizer: Any,
    dtype: torch.dtype | None,
    overwrite: bool,
    max_shard_size: str | int,
) -> None:
    if callable(getattr(module, "get_base_model", None)):  # a LoRA (peft) model: the merged base model is written
        module = module.get_base_model()
    cls = hf_model_class(module)
    config = copy.deepcopy(module.config)
    if hasattr(config, "use_cache"):
        config.use_cache = True
    first = next((t for t in tensors.values() if t.is_floating_point()), None)
    export_dtype = dtype or (first.dtype if first is not None else torch.float32)
    config.dtype = export_dtype
    # A weightless copy of the HF class: it supplies save_pretrained's naming, tied-weight handling and
    # config; the tensors are the gathered ones.
    with torch.device("meta"):
        skeleton = cls(config).to(export_dtype)  # save_pretrained records the params' dtype in config.json
    _share_tied(skeleton, tensors)
    # transformers writes only on global rank 0 once torch.distributed is up; the writer was chosen by
    # the caller (the first rank of the state's own group, e.g. a critic pool that excludes rank 0)
    skeleton.should_save_on_this_rank = lambda is_main_process: is_main_process
    if (
        getattr(module, "generation_config", None) is not None
        and getattr(skeleton, "generation_config", None) is not None
    ):
        skeleton.generation_config = copy.deepcopy(module.generation_config)

    tmp = out.with_name(f"{out.name}.tmp-{uuid.uuid4().hex}")
    try:
        skeleton.save_pretrained(tmp, state_dict=tensors, safe_serialization=True, max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if out.exists():
            if not overwrite:  # created meanwhile
                raise FileExistsError(f"export dir {str(out)!r} already exists (pass overwrite=True to replace it)")
            aside = out.with_name(f"{out.name}.old-{uuid.uuid4().hex}")
            os.replace(out, aside)
            os.replace(tmp, out)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
