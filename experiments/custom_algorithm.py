"""A new algorithm in a few lines: compose pure rlfunc functions, hand the loss to the engine.

The template for your own algorithm: copy this file and change ``advantages`` and ``loss_fn``. Two variants,
picked with ``algo.name``:

- ``reinforce_pp_baseline`` (default): REINFORCE++-baseline advantages (score minus the group mean,
  then whitened over the batch) with a k3 KL loss to the frozen starting policy;
- ``dr_grpo``: Dr.GRPO (https://arxiv.org/abs/2503.20783): group-mean advantages without the std
  division, and the ``seq-mean-token-sum-norm`` aggregation (no length normalisation bias).

Data, reward, model, evaluation, SFT, checkpoint and placement sections are the GRPO recipe's
(``experiments/grpo.py``): the loop (``backends/loop/``) runs the step, this file is only the algorithm.

Run:  python experiments/custom_algorithm.py data.train_files=train.jsonl data.val_files=val.jsonl reward.fn=exact
      torchrun --standalone --nproc_per_node 2 experiments/custom_algorithm.py algo.name=dr_grpo ...
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import attrs

import rlfunc as rf
from backends.distributed.collectives import global_masked_whiten
from backends.loop.algorithm import response_horizon
from backends.loop.algorithm_checks import group_size_warnings
from backends.loop.rl_loop import Recipe, run_recipe
from backends.loop.vocabulary import RENAMED_CUSTOM, PolicyLossArgs, PolicyUpdateConfig, PPOArgs, RLConfig

PRESETS = Path(__file__).resolve().parent / "presets"


@attrs.frozen
class AlgoConfig(PolicyUpdateConfig):
    #: the variant: reinforce_pp_baseline or dr_grpo
    name: str = attrs.field(
        default="reinforce_pp_baseline", validator=attrs.validators.in_(("reinforce_pp_baseline", "dr_grpo"))
    )
    #: the loss is PPO's: its clip is read from algo.policy_loss_args.ppo (the key GRPO and PPO use)
    policy_loss_args: PolicyLossArgs = PolicyLossArgs(ppo=PPOArgs(clip_high=0.2))
    kl_loss_coef: float = 0.001  #: reinforce_pp_baseline: weight of the k3 KL loss (the key GRPO and PPO use)


@attrs.frozen
class Config(RLConfig):
    name: str = "custom_algorithm"  #: the run's name (the run dir is <run_root>/<name>-<time>)
    #: prompts per RL step, over all ranks
    prompts_per_step: int = attrs.field(default=16, validator=attrs.validators.ge(1))
    algo: AlgoConfig = AlgoConfig()  #: the algorithm


# ---------------------------------------------------------------------------------------------------
# The algorithm: advantages and a loss, each a pure function of tensors.


def advantages(batch: rf.RolloutBatch, algo: AlgoConfig, whiten=rf.masked_whiten) -> rf.RolloutBatch:
    """``whiten``: the loop passes global_masked_whiten over its ranks (the whole batch, all ranks)."""
    if algo.name == "reinforce_pp_baseline":
        adv, ret = rf.reinforce_pp_baseline(batch.scores, group_ids=batch.group_ids, response_mask=batch.response_mask)
        adv = whiten(adv, batch.response_mask)
    else:  # dr_grpo
        adv, ret = rf.grpo(
            batch.scores, group_ids=batch.group_ids, response_mask=batch.response_mask, norm_by_std=False
        )
    return batch.replace(advantages=adv, returns=ret)


def loss_fn(out, mb: rf.RolloutBatch, norms: rf.Normalizers, *, algo: AlgoConfig, horizon: int, seed: int = 0):
    agg = "token-mean" if algo.name == "reinforce_pp_baseline" else "seq-mean-token-sum-norm"
    clip = algo.policy_loss_args.ppo
    loss, metrics = rf.ppo_policy_loss(
        out.logprobs,
        old_logprobs=mb.old_logprobs,
        advantages=mb.advantages,
        response_mask=mb.response_mask,
        clip_low=clip.clip_low,
        clip_high=clip.clip_high,
        dual_clip=clip.dual_clip,
        agg=agg,
        norms=norms,
        horizon=horizon,
    )
    if uses_kl(algo):
        kl, kl_metrics = rf.kl_loss(
            out.logprobs, ref_logprobs=mb.ref_logprobs, mask=mb.response_mask, kind="k3", agg=agg, norms=norms
        )
        loss, metrics = loss + algo.kl_loss_coef * kl, {**metrics, **kl_metrics}
    return loss, metrics


def uses_kl(algo: AlgoConfig) -> bool:
    return algo.name == "reinforce_pp_baseline" and algo.kl_loss_coef > 0


# ---------------------------------------------------------------------------------------------------
# What the loop calls (backends.loop.algorithm.Algorithm).


@attrs.frozen
class CustomAlgorithm:
    algo: AlgoConfig
    actor_loss: Any
    title: str = "custom"
    uses_critic: bool = False
    critic_loss: None = None
    policy_loss: None = None  #: a loss of its own (not a registered one)

    @property
    def uses_reference(self) -> bool:
        return uses_kl(self.algo)

    def initial_state(self) -> dict:
        return {}

    def advantages(self, batch: rf.RolloutBatch, state: dict, *, env: Any) -> tuple[rf.RolloutBatch, dict, dict]:
        whiten = functools.partial(global_masked_whiten, group=env.group)
        return advantages(batch, self.algo, whiten=whiten), state, {}


def custom_algorithm(cfg: Config) -> CustomAlgorithm:
    return CustomAlgorithm(
        algo=cfg.algo,
        title=cfg.algo.name,
        actor_loss=functools.partial(loss_fn, algo=cfg.algo, horizon=response_horizon(cfg)),
    )


RECIPE = Recipe(
    name="custom",
    doc=__doc__,
    config=Config(),
    algorithm=custom_algorithm,
    presets=PRESETS,
    renamed=RENAMED_CUSTOM,
    registries=lambda: {"algo.name": ("reinforce_pp_baseline", "dr_grpo")},
    console_keys=("reward_mean", "kl_mean", "grad_norm"),
    warnings=lambda cfg: group_size_warnings(cfg.rollout.n, key="algo.name", spec=cfg.algo.name),
)


def main(argv: list[str]) -> dict:
    return run_recipe(RECIPE, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
