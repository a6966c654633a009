"""The multi-rank test harness (``tests/distributed.py``): what one test does to its ranks' processes does not
reach the next test on the same pool, and a test that fails leaves a pool that the next one does not inherit."""

from __future__ import annotations

import os

import pytest

import backends.checkpoint.dcp as dcp
from tests import distributed
from tests.distributed import run_distributed

pytestmark = pytest.mark.distributed


def _enospc(*args, **kwargs):
    raise OSError(28, "No space left on device")


def _change_the_process(rank, world_size, marker):
    """What a careless test does: a fault injected by assignment, an environment variable, a module global."""
    original = dcp.save_checkpoint
    dcp.save_checkpoint = _enospc
    distributed._PROJECT_PACKAGES = ("nothing",)
    os.environ["RLFUNC_TEST_POOL_MARKER"] = marker
    return os.getpid(), original is not _enospc


def _look_at_the_process(rank, world_size):
    return (
        os.getpid(),
        dcp.save_checkpoint is not _enospc,
        distributed._PROJECT_PACKAGES,
        os.environ.get("RLFUNC_TEST_POOL_MARKER"),
    )


def _fail_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    return rank


def test_what_a_test_changes_in_its_ranks_is_put_back_before_the_next_test():
    before = run_distributed(_change_the_process, 2, "set by the previous test")
    after = run_distributed(_look_at_the_process, 2)
    for rank in range(2):
        pid, was_original = before[rank]
        pid_after, is_original, packages, marker = after[rank]
        assert was_original and pid_after == pid  # the same process served both tests
        assert is_original, f"rank {rank}: the replaced save_checkpoint reached the next test"
        assert packages == ("backends", "experiments", "rlfunc", "tests") and marker is None


def test_a_failing_test_leaves_no_pool_behind_for_the_next_one():
    pids = [pid for pid, *_ in run_distributed(_look_at_the_process, 2)]
    with pytest.raises(RuntimeError, match="rank 1 failed:(.|\n)*rank 1 fails on purpose"):
        run_distributed(_fail_on_rank_1, 2)
    after = run_distributed(_look_at_the_process, 2)
    assert not set(pids) & {pid for pid, *_ in after}  # new processes
    assert all(is_original for _, is_original, _, _ in after)


def test_a_fresh_pool_is_a_pool_of_its_own():
    shared = {pid for pid, *_ in run_distributed(_look_at_the_process, 2)}
    fresh = {pid for pid, *_ in run_distributed(_look_at_the_process, 2, fresh=True)}
    assert not shared & fresh
    assert shared == {pid for pid, *_ in run_distributed(_look_at_the_process, 2)}
