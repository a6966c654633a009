"""Reward worker processes that die are named at once, and workers die with their trainer.

A user function that calls ``sys.exit``, ends its process with ``os._exit`` or is killed from outside is an error
naming the function, the row and how the worker ended, within seconds (not a timeout after ``reward.timeout_s``
times the calls queued behind it); with ``reward.on_error=zero`` the batch goes on, the console says so, and a
function that kills every worker it runs in costs at most four worker starts per worker. A trainer killed with
SIGKILL leaves no process behind. Every worker here is a real process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from backends.data import Example
from backends.rewards import RewardConfig, RewardError, RewardScorer

pytestmark = pytest.mark.faults

ROOT = Path(__file__).resolve().parents[1]

USER_FILE = """
import os
import signal
import sys
import time


def exits(response, ground_truth):
    if response == "exit":
        sys.exit(3)
    return 1.0


def hard_exit(response, ground_truth):
    if response == "die":
        os._exit(7)
    return 1.0


def waits_to_be_killed(response, ground_truth, pid_file=""):
    if response == "kill me":
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)
    return 1.0


def always_dies(response, ground_truth):
    os._exit(1)
"""


@pytest.fixture(scope="module")
def user_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("rewards") / "my_reward.py"
    path.write_text(USER_FILE)
    return str(path)


def example(row: int = 1, **columns) -> Example:
    return Example(prompt_ids=(1,), ground_truth="x", source="s", columns=columns, where=f"train.jsonl:line {row}")


def kill_when_written(pid_file: Path) -> threading.Thread:
    """Kill (SIGKILL) the process whose pid appears in ``pid_file``, from this process: a kill from outside."""

    def run() -> None:
        for _ in range(600):
            if pid_file.exists() and pid_file.read_text():
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(
    ("fn", "response", "message"),
    [
        ("exits", "exit", r"called sys\.exit\(3\)"),
        (
            "hard_exit",
            "die",
            r"ended its worker process: its worker process \(pid \d+\) exited with code 7 \(os\._exit",
        ),
        (
            "waits_to_be_killed",
            "kill me",
            r"ended its worker process: its worker process \(pid \d+\) was killed by SIGKILL",
        ),
    ],
)
def test_a_dead_worker_is_named_at_once(user_file, tmp_path, fn, response, message):
    pid_file = tmp_path / "pid"
    scorer = RewardScorer(RewardConfig(fn=(f"{user_file}:{fn}",), workers=2))  # reward.timeout_s: 60 s
    try:
        scorer.score(["ok"], [example(pid_file=str(pid_file))])  # the workers are up
        if fn == "waits_to_be_killed":
            kill_when_written(pid_file)
        rows = [example(row=r, pid_file=str(pid_file)) for r in range(1, 9)]
        t0 = time.monotonic()
        with pytest.raises(
            RewardError, match=rf"reward function '.*my_reward\.py:{fn}' {message}.* on train\.jsonl:line 3"
        ):
            scorer.score(["ok", "ok", response, "ok", "ok", "ok", "ok", "ok"], rows)
        assert time.monotonic() - t0 < 10.0
        assert scorer.score(["ok", "ok"], rows[:2]).scores.tolist() == [1.0, 1.0]  # a new worker took its place
    finally:
        scorer.close()


def test_on_error_zero_goes_on_says_so_and_stays_bounded(user_file, capfd):
    scorer = RewardScorer(RewardConfig(fn=(f"{user_file}:hard_exit",), workers=2, on_error="zero"))
    try:
        scorer.score(["ok"], [example()])
        t0 = time.monotonic()
        result = scorer.score(["ok", "die", "ok", "ok", "die", "ok"], [example(row=r) for r in range(1, 7)])
        elapsed = time.monotonic() - t0
        assert result.scores.tolist() == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0] and result.errors == 2
        assert elapsed < 15.0
        err = capfd.readouterr().err
        assert (
            "WARNING reward.on_error=zero: 2 call(s) scored 0 because their worker process died or hung; first" in err
        )
        assert "my_reward.py:hard_exit' ended its worker process" in err and "on train.jsonl:line 2" in err
    finally:
        scorer.close()
    killer = RewardScorer(RewardConfig(fn=(f"{user_file}:always_dies",), workers=2, on_error="zero"))
    try:
        t0 = time.monotonic()
        result = killer.score(["a"] * 64, [example(row=r) for r in range(64)])
        assert result.errors == 64 and result.scores.abs().sum() == 0
        assert time.monotonic() - t0 < 30.0  # eight worker starts (four per worker), not 64
        assert (
            "8 call(s) scored 0 because their worker process died or hung, and 56 more were not run: 8 worker "
            "process(es) died or hung in this batch"
        ) in capfd.readouterr().err
    finally:
        killer.close()


CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from backends.data import Example
    from backends.rewards import RewardConfig, RewardScorer

    scorer = RewardScorer(RewardConfig(fn=({fn!r},), workers=2))
    rows = [Example(prompt_ids=(1,), ground_truth="x", source="s", columns={{}}, where="t:1")] * 4
    scorer.score(["ok"] * 4, rows)
    print("scored", flush=True)
    time.sleep(600)
""")


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_and_the_resource_tracker_die_with_a_killed_trainer(user_file):
    script = CHILD.format(root=str(ROOT), fn=f"{user_file}:exits")
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    try:
        assert child.stdout.readline().strip() == "scored"
        below = descendants(child.pid)
        assert len(below) >= 2  # two workers
        child.kill()
        child.wait()
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and any(alive(p) for p in below):
            time.sleep(0.1)
        assert not [p for p in below if alive(p)], "processes outlived the trainer"
    finally:
        if child.poll() is None:
            child.kill()
