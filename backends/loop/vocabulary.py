"""The config keys the recipes share, declared once: the run's sections, the policy update's settings, and the
typed knobs of every built-in policy loss and advantage estimator.

A recipe's ``Config`` extends :class:`RunConfig` and its ``algo`` section :class:`PolicyUpdateConfig`, so the
same key means the same thing in GRPO, PPO and the custom template: ``algo.kl_loss_coef`` is the weight of the
KL term in the actor's loss everywhere (PPO's in-reward KL beta is ``algo.kl_reward_coef``), the ratio clip of
a loss is ``algo.policy_loss_args.<loss>.clip_low / clip_high``, and so on. Old spellings are refused at
start-up with the new key (:data:`RENAMED_GRPO` and friends, through ``apply_overrides(..., renamed=...)``).

A built-in loss's knobs live in its own section, ``algo.policy_loss_args.<name>.<knob>`` (e.g.
``algo.policy_loss_args.kl_cov.kl_cov_ratio=0.001``); an estimator's in ``algo.estimator_args.<name>.<knob>``.
Each section is a frozen attrs class whose fields are the keyword arguments of that rlfunc function, with
rlfunc's defaults (tests/test_vocabulary.py checks that they agree); a knob that a loss does not have is an
unknown key, and the error lists the section's keys.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

import rlfunc as rf
from backends.checkpoint.resume import CheckpointConfig
from backends.data import DataConfig
from backends.distributed.placement import PlacementConfig
from backends.distributed.watchdog import DeadlineConfig
from backends.models import ModelConfig
from backends.rewards import RewardConfig
from backends.rollout.api import RolloutConfig
from backends.rollout.evaluation import EvalConfig
from backends.training.engines import registered_engine
from backends.training.fsdp import FSDPConfig
from backends.training.lora import LoraConfig
from backends.training.optim import OptimConfig
from backends.training.reference import ReferenceConfig
from backends.training.reward_model import RewardModelConfig
from backends.training.sft import SFTConfig

__all__ = [
    "RESUMABLE_KEYS",
    "RunConfig",
    "RLConfig",
    "ActorConfig",
    "CriticConfig",
    "ExportConfig",
    "OffPolicyConfig",
    "PolicyUpdateConfig",
    "PolicyLossArgs",
    "EstimatorArgs",
    "loss_knobs",
    "estimator_knobs",
    "RENAMED_GRPO",
    "RENAMED_PPO",
    "RENAMED_CUSTOM",
]

_ge0 = attrs.validators.ge(0.0)
Singletons = Literal["no_baseline", "zero", "error"]


# ---------------------------------------------------------------------------------------------------
# The run: what every recipe has and backends/loop/stages.py reads.


@attrs.frozen
class DebugConfig:
    #: write a fingerprint of every step's tensors (samples, scores, log-probs, advantages, losses, gradient norms,
    #: weights) to runs/<run>/fingerprints/: python -m backends.loop.bisect compares two runs with them
    fingerprints: bool = True
    #: save the complete inputs of these steps (the weights before them, the batch, the seeds) under
    #: runs/<run>/records/step_<N>: python -m backends.loop.replay runs such a step again (colocated runs)
    record_steps: tuple[int, ...] = ()
    record_every: int = attrs.field(default=0, validator=attrs.validators.ge(0))  #: ... and every N-th step (0: none)


#: keys that may differ between a run and its resumption (where things go and how they are logged)
RESUMABLE_KEYS = (
    "debug",
    "resume",
    "fork_from",
    "run_dir",
    "run_root",
    "checkpoint",
    "deadlines",
    "export",
    "eval",
    "logger",
    "log_every",
    "dump_generations_every",
)


@attrs.frozen
class RunConfig:
    name: str = "run"  #: the run's name (the run dir is <run_root>/<name>-<time>); each recipe names its own
    seed: int = 0  #: seeds the data order, the sampling and the weights of a tiny model
    #: RL steps; none: epochs x the steps of one pass over data.train_files; 0: evaluate only (GRPO)
    steps: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.ge(0)))
    #: passes over data.train_files when steps is none
    epochs: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    #: prompts per RL step, over all ranks (verl's data.train_batch_size)
    prompts_per_step: int = attrs.field(default=32, validator=attrs.validators.ge(1))
    logger: tuple[str, ...] = ("console", "jsonl", "tensorboard")  #: metric sinks: console, jsonl, tensorboard, wandb
    log_every: int = 10  #: console line every N steps
    dump_generations_every: int = 0  #: write runs/<run>/generations/step_<N>.jsonl every N steps (0: never)
    run_root: str = "runs"  #: where run dirs go
    run_dir: str = ""  #: empty: <run_root>/<name>-<time>, or the resumed checkpoint's run dir
    resume: str = "never"  #: never | auto (the newest complete checkpoint, else a fresh start) | a step_N dir
    #: a step_N dir of another run: a new run that starts from it with any key but model.* changed (its weights,
    #: optimizer, RNG, data position and logs up to step N); resume=auto continues the fork itself
    fork_from: str = attrs.field(default="")
    checkpoint: CheckpointConfig = CheckpointConfig()  #: when and where checkpoints go
    #: the longest each phase of a step may take (s); past it the rank exits
    deadlines: DeadlineConfig = DeadlineConfig()
    model: ModelConfig = ModelConfig()  #: the starting policy
    data: DataConfig = DataConfig()  #: the prompts
    reward: RewardConfig = RewardConfig()  #: the reward functions
    eval: EvalConfig = EvalConfig()  #: held-out evaluation
    sft: SFTConfig = SFTConfig()  #: an optional SFT stage before RL
    debug: DebugConfig = DebugConfig()  #: what a run records to be compared and debugged
    #: sampling (rollout.engine=vllm for vLLM)
    rollout: RolloutConfig = RolloutConfig(n=8, temperature=1.0, max_new_tokens=256)

    @fork_from.validator
    def _one_starting_checkpoint(self, attribute: attrs.Attribute, value: str) -> None:
        if value and self.resume not in ("never", "auto"):
            raise ValueError(
                f"fork_from={value!r} starts a new run from another run's checkpoint and resume={self.resume!r} "
                "continues from this one's: give one of them (resume=auto with fork_from continues the fork once it "
                "has a checkpoint of its own)"
            )


# ---------------------------------------------------------------------------------------------------
# The knobs of each built-in policy loss (keyword arguments of rlfunc.POLICY_LOSSES[name]).


@attrs.frozen
class PPOArgs:
    clip_low: float = attrs.field(default=0.2, validator=[_ge0, attrs.validators.lt(1.0)])  #: ratio clip below 1
    clip_high: float | None = None  #: ratio clip above 1 (DAPO's clip-higher); none: clip_low
    dual_clip: float | None = None  #: > 1 bounds the loss of negative-advantage tokens (verl's clip_ratio_c); none: off


@attrs.frozen
class VanillaArgs:
    clip_low: float = attrs.field(default=0.2, validator=[_ge0, attrs.validators.lt(1.0)])  #: ratio clip below 1
    clip_high: float | None = None  #: ratio clip above 1; none: clip_low
    dual_clip: float | None = 3.0  #: verl's clip_ratio_c (on at 3.0, as verl); none: off


@attrs.frozen
class ClipArgs:
    clip_low: float = attrs.field(default=0.2, validator=_ge0)  #: clip below (GSPO: the sequence ratio; GMPO: log r)
    clip_high: float | None = None  #: clip above; none: clip_low


@attrs.frozen
class SAPOArgs:
    tau_pos: float = 1.0  #: the gate's temperature for positive advantages
    tau_neg: float = 1.05  #: ... for negative advantages (larger: damped faster)


@attrs.frozen
class NoArgs:
    """A loss or estimator with no knobs of its own."""


@attrs.frozen
class ClipCovArgs:
    clip_low: float = attrs.field(default=0.2, validator=[_ge0, attrs.validators.lt(1.0)])  #: PPO ratio clip below 1
    clip_high: float | None = None  #: PPO ratio clip above 1; none: clip_low
    clip_cov_ratio: float = 0.0002  #: share of the tokens whose gradient is cut
    clip_cov_lb: float = 1.0  #: covariance lower bound of the candidates
    clip_cov_ub: float = 5.0  #: covariance upper bound of the candidates


@attrs.frozen
class KLCovArgs:
    kl_cov_ratio: float = 0.0002  #: share of the tokens (highest covariance) that get the KL penalty
    ppo_kl_coef: float = 0.1  #: the penalty's weight on |log r|


@attrs.frozen
class DecoupledPPOArgs:
    behaviour_weight_cap: float | None = None  #: tokens whose proximal / behaviour weight exceeds it leave the loss
    clip_low: float = attrs.field(default=0.2, validator=[_ge0, attrs.validators.lt(1.0)])  #: ratio clip below 1
    clip_high: float | None = None  #: ratio clip above 1; none: clip_low
    dual_clip: float | None = None  #: > 1 bounds negative-advantage tokens; none: off


@attrs.frozen
class PolicyLossArgs:
    """One section per built-in policy loss (``algo.policy_loss`` picks the loss; only its section is read)."""

    ppo: PPOArgs = PPOArgs()  #: PPO's clipped surrogate
    vanilla: VanillaArgs = VanillaArgs()  #: verl's name for PPO, with verl's dual clip
    gspo: ClipArgs = ClipArgs()  #: GSPO (the paper's clips are tiny, e.g. 3e-4 / 4e-4)
    sapo: SAPOArgs = SAPOArgs()  #: SAPO's soft gate
    cispo: ClipArgs = ClipArgs()  #: CISPO's truncation of the importance weight
    gpg: NoArgs = NoArgs()  #: GPG: no knobs
    clip_cov: ClipCovArgs = ClipCovArgs()  #: Clip-Cov
    kl_cov: KLCovArgs = KLCovArgs()  #: KL-Cov
    gmpo: ClipArgs = ClipArgs()  #: GMPO (clip on log r)
    geo_mean: ClipArgs = ClipArgs()  #: verl's name for GMPO
    decoupled_ppo: DecoupledPPOArgs = DecoupledPPOArgs()  #: AReaL's decoupled PPO


# ---------------------------------------------------------------------------------------------------
# The knobs of each built-in group estimator (keyword arguments of rlfunc.ADVANTAGE_ESTIMATORS[name]).


@attrs.frozen
class GRPOArgs:
    norm_by_std: bool = True  #: divide by the group's std (false: Dr.GRPO)
    eps: float = 1e-6  #: added to the std
    singletons: Singletons = "no_baseline"  #: a group of one: no_baseline (its score), zero, or error


@attrs.frozen
class GRPOPassKArgs:
    norm_by_std: bool = True  #: divide the margin by the group's std
    eps: float = 1e-6  #: added to the std


@attrs.frozen
class SingletonArgs:
    singletons: Singletons = "no_baseline"  #: a group of one: no_baseline (its score), zero, or error


@attrs.frozen
class ZeroSingletonArgs:
    singletons: Singletons = "zero"  #: a group of one: zero (verl's vectorized RLOO), no_baseline, or error


@attrs.frozen
class GPGEstimatorArgs:
    f_norm: float = 1.0  #: GPG's correction factor
    singletons: Singletons = "no_baseline"  #: a group of one: no_baseline (its score), zero, or error


@attrs.frozen
class EstimatorArgs:
    """One section per built-in group estimator (``algo.estimator`` picks it; only its section is read)."""

    grpo: GRPOArgs = GRPOArgs()  #: GRPO (group mean, divided by the group's std)
    grpo_passk: GRPOPassKArgs = GRPOPassKArgs()  #: GRPO pass@k
    rloo: SingletonArgs = SingletonArgs()  #: RLOO (leave-one-out mean)
    rloo_vectorized: ZeroSingletonArgs = ZeroSingletonArgs()  #: verl's vectorized RLOO (a group of one gets 0)
    reinforce_pp_baseline: SingletonArgs = SingletonArgs()  #: REINFORCE++ with the group mean as baseline
    opo: SingletonArgs = SingletonArgs()  #: OPO (length-weighted group mean)
    gpg: GPGEstimatorArgs = GPGEstimatorArgs()  #: GPG


def _section_name(spec: str, aliases: dict[str, str]) -> str:
    key = spec.replace("-", "_")
    return aliases.get(key, key)


def loss_knobs(args: PolicyLossArgs, spec: str) -> dict[str, Any]:
    """The keyword arguments ``algo.policy_loss=spec`` gets from its section; ``{}`` for a user's own loss."""
    name = _section_name(spec, {})
    return attrs.asdict(getattr(args, name)) if name in attrs.fields_dict(PolicyLossArgs) else {}


def estimator_knobs(args: EstimatorArgs, spec: str) -> dict[str, Any]:
    """The keyword arguments ``algo.estimator=spec`` gets from its section (verl's aliases read our name's);
    ``{}`` for a user's own estimator."""
    name = _section_name(spec, dict(rf.ADVANTAGE_ESTIMATOR_ALIASES))
    return attrs.asdict(getattr(args, name)) if name in attrs.fields_dict(EstimatorArgs) else {}


# ---------------------------------------------------------------------------------------------------
# The policy update: the actor's loss and its corrections, in every recipe that trains a policy.


@attrs.frozen
class PolicyUpdateConfig:
    #: a name of rlfunc.POLICY_LOSSES (ppo = PPO clip; vanilla = verl's, dual clip on; --help lists them) or a
    #: reference package.module:function / path/to/file.py:function (BUILD.md, "Your own estimator or loss")
    policy_loss: str = "ppo"
    policy_loss_args: PolicyLossArgs = PolicyLossArgs()  #: each built-in loss's own knobs
    #: loss aggregation: token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm
    agg: str = attrs.field(default="token-mean", validator=attrs.validators.in_(rf.AGG_MODES))
    #: > 0 adds kl_loss_coef * KL(policy || reference) to the actor's loss; the reference is the starting policy
    kl_loss_coef: float = attrs.field(default=0.0, validator=_ge0)
    #: that KL's estimator (rlfunc.KL_KINDS: k1..k3 / low_var_kl, "+" for straight-through gradients)
    kl_loss_kind: str = attrs.field(default="k3", validator=attrs.validators.in_(rf.KL_KINDS))
    entropy_coef: float = attrs.field(default=0.0, validator=_ge0)  #: > 0 subtracts entropy_coef * the token entropy
    ppo_epochs: int = attrs.field(default=1, validator=attrs.validators.ge(1))  #: passes over each batch
    #: prompts per optimizer step (global; x rollout.n rows); 0: the whole step's batch in one optimizer step
    ppo_mini_batch_size: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    critic_warmup: int = attrs.field(default=0, validator=attrs.validators.ge(0))  #: steps that train only the critic
    #: rejection (masked importance sampling): tokens (token) or whole responses (sequence, geometric) whose trainer /
    #: rollout ratio lies outside [1 / rollout_rs_threshold, rollout_rs_threshold] leave the loss and its normalisers
    rollout_rs: Literal["none", "token", "sequence", "geometric"] = "none"
    rollout_rs_threshold: float = attrs.field(default=2.0, validator=attrs.validators.gt(1.0))  #: the rejection bound
    #: > 0 (with rollout_rs): a response with a token ratio below it leaves the loss
    rollout_token_veto: float = attrs.field(default=0.0, validator=_ge0)
    #: rows whose advantages are all 0 get no forward / backward (they still count in the normalisers, so the
    #: gradient is unchanged); applied only where exact: an advantage-proportional built-in loss, no KL / entropy
    skip_zero_advantage: bool = True
    #: DAPO: keep only groups whose samples got different scores, drawing more prompts until the batch is full
    dynamic_sampling: bool = False
    #: dynamic sampling's generation rounds per step at most (then the batch fills up with what was drawn)
    max_sampling_rounds: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    overlong_filter: bool = False  #: DAPO: responses cut off by rollout.max_new_tokens carry no loss
    #: truncated importance weights for the rollout / trainer mismatch (TIS): per token, per sequence (the product of
    #: its ratios) or geometric (their geometric mean)
    rollout_is: Literal["none", "token", "sequence", "geometric"] = "none"
    rollout_is_cap: float = attrs.field(default=2.0, validator=attrs.validators.gt(0.0))  #: the TIS truncation


# ---------------------------------------------------------------------------------------------------
# The roles, the placement and what is written at the end: every RL recipe's, read by backends.loop.rl_loop.


@attrs.frozen
class ActorConfig:
    optim: OptimConfig = OptimConfig(lr=1e-6, weight_decay=0.0, clip_grad=1.0, lr_warmup_steps=0)  #: the RL optimizer
    fsdp: FSDPConfig = FSDPConfig(micro_batch_size=16)  #: sharding, micro-batches, precision
    #: fsdp (data parallel) or megatron (tensor / pipeline parallel: actor.tp, actor.pp), for the actor and the critic
    backend: str = attrs.field(default="fsdp", validator=registered_engine)
    tp: int = 1  #: megatron tensor-parallel size
    pp: int = 1  #: megatron pipeline-parallel size
    lora: LoraConfig = LoraConfig()  #: train a LoRA adapter instead of every weight (actor.lora.rank > 0)


@attrs.frozen
class CriticConfig:
    optim: OptimConfig = OptimConfig(lr=1e-5, weight_decay=0.0, clip_grad=1.0)  #: the critic's optimizer
    fsdp: FSDPConfig = FSDPConfig(micro_batch_size=16)  #: the critic's sharding and micro-batches


@attrs.frozen
class ExportConfig:
    hf: bool = True  #: the actor (final_model) and a critic (final_critic) as HF dirs that transformers / vLLM load
    orbax: bool = False  #: the gathered actor train state as an orbax PyTree (actor_orbax; JAX interop)


@attrs.frozen
class OffPolicyConfig:
    #: sync: sample with the newest weights; one_step_off: the rollout runs one step ahead; bounded: up to
    #: max_staleness steps ahead (new weights on a fixed schedule, so runs are reproducible)
    mode: str = attrs.field(default="sync", validator=attrs.validators.in_(("sync", "one_step_off", "bounded")))
    max_staleness: int = attrs.field(default=1, validator=attrs.validators.ge(0))  #: bounded: the lag in steps
    #: ranks that only sample (the last ones of the world); 0: every rank samples and trains (colocated)
    rollout_ranks: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    #: bounded: a generation takes newer weights at chunk boundaries (one version a boundary, never past the trainer's
    #: version at the batch's update) and each token carries the version that sampled it (native engine)
    partial_rollouts: bool = attrs.field(default=False)
    #: partial_rollouts: decode iterations between two chunk boundaries
    partial_chunk_tokens: int = attrs.field(default=32, validator=attrs.validators.ge(1))

    @partial_rollouts.validator
    def _bounded_only(self, attribute: attrs.Attribute, value: bool) -> None:
        if value and self.mode != "bounded":
            raise ValueError(
                f"offpolicy.partial_rollouts=true needs offpolicy.mode=bounded (its offpolicy.max_staleness bounds "
                f"the versions a generation may take), got offpolicy.mode={self.mode}"
            )


@attrs.frozen
class RLConfig(RunConfig):
    """An RL recipe's config: the run's sections, the roles, where they run, and the policy update (``algo``, which
    a recipe extends with its own algorithm's keys)."""

    actor: ActorConfig = ActorConfig()  #: the trained policy
    #: the value model (algorithms with a critic: PPO); its engine is actor.backend's
    critic: CriticConfig = CriticConfig()
    #: the frozen reference of the KL terms (built when the algorithm uses one; verl's ref/*.yaml)
    reference: ReferenceConfig = ReferenceConfig(log_prob_micro_batch_size=64)
    reward_model: RewardModelConfig = RewardModelConfig()  #: an optional learned reward, added to the functions' score
    #: where the trained roles run: colocated (every role on every rank) or split (the critic and the reference on
    #: a pool of their own; algorithms with a critic)
    placement: PlacementConfig = PlacementConfig()
    #: asynchronous RL: rollout ranks of their own sample ahead while the trainer ranks update
    offpolicy: OffPolicyConfig = OffPolicyConfig()
    export: ExportConfig = ExportConfig()  #: what is written at the end
    algo: PolicyUpdateConfig = PolicyUpdateConfig()  #: the algorithm


def _clip_moved(old: str) -> str:
    return (
        f"algo.policy_loss_args.<loss>.{old} (each loss has its own clip, e.g. "
        f"algo.policy_loss_args.ppo.{old}; --help lists them)"
    )


#: old spellings every recipe refuses -> the key that replaced them
RENAMED_SHARED = {
    "algo.mini_batches": "algo.ppo_mini_batch_size (prompts per optimizer step: prompts_per_step / mini_batches)",
    "export_hf": "export.hf",
    "ref_log_prob_micro_batch_size": "reference.log_prob_micro_batch_size",
}
#: old spellings -> the key that replaced them (refused at start-up with this message)
RENAMED_GRPO = {
    **RENAMED_SHARED,
    "algo.kl_coef": "algo.kl_loss_coef",
    "algo.kl_kind": "algo.kl_loss_kind",
    "algo.clip_low": _clip_moved("clip_low"),
    "algo.clip_high": _clip_moved("clip_high"),
    "algo.norm_by_std": "algo.estimator_args.grpo.norm_by_std",
    "algo.behaviour_weight_cap": "algo.policy_loss_args.decoupled_ppo.behaviour_weight_cap (none: no cap)",
}
RENAMED_PPO = {
    **RENAMED_SHARED,
    "algo.kl_coef": "algo.kl_reward_coef (the in-reward KL beta; the KL loss's weight is algo.kl_loss_coef)",
    "algo.kl_penalty": "algo.kl_reward_kind",
    "algo.use_kl_loss": "algo.kl_loss_coef (> 0 adds the KL loss)",
    "algo.kl_loss_type": "algo.kl_loss_kind",
    "algo.clip_ratio": "algo.policy_loss_args.ppo.clip_low and algo.policy_loss_args.ppo.clip_high",
    "algo.clip_ratio_c": "algo.policy_loss_args.ppo.dual_clip",
}
RENAMED_CUSTOM = {
    **RENAMED_SHARED,
    "algo.clip": "algo.policy_loss_args.ppo.clip_low and algo.policy_loss_args.ppo.clip_high",
    "algo.kl_coef": "algo.kl_loss_coef",
    "optim": "actor.optim",
    "fsdp": "actor.fsdp",
}
