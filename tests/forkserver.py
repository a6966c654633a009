"""The one process every rank the suite starts is forked from, with torch, transformers and the recipes imported.

A rank started from scratch (``torchrun``, or a ``spawn`` process) pays a Python start-up and the imports of
torch, transformers and the backends: several seconds on CI's two cores, for each of the hundreds of ranks the
suite starts, and most of what a tiny recipe run costs. ``multiprocessing``'s forkserver imports
:data:`PRELOAD` once; every process of :func:`context` is a ``fork`` of it, so it starts with those modules
loaded and nothing else: no process group, no threads, no model, no state of any earlier test. What a test
then runs (a recipe's ``main``, a test body on a process group) runs as it would in a fresh interpreter.

The server starts on first use with the environment of :func:`rank_environment` (one torch thread, no hub),
so the imports see what a recipe process started by the tests would see. On a machine with CUDA the processes
are ``spawn``-ed instead: a fork cannot use CUDA once its parent has initialised it.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import traceback
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]

#: imported once by the server: what nearly every rank imports, and the lazy imports of a recipe's first
#: run (the model classes, the tokenizer, checkpoints, the plot, megatron-core). Not vLLM: the ranks that
#: use it import it (its import changes process-wide settings that other ranks should not inherit).
PRELOAD = (
    "tests.forkserver",
    "tests.distributed",
    "tests.recipes",
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "transformers",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.llama.modeling_llama",
    "transformers.tokenization_utils_fast",
    "safetensors.torch",
    "matplotlib.pyplot",
    "torch.utils.tensorboard",
    "experiments.grpo",
    "experiments.ppo",
    "experiments.custom_algorithm",
    "backends.training.megatron.engine",
)

_lock = threading.Lock()
_context: BaseContext | None = None


def rank_environment() -> dict[str, str]:
    """What every rank's environment holds beyond the test process's: one torch thread per rank (two ranks
    share CI's two cores), no hub, this checkout first on the path (for the ranks' own child processes)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return {
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "MPLBACKEND": "Agg",
        "PYTHONPATH": path,
    }


def context() -> BaseContext:
    """The forkserver context (the server starts with the first process made from it)."""
    global _context
    with _lock:
        if _context is None and _cuda_present():
            # A fork cannot use CUDA once its parent initialised it, and importing the preloaded modules may do so
            # (a GPU machine's tests are few): fresh interpreters there.
            _context = multiprocessing.get_context("spawn")
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(list(PRELOAD))
            saved = dict(os.environ)
            os.environ.update(rank_environment())
            try:  # the server reads the environment once, when it starts
                from multiprocessing import forkserver

                forkserver.ensure_running()
            finally:
                os.environ.clear()
                os.environ.update(saved)
            _context = ctx
        return _context


def _cuda_present() -> bool:
    import torch

    return torch.cuda.is_available()


def _call(fn: Callable[..., Any], args: tuple, conn: Any) -> None:
    try:
        conn.send(("ok", fn(*args)))
    except BaseException:  # noqa: BLE001 - the caller raises it with the child's traceback
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def call_in_child(fn: Callable[..., Any], *args: Any, timeout: float = 300) -> Any:
    """``fn(*args)`` in a process of its own (forked from the server), for what must not share this one's
    state: a peak resident size, process-wide settings. Returns its result; its exception raises here."""
    ctx = context()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_call, args=(fn, args, child))
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout):
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} did not return within {timeout:.0f} s")
        status, value = parent.recv()
    except EOFError:
        proc.join(timeout=10)
        raise RuntimeError(
            f"{getattr(fn, '__name__', fn)}'s process ended without a result (exit code {proc.exitcode})"
        )
    finally:
        if proc.is_alive():
            proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    if status == "error":
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed in its process:\n{value}")
    return value
