"""Every built-in policy loss and group estimator through the GRPO step, and PPO with every value-loss and KL option,
on 1 process and on 2 gloo ranks.

The step is the recipes' own code: GRPO's ``resolve_algorithm`` / ``check_algorithm`` (the start-up checks), the
estimator called as its loop calls it, ``make_actor_loss`` with the step's seed and the FSDP engine's update; PPO's
``advantages`` (token rewards, in-reward KL and its controller, GAE, whitening over the ranks), the critic's
``value_loss_fn`` and the same actor loss. Each run builds the tiny actor, reference and critic once and loops over
the entries inside, so a new registry entry costs one update, not one process start; a failure names the entry.
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


def _update(engine, actor, batch, loss_fn, name, expected_metrics):
    """One update; the entry's name in any failure. Returns the new state."""
    before = _params(actor)
    actor, metrics = engine.update(actor, batch, loss_fn, with_entropy=True)
    assert torch.isfinite(torch.tensor(float(metrics["loss"]))), f"{name}: loss {metrics['loss']}"
    assert not torch.equal(before, _params(actor)), f"{name}: no parameter changed"
    assert expected_metrics <= set(metrics), f"{name}: metrics {sorted(metrics)} lack {expected_metrics - set(metrics)}"
    return actor


def grpo_every_entry(rank: int, world_size: int, model_dir: str) -> list[str]:
    from backends.distributed.setup import init_distributed
    from backends.loop.actor_loss import loss_seed, make_actor_loss
    from backends.training.engines import select_engine
    from backends.training.fsdp import FSDPConfig
    from backends.training.optim import OptimConfig
    from experiments import grpo

    env = init_distributed()
    engine = select_engine("fsdp", fsdp=FSDPConfig(micro_batch_size=4))
    actor = engine.build_actor(model_dir, env, OptimConfig(lr=1e-2, weight_decay=0.0))
    reference = engine.build_reference(model_dir, env)
    batch = step_batch(rank)
    batch = batch.replace(
        old_logprobs=engine.compute_logprobs(actor, batch).logprobs,
        ref_logprobs=engine.compute_logprobs(reference, batch).logprobs,
    )
    done = []
    estimators, _ = grpo.group_estimators()
    for name in [*rf.POLICY_LOSSES, *(f"estimator:{e}" for e in estimators)]:
        loss_name, estimator_name = (name, "grpo") if ":" not in name else ("ppo", name.split(":")[1])
        # a KL term and an entropy bonus on every entry: the recipe's whole loss, not the policy term alone
        cfg = grpo.Config(
            algo=grpo.AlgoConfig(
                policy_loss=loss_name,
                estimator=estimator_name,
                kl_loss_coef=0.01,
                entropy_coef=0.01,
                policy_loss_args=grpo.GRPO_LOSS_ARGS,
            )
        )
        estimator, estimator_kwargs, policy_loss = grpo.resolve_algorithm(cfg.algo)
        grpo.check_algorithm(
            attrs.evolve(cfg, rollout=attrs.evolve(cfg.rollout, n=GROUP)), estimator, estimator_kwargs, policy_loss
        )
        adv, ret = estimator(
            batch.scores, group_ids=batch.group_ids, response_mask=rf.loss_tokens(batch), **estimator_kwargs
        )
        assert torch.isfinite(adv).all(), f"{name}: advantages {adv}"
        loss_fn = make_actor_loss(policy_loss, cfg.algo, horizon=RESPONSE)
        actor = _update(
            engine,
            actor,
            batch.replace(advantages=adv, returns=ret),
            lambda out, mb, norms, f=loss_fn: f(out, mb, norms, seed=loss_seed(cfg.seed, 1, replica=rank)),
            name,
            {"loss", "grad_norm", "kl_loss", "entropy"},
        )
        done.append(name)
    return done


def ppo_every_option(rank: int, world_size: int, model_dir: str) -> list[str]:
    from backends.distributed.setup import init_distributed
    from backends.loop.actor_loss import loss_seed, make_actor_loss
    from backends.training.engines import select_engine
    from backends.training.fsdp import FSDPConfig, value_loss_fn
    from backends.training.optim import OptimConfig
    from experiments import ppo

    env = init_distributed()
    engine = select_engine("fsdp", fsdp=FSDPConfig(micro_batch_size=4))
    optim = OptimConfig(lr=1e-2, weight_decay=0.0)
    actor = engine.build_actor(model_dir, env, optim)
    reference = engine.build_reference(model_dir, env)
    critic = engine.build_critic(model_dir, env, optim, seed=1)
    batch = step_batch(rank)
    batch = batch.replace(
        old_logprobs=engine.compute_logprobs(actor, batch).logprobs,
        ref_logprobs=engine.compute_logprobs(reference, batch).logprobs,
    )
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
        policy_loss = ppo.resolve_policy_loss(cfg.algo)
        values = engine.compute_values(critic, batch)
        scored, kl_ctrl, kl_stats = ppo.advantages(
            batch.replace(values=values, old_values=values), ppo.kl_controller(cfg.algo), cfg, env
        )
        assert torch.isfinite(scored.advantages).all() and torch.isfinite(scored.returns).all(), name
        if cfg.algo.kl_in_reward:
            assert {"kl_reward", "kl_coef"} <= set(kl_stats), f"{name}: {kl_stats}"
            assert kl_ctrl.beta != cfg.algo.kl_reward_coef or cfg.algo.kl_ctrl == "fixed", name
        before = _params(critic)
        critic, critic_metrics = engine.update(
            critic, scored, value_loss_fn(clip_range=cfg.algo.cliprange_value, horizon=RESPONSE)
        )
        assert torch.isfinite(torch.tensor(float(critic_metrics["loss"]))), f"{name}: critic loss"
        assert not torch.equal(before, _params(critic)), f"{name}: the critic did not change"
        assert {"vf_clipfrac", "vpred_mean"} <= set(critic_metrics), f"{name}: {sorted(critic_metrics)}"
        loss_fn = make_actor_loss(policy_loss, cfg.algo, horizon=RESPONSE)
        expected = {"loss", "clip_frac", "dual_clip_frac", "entropy", *(["kl_loss"] if cfg.algo.kl_loss_coef else [])}
        actor = _update(
            engine,
            actor,
            scored,
            lambda out, mb, norms, f=loss_fn: f(out, mb, norms, seed=loss_seed(cfg.seed, 1, replica=rank)),
            name,
            expected,
        )
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
