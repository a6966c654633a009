"""Partial rollouts in the split loop (``offpolicy.partial_rollouts=true``, ``offpolicy.mode=bounded``): a rollout
rank's generation of a batch takes newer weights at chunk boundaries instead of finishing under the weights it
started with, and every token carries the version that sampled it (``RolloutBatch.policy_version (b t)``), its
behaviour log-prob under those weights, so the trainer's staleness metrics and the off-policy corrections see each
token's own version (AReaL's interruptible generation, verl's partial rollout).

**Schedule.** The batch of step ``s`` starts with the version :func:`backends.loop.split.sampling_version` gives
it; at each chunk boundary (every ``offpolicy.partial_chunk_tokens`` decode iterations of the engine) it takes the
next version, one a boundary, up to ``s - 1``: the trainer's version when it updates on that batch, so no token is
older than the bound allows and none is newer than the trainer. The versions come in a fixed order at fixed
points of the generation (never "whatever arrived last"), so a run is reproducible, and with
``max_staleness=0`` (nothing to take: the batch starts at ``s - 1``) it is the same run as without them. A
boundary waits for its version when the trainer has not pushed it yet.

The engine's side is :mod:`backends.rollout.scheduler` (the native engine's continuous batcher): at a boundary
with new weights it computes its unfinished rows' caches again from their prompts and tokens so far.
"""

from __future__ import annotations

from typing import Any

import attrs

from backends.config import ConfigError
from backends.rollout.api import rollout_engine_spec

__all__ = ["NewerWeightsAtBoundaries", "StoppedAtBoundary", "check_partial_rollouts"]


def check_partial_rollouts(cfg: Any) -> None:
    """Refuse, before any model is built, what partial rollouts do not do (yet)."""
    off, rollout = cfg.offpolicy, cfg.rollout
    reason = rollout_engine_spec(rollout).partial_rollouts(rollout)
    if reason is not None:
        raise ConfigError(f"offpolicy.partial_rollouts=true with rollout.engine={rollout.engine}: {reason}")
    refused = {
        # every rollout rank would take each version at a boundary of its own generation, while the pool's
        # collectives (an evaluation, dynamic sampling, a dump) come in step order: the ranks would wait on each other
        f"offpolicy.rollout_ranks={off.rollout_ranks} (one rollout rank)": off.rollout_ranks > 1,
        "multi-turn rollouts (rollout.multi_turn.max_turns > 1) or rollout.agent (single-turn sampling)": (
            rollout.multi_turn.max_turns > 1 or rollout.agent is not None
        ),
    }
    for what, bad in refused.items():
        if bad:
            raise ConfigError(f"offpolicy.partial_rollouts=true does not support {what} yet")


class StoppedAtBoundary(Exception):
    """The run stops (SIGTERM, a deadline) at a version a generation took at a chunk boundary: its batch is dropped."""


@attrs.define
class NewerWeightsAtBoundaries:
    """Partial rollouts on a rollout rank (the caller's side of :class:`backends.rollout.scheduler.WeightUpdates`):
    at each chunk boundary of the generation of batch ``step`` the engine takes the next version of the weights, one
    version a boundary on this fixed schedule (so a run is reproducible), never past ``newest = step - 1``, the
    trainer's version at that batch's update (so every token stays within the bound). Each version is received as
    between steps (:meth:`RolloutRank.receive_through`: with its evaluation and the checkpoint / stop check the
    trainers make after pushing it, in the same order)."""

    rank: Any  #: the :class:`backends.loop.split.RolloutRank` whose engine takes the weights
    newest: int
    chunk_tokens: int
    loads: int = 0  #: versions taken at boundaries during this step

    def version(self) -> int:
        return self.rank.received

    def at_boundary(self) -> Any:
        if self.rank.received >= self.newest:
            return None
        if self.rank.receive_through(self.rank.received + 1):
            raise StoppedAtBoundary
        self.loads += 1
        return self.rank.rollout
