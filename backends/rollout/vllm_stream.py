"""Sampling requests admitted into the in-process vLLM engine's running batch: a rollout server's agents' calls join
as they come, where a gathered ``llm.generate`` makes a call that arrives while it runs wait for all of it.

A :class:`VLLMRequestStream` drives the engine the way ``vllm.LLM`` does inside its own ``generate``, one iteration
at a time, so that requests can be added between iterations (``vllm/entrypoints/common/offline.py``: ``_add_request``
marks a request's output ``RequestOutputKind.FINAL_ONLY`` and hands it to ``LLMEngine.add_request``; ``_run_engine``
calls ``LLMEngine.step()`` while ``has_unfinished_requests()`` and keeps the outputs that are ``finished``). vLLM's
scheduler admits each added request into the running batch as KV-cache blocks and ``max_num_seqs`` allow, and its
prefix cache serves an agent's next call, whose prompt is the conversation so far.

A request's prompts are seeded as :func:`backends.rollout.vllm.generate` seeds a call of its own
(:func:`~backends.rollout.vllm_requests.build_requests`), so it samples those tokens whichever requests run beside
it (vLLM draws a seeded request's tokens from a generator of its own); its log-probs agree to float rounding.

Ids: the stream's requests are ``stream-<stream>-<request>``, apart from the integer ids ``LLM.generate`` numbers its
own with (its ``_run_engine`` sorts its outputs by ``int(request_id)``); whatever the stream has not returned when it
ends is aborted by those external ids, which vLLM maps to every sample of a request
(``OutputProcessor.abort_requests`` in ``vllm/v1/engine/output_processor.py``), so no request of the stream outlives
it into the engine's next ``generate``.

Not for a tensor-parallel engine: its ranks must submit the same requests in the same order, which a server's calls
arriving on one rank do not give (``VLLMRollout.start_request_stream`` returns None there; gathered calls run).
"""

from __future__ import annotations

import itertools
from typing import Any, Hashable, Sequence

import attrs

from backends.rollout.common import EndedRequest, SamplingConfig, prepare_prompts
from backends.rollout.vllm_requests import (
    add_final_only,
    build_requests,
    finished_outputs,
    ready_to_sample,
    response_rows,
)

__all__ = ["VLLMRequestStream"]

_streams = itertools.count()  #: numbers each stream's request ids apart from an earlier stream's


@attrs.define
class _Open:
    """A request's prompts and the outputs of those that have finished (by prompt index)."""

    sampling: SamplingConfig
    ids: list[str]  #: vLLM's external request id of each prompt
    outputs: dict[int, Any] = attrs.field(factory=dict)


class VLLMRequestStream:
    """The vLLM engine's :class:`~backends.rollout.engine.RequestStream` (see the module docstring). Not thread-safe:
    one thread adds and steps, and nothing else uses the engine until :meth:`end`."""

    def __init__(self, rollout: Any, sampling: SamplingConfig) -> None:
        ready_to_sample(rollout)  # a failed sync or dropped weights refuse here; a sleeping engine wakes
        self.rollout, self.sampling = rollout, sampling
        self.engine = rollout.llm.llm_engine
        self.name = f"stream-{next(_streams)}"
        self.cached_tokens = 0  #: prompt tokens vLLM's prefix cache held
        self._ids = itertools.count()
        self._open: dict[Hashable, _Open] = {}
        self._prompt_of: dict[str, tuple[Hashable, int]] = {}  #: external id -> (request key, prompt index)

    @property
    def busy(self) -> bool:
        """Some request is queued or sampling."""
        return bool(self._open)

    @property
    def requests(self) -> int:
        """Requests added and not yet returned by :meth:`step`."""
        return len(self._open)

    def add(self, key: Hashable, prompts: Sequence[Sequence[int]], *, n: int, max_new_tokens: int, seed: int) -> None:
        """Queue ``n`` samples of each of ``prompts``, each of at most ``max_new_tokens`` tokens, seeded by ``seed``;
        :meth:`step` returns them under ``key``. Refuses (``ValueError``, nothing queued) bad prompts: longer than
        the engine's context, tokens outside its vocabulary."""
        if key in self._open:
            raise ValueError(f"request {key!r} is already in the stream")
        rollout = self.rollout
        sampling = attrs.evolve(self.sampling, n=n, max_new_tokens=max_new_tokens)
        prompts = prepare_prompts(prompts, sampling, max_context=rollout.max_context, vocab_size=rollout.vocab_size)
        requests, params = build_requests(prompts, sampling, rollout.eos_token_ids, seed)
        ids = [f"{self.name}-{next(self._ids)}" for _ in requests]
        add_final_only(rollout, ids, [r["prompt_token_ids"] for r in requests], params)
        self._open[key] = _Open(sampling, ids)
        self._prompt_of.update((request_id, (key, i)) for i, request_id in enumerate(ids))

    def step(self) -> list[EndedRequest]:
        """One engine iteration: the requests whose every row ended in it, their rows in the order of a call of their
        own (prompt by prompt, a prompt's samples together)."""
        ended = []
        for output in finished_outputs(self.engine, self._prompt_of, len(self._open), "open requests"):
            key, index = self._prompt_of.pop(output.request_id)
            self.cached_tokens += output.num_cached_tokens or 0
            request = self._open[key]
            request.outputs[index] = output
            if len(request.outputs) == len(request.ids):
                del self._open[key]
                ended.append(self._ended(key, request))
        return ended

    def _ended(self, key: Hashable, request: _Open) -> EndedRequest:
        outputs = [request.outputs[i] for i in range(len(request.ids))]
        greedy = request.sampling.temperature == 0.0
        tokens, mask, logprobs = response_rows(outputs, request.sampling.n, greedy, self.rollout.pad_token_id)
        return EndedRequest(key=key, response_ids=tokens, response_mask=mask, logprobs=logprobs)

    def end(self) -> None:
        """Abort what the engine still runs for the stream; requests still in it are dropped (the caller answers
        them)."""
        unfinished = list(self._prompt_of)
        self._open.clear()
        self._prompt_of.clear()
        if unfinished:
            self.engine.abort_request(unfinished, internal=False)
