"""backends.distributed.setup and .collectives: process-group setup (1 process and 2 gloo ranks), meshes,
logging, seeding, collectives.

Tests that create the default process group of a plain ``python`` process do it in a fresh interpreter:
the pytest process may hold a group another test made (the group is process-wide), and a group made here
must not outlive the test either way."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import backends.distributed.collectives as collectives
import backends.distributed.setup as setup
from backends.distributed.collectives import (
    all_reduce_max,
    all_reduce_sum,
    barrier,
    broadcast_object,
    global_masked_whiten,
    sum_and_max,
)
from backends.distributed.setup import DistEnv, device_mesh, get_logger, init_distributed, seed_everything, shutdown
from tests.distributed import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _cpu_env(rank: int = 0, world_size: int = 1) -> DistEnv:
    return DistEnv(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"), backend="gloo")


def _in_fresh_process(test_body: str, **env_updates: str) -> None:
    """Run ``tests.test_distributed_setup.<test_body>()`` in a fresh interpreter without a torchrun
    environment (plus ``env_updates``): no process group exists there when it starts."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(env_updates)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    code = f"from tests.test_distributed_setup import {test_body}; {test_body}()"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def _one_process_group() -> None:
    assert not dist.is_initialized()
    assert (collectives.world_rank(), collectives.world_size()) == (0, 1)
    try:
        env = init_distributed(device="cpu")
        assert env == DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
        assert env.is_main
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert (collectives.world_rank(), collectives.world_size()) == (0, 1)
        assert init_distributed(device="cpu") == env  # idempotent
        mesh = device_mesh(env)
        assert mesh.size() == 1 and mesh.mesh_dim_names == ("dp",)
        x = torch.tensor([1.0, 2.0])
        torch.testing.assert_close(all_reduce_sum(x), x)
        assert broadcast_object({"step": 3}) == {"step": 3}
        shutdown(env)
        assert not dist.is_initialized()
        shutdown(env)  # a second shutdown is a no-op
    finally:
        shutdown()


def test_init_without_torchrun_makes_a_one_process_gloo_group():
    _in_fresh_process("_one_process_group")


def _rank_without_world_size() -> None:
    try:
        with pytest.raises(RuntimeError, match="RANK and WORLD_SIZE must be set together"):
            init_distributed(device="cpu")
        assert not dist.is_initialized()
    finally:
        shutdown()


def test_rank_without_world_size_is_an_error():
    _in_fresh_process("_rank_without_world_size", RANK="0")


def test_collectives_are_the_identity_without_a_group():
    """Without a group (or in a group of one) every collective leaves the value as it is."""
    x = torch.tensor([1.0, -2.0])
    for out in (all_reduce_sum(x), all_reduce_max(x), *sum_and_max(x, x)):
        torch.testing.assert_close(out, x)
        assert out is not x
    assert broadcast_object([1, "a"]) == [1, "a"]
    barrier()


def test_setup_still_exports_the_collectives():
    """Callers that import the collectives from backends.distributed.setup get the same functions."""
    for name in collectives.__all__:
        assert getattr(setup, name) is getattr(collectives, name), name


def test_bad_device_name():
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        init_distributed(device="tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_requested_without_cuda():
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        init_distributed(device="cuda")


def test_device_mesh_shape_must_cover_the_world():
    env = _cpu_env(0, 4)
    with pytest.raises(ValueError, match=r"holds 3 ranks, the world has 4"):
        device_mesh(env, (3,))
    with pytest.raises(ValueError, match="has 2 dims but names"):
        device_mesh(env, (2, 2), ("dp",))


def _two_ranks(rank: int, world_size: int) -> dict:
    """Runs on each of 2 gloo ranks (the harness has already initialised the group)."""
    env = init_distributed(device="cpu")
    out: dict = {"env": env, "again": init_distributed(device="cpu")}
    mesh = device_mesh(env)
    out["mesh"] = (mesh.size(), mesh.mesh_dim_names, mesh.get_local_rank("dp"))
    mesh2 = device_mesh(env, (2, 1), ("dp", "tp"))
    out["mesh2"] = (tuple(mesh2.shape), mesh2.mesh_dim_names)
    x = torch.tensor([float(rank + 1), 10.0 * rank])
    out["sum"] = all_reduce_sum(x)
    out["max"] = all_reduce_max(x)
    out["sum_and_max"] = sum_and_max(torch.tensor([rank + 1.0, 2.0]), torch.tensor([5.0 * rank, -1.0 - rank]))
    out["input_after"] = x
    out["broadcast"] = broadcast_object({"from": rank}, src=1)
    out["ranks"] = (collectives.world_rank(), collectives.world_size())
    stream = io.StringIO()
    log = get_logger("rlfunc.test", env, stream=stream)
    log.info("info line")
    log.warning("warning line")
    out["log"] = stream.getvalue()
    barrier()
    os.environ["WORLD_SIZE"] = "3"
    try:
        init_distributed(device="cpu")
        out["mismatch"] = None
    except RuntimeError as err:
        out["mismatch"] = str(err)
    return out


@pytest.mark.distributed
def test_two_gloo_ranks():
    results = run_distributed(_two_ranks, 2)
    for rank, out in enumerate(results):
        assert out["env"] == DistEnv(
            rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"), backend="gloo"
        )
        assert out["again"] == out["env"]
        assert out["env"].is_main == (rank == 0)
        assert out["mesh"] == (2, ("dp",), rank)
        assert out["mesh2"] == ((2, 1), ("dp", "tp"))
        torch.testing.assert_close(out["sum"], torch.tensor([3.0, 10.0]))
        torch.testing.assert_close(out["max"], torch.tensor([2.0, 10.0]))
        sums, maxima = out["sum_and_max"]  # one collective: sums, and maxima below zero too
        torch.testing.assert_close(sums, torch.tensor([3.0, 4.0]))
        torch.testing.assert_close(maxima, torch.tensor([5.0, -1.0]))
        torch.testing.assert_close(out["input_after"], torch.tensor([float(rank + 1), 10.0 * rank]))
        assert out["broadcast"] == {"from": 1}
        assert out["ranks"] == (rank, 2)
        assert "disagrees with the environment" in out["mismatch"]
    log0, log1 = results[0]["log"], results[1]["log"]
    assert "[rank 0]" in log0 and "info line" in log0 and "warning line" in log0
    assert "info line" not in log1
    assert "[rank 1]" in log1 and "warning line" in log1


def test_logger_levels_and_prefix_without_a_group():
    stream = io.StringIO()
    log = get_logger("rlfunc.test.levels", _cpu_env(0), stream=stream)
    log.info("hello %d", 1)
    assert stream.getvalue().startswith("[rank 0]") and "hello 1" in stream.getvalue()
    stream1 = io.StringIO()
    log = get_logger("rlfunc.test.levels", _cpu_env(3, 4), stream=stream1)  # same logger, reconfigured
    log.info("quiet")
    log.error("loud")
    assert len([h for h in log.handlers if getattr(h, "_rlfunc_rank_handler", False)]) == 1
    assert "quiet" not in stream1.getvalue() and "[rank 3]" in stream1.getvalue() and "loud" in stream1.getvalue()
    assert "loud" not in stream.getvalue()  # the old handler is gone


def test_seed_everything():
    import random

    state, py_state = torch.random.get_rng_state(), random.getstate()
    try:
        assert seed_everything(5) == 5
        a = (torch.rand(3), random.random())
        seed_everything(5)
        b = (torch.rand(3), random.random())
        assert seed_everything(5, rank_offset=2) == 7
        c = torch.rand(3)
    finally:
        torch.random.set_rng_state(state)
        random.setstate(py_state)
    torch.testing.assert_close(a[0], b[0])
    assert a[1] == b[1]
    assert not torch.equal(a[0], c)


def _global_whiten_worker(rank: int, world_size: int) -> list[float]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * world_size, 5, generator=g)
    m = torch.rand(4 * world_size, 5, generator=g) < 0.6
    rows = slice(4 * rank, 4 * (rank + 1))
    local = global_masked_whiten(x[rows], m[rows])
    import rlfunc as rf

    whole = rf.masked_whiten(x, m)[rows]
    return [float((local - whole).abs().max()), float((rf.masked_whiten(x[rows], m[rows]) - whole).abs().max())]


@pytest.mark.distributed
def test_global_masked_whiten_on_two_ranks_equals_whitening_the_whole_batch():
    for gap, per_rank_gap in run_distributed(_global_whiten_worker, 2):
        assert gap < 1e-6
        assert per_rank_gap > 1e-3  # per-rank whitening would differ: the test can tell them apart
