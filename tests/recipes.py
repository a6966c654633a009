"""What the end-to-end recipe tests share: the recipes, a launcher, a small arithmetic dataset, tiny-model overrides.

The launcher (:func:`run`, :func:`start`) runs a recipe's ``main`` on N local ranks, each a process forked from
the suite's forkserver (``tests/forkserver.py``) with the environment ``torchrun --standalone`` gives its
workers (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...; none for one rank, as ``python recipe.py`` has). Each
rank runs the recipe from ``main`` on in a process of its own, joins a real gloo group and exits with the
recipe's exit status; only the interpreter start-up and the imports are shared, which is most of what a tiny
run costs. As under torchrun, a rank that fails takes the job down: the other ranks are stopped. The tests of
torchrun's own behaviour (the signals it forwards, its restarts, its failure report) start the real one
(:data:`TORCHRUN`).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from experiments.tasks.arithmetic import ArithmeticTask, write_dataset
from tests import forkserver

ROOT = Path(__file__).resolve().parents[1]
GRPO = ROOT / "experiments" / "grpo.py"
PPO = ROOT / "experiments" / "ppo.py"
CUSTOM = ROOT / "experiments" / "custom_algorithm.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")

#: a one-layer model small enough for a few steps in seconds
TINY_MODEL = [
    "model.tiny.hidden_size=64",
    "model.tiny.num_heads=2",
    "model.tiny.num_kv_heads=1",
    "model.tiny.intermediate_size=96",
    "model.tiny.num_layers=1",
]


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def arithmetic_data(
    out_dir: Path,
    *,
    max_operand: int = 99,
    max_second_operand: int = 9,
    num_heldout: int = 8,
    sft_examples: int = 64,
    wrong_answer_fraction: float = 0.5,
) -> Path:
    """The arithmetic task's train / val / sft JSONL files in ``out_dir``."""
    task = ArithmeticTask(max_operand=max_operand, max_second_operand=max_second_operand, num_heldout=num_heldout)
    return write_dataset(out_dir, task, sft_examples=sft_examples, wrong_answer_fraction=wrong_answer_fraction)


def data_args(data_dir: Path, *, sft_steps: int = 4) -> list[str]:
    """Overrides that point a recipe at ``data_dir``'s files, with a short SFT stage on them."""
    args = [
        f"data.train_files={data_dir / 'train.jsonl'}",
        f"data.val_files={data_dir / 'val.jsonl'}",
        "data.max_prompt_length=16",
        "reward.fn=arithmetic",
        "rollout.max_new_tokens=6",
        "eval.n=1",
    ]
    if sft_steps:
        args += [
            f"sft.files={data_dir / 'sft.jsonl'}",
            f"sft.steps={sft_steps}",
            "sft.batch_size=8",
            "sft.optim.lr=3e-3",
        ]
    return args


def _exit_status(e: SystemExit) -> int:
    """The status the interpreter would exit with for ``SystemExit(e.code)`` (a message: printed, status 1)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _recipe_rank(module: str, argv: list[str], environ: dict[str, str], out_prefix: str) -> None:
    """One rank of a launched recipe: what ``python recipe.py argv`` does, from ``main`` on."""
    for fd, suffix in ((1, "out"), (2, "err")):
        os.dup2(os.open(f"{out_prefix}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    os.environ.update(environ)
    import torch

    torch.set_num_threads(1)  # what OMP_NUM_THREADS=1 gives a fresh interpreter
    recipe = importlib.import_module(module)
    sys.argv = [recipe.__file__, *argv]
    try:
        recipe.main(argv)
        status = 0
    except SystemExit as e:
        status = _exit_status(e)
    except BaseException:  # noqa: BLE001 - an uncaught exception: its traceback and status 1, as Python does
        traceback.print_exc()
        status = 1
    atexit._run_exitfuncs()  # what the recipe registered runs at exit, as in an interpreter of its own
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


class RecipeJob:
    """A recipe running on ``nproc`` forked ranks (:func:`start`)."""

    def __init__(self, recipe: Path, args: tuple[str, ...], nproc: int, environ: dict[str, str] | None) -> None:
        from tests.distributed import free_port

        ctx = forkserver.context()
        self.args = [str(recipe), *args]
        self.out_dir = Path(tempfile.mkdtemp(prefix="rlfunc-recipe-"))
        port = free_port()
        self.ranks = []
        for rank in range(nproc):
            rank_env = {**env(), **(environ or {})}
            if nproc > 1:
                rank_env.update(
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    WORLD_SIZE=str(nproc),
                    LOCAL_WORLD_SIZE=str(nproc),
                    GROUP_RANK="0",
                    ROLE_RANK=str(rank),
                    ROLE_WORLD_SIZE=str(nproc),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                    TORCHELASTIC_RESTART_COUNT="0",
                    TORCHELASTIC_MAX_RESTARTS="0",
                    TORCHELASTIC_RUN_ID="none",
                )
            module = ".".join(recipe.resolve().relative_to(ROOT).with_suffix("").parts)
            proc = ctx.Process(
                target=_recipe_rank, args=(module, list(args), rank_env, str(self.out_dir / f"rank{rank}"))
            )
            proc.start()
            self.ranks.append(proc)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.ranks]

    def poll(self) -> int | None:
        """The job's status once every rank has ended (the first failed rank's status, else 0), else None. A
        failed rank stops the others, as torchrun's agent does."""
        codes = [p.exitcode for p in self.ranks]
        if any(c not in (None, 0) for c in codes) and None in codes:
            self._stop_others()
            codes = [p.exitcode for p in self.ranks]
        if None in codes:
            return None
        return next((c for c in codes if c != 0), 0)  # -N: killed by signal N, as subprocess reports it

    def _stop_others(self, grace_s: float = 5.0) -> None:
        deadline = time.monotonic() + grace_s  # a peer whose collective failed exits by itself within the grace
        while time.monotonic() < deadline and any(p.exitcode is None for p in self.ranks):
            time.sleep(0.05)
        self.kill()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        for p in self.ranks:
            if p.exitcode is None:
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:
                    pass
        if sig == signal.SIGKILL:
            for p in self.ranks:
                p.join(timeout=30)

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        deadline = time.monotonic() + timeout
        while (status := self.poll()) is None:
            if time.monotonic() > deadline:
                self.kill()
                raise subprocess.TimeoutExpired(self.args, timeout, output=self._read("out"), stderr=self._read("err"))
            time.sleep(0.02)
        done = subprocess.CompletedProcess(self.args, status, stdout=self._read("out"), stderr=self._read("err"))
        shutil.rmtree(self.out_dir, ignore_errors=True)
        return done

    def output(self, suffix: str) -> str:
        """What the ranks have written so far to stdout (``"out"``) or stderr (``"err"``), rank by rank."""
        return self._read(suffix)

    def _read(self, suffix: str) -> str:
        parts = [(self.out_dir / f"rank{r}.{suffix}") for r in range(len(self.ranks))]
        return "".join(p.read_text(errors="replace") for p in parts if p.exists())


def start(recipe: Path, *args: str, nproc: int = 1, environ: dict[str, str] | None = None) -> RecipeJob:
    """Start the recipe's ``main`` on ``nproc`` forked ranks (see the module doc); ``environ`` adds to their
    environment. ``recipe`` is any script of this checkout whose module has ``main(argv)`` (a recipe, a test's worker
    script)."""
    return RecipeJob(recipe, args, nproc, environ)


def run(
    recipe: Path, *args: str, nproc: int = 1, timeout: float = 600, environ: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """The recipe on ``nproc`` forked ranks, to its end: exit status and every rank's stdout / stderr."""
    return start(recipe, *args, nproc=nproc, environ=environ).wait(timeout)


def run_torchrun(recipe: Path, *args: str, nproc: int = 1, timeout: float = 600) -> subprocess.CompletedProcess:
    """The recipe as a plain script (``nproc=1``) or under the real ``torchrun --nproc_per_node nproc``."""
    launcher = [sys.executable] if nproc == 1 else [str(TORCHRUN), "--standalone", "--nproc_per_node", str(nproc)]
    return subprocess.run([*launcher, str(recipe), *args], env=env(), capture_output=True, text=True, timeout=timeout)


def the_run_dir(root: Path, name: str) -> Path:
    (run_dir,) = list(root.glob(f"{name}-*"))
    return run_dir


def metrics(run_dir: Path, *, rl_only: bool = True) -> list[dict]:
    """``metrics.jsonl``'s rows (by default the RL steps' only: not the SFT stage's, not the evaluations' rows)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if not rl_only:
        return rows
    return [r for r in rows if r["step"] > 0 and "step_time_s" in r]
