"""The actor's loss, the same in every recipe that trains a policy: the configured policy loss through rlfunc's
uniform call (rlfunc.policy_losses' docstring), the rollout importance weights, the KL loss to the reference and
the entropy bonus. Nothing here tests a loss's name: every built-in, and a user's own loss, gets the same call
with its own knobs (``algo.policy_loss_args.<name>``) and the step's seed.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import rlfunc as rf
from backends.loop.vocabulary import PolicyUpdateConfig, loss_knobs

__all__ = ["actor_loss", "make_actor_loss", "loss_seed"]


def loss_seed(run_seed: int, step: int, *, replica: int) -> int:
    """The seed a random loss (clip_cov) gets at ``step`` on data-parallel ``replica``: different per step and per
    replica, and a function of the step alone, so a resumed run draws the keys an uninterrupted one draws. The
    micro- and mini-batches of one step share it (each call draws over its own rows)."""
    return ((run_seed * 1_000_003 + step) * 65_537 + replica) % 2**62


def make_actor_loss(policy_loss: Callable, algo: PolicyUpdateConfig, *, horizon: int) -> Callable:
    """:func:`actor_loss` bound to the configured loss and its knobs; the loop adds ``seed=`` each step."""
    return functools.partial(
        actor_loss,
        policy_loss=policy_loss,
        knobs=loss_knobs(algo.policy_loss_args, algo.policy_loss),
        algo=algo,
        horizon=horizon,
    )


def actor_loss(
    out: Any,
    mb: rf.RolloutBatch,
    norms: rf.Normalizers,
    *,
    policy_loss: Callable,
    knobs: dict[str, Any],
    algo: PolicyUpdateConfig,
    horizon: int,
    seed: int,
) -> tuple[Any, dict[str, Any]]:
    """The policy loss (weighted by truncated importance weights with ``algo.rollout_is``), plus ``kl_loss_coef``
    times a KL estimate to the reference, minus ``entropy_coef`` times the policy's entropy. Losses count the loss
    tokens (``rf.loss_tokens``); the engine passes the global ``norms``."""
    mask = rf.loss_tokens(mb)
    is_weights, is_metrics = None, {}
    if algo.rollout_is != "none":  # trainer / rollout log-prob mismatch: truncated importance weights
        is_weights, is_metrics = rf.rollout_is_weights(
            mb.old_logprobs,
            rollout_logprobs=mb.rollout_logprobs,
            response_mask=mask,
            level=algo.rollout_is,
            upper=algo.rollout_is_cap,
        )
    loss, metrics = policy_loss(
        out.logprobs,
        old_logprobs=mb.old_logprobs,
        advantages=mb.advantages,
        response_mask=mask,
        behaviour_logprobs=mb.rollout_logprobs,
        is_weights=is_weights,
        agg=algo.agg,
        norms=norms,
        horizon=horizon,
        seed=seed,
        **knobs,
    )
    metrics = {**metrics, **is_metrics}
    if algo.kl_loss_coef > 0:
        kl, _ = rf.kl_loss(
            out.logprobs,
            ref_logprobs=mb.ref_logprobs,
            mask=mask,
            kind=algo.kl_loss_kind,
            agg=algo.agg,
            norms=norms,
            horizon=horizon,
        )
        loss = loss + algo.kl_loss_coef * kl
        metrics["kl_loss"] = kl.detach()
    if algo.entropy_coef > 0:  # exploration bonus: the entropy is differentiable (rlfunc.entropy_from_logits)
        loss = loss - algo.entropy_coef * rf.aggregate(out.entropy, mask, mode=algo.agg, norms=norms, horizon=horizon)
    if out.entropy is not None:
        metrics["entropy"] = rf.aggregate(out.entropy.detach(), mask, mode="token-mean", norms=norms)
    return loss, metrics
