"""Step records: everything the training half of a step reads, saved so that the step can be run again.

With ``debug.record_steps=[812]`` or ``debug.record_every=N`` the colocated loop saves, before it trains on step
``s``, into ``runs/<run>/records/step_<s>/``:

- ``weights/step_<s-1>/``: a checkpoint of every trained role as the step starts (weights, optimizer state, every
  rank's RNG) and the algorithm's state (PPO's KL controller), written by the checkpoint code (atomic, checked);
- ``batch_rank<r>.pt``: rank ``r``'s sampled and scored batch, as the step hands it to the learner (tensors only,
  loaded with ``weights_only=True``);
- ``record.json``: the recipe, its command line, the world size, each rank's loss seed and whether the rollout's
  log-probs stood in for the trainer's.

:mod:`backends.loop.replay` runs the step again from a record and compares it with the run's fingerprints. A
record costs a checkpoint's size (the weights and the optimizer state) plus the batch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist

import rlfunc as rf
from backends.checkpoint.dcp import save_checkpoint
from backends.distributed import watchdog

__all__ = ["StepRecorder", "load_batch", "read_record", "record_dir"]


def record_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "records" / f"step_{step}"


@attrs.frozen
class StepRecorder:
    """Which steps to record and what a record says about the run (the same on every rank)."""

    run_dir: Path
    steps: tuple[int, ...] = ()  #: ``debug.record_steps``
    every: int = 0  #: ``debug.record_every`` (0: none)
    recipe: str = ""  #: the recipe's module (``experiments.grpo``)
    argv: tuple[str, ...] = ()  #: its command line
    must_match: dict = attrs.field(factory=dict)  #: the run's config, recorded with the weights
    total_steps: int = 0  #: the run's RL steps (its learning-rate schedule's length)

    def wants(self, step: int) -> bool:
        return step in self.steps or bool(self.every and step % self.every == 0)

    def save(self, step: int, learner: Any, batch: rf.RolloutBatch | None, *, seed: int, on_policy: bool) -> Path:
        """Record ``step`` (a collective of every rank): the roles' states before it, each rank's batch and seed."""
        where = record_dir(self.run_dir, step)
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        with watchdog.phase("checkpoint", step=step, op=f"record step {step} ({where})"):
            save_checkpoint(
                where / "weights",
                step - 1,
                learner.states(),
                {"algorithm_state": learner.state},
                config=self.must_match,
            )
            if batch is not None:
                fields = {f.name: getattr(batch, f.name) for f in attrs.fields(type(batch))}
                torch.save({k: v for k, v in fields.items() if v is not None}, where / f"batch_rank{rank}.pt")
            seeds = [None] * world
            if world > 1:
                dist.all_gather_object(seeds, seed)
            else:
                seeds = [seed]
            if rank == 0:
                record = {
                    "step": step,
                    "recipe": self.recipe,
                    "argv": list(self.argv),
                    "world_size": world,
                    "total_steps": self.total_steps,
                    "seeds": seeds,
                    "on_policy": on_policy,
                }
                (where / "record.json").write_text(json.dumps(record, indent=2))
            if world > 1:
                dist.barrier()
        return where


def read_record(run_dir: str | Path, step: int) -> dict:
    """A step's ``record.json``; a missing record is an error naming the keys that write one."""
    path = record_dir(run_dir, step) / "record.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: step {step} was not recorded (run with debug.record_steps=[{step}] or debug.record_every=N)"
        )
    return json.loads(path.read_text())


def load_batch(run_dir: str | Path, step: int, rank: int) -> rf.RolloutBatch:
    """Rank ``rank``'s recorded batch of ``step``."""
    fields = torch.load(record_dir(run_dir, step) / f"batch_rank{rank}.pt", weights_only=True)
    return rf.RolloutBatch(**fields)
