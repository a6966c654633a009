"""What a recipe hands the loop: an :class:`Algorithm` (its advantages, its losses, whether it needs a critic or a
reference), and the policy-update helpers every algorithm shares (the configured policy loss resolved and checked,
the rollout-correction mask, when the rollout's log-probs may stand in for the trainer's).

The loop (:mod:`backends.loop.rl_loop`) owns the step; an algorithm is pure functions of the batch and of the state
it carries between steps (PPO's KL controller), passed explicitly:

    batch, state, metrics = algorithm.advantages(batch, state, env=env)     # on the ranks that hold the critic
    loss, metrics = algorithm.actor_loss(out, mini_batch, norms, seed=seed)  # inside the engine's update
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Protocol

import attrs
import torch

import rlfunc as rf
from backends.config import ConfigError, resolve_function
from backends.loop.actor_loss import make_actor_loss
from backends.loop.algorithm_checks import check_policy_loss
from backends.loop.vocabulary import PolicyUpdateConfig

__all__ = [
    "Algorithm",
    "max_context",
    "reads_behaviour_logprobs",
    "reject_mismatched_tokens",
    "resolve_policy_loss",
    "response_horizon",
    "rollout_logprobs_suffice",
    "stamp_policy_version",
    "zero_advantage_rows_are_skippable",
]


class Algorithm(Protocol):
    """An RL algorithm as the loop calls it."""

    title: str  #: the summary's and the curves' title
    uses_critic: bool  #: a value model is built, updated and checkpointed (its values reach ``advantages``)
    uses_reference: bool  #: the frozen starting policy is built (its log-probs reach ``advantages`` and the loss)
    #: the configured policy loss (rlfunc's uniform call), or None for an algorithm with a loss of its own: the loop
    #: reads its declared needs (behaviour log-probs) and whether zero-advantage rows may be skipped
    policy_loss: Callable | None
    #: ``(out, mini_batch, norms, *, seed) -> (loss, metrics)``: the actor's loss; ``seed`` is the step's
    actor_loss: Callable
    critic_loss: Callable | None  #: the critic's loss (with ``uses_critic``)

    def initial_state(self) -> dict[str, Any]:
        """What the algorithm carries from step to step (picklable: it is checkpointed); ``{}`` for none."""

    def advantages(
        self, batch: rf.RolloutBatch, state: dict[str, Any], *, env: Any
    ) -> tuple[rf.RolloutBatch, dict[str, Any], dict[str, float]]:
        """The batch with ``advantages`` and ``returns`` (and whatever else the losses read), the new state and
        metrics; ``env``: the ranks of the critic's pool (the world's when colocated), for batch-wide statistics."""


def resolve_policy_loss(algo: PolicyUpdateConfig) -> Callable:
    """The policy loss ``algo.policy_loss`` names (a built-in or a reference), checked with the loop's uniform call on
    a synthetic batch before any work (:mod:`backends.loop.algorithm_checks`)."""
    loss_aliases = {name.replace("_", "-"): name for name in rf.POLICY_LOSSES if "_" in name}  # clip-cov = clip_cov
    policy_loss = resolve_function(algo.policy_loss, rf.POLICY_LOSSES, "algo.policy_loss", aliases=loss_aliases)
    try:  # every engine records the behaviour (rollout) log-probs; the trainer supplies proximal and current ones
        rf.check_logprobs_supplied(policy_loss, available=("current", "proximal", "behaviour"))
    except ValueError as e:
        raise ConfigError(f"algo.policy_loss={algo.policy_loss!r}: {e}") from None
    # the synthetic batch has no reference log-probs: the KL term is the loop's, checked by its own tests
    loss = make_actor_loss(policy_loss, attrs.evolve(algo, kl_loss_coef=0.0), horizon=4)
    check_policy_loss(functools.partial(loss, seed=0), key="algo.policy_loss", spec=algo.policy_loss)
    return policy_loss


def zero_advantage_rows_are_skippable(algo: PolicyUpdateConfig, policy_loss: Callable | None) -> bool:
    """Whether zero-advantage rows add exactly nothing to the loss and its gradient: a built-in policy loss
    whose per-token term is a multiple of the advantage, and no KL or entropy term."""
    proportional = {rf.POLICY_LOSSES[name] for name in rf.ADVANTAGE_PROPORTIONAL_LOSSES}
    return (
        algo.skip_zero_advantage and policy_loss in proportional and algo.kl_loss_coef == 0 and algo.entropy_coef == 0
    )


def rollout_logprobs_suffice(algo: PolicyUpdateConfig, policy_loss: Callable | None, mini_batches: int) -> bool:
    """Whether the algorithm may take the rollout's log-probs as the old ones (where the weight bridge finds that both
    engines compute the same numbers): one update per batch and no trainer / rollout correction, which needs both."""
    if policy_loss is None:  # a loss of the recipe's own: its needs are not declared
        return False
    corrections = algo.rollout_is != "none" or algo.rollout_rs != "none" or reads_behaviour_logprobs(policy_loss)
    return algo.ppo_epochs == 1 and mini_batches == 1 and not corrections


def reads_behaviour_logprobs(policy_loss: Callable) -> bool:
    """Whether the loss reads the sampler's log-probs besides the trainer's (decoupled PPO), by its declared needs."""
    try:
        rf.check_logprobs_supplied(policy_loss, available=("current", "proximal"))
    except ValueError:
        return True
    return False


def reject_mismatched_tokens(
    batch: rf.RolloutBatch, algo: PolicyUpdateConfig
) -> tuple[rf.RolloutBatch, dict[str, torch.Tensor]]:
    """``algo.rollout_rs``: the loss mask without the tokens (or responses) whose trainer / rollout ratio is out of
    bounds, before the advantages and the update, so that the normalisers count only what stays."""
    if algo.rollout_rs == "none":
        return batch, {}
    keep, metrics = rf.rollout_rejection_mask(
        batch.old_logprobs,
        rollout_logprobs=batch.rollout_logprobs,
        response_mask=rf.loss_tokens(batch),
        level=algo.rollout_rs,
        upper=algo.rollout_rs_threshold,
        token_veto=algo.rollout_token_veto or None,
    )
    return batch.replace(loss_mask=keep), metrics


def stamp_policy_version(
    batch: rf.RolloutBatch, version: int, current: int | None = None
) -> tuple[rf.RolloutBatch, dict[str, torch.Tensor]]:
    """Every sampled token carries the policy version that produced it (the weights after ``version`` updates)
    and the staleness of the batch's tokens at this update (the trainer at version ``current``, default ``version``)
    is logged: ``staleness/min``, ``mean``, ``max`` and the histogram ``frac_0`` ... ``frac_ge_3`` (the share of the
    tokens of each age). A batch whose engine stamped its tokens already (partial rollouts: a row's tokens may come
    from several versions) keeps its versions; ``version`` is then its oldest."""
    if batch.policy_version is None:
        batch = batch.replace(policy_version=torch.full_like(batch.response_ids, version))
    _, metrics = rf.staleness(
        batch.policy_version,
        current_version=version if current is None else current,
        response_mask=rf.loss_tokens(batch),
    )
    return batch, {f"staleness/{k.removeprefix('staleness_')}": v for k, v in metrics.items()}


def max_context(cfg: Any) -> int:
    """The longest sequence the rollout engine holds: a prompt and its response, or a whole trajectory."""
    single = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    return single if cfg.rollout.multi_turn.max_turns == 1 else cfg.rollout.multi_turn.max_total_tokens


def response_horizon(cfg: Any) -> int:
    """The most response tokens a row can have (the constant of the seq-mean-token-sum-norm aggregation)."""
    multi = cfg.rollout.multi_turn
    return cfg.rollout.max_new_tokens if multi.max_turns == 1 else multi.max_total_tokens
