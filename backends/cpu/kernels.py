"""Small C kernels for the CPU paths, built on first use with the system C compiler and called through ctypes.

- ``csrc/decode_attention.c``: the native rollout's decode-step attention (AVX-512), used by its kernel
  strategy (``backends/cpu/decode.py``). At the rollout's sizes each (row, kv head) is a small product
  (a few queries by L keys) and PyTorch's batched matmuls spend their time on per-item overhead; the
  kernel reads the cache once per (row, kv head). It also reads bf16 caches (a bf16 model's keys and
  values, stored exactly, at half the bytes).
- ``csrc/packed_attention.c``: causal attention over a packed training micro-batch, forward and
  backward, reading the packed q, k, v in place (shared prompts included); see backends/cpu/fused_modules.py.
- ``csrc/norm_act.c``: fused RMSNorm and SwiGLU, forward and backward, for training and for the native
  rollout's decode steps (one pass over the activations each, where PyTorch runs Hugging Face's modules as
  several elementwise kernels), on float32 or bfloat16 tensors (float32 math either way).

Nothing here is needed: when there is no compiler, no AVX-512, an unsupported size, or
``RLFUNC_CPU_KERNELS=0``, the accessors (:func:`decode_attention_kernel`, :func:`packed_attention_kernel`,
:func:`norm_act_kernel`) return None and the caller runs its PyTorch path (one log line says why).
The wrappers check dtypes and layouts before passing raw pointers: the kernels trust them.

Build: ``$CC`` (default ``cc``) ``-O3 -march=native -shared -fPIC``, no Python or torch headers.
The library is cached under ``$RLFUNC_KERNEL_CACHE`` (default
``~/.cache/rlfunc/kernels``), named by a hash of the sources (the ``.c`` file and the shared headers),
the compiler's version, the flags and this CPU's feature flags, so a changed source or another machine
sharing the home directory builds its own. It is written to a temporary name and renamed into place,
so concurrent ranks never load a half-written file.
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
from typing import Any

import torch
from torch import Tensor

__all__ = ["DecodeAttention", "key_blocks", "NormAct", "PackedAttention", "decode_attention_kernel",
           "kernel_cache_dir", "norm_act_kernel", "packed_attention_kernel"]

_CSRC = Path(__file__).resolve().parent / "csrc"
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
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]
    key = hashlib.sha256(
        b"\0".join([source.read_bytes(), *headers, version.encode(), " ".join(_FLAGS).encode(), _cpu_flags().encode()])
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


def key_blocks(k: Tensor, length: int | None = None) -> Tensor:
    """Keys ``(b kv T d)`` in the decode kernels' cache layout ``(b kv ceil(T'/16) d 16)``, ``T'`` = ``length``
    (default ``T``, at least ``T``): slot ``l`` at ``[..., l // 16, :, l % 16]``, each block of 16 slots
    transposed and contiguous; slots past ``T`` are zero."""
    b, kv, t, d = k.shape
    blocks = -(-max(t, length or 0) // 16)
    padded = k.new_zeros(b, kv, blocks * 16, d)
    padded[:, :, :t] = k
    return padded.view(b, kv, blocks, 16, d).transpose(-1, -2).contiguous()


def _key_blocks_layout(k_t: Tensor, b: int, kv: int, d: int, length: int) -> bool:
    return (k_t.dim() == 5 and k_t.shape[:2] == (b, kv) and k_t.shape[3:] == (d, 16) and k_t.shape[2] * 16 >= length
            and k_t.stride(4) == 1 and k_t.stride(3) == 16)


class DecodeAttention:
    """The loaded decode-attention kernel; see ``csrc/decode_attention.c`` for the layouts."""

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._fn = lib.rlfunc_decode_attention
        self._fn.argtypes = [ptr] * 6 + [i64] * 5 + [i64] * 8 + [ctypes.c_float, ctypes.c_int, ptr, i64]
        self._fn.restype = ctypes.c_int
        self._step = lib.rlfunc_decode_step
        self._step.argtypes = [ptr] * 9 + [i64] * 12 + [ctypes.c_float, ptr, i64]
        self._step.restype = ctypes.c_int
        lib.rlfunc_decode_attention_support.restype = ctypes.c_int
        support = lib.rlfunc_decode_attention_support()
        self.available = bool(support & 1)  #: built with AVX-512F: float32 caches
        self.bf16_cache = bool(support & 2)  #: also AVX-512BW/VL: bfloat16 caches
        self.library = library

    def __call__(self, q: Tensor, k_t: Tensor, v: Tensor, bias: Tensor, length: int, scale: float,
                 out: Tensor, scratch: Tensor, rows: Tensor | None = None) -> Tensor:
        """``out (b kv g d)`` = attention of ``q (b kv g d)`` over slots ``[0, length)`` of the caches.

        ``k_t (R kv T/16 d 16)`` (keys transposed in blocks of 16 slots: :func:`key_blocks`) and
        ``v (R kv T d)``: fp32, or bf16 if
        :attr:`bf16_cache`; ``q``, ``out``, ``bias (R, >= length)`` (0 / -inf) and ``scratch`` (at least
        ``g * ceil(length / 16) * 16`` elements) fp32. All on the CPU with unit stride in their last
        dim; ``q`` contiguous within a row, ``out`` contiguous. Row ``i`` of ``q`` reads cache (and bias)
        row ``rows[i]`` (``rows``: int64 ``(b,)``, each in ``[0, R)``), or row ``i`` without ``rows``
        (then ``b == R``).
        """
        b, kv, g, d = q.shape
        cache_rows = k_t.shape[0]
        bf16 = k_t.dtype == torch.bfloat16
        if not (q.dtype == out.dtype == bias.dtype == scratch.dtype == torch.float32 and k_t.dtype == v.dtype
                and k_t.dtype in (torch.float32, torch.bfloat16)):
            raise TypeError(f"decode attention: q/out/bias/scratch must be float32 and the caches float32 or "
                            f"bfloat16, got q {q.dtype}, k {k_t.dtype}, v {v.dtype}")
        # the kernel trusts these layouts (it reads raw pointers): refuse anything else
        if not (q.stride()[1:] == (g * d, d, 1) and out.is_contiguous() and out.shape == q.shape
                and _key_blocks_layout(k_t, cache_rows, kv, d, length) and v.stride(3) == 1 and bias.stride(1) == 1
                and v.shape[0:2] == (cache_rows, kv) and v.shape[3] == d and bias.shape[0] == cache_rows
                and min(v.shape[2], bias.shape[1]) >= length and _row_index_ok(rows, b, cache_rows)
                and scratch.is_contiguous() and scratch.numel() >= g * ((length + 15) // 16 * 16)):
            raise ValueError(
                f"decode attention: unsupported layout (q {tuple(q.shape)} strides {q.stride()}, k_t {tuple(k_t.shape)}, "
                f"v {tuple(v.shape)}, bias {tuple(bias.shape)}, length {length}, scratch {scratch.numel()})"
            )
        rc = self._fn(
            q.data_ptr(), k_t.data_ptr(), v.data_ptr(), bias.data_ptr(), out.data_ptr(), scratch.data_ptr(),
            b, kv, g, d, length, q.stride(0), k_t.stride(0), k_t.stride(1), k_t.stride(2),
            v.stride(0), v.stride(1), v.stride(2), bias.stride(0), scale, int(bf16),
            None if rows is None else rows.data_ptr(), cache_rows,
        )
        _check_rc(rc, "decode attention", f"head_dim={d}, length={length}", cache_rows)
        return out


    def step(self, qkv: Tensor, cos: Tensor, sin_signed: Tensor, positions: Tensor, k_t: Tensor, v: Tensor,
             bias: Tensor, slot: int, scale: float, out: Tensor, scratch: Tensor, rows: Tensor | None = None) -> Tensor:
        """A float32 model's decode-step attention from its fused projection on: RoPE on the new queries
        and keys of ``qkv (b, h + 2 kv, d)``, the new key and value written to cache ``slot``, and
        ``out (b kv g d)`` = attention over slots ``[0, slot]``.

        ``cos``, ``sin_signed (P, d)``: RoPE tables (``sin_signed = cat(-sin[:d/2], sin[d/2:])``) read at
        ``positions (b)`` (int64); caches, ``bias``, ``scratch`` and ``rows`` as in :meth:`__call__` (float32
        caches).
        """
        b, kv, g, d = out.shape
        cache_rows = k_t.shape[0]
        _contiguous_f32("decode step", qkv, cos, sin_signed, out, scratch)
        if not (k_t.dtype == v.dtype == bias.dtype == torch.float32):
            raise TypeError(f"decode step: caches and bias must be float32, got {k_t.dtype}, {v.dtype}, {bias.dtype}")
        length = slot + 1
        if not (qkv.shape == (b, kv * g + 2 * kv, d) and cos.shape == sin_signed.shape and cos.dim() == 2
                and cos.shape[1] == d and positions.dtype == torch.int64 and positions.shape == (b,)
                and positions.is_contiguous() and _key_blocks_layout(k_t, cache_rows, kv, d, length)
                and v.stride(3) == 1 and bias.stride(1) == 1 and v.shape[:2] == (cache_rows, kv) and v.shape[3] == d
                and bias.shape[0] == cache_rows and min(v.shape[2], bias.shape[1]) >= length and slot >= 0
                and _row_index_ok(rows, b, cache_rows)
                and scratch.numel() >= g * ((length + 15) // 16 * 16)):
            raise ValueError(
                f"decode step: unsupported layout (qkv {tuple(qkv.shape)}, out {tuple(out.shape)}, cos {tuple(cos.shape)}, "
                f"positions {tuple(positions.shape)}, k_t {tuple(k_t.shape)}, v {tuple(v.shape)}, bias {tuple(bias.shape)}, "
                f"slot {slot}, scratch {scratch.numel()})"
            )
        if b and (int(positions.min()) < 0 or int(positions.max()) >= cos.shape[0]):
            raise ValueError(f"decode step: positions outside the {cos.shape[0]} rows of the RoPE tables")
        rc = self._step(
            qkv.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(), positions.data_ptr(), k_t.data_ptr(), v.data_ptr(),
            bias.data_ptr(), out.data_ptr(), scratch.data_ptr(), b, kv, g, d, slot, k_t.stride(0), k_t.stride(1),
            k_t.stride(2), v.stride(0), v.stride(1), v.stride(2), bias.stride(0), scale,
            None if rows is None else rows.data_ptr(), cache_rows,
        )
        _check_rc(rc, "decode step", f"head_dim={d}, slot={slot}", cache_rows)
        return out


def _row_index_ok(rows: Tensor | None, b: int, cache_rows: int) -> bool:
    """``rows`` is None with one working row per cache row, or a contiguous int64 CPU ``(b,)`` index (the
    kernel checks its values against the cache's rows)."""
    if rows is None:
        return b == cache_rows
    return rows.dtype == torch.int64 and rows.device.type == "cpu" and rows.is_contiguous() and rows.shape == (b,)


def _check_rc(rc: int, name: str, what: str, cache_rows: int) -> None:
    if rc == -2:
        raise ValueError(f"{name}: a row index lies outside the caches' {cache_rows} rows")
    if rc != 0:
        raise RuntimeError(f"{name} kernel refused {what}")


def _contiguous_f32(name: str, *tensors: Tensor) -> None:
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise TypeError(f"{name}: every tensor must be a contiguous float32 CPU tensor, got {t.dtype} on "
                            f"{t.device} with strides {t.stride()} for shape {tuple(t.shape)}")


def _rows(name: str, x: Tensor, heads: int, d: int) -> None:
    """``x`` must be a float32 CPU (T, heads, d) view whose rows may be strided but whose heads are not."""
    if not (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 3 and x.shape[1:] == (heads, d)
            and x.stride(2) == 1 and (heads == 1 or x.stride(1) == d) and x.stride(0) >= heads * d):
        raise ValueError(f"packed attention: {name} must be a float32 CPU (T, {heads}, {d}) tensor with contiguous "
                         f"rows, got {x.dtype} {tuple(x.shape)} strides {x.stride()} on {x.device}")


class PackedAttention:
    """The loaded packed-attention and RoPE kernels; see ``csrc/packed_attention.c`` for the math.

    ``q (T h d)``, ``k v (T kv d)`` and the gradients may be row-strided views (heads contiguous within
    a row), e.g. slices of one fused ``(T, h + 2 kv, d)`` projection.
    """

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        self._forward = lib.rlfunc_packed_attention_forward
        self._forward.argtypes = [ptr] * 8 + [i64] * 8 + [f32]
        self._backward = lib.rlfunc_packed_attention_backward
        self._backward.argtypes = [ptr] * 12 + [i64] * 12 + [f32]
        self._rope_forward = lib.rlfunc_rope_forward
        self._rope_backward = lib.rlfunc_rope_backward
        for fn in (self._rope_forward, self._rope_backward):
            fn.argtypes = [ptr] * 4 + [i64] * 5
        for fn in (self._forward, self._backward, self._rope_forward, self._rope_backward):
            fn.restype = ctypes.c_int
        lib.rlfunc_packed_attention_support.restype = ctypes.c_int
        self.available = bool(lib.rlfunc_packed_attention_support() & 1)  #: built with AVX-512F
        self.library = library

    @staticmethod
    def _check(q: Tensor, k: Tensor, v: Tensor, gather: Tensor, lengths: Tensor, slot_token: Tensor) -> None:
        (T, h, d), (n, L) = q.shape, gather.shape
        if k.shape != v.shape or k.dim() != 3 or k.shape[0] != T or k.shape[2] != d or h % k.shape[1]:
            raise ValueError(f"packed attention: q {tuple(q.shape)} needs k, v (T, kv, d) with kv dividing h, got "
                             f"k {tuple(k.shape)}, v {tuple(v.shape)}")
        for name, x, heads in (("q", q, h), ("k", k, k.shape[1]), ("v", v, k.shape[1])):
            _rows(name, x, heads, d)
        for name, t, shape in (("gather", gather, (n, L)), ("lengths", lengths, (n,)), ("slot_token", slot_token, (n, L))):
            if t.dtype != torch.int64 or not t.is_contiguous() or tuple(t.shape) != shape:
                raise ValueError(f"packed attention: {name} must be a contiguous int64 tensor of shape {shape}, "
                                 f"got {t.dtype} {tuple(t.shape)}")
        # the kernel follows these indices into q, k, v: out-of-range values would read out of bounds
        if n and (int(gather.min()) < 0 or int(gather.max()) >= T or int(lengths.min()) < 0 or int(lengths.max()) > L
                  or int(slot_token.min()) < -1 or int(slot_token.max()) >= T):
            raise ValueError(f"packed attention: layout indices out of range for {T} tokens and blocks of {L}")

    def forward(self, q: Tensor, k: Tensor, v: Tensor, gather: Tensor, lengths: Tensor, slot_token: Tensor,
                scale: float) -> tuple[Tensor, Tensor]:
        """``out (T h d)`` (contiguous) and ``lse (T h)`` from ``q (T h d)``, ``k v (T kv d)`` and the layout."""
        self._check(q, k, v, gather, lengths, slot_token)
        (T, h, d), (n, L), kv = q.shape, gather.shape, k.shape[1]
        out, lse = torch.empty(T, h, d, dtype=torch.float32), torch.empty(T, h, dtype=torch.float32)
        rc = self._forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), gather.data_ptr(), lengths.data_ptr(),
                           slot_token.data_ptr(), out.data_ptr(), lse.data_ptr(), n, L, h, kv, d, q.stride(0),
                           k.stride(0), v.stride(0), scale)
        if rc != 0:
            raise RuntimeError(f"packed attention forward failed (code {rc}) for head_dim={d}, heads={h}/{kv}, L={L}")
        return out, lse

    def backward(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, gather: Tensor,
                 lengths: Tensor, slot_token: Tensor, scale: float, dq: Tensor | None = None, dk: Tensor | None = None,
                 dv: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``dq, dk, dv`` for the output gradient ``dout (T h d)``: written into the given views (of q's,
        k's and v's shapes), or new tensors."""
        self._check(q, k, v, gather, lengths, slot_token)
        _contiguous_f32("packed attention", out, lse, dout)
        if out.shape != q.shape or dout.shape != q.shape or lse.shape != q.shape[:2]:
            raise ValueError(f"packed attention: out {tuple(out.shape)}, dout {tuple(dout.shape)} and lse "
                             f"{tuple(lse.shape)} do not match q {tuple(q.shape)}")
        (T, h, d), (n, L), kv = q.shape, gather.shape, k.shape[1]
        dq = torch.empty(T, h, d) if dq is None else dq
        dk = torch.empty(T, kv, d) if dk is None else dk
        dv = torch.empty(T, kv, d) if dv is None else dv
        for name, x, heads in (("dq", dq, h), ("dk", dk, kv), ("dv", dv, kv)):
            _rows(name, x, heads, d)
            if x.shape[0] != T:
                raise ValueError(f"packed attention: {name} has {x.shape[0]} rows, not {T}")
        rc = self._backward(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), dout.data_ptr(),
                            gather.data_ptr(), lengths.data_ptr(), slot_token.data_ptr(), dq.data_ptr(), dk.data_ptr(),
                            dv.data_ptr(), T, n, L, h, kv, d, q.stride(0), k.stride(0), v.stride(0), dq.stride(0),
                            dk.stride(0), dv.stride(0), scale)
        if rc != 0:
            raise RuntimeError(f"packed attention backward failed (code {rc}) for head_dim={d}, heads={h}/{kv}, L={L}")
        return dq, dk, dv

    def _rope(self, fn: Any, x: Tensor, cos: Tensor, sin: Tensor, out: Tensor) -> Tensor:
        T, heads, d = x.shape
        _rows("rope input", x, heads, d)
        _rows("rope output", out, heads, d)
        _contiguous_f32("rope", cos, sin)
        if out.shape[0] != T or cos.shape != (T, d) or sin.shape != (T, d):
            raise ValueError(f"rope: x {tuple(x.shape)}, out {tuple(out.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
        rc = fn(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), T, heads, d, x.stride(0), out.stride(0))
        if rc != 0:
            raise RuntimeError(f"rope kernel refused head_dim={d}")
        return out

    def rope_forward(self, x: Tensor, cos: Tensor, sin: Tensor, out: Tensor) -> Tensor:
        """``out = x * cos + rotate_half(x) * sin`` for ``x, out (T heads d)`` (row-strided views), ``cos sin (T d)``."""
        return self._rope(self._rope_forward, x, cos, sin, out)

    def rope_backward(self, grad: Tensor, cos: Tensor, sin: Tensor, out: Tensor) -> Tensor:
        """The gradient with respect to ``x`` of :meth:`rope_forward`, for the output gradient ``grad``."""
        return self._rope(self._rope_backward, grad, cos, sin, out)


class NormAct:
    """The loaded RMSNorm / SwiGLU kernels; see ``csrc/norm_act.c``. Contiguous CPU tensors, float32 or
    (where :attr:`bf16` says so) bfloat16, one dtype per call; ``rstd`` and ``dweight`` are float32."""

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))
        i64, ptr, f32, flag = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
        for name, args in (("rms_norm_forward", [ptr] * 4 + [i64, i64, f32, flag]),
                           ("rms_norm_backward", [ptr] * 6 + [i64, i64, flag]),
                           ("swiglu_forward", [ptr] * 3 + [i64, flag]), ("swiglu_backward", [ptr] * 5 + [i64, flag])):
            fn = getattr(lib, f"rlfunc_{name}")
            fn.argtypes, fn.restype = args, ctypes.c_int
            setattr(self, f"_{name}", fn)
        lib.rlfunc_norm_act_support.restype = ctypes.c_int
        support = lib.rlfunc_norm_act_support()
        self.available = bool(support & 1)  #: built with AVX-512F: float32 tensors
        self.bf16 = bool(support & 2)  #: also AVX-512BW/VL: bfloat16 tensors
        self.library = library

    def supports(self, *tensors: Tensor) -> bool:
        """Whether these tensors (one dtype, on the CPU) are a dtype this build runs."""
        dtypes = {t.dtype for t in tensors}
        return (all(t.device.type == "cpu" for t in tensors)
                and (dtypes == {torch.float32} or (dtypes == {torch.bfloat16} and self.bf16)))

    def _flag(self, name: str, *tensors: Tensor) -> int:
        """1 for bfloat16 tensors, 0 for float32; anything else (or non-contiguous) is refused."""
        if not self.supports(*tensors) or not all(t.is_contiguous() for t in tensors):
            raise TypeError(f"{name}: every tensor must be a contiguous CPU tensor of one dtype, float32"
                            f"{' or bfloat16' if self.bf16 else ''}; got "
                            + ", ".join(f"{t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}" for t in tensors))
        return int(tensors[0].dtype == torch.bfloat16)

    @staticmethod
    def _rc(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} kernel failed (code {rc})")

    def rms_norm_forward(self, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """``y`` (x's dtype), ``rstd (rows)`` (float32) for ``x (rows, hidden)``."""
        bf16 = self._flag("rms_norm", x, weight)
        if x.dim() != 2 or weight.shape != (x.shape[1],):
            raise ValueError(f"rms_norm: x must be (rows, hidden) and weight (hidden), got {tuple(x.shape)}, {tuple(weight.shape)}")
        y, rstd = torch.empty_like(x), torch.empty(x.shape[0], dtype=torch.float32)
        self._rc(self._rms_norm_forward(x.data_ptr(), weight.data_ptr(), y.data_ptr(), rstd.data_ptr(), x.shape[0],
                                        x.shape[1], eps, bf16), "rms_norm forward")
        return y, rstd

    def rms_norm_backward(self, x: Tensor, weight: Tensor, rstd: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
        """``dx`` (x's dtype), ``dweight`` (float32)."""
        bf16 = self._flag("rms_norm backward", x, weight, dy)
        _contiguous_f32("rms_norm backward", rstd)
        if x.dim() != 2 or dy.shape != x.shape or weight.shape != (x.shape[1],) or rstd.shape != (x.shape[0],):
            raise ValueError(f"rms_norm backward: shapes disagree: x {tuple(x.shape)}, dy {tuple(dy.shape)}, "
                             f"weight {tuple(weight.shape)}, rstd {tuple(rstd.shape)}")
        dx, dw = torch.empty_like(x), torch.empty(weight.shape, dtype=torch.float32)
        self._rc(self._rms_norm_backward(x.data_ptr(), weight.data_ptr(), rstd.data_ptr(), dy.data_ptr(), dx.data_ptr(),
                                         dw.data_ptr(), x.shape[0], x.shape[1], bf16), "rms_norm backward")
        return dx, dw

    def swiglu_forward(self, gate: Tensor, up: Tensor) -> Tensor:
        """``silu(gate) * up``."""
        bf16 = self._flag("swiglu", gate, up)
        if gate.shape != up.shape:
            raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
        out = torch.empty_like(gate)
        self._rc(self._swiglu_forward(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(), bf16), "swiglu forward")
        return out

    def swiglu_backward(self, gate: Tensor, up: Tensor, dout: Tensor) -> tuple[Tensor, Tensor]:
        """``dgate, dup``."""
        bf16 = self._flag("swiglu backward", gate, up, dout)
        if not gate.shape == up.shape == dout.shape:
            raise ValueError(f"swiglu backward: shapes differ: {tuple(gate.shape)}, {tuple(up.shape)}, {tuple(dout.shape)}")
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        self._rc(self._swiglu_backward(gate.data_ptr(), up.data_ptr(), dout.data_ptr(), dgate.data_ptr(), dup.data_ptr(),
                                       gate.numel(), bf16), "swiglu backward")
        return dgate, dup


_KERNELS = {"decode_attention": DecodeAttention, "packed_attention": PackedAttention, "norm_act": NormAct}


@functools.lru_cache(maxsize=None)
def _load(name: str) -> Any:
    """The loaded kernel library ``csrc/<name>.c``, or None (logged once) if it cannot run here."""
    what = name.replace("_", " ")
    if os.environ.get("RLFUNC_CPU_KERNELS", "1") == "0":
        _log.info("RLFUNC_CPU_KERNELS=0: %s runs in PyTorch", what)
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        _log.warning("no C compiler (CC=%r, cc not on PATH): %s runs in PyTorch", os.environ.get("CC"), what)
        return None
    try:
        kernel = _KERNELS[name](_build(_CSRC / f"{name}.c", compiler))
    except Exception as e:  # noqa: BLE001 - any build or load failure means: use the PyTorch path
        _log.warning("could not build the %s kernel (%s): it runs in PyTorch", what, e)
        return None
    if not kernel.available:
        _log.info("this CPU has no AVX-512F: %s runs in PyTorch", what)
        return None
    return kernel


def decode_attention_kernel(head_dim: int) -> DecodeAttention | None:
    """The native rollout's decode-attention kernel for this head dim, or None (use PyTorch) if it cannot run here."""
    if head_dim % 16:
        return None
    return _load("decode_attention")


def packed_attention_kernel(head_dim: int) -> PackedAttention | None:
    """The packed training attention's kernels for this head dim, or None (use PyTorch)."""
    if head_dim % 16:
        return None
    return _load("packed_attention")


def norm_act_kernel() -> NormAct | None:
    """The fused RMSNorm / SwiGLU kernels, or None (use PyTorch)."""
    return _load("norm_act")
