"""The errors a checkpoint save, load or lookup raises: one base class, one subclass per kind of failure."""

from __future__ import annotations

__all__ = ["CheckpointError", "CheckpointNotFoundError", "CheckpointCorruptError", "CheckpointMismatchError"]


class CheckpointError(RuntimeError):
    """Base class of every checkpoint error raised by ``backends.checkpoint``."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint path does not exist (or is not a directory)."""


class CheckpointCorruptError(CheckpointError):
    """The directory is not a complete checkpoint (no COMPLETE marker, no DCP metadata, bad JSON)."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint does not fit what it is loaded into (other model, other config, missing state)."""
