"""Reading a DCP checkpoint without unpickling anything but DCP's own metadata classes.

DCP's ``.metadata`` index is a pickle, and its default planner unpickles every non-tensor item; a
checkpoint dir from elsewhere could run code that way. The reader here unpickles the index with an
allow-list (DCP metadata classes, ``torch.Size``, dtypes, paths), and the planner refuses any item that
is not a tensor (this checkpoint format stores only tensors through DCP).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch

from backends.checkpoint.errors import CheckpointCorruptError

__all__ = ["MetadataUnpickler", "check_data_files", "safe_reader", "tensor_only_planner"]


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` index: DCP metadata classes, ``torch.Size``, dtypes, paths only."""

    _ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if (module, name) in self._ALLOWED:
                return super().find_class(module, name)
            if module == "torch" and isinstance(
                getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
            ):
                return getattr(torch, name)
            if module.startswith("torch.distributed.checkpoint."):
                obj = super().find_class(module, name)
                if isinstance(obj, type) and obj.__module__.startswith("torch.distributed.checkpoint."):
                    return obj
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a checkpoint's DCP metadata")


def safe_reader(path: Path) -> Any:
    """A ``FileSystemReader`` of ``path`` whose metadata is read with :class:`MetadataUnpickler`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = MetadataUnpickler(io.BytesIO(f.read())).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            check_data_files(Path(self.path), metadata)
            return metadata

    return SafeFileSystemReader(str(path))


def check_data_files(path: Path, metadata: Any) -> None:
    """Every data file the DCP index points into is there and long enough: a missing or cut-off file is a
    :class:`CheckpointCorruptError` naming it, before DCP reads any byte (its own error names neither)."""
    ends: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointCorruptError(
                f"checkpoint {str(path)!r} lacks its data file {name!r}: the checkpoint is damaged"
            )
        size = file.stat().st_size
        if size < end:
            raise CheckpointCorruptError(
                f"checkpoint {str(path)!r}: data file {name!r} is cut off ({size} bytes; its index needs {end})"
            )


def tensor_only_planner() -> Any:
    """A load planner that raises :class:`CheckpointCorruptError` for any pickled (non-tensor) item."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class TensorOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            raise CheckpointCorruptError(
                f"checkpoint item {read_item.dest_index.fqn!r} is a pickled object, not a tensor; "
                f"refusing to unpickle it"
            )

    return TensorOnlyLoadPlanner()
