"""Deadlines, a per-rank watchdog thread and preemption (SIGTERM) for the recipes' loops.

A recipe declares what it is doing::

    watchdog.start(cfg.deadlines, env, role="grpo")          # once, after init_distributed
    with watchdog.phase("rollout", step=step):                # each kind has its deadline (deadlines.rollout)
        ...
    if watchdog.stop_agreed(): ...                            # at a step boundary: SIGTERM seen on any rank?

**Deadlines.** Each phase kind has a deadline in seconds (:class:`DeadlineConfig`, 0: none). A daemon thread
checks the open phases once a second; when one has run past its deadline it writes one line naming the
rank, world size, recipe role, step, phase and the operation it waits on, dumps every thread's stack
(``faulthandler``) to stderr, and ends the process with ``os._exit(DEADLINE_EXIT_CODE)``, so torchrun tears
the job down. It is a thread because the main thread may be stuck in a C call (a collective whose peer
is gone or frozen, a kernel); such calls release the GIL. As a backstop for a C call that holds the GIL,
``faulthandler.dump_traceback_later`` (a C-level timer) is armed ``BACKSTOP_S`` after the first deadline.
The process-group timeout (``deadlines.process_group``) bounds every collective as well.

**Preemption and Ctrl-C.** :func:`start` installs a handler for SIGTERM and SIGINT (Ctrl-C; torchrun forwards
it to the ranks) that only sets a flag. At each step boundary the recipe calls :func:`stop_agreed`: a
one-element max all-reduce of the flag, so every rank stops after the same step (then the recipe checkpoints,
prints one line saying how to continue and returns, exit code 0; ``resume=auto`` continues). A second SIGINT
ends the process at once (exit code 130, no checkpoint). The wait for the boundary is bounded:
``deadlines.stop_grace`` seconds after the first signal the watchdog ends a rank that has not reached it,
naming the phase it is in, like a deadline.

Fault injection for tests (``RLFUNC_FAULT``) is in :mod:`backends.distributed.faults`; phases call it on
entry, and it does nothing when the variable is unset.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from typing import Any, Iterator

import attrs
import torch

from backends.distributed import faults
from backends.distributed.collectives import all_reduce_max

__all__ = [
    "DeadlineConfig",
    "Watchdog",
    "DEADLINE_EXIT_CODE",
    "start",
    "stop",
    "phase",
    "waiting_on",
    "stop_requested",
    "stop_agreed",
    "preemption_note",
    "current",
]

#: the exit code of a process whose deadline passed (like timeout(1))
DEADLINE_EXIT_CODE = 124
#: seconds after a deadline at which the C-level faulthandler timer ends a process whose watchdog thread
#: could not run (a C call holding the GIL)
BACKSTOP_S = 60.0


def _non_negative(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if value < 0:
        raise ValueError(f"deadlines.{attribute.name} must be >= 0 (0: no deadline), got {value}")


def _seconds(default: float) -> Any:
    return attrs.field(default=default, validator=_non_negative)


@attrs.frozen
class DeadlineConfig:
    """The longest each phase of a step may take, in seconds (0: no deadline); past it the rank's watchdog
    dumps every thread's stack and ends the process (exit code 124), and torchrun ends the job."""

    rollout: float = _seconds(3600.0)  #: sampling a step's responses (dynamic sampling's rounds included)
    reward: float = _seconds(1800.0)  #: scoring them (reward functions, a reward model)
    update: float = _seconds(3600.0)  #: log-probs, values, advantages and the optimizer steps of one RL step
    weight_sync: float = _seconds(1800.0)  #: the trained weights into the rollout engine
    checkpoint: float = _seconds(3600.0)  #: saving or loading a checkpoint
    eval: float = _seconds(3600.0)  #: one held-out evaluation
    collective: float = _seconds(1800.0)  #: a step-boundary collective (the preemption flag's all-reduce)
    #: after SIGTERM or Ctrl-C, the longest a rank may take to reach the end of its step (then it stops, with a
    #: checkpoint); past it the rank exits naming the phase it is in. Under torchrun, keep
    #: TORCH_ELASTIC_SHUTDOWN_TIMEOUT (torchrun's wait before its SIGKILL, 30 s by default) above it
    stop_grace: float = _seconds(60.0)
    #: the process-group timeout: no single collective waits longer (0: torch's default, 30 min)
    process_group: float = _seconds(1800.0)


@attrs.define(eq=False)
class _Phase:
    kind: str
    step: int | None
    op: str
    deadline_s: float
    started: float
    thread: str


class Watchdog:
    """One rank's deadlines: :meth:`phase` opens a phase, a daemon thread checks them (see the module doc)."""

    def __init__(
        self,
        deadlines: DeadlineConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        role: str = "",
        poll_s: float = 1.0,
        stream: Any = None,
    ) -> None:
        self.deadlines, self.rank, self.world_size, self.role = deadlines, rank, world_size, role
        self.poll_s, self.stream = poll_s, stream
        self._open: list[_Phase] = []
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"rlfunc-watchdog-rank{rank}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stopped.set()
        with self._lock:
            self._open.clear()
        self._rearm_backstop()

    @contextlib.contextmanager
    def phase(self, kind: str, *, step: int | None = None, op: str = "") -> Iterator[None]:
        if not hasattr(self.deadlines, kind):
            raise ValueError(f"unknown phase kind {kind!r}: one of {', '.join(attrs.fields_dict(DeadlineConfig))}")
        with self._lock:
            if step is None and self._open:
                step = self._open[-1].step  # a nested phase belongs to its parent's step
            entry = _Phase(
                kind,
                step,
                op or kind,
                float(getattr(self.deadlines, kind)),
                time.monotonic(),
                threading.current_thread().name,
            )
            self._open.append(entry)
        self._rearm_backstop()
        try:
            faults.inject(kind, step)
            yield
        finally:
            with self._lock:
                if entry in self._open:
                    self._open.remove(entry)
            self._rearm_backstop()

    def waiting_on(self, op: str) -> None:
        """Name the operation the innermost open phase now waits on (it appears in a deadline's report)."""
        with self._lock:
            if self._open:
                self._open[-1].op = op

    def overdue(self, now: float | None = None) -> _Phase | None:
        """The innermost open phase past its deadline, if any."""
        now = time.monotonic() if now is None else now
        with self._lock:
            late = [p for p in self._open if p.deadline_s > 0 and now - p.started > p.deadline_s]
        return late[-1] if late else None

    def report(self, late: _Phase) -> str:
        waited = time.monotonic() - late.started
        where = f"rank {self.rank} of {self.world_size}" + (f" ({self.role})" if self.role else "")
        step = f"step {late.step}" if late.step is not None else "no step"
        return (
            f"DEADLINE PASSED on {where}, {step}: phase {late.kind!r} has run {waited:.1f} s, past "
            f"deadlines.{late.kind}={late.deadline_s:g} s; waiting on: {late.op} (thread {late.thread}). "
            f"Every thread's stack follows; the process exits with code {DEADLINE_EXIT_CODE}."
        )

    def stop_overdue(self, now: float | None = None) -> str | None:
        """The report of a rank that got a stop signal ``deadlines.stop_grace`` seconds ago and has not reached
        the step boundary; None otherwise."""
        grace, since = self.deadlines.stop_grace, _stop_signal["at"]
        now = time.monotonic() if now is None else now
        if not grace or since is None or _boundary_reached.is_set() or now - since <= grace:
            return None
        with self._lock:
            inner = self._open[-1] if self._open else None
        where = f"rank {self.rank} of {self.world_size}" + (f" ({self.role})" if self.role else "")
        stuck = (
            "between phases"
            if inner is None
            else f"in phase {inner.kind!r} of {f'step {inner.step}' if inner.step is not None else 'no step'} for "
            f"{now - inner.started:.1f} s, waiting on: {inner.op} (thread {inner.thread})"
        )
        return (
            f"STOP GRACE PASSED on {where}: {_stop_signal['name']} arrived {now - since:.1f} s ago and the step did "
            f"not reach its end within deadlines.stop_grace={grace:g} s; stuck {stuck}. Every thread's stack "
            f"follows; the process exits with code {DEADLINE_EXIT_CODE}, without a checkpoint."
        )

    def _watch(self) -> None:
        while not self._stopped.wait(self.poll_s):
            late = self.overdue()
            if late is not None:
                self._fire(self.report(late))
            stuck = self.stop_overdue()
            if stuck is not None:
                self._fire(stuck)

    def _fire(self, report: str) -> None:
        stream = self.stream or sys.stderr
        try:
            stream.write(f"\n[rank {self.rank}] {report}\n")
            stream.flush()
            faulthandler.dump_traceback(file=stream, all_threads=True)
            stream.flush()
        finally:
            os._exit(DEADLINE_EXIT_CODE)

    def _rearm_backstop(self) -> None:
        """Arm the C-level timer for the soonest deadline of the open phases plus BACKSTOP_S (or cancel it)."""
        if threading.current_thread() is not threading.main_thread():
            return
        with self._lock:
            left = [p.started + p.deadline_s - time.monotonic() for p in self._open if p.deadline_s > 0]
        if left and not self._stopped.is_set():
            faulthandler.dump_traceback_later(max(min(left), 0.0) + BACKSTOP_S, exit=True)
        else:
            faulthandler.cancel_dump_traceback_later()


_current: Watchdog | None = None
_sigterm = threading.Event()  #: a stop signal (SIGTERM or SIGINT) arrived since start()
_stop_signal: dict[str, Any] = {"name": None, "at": None}  #: the first one: its name and monotonic time
_boundary_reached = threading.Event()  #: every rank agreed to stop: the grace no longer applies
_replaced_sigint: list[Any] = []  #: the SIGINT handler start() replaced, put back by stop()


def start(deadlines: DeadlineConfig, env: Any = None, *, role: str = "", poll_s: float = 1.0) -> Watchdog:
    """This process's watchdog (replacing an earlier one) and the SIGTERM handler; ``env``: a ``DistEnv``."""
    global _current
    stop()
    rank, world = (env.rank, env.world_size) if env is not None else (0, 1)
    _sigterm.clear()
    _boundary_reached.clear()
    _stop_signal.update(name=None, at=None)
    _current = Watchdog(deadlines, rank=rank, world_size=world, role=role, poll_s=poll_s)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_stop_signal)
        _replaced_sigint[:] = [signal.signal(signal.SIGINT, _on_stop_signal)]
    return _current


def stop() -> None:
    """Close this process's watchdog, if one runs. The SIGTERM handler stays (a late signal is just a flag);
    Ctrl-C gets its earlier handler back."""
    global _current
    if _current is not None:
        _current.close()
        _current = None
    if _replaced_sigint and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _replaced_sigint.pop())


def current() -> Watchdog | None:
    return _current


def phase(kind: str, *, step: int | None = None, op: str = "") -> contextlib.AbstractContextManager:
    """A phase of this process's watchdog (only fault injection, and no deadline, before :func:`start`)."""
    if _current is None:
        return _unwatched(kind, step)
    return _current.phase(kind, step=step, op=op)


@contextlib.contextmanager
def _unwatched(kind: str, step: int | None) -> Iterator[None]:
    faults.inject(kind, step)
    yield


def waiting_on(op: str) -> None:
    if _current is not None:
        _current.waiting_on(op)


def _on_stop_signal(signum: int, frame: Any) -> None:
    name = signal.Signals(signum).name
    if _sigterm.is_set():
        if signum == signal.SIGINT:  # a second Ctrl-C: the user does not want to wait for the step's end
            sys.stderr.write(f"[rlfunc] {name} again (pid {os.getpid()}): stopping now, without a checkpoint\n")
            sys.stderr.flush()
            os._exit(128 + signal.SIGINT)
        return
    _stop_signal.update(name=name, at=time.monotonic())
    _sigterm.set()
    grace = _current.deadlines.stop_grace if _current is not None else 0
    within = f" (within deadlines.stop_grace={grace:g} s)" if grace else ""
    again = "; Ctrl-C again stops at once, without a checkpoint" if signum == signal.SIGINT else ""
    sys.stderr.write(
        f"[rlfunc] {name} received (pid {os.getpid()}): stopping at the next step boundary{within}{again}\n"
    )


def stop_requested() -> bool:
    """Whether this process got SIGTERM or SIGINT since :func:`start`."""
    return _sigterm.is_set()


def stop_agreed(step: int | None = None) -> bool:
    """Whether any rank got SIGTERM or SIGINT: a max all-reduce of the flag (every rank must call it at the same
    step boundary, so all of them stop after the same step)."""
    with phase("collective", step=step, op="all_reduce(max) of the preemption flag at the step boundary"):
        flag = torch.tensor([1.0 if _sigterm.is_set() else 0.0])
        agreed = bool(all_reduce_max(flag).item() > 0)
    if agreed:
        _boundary_reached.set()
    return agreed


def preemption_note(step: int, ckpt_dir: Any = None, resume_args: str = "the same checkpoint.dir / run_dir") -> str:
    """The line of a run that stops after ``step`` on SIGTERM or Ctrl-C (``ckpt_dir``: where its checkpoint went;
    ``resume_args``: the keys that find it again)."""
    what = _stop_signal["name"] or "SIGTERM"
    if ckpt_dir is None:
        return (
            f"{what}: stopped after step {step} WITHOUT a checkpoint (checkpoint.every=0): a restart begins "
            f"again from step 1; set checkpoint.every=N to keep the progress of an interrupted run"
        )
    return (
        f"{what}: stopped after step {step}; its checkpoint is {ckpt_dir}/step_{step}; exit code 0. "
        f"Continue with resume=auto ({resume_args})"
    )
