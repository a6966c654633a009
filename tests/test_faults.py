"""Nothing hangs, nothing is lost: the watchdog's deadlines, SIGTERM (preemption) and restarts.

Unit checks (one process): the watchdog ends a process whose main thread is stuck in a C call, naming the
phase; the fault spec (``RLFUNC_FAULT``) and the SIGTERM flag. Then jobs of 2 gloo ranks (the GRPO recipe on a
tiny model, a few steps; under the real torchrun where its agent's part is checked: (a), (b), (d)), each with one
injected fault, timed from the fault to the exit:

(a) SIGKILL of one rank mid-update: the job fails fast; ``resume=auto`` ends with the uninterrupted metrics;
(b) SIGSTOP of one rank: the other rank's watchdog fires within its deadline, naming phase and operation;
(c) SIGTERM to the job's ranks: a checkpoint, exit code 0; ``resume=auto`` ends with the same metrics;
(d) ``torchrun --max-restarts 1 ... resume=auto`` with a crash on the first attempt: the restart continues
    from the last checkpoint and ends with the same metrics;
(e) Ctrl-C to torchrun (SIGINT, which it forwards): both ranks stop after the same step with a checkpoint and
    one line each saying how to continue.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import attrs
import pytest

from backends.distributed import faults, watchdog
from backends.distributed.watchdog import DEADLINE_EXIT_CODE, DeadlineConfig
from tests.recipes import GRPO, TINY_MODEL, TORCHRUN, arithmetic_data, data_args, env, start

STEPS, EVERY = 5, 2
#: metrics that depend on the clock, not on the computation
TIMING = ("tokens_per_s", "step_time_s", "rollout_time_s", "update_time_s", "sync_time_s")


# ------------------------------------------------------------------------------------------ one process

WATCHED_SCRIPT = """
import time
from backends.distributed import watchdog
from backends.distributed.watchdog import DeadlineConfig

watchdog.start(DeadlineConfig(update=1.0), role="unit", poll_s=0.2)
with watchdog.phase("update", step=3, op="a blocked C call"):
    time.sleep(60)  # C code (the GIL released), like a collective waiting on a frozen peer
print("not reached")
"""


@pytest.mark.faults
def test_watchdog_ends_a_process_stuck_in_a_c_call(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(WATCHED_SCRIPT)
    t0 = time.time()
    out = subprocess.run([sys.executable, str(script)], env=env(), capture_output=True, text=True, timeout=60)
    elapsed = time.time() - t0
    print(f"\nwatchdog: deadline 1 s, process gone after {elapsed:.1f} s (interpreter start included)")
    assert out.returncode == DEADLINE_EXIT_CODE, out.stderr[-3000:]
    assert "not reached" not in out.stdout and elapsed < 30
    assert "DEADLINE PASSED on rank 0 of 1 (unit), step 3: phase 'update'" in out.stderr
    assert "deadlines.update=1 s; waiting on: a blocked C call" in out.stderr
    assert f'File "{script}", line 8' in out.stderr  # every thread's stack: the main thread's sleeping line


@pytest.mark.faults
def test_phases_deadlines_and_nesting():
    dog = watchdog.Watchdog(DeadlineConfig(update=5.0, reward=0.0), rank=1, world_size=2, role="grpo", poll_s=3600)
    try:
        with dog.phase("update", step=7, op="engine.update"):
            assert dog.overdue() is None
            late = dog.overdue(now=time.monotonic() + 10)
            assert late is not None and late.kind == "update" and late.step == 7
            with dog.phase("reward"):  # nested: the parent's step; deadline 0: never overdue itself
                dog.waiting_on("scorer.score")
                assert dog.overdue(now=time.monotonic() + 10).kind == "update"
                assert [p.op for p in dog._open] == ["engine.update", "scorer.score"] and dog._open[-1].step == 7
            assert "rank 1 of 2 (grpo), step 7: phase 'update'" in dog.report(late)
        assert dog.overdue(now=time.monotonic() + 1e6) is None
        with pytest.raises(ValueError, match="unknown phase kind 'rolout'"):
            with dog.phase("rolout"):
                pass
    finally:
        dog.close()
    with pytest.raises(ValueError, match="deadlines.update must be >= 0"):
        DeadlineConfig(update=-1)


@pytest.mark.faults
def test_fault_spec_fires_on_the_first_attempt_only(monkeypatch):
    assert faults.parse("kill:rank=1:step=3:phase=update") == faults.Fault("kill", 1, 3, "update")
    assert faults.parse("term:rank=all:phase=rollout") == faults.Fault("term", None, None, "rollout")
    for bad in ("explode:rank=1:phase=update", "kill:rank=1:step=3", "kill:rank=1:when=3:phase=update"):
        with pytest.raises(ValueError, match="RLFUNC_FAULT"):
            faults.parse(bad)
    monkeypatch.setenv("RLFUNC_FAULT", "crash:rank=0:step=2:phase=update")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert faults.planned() == faults.Fault("crash", 0, 2, "update")
    faults.inject("update", 1)  # not due: another step
    faults.inject("rollout", 2)  # not due: another phase
    with pytest.raises(faults.InjectedFault, match="phase 'update' of step 2"):
        faults.inject("update", 2)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted attempt runs clean
    assert faults.planned() is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("RANK", "1")  # another rank's fault
    assert faults.planned() is None
    monkeypatch.delenv("RLFUNC_FAULT")
    assert faults.planned() is None


@pytest.mark.faults
def test_sigterm_sets_a_flag_that_stops_at_the_step_boundary():
    previous = signal.getsignal(signal.SIGTERM)
    try:
        watchdog.start(DeadlineConfig(), poll_s=3600)
        assert not watchdog.stop_requested() and not watchdog.stop_agreed(1)
        os.kill(os.getpid(), signal.SIGTERM)  # the process lives on: only a flag
        time.sleep(0.05)
        assert watchdog.stop_requested() and watchdog.stop_agreed(1)
        assert "step_4" in watchdog.preemption_note(4, "ckpt") and "WITHOUT a checkpoint" in watchdog.preemption_note(4)
    finally:
        watchdog.stop()
        signal.signal(signal.SIGTERM, previous)


# --------------------------------------------------------------------------------- torchrun, 2 ranks


@attrs.frozen
class Job:
    returncode: int
    stderr: str
    seconds: float  #: from the launch to the exit
    after_fault: float | None  #: from the fault (its injection, or the signal the test sent) to the exit


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if _parent(int(stat.parent.name)) == pid:
                out.append(int(stat.parent.name))
        except OSError:  # the process ended meanwhile
            continue
    return out


def _kill_tree(pid: int) -> None:
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += _children(p)
    for p in seen:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _launch(args: list[str], *, fault: str = "", restarts: int = 0, when=None, timeout: float = 300) -> Job:
    """torchrun (2 ranks) on GRPO with ``args``; ``fault``: RLFUNC_FAULT; ``when(pids)`` polled with the ranks'
    pids while it runs: a true return marks the moment of an outside fault (a signal the test sent)."""
    launcher = [str(TORCHRUN), "--standalone", "--nproc_per_node", "2", "--max-restarts", str(restarts)]
    environ = {**env(), "RLFUNC_FAULT": fault} if fault else env()
    lines: list[tuple[float, str]] = []
    t0 = time.time()
    proc = subprocess.Popen(
        [*launcher, str(GRPO), *args],
        env=environ,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    reader = threading.Thread(target=lambda: lines.extend((time.time(), line) for line in proc.stderr), daemon=True)
    reader.start()
    t_fault = None
    try:
        while proc.poll() is None:
            assert time.time() - t0 < timeout, "the job did not end in time:\n" + "".join(x for _, x in lines)[-4000:]
            if when is not None and t_fault is None and when(_children(proc.pid)):
                t_fault = time.time()
            time.sleep(0.05)
    finally:
        _kill_tree(proc.pid)  # nothing stays behind (a stopped rank included)
        proc.wait()
        reader.join(timeout=10)
    t_end = time.time()
    injected = [t for t, line in lines if "injecting fault" in line]
    t_fault = t_fault or (injected[0] if injected else None)
    return Job(proc.returncode, "".join(x for _, x in lines), t_end - t0, None if t_fault is None else t_end - t_fault)


def _launch_forked(args: list[str], *, fault: str = "", when=None, timeout: float = 300) -> Job:
    """As :func:`_launch`, on the suite's forked ranks (``tests.recipes.start``), for the faults whose checks are
    about the ranks, not about torchrun's agent: no interpreter start-up per rank, and a rank that fails stops
    the others at once (torchrun's agent waits 30 s for a frozen one)."""
    t0 = time.time()
    job = start(GRPO, *args, nproc=2, environ={"RLFUNC_FAULT": fault} if fault else None)
    t_fault = None
    try:
        while job.poll() is None:
            assert time.time() - t0 < timeout, "the job did not end in time:\n" + job.output("err")[-4000:]
            if t_fault is None and (when(job.pids) if when is not None else "injecting fault" in job.output("err")):
                t_fault = time.time()
            time.sleep(0.05)
    finally:
        job.kill()
    out = job.wait(timeout=30)
    t_end = time.time()
    return Job(out.returncode, out.stderr, t_end - t0, None if t_fault is None else t_end - t_fault)


@pytest.fixture(scope="module")
def grpo_args(tmp_path_factory):
    data = arithmetic_data(tmp_path_factory.mktemp("arithmetic"), max_operand=9, max_second_operand=9, num_heldout=4)
    # an entropy bonus and a KL term: the weights, log-probs and KL move every step even where all rewards are equal
    return [
        *data_args(data, sft_steps=0),
        *TINY_MODEL,
        f"steps={STEPS}",
        "prompts_per_step=4",
        "rollout.n=2",
        "algo.kl_loss_coef=0.01",
        "algo.entropy_coef=0.01",
        "eval.before_training=false",
        "eval.max_prompts=2",
        "export.hf=false",
        "logger=[jsonl]",
        f"checkpoint.every={EVERY}",
        "checkpoint.keep_last=10",
    ]


def _where(root: Path) -> list[str]:
    return [f"run_dir={root / 'run'}", f"checkpoint.dir={root / 'ckpt'}"]


def _rows(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] > 0 and "step_time_s" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # no step missing, none logged twice
    return {r["step"]: {k: v for k, v in r.items() if k not in TIMING and not k.startswith("time/")} for r in rows}


def _complete(ckpt_dir: Path) -> list[int]:
    return sorted(int(p.parent.name[len("step_") :]) for p in ckpt_dir.glob("step_*/COMPLETE"))


@pytest.fixture(scope="module")
def uninterrupted(grpo_args, tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    job = _launch_forked([*grpo_args, *_where(root)])
    assert job.returncode == 0, job.stderr[-4000:]
    print(f"\nuninterrupted: {job.seconds:.1f} s")
    return _rows(root / "run")


def _same_metrics(expected: dict, got: dict, after: int) -> int:
    """Every metric of every step equal (|diff| <= 1e-6); returns the number compared after step ``after``."""
    compared = 0
    for step in expected:
        assert sorted(expected[step]) == sorted(got[step]), step
        for k, v in expected[step].items():
            assert abs(v - got[step][k]) <= 1e-6, f"step {step} {k}: uninterrupted {v}, resumed {got[step][k]}"
            compared += step > after
    assert compared > 0
    return compared


def _resume(grpo_args, root: Path, uninterrupted: dict, after: int) -> int:
    job = _launch_forked([*grpo_args, *_where(root), "resume=auto"])
    assert job.returncode == 0, job.stderr[-4000:]
    assert json.loads((root / "run" / "summary.json").read_text())["resumed_from"].endswith(f"step_{after}")
    return _same_metrics(uninterrupted, _rows(root / "run"), after)


@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.distributed
def test_sigkill_of_one_rank_fails_fast_and_resume_is_exact(grpo_args, uninterrupted, tmp_path):
    job = _launch([*grpo_args, *_where(tmp_path)], fault="kill:rank=1:step=3:phase=update")
    print(
        f"\n(a) SIGKILL rank 1 in step 3's update: exit code {job.returncode}, {job.after_fault:.1f} s after the kill"
    )
    assert job.returncode != 0 and job.after_fault < 60
    assert "Signal 9 (SIGKILL) received by PID" in job.stderr  # torchrun names the killed rank
    assert _complete(tmp_path / "ckpt") == [2] and not (tmp_path / "run" / "summary.json").exists()
    compared = _resume(grpo_args, tmp_path, uninterrupted, after=2)
    print(f"(a) resumed from step 2: {compared} metric values after it equal the uninterrupted run's")


@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.distributed
def test_sigstop_of_one_rank_fires_the_other_ranks_watchdog(grpo_args, tmp_path):
    args = [*grpo_args, *_where(tmp_path), "deadlines.update=5", "deadlines.process_group=120"]
    job = _launch(args, fault="stop:rank=1:step=2:phase=update")
    print(
        f"\n(b) SIGSTOP rank 1 in step 2's update: exit code {job.returncode}, {job.after_fault:.1f} s after the stop "
        f"(torchrun waits 30 s for the frozen rank before its SIGKILL)"
    )
    assert job.returncode != 0 and job.after_fault < 60
    assert "DEADLINE PASSED on rank 0 of 2 (grpo), step 2: phase 'update'" in job.stderr, job.stderr[-4000:]
    line = next(x for x in job.stderr.splitlines() if "DEADLINE PASSED" in x)
    print(f"(b) {line.strip()}")
    assert "deadlines.update=5 s; waiting on: " in line  # the operation: log-probs forwards or the update
    assert "Thread 0x" in job.stderr or "Current thread 0x" in job.stderr  # every thread's stack
    assert f"exitcode  : {DEADLINE_EXIT_CODE}" in job.stderr  # torchrun's report names the watchdog's exit


@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.distributed
def test_a_frozen_rank_in_the_sft_stage_fires_the_watchdog(grpo_args, tmp_path):
    """The SFT stage before RL runs under the same "update" deadline: a rank frozen in SFT step -3 (counted up to
    -1, as in the metrics log) is named by the other rank's watchdog."""
    data = Path(next(a for a in grpo_args if a.startswith("data.train_files=")).split("=", 1)[1]).parent
    args = [
        *grpo_args,
        *_where(tmp_path),
        f"sft.files={data / 'sft.jsonl'}",
        "sft.steps=6",
        "sft.batch_size=8",
        "deadlines.update=5",
        "deadlines.process_group=120",
    ]
    job = _launch_forked(args, fault="stop:rank=1:step=-3:phase=update")
    assert job.returncode != 0 and job.after_fault < 60, job.stderr[-4000:]
    line = next((x for x in job.stderr.splitlines() if "DEADLINE PASSED" in x), "")
    assert "DEADLINE PASSED on rank 0 of 2 (grpo), step -3: phase 'update'" in line, job.stderr[-4000:]
    assert "SFT update 4 of 6" in line


def _send_sigterm_after_first_checkpoint(ckpt_dir: Path):
    def when(ranks: list[int]) -> bool:
        if not _complete(ckpt_dir):
            return False
        for pid in ranks:  # a cluster's preemption signals every process of the job
            os.kill(pid, signal.SIGTERM)
        return True

    return when


@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.distributed
def test_sigterm_checkpoints_exits_zero_and_resume_is_exact(grpo_args, uninterrupted, tmp_path):
    job = _launch_forked([*grpo_args, *_where(tmp_path)], when=_send_sigterm_after_first_checkpoint(tmp_path / "ckpt"))
    print(
        f"\n(c) SIGTERM to both ranks after step 2's checkpoint: exit code {job.returncode}, "
        f"{job.after_fault:.1f} s after the signal"
    )
    assert job.returncode == 0, job.stderr[-4000:]
    stopped = int(job.stderr.split("SIGTERM: stopped after step ")[1].split(";")[0])
    assert 2 <= stopped < STEPS and _complete(tmp_path / "ckpt")[-1] == stopped
    assert job.stderr.count(f"SIGTERM: stopped after step {stopped};") == 2  # both ranks stopped after the same step
    assert not (tmp_path / "run" / "summary.json").exists()  # not finished: resume=auto continues
    compared = _resume(grpo_args, tmp_path, uninterrupted, after=stopped)
    print(f"(c) resumed from step {stopped}: {compared} metric values after it equal the uninterrupted run's")


@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_restart_resumes_from_the_last_checkpoint(grpo_args, uninterrupted, tmp_path):
    job = _launch([*grpo_args, *_where(tmp_path), "resume=auto"], fault="crash:rank=1:step=4:phase=update", restarts=1)
    print(
        f"\n(d) crash of rank 1 in step 4, torchrun --max-restarts 1: exit code {job.returncode}, the restarted job "
        f"ended {job.after_fault:.1f} s after the crash ({job.seconds:.1f} s in all)"
    )
    assert job.returncode == 0, job.stderr[-4000:]
    assert job.stderr.count("injecting fault") == 1  # the first attempt only
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["resumed_from"].endswith(f"step_{EVERY}")  # the crash came before step 4's checkpoint
    compared = _same_metrics(uninterrupted, _rows(tmp_path / "run"), after=EVERY)
    print(
        f"(d) restarted from {Path(summary['resumed_from']).name}: "
        f"{compared} metric values equal the uninterrupted run's"
    )


def _ctrl_c_after_first_checkpoint(ckpt_dir: Path):
    def when(ranks: list[int]) -> bool:
        if not ranks or not _complete(ckpt_dir):
            return False
        # what a terminal's Ctrl-C does: SIGINT to torchrun's process group (the ranks run in sessions of their own,
        # and torchrun, their parent and its group's leader, forwards it to them)
        os.killpg(_parent(ranks[0]), signal.SIGINT)
        return True

    return when


@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.distributed
def test_ctrl_c_to_torchrun_checkpoints_and_says_how_to_continue(grpo_args, tmp_path):
    job = _launch([*grpo_args, *_where(tmp_path)], when=_ctrl_c_after_first_checkpoint(tmp_path / "ckpt"))
    print(f"\n(e) Ctrl-C (SIGINT to torchrun) after step 2's checkpoint: the job ended {job.after_fault:.1f} s later")
    assert "SIGINT: stopped after step " in job.stderr, job.stderr[-4000:]
    stopped = int(job.stderr.split("SIGINT: stopped after step ")[1].split(";")[0])
    assert 2 <= stopped < STEPS and _complete(tmp_path / "ckpt")[-1] == stopped
    assert job.stderr.count(f"SIGINT: stopped after step {stopped};") == 2  # both ranks stopped after the same step
    assert f"Continue with resume=auto (run_dir={tmp_path / 'run'} checkpoint.dir={tmp_path / 'ckpt'})" in job.stderr
    assert "KeyboardInterrupt" not in job.stderr and not (tmp_path / "run" / "summary.json").exists()
