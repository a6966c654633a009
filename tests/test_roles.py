"""backends.training.roles.Roles with stand-in engines: each phase runs where its role lives, passes
through elsewhere, and is timed where it ran. (The recipes' runs cover real engines and both placements:
tests/test_recipe_ppo.py, tests/test_placement.py.)"""

from __future__ import annotations

import torch

import rlfunc as rf
from backends.distributed.placement import Placement
from backends.distributed.setup import DistEnv
from backends.training.engine import TrainEngine
from backends.training.roles import Roles


class _CountingEngine(TrainEngine):
    """A stand-in TrainEngine whose state is a number: each update adds 1 and is recorded in ``calls``."""

    name, runs_on_a_pool, trains_lora, exports_orbax = "fake", True, False, False

    def __init__(self, role: str, calls: list) -> None:
        self.role, self.calls, self.config = role, calls, None

    def update(self, state, batch, loss_fn, *, with_entropy=False, skip_rows=None):
        kwargs = {"with_entropy": True} if with_entropy else {}
        self.calls.append((self.role, "update", batch.prompt_ids.shape[0], kwargs))
        return state + 1, {"loss": float(state)}

    def compute_logprobs(self, state, batch, *, with_entropy=False, micro_batch_size=None):
        return type("Out", (), {"logprobs": torch.full(batch.response_ids.shape, -1.0)})()

    def compute_values(self, state, batch, *, micro_batch_size=None):
        return torch.full(batch.response_ids.shape, 0.5)

    def full_state_dict(self, state, *, dtype=None, bucket_mb=None):
        return [("w", torch.tensor(float(state)))]

    def data_parallel(self, state):
        return 0, 1

    def share_batch(self, state, batch):
        return batch

    def checkpoint_name(self, state, role):
        return f"{role}_shard0"


def _engine(name: str, calls: list) -> TrainEngine:
    return _CountingEngine(name, calls)


def _placement(mode: str, pools_here: tuple[str, ...]) -> Placement:
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    return Placement(
        mode=mode,
        world=env,
        pools={"actor": (0,), "critic": (0,) if mode == "colocated" else (1,)},
        meshes={},
        envs={pool: env for pool in pools_here},
    )


def _batch(rows: int = 4) -> rf.RolloutBatch:
    return rf.RolloutBatch(
        prompt_ids=torch.ones(rows, 2, dtype=torch.long),
        prompt_mask=torch.ones(rows, 2, dtype=torch.bool),
        response_ids=torch.ones(rows, 3, dtype=torch.long),
        response_mask=torch.ones(rows, 3, dtype=torch.bool),
        group_ids=torch.arange(rows),
    )


def test_colocated_roles_do_every_phase_on_this_rank():
    calls = []
    roles = Roles(
        _placement("colocated", ("actor", "critic")),
        _engine("actor", calls),
        _engine("critic", calls),
        actor=0,
        critic=10,
    )
    batch = roles.old_logprobs(_batch())
    assert torch.equal(batch.old_logprobs, torch.full((4, 3), -1.0))
    critic_batch = roles.compute_values(roles.reference_logprobs(roles.to_critic(batch)))  # no reference: unchanged
    assert critic_batch.ref_logprobs is None and torch.equal(critic_batch.old_values, critic_batch.values)
    assert roles.to_actor(critic_batch, like=batch) is critic_batch
    critic_metrics = roles.update_critic(critic_batch, None, epochs=2, mini_batches=2)
    actor_metrics = roles.update_actor(batch, None, epochs=1, mini_batches=4, with_entropy=True)
    assert [m["loss"] for m in critic_metrics] == [10.0, 11.0, 12.0, 13.0] and roles.critic == 14
    assert len(actor_metrics) == 4 and roles.actor == 4
    assert calls[-1] == ("actor", "update", 1, {"with_entropy": True})  # 4 mini-batches of 1 row
    assert roles.run_on("actor", "rollout", lambda x: x + 1, 1) == 2
    assert dict(roles.actor_weights())["w"].item() == 4.0
    times = roles.step_times()
    assert set(times) == {
        "old_logprob",
        "to_critic_pool",
        "values",
        "to_actor_pool",
        "critic_update",
        "actor_update",
        "rollout",
    }
    assert roles.step_times() == {}  # reset for the next step
    assert roles.checkpoint_states() == {"actor_shard0": 4, "critic_shard0": 14}
    roles.load_checkpoint_states({"actor_shard0": 40, "critic_shard0": 140})
    assert (roles.actor, roles.critic) == (40, 140)


def test_a_rank_without_the_actor_passes_the_actor_phases_through():
    calls = []
    roles = Roles(_placement("split", ("critic",)), _engine("actor", calls), _engine("critic", calls), critic=0)
    assert not roles.on_actor and roles.on_critic and roles.env("actor") is None
    assert roles.old_logprobs(None) is None
    assert roles.run_on("actor", "rollout", lambda: 1 / 0, otherwise="skipped") == "skipped"
    assert roles.update_actor(_batch(), None, epochs=1, mini_batches=1) == [] and roles.actor_weights() is None
    assert len(roles.update_critic(_batch(), None, epochs=1, mini_batches=1)) == 1
    assert roles.checkpoint_states() == {"critic_shard0": 1}
    assert set(roles.times) == {"critic_update"}  # only the work this rank did is timed
    assert roles.pool_size("actor") == roles.pool_size("reference") == 1
