"""GRPO (and the other group-relative estimators and policy losses of rlfunc) on your data, your reward, your model.

Run:  python experiments/grpo.py data.train_files=train.jsonl data.val_files=val.jsonl reward.fn=my_reward.py:score
      torchrun --standalone --nproc_per_node 2 experiments/grpo.py ...          (FSDP2 over 2 ranks)
      ... model.path=/path/to/hf_dir            a local Llama / Qwen2 checkpoint (default: a tiny random model)
      ... preset=demo/arithmetic                the demo (`make demo` writes its data first)
      --help lists every key with its default and meaning.

Data: JSONL, parquet or a saved datasets dir; ``data.prompt_key`` holds a string or chat messages (rendered by
the tokenizer's chat template), ``data.answer_key`` the ground truth, every other column reaches the reward.
Reward: ``reward.fn`` names built-ins (exact, arithmetic, gsm8k, boxed, math, format) or your own
``fn(response, ground_truth, **columns) -> float | dict`` as ``package.module:function`` / ``file.py:function``.
Algorithm pieces by name or reference, resolved at start-up (a misspelling fails before any work):
      ... algo.estimator=rloo algo.policy_loss=gspo algo.estimator=my_pkg.advantages:centered
Multi-turn / tools: ``rollout.multi_turn.max_turns=4 rollout.multi_turn.tools=[my_tools.py:search]``: each sample
is a trajectory of model turns and tool results; the reward reads the last model turn (BUILD.md, "Multi-turn").
DAPO: ``algo.dynamic_sampling=true``, ``reward.overlong_buffer_len=...``, ``algo.overlong_filter=true``,
``algo.policy_loss_args.ppo.clip_high=0.28``, ``algo.agg=token-mean``.
Each loss's own knobs: ``algo.policy_loss=kl_cov algo.policy_loss_args.kl_cov.kl_cov_ratio=0.001`` (--help lists them).
Checkpoints and exact resume: ``checkpoint.every=50`` then ``resume=auto`` (same run dir, same metrics).

Asynchronous: ``offpolicy.rollout_ranks=1 offpolicy.mode=one_step_off`` (or ``bounded``): rollout ranks of their own
sample ahead while the others train (BUILD.md, "Asynchronous training").

The recipe is the algorithm (group-relative advantages from the configured estimator, the configured policy loss);
the loop (``backends/loop/``) runs the step: rollout + reward (dynamic sampling, multi-turn) -> log-probs ->
advantages -> policy update(s) -> weight sync -> log / eval / checkpoint, on every placement.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any, Callable

import attrs

import rlfunc as rf
from backends.config import resolve_function
from backends.loop.actor_loss import make_actor_loss
from backends.loop.algorithm import resolve_policy_loss, response_horizon
from backends.loop.algorithm_checks import check_estimator, group_size_warnings
from backends.loop.rl_loop import Recipe, run_recipe
from backends.loop.vocabulary import (
    RENAMED_GRPO,
    EstimatorArgs,
    PolicyLossArgs,
    PolicyUpdateConfig,
    PPOArgs,
    RLConfig,
    estimator_knobs,
)

PRESETS = Path(__file__).resolve().parent / "presets"


@attrs.frozen
class AlgoConfig(PolicyUpdateConfig):
    """The policy update's keys (backends/loop/vocabulary.py, shared with the other recipes) and GRPO's own."""

    #: an outcome estimator over groups (a built-in of rlfunc.ADVANTAGE_ESTIMATORS that takes group_ids; --help lists
    #: them) or a reference package.module:function / path/to/file.py:function (BUILD.md, "Your own estimator or loss")
    estimator: str = "grpo"
    estimator_args: EstimatorArgs = EstimatorArgs()  #: each built-in estimator's own knobs


#: GRPO's clip above 1 defaults to DAPO's clip-higher for the PPO-family losses
GRPO_LOSS_ARGS = PolicyLossArgs(ppo=PPOArgs(clip_high=0.28))


@attrs.frozen
class Config(RLConfig):
    name: str = "grpo"  #: the run's name (the run dir is <run_root>/<name>-<time>)
    algo: AlgoConfig = AlgoConfig(policy_loss_args=GRPO_LOSS_ARGS)  #: the algorithm


@attrs.frozen
class GroupRelative:
    """GRPO and its relatives: advantages from the scores of each prompt's group of samples (no critic), the
    configured policy loss, and a frozen reference where the KL loss is on."""

    estimator: Callable
    estimator_kwargs: dict
    policy_loss: Callable
    actor_loss: Callable
    uses_reference: bool
    title: str = "GRPO"
    uses_critic: bool = False
    critic_loss: None = None

    def initial_state(self) -> dict:
        return {}

    def advantages(self, batch: rf.RolloutBatch, state: dict, *, env: Any) -> tuple[rf.RolloutBatch, dict, dict]:
        # all n samples of a prompt live on one rank: the estimator is pure rlfunc over this rank's groups
        adv, ret = self.estimator(
            batch.scores, group_ids=batch.group_ids, response_mask=rf.loss_tokens(batch), **self.estimator_kwargs
        )
        return batch.replace(advantages=adv, returns=ret), state, {}


def group_relative(cfg: Config) -> GroupRelative:
    """The algorithm ``cfg`` names, resolved and called once as the loop calls it (a ConfigError before any work)."""
    estimator, estimator_kwargs, policy_loss = resolve_algorithm(cfg.algo)
    check_estimator(
        estimator, estimator_kwargs, key="algo.estimator", spec=cfg.algo.estimator, group_size=cfg.rollout.n
    )
    return GroupRelative(
        estimator=estimator,
        estimator_kwargs=estimator_kwargs,
        policy_loss=policy_loss,
        actor_loss=make_actor_loss(policy_loss, cfg.algo, horizon=response_horizon(cfg)),
        uses_reference=cfg.algo.kl_loss_coef > 0,
    )


def group_estimators() -> tuple[dict[str, Callable], dict[str, str]]:
    """The built-in estimators that fit the loop, outcome estimators over groups of samples (not gae, reinforce_pp,
    remax), and their aliases."""
    estimators = {
        name: fn for name, fn in rf.ADVANTAGE_ESTIMATORS.items() if "group_ids" in inspect.signature(fn).parameters
    }
    return estimators, {alias: name for alias, name in rf.ADVANTAGE_ESTIMATOR_ALIASES.items() if name in estimators}


def resolve_algorithm(algo: AlgoConfig) -> tuple[Callable, dict[str, Any], Callable]:
    """``(estimator, its extra keyword arguments, policy loss)`` from their config names or references."""
    estimators, aliases = group_estimators()
    estimator = resolve_function(algo.estimator, estimators, "algo.estimator", aliases=aliases)
    return estimator, estimator_knobs(algo.estimator_args, algo.estimator), resolve_policy_loss(algo)


def help_registries() -> dict[str, tuple[str, ...]]:
    """The names of the keys that take a built-in, for --help."""
    estimators, aliases = group_estimators()
    return {
        "algo.estimator": (*estimators, *(f"{alias}={name}" for alias, name in aliases.items())),
        "algo.policy_loss": tuple(rf.POLICY_LOSSES),
        "algo.agg": tuple(rf.AGG_MODES),
        "algo.kl_loss_kind": rf.KL_KINDS,
    }


RECIPE = Recipe(
    name="grpo",
    doc=__doc__,
    config=Config(),
    algorithm=group_relative,
    presets=PRESETS,
    renamed=RENAMED_GRPO,
    registries=help_registries,
    console_keys=(
        "reward_mean",
        "success_rate",
        "multi_turn/turns",
        "multi_turn/tool_call_validity",
        "kl_loss",
        "entropy",
        "clip_frac",
        "grad_norm",
        "response_length",
        "step_time_s",
    ),
    warnings=lambda cfg: group_size_warnings(cfg.rollout.n, key="algo.estimator", spec=cfg.algo.estimator),
)


def main(argv: list[str]) -> dict:
    return run_recipe(RECIPE, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
