"""The worker processes that run user reward functions: one call at a time each, so a worker that dies is known
at once, with the call it was running.

``multiprocessing.Pool`` loses the task of a worker that dies (``os._exit``, a crash in native code, a kill from
outside) and its result never comes: the caller learns of it only when its own time limit runs out, as a timeout.
Here each worker has its own pipe, and the parent waits on the pipes and the processes' sentinels together: a
death ends its call at once with what happened (the exit code, or the signal), and a new worker takes its place
while the others go on. ``sys.exit`` inside a function is an error of that call; the worker lives on.

A worker is a plain ``python`` process started with ``subprocess`` (not ``multiprocessing``'s spawn, which would
import the trainer's own script in every worker and start a resource-tracker process): it imports only
this module and the reward functions, and talks over a socket pair. Workers die with their parent: each asks the
kernel for SIGKILL when the thread that started it ends (``PR_SET_PDEATHSIG``, Linux) and a thread in it also
watches the parent's pid, so a trainer killed with SIGKILL leaves no process behind.
"""

from __future__ import annotations

import collections
import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterator, Mapping, Sequence

__all__ = ["CallTimeout", "time_limit", "WorkerPool", "Outcome", "how_it_died", "serve"]

#: how long past reward.timeout_s a call may run before its worker is stopped (its SIGALRM did not interrupt it:
#: native code that does not return to Python)
KILL_AFTER_S = 5.0
#: the longest a new worker may take to start and import the reward functions
START_TIMEOUT_S = 120.0


class CallTimeout(BaseException):
    """Raised inside a reward call that ran past its limit (a BaseException: a user's ``except Exception``
    inside the function does not swallow it)."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Interrupt the body after ``seconds`` (SIGALRM; only on the main thread, elsewhere no limit)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise CallTimeout()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


#: ``(status, value)``: ``("ok", result)``, ``("not-a-score", (type name, text))`` (a result that cannot be sent
#: back, such as a generator), ``("error", what the call did)``, ``("died", how its worker died)``, ``("hung", ...)``
#: (stopped past its time limit) or ``("skipped", why it was not run)``
Outcome = tuple[str, Any]


def how_it_died(exitcode: int | None, pid: int) -> str:
    """A worker's end, in words, from its exit code."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"its worker process (pid {pid}) was killed by {name} (from outside, or the out-of-memory killer)"
    return f"its worker process (pid {pid}) exited with code {exitcode} (os._exit, or a crash in native code)"


#: what a worker process runs: its socket's fd, the parent's pid, whether the parent's main thread started it
_BOOT = "import sys; from backends.rewards.workers import serve; serve(*map(int, sys.argv[1:]))"


class _Worker:
    def __init__(self, specs: Sequence[str], format_pattern: str) -> None:
        mine, theirs = socket.socketpair()
        main = threading.current_thread() is threading.main_thread()
        # the parent's import path, so that package.module:function references resolve as they did here
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if isinstance(p, str) and p)}
        self.process = subprocess.Popen(
            [sys.executable, "-c", _BOOT, str(theirs.fileno()), str(os.getpid()), str(int(main))],
            pass_fds=(theirs.fileno(),),
            env=env,
        )
        theirs.close()
        self.conn = Connection(mine.detach())
        self.conn.send((list(specs), format_pattern))
        #: readable once the process has ended (Linux); elsewhere its end is polled
        self.sentinel = os.pidfd_open(self.process.pid) if hasattr(os, "pidfd_open") else None
        self.started = time.monotonic()
        self.ready = False
        self.call: tuple[int, float] | None = None  #: (call index, deadline) while it runs one

    @property
    def pid(self) -> int:
        return self.process.pid

    def exitcode(self) -> int | None:
        return self.process.poll()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5.0)
        self.conn.close()
        if self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None


class WorkerPool:
    """``size`` worker processes that resolve ``specs`` once and then serve calls, one at a time each."""

    def __init__(self, size: int, specs: Sequence[str], format_pattern: str) -> None:
        self.size, self.specs, self.format_pattern = size, list(specs), format_pattern
        self._workers: list[_Worker] = []

    def run(
        self, calls: Sequence[tuple[str, tuple]], timeout_s: float, *, max_deaths: int | None = None
    ) -> list[Outcome]:
        """The outcome of each ``(spec, args)`` call, in order. A call's time counts from when a worker takes it.
        After ``max_deaths`` deaths or hangs (default: four per worker) the calls not yet started are skipped:
        a function that kills every worker it runs in would otherwise cost a worker start per call."""
        outcomes: list[Outcome | None] = [None] * len(calls)
        queue = collections.deque(range(len(calls)))
        losses, limit = 0, 4 * self.size if max_deaths is None else max_deaths
        while queue or any(w.call is not None for w in self._workers):
            if losses >= limit and queue:
                why = f"not run: {losses} worker process(es) died or hung in this batch"
                while queue:
                    outcomes[queue.popleft()] = ("skipped", why)
                if not any(w.call is not None for w in self._workers):
                    break
            self._fill()
            for worker in self._workers:
                if worker.ready and worker.call is None and queue and not worker.conn.closed:
                    index = queue.popleft()
                    spec, args = calls[index]
                    try:
                        worker.conn.send((index, spec, args, timeout_s))
                    except OSError:  # it ended while idle: the call goes to another worker
                        queue.appendleft(index)
                        worker.stop()
                        continue
                    worker.call = (index, time.monotonic() + timeout_s + KILL_AFTER_S)
            losses += self._collect(outcomes, timeout_s)
        return [o if o is not None else ("skipped", "not run") for o in outcomes]

    def _fill(self) -> None:
        self._workers = [w for w in self._workers if not w.conn.closed]
        while len(self._workers) < self.size:
            self._workers.append(_Worker(self.specs, self.format_pattern))

    def _collect(self, outcomes: list, timeout_s: float) -> int:
        """Wait for a result, a worker's readiness or death, or a deadline; record what came. The calls lost to a
        death or a hang."""
        now = time.monotonic()
        deadlines = [w.call[1] for w in self._workers if w.call is not None]
        deadlines += [w.started + START_TIMEOUT_S for w in self._workers if not w.ready]
        waiting = {w.conn: w for w in self._workers} | {w.sentinel: w for w in self._workers if w.sentinel is not None}
        polled = any(w.sentinel is None for w in self._workers)
        timeout = max(0.0, min(deadlines, default=now + 1.0) - now)
        ready = wait(list(waiting), timeout=min(timeout, 1.0) if polled else timeout)
        losses = 0
        # each once, in order; where ends are polled, every worker
        for worker in self._workers if polled else dict.fromkeys(waiting[handle] for handle in ready):
            if worker.conn.closed:
                continue
            if self._receive(worker, outcomes):  # what it sent before it died counts; then its end is near
                with contextlib.suppress(subprocess.TimeoutExpired):
                    worker.process.wait(timeout=5.0)
                if worker.exitcode() is None:  # its socket closed, yet it runs: it cannot serve
                    worker.process.kill()
                    worker.process.wait()
            if worker.exitcode() is not None:
                losses += self._lost(worker, outcomes, ("died", how_it_died(worker.exitcode(), worker.pid)))
        now = time.monotonic()
        for worker in self._workers:
            if worker.conn.closed:
                continue
            if worker.call is not None and now > worker.call[1]:
                losses += self._lost(
                    worker,
                    outcomes,
                    ("hung", f"did not return within reward.timeout_s={timeout_s:g} (its worker was stopped)"),
                )
            elif not worker.ready and now > worker.started + START_TIMEOUT_S:
                self.close()
                raise RuntimeError(
                    f"a reward worker process did not start within {START_TIMEOUT_S:g} s (importing the "
                    "reward functions hangs?)"
                )
        return losses

    def _receive(self, worker: _Worker, outcomes: list) -> bool:
        """Everything ``worker`` has sent so far; whether its socket is closed (it ended)."""
        while not worker.conn.closed:
            try:
                if not worker.conn.poll():
                    return False
                message = worker.conn.recv()
            except (EOFError, OSError):  # it died, mid-send or after: its exit code says how
                return True
            if message[0] == "ready":
                worker.ready = True
            elif message[0] == "init-error":
                self.close()
                raise RuntimeError(f"a reward worker process could not resolve the reward functions: {message[1]}")
            else:
                index, status, value = message
                outcomes[index] = (status, value)
                worker.call = None
        return True

    def _lost(self, worker: _Worker, outcomes: list, outcome: Outcome) -> int:
        if not worker.ready:
            code = worker.exitcode()
            self.close()
            raise RuntimeError(
                f"a reward worker process ended while starting (exit code {code}): importing the "
                "reward functions failed or ended the process"
            )
        lost = worker.call is not None
        if lost:
            outcomes[worker.call[0]] = outcome
        worker.call = None
        worker.stop()
        return int(lost)

    def pids(self) -> list[int]:
        return [w.pid for w in self._workers if w.exitcode() is None]

    def close(self) -> None:
        """Stop every worker (a later :meth:`run` starts new ones)."""
        for worker in self._workers:
            with contextlib.suppress(OSError):
                if worker.ready and worker.call is None and not worker.conn.closed:
                    worker.conn.send(None)
        deadline = time.monotonic() + 1.0
        for worker in self._workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            worker.stop()
        self._workers = []


# ------------------------------------------------------------------------------------ in the worker


def _die_with(parent: int, started_by_main_thread: bool) -> None:
    """End this process when ``parent`` does: the kernel's parent-death signal where it exists (it fires when the
    parent's starting thread ends, so only when that was the main thread), and a thread that polls the parent."""
    if started_by_main_thread and sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the request above
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="rlfunc-parent-watch", daemon=True).start()


def serve(fd: int, parent: int, started_by_main_thread: int) -> None:
    """A worker process's life: resolve the functions the parent sends, then run calls until told to stop."""
    _die_with(parent, bool(started_by_main_thread))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the trainer, which then stops its workers
    conn = Connection(fd)
    specs, format_pattern = conn.recv()
    try:
        functions: Mapping[str, Callable[..., Any]] = {s: _resolve(s, format_pattern) for s in specs}
    except Exception as e:  # noqa: BLE001 - reported to the parent
        conn.send(("init-error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        index, spec, (response, ground_truth, columns), timeout_s = message
        status, value = _call(functions[spec], response, ground_truth, columns, timeout_s)
        try:
            conn.send((index, status, value))
        except (pickle.PicklingError, TypeError, AttributeError):  # nothing was written: pickling comes first
            conn.send((index, "not-a-score", (type(value).__name__, f"{value!r:.60}")))


def _resolve(spec: str, format_pattern: str) -> Callable[..., Any]:
    """A reference (``module:function``, ``file.py:function``) without importing the built-ins (and torch with
    them) unless a built-in name is asked for."""
    if ":" in spec:
        from backends.config import resolve_function

        return resolve_function(spec, {}, "reward.fn")
    from backends.rewards.builtins import builtin_reward

    return builtin_reward(spec, format_pattern=format_pattern)


def _call(fn: Callable[..., Any], response: str, ground_truth: Any, columns: dict, timeout_s: float) -> Outcome:
    try:
        with time_limit(timeout_s):
            result = fn(response, ground_truth, **columns)
    except CallTimeout:
        return "error", f"ran longer than reward.timeout_s={timeout_s:g}"
    except SystemExit as e:
        return "error", f"called sys.exit({e.code!r}) (a reward function returns a score; its worker lives on)"
    except Exception as e:  # noqa: BLE001 - exceptions do not cross the process boundary: described instead
        return "error", f"raised {type(e).__name__}: {e}"
    return "ok", dict(result) if isinstance(result, Mapping) else result
