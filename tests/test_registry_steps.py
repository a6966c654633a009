"""Every built-in policy loss and group estimator through the GRPO step, and PPO with every value-loss and KL option,
on 1 process and on 2 gloo ranks.

The step is the loop's own: :class:`backends.loop.learner.Learner` (old log-probs, reference log-probs, values,
advantages by the recipe's algorithm, critic and actor updates with the step's seed) on the FSDP engine, with the
recipes' algorithms as their start-up builds them (``grpo.group_relative``, ``ppo.actor_critic``: the estimator and
the loss resolved and called once on a synthetic batch). Each run builds the tiny actor, reference and critic once and
loops over the entries inside, so a new registry entry costs one step, not one process start; a failure names the
entry.
"""

from __future__ import annotations

import attrs
import pytest
import torch

import rlfunc as rf
from backends.models import TinyModelConfig, write_tiny_model
from tests.distributed import run_distributed

TINY = TinyModelConfig(
    hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=96, max_position_embeddings=64, seed=5
)
ROWS, PROMPT, RESPONSE, GROUP = 8, 3, 5, 4  # per rank: 2 groups of 4 samples


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("registry") / "model", TINY))


def step_batch(rank: int) -> rf.RolloutBatch:
    """A scored batch as the GRPO loop holds it before the update: groups of ``GROUP`` with mixed scores."""
    g = torch.Generator().manual_seed(100 + rank)
    response_mask = torch.arange(RESPONSE)[None, :] < torch.tensor([5, 4, 3, 5, 2, 5, 4, 1])[:, None]
    logprobs = -torch.rand(ROWS, RESPONSE, generator=g) * 2
    return rf.RolloutBatch(
        prompt_ids=torch.randint(4, 60, (ROWS, PROMPT), generator=g),
        prompt_mask=torch.ones(ROWS, PROMPT, dtype=torch.bool),
        response_ids=torch.randint(4, 60, (ROWS, RESPONSE), generator=g),
        response_mask=response_mask,
        group_ids=torch.arange(ROWS) // GROUP,
        scores=torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.25]),
        rollout_logprobs=logprobs,
    )


def _params(state) -> torch.Tensor:
    return torch.cat(
        [
            p.detach().full_tensor().flatten() if hasattr(p, "full_tensor") else p.detach().flatten()
            for p in state.module.parameters()
        ]
    )


def _learner(rank: int, model_dir: str):
    """The loop's learner over a colocated placement with the tiny actor, reference and critic (no algorithm yet)."""
    from backends.distributed.placement import PlacementConfig, build_placement
    from backends.distributed.setup import init_distributed
    from backends.loop.learner import Learner
    from backends.training.engines import select_engine
    from backends.training.fsdp import FSDPConfig
    from backends.training.optim import OptimConfig
    from backends.training.roles import Roles

    env = init_distributed()
    engine = select_engine("fsdp", fsdp=FSDPConfig(micro_batch_size=4))
    optim = OptimConfig(lr=1e-2, weight_decay=0.0)
    roles = Roles(
        placement=build_placement(PlacementConfig(), env),
        actor_engine=engine,
        critic_engine=engine,
        actor=engine.build_actor(model_dir, env, optim),
        critic=engine.build_critic(model_dir, env, optim, seed=1),
        reference=engine.build_reference(model_dir, env),
        reference_engine=engine,
        reference_rows_are_replicas=True,
    )
    return Learner(cfg=None, algorithm=None, roles=roles, state={}, mini_batches=1, skip_zero_rows=False)


def _step(learner, cfg, algorithm, rank: int, name: str, expected_metrics: set[str]):
    """One step of ``algorithm`` through the learner; the entry's name in any failure. Returns the batch (with its
    advantages) and the metrics."""
    from backends.loop.actor_loss import loss_seed
    from backends.loop.algorithm import zero_advantage_rows_are_skippable

    learner.cfg, learner.algorithm, learner.state = cfg, algorithm, algorithm.initial_state()
    learner.skip_zero_rows = zero_advantage_rows_are_skippable(cfg.algo, algorithm.policy_loss)
    actor_before, critic_before = _params(learner.roles.actor), _params(learner.roles.critic)
    batch, metrics = learner.train(step_batch(rank), 1, seed=loss_seed(cfg.seed, 1, replica=rank))
    assert torch.isfinite(batch.advantages).all() and torch.isfinite(batch.returns).all(), f"{name}: advantages"
    assert torch.isfinite(torch.tensor(float(metrics["loss"]))), f"{name}: loss {metrics['loss']}"
    assert not torch.equal(actor_before, _params(learner.roles.actor)), f"{name}: no actor parameter changed"
    critic_changed = not torch.equal(critic_before, _params(learner.roles.critic))
    assert critic_changed == algorithm.uses_critic, f"{name}: the critic changed: {critic_changed}"
    assert expected_metrics <= set(metrics), f"{name}: metrics {sorted(metrics)} lack {expected_metrics - set(metrics)}"
    return batch, metrics


def grpo_every_entry(rank: int, world_size: int, model_dir: str) -> list[str]:
    from experiments import grpo

    learner = _learner(rank, model_dir)
    done = []
    estimators, _ = grpo.group_estimators()
    for name in [*rf.POLICY_LOSSES, *(f"estimator:{e}" for e in estimators)]:
        loss_name, estimator_name = (name, "grpo") if ":" not in name else ("ppo", name.split(":")[1])
        # a KL term and an entropy bonus on every entry: the recipe's whole loss, not the policy term alone
        algo = grpo.AlgoConfig(
            policy_loss=loss_name,
            estimator=estimator_name,
            kl_loss_coef=0.01,
            entropy_coef=0.01,
            policy_loss_args=grpo.GRPO_LOSS_ARGS,
        )
        cfg = grpo.Config(algo=algo, rollout=attrs.evolve(grpo.Config().rollout, n=GROUP, max_new_tokens=RESPONSE))
        _step(learner, cfg, grpo.group_relative(cfg), rank, name, {"loss", "grad_norm", "kl_loss", "entropy"})
        done.append(name)
    return done


def ppo_every_option(rank: int, world_size: int, model_dir: str) -> list[str]:
    from experiments import ppo

    learner = _learner(rank, model_dir)
    options = [{"kl_in_reward": False}]
    options += [{"kl_reward_kind": kind} for kind in rf.KL_KINDS]
    options += [{"kl_ctrl": "adaptive"}, {"kl_in_reward": False, "kl_loss_coef": 0.01}]
    options += [{"kl_loss_coef": 0.01, "kl_loss_kind": kind} for kind in rf.KL_KINDS]
    options += [{"cliprange_value": c} for c in (0.0, 0.2, 10.0)]
    done = []
    for option in options:
        name = ",".join(f"{k}={v}" for k, v in option.items())
        rollout = attrs.evolve(ppo.Config().rollout, n=GROUP, max_new_tokens=RESPONSE)
        cfg = ppo.Config(algo=attrs.evolve(ppo.PPO_ALGO, **option), prompts_per_step=2 * world_size, rollout=rollout)
        algorithm = ppo.actor_critic(cfg)
        expected = {"loss", "clip_frac", "dual_clip_frac", "entropy", "critic/loss", "critic/vf_clipfrac"}
        expected |= {"kl_loss"} if cfg.algo.kl_loss_coef else set()
        expected |= {"kl_reward", "kl_coef"} if cfg.algo.kl_in_reward else set()
        _step(learner, cfg, algorithm, rank, name, expected)
        if cfg.algo.kl_ctrl == "adaptive":  # the controller moved its beta, and the learner carries it
            assert learner.state["kl_ctrl"]["beta"] != cfg.algo.kl_reward_coef, name
        done.append(name)
    return done


def test_every_policy_loss_and_estimator_through_the_grpo_step(model_dir):
    done = run_distributed(grpo_every_entry, 1, model_dir, timeout=240)[0]
    assert set(rf.POLICY_LOSSES) <= set(done) and "estimator:rloo_vectorized" in done


def test_ppo_with_every_value_loss_and_kl_option(model_dir):
    done = run_distributed(ppo_every_option, 1, model_dir, timeout=240)[0]
    assert "kl_ctrl=adaptive" in done and f"kl_loss_coef=0.01,kl_loss_kind={rf.KL_KINDS[-1]}" in done


@pytest.mark.distributed
def test_every_entry_on_two_ranks(model_dir):
    grpo_done = run_distributed(grpo_every_entry, 2, model_dir, timeout=300)
    ppo_done = run_distributed(ppo_every_option, 2, model_dir, timeout=300)
    assert grpo_done[0] == grpo_done[1] and ppo_done[0] == ppo_done[1]


def test_a_random_loss_draws_other_tokens_each_step_and_the_same_on_resume():
    """clip_cov with the loop's seed: steps 1 and 2 cut the gradient of different tokens; step 2 computed again (as a
    resumed run computes it) cuts the same ones. Cheap: one 4 x 16 loss per call, no model."""
    from backends.loop.actor_loss import loss_seed

    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 16, generator=g)
    advantages, mask = torch.randn(4, 16, generator=g), torch.ones(4, 16, dtype=torch.bool)

    def cut_tokens(step: int) -> torch.Tensor:
        logprobs = old.clone().requires_grad_(True)
        loss, _ = rf.POLICY_LOSSES["clip_cov"](
            logprobs,
            old_logprobs=old,
            advantages=advantages,
            response_mask=mask,
            clip_cov_ratio=0.25,
            clip_cov_lb=-1e9,
            clip_cov_ub=1e9,
            seed=loss_seed(0, step, replica=0),
        )
        (grad,) = torch.autograd.grad(loss, logprobs)
        return grad == 0

    first, second = cut_tokens(1), cut_tokens(2)
    assert first.sum() == second.sum() == 16  # a quarter of the 64 tokens each step
    assert not torch.equal(first, second)
    assert torch.equal(second, cut_tokens(2))
    assert loss_seed(0, 2, replica=0) != loss_seed(0, 2, replica=1)
