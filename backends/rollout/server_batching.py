"""Concurrent sampling requests share engine calls: one worker runs a rollout server's engine.

An agent's model call is one prompt of one row; a run's agents make dozens of them at once, and an engine call of
one row costs nearly what a call of thirty-two does on a small model. So every sampling request of a server (the
OpenAI routes) is queued, and one worker thread takes the oldest waiting request together with every other waiting
request of the same sampling options (up to ``max_rows`` rows in all), runs them as one ``generate`` and hands each
request its rows. Gather what waits, run, repeat: while one call runs, the next one fills.

Each request's rows are keyed by its own seed (:class:`~backends.rollout.row_random.RowKeys`), so a request samples
the tokens a call of its own samples, whichever requests share its call; its log-probs agree to float rounding (a
batch of another shape may round a matrix product differently). A call refused for its inputs (``ValueError`` /
``TypeError``: a prompt longer than the context, a token outside the vocabulary) is run again request by request,
so only the request at fault is refused.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import attrs
from torch import Tensor

from backends.rollout.common import SamplingConfig
from backends.rollout.row_random import RowKeys

__all__ = ["EngineBatcher", "SampledRows"]

#: an engine call: (prompts, sampling, row keys) -> (the RolloutBatch, the policy version that sampled it)
EngineCall = Callable[[list[list[int]], SamplingConfig, RowKeys], tuple[Any, int]]


@attrs.frozen
class SampledRows:
    """One request's rows of an engine call: ``(rows t)`` right-padded, ``t`` the longest of them."""

    response_ids: Tensor
    response_mask: Tensor
    logprobs: Tensor
    version: int  #: the policy version that sampled them


@attrs.define(eq=False)
class _Request:
    prompts: list[list[int]]
    sampling: SamplingConfig
    seed: int
    done: threading.Event = attrs.field(factory=threading.Event)
    result: SampledRows | None = None
    error: BaseException | None = None

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.sampling.n

    def finish(self, result: SampledRows | None = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


def _same_options(a: SamplingConfig, b: SamplingConfig) -> bool:
    return attrs.evolve(a, seed=0) == attrs.evolve(b, seed=0)


class EngineBatcher:
    """The queue of a server's sampling requests and the worker that runs them (see the module doc)."""

    def __init__(self, engine_call: EngineCall, *, max_rows: int = 64) -> None:
        if max_rows < 1:
            raise ValueError(f"EngineBatcher: max_rows must be at least 1, got {max_rows}")
        self.engine_call, self.max_rows = engine_call, max_rows
        self.calls = 0  #: engine calls run
        self.requests = 0  #: requests answered by them
        self.largest = 0  #: the most requests one call answered
        self._waiting: list[_Request] = []
        self._pending = 0
        self._closed = False
        self._cond = threading.Condition()
        self._worker: threading.Thread | None = None

    def sample(self, prompts: list[list[int]], sampling: SamplingConfig, seed: int) -> SampledRows:
        """``sampling.n`` rows of each of ``prompts`` seeded by ``seed``, once the worker has run them; raises what
        the engine raised on them."""
        if not prompts:
            raise ValueError("a sampling request needs at least one prompt")
        request = _Request(prompts=prompts, sampling=sampling, seed=seed)
        with self._cond:
            if self._closed:
                raise RuntimeError("the rollout server is shutting down: its engine takes no more requests")
            if self._worker is None:
                # daemon: a server stopped while a call runs does not hold up the process's exit
                self._worker = threading.Thread(target=self._work, daemon=True, name="rollout-engine")
                self._worker.start()
            self._waiting.append(request)
            self._pending += 1
            self._cond.notify()
        request.done.wait()
        with self._cond:
            self._pending -= 1
        if request.error is not None:
            raise request.error
        assert request.result is not None
        return request.result

    @property
    def pending(self) -> int:
        """Requests submitted and not yet answered (waiting, or in the engine call under way)."""
        with self._cond:
            return self._pending

    @property
    def stats(self) -> dict[str, int]:
        return {"engine/calls": self.calls, "engine/requests": self.requests, "engine/largest_call": self.largest}

    def close(self, timeout_s: float = 30.0) -> None:
        """Refuse new requests; the waiting ones fail, the call under way finishes, and the worker is joined (a
        daemon thread left running into the interpreter's exit can abort the process)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout_s)

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed:
                    for request in self._waiting:
                        request.finish(error=RuntimeError("the rollout server shut down before this request ran"))
                    self._waiting.clear()
                    return
                taken = self._take()
            self._run(taken)

    def _take(self) -> list[_Request]:
        """The oldest waiting request and the others of its sampling options that fit ``max_rows`` (in order)."""
        head = self._waiting[0]
        taken, rows = [head], head.rows
        for request in self._waiting[1:]:
            if _same_options(request.sampling, head.sampling) and rows + request.rows <= self.max_rows:
                taken.append(request)
                rows += request.rows
        self._waiting = [r for r in self._waiting if all(r is not t for t in taken)]
        return taken

    def _run(self, requests: list[_Request]) -> None:
        prompts = [p for r in requests for p in r.prompts]
        keys = RowKeys.of_requests([r.seed for r in requests], [r.rows for r in requests])
        try:
            batch, version = self.engine_call(prompts, requests[0].sampling, keys)
        except (ValueError, TypeError) as e:
            if len(requests) == 1:
                requests[0].finish(error=e)
            else:  # one request's inputs: each alone, so only that one is refused
                for request in requests:
                    self._run([request])
            return
        except BaseException as e:  # the engine's own failure: every request of the call hears of it
            for request in requests:
                request.finish(error=e)
            return
        self.calls += 1
        self.requests += len(requests)
        self.largest = max(self.largest, len(requests))
        start = 0
        for request in requests:
            end = start + request.rows
            mask = batch.response_mask[start:end]
            t = max(1, int(mask.sum(-1).max()))
            request.finish(
                SampledRows(
                    response_ids=batch.response_ids[start:end, :t],
                    response_mask=mask[:, :t],
                    logprobs=batch.rollout_logprobs[start:end, :t],
                    version=version,
                )
            )
            start = end
