"""Crash-safe, resumable checkpoints of a whole run with ``torch.distributed.checkpoint`` (DCP).

API (every function is called on **all** ranks, in step, unless it says otherwise)::

    path = save_checkpoint(ckpt_dir, step, {"actor": actor, "critic": critic}, extra,
                           keep_last=3, config=must_match)            # -> Path (or PendingCheckpoint)
    path = resolve_resume(resume, ckpt_dir)      # "auto" | "never" | None | a step_N dir -> Path | None
    states, extra = load_checkpoint(path, {"actor": actor, "critic": critic}, config=must_match)
    latest_checkpoint(ckpt_dir) / list_checkpoints(ckpt_dir) / checkpoint_info(path)   # any rank
    wait_for_pending_save()                      # before exit when saving with async_save=True

- ``states``: named train states (``backends.training.fsdp.TrainState`` or anything with ``module``,
  ``optimizer`` (or None) and ``step``, plus ``replace(step=...)``). Model and optimizer are saved
  sharded (``get_state_dict`` / ``set_state_dict``: FSDP2 ``DTensor``s, or plain tensors at world size
  1) and loaded back in place; ``load_checkpoint`` returns new state objects carrying the saved
  ``step``. A checkpoint holds several states; loading may ask for a subset of them.
- ``extra``: a small JSON-like tree the recipe owns (data position, KL-controller state, counters):
  dicts with ``str`` keys, lists (tuples come back as lists), ``None``/bool/int/float/str, and
  ``torch.Tensor`` leaves. Scalars are stored as JSON, tensors through DCP (they come back on the CPU
  with their dtype and shape). It must be the same on every rank (one copy is stored).
- RNG: each rank's torch CPU, CUDA (if initialised), Python ``random`` and NumPy global states are
  saved to ``rng/rank_<r>.safetensors`` and restored on that rank by ``load_checkpoint``
  (``restore_rng=False`` to skip). A rank absent from the checkpoint (more ranks than when saved)
  keeps its RNG and gets a warning: exact resumption needs the same world size.
- ``config``: the config keys that must match on resume (nested dicts / attrs objects are
  flattened to dotted keys). A mismatch raises :class:`CheckpointMismatchError` naming every
  differing key, before any weight is loaded.

Layout and atomicity::

    <ckpt_dir>/step_<N>/            a complete checkpoint (has COMPLETE)
        COMPLETE                    JSON marker, written last: step, world size, per-state model
                                    fingerprint (parameter names + shapes), config + its hash,
                                    optimizer hyper-parameters, the extra tree's JSON skeleton, and a
                                    SHA-256 per tensor chunk and per other file, which a load checks
                                    first (``integrity``: a damaged byte is an error naming the file
                                    and the tensor)
        .metadata, __<r>_0.distcp   DCP files (tensors only)
        rng/rank_<r>.safetensors    per-rank RNG states
    <ckpt_dir>/step_<N>.tmp-<hex>/  a save in progress (or one that crashed): ignored, removed by the
                                    next save

Every rank writes into the temp dir; after all ranks are done (a barrier; for async saves, the DCP
future of rank 0, which completes only after every rank's shard is written), rank 0 writes
``COMPLETE`` and renames the dir to ``step_<N>`` (``os.replace`` of a directory is atomic on
POSIX). A crash at any point leaves every earlier checkpoint intact; :func:`latest_checkpoint` only
sees dirs named ``step_<N>`` that hold ``COMPLETE``. Retention (``keep_last``) renames an old
checkpoint out of the ``step_<N>`` namespace before deleting it, so a crash mid-delete never leaves
a half-deleted dir that looks complete. ``ckpt_dir`` must be visible to every rank (one node, or a
shared filesystem).

Async (``async_save=True``): the state is copied to CPU memory (the call blocks for that), the files
are written by a background thread over a dedicated gloo group, and rank 0 renames the dir as soon
as the write completes. Call ``pending.wait()`` (or :func:`wait_for_pending_save`) before exiting;
the next ``save_checkpoint`` / ``load_checkpoint`` waits for a pending save first. A process that
exits without waiting leaves only a temp dir, never a damaged checkpoint.

Nothing is unpickled beyond ``torch.load(weights_only=True)``: only tensors go through DCP (its
``.metadata`` index is read with an unpickler that accepts only DCP's own metadata classes), the rest
is JSON, RNG states are safetensors.

An optimizer that has never stepped has no state; DCP's ``get_state_dict`` would initialise it by
stepping with zero gradients (setting Adam's step counter to 1 and changing the next update), so such
an optimizer is recorded as ``"empty"`` and restored as empty.

This module is the save / load protocol; its parts are modules of their own: ``files`` (the dir layout,
atomic writes, the marker, listing), ``fingerprint`` (config and model fingerprints), ``rng``,
``extra_tree``, ``safe_reader`` (the restricted unpickler) and ``coordination`` (the ranks' small
collectives over a gloo side-group).
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Mapping

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

from backends.checkpoint.coordination import (
    all_ok,
    all_state_meta,
    broadcast_hex,
    gloo_barrier,
    gloo_group,
    quiet_no_dist,
)
from backends.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
)
from backends.checkpoint.extra_tree import join_extra, split_extra
from backends.checkpoint.files import (
    FORMAT,
    FORMAT_VERSION,
    MARKER,
    CheckpointInfo,
    checkpoint_info,
    checkpoint_writer,
    clean_stale_dirs,
    commit_checkpoint,
    latest_checkpoint,
    list_checkpoints,
)
from backends.checkpoint.fingerprint import (
    config_diff,
    config_hash,
    fingerprint_diff,
    flatten_config,
    json_value,
    model_config_json,
    model_fingerprint,
    state_dict_fingerprint,
)
from backends.checkpoint.integrity import record_integrity, verify_integrity
from backends.checkpoint.rng import capture_rng_state, read_rng_file, restore_rng_state, write_rng_file
from backends.checkpoint.safe_reader import safe_reader, tensor_only_planner
from backends.distributed.collectives import world_rank, world_size
from backends.distributed.sharded_state import reshard

# The errors, the listing functions and the config / fingerprint / RNG helpers have their own modules
# (errors, files, fingerprint, rng); they are re-exported here, where a recipe finds the whole API.
__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CheckpointInfo",
    "PendingCheckpoint",
    "save_checkpoint",
    "load_checkpoint",
    "resolve_resume",
    "latest_checkpoint",
    "list_checkpoints",
    "checkpoint_info",
    "wait_for_pending_save",
    "model_fingerprint",
    "flatten_config",
    "config_hash",
    "config_diff",
    "capture_rng_state",
    "restore_rng_state",
]

_STATE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


# ----------------------------------------------------------------------------- state dicts of states


def _check_states(states: Mapping[str, Any]) -> None:
    # empty on a rank that holds no trained state (a rollout-only pool): it still takes part in the collectives
    if not isinstance(states, Mapping) or (not states and world_size() == 1):
        raise ValueError("states must be a non-empty dict of {name: train state}")
    for name, state in states.items():
        if not isinstance(name, str) or not _STATE_NAME.match(name):
            raise ValueError(f"state name {name!r} must be a non-empty str of letters, digits, '_', '.', '-'")
        if not isinstance(getattr(state, "module", None), torch.nn.Module):
            raise TypeError(f"states[{name!r}] has no .module (an nn.Module); got {type(state).__name__}")


def _optimizer_status(state: Any) -> str:
    opt = getattr(state, "optimizer", None)
    if opt is None:
        return "none"
    return "saved" if len(opt.state) > 0 else "empty"


def _state_dicts(state: Any, with_optimizer: bool) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    optimizers = [state.optimizer] if with_optimizer else []
    msd, osd = get_state_dict(state.module, optimizers, options=options)
    return msd, (osd if with_optimizer else {})


def _restore_type(loaded: Any, template: Any) -> Any:
    if isinstance(template, tuple) and isinstance(loaded, list):
        return tuple(loaded)
    return loaded


# ------------------------------------------------------------------------------------- async saves


@attrs.define
class PendingCheckpoint:
    """An async save in flight. ``wait()`` (on every rank) returns the final ``step_<N>`` path."""

    path: Path
    _future: Any
    _tmp: Path
    _marker: dict
    _keep_last: int | None
    _write_errors: list = attrs.field(factory=list)  #: OSErrors of the shard writes (checkpoint_writer)
    _finalized: threading.Event = attrs.field(factory=threading.Event)
    _error: BaseException | None = None
    _waited: bool = False

    def _on_done(self, future: Any) -> None:  # rank 0, in the writer thread
        try:
            if future.exception() is None:
                self._marker["integrity"] = record_integrity(self._tmp, saved_by=1)
                commit_checkpoint(self._tmp, self.path, self._marker, self._keep_last)
        except BaseException as e:  # noqa: BLE001 - reported by wait()
            self._error = e
        finally:
            self._finalized.set()

    def done(self) -> bool:
        """True once this rank's write finished (and, on rank 0, the rename happened)."""
        return self._future.done() and (world_rank() != 0 or self._finalized.is_set())

    def wait(self) -> Path:
        global _PENDING
        if self._waited:
            return self.path
        self._waited = True
        if _PENDING is self:
            _PENDING = None
        try:
            self._future.result()  # re-raises a failed write (on every rank: DCP agrees on the outcome)
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            raise _save_error(self.path, self._tmp, self._write_errors[0] if self._write_errors else e) from None
        if world_rank() == 0:
            self._finalized.wait()
        if not all_ok(self._error is None):  # also the barrier: no rank waits on one that raised
            raise _save_error(self.path, self._tmp, self._error)
        return self.path


_PENDING: PendingCheckpoint | None = None


def wait_for_pending_save() -> Path | None:
    """Wait for this process's in-flight async save, if any (call on every rank). Returns its path."""
    pending = _PENDING
    return pending.wait() if pending is not None else None


def resolve_resume(resume: str | os.PathLike | bool | None, ckpt_dir: str | os.PathLike | None = None) -> Path | None:
    """Which checkpoint to resume from.

    - ``"auto"`` (or True): the newest complete checkpoint under ``ckpt_dir``; None (start fresh) if there
      is none;
    - ``None`` / False / ``""`` / ``"never"`` / ``"none"`` / ``"off"``: None;
    - a path: that checkpoint (validated: a clear error if it is missing or incomplete).
    """
    if (
        resume is None
        or resume is False
        or (isinstance(resume, str) and resume.lower() in ("", "never", "none", "off", "false"))
    ):
        return None
    if resume is True or (isinstance(resume, str) and resume.lower() == "auto"):
        if ckpt_dir is None:
            raise ValueError("resume='auto' needs the checkpoint directory (ckpt_dir)")
        wait_for_pending_save()
        return latest_checkpoint(ckpt_dir)
    return checkpoint_info(resume).path


# --------------------------------------------------------------------------------------------- save


def _failure_reason(error: BaseException | None) -> str:
    """What went wrong, from DCP's CheckpointException (per-rank failures) or a plain exception; a full disk
    is said as such."""
    if error is None:
        return "rank 0 failed (see its error)"
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, failure = next(iter(failures.items()))
        cause = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {_failure_reason(cause)}"
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return f"no space left on device ({error.filename or 'writing the files'})"
    return f"{type(error).__name__}: {error}"


def _save_error(final: Path, tmp: Path, error: BaseException | None) -> CheckpointError:
    """The error every rank raises for a failed save; rank 0 removes the partial temp dir (space back)."""
    if world_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    complete = (final / MARKER).is_file() and not tmp.exists()
    outcome = (
        "the checkpoint itself is complete"
        if complete
        else f"its temp dir {tmp.name} was removed; earlier checkpoints in {str(final.parent)!r} are intact"
    )
    return CheckpointError(f"saving checkpoint {str(final)!r} failed: {_failure_reason(error)}; {outcome}")


def _write_shards(flat: dict[str, Tensor], tmp: Path, final: Path, save_rng: bool) -> None:
    """Every rank's RNG file and DCP shards into ``tmp``; a failure on any rank (a full disk) raises on all."""
    import torch.distributed.checkpoint as dcp

    error = None
    try:
        if save_rng:
            write_rng_file(tmp, world_rank())
    except OSError as e:
        error = e
    if not all_ok(error is None):  # before DCP's collectives, which a rank that raised would never join
        raise _save_error(final, tmp, error)
    writer, write_errors = checkpoint_writer(tmp)
    try:
        with quiet_no_dist():
            dcp.save(flat, storage_writer=writer, no_dist=not dist.is_initialized())
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        raise _save_error(final, tmp, write_errors[0] if write_errors else e) from None


def _finalize_on_rank0(tmp: Path, final: Path, marker: dict, keep_last: int | None) -> None:
    """Rank 0 finalises; a failure there (a full disk) raises on every rank instead of leaving them waiting."""
    error = None
    if world_rank() == 0:
        try:
            commit_checkpoint(tmp, final, marker, keep_last)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            error = e
    if not all_ok(error is None):  # also the barrier: the renamed checkpoint is visible to everyone
        raise _save_error(final, tmp, error)


def _check_save_args(step: Any, keep_last: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be None (keep all) or an int >= 1, got {keep_last!r}")


def _make_temp_dir(root: Path, step: int) -> Path:
    """Rank 0 creates ``step_<step>.tmp-<hex>`` (after removing crashed saves' leftovers); every rank gets its path."""
    token, error = "", None
    if world_rank() == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            clean_stale_dirs(root)
            token = uuid.uuid4().hex
            (root / f"step_{step}.tmp-{token}").mkdir()
        except OSError as e:  # a full or read-only disk: said on every rank, not left to hang the others
            token, error = "", e
    token = broadcast_hex(token)
    if token.strip("0") == "":  # rank 0 sent no token (a uuid4 is never all zeros)
        raise CheckpointError(f"cannot create a temp dir for step {step} under {str(root)!r}: {_failure_reason(error)}")
    tmp = root / f"step_{step}.tmp-{token}"
    if not all_ok(tmp.is_dir()):
        raise CheckpointError(
            f"the temp dir {str(tmp)!r} made by rank 0 is not visible on every rank: {str(root)!r} must be on a "
            "filesystem shared by all ranks"
        )
    return tmp


def _collect_state(name: str, state: Any, flat: dict[str, Tensor]) -> dict[str, Any]:
    """Put ``state``'s model and optimizer tensors into ``flat`` (under ``<name>/model/`` and
    ``<name>/optim/``); return what the marker records about it."""
    reshard(state.module)
    status = _optimizer_status(state)
    msd, osd = _state_dicts(state, with_optimizer=status == "saved")
    optim_json = {}
    for k, v in msd.items():
        if v is None:  # an empty extra state (megatron's ``_extra_state`` without TransformerEngine)
            continue
        if not isinstance(v, Tensor):
            raise TypeError(f"model state of {name!r} has a non-tensor entry {k!r} ({type(v).__name__})")
        flat[f"{name}/model/{k}"] = v
    for k, v in osd.items():
        if isinstance(v, Tensor):
            flat[f"{name}/optim/{k}"] = v
        else:
            optim_json[k] = json_value(v)
    fp = state_dict_fingerprint(msd)
    return {
        "step": int(getattr(state, "step", 0)),
        "nonfinite_updates_skipped": int(
            getattr(state, "nonfinite_updates_skipped", 0)
        ),  # optim.nonfinite=skip's total
        "fingerprint": fp["sha256"],
        "params": fp["params"],
        "model_type": getattr(getattr(state.module, "config", None), "model_type", None),
        "model_config": model_config_json(state.module),
        "optimizer": status,
        "optimizer_class": None if status == "none" else type(state.optimizer).__name__,
        "optimizer_values": optim_json,
    }


def _marker(step: int, state_meta: dict, flat_config: dict, skeleton: Any, save_rng: bool) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": step,
        "world_size": world_size(),
        "created_unix": time.time(),
        "states": state_meta,
        "config": flat_config,
        "config_hash": config_hash(flat_config),
        "extra": skeleton,
        "rng_saved": bool(save_rng),
        "torch_version": torch.__version__,
    }


def _save_async(
    flat: dict[str, Tensor], writer_and_errors: tuple, final: Path, tmp: Path, marker: dict, keep_last: int | None
) -> PendingCheckpoint:
    """Start DCP's background write over the side-group; rank 0 finalises when it completes."""
    import torch.distributed.checkpoint as dcp

    global _PENDING
    writer, write_errors = writer_and_errors
    group = gloo_group() if dist.is_initialized() else None
    with quiet_no_dist():
        future = dcp.async_save(flat, storage_writer=writer, process_group=group, no_dist=group is None)
    future = getattr(future, "upload_completion", future)  # AsyncSaveResponse on newer torch
    pending = PendingCheckpoint(final, future, tmp, marker, keep_last, write_errors)
    if world_rank() == 0:
        future.add_done_callback(pending._on_done)
    _PENDING = pending
    return pending


def save_checkpoint(
    ckpt_dir: str | os.PathLike,
    step: int,
    states: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
    *,
    keep_last: int | None = None,
    config: Mapping[str, Any] | Any | None = None,
    async_save: bool = False,
    save_rng: bool = True,
) -> Path | PendingCheckpoint:
    """Save ``states`` (model + optimizer, sharded), ``extra`` and every rank's RNG as ``ckpt_dir/step_<step>``.

    Call on every rank, each with the states it holds: all of them, or under split placement its pool's
    roles (the checkpoint then holds every pool's, and each rank loads its own; a rank of a pool that trains
    nothing, such as a rollout pool, passes ``{}``). ``extra`` must be the
    same on every rank. Returns the checkpoint path (all ranks, after the rename), or with
    ``async_save=True`` a :class:`PendingCheckpoint` whose ``wait()`` returns it. ``keep_last``: keep
    only the newest K complete checkpoints (None: keep all). ``config``: the settings a resume must
    match (see :func:`load_checkpoint`). Any earlier async save is waited for first; leftover temp dirs
    of crashed saves are removed.
    """
    _check_save_args(step, keep_last)
    _check_states(states)
    skeleton, extra_tensors = split_extra(extra)
    flat_config = flatten_config(config)
    wait_for_pending_save()

    root = Path(ckpt_dir)
    final = root / f"step_{step}"
    tmp = _make_temp_dir(root, step)
    flat: dict[str, Tensor] = {}
    state_meta = {name: _collect_state(name, state, flat) for name, state in states.items()}
    for key, tensor in extra_tensors.items():
        flat[f"extra/{key}"] = tensor
    marker = _marker(step, all_state_meta(state_meta), flat_config, skeleton, save_rng)
    if async_save:
        if save_rng:
            write_rng_file(tmp, world_rank())
        return _save_async(flat, checkpoint_writer(tmp), final, tmp, marker, keep_last)
    _write_shards(flat, tmp, final, save_rng)
    gloo_barrier()  # every rank's shard and RNG file is on disk
    marker["integrity"] = record_integrity(tmp, saved_by=world_size())
    _finalize_on_rank0(tmp, final, marker, keep_last)
    return final


# --------------------------------------------------------------------------------------------- load


def _validate_against(
    info: CheckpointInfo, states: Mapping[str, Any], config: Any | None, fingerprints: dict[str, dict]
) -> None:
    marker = info.marker
    saved_states = marker["states"]
    missing = [n for n in states if n not in saved_states]
    if missing:
        raise CheckpointMismatchError(
            f"checkpoint {str(info.path)!r} has no state named {', '.join(map(repr, missing))}; "
            f"it holds: {', '.join(map(repr, saved_states))}"
        )
    for name, state in states.items():
        _validate_state(info, name, state, saved_states[name], fingerprints[name])
    if config is not None:
        diff = config_diff(info.config, flatten_config(config))
        if diff:
            raise CheckpointMismatchError(
                f"checkpoint {str(info.path)!r} was written with a different config ({len(diff)} key(s) differ):\n  "
                + "\n  ".join(diff)
            )


def _validate_state(info: CheckpointInfo, name: str, state: Any, saved: dict, current: dict) -> None:
    if saved["fingerprint"] != current["sha256"]:
        details = fingerprint_diff(saved["params"], current["params"])
        raise CheckpointMismatchError(
            f"checkpoint {str(info.path)!r} state {name!r} is of another model "
            f"(saved model_type {saved.get('model_type')!r}, fingerprint {saved['fingerprint'][:12]}; "
            f"this model: {current['sha256'][:12]}):\n  " + "\n  ".join(details)
        )
    saved_cfg, current_cfg = saved.get("model_config"), model_config_json(state.module)
    if saved_cfg is not None and current_cfg is not None and saved_cfg != current_cfg:
        diff = config_diff(saved_cfg, current_cfg)
        warnings.warn(
            f"checkpoint {str(info.path)!r} state {name!r}: same parameter names and shapes, but the model "
            f"config differs in {len(diff)} key(s):\n  " + "\n  ".join(diff),
            stacklevel=4,
        )
    if getattr(state, "optimizer", None) is not None:
        if saved["optimizer"] == "none":
            raise CheckpointMismatchError(
                f"checkpoint {str(info.path)!r} state {name!r} has no optimizer state, but the state being "
                "restored has an optimizer"
            )
        if saved["optimizer_class"] != type(state.optimizer).__name__:
            raise CheckpointMismatchError(
                f"checkpoint {str(info.path)!r} state {name!r} was saved with optimizer {saved['optimizer_class']}, "
                f"the state being restored uses {type(state.optimizer).__name__}"
            )


def _load_targets(
    states: Mapping[str, Any], model_sds: dict, saved_states: dict, flat: dict[str, Tensor]
) -> dict[str, tuple[dict, dict]]:
    """Put every tensor to load into ``flat`` (the states' own tensors, filled in place); return each
    state's ``(model, optimizer)`` state dicts, the optimizer's non-tensor values already restored."""
    plans: dict[str, tuple[dict, dict]] = {}
    for name, state in states.items():
        load_optim = getattr(state, "optimizer", None) is not None and saved_states[name]["optimizer"] == "saved"
        if load_optim:
            msd, osd = _state_dicts(state, with_optimizer=True)
        else:
            msd, osd = model_sds[name], {}
        for k, v in msd.items():
            if v is not None:  # empty extra states were not saved, and stay empty
                flat[f"{name}/model/{k}"] = v
        saved_values = saved_states[name]["optimizer_values"]
        for k, v in osd.items():
            if isinstance(v, Tensor):
                flat[f"{name}/optim/{k}"] = v
            elif k not in saved_values:
                raise CheckpointMismatchError(f"checkpoint state {name!r} has no optimizer entry {k!r}")
            else:
                osd[k] = _restore_type(saved_values[k], v)
        plans[name] = (msd, osd)
    return plans


def _extra_targets(available: Mapping[str, Any], flat: dict[str, Tensor]) -> dict[str, Tensor]:
    """Empty CPU tensors for the checkpoint's ``extra/`` items, also put into ``flat``; keyed without the prefix."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    extra_tensors: dict[str, Tensor] = {}
    for key in available:
        if key.startswith("extra/"):
            md = available[key]
            if isinstance(md, BytesStorageMetadata):
                raise CheckpointCorruptError(f"checkpoint item {key!r} is not a tensor")
            extra_tensors[key[len("extra/") :]] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            flat[key] = extra_tensors[key[len("extra/") :]]
    return extra_tensors


def _apply_loaded(states: Mapping[str, Any], plans: dict[str, tuple[dict, dict]], saved_states: dict) -> dict[str, Any]:
    """Set the loaded state dicts into the modules and optimizers; the states, carrying their saved step."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    new_states: dict[str, Any] = {}
    for name, state in states.items():
        msd, osd = plans[name]
        optimizers = [state.optimizer] if osd else []
        set_state_dict(
            state.module,
            optimizers,
            model_state_dict=msd,
            optim_state_dict=osd if osd else {},
            options=StateDictOptions(flatten_optimizer_state_dict=True),
        )
        if getattr(state, "optimizer", None) is not None and saved_states[name]["optimizer"] == "empty":
            state.optimizer.state.clear()  # never stepped when saved: restore that, not a zero-step state
        saved_step = int(saved_states[name]["step"])
        if hasattr(state, "replace"):
            counted = (
                {"nonfinite_updates_skipped": int(saved_states[name].get("nonfinite_updates_skipped", 0))}
                if hasattr(state, "nonfinite_updates_skipped")
                else {}
            )
            new_states[name] = state.replace(step=saved_step, **counted)
        elif attrs.has(type(state)):
            new_states[name] = attrs.evolve(state, step=saved_step)
        else:
            state.step = saved_step
            new_states[name] = state
    return new_states


def _restore_this_ranks_rng(info: CheckpointInfo) -> None:
    rank = world_rank()
    rng = read_rng_file(info.path, rank)
    if rng is None:
        warnings.warn(
            f"checkpoint {str(info.path)!r} has no RNG state for rank {rank} (saved by {info.world_size} ranks); "
            "this rank keeps its current RNG, so the run is not an exact continuation",
            stacklevel=3,
        )
    else:
        restore_rng_state(*rng)


def load_checkpoint(
    path: str | os.PathLike,
    states: Mapping[str, Any],
    *,
    config: Mapping[str, Any] | Any | None = None,
    restore_rng: bool = True,
) -> tuple[dict[str, Any], Any]:
    """Load a checkpoint into ``states`` (in place) and return ``(new_states, extra)``.

    Call on every rank. ``new_states[name]`` is ``states[name].replace(step=saved_step)``. ``extra`` is
    the tree given to :func:`save_checkpoint` (tensors on the CPU). Before anything is loaded, raises
    :class:`CheckpointNotFoundError` (missing path), :class:`CheckpointCorruptError` (incomplete or
    damaged dir) or :class:`CheckpointMismatchError` (a state not in the checkpoint, a different model:
    parameter names / shapes, a different optimizer class, or, when ``config`` is given, any differing
    config key, each named). Same parameter names and shapes under a different HF model config (say
    ``rope_theta``) loads, with a warning naming the keys. Resharding to another world size is handled
    by DCP. A state that has no optimizer (a reference) loads only the model.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    _check_states(states)
    wait_for_pending_save()
    info = checkpoint_info(path)
    saved_states = info.marker["states"]

    # Fingerprints from the model alone: nothing is initialised or changed until validation passed.
    model_sds = {}
    for name, state in states.items():
        reshard(state.module)
        model_sds[name] = get_model_state_dict(state.module)
    fingerprints = {name: state_dict_fingerprint(sd) for name, sd in model_sds.items()}
    _validate_against(info, states, config, fingerprints)

    reader = safe_reader(info.path)
    try:
        metadata = reader.read_metadata()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
        raise CheckpointCorruptError(f"cannot read the DCP metadata of {str(info.path)!r}: {e}") from None
    available = metadata.state_dict_metadata
    if not verify_integrity(info.path, info.marker):
        warnings.warn(
            f"checkpoint {str(info.path)!r} records no hashes (written by an older rlfunc): its bytes are not verified",
            stacklevel=2,
        )

    flat: dict[str, Tensor] = {}
    plans = _load_targets(states, model_sds, saved_states, flat)
    extra_tensors = _extra_targets(available, flat)
    absent = [k for k in flat if k not in available]
    if absent:
        raise CheckpointCorruptError(
            f"checkpoint {str(info.path)!r} lacks {len(absent)} tensor(s) its marker promises, e.g. {absent[:3]}"
        )
    with quiet_no_dist():
        dcp.load(flat, storage_reader=reader, planner=tensor_only_planner(), no_dist=not dist.is_initialized())

    new_states = _apply_loaded(states, plans, saved_states)
    if restore_rng and info.marker.get("rng_saved", False):
        _restore_this_ranks_rng(info)
    gloo_barrier()
    return new_states, join_extra(info.marker["extra"], extra_tensors)
