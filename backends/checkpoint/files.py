"""The checkpoint directory on disk: its names, crash-safe writes, the COMPLETE marker, and finding the
complete checkpoints under a root.

A checkpoint is complete exactly when its dir is named ``step_<N>`` and holds ``COMPLETE``: saves write
into ``step_<N>.tmp-<hex>`` and rename it (atomic on POSIX) only after the marker is on disk, and
retention renames a dir out of the ``step_<N>`` namespace before deleting it. So a crash at any point
leaves only dirs that :func:`list_checkpoints` ignores, and the next save removes them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator

import attrs

from backends.checkpoint.errors import CheckpointCorruptError, CheckpointNotFoundError

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MARKER",
    "CheckpointInfo",
    "commit_checkpoint",
    "step_of",
    "list_checkpoints",
    "latest_checkpoint",
    "checkpoint_info",
    "fsync_dir",
    "write_json_atomic",
    "remove_dir",
    "clean_stale_dirs",
    "checkpoint_writer",
]

FORMAT = "rlfunc.dcp-checkpoint"
FORMAT_VERSION = 1
MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d+)$")
#: a save in progress or crashed (tmp), a replaced step (old), a retention delete (deleting)
_STALE_DIR = re.compile(r"^step_\d+\.(tmp|old|deleting)-[0-9a-f]+$")


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename or new file in it) to disk, where the platform allows."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path``: all of it, on disk, or (after a crash) the old file or none."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def remove_dir(path: Path) -> None:
    """Rename out of the ``step_<N>`` namespace (atomic), then delete."""
    doomed = path.with_name(f"{path.name}.deleting-{uuid.uuid4().hex}")
    try:
        os.replace(path, doomed)
    except FileNotFoundError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


def clean_stale_dirs(root: Path) -> None:
    """Remove what crashed saves and deletes left under ``root`` (never a complete checkpoint)."""
    for entry in root.iterdir():
        if _STALE_DIR.match(entry.name) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


@attrs.frozen
class CheckpointInfo:
    """What a complete checkpoint's ``COMPLETE`` marker says."""

    path: Path
    step: int
    world_size: int
    state_names: tuple[str, ...]
    config: dict = attrs.field(eq=False)
    config_hash: str
    marker: dict = attrs.field(eq=False, repr=False)


def step_of(path: Path) -> int | None:
    """``N`` of a ``step_<N>`` dir name; None for any other name."""
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def list_checkpoints(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints (``step_<N>`` dirs holding ``COMPLETE``) under ``ckpt_dir``, oldest first."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        step = step_of(entry)
        if step is not None and entry.is_dir() and (entry / MARKER).is_file():
            found.append((step, entry))
    return [p for _, p in sorted(found)]


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``ckpt_dir``, or None (no dir, or nothing complete)."""
    found = list_checkpoints(ckpt_dir)
    return found[-1] if found else None


def commit_checkpoint(tmp: Path, final: Path, marker: dict, keep_last: int | None) -> None:
    """Rank 0, once every rank's files are in ``tmp``: write COMPLETE into it, rename it to ``final`` (an
    existing ``final``, a re-saved step, is moved aside first), then keep only the newest ``keep_last``."""
    write_json_atomic(tmp / MARKER, marker)
    fsync_dir(tmp)
    if final.exists():  # re-saving a step (e.g. after resuming from an older checkpoint)
        aside = final.with_name(f"{final.name}.old-{uuid.uuid4().hex}")
        os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)
    if keep_last is not None:
        for old in list_checkpoints(final.parent)[:-keep_last]:
            remove_dir(old)


def checkpoint_info(path: str | os.PathLike) -> CheckpointInfo:
    """Validate a checkpoint dir's files and read its marker; clear errors for a missing / corrupt one."""
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"checkpoint {str(path)!r} does not exist")
    if not path.is_dir():
        raise CheckpointNotFoundError(f"checkpoint {str(path)!r} is not a directory")
    marker_file = path / MARKER
    if not marker_file.is_file():
        if list_checkpoints(path):
            raise CheckpointCorruptError(
                f"{str(path)!r} is a checkpoint root, not a checkpoint: pass one of its step_<N> dirs "
                f"(newest: {latest_checkpoint(path).name}) or resume='auto'"
            )
        raise CheckpointCorruptError(
            f"{str(path)!r} is not a complete checkpoint: it has no {MARKER} marker (the save was interrupted, "
            "or this is not a checkpoint dir)"
        )
    try:
        marker = json.loads(marker_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"{str(marker_file)!r} is not valid JSON: {e}") from None
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{str(marker_file)!r} is not an rlfunc checkpoint marker (format {FORMAT!r})")
    if marker.get("version") != FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"{str(path)!r} has checkpoint format version {marker.get('version')}; "
            f"this code reads version {FORMAT_VERSION}"
        )
    if not (path / ".metadata").is_file():
        raise CheckpointCorruptError(
            f"{str(path)!r} has a {MARKER} marker but no DCP .metadata file: the checkpoint is damaged"
        )
    return CheckpointInfo(
        path=path,
        step=int(marker["step"]),
        world_size=int(marker["world_size"]),
        state_names=tuple(marker["states"]),
        config=marker.get("config", {}),
        config_hash=marker.get("config_hash", ""),
        marker=marker,
    )


class _RecordedWrites:
    """A write stream that remembers the first ``OSError`` its writes raised on ``errors`` (then re-raises it)."""

    def __init__(self, stream: Any, errors: list[OSError]) -> None:
        self._stream, self._errors = stream, errors

    def write(self, data: Any) -> int:
        try:
            return self._stream.write(data)
        except OSError as e:
            if e.filename is None:
                e.filename = getattr(self._stream, "name", None)
            self._errors.append(e)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def checkpoint_writer(path: Path) -> tuple[Any, list[OSError]]:
    """A DCP ``FileSystemWriter`` into ``path`` and the list of ``OSError``s its file writes raised: torch's zip
    writer turns a failed write (a full disk) into "unexpected pos" errors, which the list sees through."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    errors: list[OSError] = []

    class RecordingFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            with super().create_stream(path, mode) as stream:
                yield _RecordedWrites(stream, errors) if "r" not in mode else stream

    writer = FileSystemWriter(str(path))
    writer.fs = RecordingFileSystem()
    return writer, errors
