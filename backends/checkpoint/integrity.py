"""A checkpoint's bytes, hashed when it is saved and checked when it is loaded.

The ``COMPLETE`` marker's ``integrity`` entry records a SHA-256 per stored tensor chunk (the byte range DCP's
index gives it in a ``.distcp`` file) and per whole file for the rest (the ``.metadata`` index, every rank's
RNG file). A load re-hashes the same ranges first, so damaged bytes (finite or not) are an error naming the
file and the tensor before anything is read into a model, instead of weights that load silently or a NaN met
steps later. The hashes are of the files as written, read back once the save is on disk.

Every rank hashes its share (the items ``i`` with ``i % world_size == rank``), so neither recording nor
checking is one rank's whole read of a sharded checkpoint.
"""

from __future__ import annotations

import collections
import hashlib
import io
from pathlib import Path
from typing import Any

from backends.checkpoint.coordination import all_merged, first_message
from backends.checkpoint.errors import CheckpointCorruptError
from backends.checkpoint.rng import rng_file
from backends.distributed.collectives import world_rank, world_size

__all__ = ["ALGORITHM", "describe_items", "hash_share", "check_share", "record_integrity", "verify_integrity", "damage"]

ALGORITHM = "sha256"
_CHUNK = 16 << 20


def _sha256(path: Path, offset: int = 0, length: int | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left is None or left > 0:
            block = f.read(_CHUNK if left is None else min(_CHUNK, left))
            if not block:
                break
            digest.update(block)
            if left is not None:
                left -= len(block)
    return digest.hexdigest()


def describe_items(root: Path, world_size: int) -> list[tuple[str, str, int, int | None]]:
    """``(name, file, offset, length)`` of everything a checkpoint dir's hashes cover, in a fixed order: each tensor
    chunk of the DCP index (``name`` is its key, plus ``[offsets]`` for one of several shards), then the index file and
    each rank's RNG file whole (``length`` None)."""
    from backends.checkpoint.safe_reader import MetadataUnpickler

    metadata = MetadataUnpickler(io.BytesIO((root / ".metadata").read_bytes())).load()
    stored = getattr(metadata, "storage_data", None) or {}
    chunks = collections.Counter(index.fqn for index in stored)
    items = []
    for index, info in stored.items():
        shard = "" if chunks[index.fqn] == 1 else "[" + ",".join(str(int(o)) for o in index.offset) + "]"
        items.append((index.fqn + shard, str(info.relative_path), int(info.offset), int(info.length)))
    items.sort()
    items.append((".metadata", ".metadata", 0, None))
    for rank in range(world_size):
        rng = rng_file(root, rank)
        if rng.is_file():
            name = str(rng.relative_to(root))
            items.append((name, name, 0, None))
    return items


def hash_share(root: Path, world_size: int, rank: int = 0, share_of: int = 1) -> dict[str, list]:
    """``{name: [file, offset, length, sha256]}`` for this rank's share of :func:`describe_items`
    (``share_of`` ranks split them; ``share_of=1``: all of them)."""
    return {
        name: [file, offset, length, _sha256(root / file, offset, length)]
        for i, (name, file, offset, length) in enumerate(describe_items(root, world_size))
        if i % share_of == rank
    }


def check_share(root: Path, recorded: dict[str, list], rank: int = 0, share_of: int = 1) -> str | None:
    """The first damage found in this rank's share of ``recorded`` (a message naming the file and the tensor),
    or None. Whole files come first: a damaged index would misplace every range after it."""
    entries = sorted(recorded.items(), key=lambda kv: (kv[1][2] is not None, kv[0]))
    for i, (name, (file, offset, length, want)) in enumerate(entries):
        if i % share_of != rank:
            continue
        path = root / file
        what = (
            f"file {file!r}" if length is None else f"tensor {name!r} (bytes {offset}..{offset + length} of {file!r})"
        )
        if not path.is_file():
            return f"checkpoint {str(root)!r} is damaged: {file!r} is missing ({what} was saved in it)"
        size = path.stat().st_size
        if length is not None and size < offset + length:
            return (
                f"checkpoint {str(root)!r} is damaged: "
                f"{file!r} is cut off ({size} bytes; {what} needs {offset + length})"
            )
        if _sha256(path, offset, length) != want:
            return (
                f"checkpoint {str(root)!r} is damaged: {what} does not match the {ALGORITHM} recorded when it was "
                "saved (its bytes changed on disk)"
            )
    return None


def record_integrity(root: Path, saved_by: int) -> dict[str, Any]:
    """The marker's ``integrity`` entry for the checkpoint written into ``root`` by ``saved_by`` ranks. Called on
    every rank (each hashes its share) or, with no process group or from rank 0's async-save thread, by one."""
    if saved_by > 1 and world_size() == saved_by:
        items = all_merged(hash_share(root, saved_by, world_rank(), saved_by))
    else:
        items = hash_share(root, saved_by)
    return {"algorithm": ALGORITHM, "items": items}


def verify_integrity(root: Path, marker: dict[str, Any]) -> bool:
    """Check the checkpoint's bytes against its marker's hashes (every rank its share; every rank raises the same
    :class:`CheckpointCorruptError` naming the file and the tensor). False for a checkpoint without hashes."""
    recorded = marker.get("integrity")
    if not recorded:
        return False
    if recorded.get("algorithm") != ALGORITHM:
        raise CheckpointCorruptError(f"checkpoint {str(root)!r}: unknown hash algorithm {recorded.get('algorithm')!r}")
    message = first_message(check_share(root, recorded["items"], world_rank(), world_size()))
    if message is not None:
        raise CheckpointCorruptError(message)
    return True


def damage(root: Path) -> str | None:
    """What is wrong with the complete checkpoint ``root`` (a damaged marker, or bytes that changed since the
    save), checked by this process alone; None when it is whole or has no hashes to check."""
    import json

    from backends.checkpoint.files import checkpoint_info

    try:
        marker = checkpoint_info(root).marker
    except (CheckpointCorruptError, json.JSONDecodeError, KeyError, ValueError) as e:
        return str(e)
    recorded = marker.get("integrity")
    return check_share(root, recorded["items"]) if recorded else None
