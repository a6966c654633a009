"""Fault injection for the fault tests: ``RLFUNC_FAULT=<action>:rank=<r>:step=<s>:phase=<kind>`` makes rank
``r`` (``rank=all``: every rank) act when it enters phase ``kind`` of step ``s``
(:func:`backends.distributed.watchdog.phase` calls :func:`inject`). Actions:

- ``kill``: SIGKILL itself (a machine failure: nothing gets to clean up);
- ``stop``: SIGSTOP itself (a frozen rank: its peers wait on it);
- ``term``: SIGTERM itself (a preemption notice);
- ``crash``: raise :class:`InjectedFault` (an ordinary error).

A fault fires on the first attempt only (``TORCHELASTIC_RESTART_COUNT`` unset or 0), so a job restarted
by ``torchrun --max-restarts N`` runs clean. With ``RLFUNC_FAULT`` unset nothing happens.
"""

from __future__ import annotations

import functools
import os
import signal
import sys

import attrs

__all__ = ["Fault", "InjectedFault", "parse", "planned", "inject"]

ENV = "RLFUNC_FAULT"
ACTIONS = ("kill", "stop", "term", "crash")


class InjectedFault(RuntimeError):
    """The error a ``crash`` fault raises."""


@attrs.frozen
class Fault:
    action: str
    rank: int | None  #: None: every rank
    step: int | None  #: None: the first phase of the kind, whatever the step
    phase: str


def parse(spec: str) -> Fault:
    """``kill:rank=1:step=3:phase=update`` as a :class:`Fault`; a malformed spec is an error naming it."""
    action, *fields = spec.split(":")
    if action not in ACTIONS:
        raise ValueError(f"{ENV}={spec!r}: the action must be one of {', '.join(ACTIONS)}")
    values = dict(f.split("=", 1) for f in fields if "=" in f)
    unknown = set(values) - {"rank", "step", "phase"}
    if unknown or len(values) != len(fields) or "phase" not in values:
        raise ValueError(f"{ENV}={spec!r}: expected <action>:rank=<r|all>:step=<s>:phase=<kind>")
    rank = None if values.get("rank", "all") == "all" else int(values["rank"])
    step = int(values["step"]) if "step" in values else None
    return Fault(action=action, rank=rank, step=step, phase=values["phase"])


@functools.lru_cache(maxsize=None)
def _planned(spec: str, restart: str, rank: str) -> Fault | None:
    if not spec or restart not in ("", "0"):
        return None
    fault = parse(spec)
    return fault if fault.rank is None or fault.rank == int(rank or 0) else None


def planned() -> Fault | None:
    """This process's fault, or None (none set, another rank's, or a restarted attempt)."""
    return _planned(
        os.environ.get(ENV, ""), os.environ.get("TORCHELASTIC_RESTART_COUNT", ""), os.environ.get("RANK", "")
    )


_fired: set[Fault] = set()


def inject(phase: str, step: int | None) -> None:
    """Act out this process's fault if it is due at ``phase`` of ``step`` (once per process)."""
    fault = planned()
    if fault is None or fault.phase != phase or (fault.step is not None and fault.step != step) or fault in _fired:
        return
    _fired.add(fault)
    sys.stderr.write(
        f"[rlfunc] injecting fault {fault.action!r} at phase {phase!r} of step {step} (pid {os.getpid()})\n"
    )
    sys.stderr.flush()
    if fault.action == "crash":
        raise InjectedFault(f"injected crash at phase {phase!r} of step {step}")
    sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}[fault.action]
    os.kill(os.getpid(), sig)
