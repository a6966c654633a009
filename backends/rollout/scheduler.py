"""Continuous batching for the native engine: a fixed number of slots, requests admitted as rows finish.

A request is one prompt and its ``n`` samples. Each iteration of :meth:`ContinuousBatcher.run`:

1. admits waiting requests, in order, while their samples find free slots, the paged cache can promise their
   longest possible length (:func:`backends.rollout.paged_kv.blocks_for_request`) and their prompts fit the
   iteration's prefill budget (``prefill_tokens``; the first request of an iteration is admitted whatever its
   length);
2. prefills the admitted prompts together, once per prompt (the samples share its blocks);
3. samples one token for every working row (the new rows from their prompt's last logits), with the uniform keyed
   by the row's index in the output and its number of tokens so far (:func:`backends.rollout.row_random.row_uniforms`);
4. frees the rows that ended (EOS, or their request's ``max_new_tokens`` tokens) and their slots and blocks;
5. runs one decode step of the rows still running, each at its own position (on CUDA replayed from a CUDA graph
   of the step at fixed shapes: :mod:`backends.rollout.decode_graphs`).

So a short row's slot takes the next request at once instead of idling until the batch's longest row ends, and
more requests than slots stream through a bounded cache. The prefill of new prompts and the decode step of running
rows are two forwards of one iteration (not one packed forward), and a prompt is prefilled whole (no chunking).

The bookkeeping (slots, positions, tokens drawn, blocks) is the host's, in lists: an iteration reads the device once,
for the tokens it sampled (to see the EOS), and writes it once per tensor it builds. On CUDA (``overlap``) steps 4
and 5 swap: the decode step of every row below its limit is queued first, the tokens are read while it runs, and a
row that sampled its EOS has stepped once for nothing (its logits are dropped). The host then never holds the
device idle between two steps (TensorRT-LLM's overlap scheduler and SGLang's zero-overhead scheduler make the same
trade: one extra step per finished row); on a CPU, where a step runs as it is called, nothing overlaps and the
batcher waits for the tokens first.

**Partial rollouts** (``updates``, a :class:`WeightUpdates`): every ``updates.chunk_tokens`` iterations the batcher
stops at a chunk boundary and hands control to the caller (``updates.at_boundary()``), which may copy newer
weights into the engine. The unfinished rows then continue under them: their tokens so far stay, and their keys
and values are computed again from the prompt and those tokens (one prefill of the whole sequence per row, as
AReaL and SGLang recompute the cache after a weight update), because keys and values of the old weights must not
be attended by the new ones; the prefill's last logits are the next token's under the new weights. Each token
records the version of the weights that sampled it (``versions``), and its log-prob is under those weights.
The uniforms stay keyed by (seed, row, token index), so a row's draws do not depend on where the boundaries fell;
with unchanged weights at every boundary the tokens are the ones a call without ``updates`` samples.

Rows are numbered as :func:`backends.rollout.native.generate` numbers them (prompt ``i``'s samples are rows
``i*n .. i*n+n-1``), so the lock-step loop and this one draw the same uniforms for the same row and token.
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Protocol

import attrs
import torch
from torch import Tensor

from backends.rollout.common import HostCopy, SamplingConfig, left_pad, on_device, sample_tokens
from backends.rollout.decode_graphs import GraphedDecodeStep
from backends.rollout.decoder import Decoder
from backends.rollout.paged_kv import PagedKVCache, blocks_for_request, pool_blocks_for_budget, request_too_large
from backends.rollout.row_random import RowKeys, row_uniforms

__all__ = ["BatchingLimits", "ContinuousBatcher", "WeightUpdates", "generate_continuous", "pool_blocks"]


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"BatchingLimits.{attribute.name} must be positive, got {value}")


@attrs.frozen
class BatchingLimits:
    """How much continuous batching runs at once (``NativeRollout.batching_limits``)."""

    #: rows decoded together (each a slot); None: every row of the call, up to :data:`DEFAULT_MAX_SLOTS`
    max_slots: int | None = attrs.field(default=None, validator=_positive)
    prefill_tokens: int = attrs.field(default=4096, validator=_positive)  #: prompt tokens one iteration prefills
    #: tokens per KV-cache block: a decode step gathers whole blocks, so the longest row's last block is padding; on
    #: a CPU 8 ran config B's decode faster than 16 or 4 (less padding, blocks still long enough to copy fast)
    block_size: int = attrs.field(default=8, validator=_positive)
    #: keys and values of the pool, in GiB; None: enough for ``max_slots`` rows at their longest
    kv_cache_gib: float | None = attrs.field(default=None, validator=_positive)
    #: on CUDA, replay the decode step from CUDA graphs (:mod:`backends.rollout.decode_graphs`)
    cuda_graphs: bool = True
    #: on CUDA, queue each decode step before reading the tokens sampled before it (see the module docstring)
    overlap_steps: bool = True


#: the default number of slots: rows beyond it wait for a free one
DEFAULT_MAX_SLOTS = 1024


class WeightUpdates(Protocol):
    """The caller's side of a generation that may take new weights at chunk boundaries (partial rollouts)."""

    chunk_tokens: int  #: decode iterations between two boundaries

    def version(self) -> int:
        """The version of the weights the engine holds now (what the next sampled tokens are stamped with)."""
        ...

    def at_boundary(self) -> Any | None:
        """Called at a chunk boundary: copy newer weights into the engine's model (in place, as ``sync_weights``
        does) and return the engine's new value, or return None to go on with the weights it has."""
        ...


@attrs.define
class _Working:
    """The running rows, in the order the decode step computes them: host lists of length ``b`` (the scheduler's
    bookkeeping never reads the device) and their next-token logits on the device."""

    slot: list[int]  #: cache slot
    row: list[int]  #: row of the output batch
    position: list[int]  #: position of the next token to feed (the tokens the row holds)
    drawn: list[int]  #: tokens sampled so far
    logits: Tensor  #: (b v) fp32: next-token logits

    def keep(self, index: list[int]) -> None:
        """Keep rows ``index``, in that order."""
        for name in ("slot", "row", "position", "drawn"):
            values = getattr(self, name)
            setattr(self, name, [values[i] for i in index])
        if len(index) != self.logits.shape[0]:
            self.logits = self.logits[on_device(index, self.logits.device)]

    def extend(self, other: _Working) -> None:
        for name in ("slot", "row", "position", "drawn"):
            getattr(self, name).extend(getattr(other, name))
        self.logits = torch.cat([self.logits, other.logits])


def _prompt_limits(max_new_tokens: list[int] | None, prompts: int, default: int) -> list[int]:
    """Each prompt's most new tokens: ``max_new_tokens`` (checked) or ``default`` for all."""
    if max_new_tokens is None:
        return [default] * prompts
    if len(max_new_tokens) != prompts:
        raise ValueError(f"max_new_tokens has {len(max_new_tokens)} limits for {prompts} prompts: give one per prompt")
    bad = [(i, m) for i, m in enumerate(max_new_tokens) if not isinstance(m, int) or isinstance(m, bool) or m < 1]
    if bad:
        raise ValueError(f"max_new_tokens[{bad[0][0]}] is {bad[0][1]!r}: each prompt's limit must be an int >= 1")
    return list(max_new_tokens)


def pool_blocks(rollout: Any, limits: BatchingLimits, slots: int, max_len: int) -> int:
    """Blocks of a paged cache (the null block included) for ``slots`` rows of at most ``max_len`` positions:
    ``limits.kv_cache_gib`` worth, or, without a budget, every slot at its longest as if no block were shared."""
    bs = limits.block_size
    if limits.kv_cache_gib is None:
        return slots * -(-max_len // bs) + 1
    cfg = rollout.model.config
    # the decoder keeps keys and values in fp32 on the CPU, in the weights' dtype elsewhere
    weight_dtype = rollout.model.get_input_embeddings().weight.dtype
    return pool_blocks_for_budget(
        limits.kv_cache_gib,
        layers=cfg.num_hidden_layers,
        kv_heads=cfg.num_key_value_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        block_size=bs,
        itemsize=4 if rollout.device.type == "cpu" else weight_dtype.itemsize,
    )


class ContinuousBatcher:
    """One call's scheduler: its requests, slots, paged cache and outputs (see the module docstring)."""

    def __init__(
        self,
        rollout: Any,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        seed: int | RowKeys,
        limits: BatchingLimits,
        updates: WeightUpdates | None = None,
        max_new_tokens: list[int] | None = None,
    ) -> None:
        self.rollout, self.prompts, self.sampling, self.seed = rollout, prompts, sampling, seed
        if updates is not None and not (isinstance(updates.chunk_tokens, int) and updates.chunk_tokens > 0):
            raise ValueError(f"WeightUpdates.chunk_tokens must be a positive int, got {updates.chunk_tokens!r}")
        self.updates = updates
        device, n = rollout.device, sampling.n
        self.device, self.n = device, n
        #: each prompt's most new tokens per sample (a request's own limit, as a server's requests have)
        self.max_new = _prompt_limits(max_new_tokens, len(prompts), sampling.max_new_tokens)
        max_new = max(self.max_new, default=sampling.max_new_tokens)
        rows = len(prompts) * n
        slots = min(rows, limits.max_slots or DEFAULT_MAX_SLOTS)
        if slots < n:
            raise ValueError(
                f"rollout.native.max_slots={slots} is fewer than rollout.n={n}: a prompt's samples are admitted "
                "together, so the slots must hold n rows at least"
            )
        self.max_len = max((len(p) + m for p, m in zip(prompts, self.max_new)), default=max_new)
        bs = limits.block_size
        num_blocks = pool_blocks(rollout, limits, slots, self.max_len)
        self.needs = [blocks_for_request(len(p), n, m, bs) for p, m in zip(prompts, self.max_new)]
        for i, need in enumerate(self.needs):
            if need > num_blocks - 1:
                usable = max(num_blocks - 1, 0)
                raise ValueError(request_too_large(i, len(prompts[i]), n, self.max_new[i], need, usable, bs))
        make_cache = functools.partial(
            PagedKVCache.allocate, slots=slots, max_len=self.max_len, num_blocks=num_blocks, block_size=bs
        )
        # partial rollouts: the caller may generate (an evaluation) at a boundary, which must not take these caches
        self.decoder = Decoder(
            rollout.model,
            slots,
            self.max_len,
            rollout.prepack_cpu_weights,
            rollout.workspace,
            make_cache=make_cache,
            own_cache=updates is not None,
        )
        self.cache: PagedKVCache = self.decoder.cache
        self.cache.reset()
        graphed = device.type == "cuda" and limits.cuda_graphs
        self.graphed_step = GraphedDecodeStep(self.decoder, self.cache, self.max_len) if graphed else None
        #: queue each decode step before reading the tokens sampled before it (on CUDA, where the device runs
        #: behind the host): the rows that just sampled their EOS step once more, for nothing, and in exchange the
        #: device never waits for the host's bookkeeping between two steps
        self.overlap = device.type == "cuda" and limits.overlap_steps
        self.prefill_tokens = limits.prefill_tokens
        self.waiting = collections.deque(range(len(prompts)))
        self.free_slots = list(range(slots - 1, -1, -1))
        self.eos = set(rollout.eos_token_ids)
        self.tokens = torch.full((rows, max_new), rollout.pad_token_id, dtype=torch.long, device=device)
        self.logprobs = torch.zeros((rows, max_new), dtype=torch.float32, device=device)
        self.version = updates.version() if updates is not None else 0  #: of the weights sampling now
        #: the version of the weights that sampled each token (the start version where none was sampled)
        self.versions = torch.full((rows, max_new), self.version, dtype=torch.long, device=device)
        self.weight_loads = 0  #: boundaries at which new weights were taken
        self.refilled_tokens = 0  #: tokens whose keys and values were computed again under new weights
        self.steps = 0  #: the most tokens any row has sampled
        self.iterations = 0
        self.peak_blocks = 0  #: the most blocks held at once
        self.peak_rows = 0  #: the most rows decoded together

    def run(self) -> tuple[Tensor, Tensor]:
        """Raw tokens and log-probs ``(rows steps)``, as the lock-step loop returns them."""
        work = _Working([], [], [], [], torch.zeros(0, self.rollout.vocab_size, device=self.device))
        while self.waiting or work.row:
            if self.updates is not None and self.iterations and self.iterations % self.updates.chunk_tokens == 0:
                self._boundary(work)
            admitted = self._admit()
            if admitted:
                work.extend(self._prefill(admitted))
            if not work.row:
                raise RuntimeError("continuous batching: requests wait but none can be admitted (a check was skipped)")
            self.iterations += 1
            self.peak_blocks = max(self.peak_blocks, self.cache.pool.usable - len(self.cache.pool.free))
            self.peak_rows = max(self.peak_rows, len(work.row))
            token = self._sample(work)
            sampled = HostCopy(token)
            below_limit = [i for i, (r, d) in enumerate(zip(work.row, work.drawn)) if d < self.max_new[r // self.n]]
            if self.overlap:
                # the next step is queued before this step's tokens reach the host: a row that sampled its EOS
                # steps once more (its logits are dropped), and the device does not wait for the bookkeeping
                stepped = self._step(work, token, below_limit)
                tokens = sampled.values()
                going = [j for j, i in enumerate(below_limit) if tokens[i] not in self.eos]
                self._release(work, sorted(set(range(len(tokens))) - {below_limit[j] for j in going}))
                stepped.keep(going)
            else:
                tokens = sampled.values()
                running = [i for i in below_limit if tokens[i] not in self.eos]
                self._release(work, sorted(set(range(len(tokens))) - set(running)))
                stepped = self._step(work, token, running)
            work = stepped
        return self.tokens[:, : self.steps], self.logprobs[:, : self.steps]

    def _release(self, work: _Working, index: list[int]) -> None:
        """Working rows ``index`` have ended: their slots and blocks are free (a decode step already queued that
        still writes into them runs before any later use of them: the device runs its work in order)."""
        for i in index:
            self.cache.release(work.slot[i])
            self.free_slots.append(work.slot[i])

    def _step(self, work: _Working, token: Tensor, index: list[int]) -> _Working:
        """One decode step of working rows ``index``, each fed its entry of ``token (b)``: those rows, one position
        further, with the step's logits."""
        slot, row = [work.slot[i] for i in index], [work.row[i] for i in index]
        position, drawn = [work.position[i] for i in index], [work.drawn[i] for i in index]
        if not index:
            return _Working(slot, row, position, drawn, work.logits[:0])
        if len(index) != len(work.row):
            token = token[on_device(index, self.device)]
        self.cache.grow(slot, position)
        slots, positions = on_device([slot, position], self.device)  # one copy
        if self.graphed_step is not None:
            logits = self.graphed_step(token, slots, positions, max(position) + 1)
        else:
            logits = self.decoder.step_paged(token, slots, positions, max(position) + 1)
        # read before the next step: a graph's logits are overwritten there
        return _Working(slot, row, [p + 1 for p in position], drawn, logits.float())

    def _admit(self) -> list[tuple[int, list[int]]]:
        """Waiting requests that fit now, each with its slots."""
        admitted, tokens = [], 0
        pool = self.cache.pool
        while self.waiting:
            i = self.waiting[0]
            prompt_len = len(self.prompts[i])
            if len(self.free_slots) < self.n or self.needs[i] > pool.available:
                break
            if admitted and tokens + prompt_len > self.prefill_tokens:
                break
            self.waiting.popleft()
            slots = [self.free_slots.pop() for _ in range(self.n)]
            self.cache.admit(slots, prompt_len, self.max_new[i])
            admitted.append((i, slots))
            tokens += prompt_len
        return admitted

    def _prefill(self, admitted: list[tuple[int, list[int]]]) -> _Working:
        """Prefill the admitted prompts once each; their samples as new working rows."""
        n, device = self.n, self.device
        prompts = [self.prompts[i] for i, _ in admitted]
        ids, mask = left_pad(prompts, self.rollout.pad_token_id)
        ids, mask = on_device(ids, device), on_device(mask, device)
        self.cache.begin_prefill(on_device([slots[0] for _, slots in admitted], device), mask)
        logits = self.decoder.prefill(ids, mask, copies=1).float().repeat_interleave(n, dim=0)
        slot = [s for _, slots in admitted for s in slots]
        row = [i * n + j for i, _ in admitted for j in range(n)]
        position = [len(p) for p in prompts for _ in range(n)]
        return _Working(slot, row, position, [0] * len(row), logits)

    def _sample(self, work: _Working) -> Tensor:
        """One token per working row, recorded in the outputs; counts it in ``work.drawn``."""
        rows, drawn = on_device([work.row, work.drawn], self.device)  # one copy
        uniform = None
        if self.sampling.temperature > 0.0:
            uniform = row_uniforms(self.seed, rows, drawn)[:, None]
        token = sample_tokens(work.logits, self.sampling, None, uniform=uniform)
        logprob = torch.log_softmax(work.logits, dim=-1).gather(-1, token[:, None]).squeeze(-1)
        self.tokens[rows, drawn] = token
        self.logprobs[rows, drawn] = logprob
        self.versions[rows, drawn] = self.version
        work.drawn = [d + 1 for d in work.drawn]
        self.steps = max(self.steps, max(work.drawn))
        return token

    def _boundary(self, work: _Working) -> None:
        """A chunk boundary: the caller may load new weights; if it did, the working rows continue under them."""
        with torch.inference_mode(False):  # the caller's weight sync and evaluation run as they would outside
            new = self.updates.at_boundary()
        if new is None:
            return
        if new.model is not self.rollout.model:
            raise RuntimeError(
                "WeightUpdates.at_boundary returned an engine over another model: new weights must be copied into "
                "the model this generation decodes (sync_weights copies them in place)"
            )
        self.rollout, self.version = new, self.updates.version()
        self.weight_loads += 1
        self.decoder.reload_weights()
        if self.graphed_step is not None:
            self.graphed_step.forget()
        if work.row:
            work.logits = self._refill(work)

    def _refill(self, work: _Working) -> Tensor:
        """Prefill each working row's prompt and tokens so far again, into its own blocks, under the weights the
        model holds now; the next-token logits ``(b v)`` fp32. Rows are prefilled in groups of at most
        ``prefill_tokens`` tokens (at least one row a group)."""
        n, device = self.n, self.device
        sequences = [self.prompts[r // n] + self.tokens[r, :d].tolist() for r, d in zip(work.row, work.drawn)]
        if any(len(q) != p for q, p in zip(sequences, work.position)):
            raise RuntimeError("continuous batching: a row's cache does not hold its prompt and sampled tokens")
        groups, start, tokens = [], 0, 0
        for i, q in enumerate(sequences):
            if i > start and tokens + len(q) > self.prefill_tokens:
                groups.append((start, i))
                start, tokens = i, 0
            tokens += len(q)
        groups.append((start, len(sequences)))
        logits = []
        for lo, hi in groups:
            ids, mask = left_pad(sequences[lo:hi], self.rollout.pad_token_id)
            ids, mask = on_device(ids, device), on_device(mask, device)
            self.cache.begin_refill(on_device(work.slot[lo:hi], device), mask)
            logits.append(self.decoder.prefill(ids, mask, copies=1).float())
        self.refilled_tokens += sum(map(len, sequences))
        return torch.cat(logits)


def generate_continuous(
    rollout: Any,
    prompts: list[list[int]],
    sampling: SamplingConfig,
    seed: int | RowKeys,
    limits: BatchingLimits,
    updates: WeightUpdates | None = None,
    max_new_tokens: list[int] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Raw tokens, log-probs and the version of the weights that sampled each token ``(rows steps)`` of
    ``prompts`` (checked) through continuous batching; prompt ``i``'s samples stop after ``max_new_tokens[i]``
    tokens if given (``sampling.max_new_tokens`` else), their tokens past it are padding."""
    batcher = ContinuousBatcher(rollout, prompts, sampling, seed, limits, updates, max_new_tokens)
    tokens, logprobs = batcher.run()
    return tokens, logprobs, batcher.versions[:, : batcher.steps]
