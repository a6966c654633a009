"""The continuous-batching decode step at fixed shapes, replayed from CUDA graphs on a GPU.

A decode step of a small model is hundreds of kernel launches of a few microseconds each: on a GPU the host's
launching, not the device, sets its pace. A CUDA graph records the step's launches once and replays them with one
call. A graph fixes its shapes and addresses, so the step it records is :class:`PaddedDecodeStep`'s:

- the working rows padded to a bucket (powers of two up to the slots): padding rows feed token 0 at position 0 of
  the cache's spare slot, whose block table is all null block (:attr:`PagedKVCache.spare_slot`), so what they write
  lands in the null block, which masked positions read as finite numbers only;
- every row attends over a bucket of keys instead of the step's longest row: the smallest power-of-two number of
  blocks holding the longest row (the caller knows it: positions are host bookkeeping), at most the whole block
  table (``max_len`` keys). The keys past a row's position are masked to an exact zero weight, so the result is the
  same attention up to the float rounding of a longer reduction; a step reads at most twice the keys its longest
  row needs, where the whole table would make a short batch read them all;
- its inputs (tokens, slots, positions) copied into tensors that outlive the graph, its logits returned in one.

:class:`GraphedDecodeStep` captures a (rows, keys) bucket's graph the first time it is needed (after one eager run of
the same step, which writes the same keys and values the replay writes again) and replays it after. Within a call
the longest row grows while the working rows thin out, so a call meets a few more buckets than row buckets alone.
A capture that fails (an operation that cannot be captured on this build) leaves the step eager for the rest of the
call, with a warning naming the error. The graphs belong to one call's cache: its block table and pools are the
graphs' addresses.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

__all__ = ["GraphedDecodeStep", "PaddedDecodeStep", "key_bucket", "row_bucket"]


def row_bucket(rows: int, most: int) -> int:
    """The smallest power of two holding ``rows``, at most ``most``."""
    return min(1 << max(rows - 1, 0).bit_length(), most)


def key_bucket(length: int, block_size: int, most: int) -> int:
    """The keys a padded step attends for a longest row of ``length`` positions: a power-of-two number of whole
    blocks, at most ``most`` (the block table's positions)."""
    return min(block_size * row_bucket(-(-length // block_size), most), most)


class PaddedDecodeStep:
    """:meth:`Decoder.step_paged` over a bucket of rows and of keys (see the module docstring)."""

    def __init__(self, decoder: Any, cache: Any, max_len: int) -> None:
        self.decoder, self.cache, self.max_len = decoder, cache, max_len
        self.most = cache.spare_slot  # the admissible slots: 0 .. spare_slot - 1
        device = cache.device
        self.tokens = torch.zeros(self.most, dtype=torch.long, device=device)
        self.slots = torch.full((self.most,), cache.spare_slot, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.most, dtype=torch.long, device=device)

    def load(self, tokens: Tensor, slots: Tensor, positions: Tensor) -> int:
        """Copy the working rows into the static inputs, pad them to their bucket; returns the bucket."""
        b = tokens.shape[0]
        bucket = row_bucket(b, self.most)
        self.tokens[:b].copy_(tokens)
        self.slots[:b].copy_(slots)
        self.positions[:b].copy_(positions)
        self.tokens[b:bucket].zero_()
        self.slots[b:bucket].fill_(self.cache.spare_slot)
        self.positions[b:bucket].zero_()
        return bucket

    def keys(self, length: int) -> int:
        """The key bucket of a step whose longest row holds ``length`` positions (its new token's included)."""
        if not 0 < length <= self.max_len:
            raise ValueError(
                f"a decode step's longest row has {length} positions; the block table holds {self.max_len}"
            )
        return key_bucket(length, self.cache.block_size, self.max_len)

    def run(self, bucket: int, keys: int) -> Tensor:
        """The step over the loaded inputs' first ``bucket`` rows, attending ``keys`` positions: logits
        ``(bucket v)``."""
        n = slice(0, bucket)
        return self.decoder.step_paged(self.tokens[n], self.slots[n], self.positions[n], keys)

    def __call__(self, tokens: Tensor, slots: Tensor, positions: Tensor, length: int) -> Tensor:
        """The logits ``(b v)`` of the step of ``tokens`` at ``positions`` in ``slots`` (``b`` rows); ``length``
        > every position."""
        return self.run(self.load(tokens, slots, positions), self.keys(length))[: tokens.shape[0]]


class GraphedDecodeStep(PaddedDecodeStep):
    """:class:`PaddedDecodeStep` replayed from one CUDA graph per bucket of rows and keys."""

    def __init__(self, decoder: Any, cache: Any, max_len: int) -> None:
        super().__init__(decoder, cache, max_len)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()  # one memory pool for every bucket's intermediates
        self.failed: str | None = None

    def __call__(self, tokens: Tensor, slots: Tensor, positions: Tensor, length: int) -> Tensor:
        bucket, keys = self.load(tokens, slots, positions), self.keys(length)
        if self.failed is not None:
            return self.run(bucket, keys)[: tokens.shape[0]]
        found = self.graphs.get((bucket, keys))
        if found is None:
            # the eager step is this step's result: the capture below records its launches without running them
            logits = self.run(bucket, keys)
            self._capture(bucket, keys)
            return logits[: tokens.shape[0]]
        graph, logits = found
        graph.replay()
        return logits[: tokens.shape[0]]

    def forget(self) -> None:
        """Drop the graphs: the decoder read its weights again (partial rollouts), and a graph replays the
        addresses it captured, the fused and copied weights of before among them. The next captures take a new
        memory pool: the dropped graphs were the old pool's last users, and PyTorch's allocator releases a pool with
        its last graph (capturing into the released pool's handle fails an internal assert of the allocator)."""
        self.graphs.clear()
        self.pool = torch.cuda.graph_pool_handle()

    def _capture(self, bucket: int, keys: int) -> None:
        """Record the bucket's step: one run on a side stream first (libraries set up their per-stream state
        outside the capture, as PyTorch's CUDA-graph notes ask), then the capture on that stream, which records
        without running. The side-stream run writes the keys and values the eager step just wrote, so the cache is
        left as it was."""
        device = self.cache.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(stream):
                self.run(bucket, keys)
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                logits = self.run(bucket, keys)
        except RuntimeError as error:  # an operation this build cannot capture: stay eager, say why once
            self.failed = str(error).splitlines()[0]
            warnings.warn(f"the native engine's decode step runs without CUDA graphs: capture failed: {self.failed}")
            return
        finally:
            torch.cuda.current_stream(device).wait_stream(stream)
        self.graphs[bucket, keys] = (graph, logits)
