"""Ctrl-C (SIGINT) is a stop request like SIGTERM; a second one stops at once; the wait for the step's end is
bounded by ``deadlines.stop_grace``, after which the rank exits naming the phase it is stuck in.

Each case is a real process that installs the watchdog and gets real signals from this test. The recipes' side
(every rank stops after the same step, checkpoints and says how to continue) is the torchrun job of
``tests/test_faults.py::test_ctrl_c_to_torchrun_checkpoints_and_says_how_to_continue``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from backends.distributed import watchdog
from backends.distributed.watchdog import DEADLINE_EXIT_CODE, DeadlineConfig
from tests.recipes import env

pytestmark = pytest.mark.faults

SCRIPT = """
import sys, time
from backends.distributed import watchdog
from backends.distributed.watchdog import DeadlineConfig

watchdog.start(DeadlineConfig(stop_grace={grace}), role="unit", poll_s=0.1)
print("ready", flush=True)
with watchdog.phase("reward", step=3, op="the reward workers' results"):
    for _ in range(600):  # a step whose end does not come: a wait in C code, a second at a time
        time.sleep(0.1)
print("not reached", flush=True)
"""


def start(grace: float) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT.format(grace=grace)],
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_ctrl_c_sets_the_stop_flag_and_the_grace_ends_a_stuck_step():
    proc = start(grace=1.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    elapsed = time.monotonic() - t0
    assert proc.returncode == DEADLINE_EXIT_CODE and "not reached" not in out, err[-3000:]
    assert (
        "SIGINT received" in err
        and "stopping at the next step boundary (within deadlines.stop_grace=1 s); "
        "Ctrl-C again stops at once, without a checkpoint"
        in err
    )
    line = next(x for x in err.splitlines() if "STOP GRACE PASSED" in x)
    assert "rank 0 of 1 (unit): SIGINT arrived" in line and "deadlines.stop_grace=1 s" in line
    assert "stuck in phase 'reward' of step 3" in line and "waiting on: the reward workers' results" in line
    assert "Current thread 0x" in err or "Thread 0x" in err  # every thread's stack
    assert 1.0 <= elapsed < 20.0


def test_a_second_ctrl_c_stops_at_once():
    proc = start(grace=600.0)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and time.monotonic() - t0 < 5.0
    assert "SIGINT again (pid" in err and "stopping now, without a checkpoint" in err


def test_sigint_is_a_flag_agreed_at_the_step_boundary_and_stop_gives_ctrl_c_back():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        watchdog.start(DeadlineConfig(), role="unit")
        assert not watchdog.stop_agreed(1)
        os.kill(os.getpid(), signal.SIGINT)  # the process lives on: only a flag
        assert watchdog.stop_requested() and watchdog.stop_agreed(2)
        note = watchdog.preemption_note(2, "ckpt", resume_args="run_dir=runs/x")
        assert note == (
            "SIGINT: stopped after step 2; its checkpoint is ckpt/step_2; exit code 0. Continue with "
            "resume=auto (run_dir=runs/x)"
        )
        assert watchdog.current().stop_overdue(time.monotonic() + 3600) is None  # the boundary was reached
        watchdog.stop()
        assert signal.getsignal(signal.SIGINT) is before[0]
    finally:
        watchdog.stop()
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])
