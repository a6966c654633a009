"""Run a function on N real processes joined by a real process group (the multi-rank test harness).

``run_distributed(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` on every rank of a
:class:`RankPool`: ``world_size`` processes joined in the default process group, started once per pytest run
and world size and reused by every test after it (PyTorch's ``MultiProcContinuousTest`` is the precedent). A
test pays for its own work, not for starting processes and forming a group. The ranks are forked from the
suite's forkserver (``tests/forkserver.py``), so even a new pool starts in about a second.

Between two tests every rank puts back what a test may change in its process (environment, working dir,
torch's default dtype, grad mode and thread count, the CPU affinity, the default RNG state, logging and
signal handlers, the functions and globals of the project's modules that a test replaced (a fault injected by
assignment), megatron-core's model-parallel state) and the ranks meet in a barrier. A pool whose last test
failed, timed out, lost a rank, destroyed its group or left it unusable (threads left running included) is
replaced before the next test, and a replacement after a passing test is a warning in the pytest summary: a
failing test cannot poison the next one. A test that breaks the group on
purpose (kills or freezes a rank, injects a fault, runs into a deadline) passes ``fresh=True``: it gets a
pool of its own, closed after it.

On CPU the group is gloo. Where CUDA has a GPU per rank it is ``cpu:gloo,cuda:nccl``: collectives on CUDA
tensors go through NCCL (what a GPU cluster runs), those on CPU tensors through gloo, and each rank uses
``cuda:<rank>``. ``RLFUNC_TEST_BACKEND`` overrides the choice (e.g. ``gloo``).
"""

from __future__ import annotations

import atexit
import faulthandler
import logging
import os
import pickle
import queue as queue_module
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from tests import forkserver

#: signals whose handlers a test may install in a rank (the watchdog's SIGTERM flag, SIGINT) and that the
#: pool puts back after it
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM)
#: threads a library starts once per process and keeps (not a test's leftovers)
_PROCESS_THREADS = ("tqdm_monitor",)
#: how long the other ranks get to report once one rank's test failed, before the pool is given up
_FAILURE_GRACE_S = 10.0
#: how long the ranks get, after a test, to put their state back and meet in the barrier
_HEALTH_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_group_backend(world_size: int) -> str:
    """The process-group backend of the multi-rank tests (see the module doc)."""
    import torch

    override = os.environ.get("RLFUNC_TEST_BACKEND")
    if override:
        return override
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "cpu:gloo,cuda:nccl"
    return "gloo"


# ------------------------------------------------------------------------------------------ a rank


class _ProcessState:
    """What a test may change in a rank's process, taken when the rank has joined its group."""

    def __init__(self) -> None:
        import torch

        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.default_dtype = torch.get_default_dtype()
        self.grad_enabled = torch.is_grad_enabled()
        self.threads = torch.get_num_threads()
        self.affinity = os.sched_getaffinity(0)
        self.rng = torch.get_rng_state()
        self.signals = {sig: signal.getsignal(sig) for sig in _SIGNALS}
        self.loggers = {name: (list(lg.handlers), lg.level, lg.propagate) for name, lg in _all_loggers().items()}
        self.threads_alive = {t.ident for t in threading.enumerate()}
        # a test that replaces a function of the project (a fault injection) leaves it replaced for the next one
        self.bindings = {name: dict(vars(module)) for name, module in _project_modules().items()}

    def restore(self) -> list[str]:
        """Put the process back as it was; returns what could not be put back (the pool is then replaced)."""
        import torch

        if os.environ != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        os.chdir(self.cwd)
        torch.set_default_dtype(self.default_dtype)
        torch.set_grad_enabled(self.grad_enabled)
        torch.set_num_threads(self.threads)
        os.sched_setaffinity(0, self.affinity)
        torch.set_rng_state(self.rng)  # every test starts from a fresh process's default generator
        for sig, handler in self.signals.items():
            if handler is not None:
                signal.signal(sig, handler)
        for name, lg in _all_loggers().items():
            handlers, level, propagate = self.loggers.get(name, ([], logging.NOTSET, True))
            lg.handlers[:] = handlers
            lg.setLevel(level)
            lg.propagate = propagate
        for name, saved in self.bindings.items():
            module = sys.modules.get(name)
            if module is not None:
                namespace = vars(module)
                namespace.update(
                    {key: value for key, value in saved.items() if namespace.get(key, _UNSET) is not value}
                )
        problems = _reset_megatron()
        deadline = time.monotonic() + 5.0  # a test's helper threads (a writer, a watchdog) may still be ending
        while time.monotonic() < deadline:
            left = [
                t
                for t in threading.enumerate()
                if t.ident not in self.threads_alive and t.is_alive() and t.name not in _PROCESS_THREADS
            ]
            if not left:
                break
            time.sleep(0.05)
        else:
            problems.append(f"threads left running: {', '.join(sorted(t.name for t in left))}")
        return problems


_PROJECT_PACKAGES = ("backends", "experiments", "rlfunc", "tests")
_UNSET = object()


def _project_modules() -> dict[str, Any]:
    return {
        name: module
        for name, module in list(sys.modules.items())
        if module is not None and name.partition(".")[0] in _PROJECT_PACKAGES
    }


def _all_loggers() -> dict[str, logging.Logger]:
    loggers = {name: lg for name, lg in logging.root.manager.loggerDict.items() if isinstance(lg, logging.Logger)}
    return {"": logging.getLogger(), **loggers}


def _reset_megatron() -> list[str]:
    """megatron-core keeps its parallel layout and RNG tracker in module globals: a test that set them up
    would hand them to the next one."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None:
        return []
    try:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        random = sys.modules.get("megatron.core.tensor_parallel.random")
        if random is not None:  # as a fresh process has it: the next test picks the tracker's kind (CPU or CUDA)
            random._CUDA_RNG_STATE_TRACKER = None
            random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    except Exception as e:  # noqa: BLE001 - a layout that cannot be torn down makes the pool unusable
        return [f"megatron-core's parallel state could not be reset: {type(e).__name__}: {e}"]
    return []


def _check_group(world_size: int) -> list[str]:
    if not dist.is_initialized():
        return ["the default process group was destroyed"]
    if dist.get_world_size() != world_size:
        return [f"the default process group has {dist.get_world_size()} ranks, not {world_size}"]
    try:
        if "nccl" in str(dist.get_backend()):
            dist.barrier()
        else:
            dist.monitored_barrier(timeout=timedelta(seconds=_HEALTH_TIMEOUT_S / 2))
    except Exception as e:  # noqa: BLE001 - any failure means the group cannot serve the next test
        return [f"the barrier between tests failed: {type(e).__name__}: {e}"]
    return []


def _serve(rank: int, world_size: int, port: int, backend: str, inbox: Any, outbox: Any, log_path: str) -> None:
    """A rank of a pool: join the group, then run each test body sent to it until told to stop."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)  # the rank's own output goes to its log, whose tail a failure report shows
    os.dup2(log, 2)
    # the parent asks a rank that does not answer for its stacks
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    os.environ.update(forkserver.rank_environment())
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        import torch

        torch.set_num_threads(1)
        if "nccl" in backend:
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=600))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        outbox.put((rank, "error", traceback.format_exc()))
        return
    outbox.put((rank, "ready", []))
    state = _ProcessState()  # after the first message: the queue's feeder thread belongs to the rank, not a test
    while True:
        task = inbox.get()
        if task is None:
            break
        try:
            fn, args = pickle.loads(task)
            result = fn(rank, world_size, *args)
            # plain pickle bytes: a queue would share the result's tensors through file descriptors
            outbox.put((rank, "ok", pickle.dumps(result)))
        except BaseException:  # noqa: BLE001 - report every failure to the parent
            outbox.put((rank, "error", traceback.format_exc()))
        sys.stdout.flush()
        sys.stderr.flush()
        outbox.put((rank, "ready", state.restore() + _check_group(world_size)))
    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ the pool


class RankPool:
    """``world_size`` processes in one process group, running test bodies one test at a time."""

    def __init__(self, world_size: int) -> None:
        ctx = forkserver.context()
        self.world_size = world_size
        self.backend = process_group_backend(world_size)
        self.log_dir = Path(tempfile.mkdtemp(prefix=f"rlfunc-pool{world_size}-"))
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.SimpleQueue() for _ in range(world_size)]
        port = free_port()
        self.procs = [
            ctx.Process(
                target=_serve,
                args=(
                    r,
                    world_size,
                    port,
                    self.backend,
                    self.inboxes[r],
                    self.outbox,
                    str(self.log_dir / f"rank{r}.log"),
                ),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self.healthy = True
        problems = self._await_ready(timeout=120)
        if problems:
            self.close()
            raise RuntimeError(f"a pool of {world_size} ranks could not start:\n" + "\n".join(problems))

    def run(self, fn: Callable[..., Any], args: tuple, timeout: float, *, reuse: bool = True) -> list[Any]:
        """``fn(rank, world_size, *args)`` on every rank; the results by rank, or an error with every failed
        rank's traceback (the pool is then unhealthy and must be closed). ``reuse=False``: the pool is closed
        after this test, so its state is not checked."""
        task = pickle.dumps((fn, args))
        for inbox in self.inboxes:
            inbox.put(task)
        results: dict[int, Any] = {}
        errors: list[str] = []
        failed: set[int] = set()
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < self.world_size:
            wait = deadline - time.monotonic()
            if errors:
                wait = min(wait, _FAILURE_GRACE_S)  # its peers may wait on the failed rank forever
            try:
                rank, status, payload = self.outbox.get(timeout=max(wait, 0.01))
            except queue_module.Empty:
                self.healthy = False
                missing = sorted(set(range(self.world_size)) - set(results) - failed)
                if not errors:
                    errors.append(f"rank(s) {missing} did not finish within {timeout:.0f} s")
                errors.append(self._log_tails(missing))
                break
            if status == "ok":
                results[rank] = pickle.loads(payload)
            elif status == "error":
                errors.append(f"rank {rank} failed:\n{payload}")
                failed.add(rank)
                self.healthy = False
        if errors:
            raise RuntimeError("\n".join(errors))
        if not reuse:
            self.healthy = False
            return [results[r] for r in range(self.world_size)]
        problems = self._await_ready(timeout=_HEALTH_TIMEOUT_S)
        if problems:
            self.healthy = False
            warnings.warn(
                f"the pool of {self.world_size} ranks is replaced after this test: " + "; ".join(problems), stacklevel=3
            )
        return [results[r] for r in range(self.world_size)]

    def _await_ready(self, timeout: float) -> list[str]:
        problems, ready = [], set()
        deadline = time.monotonic() + timeout
        while len(ready) < self.world_size:
            try:
                rank, status, payload = self.outbox.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue_module.Empty:
                silent = sorted(set(range(self.world_size)) - ready)
                return problems + [f"rank(s) {silent} did not report ready", self._log_tails(silent)]
            if status == "error":
                problems.append(f"rank {rank}: {payload}")
                ready.add(rank)
            elif status == "ready":
                problems += [f"rank {rank}: {p}" for p in payload]
                ready.add(rank)
        return problems

    def _log_tails(self, ranks: list[int], chars: int = 3000) -> str:
        """The end of each rank's output, after its stacks (a rank that stopped answering is asked for them)."""
        for r in ranks:
            if self.procs[r].is_alive():
                os.kill(self.procs[r].pid, signal.SIGUSR2)
        time.sleep(1.0)
        tails = []
        for r in ranks:
            path = self.log_dir / f"rank{r}.log"
            text = path.read_text(errors="replace")[-chars:] if path.exists() else ""
            tails.append(f"--- rank {r}'s output (tail) ---\n{text}")
        return "\n".join(tails)

    def close(self) -> None:
        if self.healthy:
            for inbox in self.inboxes:
                inbox.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        self.outbox.close()


_pools: dict[int, RankPool] = {}


@atexit.register
def close_pools() -> None:
    for pool in _pools.values():
        pool.close()
    _pools.clear()


def run_distributed(
    fn: Callable[..., Any], world_size: int = 2, *args: Any, timeout: float = 300, fresh: bool = False
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` ranks of a process group; return results by rank.

    ``fn`` must be importable (a module-level function). A failure on any rank raises with its traceback.
    ``fresh=True``: a pool of its own, closed afterwards (for a test that breaks the group on purpose).
    """
    if fresh:
        pool = RankPool(world_size)
        try:
            return pool.run(fn, args, timeout, reuse=False)
        finally:
            pool.close()
    pool = _pools.get(world_size)
    if pool is None or not pool.healthy:
        if pool is not None:
            pool.close()
        pool = _pools[world_size] = RankPool(world_size)
    try:
        return pool.run(fn, args, timeout)
    finally:
        if not pool.healthy:
            pool.close()
            del _pools[world_size]
