"""The native decoder's KV cache (:mod:`backends.rollout.decoder`): its layout, how a prompt's keys and values go
into it, how a decode step attends over it, and how finished rows leave the working batch.

Caches are ``(rows, kv_heads, total_len, head_dim)`` per layer, the step's attention is two batched matmuls, and
finished rows are dropped by copying the caches down. Plain PyTorch ops, on any device.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

__all__ = ["KVCache", "apply_rope", "softmax_last"]

#: ``buffers(name, shape, dtype, count)``: ``count`` uninitialised tensors of ``shape`` (the workspace's,
#: reused between calls on the CPU)
Buffers = Callable[[str, tuple[int, ...], torch.dtype, int], list[Tensor]]


def apply_rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """HF's ``x * cos + rotate_half(x) * sin`` with ``sin_signed = cat(-sin[:half], sin[half:])``."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


def softmax_last(x: Tensor) -> Tensor:
    """``softmax(x, -1)``; as exp / sum when the last dim is under 16 on CPU, where PyTorch's softmax
    takes a slow path for short rows."""
    if x.shape[-1] >= 16 or x.device.type != "cpu":
        return torch.softmax(x, dim=-1)
    e = (x - x.amax(dim=-1, keepdim=True)).exp_()
    return e.div_(e.sum(dim=-1, keepdim=True))


class KVCache:
    """Caches ``(rows, kv_heads, total_len, head_dim)`` per layer, in the attention's dtype; slot ``j`` holds
    token ``j`` of the left-padded prompt followed by the response, for every row alike (RoPE positions differ
    per row). The working batch is the caches' rows: :meth:`keep_rows` copies them down.

    ``key_bias`` masks slots per row, so a step may write a dummy token for some rows (:meth:`mask_slot`):
    what multi-turn rollouts need."""

    def __init__(
        self,
        k: list[Tensor],
        v: list[Tensor],
        *,
        num_heads: int,
        att_dtype: torch.dtype,
        rope: tuple[Tensor, Tensor],
        scale: float,
        device: torch.device,
    ) -> None:
        self.k, self.v = k, v
        self.num_heads, self.att_dtype, self.scale = num_heads, att_dtype, scale
        self.cos, self.sin = rope
        #: (rows, total_len) 0 for keys to attend to, -inf for prompt padding
        self.key_bias = torch.zeros(k[0].shape[0], k[0].shape[2], dtype=att_dtype, device=device)
        self._step: tuple | None = None

    @classmethod
    def allocate(
        cls,
        *,
        rows: int,
        total_len: int,
        num_heads: int,
        num_kv: int,
        head_dim: int,
        layers: int,
        att_dtype: torch.dtype,
        device: torch.device,
        rope: tuple[Tensor, Tensor],
        scale: float,
        buffers: Buffers,
    ) -> KVCache:
        """Uninitialised caches for ``rows`` rows of ``total_len`` slots, from ``buffers``; ``rope`` is the
        ``(cos, sin_signed)`` tables of every position."""
        shape = (rows, num_kv, total_len, head_dim)
        k = buffers("k", shape, att_dtype, layers)
        v = buffers("v", shape, att_dtype, layers)
        return cls(k, v, num_heads=num_heads, att_dtype=att_dtype, rope=rope, scale=scale, device=device)

    def mask_prompts(self, mask: Tensor, copies: int) -> None:
        """Rows ``[i*copies, (i+1)*copies)`` hold prompt ``i`` of ``mask (b0 p)``: its padding gets -inf."""
        self.key_bias[:, : mask.shape[1]].masked_fill_(~mask.repeat_interleave(copies, dim=0), float("-inf"))

    def write_prompt(self, layer: int, k: Tensor, v: Tensor, copies: int) -> None:
        """Keys and values ``(b0 kv p d)`` of the prompts into slots ``[0, p)`` of their ``copies`` rows each."""
        p = k.shape[2]
        kc, vc = self.k[layer], self.v[layer]
        kc.view(k.shape[0], copies, *kc.shape[1:])[:, :, :, :p] = k[:, None]
        vc.view(v.shape[0], copies, *vc.shape[1:])[:, :, :, :p] = v[:, None]

    def mask_slot(self, slot: int, masked: Tensor) -> None:
        """Slot ``slot`` holds a dummy for the rows where ``masked (rows)`` is true: -inf there, for this
        step and every later one, 0 for the other rows. The whole column is set, so a slot written again
        (a multi-turn call retried after an error) keeps no mask of its earlier use."""
        self.key_bias[:, slot].zero_().masked_fill_(masked, float("-inf"))

    def begin_step(self, positions: Tensor, slot: int, rows: Tensor | None = None) -> None:
        """The next :meth:`attend` calls are for new tokens at RoPE ``positions (b)``, cache ``slot``.

        ``rows (b)`` int64: only those cache rows step (``positions`` and the queries are theirs); the slot of
        every other row is zeroed, so it holds finite numbers behind its mask."""
        bias = self.key_bias[:, None, None, : slot + 1]
        if rows is not None:
            bias = bias[rows]
            for cache in (*self.k, *self.v):
                cache[:, :, slot].zero_()
        self._step = (self.cos[positions][:, None], self.sin[positions][:, None], bias, slot, rows)

    def attend(self, layer: int, qkv: Tensor) -> Tensor:
        """RoPE on the new queries and keys of ``qkv (b, h + 2 kv, d)``, the new key and value written to the
        step's slot, and the attention ``(b kv g d)`` of the queries over slots ``[0, slot]``."""
        cos, sin, bias, slot, rows = self._step
        b, kv = qkv.shape[0], (qkv.shape[1] - self.num_heads) // 2
        h, d = self.num_heads, qkv.shape[2]
        kc, vc = self.k[layer], self.v[layer]
        qk = apply_rope(qkv[:, : h + kv], cos, sin)
        q = qk[:, :h].view(b, kv, h // kv, d).to(self.att_dtype)
        if rows is None:
            vc[:, :, slot] = qkv[:, h + kv :]
            kc[:, :, slot] = qk[:, h:]
            keys, values = kc[:, :, : slot + 1], vc[:, :, : slot + 1]
        else:  # a subset of the rows: gather theirs (the others' attention would be thrown away)
            vc[rows, :, slot] = qkv[:, h + kv :].to(vc.dtype)
            kc[rows, :, slot] = qk[:, h:].to(kc.dtype)
            keys, values = kc[rows, :, : slot + 1], vc[rows, :, : slot + 1]
        scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(self.scale).add_(bias)
        return torch.matmul(softmax_last(scores), values)

    def begin_chunk(self, positions: Tensor, slot: int) -> None:
        """The next :meth:`attend_chunk` calls are for ``c`` new tokens per row at RoPE ``positions (b c)``, cache
        slots ``[slot, slot + c)``; each attends to the slots before it and, causally, to the chunk's earlier ones."""
        c = positions.shape[1]
        causal = torch.ones(c, slot + c, dtype=torch.bool, device=positions.device).tril_(diagonal=slot)
        bias = self.key_bias[:, None, : slot + c].masked_fill(~causal, float("-inf"))  # (b c slot+c)
        self._step = (self.cos[positions][:, :, None], self.sin[positions][:, :, None], bias[:, None, None], slot)

    def attend_chunk(self, layer: int, qkv: Tensor) -> Tensor:
        """:meth:`attend` for a chunk: ``qkv (b c h+2kv d)`` -> the attention ``(b c h d)``."""
        cos, sin, bias, slot = self._step
        b, c = qkv.shape[:2]
        h, d = self.num_heads, qkv.shape[3]
        kv = (qkv.shape[2] - h) // 2
        kc, vc = self.k[layer], self.v[layer]
        qk = apply_rope(qkv[:, :, : h + kv], cos, sin)
        kc[:, :, slot : slot + c] = qk[:, :, h:].transpose(1, 2)
        vc[:, :, slot : slot + c] = qkv[:, :, h + kv :].transpose(1, 2)
        q = qk[:, :, :h].reshape(b, c, kv, h // kv, d).permute(0, 2, 3, 1, 4).to(self.att_dtype)  # (b kv g c d)
        keys, values = kc[:, :, None, : slot + c], vc[:, :, None, : slot + c]  # (b kv 1 L d)
        scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(self.scale).add_(bias)  # (b kv g c L)
        return torch.matmul(softmax_last(scores), values).permute(0, 3, 1, 2, 4).reshape(b, c, h, d)

    def keep_rows(self, index: Tensor) -> None:
        """Keep working rows ``index`` (int64, into the current working batch), in that order."""
        self.k = [c.index_select(0, index) for c in self.k]
        self.v = [c.index_select(0, index) for c in self.v]
        self.key_bias = self.key_bias.index_select(0, index)
