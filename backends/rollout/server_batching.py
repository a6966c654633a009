"""Concurrent sampling requests share the engine: one worker runs a rollout server's engine.

An agent's model call is one prompt of one row; a run's agents make dozens of them at once, and an engine call of
one row costs nearly what a call of thirty-two does on a small model. So every sampling request of a server (the
OpenAI routes) is queued, and one worker thread runs them together, in one of two ways:

- **a request stream**, where the engine has one (``RequestStream``: the native engine with continuous batching,
  an in-process vLLM engine of one rank):
  the oldest waiting request opens it, and every waiting request of the same sampling options (temperature, top-p,
  top-k; ``n``, ``max_tokens`` and seeds may differ) joins it as soon as it comes, into rows that free as others
  end; each request is answered when its own rows have ended. The stream stops taking requests when one of other
  options is next in line, when the engine or its weights change, or while the batcher is paused (a weight push,
  the trainer's own call), and ends once its rows have;
- **gathered calls** otherwise: the oldest waiting request and every other waiting request of the same sampling
  options (up to ``max_rows`` rows in all) run as one ``generate``, and each request gets its rows. Gather what
  waits, run, repeat: while one call runs, the next one fills, and a request that comes during a call waits for
  the whole call.

Each request's rows are keyed by its own seed (:class:`~backends.rollout.row_random.RowKeys`), so a request samples
the tokens a call of its own samples, whichever requests share the engine with it; its log-probs agree to float
rounding (a batch of another shape may round a matrix product differently). A request refused for its inputs
(``ValueError`` / ``TypeError``: a prompt longer than the context, a token outside the vocabulary) fails alone: a
stream refuses it when it joins, and a gathered call so refused is run again request by request.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable, Iterator

import attrs
from torch import Tensor

from backends.rollout.common import SamplingConfig
from backends.rollout.row_random import RowKeys

__all__ = ["EngineBatcher", "OpenStream", "SampledRows"]

log = logging.getLogger(__name__)

#: an engine call: (prompts, sampling, row keys) -> (the RolloutBatch, the policy version that sampled it)
EngineCall = Callable[[list[list[int]], SamplingConfig, RowKeys], tuple[Any, int]]


@attrs.frozen
class OpenStream:
    """A request stream opened on the engine (:class:`backends.rollout.engine.RequestStream`), with the engine held
    for it until ``release``."""

    stream: Any  #: the RequestStream
    version: int  #: the policy version it samples with
    current: Callable[[], bool]  #: the engine and its weights are still those the stream samples with
    release: Callable[[], None]  #: let the engine go (after the stream ended)


#: opens a request stream for sampling options, or returns None (the engine has none: gathered calls run)
StreamOpener = Callable[[SamplingConfig], OpenStream | None]


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


def _same_stream_options(a: SamplingConfig, b: SamplingConfig) -> bool:
    """Requests a stream runs together: a row's own ``n``, token limit and seed are its request's."""
    return attrs.evolve(a, seed=0, n=1, max_new_tokens=1) == attrs.evolve(b, seed=0, n=1, max_new_tokens=1)


class EngineBatcher:
    """The queue of a server's sampling requests and the worker that runs them (see the module doc)."""

    def __init__(
        self,
        engine_call: EngineCall,
        *,
        max_rows: int = 64,
        open_stream: StreamOpener | None = None,
        linger_s: float = 2.0,
    ) -> None:
        if max_rows < 1:
            raise ValueError(f"EngineBatcher: max_rows must be at least 1, got {max_rows}")
        if linger_s < 0:
            raise ValueError(f"EngineBatcher: linger_s must be at least 0, got {linger_s}")
        self.engine_call, self.max_rows, self.open_stream = engine_call, max_rows, open_stream
        #: how long a stream whose rows have all ended waits for the next call before it ends (an agent's next turn,
        #: sent after its tool ran, then finds its conversation in the stream's prefix cache)
        self.linger_s = linger_s
        self.calls = 0  #: gathered engine calls run
        self.streams = 0  #: request streams opened
        self.requests = 0  #: requests answered by them
        self.joined = 0  #: requests that joined a stream while its rows were sampling
        self.cached_tokens = 0  #: prompt tokens streams did not compute (their prefix caches held them)
        self.largest = 0  #: the most requests one call or one stream answered
        self._waiting: list[_Request] = []
        self._pending = 0
        self._paused = 0
        self._settling = 0
        self._streaming = False
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
            self._cond.notify_all()  # the worker, whether it waits for work or lingers in a stream
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
        """Counts since start, and ``engine/paused``: holds on new requests in effect (a weight push waiting)."""
        return {
            "engine/paused": self._paused,
            "engine/calls": self.calls,
            "engine/streams": self.streams,
            "engine/requests": self.requests,
            "engine/joined": self.joined,
            "engine/prefix_cached_tokens": self.cached_tokens,
            "engine/largest_call": self.largest,
        }

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """While inside, no request starts (those in the engine finish): the engine is free for whoever takes it
        next, a weight push or the trainer's own call."""
        with self._cond:
            self._paused += 1
            self._cond.notify_all()  # a lingering stream ends now
        try:
            yield
        finally:
            with self._cond:
                self._paused -= 1
                self._cond.notify_all()

    def settle(self) -> None:
        """End the request stream as soon as its rows have ended (no lingering, nothing more joins), and return then:
        its cache's memory is free for whatever the caller runs next (the trainer, after a round of agents)."""
        with self._cond:
            self._settling += 1
            self._cond.notify_all()
            try:
                while self._streaming:
                    self._cond.wait()
            finally:
                self._settling -= 1
                self._cond.notify_all()

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
                while (not self._waiting or self._paused) and not self._closed:
                    self._cond.wait()
                if self._closed:
                    for request in self._waiting:
                        request.finish(error=RuntimeError("the rollout server shut down before this request ran"))
                    self._waiting.clear()
                    return
                head = self._waiting[0]
            try:
                opened = self._open(head.sampling)
            except BaseException as e:  # the engine could not run it: the requests it would have run hear why
                with self._cond:
                    taken = self._take()
                for request in taken:
                    request.finish(error=e)
                continue
            if opened is not None:
                try:
                    self._stream(opened, head.sampling)
                except Exception:  # its requests were answered; the worker goes on for the next ones
                    log.exception("a request stream failed as it ended")
                continue
            with self._cond:
                taken = self._take()
            self._run(taken)

    def _open(self, sampling: SamplingConfig) -> OpenStream | None:
        if self.open_stream is None or sampling.n > self.max_rows:
            return None
        return self.open_stream(sampling)

    def _stream(self, opened: OpenStream, options: SamplingConfig) -> None:
        """Run requests of ``options`` through the stream while they come; end it once nothing more joins and its
        rows have ended."""
        stream, live, answered = opened.stream, {}, 0
        joining: list[_Request] = []
        with self._cond:
            self._streaming = True
        self.streams += 1
        try:
            while True:
                joining = self._joining(options, opened)
                while joining:
                    request, busy = joining[0], stream.busy
                    try:
                        stream.add(
                            id(request),
                            request.prompts,
                            n=request.sampling.n,
                            max_new_tokens=request.sampling.max_new_tokens,
                            seed=request.seed,
                        )
                    except (ValueError, TypeError) as e:  # this request's inputs
                        request.finish(error=e)
                    else:
                        live[id(request)] = request
                        self.joined += busy
                    joining.pop(0)
                if not stream.busy:
                    if self._linger(options, opened):
                        continue
                    break
                for ended in stream.step():
                    rows = SampledRows(ended.response_ids, ended.response_mask, ended.logprobs, opened.version)
                    live.pop(ended.key).finish(rows)
                    answered += 1
                    self.requests += 1
                    self.largest = max(self.largest, answered)
        except BaseException as e:  # the engine's own failure: every request it took hears of it
            for request in [*live.values(), *joining]:
                request.finish(error=e)
        finally:
            try:
                stream.end()
            finally:
                opened.release()
                with self._cond:
                    self._streaming = False
                    self._cond.notify_all()
        self.cached_tokens += stream.cached_tokens

    def _joining(self, options: SamplingConfig, opened: OpenStream) -> list[_Request]:
        """The waiting requests that join the stream now: the oldest ones, up to the first that cannot (other
        options, more samples of a prompt than the rows), unless the stream takes no more."""
        with self._cond:
            count = self._joinable(options, opened)
            joining, self._waiting = self._waiting[:count], self._waiting[count:]
            return joining

    def _joinable(self, options: SamplingConfig, opened: OpenStream) -> int:
        """How many of the oldest waiting requests may join the stream (under ``self._cond``)."""
        if self._paused or self._settling or self._closed or not opened.current():
            return 0
        count = 0
        for request in self._waiting:
            if not _same_stream_options(request.sampling, options) or request.sampling.n > self.max_rows:
                break
            count += 1
        return count

    def _linger(self, options: SamplingConfig, opened: OpenStream) -> bool:
        """The stream's rows have all ended: wait up to ``linger_s`` for a request that may join (True), or until the
        stream should end (False: a request that may not join waits, or the batcher pauses, settles or closes)."""

        def decided() -> bool:
            stop = self._paused or self._settling or self._closed or not opened.current()
            return stop or bool(self._waiting)

        with self._cond:
            self._cond.wait_for(decided, timeout=self.linger_s)
            return self._joinable(options, opened) > 0

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
