"""Checkpoint and metrics writes under faults: a crash at any point of a save leaves the previous checkpoint
loadable (and found by ``resume=auto``); a full disk (ENOSPC, simulated) while writing a checkpoint or the
metrics gives an error naming the path and the cause, and corrupts nothing.

Crashes are real: the save runs in a child process that SIGKILLs itself at the injected point. Full disks
are simulated by file objects whose writes fail with ``OSError(ENOSPC)`` part-way (mounting a small tmpfs
needs privileges a test run does not have).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import time
from pathlib import Path

import attrs
import pytest
import torch

import backends.checkpoint.dcp as ckpt
import backends.checkpoint.files as files
from backends.checkpoint.dcp import CheckpointError, list_checkpoints, load_checkpoint, resolve_resume, save_checkpoint
from backends.checkpoint.resume import truncate_metrics
from backends.metrics_log import MetricsLog, read_jsonl
from backends.models import TinyModelConfig, build_tiny_model
from tests import forkserver
from tests.checkpoint_state import State
from tests.distributed import run_distributed

pytestmark = [pytest.mark.faults, pytest.mark.checkpoint]

TINY = TinyModelConfig(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, max_position_embeddings=64
)
TIMINGS: dict[str, float] = {}


def make_state(seed: int) -> State:
    return State(build_tiny_model(attrs.evolve(TINY, seed=seed)), None, seed)


def _save(root: Path, step: int, seed: int, **kw) -> Path:
    return save_checkpoint(root, step, {"actor": make_state(seed)}, {"seed": seed}, **kw)


def _assert_loads_seed(path: Path, seed: int) -> None:
    """``path`` loads (into another model) and holds exactly the weights of ``make_state(seed)``."""
    target = make_state(seed + 100)
    states, extra = load_checkpoint(path, {"actor": target})
    assert extra == {"seed": seed}
    expected = make_state(seed).module.state_dict()
    for name, value in states["actor"].module.state_dict().items():
        assert torch.equal(value, expected[name]), name


def _stale(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if "." in p.name)


# --------------------------------------------------------------------------------------------------
# Crashes: a child process (forked from the suite's forkserver) saves and SIGKILLs itself at an injected point


def _crashing_save(point: str, ckpt_dir: str, step: int, seed: int, keep_last: int | None) -> None:
    """The child: arm the crash at ``point``, then save; returning (exit code 0) means the fault was never hit."""
    inject(point)
    _save(ckpt_dir, step, seed, keep_last=keep_last)


def _die() -> None:
    os.kill(os.getpid(), 9)


def inject(point: str) -> None:
    """In the child: arm the crash at ``point``."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    if point == "shard write":  # half of the first write of a DCP shard reaches the file

        @contextlib.contextmanager
        def stream(self, path, mode):
            with _DyingFile(str(path), mode) as f:
                yield f

        FileSystem.create_stream = stream
    elif point == "after shards, before COMPLETE":
        files.write_json_atomic = lambda path, data: _die()
    elif point == "mid COMPLETE write":

        def partial_dump(data, f, **kw):
            f.write(json.dumps(data)[:40])
            f.flush()
            _die()

        files.json = type("J", (), {"dump": staticmethod(partial_dump)})
    elif point == "after COMPLETE, before rename":
        files.fsync_dir = lambda path: _die()
    elif point == "re-save: old step moved aside, new not renamed":
        calls = []

        def replace(src, dst):  # commit_checkpoint's dir renames: 1: step_N -> step_N.old-*, 2: tmp -> step_N
            if Path(src).is_dir():
                calls.append(src)
                if len(calls) == 2:
                    _die()
            os.replace(src, dst)

        class _OsDyingOnTheSecondDirRename:
            def __getattr__(self, name):
                return getattr(os, name)

        _OsDyingOnTheSecondDirRename.replace = staticmethod(replace)
        files.os = _OsDyingOnTheSecondDirRename()
    elif point == "retention delete":

        def rmtree(path, ignore_errors=False):  # one file of the doomed checkpoint goes, then the crash
            next(Path(path).glob("*.distcp")).unlink()
            _die()

        files.shutil = type("S", (), {"rmtree": staticmethod(rmtree)})
    else:
        raise ValueError(point)


class _DyingFile(io.FileIO):
    def write(self, b):
        data = bytes(memoryview(b))
        super().write(data[: max(1, len(data) // 2)])
        self.flush()
        _die()


# point -> (steps saved before, the child's step, keep_last, the checkpoint resume=auto must find)
CRASHES = {
    "shard write": ([1], 2, "none", 1),
    "after shards, before COMPLETE": ([1], 2, "none", 1),
    "mid COMPLETE write": ([1], 2, "none", 1),
    "after COMPLETE, before rename": ([1], 2, "none", 1),
    "re-save: old step moved aside, new not renamed": ([1, 2], 2, "none", 1),
    "retention delete": ([1, 2], 3, "1", 3),
}


@pytest.mark.parametrize("point", list(CRASHES))
def test_a_crash_during_a_save_leaves_the_previous_checkpoint(tmp_path, point):
    before, step, keep_last, expected = CRASHES[point]
    root = tmp_path / "ckpt"
    for s in before:
        _save(root, s, seed=s)
    t0 = time.perf_counter()
    child = forkserver.context().Process(
        target=_crashing_save, args=(point, str(root), step, step + 10, None if keep_last == "none" else int(keep_last))
    )
    child.start()
    child.join(timeout=300)
    TIMINGS[f"crash: {point}"] = time.perf_counter() - t0
    assert child.exitcode == -9, f"the child ended with {child.exitcode}, not killed at {point!r}"
    found = resolve_resume("auto", root)
    assert found == root / f"step_{expected}", (found, sorted(p.name for p in root.iterdir()))
    _assert_loads_seed(found, seed=expected if expected in before else expected + 10)
    # the next save removes what the crash left, and the earlier checkpoints are still there
    _save(root, 9, seed=9)
    assert _stale(root) == []
    if point != "retention delete":
        assert [p.name for p in list_checkpoints(root)][:1] == ["step_1"]
        _assert_loads_seed(root / "step_1", seed=1)


# --------------------------------------------------------------------------------------------------
# A full disk while saving a checkpoint


class _FullDiskFile(io.FileIO):
    """A file on a disk with ``budget`` bytes left: the write that crosses it writes what fits and fails."""

    budget = [0]

    def write(self, b):
        data = bytes(memoryview(b))
        room = self.budget[0]
        if len(data) > room:
            super().write(data[:room])
            self.budget[0] = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)
        self.budget[0] -= len(data)
        return super().write(data)


@pytest.fixture
def full_disk(monkeypatch):
    from torch.distributed.checkpoint.filesystem import FileSystem

    @contextlib.contextmanager
    def stream(self, path, mode):
        with _FullDiskFile(str(path), mode) as f:
            yield f

    def arm(budget: int) -> None:
        _FullDiskFile.budget[0] = budget
        monkeypatch.setattr(FileSystem, "create_stream", stream)

    return arm


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(args[0]) if args else None)


@pytest.mark.parametrize("where", ["shards", "shards, async", "rng file", "COMPLETE marker"])
def test_a_full_disk_during_a_save_is_a_clear_error_and_corrupts_nothing(tmp_path, monkeypatch, full_disk, where):
    root = tmp_path / "ckpt"
    _save(root, 1, seed=1)
    if where.startswith("shards"):
        full_disk(budget=3000)
    elif where == "rng file":
        monkeypatch.setattr(ckpt, "write_rng_file", _enospc)
    else:
        monkeypatch.setattr(files, "write_json_atomic", _enospc)
    t0 = time.perf_counter()
    with pytest.raises(
        CheckpointError,
        match=rf"saving checkpoint '{root / 'step_2'}' failed: .*no space left on device"
        r".*earlier checkpoints in .* are intact",
    ):
        saved = _save(root, 2, seed=2, async_save=where.endswith("async"))
        if not isinstance(saved, Path):
            saved.wait()
    TIMINGS[f"ENOSPC: checkpoint {where}"] = time.perf_counter() - t0
    monkeypatch.undo()
    assert _stale(root) == []  # the partial save's files are gone: its space is back
    assert resolve_resume("auto", root) == root / "step_1"
    _assert_loads_seed(root / "step_1", seed=1)
    _assert_loads_seed(_save(root, 2, seed=2), seed=2)  # the disk has room again: the same save works


def test_a_full_disk_when_creating_the_temp_dir(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    _save(root, 1, seed=1)
    real_mkdir = Path.mkdir
    monkeypatch.setattr(
        Path, "mkdir", lambda self, *a, **k: _enospc(self) if ".tmp-" in self.name else real_mkdir(self, *a, **k)
    )
    with pytest.raises(
        CheckpointError, match=rf"cannot create a temp dir for step 2 under '{root}': no space left on device"
    ):
        _save(root, 2, seed=2)
    monkeypatch.undo()
    assert resolve_resume("auto", root) == root / "step_1"


def _full_disk_worker(rank, world_size, ckpt_dir, failing_rank, where):
    """Two gloo ranks save; ``failing_rank`` finds its disk full at ``where``: every rank must raise (none
    waits forever on the other), naming the cause."""
    if rank == failing_rank:
        if where == "rng file":
            ckpt.write_rng_file = _enospc
        else:
            files.write_json_atomic = _enospc
    t0 = time.perf_counter()
    try:
        _save(Path(ckpt_dir), 2, seed=2)
    except CheckpointError as e:
        return str(e), time.perf_counter() - t0
    return None, time.perf_counter() - t0


@pytest.mark.distributed
@pytest.mark.parametrize("failing_rank, where", [(1, "rng file"), (0, "COMPLETE marker")])
def test_a_full_disk_on_one_rank_raises_on_every_rank(tmp_path, failing_rank, where):
    root = tmp_path / "ckpt"
    _save(root, 1, seed=1)
    results = run_distributed(_full_disk_worker, 2, str(root), failing_rank, where, timeout=240)
    for rank, (message, seconds) in enumerate(results):
        assert message is not None, f"rank {rank} did not raise"
        assert f"saving checkpoint '{root / 'step_2'}' failed" in message
        if rank == failing_rank or failing_rank == 0:
            assert "no space left on device" in message or "rank 0 failed" in message
        TIMINGS[f"ENOSPC on rank {failing_rank} ({where}), rank {rank} raised after"] = seconds
    assert _stale(root) == [] and resolve_resume("auto", root) == root / "step_1"
    _assert_loads_seed(root / "step_1", seed=1)


# --------------------------------------------------------------------------------------------------
# A full disk while writing metrics


def test_a_full_disk_while_logging_metrics_keeps_the_rows_before(tmp_path, monkeypatch):
    import backends.metrics_log as metrics_log

    log = MetricsLog(tmp_path, loggers=("jsonl",))
    for step in range(3):
        log.log(step, {"reward": step / 10, "note": "x" * 50})
    real_write = os.write

    def half_then_enospc(fd, data):
        real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(metrics_log.os, "write", half_then_enospc)
    t0 = time.perf_counter()
    with pytest.raises(
        OSError, match=rf"writing a metrics row to '{tmp_path / 'metrics.jsonl'}' failed: no space left on device"
    ):
        log.log(3, {"reward": 0.3, "note": "x" * 50})
    TIMINGS["ENOSPC: metrics row"] = time.perf_counter() - t0
    monkeypatch.undo()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert text.endswith("\n") and [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    log.log(3, {"reward": 0.3})  # room again: the next row is a line of its own
    log.log(4, {"reward": 0.4})
    log.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    truncate_metrics(tmp_path / "metrics.jsonl", 3)  # what a resume from step 3 does
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]


def test_a_full_disk_while_cutting_metrics_back_on_resume(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(5)) + '{"step": 5, "rew')  # a crash cut row 5
    before = path.read_text()
    real_write_text = Path.write_text

    def full(self, data, *a, **k):
        real_write_text(self, data[: len(data) // 2], *a, **k)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(
        OSError, match=rf"cutting '{path}' back to step 2 failed: No space left on device; the file is unchanged"
    ):
        truncate_metrics(path, 2)
    monkeypatch.undo()
    assert path.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    truncate_metrics(path, 2)
    assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2]


def test_report_timings():
    for fault, seconds in TIMINGS.items():
        print(f"{fault}: {seconds:.2f} s")
