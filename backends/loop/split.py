"""The RL loop on rollout ranks of their own (``offpolicy.rollout_ranks=R``): the last R ranks of the world
sample, the others train with FSDP, and the two pools overlap. This module runs the schedule, the rollout ranks and
the trainer pool's loop; the trainer pool trains with the same :class:`backends.loop.learner.Learner` as the
colocated loop (every role of the algorithm colocated over the pool: the actor, and a critic and a reference where
the algorithm has them), and the rollout ranks sample and score with :mod:`backends.loop.sampling`.

**Schedule.** With lag ``L`` (``sync``: 0, ``one_step_off``: 1, ``bounded``: ``offpolicy.max_staleness``) the
batch of step ``s`` is sampled by the weights after update ``max(0, s - 1 - L)``, so its staleness at the update
is ``min(s - 1, L)``: the rollout runs up to ``L`` steps ahead of the trainer. New weights are taken on this fixed
schedule (never "whatever arrived last"), so a run is reproducible and ``bounded`` with ``max_staleness=0`` is
the same run as ``sync``.

**Who does what.** Rollout ranks own the prompt stream (each holds the same seeded stream), build their own
rollout engine (and a reward model's replica), evaluate before and after training and on ``eval.every`` (their
pool's group), dump generations and ``isend`` each trainer rank its share of every step's batch
(:mod:`backends.distributed.sample_channel`). Trainer rank ``t`` is served by rollout rank ``t % R``; the share of
trainer ``t`` is sampled with the seed the colocated loop would give data rank ``t``, so the split of the data does
not depend on R. The trainers recompute the old log-probs (the batch is off-policy) and, with a KL loss, the
reference's (the reference lives on the trainer pool; so does PPO's critic), update, and after every update trainer
rank 0 broadcasts the weights to the rollout pool (:mod:`backends.distributed.weight_broadcast`) while every
trainer rank gathers them (a collective of the trainer pool).

**Ordering.** Per step every rank does, in this order: the weights' broadcast on the push group (trainer rank 0
and the rollout ranks), on ``eval.every`` the evaluation's metrics from the rollout pool to the trainers, then the
world's checkpoint / stop check (:func:`backends.loop.stages.checkpoint_or_stop`:
the SIGTERM agreement and, on the checkpoint schedule, the save). A rollout rank makes them for version ``v`` just
before it samples the batch that needs ``v``, so its sampling still overlaps the trainer's next ``L`` updates.
Samples travel with ``isend`` and never block the rollout rank; a stop drains what is still in flight up to the
sender's sentinel.

**Checkpoints.** A checkpoint drains the pipeline: the batch after checkpoint step ``c`` is sampled by version
``c`` (:func:`sampling_version`), so nothing sampled ahead of it is lost or needed, and a run resumed from it trains
on the batches the uninterrupted run trained on. The trainers save their states (the actor; PPO's critic too) and
the algorithm's state (PPO's KL controller); the rollout ranks save nothing but take part, and on resume
take the step and the prompt stream's position from it (sent with each batch: dynamic sampling draws a varying
number of prompts per step).

**An SFT stage** (``sft.files``) runs on the trainer pool, which exports the policy RL starts from; the rollout
ranks build their engine from it once trainer rank 0 says the stage is over. It sends one word before every SFT
update, so a rollout rank waits one update at a time, under the update's deadline, not the whole stage in one
collective.

**Partial rollouts** (``offpolicy.partial_rollouts``, bounded mode): a rollout rank's generation takes newer
weights at chunk boundaries, one version a boundary up to ``step - 1`` (:mod:`backends.loop.partial_rollouts`); each
version is received there as between steps, with its evaluation and checkpoint / stop check, and the batch travels
with the oldest version its tokens hold.

**Dynamic sampling** (``algo.dynamic_sampling``): a rollout rank samples rounds for a batch until every share of the
pool holds informative groups, all with the weights the schedule gives that batch, so the bound holds and the run
is as reproducible as without it.
"""

from __future__ import annotations

import time
from typing import Any

import attrs
import torch
import torch.distributed as dist

import rlfunc as rf
from backends.checkpoint.dcp import load_checkpoint, save_checkpoint
from backends.config import ConfigError
from backends.data import PromptStream
from backends.distributed import watchdog
from backends.distributed.collectives import mean_over_ranks
from backends.distributed.placement import PlacementConfig, build_placement, colocated_on_pool, concat_padded
from backends.distributed.sample_channel import SampleReceiver, SampleSender, StalenessBound
from backends.distributed.weight_broadcast import WeightBroadcastError, broadcast_weights
from backends.loop.actor_loss import loss_seed
from backends.loop.algorithm import max_context, stamp_policy_version
from backends.loop.dynamic_sampling import GroupFiller, any_short, round_seed, rounds_metrics
from backends.loop.learner import Learner, learner_for, step_stats
from backends.loop.partial_rollouts import NewerWeightsAtBoundaries, StoppedAtBoundary, check_partial_rollouts
from backends.loop.sampling import sample_share
from backends.loop.stages import checkpoint_or_stop, dump_generations, evaluate_policy, export_final, summarize
from backends.loop.vocabulary import OffPolicyConfig
from backends.loop.weight_bridge import WeightBridge, weight_bridge
from backends.rollout.api import build_rollout, refuse_on_a_pool
from backends.training.engines import select_engine
from backends.training.reward_model import build_reward_model
from backends.training.roles import Roles
from backends.training.sft import sft_steps

__all__ = ["check_offpolicy", "lag", "run_split", "sampling_version"]


class RolloutPoolError(RuntimeError):
    """A rollout rank stopped taking part (it exited or froze) while the trainers pushed weights to it."""


def lag(cfg: OffPolicyConfig) -> int:
    """How many updates the rollout pool's weights trail the trainer's when it samples."""
    return {"sync": 0, "one_step_off": 1}.get(cfg.mode, cfg.max_staleness)


def sampling_version(step: int, lag: int, every: int = 0, start: int = 0) -> int:
    """The weights version batch ``step`` is sampled by: ``step - 1 - lag`` on the fixed schedule, but never older
    than the last checkpoint step before it (``every``: the checkpoint interval, 0 for none) nor than ``start``, the
    version a resumed run starts from. So a checkpoint drains the pipeline: nothing is sampled ahead of it, and a
    run resumed from it samples what the uninterrupted run sampled."""
    last_checkpoint = (step - 1) // every * every if every else 0
    return max(step - 1 - lag, last_checkpoint, start, 0)


def checkpoint_extra(
    step: int, drawn: int, run: Any, before: dict, wall_seconds: float, bound: Any, algorithm_state: dict | None = None
) -> dict:
    """What a split run's checkpoint carries besides the trained states, as trainer rank 0 (global rank 0) has it, on
    every rank (a collective of the world): the step, how many prompts the rollout pool had drawn by the batch of that
    step (``drawn``, sent with the batch: dynamic sampling draws a varying number), the evaluation before training, the
    wall time so far, the trainer's staleness counts (``bound``: its :class:`StalenessBound`; None on rollout
    ranks, whose ``drawn`` is not used) and the algorithm's state (``algorithm_state``)."""
    extra = None
    if bound is not None:
        extra = {
            "step": step,
            "drawn": drawn,
            "run_dir": str(run.run_dir),
            "eval_before": before,
            "wall_seconds": wall_seconds,
            "staleness": attrs.asdict(bound),
            "algorithm_state": algorithm_state or {},
        }
    box = [extra]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_offpolicy(cfg: Any, world_size: int) -> None:
    """Refuse, before any model is built, what the split loop does not do (yet)."""
    off = cfg.offpolicy
    if off.mode != "sync" and not off.rollout_ranks:
        raise ConfigError(
            f"offpolicy.mode={off.mode} needs a rollout pool: set offpolicy.rollout_ranks >= 1 "
            "(the last ranks of the world sample while the others train)"
        )
    if not off.rollout_ranks:
        return
    if off.partial_rollouts:  # first: it names the engine, where the pool's check below would only say "colocated"
        check_partial_rollouts(cfg)
    if cfg.debug.record_steps or cfg.debug.record_every:
        raise ConfigError(
            f"debug.record_steps / debug.record_every with offpolicy.rollout_ranks={off.rollout_ranks}: "
            "step records are written by the colocated loop (offpolicy.rollout_ranks=0)"
        )
    refuse_on_a_pool(
        cfg.rollout,
        f"offpolicy.rollout_ranks={off.rollout_ranks}",
        setting="offpolicy.rollout_ranks",
        colocated="offpolicy.rollout_ranks=0",
    )
    trainers = world_size - off.rollout_ranks
    if trainers < 1 or off.rollout_ranks > trainers:
        raise ConfigError(
            f"offpolicy.rollout_ranks={off.rollout_ranks} on {world_size} ranks: need at least one "
            "trainer rank and no more rollout ranks than trainer ranks"
        )
    refused = {
        f"actor.backend={cfg.actor.backend}": not select_engine(
            cfg.actor.backend, tp=cfg.actor.tp, pp=cfg.actor.pp
        ).runs_on_a_pool,
        "placement.mode=split (the trainer pool holds every trained role)": cfg.placement.mode == "split",
        "reward_model.shard=true (the rollout ranks hold a replicated reward model)": bool(cfg.reward_model.path)
        and cfg.reward_model.shard,
        "rollout.vllm.lora_sync=adapter (the pool receives merged weights)": cfg.rollout.vllm.lora_sync == "adapter",
    }
    for what, bad in refused.items():
        if bad:
            raise ConfigError(f"offpolicy.rollout_ranks={off.rollout_ranks} does not support {what} yet")


@attrs.frozen
class Split:
    """The pools and the groups of the split loop, as seen from this rank."""

    trainers: tuple[int, ...]
    rollouts: tuple[int, ...]
    placement: Any
    push_group: Any  #: trainer rank 0 and every rollout rank: the weights' broadcast
    lag: int
    bucket_bytes: int

    @property
    def is_trainer(self) -> bool:
        return dist.get_rank() in self.trainers

    def rollout_of(self, trainer: int) -> int:
        """The rollout rank that serves trainer (pool) rank ``trainer``."""
        return self.rollouts[trainer % len(self.rollouts)]

    def served_by(self, rollout_rank: int) -> list[int]:
        """The trainer pool ranks rollout (global) rank ``rollout_rank`` samples for."""
        return [t for t in range(len(self.trainers)) if self.rollout_of(t) == rollout_rank]


def build_split(cfg: Any, env: Any) -> Split:
    """The trainer and rollout pools (meshes reused from the PPO recipe's split placement) and the push group;
    a collective of every rank."""
    world, r = env.world_size, cfg.offpolicy.rollout_ranks
    placement = build_placement(PlacementConfig(mode="split", actor_pool=world - r, critic_pool=r), env)
    push = dist.new_group([0, *range(world - r, world)])
    return Split(
        trainers=placement.pools["actor"],
        rollouts=placement.pools["critic"],
        placement=placement,
        push_group=push,
        lag=lag(cfg.offpolicy),
        bucket_bytes=int(weight_bridge(cfg.rollout).bucket_mb * 2**20),
    )


def batch_payload(batch: rf.RolloutBatch, metrics: dict[str, float], drawn: int) -> dict[str, Any]:
    """A batch as the sample channel's payload: its fields (tensors or None), its sampling metrics and the prompt
    stream's position after it (what a checkpoint of its step records)."""
    return {
        "batch": {f.name: getattr(batch, f.name) for f in attrs.fields(type(batch))},
        "metrics": metrics,
        "drawn": drawn,
    }


def sample_step(
    rollout: Any,
    stream: PromptStream,
    tokenizer: Any,
    cfg: Any,
    step: int,
    split: Split,
    *,
    scorer: Any,
    environments: Any,
    reward_model: Any,
    pool_group: Any,
) -> dict[int, tuple[rf.RolloutBatch, dict, list]]:
    """This rollout rank's batch of ``step`` for each trainer (pool rank) it serves, with its metrics and the example
    of each row. One round of ``prompts_per_step`` prompts; trainer ``t``'s share is sampled with the seed and group
    ids the colocated loop gives data rank ``t``. With dynamic sampling, rounds continue (every round with the
    weights this batch is scheduled for) until every share of the whole rollout pool holds informative groups or
    ``algo.max_sampling_rounds`` is reached, as in the colocated loop (:mod:`backends.loop.dynamic_sampling`)."""
    mine, trainers = split.served_by(dist.get_rank()), len(split.trainers)
    dynamic = cfg.algo.dynamic_sampling
    fillers = {t: GroupFiller(cfg.prompts_per_step // trainers) for t in mine}
    out: dict[int, tuple[rf.RolloutBatch, dict, list]] = {}
    drawn = 0
    for rounds in range(1, cfg.algo.max_sampling_rounds + 1 if dynamic else 2):
        examples = stream.take(cfg.prompts_per_step)
        drawn += cfg.prompts_per_step
        for t in mine:
            share = examples[t::trainers]
            batch, rows, metrics = sample_share(
                rollout,
                share,
                scorer,
                tokenizer,
                cfg,
                seed=round_seed(cfg.seed, step, rounds, trainers, t),
                group_offset=(rounds - 1) * len(share),
                environments=environments,
                reward_model=reward_model,
            )
            out[t] = (batch, metrics, rows)
            fillers[t].add(batch, rows)
        if not dynamic or not any_short(list(fillers.values()), group=pool_group):
            break
    if not dynamic:
        return out
    for t, filler in fillers.items():
        batch, rows, informative = filler.result()
        out[t] = (batch, {**out[t][1], **rounds_metrics(rounds, drawn, informative)}, rows)
    return out


def receive_weights(rollout: Any, split: Split, version: int, device: Any) -> Any:
    """Version ``version`` of the trainer's weights into the rollout engine (a collective of the push group)."""
    with watchdog.phase("weight_sync", step=version, op=f"receive weights version {version} from rank 0"):
        with broadcast_weights(
            None, group=split.push_group, src=0, bucket_bytes=split.bucket_bytes, version=version, device=device
        ) as stream:
            if stream.version != version:
                raise RuntimeError(
                    f"rank {dist.get_rank()} expected weights version {version}, rank 0 sent {stream.version}"
                )
            return rollout.sync_weights(stream)


def push_weights(trainer: Learner, split: Split, version: int, bridge: WeightBridge) -> None:
    """Every trainer rank gathers the full weights; trainer rank 0 broadcasts them to the rollout pool."""
    with watchdog.phase("weight_sync", step=version, op=f"push weights version {version} to the rollout pool"):
        tensors = trainer.weights(bridge)
        if dist.get_rank() == 0:
            try:
                broadcast_weights(
                    tensors, group=split.push_group, src=0, bucket_bytes=split.bucket_bytes, version=version
                )
            except WeightBroadcastError as e:  # the trainer is fine: say which pool to look at
                raise RolloutPoolError(
                    f"pushing weights version {version} to rollout rank(s) "
                    f"{', '.join(map(str, split.rollouts))} failed; one of them exited or froze: {e}"
                ) from e
        else:
            for _ in tensors:
                pass


_SFT_UPDATE, _SFT_DONE = 1, 0  #: what trainer rank 0 tells the rollout pool during an SFT stage


def sft_signal(split: Split, word: int, what: str) -> None:
    """Trainer rank 0 tells the rollout pool that an SFT update starts (``_SFT_UPDATE``) or that the stage is over and
    the policy exported (``_SFT_DONE``); the other trainer ranks take no part."""
    if dist.get_rank() != 0:
        return
    try:
        dist.broadcast(torch.tensor([word]), src=0, group=split.push_group)
    except RuntimeError as e:  # gloo names no peer: say which pool to look at
        raise RolloutPoolError(
            f"telling rollout rank(s) {', '.join(map(str, split.rollouts))} {what} failed; one of them exited: {e}"
        ) from e


def wait_for_sft(split: Split, steps: int) -> None:
    """A rollout rank waits for the trainer pool's SFT stage of ``steps`` updates, one update at a time."""
    word, update = torch.tensor([_SFT_UPDATE]), 0
    while True:
        op = f"the trainer pool's SFT update {update + 1} of {steps}" if update < steps else "the SFT policy's export"
        with watchdog.phase("update", step=update - steps, op=f"waiting for {op}"):
            dist.broadcast(word, src=0, group=split.push_group)
        if int(word) == _SFT_DONE:
            return
        update += 1


def share_from_rollouts(obj: Any, split: Split) -> Any:
    """The rollout pool leader's ``obj`` (the held-out metrics) on every rank; a collective of the world."""
    box = [obj]
    dist.broadcast_object_list(box, src=split.rollouts[0])
    return box[0]


def rollout_rank_loop(ctx: Any, split: Split) -> None:
    """A rollout rank: the first weights (version 0, or the checkpoint's), the evaluation before training, then per
    step the versions its batch needs (:func:`sampling_version`; each one followed by the checkpoint / stop check the
    trainers make after pushing it) and this rank's batches sent to its trainers; at the end the last versions and
    the evaluation after training."""
    RolloutRank(ctx=ctx, split=split, pool_env=split.placement.env("critic")).run()


@attrs.define
class RolloutRank:
    """A rollout rank's state between steps: its engine, the prompt stream, the last weights version received."""

    ctx: Any
    split: Split
    pool_env: Any  #: this rank's DistEnv within the rollout pool
    rollout: Any = None
    reward_model: Any = None
    stream: Any = None
    start: int = 0
    received: int = 0
    before: dict = attrs.field(factory=dict)
    last_eval: dict = attrs.field(factory=dict)
    wall_before: float = 0.0
    t_start: float = attrs.field(factory=time.time)

    def run(self) -> None:
        ctx, cfg, split = self.ctx, self.ctx.cfg, self.split
        self.begin()
        sender = SampleSender(timeout_s=cfg.deadlines.process_group or 1800.0)
        stopped = False
        for step in range(self.start + 1, ctx.steps + 1):
            stopped = self.receive_through(sampling_version(step, split.lag, cfg.checkpoint.every, self.start))
            if stopped:
                break
            oldest, updates = self.received, None  # the batch's tokens are this version or newer
            rollout = self.rollout
            if cfg.offpolicy.partial_rollouts:
                updates = NewerWeightsAtBoundaries(
                    self, newest=step - 1, chunk_tokens=cfg.offpolicy.partial_chunk_tokens
                )
                rollout = rollout.with_weight_updates(updates)
            try:
                with watchdog.phase("rollout", step=step):
                    batches = sample_step(
                        rollout,
                        self.stream,
                        ctx.tokenizer,
                        cfg,
                        step,
                        split,
                        scorer=ctx.scorer,
                        environments=ctx.environments,
                        reward_model=self.reward_model,
                        pool_group=self.pool_env.group,
                    )
            except StoppedAtBoundary:
                stopped = True
                break
            for t, (batch, metrics, _) in batches.items():
                if updates is not None:
                    metrics = {**metrics, "partial/weight_loads": float(updates.loads)}
                payload = batch_payload(batch, metrics, self.stream.drawn)
                sender.send_samples(payload, dst=split.trainers[t], version=oldest, step=step)
            if cfg.dump_generations_every and step % cfg.dump_generations_every == 0:
                dump_samples(ctx.run, step, ctx.tokenizer, list(batches.values()), ctx.algorithm, self.pool_env)
        if not stopped:  # the updates after the last batch
            stopped = self.receive_through(ctx.steps)
        mine = split.served_by(dist.get_rank())
        sender.close([split.trainers[t] for t in mine])  # the sentinel; the trainers drain what they did not train on
        if not stopped and self.last_eval.get("step") != ctx.steps:  # else the last step's evaluation is final
            with watchdog.phase("eval", step=ctx.steps):
                share_from_rollouts(self.evaluate(), split)
        self.rollout.shutdown()

    def begin(self) -> None:
        """The engine (after the trainers' SFT stage), a reward model's replica, the checkpoint's step and stream
        position on a resume, the first weights and the evaluation before training."""
        ctx, cfg, run = self.ctx, self.ctx.cfg, self.ctx.run
        if run.resume_from is None and ctx.data.sft:  # the trainers write the policy this engine starts from
            wait_for_sft(self.split, sft_steps(cfg.sft, len(ctx.data.sft)))
        self.rollout = build_rollout(
            cfg.rollout,
            run.policy_path,
            ctx.tokenizer,
            seed=cfg.seed,
            device=ctx.env.device,
            max_context=max_context(cfg),
            group=self.pool_env.group,
        )
        if cfg.reward_model.path:  # the pool scores with a replicated reward model
            self.reward_model = build_reward_model(cfg.reward_model.path, self.pool_env, cfg.reward_model)
        drawn = 0
        if run.resume_from is not None:  # this pool trains nothing: it takes part in the load for the step and stream
            with watchdog.phase("checkpoint", op=f"load_checkpoint({run.resume_from})"):
                _, extra = load_checkpoint(run.resume_from, {}, config=run.loaded_config)
            self.start, self.before, self.wall_before = extra["step"], extra["eval_before"], extra["wall_seconds"]
            drawn = extra["drawn"]
        self.received = self.start
        self.rollout = receive_weights(self.rollout, self.split, self.start, ctx.env.device)
        if run.resume_from is None:
            with watchdog.phase("eval", step=0):
                self.before = self.evaluate() if cfg.eval.before_training else {}
            share_from_rollouts(self.before, self.split)
        self.stream = PromptStream(ctx.data.train, seed=cfg.seed, shuffle=cfg.data.shuffle, drawn=drawn)

    def evaluate(self) -> dict[str, float]:
        ctx = self.ctx
        return evaluate_policy(
            self.rollout, ctx.tokenizer, ctx.data, ctx.scorer, ctx.cfg, self.pool_env, ctx.environments
        )

    def receive_through(self, version: int) -> bool:
        """The versions after the last received one up to ``version`` into the engine, in order, each followed by what
        the trainers do after pushing it (an evaluation on ``eval.every``, the checkpoint / stop check); whether the
        run stops."""
        cfg = self.ctx.cfg
        while self.received < version:
            self.received += 1
            v = self.received
            self.rollout = receive_weights(self.rollout, self.split, v, self.ctx.env.device)
            if cfg.eval.every and v % cfg.eval.every == 0:  # with these weights, overlapping the next updates
                with watchdog.phase("eval", step=v):
                    self.last_eval = {"step": v, "metrics": self.evaluate()}
                share_from_rollouts(self.last_eval["metrics"], self.split)
            if checkpoint_or_stop(v, self.ctx.steps, cfg, self.ctx.run, self.save, self.ctx.log):
                return True
        return False

    def save(self, version: int) -> None:
        """No trained state here: the rollout rank joins the save's collectives (and checks that it sampled nothing
        ahead of a scheduled checkpoint)."""
        ctx, cfg, run = self.ctx, self.ctx.cfg, self.ctx.run
        wall = self.wall_before + time.time() - self.t_start
        extra = checkpoint_extra(version, self.stream.drawn, run, self.before, wall, bound=None)
        scheduled = version % cfg.checkpoint.every == 0 or version == ctx.steps  # not a stop's save
        if scheduled and self.stream.drawn != extra["drawn"]:
            raise RuntimeError(
                f"rollout rank {dist.get_rank()} drew {self.stream.drawn} prompts by checkpoint step {version}, "
                f"its batch says {extra['drawn']} (nothing may be sampled ahead of a checkpoint)"
            )
        with watchdog.phase("checkpoint", step=version, op=f"save_checkpoint({run.ckpt_dir}/step_{version})"):
            save_checkpoint(run.ckpt_dir, version, {}, extra, keep_last=cfg.checkpoint.keep_last, config=run.must_match)


def dump_samples(run: Any, step: int, tokenizer: Any, shares: list, algorithm: Any, pool_env: Any) -> None:
    """``generations/step_<step>.jsonl`` from the rollout pool (a collective of its ranks): its shares of the step
    (``(batch, metrics, rows)``) with the advantages the trainers compute from the same scores, where the algorithm's
    advantages are a function of the scores alone (no critic: its values live on the trainer pool)."""
    scored = []
    for batch, _, _ in shares:  # per share: each trainer's group ids start at 0
        if not algorithm.uses_critic:
            batch, _, _ = algorithm.advantages(batch, algorithm.initial_state(), env=pool_env)
        scored.append(batch)
    rows = [r for _, _, part in shares for r in part]
    dump_generations(run, step, tokenizer, concat_padded(scored), rows, group=pool_env.group)


def run_split(ctx: Any) -> dict:
    """The whole RL stage with rollout ranks of their own (every rank calls it); the summary on the trainers' rank 0."""
    cfg, run, mlog = ctx.cfg, ctx.run, ctx.metrics_log
    split = build_split(cfg, ctx.env)
    if not split.is_trainer:
        rollout_rank_loop(ctx, split)
        mlog.close()
        return {}
    tenv = split.placement.env("actor")
    sft = run.resume_from is None and bool(ctx.data.sft)  # a fresh start with SFT data trains and exports it first
    roles = Roles(
        placement=colocated_on_pool(tenv, split.placement.mesh("actor")),
        actor_engine=ctx.engine,
        critic_engine=ctx.critic_engine,
    )
    trainer = learner_for(
        ctx,
        roles,
        before_sft_update=lambda step: sft_signal(split, _SFT_UPDATE, f"SFT update {step + 1} starts"),
    )
    if sft:
        sft_signal(split, _SFT_DONE, "the SFT stage is over")
    loop = TrainerLoop(ctx=ctx, split=split, trainer=trainer, tenv=tenv)
    return loop.run()


@attrs.define
class TrainerLoop:
    """A trainer rank of a split run: receive each step's batch, train on it, push the new weights."""

    ctx: Any
    split: Split
    trainer: Learner
    tenv: Any  #: this rank's DistEnv within the trainer pool
    start: int = 0
    before: dict = attrs.field(factory=dict)
    wall_before: float = 0.0
    bound: StalenessBound | None = None
    drawn: int = 0  #: the rollout pool's prompt stream position after the last batch trained on

    def run(self) -> dict:
        ctx, cfg, run, split = self.ctx, self.ctx.cfg, self.ctx.run, self.split
        bridge = weight_bridge(cfg.rollout)  # the rollout pool's engine receives full weights in its dtype
        self.bound = StalenessBound(max_staleness=split.lag)
        if run.resume_from is not None:  # the trained states with their optimizers, every rank's RNG, the counts
            with watchdog.phase("checkpoint", op=f"load_checkpoint({run.resume_from})"):
                states, extra = load_checkpoint(run.resume_from, self.trainer.states(), config=run.loaded_config)
            self.trainer.load(states, extra["algorithm_state"])
            self.start, self.before, self.wall_before = extra["step"], extra["eval_before"], extra["wall_seconds"]
            self.bound, self.drawn = StalenessBound(**extra["staleness"]), extra["drawn"]
        push_weights(self.trainer, split, self.start, bridge)
        if run.resume_from is None:
            self.before = share_from_rollouts(None, split)
            ctx.metrics_log.log(0, self.before)
        receiver = SampleReceiver(timeout_s=cfg.deadlines.process_group or 1800.0)
        src = split.rollout_of(self.tenv.rank)
        preempted_at, last_eval = None, {}
        for step in range(self.start + 1, ctx.steps + 1):
            stats = self.step(receiver, src, step)
            t_sync = time.time()
            push_weights(self.trainer, split, step, bridge)
            stats["sync_time_s"] = time.time() - t_sync
            if cfg.eval.every and step % cfg.eval.every == 0:  # the rollout pool evaluates these weights
                with watchdog.phase(
                    "eval", step=step, op=f"waiting for the evaluation of step {step} by the rollout pool"
                ):
                    last_eval = {"step": step, "metrics": share_from_rollouts(None, split)}
                stats.update(last_eval["metrics"])
            ctx.metrics_log.log(step, stats)
            if checkpoint_or_stop(
                step, ctx.steps, cfg, run, self.save, ctx.log
            ):  # the rollout pool makes the same call
                preempted_at = step
                break
        dropped = receiver.drain(src=src)  # the batches sampled ahead of a stop, up to the sentinel
        if preempted_at is not None:
            ctx.log.warning(f"stopped with {dropped} batch(es) from rank {src} in flight, dropped")
            summary = {"preempted_at_step": preempted_at, "run_dir": str(run.run_dir)}
        else:
            summary = self.finish(last_eval)
        ctx.metrics_log.close()
        return summary

    def finish(self, last_eval: dict) -> dict:
        ctx, run, steps = self.ctx, self.ctx.run, self.ctx.steps
        if last_eval.get("step") == steps:  # the last step's evaluation is the final one
            after = last_eval["metrics"]
        else:
            after = share_from_rollouts(None, self.split)
            ctx.metrics_log.log(steps, after)
        with watchdog.phase("checkpoint", step=steps, op="export"):  # the rollout pool cannot join a save here
            export_final(lambda: self.trainer.export(run, ctx.tokenizer), run, steps, save=None)
        return summarize(
            ctx.cfg,
            run,
            ctx.env,
            self.before,
            after,
            steps=steps,
            wall=self.wall_before + time.time() - ctx.t_start,
            title=self.trainer.title,
        )

    def save(self, step: int) -> None:
        """The states sharded with their optimizers, RNG, the step, the pool's stream position, the algorithm's
        state."""
        ctx, run = self.ctx, self.ctx.run
        extra = checkpoint_extra(
            step,
            self.drawn,
            run,
            self.before,
            self.wall_before + time.time() - ctx.t_start,
            bound=self.bound,
            algorithm_state=self.trainer.state,
        )
        with watchdog.phase("checkpoint", step=step, op=f"save_checkpoint({run.ckpt_dir}/step_{step})"):
            save_checkpoint(
                run.ckpt_dir,
                step,
                self.trainer.states(),
                extra,
                keep_last=ctx.cfg.checkpoint.keep_last,
                config=run.must_match,
            )

    def step(self, receiver: SampleReceiver, src: int, step: int) -> dict[str, float]:
        """Receive batch ``step``, check its staleness, stamp its policy version and train on it (the old log-probs
        recomputed: the batch is off-policy); the step's metrics (the rollout pool's sampling metrics, the
        learner's, the staleness counts)."""
        t0, cfg = time.time(), self.ctx.cfg
        with watchdog.phase("rollout", step=step, op=f"waiting for the batch of step {step} from rank {src}"):
            payload, version, sent_step = receiver.recv_samples(src=src)
        if sent_step != step:
            raise RuntimeError(
                f"trainer rank {dist.get_rank()} expected the batch of step {step}, rank {src} sent step {sent_step}"
            )
        if not self.bound.admit(step - 1, version):  # the fixed schedule never goes past the bound: a bookkeeping error
            raise RuntimeError(
                f"the batch of step {step} from rank {src} is {self.bound.last} versions old, past the "
                f"bound {self.bound.max_staleness}"
            )
        self.drawn = payload["drawn"]
        batch, provenance = stamp_policy_version(rf.RolloutBatch(**payload["batch"]), version, current=step - 1)
        waited = time.time() - t0
        with watchdog.phase("update", step=step, op="log-probs, advantages and the update"):
            batch, metrics = self.trainer.train(batch, step, seed=loss_seed(cfg.seed, step, replica=self.tenv.rank))
        times = {
            "step_time_s": time.time() - t0,
            "rollout_time_s": waited,
            "update_time_s": time.time() - t0 - waited,
            **{f"time/{k}_s": v for k, v in self.trainer.roles.step_times().items()},
        }
        return {
            **mean_over_ranks(payload["metrics"], self.tenv.group),
            **step_stats(batch, times, self.tenv.world_size, group=self.tenv.group),
            **metrics,
            **{k: float(v) for k, v in provenance.items()},
            **self.bound.metrics(),
        }
