"""Synthetic tasks: data generators and rewards, for the demo and the tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping

__all__ = ["write_jsonl_files"]


def write_jsonl_files(out: Path, files: Mapping[str, Iterable[Any]]) -> Path:
    """Each ``name -> rows`` as ``out/name``, one JSON object per line, written to a temp file and renamed into
    place (a reader never sees half a file). Returns ``out``."""
    for name, rows in files.items():
        tmp = out / f"{name}.tmp"
        tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
        tmp.replace(out / name)
    return out
