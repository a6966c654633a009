"""Sampling requests admitted into the native engine's running batch: a rollout server's requests join as they
come, where a call of gathered requests makes a request that arrives while it runs wait for all of it.

A :class:`NativeRequestStream` is one open :class:`~backends.rollout.scheduler.ContinuousBatcher` (slots for the
server's rows, positions for the engine's whole context, the paged cache of ``rollout.native``): :meth:`add` queues a
request's prompts, each with its own ``n`` samples and token limit, :meth:`step` runs one iteration and returns the
requests whose every row has ended. A request's rows draw their uniforms keyed by its own seed and its own row
numbers (prompt ``i``'s sample ``j`` is row ``i*n+j``, as :func:`backends.rollout.native.generate` numbers them), so
it samples the tokens a call of its own samples, whichever requests run beside it and whenever it joined; its
log-probs agree to float rounding (a step of another batch size may round a product differently).

With ``rollout.native.prefix_cache`` the stream keeps the full KV-cache blocks of its ended rows: an agent's next
call, whose prompt is the conversation so far, computes only the tokens after the ones its last call wrote
(:mod:`backends.rollout.paged_kv`, "Prefix cache").

The stream samples under the weights the engine holds when it starts: whoever changes them (a weight push, the
trainer's sync) lets the stream run out and ends it first (:class:`backends.rollout.server_batching.EngineBatcher`).
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

import attrs
import torch

from backends.rollout.common import EndedRequest, SamplingConfig, prepare_prompts
from backends.rollout.row_random import seed_word
from backends.rollout.scheduler import ContinuousBatcher, pool_blocks

__all__ = ["FREE_MEMORY_SHARE", "NativeRequestStream", "stream_pool_blocks"]

#: without ``rollout.native.kv_cache_gib``, a stream's cache takes at most this share of the device's free memory
FREE_MEMORY_SHARE = 0.5


def stream_pool_blocks(rollout: Any, slots: int, max_len: int, free_bytes: int | None) -> int:
    """The blocks of a stream's paged cache (null block included): ``rollout.native.kv_cache_gib`` worth if set;
    else every slot at ``max_len`` positions, but at most :data:`FREE_MEMORY_SHARE` of ``free_bytes`` (the device's
    free memory, None on a CPU). A call's cache is sized by its own rows; a stream's rows are not known when it
    opens, and a server's context (the model's, by default) can be long enough that every slot at its longest would
    not fit beside the weights."""
    limits = rollout.batching_limits
    blocks = pool_blocks(rollout, limits, slots, max_len)
    if limits.kv_cache_gib is not None or free_bytes is None:
        return blocks
    share = attrs.evolve(limits, kv_cache_gib=FREE_MEMORY_SHARE * free_bytes / 2**30)
    return max(2, min(blocks, pool_blocks(rollout, share, slots, max_len)))


@attrs.define
class _Open:
    """A request's rows and how many of them still sample."""

    rows: list[int]
    running: int


class NativeRequestStream:
    """The native engine's :class:`~backends.rollout.engine.RequestStream` (see the module docstring)."""

    def __init__(self, rollout: Any, sampling: SamplingConfig, *, max_rows: int) -> None:
        if max_rows < 1:
            raise ValueError(f"a request stream needs at least one row, got max_rows={max_rows}")
        self.rollout, self.sampling = rollout, sampling
        device = rollout.device
        free_bytes = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        with torch.inference_mode():
            self.batcher = ContinuousBatcher(
                rollout,
                [],
                sampling,
                0,
                rollout.batching_limits,
                slots=max_rows,
                max_len=rollout.max_context,
                num_blocks=stream_pool_blocks(rollout, max_rows, rollout.max_context, free_bytes),
                own_cache=True,  # the engine's other calls (an evaluation between two rounds of agents) keep theirs
                prefix_cache=rollout.batching_limits.prefix_cache,
            )
        self.cached_tokens = 0  #: prompt tokens not computed: the prefix cache held their keys and values
        self._open: dict[Hashable, _Open] = {}
        self._owner: dict[int, Hashable] = {}  #: output row -> its request

    @property
    def busy(self) -> bool:
        """Some request is queued or sampling."""
        return self.batcher.busy

    @property
    def requests(self) -> int:
        """Requests added and not yet returned by :meth:`step`."""
        return len(self._open)

    def add(self, key: Hashable, prompts: Sequence[Sequence[int]], *, n: int, max_new_tokens: int, seed: int) -> None:
        """Queue ``n`` samples of each of ``prompts``, each of at most ``max_new_tokens`` tokens, seeded by ``seed``;
        :meth:`step` returns them under ``key``. Refuses (``ValueError``, nothing queued) a request that can never
        run: bad prompts, more samples of a prompt than the stream has rows, more positions or KV-cache blocks than
        it holds."""
        if key in self._open:
            raise ValueError(f"request {key!r} is already in the stream")
        sampling = attrs.evolve(self.sampling, n=n, max_new_tokens=max_new_tokens)
        prompts = prepare_prompts(
            prompts, sampling, max_context=self.rollout.max_context, vocab_size=self.rollout.vocab_size
        )
        for i, prompt in enumerate(prompts):  # all of them, before any is queued
            self.batcher.check(prompt, max_new_tokens, n, index=i)
        word, rows = seed_word(seed), []
        for i, prompt in enumerate(prompts):
            rows += self.batcher.submit(prompt, max_new_tokens, [(word, i * n + j) for j in range(n)], index=i)
        self._open[key] = _Open(rows, len(rows))
        self._owner.update((row, key) for row in rows)

    def step(self) -> list[EndedRequest]:
        """One iteration of the batch: the requests whose last rows ended in it, their rows in the order of a call of
        their own (prompt by prompt, a prompt's samples together)."""
        with torch.inference_mode():
            ended_rows = self.batcher.step()
        self.cached_tokens = self.batcher.cached_tokens
        ended = []
        for row in ended_rows:
            key = self._owner.pop(row)
            request = self._open[key]
            request.running -= 1
            if request.running == 0:
                del self._open[key]
                ended.append(self._ended(key, request.rows))
        return ended

    def _ended(self, key: Hashable, rows: list[int]) -> EndedRequest:
        lengths = torch.tensor([len(self.batcher.rows[row].tokens) for row in rows])
        tokens, logprobs, _ = self.batcher.pop(rows)
        mask = torch.arange(tokens.shape[1])[None] < lengths[:, None]
        return EndedRequest(key=key, response_ids=tokens, response_mask=mask, logprobs=logprobs)

    def end(self) -> None:
        """Free the stream's cache; requests still in it are dropped (the caller answers them)."""
        self._open.clear()
        self._owner.clear()
        self.batcher = None
