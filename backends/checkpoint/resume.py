"""Where a recipe's run starts: fresh, or from a checkpoint, decided once for every rank.

A recipe with checkpoints (``checkpoint.every``, ``resume``, ``run_dir``) calls, on every rank, before
it builds anything::

    must_match = {k: v for k, v in config_to_dict(cfg).items() if k not in resumable_keys}
    resume_from, run_dir = resume_point(cfg.resume, cfg.checkpoint, run_dir=cfg.run_dir,
                                        run_root=cfg.run_root, name=cfg.name, must_match=must_match)
    truncate_metrics(run_dir / "metrics.jsonl", checkpoint_info(resume_from).step if resume_from else None)

- ``resume``: ``never`` | ``auto`` (the newest complete checkpoint under the checkpoint dir whose bytes match
  their hashes, a damaged newer one passed over with a warning; a fresh start if there is none) | a
  ``step_<N>`` dir.
- A resumed run continues in the run dir the checkpoint recorded (unless ``run_dir`` is given), and
  its ``metrics.jsonl`` is cut back to the checkpoint's step: the steps the crashed run logged after
  its last checkpoint are run, and logged, again.
- A checkpoint written with a different config (any key outside the recipe's resumable keys, which
  only say where things go) is refused before anything is loaded, naming every differing key.
- ``fork_from=<step_N dir>`` (:func:`fork_point`) is the way to change keys: a new run, in a run dir of its own,
  that starts from another run's checkpoint with any key but the model's changed (a learning rate from step N+1
  on, another seed).

Rank 0 decides and broadcasts, so every rank resumes from the same checkpoint even while another run
writes a newer one; an error is raised on every rank (``SystemExit`` with the message).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import attrs
import torch.distributed as dist

from backends.checkpoint.dcp import resolve_resume, wait_for_pending_save
from backends.checkpoint.errors import CheckpointCorruptError, CheckpointMismatchError
from backends.checkpoint.files import checkpoint_info, list_checkpoints
from backends.checkpoint.fingerprint import config_diff, flatten_config
from backends.checkpoint.integrity import damage
from backends.distributed.collectives import broadcast_object

__all__ = [
    "CheckpointConfig",
    "check_writable",
    "checkpoint_dir",
    "fork_point",
    "resume_point",
    "newest_whole_checkpoint",
    "truncate_metrics",
]


@attrs.frozen
class CheckpointConfig:
    every: int = 0  # save every N RL steps (and at the last step); 0: never
    dir: str = ""  # where step_<N> dirs go; empty: <run_dir>/checkpoints. Keep it stable across restarts.
    #: the newest checkpoints kept (at least 1); older ones are deleted once a newer one is complete
    keep_last: int = attrs.field(default=3, validator=attrs.validators.ge(1))


def checkpoint_dir(cfg: CheckpointConfig, run_dir: str | Path) -> Path:
    """Where this run's ``step_<N>`` dirs go."""
    return Path(cfg.dir) if cfg.dir else Path(run_dir) / "checkpoints"


def resume_point(
    resume: str, cfg: CheckpointConfig, *, run_dir: str, run_root: str, name: str, must_match: dict
) -> tuple[Path | None, Path]:
    """``(checkpoint to resume from or None, run dir)``, the same on every rank; see the module docstring."""
    resume_from, error = None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            ckpt_dir = cfg.dir or (str(checkpoint_dir(cfg, run_dir)) if run_dir else None)
            if resume == "auto" and ckpt_dir is None:
                raise ValueError("resume=auto needs checkpoint.dir (or run_dir) to look for checkpoints in")
            path = newest_whole_checkpoint(ckpt_dir) if resume == "auto" else resolve_resume(resume, ckpt_dir)
            if path is not None:
                info = checkpoint_info(path)
                diff = config_diff(info.config, flatten_config(must_match))
                if diff:
                    raise CheckpointMismatchError(
                        f"cannot resume from {str(path)!r}: it was written with a different config "
                        f"({len(diff)} key(s) differ):\n  " + "\n  ".join(diff)
                    )
                resume_from, run_dir = str(path), run_dir or info.marker["extra"]["run_dir"]
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            error = f"{type(e).__name__}: {e}"
        if not run_dir:
            run_dir = str(Path(run_root) / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
        if error is None and cfg.every:  # a save that cannot be written is known now, not after the first steps
            try:
                check_writable(
                    checkpoint_dir(cfg, run_dir), "the checkpoint dir (checkpoint.dir, default <run_dir>/checkpoints)"
                )
            except OSError as e:
                error = f"{type(e).__name__}: {e}"
    error, resume_from, run_dir = broadcast_object((error, resume_from, run_dir))
    if error is not None:
        raise SystemExit(f"error: {error}")
    return (Path(resume_from) if resume_from else None), Path(run_dir)


def fork_point(fork_from: str, *, run_dir: Path, model: dict) -> tuple[Path, Path]:
    """``(checkpoint, the run dir that wrote it)`` for a new run at ``run_dir`` that starts from another run's
    checkpoint (``fork_from``: a ``step_<N>`` dir), the same on every rank. The checkpoint must be whole and written
    for the same model (``model``: this run's ``model`` config); every other key may differ, which is what a fork
    is for. Rank 0 decides; an error is raised on every rank (``SystemExit`` with the message)."""
    decided, error = None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            path = resolve_resume(fork_from)
            if path is None:
                raise ValueError(f"fork_from={fork_from!r} names no checkpoint: give a step_<N> dir")
            problem = damage(path)
            if problem is not None:
                raise CheckpointCorruptError(f"fork_from={fork_from!r}: {problem}")
            info = checkpoint_info(path)
            if "run_dir" not in info.marker.get("extra", {}):
                raise ValueError(
                    f"fork_from={fork_from!r}: the checkpoint names no run dir (a recipe's checkpoints do): a fork "
                    "starts from a run's checkpoint and its models"
                )
            parent = Path(info.marker["extra"]["run_dir"])
            if parent.resolve() == Path(run_dir).resolve():
                raise ValueError(
                    f"fork_from={fork_from!r} is a checkpoint of this run dir ({str(parent)!r}): a fork starts a new "
                    "run; continue this one with resume=auto, or give another run_dir"
                )
            saved = {k: v for k, v in info.config.items() if k == "model" or k.startswith("model.")}
            diff = config_diff(saved, flatten_config({"model": model}))
            if diff:
                raise CheckpointMismatchError(
                    f"cannot fork from {str(path)!r}: it was written for another model "
                    f"({len(diff)} key(s) differ):\n  " + "\n  ".join(diff)
                )
            decided = (str(path), str(parent))
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            error = f"{type(e).__name__}: {e}"
    error, decided = broadcast_object((error, decided))
    if error is not None:
        raise SystemExit(f"error: {error}")
    return Path(decided[0]), Path(decided[1])


def newest_whole_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """``resume=auto``'s checkpoint: the newest complete one whose bytes match the hashes recorded at its save. A
    damaged one is passed over loudly (on stderr, naming the damage) for the one before it; all damaged is an
    error (starting afresh would drop the run's progress without a word)."""
    wait_for_pending_save()
    damaged = []
    for path in reversed(list_checkpoints(ckpt_dir)):
        problem = damage(path)
        if problem is None:
            for note in damaged:
                sys.stderr.write(
                    f"[rlfunc] WARNING resume=auto: passing over a damaged checkpoint: {note}; resuming "
                    f"from {str(path)!r} instead\n"
                )
            return path
        damaged.append(problem)
    if damaged:
        raise CheckpointCorruptError(
            f"resume=auto: every checkpoint in {str(ckpt_dir)!r} is damaged:\n  " + "\n  ".join(damaged)
        )
    return None


def check_writable(path: str | os.PathLike, what: str) -> None:
    """An ``OSError`` naming ``what`` and ``path`` unless ``path`` (a dir, which may not exist yet) can be created and
    written: a probe file is created and removed in its nearest existing ancestor (permission bits alone say nothing
    for root or a read-only mount). Nothing else is created."""
    path = Path(path).absolute()
    ancestor = next(p for p in (path, *path.parents) if p.exists())
    if not ancestor.is_dir():
        raise NotADirectoryError(
            f"{what} {str(path)!r} cannot be created: {str(ancestor)!r} is a file, not a directory"
        )
    try:
        fd, probe = tempfile.mkstemp(prefix=".rlfunc-write-probe-", dir=ancestor)
    except OSError as e:
        raise PermissionError(
            f"{what} {str(path)!r} cannot be written: creating a file in {str(ancestor)!r} failed ({e.strerror or e})"
        ) from None
    os.close(fd)
    os.unlink(probe)


def truncate_metrics(path: Path, step: int | None) -> None:
    """Drop the rows of ``path`` (a ``metrics.jsonl``) logged after ``step``: the crashed run got further
    than its last checkpoint. ``step=None`` (a fresh start) removes the file. Call on one rank."""
    if not path.exists():
        return
    if step is None:
        path.unlink()
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by the crash
            continue
        if row.get("step", 0) <= step:
            keep.append(line)
    tmp = path.with_name(path.name + ".tmp")  # a crash or a full disk mid-write leaves the old file whole
    try:
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(
            e.errno,
            f"cutting {str(path)!r} back to step {step} failed: {e.strerror or e}; the file is unchanged",
            str(path),
        ) from e
