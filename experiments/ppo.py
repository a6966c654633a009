"""PPO (verl's default algorithm: actor + critic + GAE) on your data, your reward, your model.

Run:  python experiments/ppo.py data.train_files=train.jsonl data.val_files=val.jsonl reward.fn=gsm8k
      torchrun --standalone --nproc_per_node 2 experiments/ppo.py ...           (FSDP2 over 2 ranks)
      ... model.path=/path/to/hf_dir algo.kl_ctrl=adaptive algo.kl_loss_coef=0.001
      ... preset=ref/dp_ref actor.optim=@optim/fsdp actor.optim.lr=1e-5     (presets, then overrides)
      ... actor.backend=megatron actor.tp=2 (or actor.pp=2): the actor and the critic on megatron-core
      --help lists every key with its default and meaning, and the presets.

Data, reward, evaluation and SFT sections are the GRPO recipe's (``experiments/grpo.py``).

Placement (where the roles run):
      torchrun --standalone --nproc_per_node 4 experiments/ppo.py placement.mode=split \
          placement.actor_pool=2 placement.critic_pool=2
actor + rollout on ranks 0-1, critic + reference on ranks 2-3: batches cross between the pools, and the
critic update runs at the same time as the actor update and weight sync. Colocated (the default) runs
every role on every rank. Split runs checkpoint, resume and export like colocated ones.

Asynchronous (``backends/loop/split.py``): ``offpolicy.rollout_ranks=1 offpolicy.mode=one_step_off`` gives the
rollout ranks of its own that sample the next batch while the other ranks, holding the actor, the critic and the
reference, train on this one (``algo.rollout_is=token`` corrects for the older sampling weights).
Multi-turn / tools, dynamic sampling, the rollout corrections: the keys of the GRPO recipe, which mean the same here.

Checkpoints and exact resume: ``checkpoint.every=10`` then ``resume=auto``. A checkpoint holds the actor and
the critic (weights + AdamW, sharded), the step, every rank's RNG, the data position and the KL controller.

The recipe is the algorithm (token rewards = score - beta * KL to the reference, GAE over the critic's values,
whitened advantages; the clipped value loss); the loop (``backends/loop/``) runs the step: rollout + reward ->
log-probs (actor, reference) -> values -> advantages -> critic update -> actor update -> weight sync -> log /
checkpoint, each phase on the ranks that hold its role.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import attrs
import torch

import rlfunc as rf
from backends.config import ConfigError
from backends.distributed.collectives import all_reduce_sum, global_masked_whiten
from backends.loop.actor_loss import make_actor_loss
from backends.loop.algorithm import resolve_policy_loss, response_horizon
from backends.loop.rl_loop import Recipe, run_recipe
from backends.loop.vocabulary import RENAMED_PPO, PolicyLossArgs, PolicyUpdateConfig, PPOArgs, RLConfig
from backends.training.fsdp import value_loss_fn

PRESETS = Path(__file__).resolve().parent / "presets"


@attrs.frozen
class AlgoConfig(PolicyUpdateConfig):
    """The policy update's keys (backends/loop/vocabulary.py, shared with the other recipes; the actor's loss) and
    PPO's own: verl's ``algorithm.*`` (adv_estimator=gae, the in-reward KL) and the critic's loss."""

    gamma: float = 1.0  #: GAE discount
    lam: float = 0.95  #: GAE lambda
    cliprange_value: float = 0.5  #: the critic's value clip (verl's critic.cliprange_value)
    kl_in_reward: bool = True  #: subtract kl_reward_coef * KL(policy || reference) from the token rewards (InstructGPT)
    #: the KL estimator in the reward (rlfunc.KL_KINDS; kl = k1)
    kl_reward_kind: str = attrs.field(default="kl", validator=attrs.validators.in_(rf.KL_KINDS))
    #: fixed | adaptive: how the in-reward beta moves
    kl_ctrl: str = attrs.field(default="fixed", validator=attrs.validators.in_(("fixed", "adaptive")))
    kl_reward_coef: float = 0.001  #: the (initial) in-reward beta of the controller (verl's algorithm.kl_ctrl.kl_coef)
    target_kl: float = 0.1  #: the adaptive controller's target KL
    horizon: int = 10000  #: the adaptive controller's horizon


#: verl's actor defaults: PPO clip 0.2 both sides, dual clip at 3.0 (clip_ratio_c), a low-variance KL loss when on
PPO_ALGO = AlgoConfig(
    policy_loss_args=PolicyLossArgs(ppo=PPOArgs(clip_high=0.2, dual_clip=3.0)), kl_loss_kind="low_var_kl"
)


@attrs.frozen
class Config(RLConfig):
    name: str = "ppo"  #: the run's name (the run dir is <run_root>/<name>-<time>)
    algo: AlgoConfig = PPO_ALGO  #: the algorithm


@attrs.frozen
class ActorCritic:
    """PPO: GAE advantages over the critic's values of the token rewards (the score on the last response token minus
    beta * KL to the reference per token), whitened over the whole batch; the state is the KL controller."""

    algo: AlgoConfig
    kl_steps: int  #: samples per step (prompts_per_step x rollout.n): the adaptive controller's step size
    policy_loss: Any
    actor_loss: Any
    critic_loss: Any
    title: str = "PPO"
    uses_critic: bool = True

    @property
    def uses_reference(self) -> bool:
        return self.algo.kl_in_reward or self.algo.kl_loss_coef > 0

    def initial_state(self) -> dict:
        algo = self.algo
        if algo.kl_ctrl == "adaptive":
            ctrl = rf.adaptive_kl_controller(algo.kl_reward_coef, target_kl=algo.target_kl, horizon=algo.horizon)
        else:
            ctrl = rf.fixed_kl_controller(algo.kl_reward_coef)
        return {"kl_ctrl": {"beta": ctrl.beta, "target_kl": ctrl.target_kl, "horizon": ctrl.horizon}}

    def advantages(self, batch: rf.RolloutBatch, state: dict, *, env: Any) -> tuple[rf.RolloutBatch, dict, dict]:
        """Token rewards -> GAE -> advantages whitened over every rank of ``env`` (as verl); the KL controller sees
        the KL averaged over those ranks, so every rank holds the same beta."""
        algo, mask = self.algo, rf.loss_tokens(batch)
        token_rewards = outcome_token_rewards(batch.scores, response_mask=mask)
        kl_stats = {}
        if algo.kl_in_reward:
            ctrl = rf.KLControllerState(**state["kl_ctrl"])
            token_rewards, observed_kl = rf.apply_kl_penalty_to_rewards(
                token_rewards,
                logprobs=batch.old_logprobs,
                ref_logprobs=batch.ref_logprobs,
                mask=batch.response_mask,
                beta=ctrl.beta,
                kind=algo.kl_reward_kind,
            )
            observed_kl = (all_reduce_sum(observed_kl.reshape(1), env.group) / env.world_size)[0]
            kl_stats = {"kl_reward": float(observed_kl), "kl_coef": float(ctrl.beta)}
            ctrl = rf.update_kl_controller(ctrl, observed_kl=observed_kl, n_steps=self.kl_steps)
            state = {"kl_ctrl": {"beta": float(ctrl.beta), "target_kl": ctrl.target_kl, "horizon": ctrl.horizon}}
        adv, ret = rf.gae(
            token_rewards, values=batch.values, response_mask=batch.response_mask, gamma=algo.gamma, lam=algo.lam
        )
        adv = global_masked_whiten(adv, mask, group=env.group)
        return batch.replace(token_rewards=token_rewards, advantages=adv, returns=ret), state, kl_stats


def outcome_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``(b,), (b t) -> (b t)``: each sequence's score on its last response (loss) token, 0 elsewhere (verl's
    ``token_level_scores`` of a rule-based reward; a multi-turn trajectory's last model token)."""
    last = (response_mask.long().cumsum(-1) == response_mask.sum(-1, keepdim=True)) & response_mask
    return torch.where(last, scores[:, None].to(torch.float32), torch.zeros((), dtype=torch.float32))


def actor_critic(cfg: Config) -> ActorCritic:
    """PPO as ``cfg`` sets it up: the policy loss resolved and checked with the loop's call, the value loss."""
    horizon = response_horizon(cfg)
    policy_loss = resolve_policy_loss(cfg.algo)
    if cfg.reference.ref_in_actor and not (cfg.algo.kl_in_reward or cfg.algo.kl_loss_coef > 0):
        raise ConfigError(
            "reference.ref_in_actor=true without a KL term (algo.kl_in_reward / algo.kl_loss_coef): "
            "no reference is built"
        )
    return ActorCritic(
        algo=cfg.algo,
        kl_steps=cfg.prompts_per_step * cfg.rollout.n,
        policy_loss=policy_loss,
        actor_loss=make_actor_loss(policy_loss, cfg.algo, horizon=horizon),
        critic_loss=value_loss_fn(clip_range=cfg.algo.cliprange_value, agg="token-mean", horizon=horizon),
    )


RECIPE = Recipe(
    name="ppo",
    doc=__doc__,
    config=Config(),
    algorithm=actor_critic,
    presets=PRESETS,
    renamed=RENAMED_PPO,
    registries=lambda: {
        "algo.kl_reward_kind, algo.kl_loss_kind": rf.KL_KINDS,
        "algo.agg": tuple(rf.AGG_MODES),
        "algo.policy_loss": tuple(rf.POLICY_LOSSES),
    },
    console_keys=(
        "reward_mean",
        "success_rate",
        "kl_reward",
        "entropy",
        "clip_frac",
        "critic/loss",
        "grad_norm",
        "step_time_s",
    ),
)


def main(argv: list[str]) -> dict:
    return run_recipe(RECIPE, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
