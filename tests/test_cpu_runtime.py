"""backends.cpu.runtime: the process-wide CPU settings (glibc malloc thresholds, oneDNN cache bounds) that a
recipe applies explicitly with ``backends.cpu.tune_process()``, and that joining a process group leaves alone.

The settings are process-wide (the allocator, environment variables oneDNN reads once), so every test that
applies them runs in a fresh subprocess, and the pytest process keeps its own settings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from backends.cpu.runtime import ONEDNN_CACHE_CAPACITY, bound_onednn_caches, reuse_freed_cpu_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _run_python(code: str, *args: str, env_updates: dict[str, str] | None = None) -> dict:
    """Run ``code`` in a fresh interpreter whose environment has no oneDNN cache or torchrun variables
    (plus ``env_updates``); return the JSON object its last stdout line holds."""
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARS + TORCHRUN_VARS}
    env.update(env_updates or {})
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def restored_environ():
    """The whole of ``os.environ`` as it was before the test (monkeypatch.delenv of an unset variable would
    not restore one that the code under test sets later)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


_TUNE_PROCESS = r"""
import json, os, sys
import backends.cpu as cpu
if sys.argv[1] == "user-set":
    os.environ["LRU_CACHE_CAPACITY"] = "7"
applied = cpu.tune_process()
print(json.dumps({"applied": applied, "env": {k: os.environ.get(k) for k in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY",
                                                                          "LRU_CACHE_CAPACITY")}}))
"""


def test_tune_process_bounds_the_caches_and_tunes_malloc():
    result = _run_python(_TUNE_PROCESS, "fresh")
    on_glibc = sys.platform.startswith("linux")
    assert result["applied"] == {"malloc": on_glibc, "onednn_caches": True}
    assert result["env"] == {name: str(ONEDNN_CACHE_CAPACITY) for name in CACHE_VARS}


def test_tune_process_keeps_a_cache_size_the_user_set_and_honours_the_malloc_opt_out():
    result = _run_python(_TUNE_PROCESS, "user-set", env_updates={"RLFUNC_MALLOC_TUNING": "0"})
    assert result["applied"] == {"malloc": False, "onednn_caches": True}
    assert result["env"] == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(ONEDNN_CACHE_CAPACITY), "LRU_CACHE_CAPACITY": "7"}


_INIT_DISTRIBUTED = r"""
import json, os
import backends.cpu.runtime as runtime

def forbidden(*args, **kwargs):
    raise AssertionError("init_distributed applied a process-wide CPU setting")

runtime.tune_process = runtime.reuse_freed_cpu_memory = runtime.bound_onednn_caches = forbidden
from backends.distributed.setup import init_distributed, shutdown
env = init_distributed(device="cpu")
state = {"world_size": env.world_size, "env": {k: os.environ.get(k) for k in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY",
                                                                             "LRU_CACHE_CAPACITY")}}
shutdown(env)
print(json.dumps(state))
"""


def test_init_distributed_leaves_malloc_and_onednn_settings_alone():
    """Joining a process group changes no process-wide CPU setting: that is the recipe's explicit call."""
    result = _run_python(_INIT_DISTRIBUTED)
    assert result == {"world_size": 1, "env": {name: None for name in CACHE_VARS}}


def test_malloc_tuning_opt_out(monkeypatch):
    monkeypatch.setenv("RLFUNC_MALLOC_TUNING", "0")
    assert reuse_freed_cpu_memory() is False


def test_bound_onednn_caches_keeps_a_value_the_user_set(restored_environ):
    os.environ["LRU_CACHE_CAPACITY"] = "7"
    os.environ.pop("ONEDNN_PRIMITIVE_CACHE_CAPACITY", None)
    bound_onednn_caches(64)
    assert os.environ["LRU_CACHE_CAPACITY"] == "7" and os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"


_ONEDNN_GROWTH = r"""
import ctypes, json, sys
import torch
from backends.cpu.runtime import bound_onednn_caches
from backends.rollout.decoder import PREPACK_MIN_FP32_WEIGHT, Linear
if sys.argv[1] == "bounded":
    bound_onednn_caches(16)
torch.set_num_threads(1)
libc = ctypes.CDLL("libc.so.6")
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
in_use = lambda: (libc.mallinfo2().uordblks + libc.mallinfo2().hblkhd) / 2**20
linear = Linear(torch.randn(PREPACK_MIN_FP32_WEIGHT // 256, 256), None, rows_hint=128, prepack=True)
base = in_use()
for rows in range(100, 160):  # a new shape every call, as the rollout's working batch shrinks
    linear(torch.randn(rows, 256))
print(json.dumps({"works": linear.packed is not None, "grew_mib": in_use() - base}))
"""


@pytest.mark.slow  # two fresh interpreters that each build a thousand oneDNN primitives
def test_bounded_onednn_caches_stop_the_heap_growing_with_new_shapes():
    """Every new row count of the native rollout's oneDNN-prepacked linear leaves a oneDNN primitive in two
    1024-entry caches; with bound_onednn_caches the memory they hold stops growing (glibc's mallinfo2, in
    fresh processes)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's mallinfo2 is Linux-only")
    grew = {}
    for mode in ("default", "bounded"):
        result = _run_python(_ONEDNN_GROWTH, mode)
        if not result["works"]:
            pytest.skip("this torch build has no oneDNN prepacked linear")
        grew[mode] = result["grew_mib"]
    assert grew["default"] > 3 * grew["bounded"] and grew["default"] > 10, grew
