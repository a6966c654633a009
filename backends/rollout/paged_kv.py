"""A paged KV cache: fixed-size blocks in one pool per layer, a block table per cache slot, reference counts.

The ``n`` samples of a prompt share the prompt's blocks: the prompt is prefilled once and its blocks are counted
``n`` times. A partial last prompt block is shared too, until a sample writes its first own token into it: that
sample gets a private copy (copy-on-write) unless it is the block's last holder, which writes in place. A slot's
blocks go back to the pool when its row finishes (:meth:`PagedKVCache.release`).

Layout: per layer ``(kv_heads, num_blocks * block_size, head_dim)``, so block ``b`` is token rows
``[b * block_size, (b + 1) * block_size)`` of each head's matrix: ``block_size * head_dim`` contiguous numbers. A
slot's block table (``block_table``) lists its blocks in position order; a decode step gathers the working slots'
blocks whole (one ``index_select`` of contiguous blocks per layer and tensor, which on a CPU runs near memcpy speed,
where a gather of single tokens' rows ran at a fraction of it) and attends over them, positions past each slot's own
masked: on a CPU with the two batched matmuls of :class:`~backends.rollout.kv_cache.KVCache` (PyTorch's fused CPU
attention pays a large overhead per small problem), elsewhere with one fused ``scaled_dot_product_attention`` (one
kernel where the two matmuls, the scaling, the mask and the softmax take five, and no scores written out). The ``g``
query heads of a KV head are its ``g`` queries, so grouped-query attention needs no copy of the keys. Masked
positions must hold finite numbers (a zero weight times NaN is NaN): block 0, the null block that pads every table,
is zeroed by :meth:`PagedKVCache.reset` and never handed out (padding tokens write finite keys and values into it),
and every block is zeroed when it is handed out.

Memory is reserved, not just allocated: a row is admitted only when the pool can hold its longest possible length
(:meth:`PagedKVCache.admit`), so a running row never waits for a block and no row is ever preempted.

**Prefix cache** (a batch left open, a rollout server's): before a row is released its full blocks are remembered
(:meth:`PagedKVCache.remember`), each keyed by its tokens and the key of the block before it, so a key names a whole
prefix, and a later prompt that starts with those tokens is admitted with them (:meth:`PagedKVCache.cached_prefix`):
only the tokens after them are computed. A cached block that no row holds is still counted as available, and is
taken back, least recently used first, when a new block is needed; so the cache never refuses or stalls a row. vLLM's
automatic prefix caching and SGLang's radix cache make the same trade.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from backends.rollout.common import on_device
from backends.rollout.kv_cache import apply_rope, softmax_last

__all__ = ["BlockPool", "PagedKVCache", "blocks_for_request", "pool_blocks_for_budget", "request_too_large"]

Buffers = Callable[[str, tuple[int, ...], torch.dtype, int], list[Tensor]]


def blocks_for_request(prompt_len: int, n: int, max_new_tokens: int, block_size: int) -> int:
    """The most blocks ``n`` samples of a ``prompt_len``-token prompt hold at once: the prompt's full blocks (shared)
    plus, per sample, the blocks of every position it may write (the last sampled token is never fed, so
    ``max_new_tokens - 1`` of them) outside those. A partial last prompt block counts among a sample's own: all
    but its last holder copy it, and that one writes into it."""
    own = -(-(prompt_len + max_new_tokens - 1) // block_size) - prompt_len // block_size
    return prompt_len // block_size + n * own


def pool_blocks_for_budget(gib: float, *, layers: int, kv_heads: int, head_dim: int, block_size: int, itemsize: int):
    """Blocks (the null block included) that ``gib`` GiB of keys and values hold."""
    per_block = 2 * layers * kv_heads * head_dim * block_size * itemsize
    return int(gib * 2**30) // per_block


def request_too_large(index: int, prompt_len: int, n: int, max_new: int, need: int, usable: int, bs: int) -> str:
    """The error of a request that can never fit the pool."""
    return (
        f"prompt {index} ({prompt_len} tokens, n={n} samples, max_new_tokens={max_new}) needs {need} KV-cache blocks "
        f"of {bs} tokens, more than the whole cache holds ({usable} blocks): raise rollout.native.kv_cache_gib, or "
        "lower n or max_new_tokens"
    )


class BlockPool:
    """Which blocks are free, how many holders each block has, and how many free blocks are promised to admitted
    rows. Host-side bookkeeping; block 0 (the null block) is never handed out.

    A block the prefix cache holds (:meth:`keep`) stays filled after its rows end; while the cache is its only
    holder it is ``kept``: counted as available, and taken back, oldest first, when no block is free
    (``on_evict`` tells the cache)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a paged KV cache needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.refcount = [0] * num_blocks
        self.free = list(range(num_blocks - 1, 0, -1))  # pop() hands out low ids first
        self.reserved = 0
        self.cached: set[int] = set()  #: blocks the prefix cache holds
        self.kept: dict[int, None] = {}  #: cached blocks no row holds, least recently used first
        self.on_evict: Callable[[int], None] | None = None

    @property
    def usable(self) -> int:
        return self.num_blocks - 1

    @property
    def available(self) -> int:
        """Free (or kept) blocks not promised to an admitted row."""
        return len(self.free) + len(self.kept) - self.reserved

    def take(self, holders: int = 1, *, reserved: bool = False) -> int:
        """A free block with ``holders`` holders; ``reserved``: one promised earlier (the promise is kept). With
        no free block, the least recently used kept block is evicted from the prefix cache."""
        if reserved:
            self.reserved -= 1
        elif self.available < 1:
            raise RuntimeError("paged KV cache: no unreserved block left (an admission check was skipped)")
        if self.free:
            block = self.free.pop()
        else:
            block = next(iter(self.kept))
            del self.kept[block]
            self.cached.discard(block)
            if self.on_evict is not None:
                self.on_evict(block)
        self.refcount[block] = holders
        return block

    def keep(self, block: int) -> None:
        """The prefix cache holds ``block`` too (a row still does)."""
        self.refcount[block] += 1
        self.cached.add(block)

    def hold(self, block: int, holders: int) -> None:
        """``holders`` more holders of a cached block (rows whose prompts start with its tokens)."""
        self.kept.pop(block, None)
        self.refcount[block] += holders

    def drop(self, block: int) -> bool:
        """One holder fewer; True when the block went back to the free list."""
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self.free.append(block)
            return True
        if self.refcount[block] < 0:
            raise RuntimeError(f"paged KV cache: block {block} dropped more often than it was held")
        if self.refcount[block] == 1 and block in self.cached:
            self.kept[block] = None  # its rows have ended: the cache alone holds it, newest last
        return False


class PagedKVCache:
    """The pools, the per-slot block tables, and the attention of a decode step over them.

    A slot is one running row (a sample). :meth:`admit` gives a prompt's slots its shared blocks; :meth:`grow`
    gives each working slot a writable block for its next position; :meth:`begin_step` / :meth:`attend` run a
    decode step; :meth:`release` frees a finished slot. Prefill goes through :meth:`begin_prefill` and the
    :meth:`mask_prompts` / :meth:`write_prompt` pair that :meth:`Decoder.prefill` calls.
    """

    def __init__(
        self,
        k: list[Tensor],
        v: list[Tensor],
        *,
        slots: int,
        max_len: int,
        block_size: int,
        num_heads: int,
        att_dtype: torch.dtype,
        rope: tuple[Tensor, Tensor],
        scale: float,
        device: torch.device,
    ) -> None:
        self.k, self.v = k, v
        self.block_size, self.num_heads, self.att_dtype, self.scale = block_size, num_heads, att_dtype, scale
        self.cos, self.sin = rope
        self.device = device
        self.pool = BlockPool(k[0].shape[1] // block_size)
        #: (slots + 1, blocks a row may hold) int64: each slot's blocks in position order, 0 (the null block) after
        #: them; the last row is the spare slot's, never admitted, all null block: the padding rows of a decode step
        #: at fixed shapes (:mod:`backends.rollout.decode_graphs`) write there, into the null block
        self.block_table = torch.zeros(slots + 1, -(-max_len // block_size), dtype=torch.long, device=device)
        self.spare_slot = slots
        self.blocks: list[list[int]] = [[] for _ in range(slots)]  #: the block table's rows, on the host
        self.reserve: list[int] = [0] * slots  #: blocks still promised to each slot
        #: slots that have not yet written into their prompt's shared partial last block
        self.shared_tail: set[int] = set()
        self._prefill: tuple[Tensor, Tensor] | None = None
        self._step: tuple | None = None
        self._chunk: tuple | None = None
        #: a decode step attends through ``scaled_dot_product_attention`` (off the CPU; see the module docstring)
        self.fused_attention = device.type != "cpu"
        # the prefix cache (:meth:`remember`, :meth:`cached_prefix`): a full block's entry is keyed by the entry of
        # the block before it (-1 for a first block) and its tokens, so a key names the whole prefix up to it; entry
        # ids are never reused, so an entry under an evicted parent can no longer be reached
        self._entries: dict[tuple[int, tuple[int, ...]], int] = {}
        self._entry_of: dict[int, int] = {}  # block -> its entry
        self._block_of: dict[int, int] = {}  # entry -> its block
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # entry -> its key
        self._next_entry = 0
        self.pool.on_evict = self._forget

    @classmethod
    def allocate(
        cls,
        *,
        slots: int,
        max_len: int,
        num_blocks: int,
        block_size: int,
        num_kv: int,
        head_dim: int,
        layers: int,
        num_heads: int,
        att_dtype: torch.dtype,
        device: torch.device,
        rope: tuple[Tensor, Tensor],
        scale: float,
        buffers: Buffers,
    ) -> PagedKVCache:
        """Pools of ``num_blocks`` blocks from ``buffers`` (uninitialised: see :meth:`reset`)."""
        shape = (num_kv, num_blocks * block_size, head_dim)
        k, v = buffers("paged_k", shape, att_dtype, layers), buffers("paged_v", shape, att_dtype, layers)
        return cls(
            k,
            v,
            slots=slots,
            max_len=max_len,
            block_size=block_size,
            num_heads=num_heads,
            att_dtype=att_dtype,
            rope=rope,
            scale=scale,
            device=device,
        )

    def reset(self) -> None:
        """Zero the null block, what every position past a slot's blocks reads."""
        self._zero([0])

    def _blocks_view(self, pool: Tensor) -> Tensor:
        """``pool`` as ``(kv, num_blocks, block_size * head_dim)``: one contiguous row per block and head."""
        return pool.view(pool.shape[0], -1, self.block_size * pool.shape[2])

    def _gather(self, pool: Tensor, blocks: Tensor) -> Tensor:
        """``(kv, len(blocks), block_size * head_dim)``: the blocks of each head; on a CPU one ``index_select``
        along dim 0 per head (along dim 1 of the whole pool the CPU kernel runs about 3x slower)."""
        view = self._blocks_view(pool)
        if pool.device.type != "cpu":  # one indexing kernel, with no host synchronisation (CUDA graphs capture it)
            return view[:, blocks]
        out = torch.empty((view.shape[0], blocks.shape[0], view.shape[2]), dtype=pool.dtype, device=pool.device)
        for head in range(view.shape[0]):
            torch.index_select(view[head], 0, blocks, out=out[head])
        return out

    def _zero(self, blocks: list[int]) -> None:
        index = on_device(blocks, self.device)
        for pool in (*self.k, *self.v):
            self._blocks_view(pool).index_fill_(1, index, 0.0)

    # ---------------------------------------------------------------------------------------------- blocks

    def admit(self, slots: list[int], prompt_len: int, max_new_tokens: int, cached: list[int] = ()) -> None:
        """Give ``slots`` (the samples of one prompt) the prompt's blocks, each held by all of them, and promise
        each the blocks it may still need; the first blocks are ``cached`` (:meth:`cached_prefix`), filled already.
        The caller checked :meth:`admission_need` against ``available``."""
        bs, n = self.block_size, len(slots)
        for block in cached:
            self.pool.hold(block, n)
        fresh = [self.pool.take(n) for _ in range(-(-prompt_len // bs) - len(cached))]
        self._zero(fresh)
        shared = [*cached, *fresh]
        own = -(-(prompt_len + max_new_tokens - 1) // bs) - prompt_len // bs
        # a partial last block is one of its last holder's own blocks, taken already
        self.pool.reserved += n * own - (1 if prompt_len % bs else 0)
        index = on_device(slots, self.device)
        self.block_table[index, : len(shared)] = on_device(shared, self.device)
        for s in slots:
            self.blocks[s] = list(shared)
            self.reserve[s] = own
        if prompt_len % bs:
            self.shared_tail.update(slots)

    def grow(self, slots: Tensor | list[int], positions: Tensor | list[int]) -> None:
        """Make the block of each slot's next position (``positions``) its own: a fresh block at a block
        boundary, a copy of a shared partial block (copy-on-write) where others still hold it. The bookkeeping is
        the host's: given device tensors it reads each once (one device sync each; host lists cost none)."""
        bs = self.block_size
        slots_h = slots.tolist() if isinstance(slots, Tensor) else slots
        positions_h = positions.tolist() if isinstance(positions, Tensor) else positions
        check = [i for i, pos in enumerate(positions_h) if pos % bs == 0 or slots_h[i] in self.shared_tail]
        taken, copies, table = [], [], []
        for i in check:
            slot, pos = slots_h[i], positions_h[i]
            if pos % bs and self.pool.refcount[self.blocks[slot][-1]] == 1:
                self.shared_tail.discard(slot)  # the partial block's last holder writes in place: one of its own
                self.reserve[slot] -= 1
                continue
            block = self.pool.take(reserved=True)
            taken.append(block)
            self.reserve[slot] -= 1
            if pos % bs == 0:
                self.blocks[slot].append(block)
            else:  # its first own token goes into the prompt's partial last block, which others still hold
                self.shared_tail.discard(slot)
                old = self.blocks[slot][-1]
                self.pool.drop(old)
                self.blocks[slot][-1] = block
                copies.append((block, old, pos % bs))
            table.append((slot, pos // bs, block))
        if table:
            rows, columns, blocks = on_device(list(zip(*table)), self.device)  # one copy
            self.block_table[rows, columns] = blocks
        if taken:
            self._zero(taken)
        for block, old, count in copies:
            for pool in (*self.k, *self.v):
                pool[:, block * bs : block * bs + count] = pool[:, old * bs : old * bs + count]

    def release(self, slot: int) -> None:
        """The slot's row has finished: drop its blocks and its unused promise."""
        freed = [self.pool.drop(block) for block in self.blocks[slot]]
        # the last holder of a partial prompt block it never wrote: that block was one of its promised own blocks,
        # counted out of the promise at admission, and it is free again now
        settled = 1 if slot in self.shared_tail and freed and freed[-1] else 0
        self.pool.reserved -= self.reserve[slot] - settled
        self.blocks[slot], self.reserve[slot] = [], 0
        self.shared_tail.discard(slot)
        self.block_table[slot].zero_()

    def admission_need(self, prompt_len: int, n: int, max_new_tokens: int, cached: list[int]) -> int:
        """The available blocks an admission takes: :func:`blocks_for_request` less the ``cached`` blocks, plus the
        kept ones among them (held again, they are no longer available)."""
        need = blocks_for_request(prompt_len, n, max_new_tokens, self.block_size)
        return need - len(cached) + sum(block in self.pool.kept for block in cached)

    # ---------------------------------------------------------------------------------------------- prefix cache

    def cached_prefix(self, prompt: list[int]) -> list[int]:
        """The cached blocks holding the longest run of ``prompt``'s first full blocks, leaving at least its last
        token to compute (its logits are the first sample's)."""
        bs, parent, blocks = self.block_size, -1, []
        for start in range(0, (len(prompt) - 1) // bs * bs, bs):
            entry = self._entries.get((parent, tuple(prompt[start : start + bs])))
            if entry is None:
                break
            blocks.append(self._block_of[entry])
            parent = entry
        return blocks

    def remember(self, slot: int, sequence: list[int], written: int) -> None:
        """Keep ``slot``'s full blocks among its first ``written`` positions (their keys and values are final),
        whose tokens are ``sequence``'s, for later prompts that start with them; call before :meth:`release`."""
        bs, parent = self.block_size, -1
        for j in range(written // bs):
            key = (parent, tuple(sequence[j * bs : (j + 1) * bs]))
            entry = self._entries.get(key)
            if entry is None:
                block = self.blocks[slot][j]
                if block in self._entry_of:  # cached under a prefix this row only shares the tokens of
                    return
                entry, self._next_entry = self._next_entry, self._next_entry + 1
                self._entries[key], self._key_of[entry] = entry, key
                self._entry_of[block], self._block_of[entry] = entry, block
                self.pool.keep(block)
            parent = entry

    def _forget(self, block: int) -> None:
        """An evicted block's entry (the pool takes the block back)."""
        entry = self._entry_of.pop(block)
        del self._block_of[entry], self._entries[self._key_of.pop(entry)]

    # ---------------------------------------------------------------------------------------------- prefill

    def begin_prefill(self, first_slots: Tensor, mask: Tensor, tokens: int) -> None:
        """The next prefill runs left-padded prompts ``mask (b0 p)`` of ``tokens`` real tokens in all, whose keys and
        values go to the blocks of ``first_slots (b0)`` (one slot per prompt: the others share its blocks). The
        count is the caller's (host) knowledge: with it the real tokens are found without reading the device
        (``nonzero_static`` launches kernels only, where ``nonzero`` and boolean indexing wait for a count)."""
        bs = self.block_size
        position = (mask.long().cumsum(-1) - 1).clamp_(min=0)
        dst = self.block_table[first_slots[:, None], position // bs] * bs + position % bs
        src = torch.nonzero_static(mask.flatten(), size=tokens).squeeze(-1)
        self._prefill = (src, dst.flatten()[src])

    def begin_refill(self, slots: Tensor, mask: Tensor) -> None:
        """The next prefill runs the whole sequences (prompt and tokens so far) of ``slots (b0)``, left-padded
        ``mask (b0 p)``, whose keys and values go to each slot's own blocks: after new weights every position
        is computed again. A block the samples of a prompt share is written once (the first slot's values):
        their prompt tokens are the same."""
        bs = self.block_size
        position = (mask.long().cumsum(-1) - 1).clamp_(min=0)
        dst = (self.block_table[slots[:, None], position // bs] * bs + position % bs)[mask]
        src = mask.flatten().nonzero().squeeze(-1)
        dst, order = dst.sort(stable=True)
        first = torch.ones_like(dst, dtype=torch.bool)
        first[1:] = dst[1:] != dst[:-1]
        self._prefill = (src[order][first], dst[first])

    def mask_prompts(self, mask: Tensor, copies: int) -> None:
        """Nothing to mask: padding is never written (see :meth:`write_prompt`)."""
        if copies != 1:
            raise ValueError("a paged cache prefills each prompt once (copies=1); its samples share the blocks")

    def write_prompt(self, layer: int, k: Tensor, v: Tensor, copies: int) -> None:
        """The real tokens' keys and values ``(b0 kv p d)`` into their pool rows."""
        src, dst = self._prefill
        kv, d = k.shape[1], k.shape[3]
        for pool, x in ((self.k[layer], k), (self.v[layer], v)):
            pool.index_copy_(1, dst, x.transpose(0, 1).reshape(kv, -1, d).index_select(1, src).to(pool.dtype))

    # ---------------------------------------------------------------------------------------------- decode

    def begin_step(self, slots: Tensor, positions: Tensor, length: int) -> None:
        """The next :meth:`attend` calls are for one new token per slot of ``slots (b)`` at ``positions (b)``;
        ``length`` > every position (the keys attended per row)."""
        bs = self.block_size
        write = self.block_table[slots, positions // bs] * bs + positions % bs
        read = self.block_table[slots, : -(-length // bs)].flatten()
        offsets = torch.arange(length, device=self.device)
        bias = torch.zeros(slots.shape[0], length, dtype=self.att_dtype, device=self.device)
        bias.masked_fill_(offsets[None] > positions[:, None], float("-inf"))
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        self._step = (cos, sin, bias[None, :, None], write, read, length)

    def attend(self, layer: int, qkv: Tensor) -> Tensor:
        """RoPE on the new queries and keys of ``qkv (b, h + 2 kv, d)``, the new key and value written to their
        pool rows, and the attention ``(b kv g d)`` of the queries over each slot's positions."""
        cos, sin, bias, write, read, length = self._step
        b, h, d = qkv.shape[0], self.num_heads, qkv.shape[2]
        kv = (qkv.shape[1] - h) // 2
        kp, vp = self.k[layer], self.v[layer]
        qk = apply_rope(qkv[:, : h + kv], cos, sin)
        kp.index_copy_(1, write, qk[:, h:].transpose(0, 1).to(kp.dtype))
        vp.index_copy_(1, write, qkv[:, h + kv :].transpose(0, 1).to(vp.dtype))
        # whole blocks (contiguous rows) gathered, then cut to the longest row: (kv b length d)
        keys = self._gather(kp, read).view(kv, b, -1, d)[:, :, :length]
        values = self._gather(vp, read).view(kv, b, -1, d)[:, :, :length]
        q = qk[:, :h].view(b, kv, h // kv, d).transpose(0, 1).to(self.att_dtype)  # (kv b g d)
        if self.fused_attention:
            try:  # the g query heads of a KV head as its g queries: (kv b g d) over (kv b length d)
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=self.scale)
                return out.transpose(0, 1).contiguous()
            except RuntimeError as error:  # no fused kernel takes these inputs on this build: the matmuls, said once
                self.fused_attention = False
                warnings.warn(f"paged decode attention runs as matmuls: scaled_dot_product_attention failed: {error}")
        scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(self.scale).add_(bias)
        return torch.matmul(softmax_last(scores), values).transpose(0, 1).contiguous()

    # ---------------------------------------------------------------------------------------------- chunks

    def begin_chunk(self, slots: Tensor, positions: Tensor, valid: Tensor, length: int) -> None:
        """The next :meth:`attend_chunk` calls are for up to ``c`` given tokens per slot of ``slots (b)`` at
        ``positions (b c)`` (each slot's blocks grown to hold them); ``valid (b c)`` marks the real ones; ``length``
        > every position (the keys attended per row: the caller's host bookkeeping knows it). A token
        attends to its slot's positions up to its own: what the slot held before the chunk and, causally, the chunk's
        earlier tokens. Padding tokens write into the null block's first row (finite numbers, which only masked
        positions read: no boolean indexing, whose size the host would have to read back from the device); their
        queries read finite numbers and their outputs are the caller's to drop."""
        bs = self.block_size
        write = (self.block_table[slots[:, None], positions // bs] * bs + positions % bs).masked_fill_(~valid, 0)
        read = self.block_table[slots, : -(-length // bs)].flatten()
        offsets = torch.arange(length, device=self.device)
        bias = torch.zeros(*positions.shape, length, dtype=self.att_dtype, device=self.device)
        bias.masked_fill_(offsets > positions[..., None], float("-inf"))  # (b c length)
        cos, sin = self.cos[positions][:, :, None], self.sin[positions][:, :, None]
        self._chunk = (cos, sin, bias, write.flatten(), read, length)

    def attend_chunk(self, layer: int, qkv: Tensor) -> Tensor:
        """RoPE on ``qkv (b c h+2kv d)``, the real tokens' keys and values written to their pool rows (the padding
        tokens' to the null block), and the attention ``(b c h d)`` of every query over its slot's positions."""
        cos, sin, bias, write, read, length = self._chunk
        b, c, d = qkv.shape[0], qkv.shape[1], qkv.shape[3]
        h = self.num_heads
        kv = (qkv.shape[2] - h) // 2
        kp, vp = self.k[layer], self.v[layer]
        qk = apply_rope(qkv[:, :, : h + kv], cos, sin)
        new_k = qk[:, :, h:].reshape(b * c, kv, d)
        new_v = qkv[:, :, h + kv :].reshape(b * c, kv, d)
        kp.index_copy_(1, write, new_k.transpose(0, 1).to(kp.dtype))
        vp.index_copy_(1, write, new_v.transpose(0, 1).to(vp.dtype))
        keys = self._gather(kp, read).view(kv, b, -1, d)[:, :, :length]  # (kv b length d)
        values = self._gather(vp, read).view(kv, b, -1, d)[:, :, :length]
        g = h // kv
        q = qk[:, :, :h].reshape(b, c, kv, g, d).permute(2, 0, 3, 1, 4).reshape(kv, b, g * c, d).to(self.att_dtype)
        scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(self.scale).view(kv, b, g, c, length)
        scores.add_(bias[None, :, None])
        out = torch.matmul(softmax_last(scores).view(kv, b, g * c, length), values)  # (kv b g*c d)
        return out.view(kv, b, g, c, d).permute(1, 3, 0, 2, 4).reshape(b, c, h, d)
