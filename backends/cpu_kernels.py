"""Small C kernels for the CPU paths, built on first use with the system C compiler and called through ctypes.

One kernel today: the native rollout's decode-step attention (``csrc/decode_attention.c``, AVX-512),
3-5x faster than PyTorch's batched matmuls at the rollout's sizes, where each (row, kv head) is a
2 x 64 by 64 x L product and the per-item overhead dominates. It also reads bf16 caches (a bf16
model's keys and values, stored exactly, at half the bytes). Nothing here is needed: when there is
no compiler, no AVX-512, a head dim that is not a multiple of 16, or ``RLFUNC_CPU_KERNELS=0``,
:func:`decode_attention_kernel` returns None and the caller runs its PyTorch path (one log line says
why).

Build: ``$CC`` (default ``cc``) ``-O3 -march=native -shared -fPIC``, no Python or torch headers
(about half a second). The library is cached under ``$RLFUNC_KERNEL_CACHE`` (default
``~/.cache/rlfunc/kernels``), named by a hash of the source, the compiler's version, the flags and
this CPU's feature flags, so a changed source or another machine sharing the home directory builds
its own. It is written to a temporary name and renamed into place, so concurrent ranks never load a
half-written file.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["DecodeAttention", "decode_attention_kernel", "kernel_cache_dir"]

_SOURCE = Path(__file__).resolve().parent / "csrc" / "decode_attention.c"
_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=c11")
_log = logging.getLogger("rlfunc.cpu_kernels")


def kernel_cache_dir() -> Path:
    return Path(os.environ.get("RLFUNC_KERNEL_CACHE") or Path.home() / ".cache" / "rlfunc" / "kernels")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build(source: Path, compiler: str) -> Path:
    """The compiled shared library of ``source`` (built now unless the cache has it)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(
        b"\0".join([source.read_bytes(), version.encode(), " ".join(_FLAGS).encode(), _cpu_flags().encode()])
    ).hexdigest()[:20]
    out = kernel_cache_dir() / f"{source.stem}-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        proc = subprocess.run([compiler, *_FLAGS, "-o", str(tmp), str(source)], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {source.name}: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: another rank may have just put the same file there
    finally:
        tmp.unlink(missing_ok=True)
    return out


class DecodeAttention:
    """The loaded decode-attention kernel; see ``csrc/decode_attention.c`` for the layouts."""

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._fn = lib.rlfunc_decode_attention
        self._fn.argtypes = [ptr] * 6 + [i64] * 5 + [i64] * 8 + [ctypes.c_float, ctypes.c_int]
        self._fn.restype = ctypes.c_int
        lib.rlfunc_decode_attention_support.restype = ctypes.c_int
        support = lib.rlfunc_decode_attention_support()
        self.available = bool(support & 1)  #: built with AVX-512F: float32 caches
        self.bf16_cache = bool(support & 2)  #: also AVX-512BW/VL: bfloat16 caches
        self.library = library

    def __call__(self, q: Tensor, k_t: Tensor, v: Tensor, bias: Tensor, length: int, scale: float,
                 out: Tensor, scratch: Tensor) -> Tensor:
        """``out (b kv g d)`` = attention of ``q (b kv g d)`` over slots ``[0, length)`` of the caches.

        ``k_t (b kv d T)`` (keys transposed) and ``v (b kv T d)``: fp32, or bf16 if
        :attr:`bf16_cache`; ``q``, ``out``, ``bias (b, >= length)`` (0 / -inf) and ``scratch`` (at least
        ``g * ceil(length / 16) * 16`` elements) fp32. All on the CPU with unit stride in their last
        dim; ``q`` contiguous within a row, ``out`` contiguous.
        """
        b, kv, g, d = q.shape
        bf16 = k_t.dtype == torch.bfloat16
        if not (q.dtype == out.dtype == bias.dtype == scratch.dtype == torch.float32 and k_t.dtype == v.dtype
                and k_t.dtype in (torch.float32, torch.bfloat16)):
            raise TypeError(f"decode attention: q/out/bias/scratch must be float32 and the caches float32 or "
                            f"bfloat16, got q {q.dtype}, k {k_t.dtype}, v {v.dtype}")
        # the kernel trusts these layouts (it reads raw pointers): refuse anything else
        if not (q.stride()[1:] == (g * d, d, 1) and out.is_contiguous() and out.shape == q.shape
                and k_t.stride(3) == 1 and v.stride(3) == 1 and bias.stride(1) == 1
                and k_t.shape[:3] == (b, kv, d) and v.shape[0:2] == (b, kv) and v.shape[3] == d
                and min(k_t.shape[3], v.shape[2], bias.shape[1]) >= length
                and scratch.is_contiguous() and scratch.numel() >= g * ((length + 15) // 16 * 16)):
            raise ValueError(
                f"decode attention: unsupported layout (q {tuple(q.shape)} strides {q.stride()}, k_t {tuple(k_t.shape)}, "
                f"v {tuple(v.shape)}, bias {tuple(bias.shape)}, length {length}, scratch {scratch.numel()})"
            )
        rc = self._fn(
            q.data_ptr(), k_t.data_ptr(), v.data_ptr(), bias.data_ptr(), out.data_ptr(), scratch.data_ptr(),
            b, kv, g, d, length, q.stride(0), k_t.stride(0), k_t.stride(1), k_t.stride(2),
            v.stride(0), v.stride(1), v.stride(2), bias.stride(0), scale, int(bf16),
        )
        if rc != 0:
            raise RuntimeError(f"decode attention kernel refused head_dim={d}, length={length}")
        return out


@functools.lru_cache(maxsize=None)
def _load() -> DecodeAttention | None:
    if os.environ.get("RLFUNC_CPU_KERNELS", "1") == "0":
        _log.info("RLFUNC_CPU_KERNELS=0: the native rollout's decode attention runs in PyTorch")
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        _log.warning("no C compiler (CC=%r, cc not on PATH): the native rollout's decode attention runs in PyTorch",
                     os.environ.get("CC"))
        return None
    try:
        kernel = DecodeAttention(_build(_SOURCE, compiler))
    except Exception as e:  # noqa: BLE001 - any build or load failure means: use the PyTorch path
        _log.warning("could not build the decode-attention kernel (%s): it runs in PyTorch", e)
        return None
    if not kernel.available:
        _log.info("this CPU has no AVX-512F: the native rollout's decode attention runs in PyTorch")
        return None
    return kernel


def decode_attention_kernel(head_dim: int) -> DecodeAttention | None:
    """The decode-attention kernel for this head dim, or None (use PyTorch) if it cannot run here."""
    if head_dim % 16:
        return None
    return _load()
