"""A step's samples: the rollout engine's responses (single-turn, or multi-turn trajectories with environments and
tools), their scores (the reward functions, a reward model, an environment's turn rewards, DAPO's overlong shaping)
and DAPO's dynamic sampling (:mod:`backends.loop.dynamic_sampling`), the same for every algorithm and placement.

:func:`sample_and_score` is a data-parallel rank's share of a step in the colocated loop; the split loop's rollout
ranks sample their trainers' shares with :func:`sample_share` and the same :func:`score_batch`, with the seeds the
colocated loop would give those data ranks (:func:`backends.loop.dynamic_sampling.round_seed`).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

import rlfunc as rf
from backends.data import Example, PromptStream
from backends.distributed import watchdog
from backends.distributed.collectives import mean_over_ranks
from backends.loop.dynamic_sampling import GroupFiller, any_short, round_seed, rounds_metrics
from backends.rewards import RewardScorer
from backends.rollout.agent_loop import sample
from backends.rollout.common import answer_texts
from backends.training.reward_model import combine_rewards
from backends.training.reward_model import score as reward_model_score

__all__ = ["sample_and_score", "sample_share", "score_batch"]


def sample_share(
    rollout: Any,
    examples: Sequence[Example],
    scorer: RewardScorer,
    tokenizer: Any,
    cfg: Any,
    *,
    seed: int,
    group_offset: int = 0,
    environments: Any = None,
    reward_model: Any = None,
) -> tuple[rf.RolloutBatch, list, dict[str, float]]:
    """``rollout.n`` samples (or trajectories, with ``environments``) of each of ``examples`` with ``seed``, scored:
    the batch (group ids from ``group_offset``), each row's example and the sampling / reward metrics."""
    episodes = sample(
        rollout,
        list(examples),
        tokenizer,
        cfg.rollout,
        seed=seed,
        multi_turn=cfg.rollout.multi_turn,
        environments=environments,
        group_ids=torch.arange(len(examples)) + group_offset,
        chat_template=cfg.data.chat_template,
    )
    rows = [examples[g - group_offset] for g in episodes.batch.group_ids.tolist()]
    with watchdog.phase("reward", op="reward functions / reward model on the sampled responses"):
        batch, metrics = score_batch(
            episodes.batch,
            rows,
            scorer,
            tokenizer,
            cfg,
            rollout.eos_token_ids,
            reward_model,
            given_rewards=episodes.given_rewards,
        )
    return batch, rows, {**metrics, **episodes.metrics}


def sample_and_score(
    rollout: Any,
    stream: PromptStream,
    scorer: RewardScorer,
    tokenizer: Any,
    cfg: Any,
    step: int,
    engine: Any,
    actor: Any,
    *,
    env: Any,
    reward_model: Any = None,
    environments: Any = None,
) -> tuple[rf.RolloutBatch, list, dict[str, float]]:
    """This rank's scored batch for ``step``, the example of each row and the sampling metrics averaged over the
    actor's ranks (``env``: their pool).

    Every round draws ``prompts_per_step`` prompts; each rank samples and scores its shard of them (megatron's
    tensor / pipeline peers each one shard of their replica's prompts, gathered after: ``Engine.sample_shard``).
    With dynamic sampling, only groups whose scores differ are kept, and rounds continue until every replica holds
    its share of informative groups or ``algo.max_sampling_rounds`` is reached; a replica still short then fills up
    with the last round's other groups (zero advantage: no gradient under a group estimator). Every rank runs the
    same number of rounds.
    """
    shard, shards = engine.sample_shard(actor)
    share = cfg.prompts_per_step // engine.data_parallel(actor)[1]
    dynamic = cfg.algo.dynamic_sampling
    filler, rounds, drawn = GroupFiller(share), 0, 0
    for rounds in range(1, cfg.algo.max_sampling_rounds + 1 if dynamic else 2):
        examples = stream.take(cfg.prompts_per_step)[shard::shards]
        drawn += cfg.prompts_per_step
        batch, rows, metrics = sample_share(
            rollout,
            examples,
            scorer,
            tokenizer,
            cfg,
            seed=round_seed(cfg.seed, step, rounds, shards, shard),
            environments=environments,
            reward_model=reward_model,
        )
        batch, rows = engine.replica_samples(actor, batch, rows)
        batch = batch.replace(group_ids=batch.group_ids + (rounds - 1) * share)
        if not dynamic:
            return batch, rows, mean_over_ranks(metrics, env.group)
        filler.add(batch, rows)
        if not any_short([filler], group=env.group):
            break
    batch, rows, informative = filler.result()
    return batch, rows, mean_over_ranks({**rounds_metrics(rounds, drawn, informative), **metrics}, env.group)


def score_batch(
    batch: rf.RolloutBatch,
    rows: list,
    scorer: RewardScorer,
    tokenizer: Any,
    cfg: Any,
    eos_token_ids: tuple[int, ...],
    reward_model: Any = None,
    *,
    given_rewards: Sequence[float | None] | None = None,
) -> tuple[rf.RolloutBatch, dict[str, float]]:
    """The batch with its scores (the reward functions on the answer, or the reward an agent returned for its
    trajectory (``given_rewards``, None where it left it to them), plus a reward model's weighted score, a
    multi-turn trajectory's turn rewards and DAPO's overlong shaping), the reward functions' success rate and, with
    the overlong filter, a loss mask without truncated responses."""
    result = scorer.score(answer_texts(tokenizer, batch), rows)
    scores, extra = result.scores, {}
    if given_rewards is not None:
        given = [float("nan") if g is None else float(g) for g in given_rewards]
        given_t = torch.tensor(given, dtype=scores.dtype)
        scores = torch.where(torch.isnan(given_t), scores, given_t)
    if batch.token_rewards is not None:  # the environment's per-turn rewards
        scores = scores + batch.token_rewards.sum(-1).to(scores.dtype)
    if reward_model is not None:
        learned = reward_model_score(reward_model, batch)
        scores = combine_rewards(scores, learned, rm_weight=cfg.reward_model.weight)
        extra = {"reward/model": learned.mean().item()}
    if cfg.reward.overlong_buffer_len:
        scores = scores + rf.overlong_penalty(
            batch.response_mask.sum(-1),
            max_response_length=cfg.rollout.max_new_tokens,
            buffer_length=cfg.reward.overlong_buffer_len,
            penalty_factor=cfg.reward.overlong_penalty_factor,
        )
    truncated = rf.truncated_responses(
        batch.response_ids, response_mask=batch.response_mask, eos_token_ids=eos_token_ids
    )
    batch = batch.replace(scores=scores)
    if cfg.algo.overlong_filter:
        batch = batch.replace(loss_mask=rf.loss_tokens(batch) & ~truncated[:, None])
    success = (result.scores >= cfg.reward.max_score).float()
    return batch, {
        **result.metrics(),
        **extra,
        "success_rate": success.mean().item(),
        "truncated_rate": truncated.float().mean().item(),
    }
