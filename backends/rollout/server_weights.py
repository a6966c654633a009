"""A rollout server's incoming weight set: buckets received, checked and held until the whole set commits.

The trainer pushes a new policy version as ``begin(version)``, then buckets (each the bytes of a safetensors file
and their SHA-256), then ``commit(version)``. Every bucket is checked as it arrives: its checksum, then each tensor's
name (one the model has), shape and dtype (the engine's weight dtype) and values (no NaN / Inf); a refused bucket
is an error naming the tensor and leaves the staged set as it was. Nothing reaches the engine before ``commit``,
which refuses a set that lacks a tensor (naming it), so the server keeps serving the previous version until a
complete set is applied: never a half-applied one.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Iterator

import attrs
import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors
from torch import Tensor

__all__ = ["ExpectedTensor", "WeightPushError", "WeightStaging", "expected_tensors"]


class WeightPushError(ValueError):
    """A refused weight push step; ``status`` is the HTTP status the server answers with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@attrs.frozen
class ExpectedTensor:
    shape: tuple[int, ...]
    dtype: torch.dtype
    required: bool  #: False for a tied ``lm_head.weight`` (the embedding stands for it)


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _dtype_of_safetensors(name: str, where: str) -> torch.dtype:
    dtype = _SAFETENSORS_DTYPES.get(name)
    if dtype is None:
        raise ValueError(f"{where}: safetensors dtype {name} is not one a rollout server takes")
    return dtype


def expected_tensors(model_dir: str | os.PathLike, weight_dtype: torch.dtype) -> dict[str, ExpectedTensor]:
    """The tensors a full push to a model of ``model_dir`` must hold: every tensor of its safetensors files, in
    the engine's ``weight_dtype`` (float tensors), plus ``lm_head.weight`` as optional when embeddings are tied."""
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weight files (a rollout server reads their names)")
    expected: dict[str, ExpectedTensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                dtype = _dtype_of_safetensors(piece.get_dtype(), f"{path.name}: {name}")
                expected[name] = ExpectedTensor(
                    tuple(piece.get_shape()), weight_dtype if dtype.is_floating_point else dtype, True
                )
    config = json.loads((model_dir / "config.json").read_text())
    embed = expected.get("model.embed_tokens.weight")
    if config.get("tie_word_embeddings") and embed is not None and "lm_head.weight" not in expected:
        expected["lm_head.weight"] = attrs.evolve(embed, required=False)
    return expected


def _safetensors_names(blob: bytes) -> list[str]:
    """The tensor names in a safetensors blob's header, without reading the tensors (a malformed header is an
    error here rather than deep in the loader)."""
    if len(blob) < 8:
        raise WeightPushError("the bucket is not a safetensors file (shorter than its 8-byte header length)")
    (size,) = struct.unpack("<Q", blob[:8])
    if size > len(blob) - 8:
        raise WeightPushError("the bucket is not a safetensors file (its header length runs past its end)")
    try:
        header = json.loads(blob[8 : 8 + size])
    except ValueError as e:
        raise WeightPushError(f"the bucket's safetensors header is not JSON: {e}") from None
    return [k for k in header if k != "__metadata__"]


@attrs.define
class WeightStaging:
    """The weight set being received for ``version`` (None: no push under way)."""

    expected: dict[str, ExpectedTensor]
    version: int | None = None
    staged: dict[str, Tensor] = attrs.field(factory=dict)
    buckets: int = 0
    nbytes: int = 0

    def begin(self, version: int, served_version: int) -> None:
        """Start receiving ``version`` (newer than ``served_version``); a push under way is dropped."""
        if version <= served_version:
            raise WeightPushError(
                f"weights version {version} is not newer than the served version {served_version}", status=409
            )
        self.version, self.staged, self.buckets, self.nbytes = version, {}, 0, 0

    def put(self, version: int, blob: bytes, sha256: str | None) -> list[str]:
        """One bucket of ``version``, checked whole before any of it is staged; the names it held."""
        self._check_version(version, "a bucket")
        if not sha256:
            raise WeightPushError("a weight bucket needs its SHA-256 (header X-Bucket-SHA256)")
        digest = hashlib.sha256(blob).hexdigest()
        if digest != sha256.lower():
            raise WeightPushError(f"weight bucket checksum mismatch: sent {sha256}, received bytes hash to {digest}")
        names = _safetensors_names(blob)
        try:
            tensors = load_safetensors(blob)
        except Exception as e:
            raise WeightPushError(f"the bucket is not a readable safetensors file: {e}") from None
        for name in names:
            self._check_tensor(name, tensors[name])
        self.staged.update(tensors)
        self.buckets += 1
        self.nbytes += len(blob)
        return names

    def commit(self, version: int) -> Iterator[tuple[str, Tensor]]:
        """The complete set of ``version`` as ``(name, tensor)`` (the push is then over); a missing tensor is
        an error naming it, and the staged set is kept (the missing bucket may still come)."""
        self._check_version(version, "commit")
        missing = sorted(n for n, e in self.expected.items() if e.required and n not in self.staged)
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise WeightPushError(
                f"commit of weights version {version} refused: tensor {missing[0]!r} was not received"
                f" (missing: {', '.join(missing[:3])}{more}); the server keeps serving the previous version",
                status=409,
            )
        staged, self.staged, self.version = self.staged, {}, None
        return iter(sorted(staged.items()))

    def _check_version(self, version: int, what: str) -> None:
        if self.version is None:
            raise WeightPushError(f"{what} for weights version {version} without a begin", status=409)
        if version != self.version:
            raise WeightPushError(
                f"{what} for weights version {version}, but the push under way is version {self.version}", status=409
            )

    def _check_tensor(self, name: str, tensor: Tensor) -> None:
        want = self.expected.get(name)
        if want is None:
            close = difflib.get_close_matches(name, self.expected, n=3)
            hint = f"; did you mean {close}?" if close else ""
            raise WeightPushError(f"weight bucket: the model has no tensor {name!r}{hint}")
        if tuple(tensor.shape) != want.shape:
            raise WeightPushError(
                f"weight bucket: {name!r} has shape {tuple(tensor.shape)}, the model's is {want.shape}"
            )
        if tensor.dtype != want.dtype:
            raise WeightPushError(
                f"weight bucket: {name!r} has dtype {tensor.dtype}, the rollout engine keeps it in {want.dtype}"
            )
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise WeightPushError(f"weight bucket: {name!r} holds NaN or Inf values")
