"""The native rollout decoder's kernel strategy: KV caches laid out for the C decode-attention kernel.

Reached only through the seam ``backends.cpu.decode_strategy``; the rollout's PyTorch strategy
(``backends.rollout.kv_cache``) is the reference it matches and describes the interface both follow.
What this strategy changes, and why:

- The key cache is stored transposed in blocks of 16 slots, ``(rows, kv_heads, ceil(T / 16), head_dim,
  16)`` (:func:`backends.cpu.kernels.key_blocks`), so the kernel gets the scores of 16 slots from one
  vector FMA per feature. In memory the block index comes first (slot-block-major), so block ``j`` of
  every (row, kv head) is one contiguous range and a step reads each block as one stream.
- Finished rows leave the working batch by index (the kernel reads cache row ``rows[i]`` for working row
  ``i``): nothing is copied, so compaction is free and can happen at any step.
- A float32 model's decode step runs RoPE, the cache writes and the attention in one kernel call, and
  RMSNorm runs as one C pass (``csrc/norm_act.c``) where PyTorch runs several elementwise kernels.
- A bfloat16 model's keys and values are bf16 numbers: where the kernel reads bf16 caches they are
  stored so, exactly, at half the bytes (the attention math stays float32).
- The caches lie on memory advised for transparent huge pages: the kernel reads every (row, head)'s
  slots each step, which on 4 KiB pages crosses thousands of pages (TLB misses, and the hardware
  prefetcher stops at each page boundary).
"""

from __future__ import annotations

import mmap
from typing import Any, Callable

import torch
from torch import Tensor

from backends.cpu.kernels import DecodeAttention, NormAct, decode_attention_kernel, norm_act_kernel

__all__ = ["HUGE_PAGE_BYTES", "KernelDecodeStrategy", "KernelKVCache", "decode_strategy", "empty_on_huge_pages"]

#: the transparent huge page size on x86-64 (and on aarch64 with 4 KiB base pages)
HUGE_PAGE_BYTES = 2 << 20
#: slots per block of the kernel's key cache
SLOT_BLOCK = 16


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """An uninitialised CPU tensor on memory advised for transparent huge pages (Linux ``madvise``);
    a plain ``torch.empty`` where that is not available or the tensor is under one huge page."""
    nbytes = dtype.itemsize * int(torch.Size(shape).numel())
    if nbytes < HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps ``region`` alive
    start = -raw.data_ptr() % HUGE_PAGE_BYTES  # huge pages back whole aligned 2 MiB ranges only
    return raw[start : start + nbytes].view(dtype).view(shape)


def _apply_rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """HF's ``x * cos + rotate_half(x) * sin`` with ``sin_signed = cat(-sin[:half], sin[half:])``: the
    same products as the PyTorch strategy's, so both give the same bits."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


class KernelDecodeStrategy:
    """The C decode-attention kernel's strategy for one weight dtype (see the module docstring)."""

    name = "kernel"
    slot_block = SLOT_BLOCK

    def __init__(self, attention: DecodeAttention, norm: NormAct | None, dtype: torch.dtype) -> None:
        self.attention = attention
        self.norm = norm if norm is not None and norm.supports(torch.empty(0, dtype=dtype)) else None
        self.dtype = dtype
        #: a float32 model's step runs RoPE, cache writes and attention in one kernel call
        self.fused_step = dtype == torch.float32

    def cache_dtype(self, model_dtype: torch.dtype, att_dtype: torch.dtype) -> torch.dtype:
        return torch.bfloat16 if model_dtype == torch.bfloat16 and self.attention.bf16_cache else att_dtype

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if self.norm is not None and x.dim() == 2 and x.is_contiguous():
            return self.norm.rms_norm_forward(x, weight, eps)[0]
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)

    def new_cache(self, *, rows: int, total_len: int, num_heads: int, num_kv: int, head_dim: int, layers: int,
                  model_dtype: torch.dtype, att_dtype: torch.dtype, device: torch.device, rope: tuple[Tensor, Tensor],
                  scale: float, buffers: Callable[..., list[Tensor]]) -> KernelKVCache:
        dtype = self.cache_dtype(model_dtype, att_dtype)
        blocks = -(-total_len // SLOT_BLOCK)  # whole blocks: a few unused slots past total_len
        # stored (blocks rows kv d 16), seen as the kernel's logical (rows kv blocks d 16)
        stored = buffers("k", (blocks, rows, num_kv, head_dim, SLOT_BLOCK), dtype, layers, empty_on_huge_pages)
        k = [c.permute(1, 2, 0, 3, 4) for c in stored]
        v = buffers("v", (rows, num_kv, blocks * SLOT_BLOCK, head_dim), dtype, layers, empty_on_huge_pages)
        return KernelKVCache(self, k, v, num_heads=num_heads, total_len=total_len, rope=rope, scale=scale)


class KernelKVCache:
    """Caches in the kernel's layout; the working batch addresses them by index (:attr:`rows`)."""

    drops_rows_by_index = True

    def __init__(self, strategy: KernelDecodeStrategy, k: list[Tensor], v: list[Tensor], *, num_heads: int,
                 total_len: int, rope: tuple[Tensor, Tensor], scale: float) -> None:
        self.strategy, self.kernel = strategy, strategy.attention
        self.k, self.v = k, v
        self.num_heads, self.scale = num_heads, scale
        self.cos, self.sin = rope
        num_kv = k[0].shape[1]
        self.scratch = torch.empty(num_heads // num_kv * -(-total_len // SLOT_BLOCK) * SLOT_BLOCK, dtype=torch.float32)
        #: (cache rows, total_len) 0 for keys to attend to, -inf for prompt padding
        self.key_bias = torch.zeros(k[0].shape[0], total_len, dtype=torch.float32)
        #: the cache row of each working row (None: working row i is cache row i)
        self.rows: Tensor | None = None
        self._step: tuple[Any, ...] | None = None

    def mask_prompts(self, mask: Tensor, copies: int) -> None:
        """Rows ``[i*copies, (i+1)*copies)`` hold prompt ``i`` of ``mask (b0 p)``: its padding gets -inf."""
        self.key_bias[:, : mask.shape[1]].masked_fill_(~mask.repeat_interleave(copies, dim=0), float("-inf"))

    def write_prompt(self, layer: int, k: Tensor, v: Tensor, copies: int) -> None:
        """Keys and values ``(b0 kv p d)`` of the prompts into slots ``[0, p)`` of their ``copies`` rows each."""
        b0, p = k.shape[0], k.shape[2]
        kc, vc = self.k[layer], self.v[layer]
        blocks = kc.view(b0, copies, *kc.shape[1:]).transpose(-1, -2)  # (b0 copies kv T/16 16 d)
        for blk, start in enumerate(range(0, p, SLOT_BLOCK)):
            n = min(SLOT_BLOCK, p - start)
            blocks[:, :, :, blk, :n] = k[:, None, :, start : start + n]
        vc.view(b0, copies, *vc.shape[1:])[:, :, :, :p] = v[:, None]

    def begin_step(self, positions: Tensor, slot: int) -> None:
        """The next :meth:`attend` calls are for new tokens at RoPE ``positions (b)``, cache ``slot``."""
        if self.strategy.fused_step:
            self._step = (positions.contiguous(), slot)
        else:
            self._step = (self.cos[positions][:, None], self.sin[positions][:, None], slot)

    def attend(self, layer: int, qkv: Tensor) -> Tensor:
        """RoPE on the new queries and keys of ``qkv (b, h + 2 kv, d)``, the new key and value written to the
        step's slot, and the attention ``(b kv g d)`` (float32) of the queries over slots ``[0, slot]``."""
        b, h, d = qkv.shape[0], self.num_heads, qkv.shape[2]
        kv = (qkv.shape[1] - h) // 2
        kc, vc = self.k[layer], self.v[layer]
        if self.strategy.fused_step:
            positions, slot = self._step
            return self.kernel.step(qkv, self.cos, self.sin, positions, kc, vc, self.key_bias, slot, self.scale,
                                    qkv.new_empty(b, kv, h // kv, d), self.scratch, self.rows)
        cos, sin, slot = self._step
        rows = slice(None) if self.rows is None else self.rows
        qk = _apply_rope(qkv[:, : h + kv], cos, sin)
        vc[rows, :, slot] = qkv[:, h + kv :]
        q = qk[:, :h].view(b, kv, h // kv, d).to(torch.float32)
        kc[rows, :, slot // SLOT_BLOCK, :, slot % SLOT_BLOCK] = qk[:, h:]
        return self.kernel(q, kc, vc, self.key_bias, slot + 1, self.scale, q.new_empty(q.shape), self.scratch, self.rows)

    def keep_rows(self, index: Tensor) -> None:
        """Keep working rows ``index`` (int64, into the current working batch), in that order: by index."""
        self.rows = index if self.rows is None else self.rows[index]


def decode_strategy(*, head_dim: int, dtype: torch.dtype, device: torch.device | str) -> KernelDecodeStrategy | None:
    """The kernel strategy for a decoder of this head dim, weight dtype and device, or None where the
    kernel cannot run (not the CPU, not a floating dtype, no AVX-512 or compiler, a head dim that is not
    a multiple of 16, ``RLFUNC_CPU_KERNELS=0``): the decoder then runs PyTorch. The attention math and
    caches are float32 whatever the weights (bfloat16 caches for bfloat16 weights where the kernel reads
    them), so any floating weight dtype runs."""
    if torch.device(device).type != "cpu" or not dtype.is_floating_point:
        return None
    attention = decode_attention_kernel(head_dim)
    if attention is None:
        return None
    return KernelDecodeStrategy(attention, norm_act_kernel(), dtype)
