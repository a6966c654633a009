"""backends.distributed.setup: process-group setup (1 process and 2 gloo ranks), meshes, logging, seeding."""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.distributed as dist

from backends.distributed.setup import (
    DistEnv,
    all_reduce_max,
    all_reduce_sum,
    barrier,
    broadcast_object,
    device_mesh,
    get_logger,
    init_distributed,
    seed_everything,
    shutdown,
)
from tests.distributed import run_distributed

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _cpu_env(rank: int = 0, world_size: int = 1) -> DistEnv:
    return DistEnv(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"), backend="gloo")


@pytest.fixture
def no_torchrun_env(monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this test process")
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    yield
    shutdown()


def test_init_without_torchrun_makes_a_one_process_gloo_group(no_torchrun_env):
    env = init_distributed(device="cpu")
    assert env == DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    assert env.is_main
    assert dist.is_initialized() and dist.get_world_size() == 1
    assert init_distributed(device="cpu") == env  # idempotent
    mesh = device_mesh(env)
    assert mesh.size() == 1 and mesh.mesh_dim_names == ("dp",)
    x = torch.tensor([1.0, 2.0])
    torch.testing.assert_close(all_reduce_sum(x), x)
    assert broadcast_object({"step": 3}) == {"step": 3}
    shutdown(env)
    assert not dist.is_initialized()
    shutdown(env)  # a second shutdown is a no-op


def test_rank_without_world_size_is_an_error(no_torchrun_env, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="RANK and WORLD_SIZE must be set together"):
        init_distributed(device="cpu")


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
    out["input_after"] = x
    out["broadcast"] = broadcast_object({"from": rank}, src=1)
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
        assert out["env"] == DistEnv(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"), backend="gloo")
        assert out["again"] == out["env"]
        assert out["env"].is_main == (rank == 0)
        assert out["mesh"] == (2, ("dp",), rank)
        assert out["mesh2"] == ((2, 1), ("dp", "tp"))
        torch.testing.assert_close(out["sum"], torch.tensor([3.0, 10.0]))
        torch.testing.assert_close(out["max"], torch.tensor([2.0, 10.0]))
        torch.testing.assert_close(out["input_after"], torch.tensor([float(rank + 1), 10.0 * rank]))
        assert out["broadcast"] == {"from": 1}
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
    from backends.distributed.setup import global_masked_whiten

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


_ONEDNN_GROWTH = r"""
import ctypes, json, sys
import torch
from backends.cpu.fused_modules import onednn_linear_works
from backends.cpu.runtime import bound_onednn_caches
if sys.argv[1] == "bounded":
    bound_onednn_caches(16)
torch.set_num_threads(1)
libc = ctypes.CDLL("libc.so.6")
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
in_use = lambda: (libc.mallinfo2().uordblks + libc.mallinfo2().hblkhd) / 2**20
w = torch.randn(64, 32)
base = in_use()
for rows in range(100, 160):  # a new shape every call, as a packed micro-batch's token count
    torch.ops.mkldnn._linear_pointwise(torch.randn(rows, 32), w, None, "none", [], "")
print(json.dumps({"works": onednn_linear_works(torch.float32), "grew_mib": in_use() - base}))
"""


def test_bounded_onednn_caches_stop_the_heap_growing_with_new_shapes():
    """Every new row count of a CPU linear leaves a oneDNN primitive in two 1024-entry caches; with
    bound_onednn_caches the memory they hold stops growing (glibc's mallinfo2, in fresh processes)."""
    import json
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's mallinfo2 is Linux-only")
    grew = {}
    for mode in ("default", "bounded"):
        env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
        out = subprocess.run([sys.executable, "-c", _ONEDNN_GROWTH, mode], capture_output=True, text=True, env=env,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
        if not result["works"]:
            pytest.skip("this torch build has no oneDNN linear")
        grew[mode] = result["grew_mib"]
    assert grew["default"] > 3 * grew["bounded"] and grew["default"] > 10, grew


def test_bound_onednn_caches_keeps_a_value_the_user_set(monkeypatch):
    from backends.cpu.runtime import bound_onednn_caches

    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    bound_onednn_caches(64)
    assert os.environ["LRU_CACHE_CAPACITY"] == "7" and os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"
