"""Held-out evaluation: sample on the validation prompts, score with the run's reward, report per data source.

Metrics (verl's ``val/<source>/...`` convention), with ``n`` = ``eval.n``:

- ``val/mean@n``, ``val/<source>/mean@n``: the share of samples that succeed (score reaches ``reward.max_score``),
  ``n`` samples per prompt at ``eval.temperature`` / ``eval.top_p`` / ``eval.top_k``;
- ``val/score@n``, ``val/<source>/score@n``: the mean score of those samples;
- ``val/greedy@1``, ``val/<source>/greedy@1``: the share of prompts whose greedy (temperature 0) answer succeeds,
  when ``eval.greedy``.

Every rank of ``env`` samples its share of the prompts; the sums are all-reduced over ``env.group``, so every
rank returns the same numbers. A rank whose share is empty (fewer held-out prompts than ranks) still samples
one prompt and counts nothing of it: the ranks of a tensor-parallel vLLM engine gather each other's prompts in
every ``generate`` (and every multi-turn turn), so a rank that skipped would leave its peers waiting. With
``multi_turn`` (``rollout.multi_turn.max_turns > 1``) each sample is a trajectory through the run's environments,
scored on its last model turn plus its turn rewards, as in training.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs
import torch
import torch.distributed as dist

from backends.data import Example
from backends.rewards import RewardScorer
from backends.rollout.agent_loop import sample
from backends.rollout.common import SamplingConfig, answer_texts
from backends.rollout.environments import MultiTurnConfig

__all__ = ["EvalConfig", "evaluate"]


@attrs.frozen
class EvalConfig:
    """When and how the held-out prompts are evaluated (verl's ``val_kwargs``)."""

    #: evaluate every N RL steps; 0: only before and after training
    every: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    files: tuple[str, ...] = ()  #: held-out data files; empty: data.val_files
    n: int = attrs.field(default=4, validator=attrs.validators.ge(1))  #: samples per prompt for mean@n
    #: sampling temperature of the mean@n samples
    temperature: float = attrs.field(default=1.0, validator=attrs.validators.ge(0))
    top_p: float = 1.0  #: nucleus mass of the mean@n samples
    top_k: int = 0  #: top-k of the mean@n samples (0: off)
    greedy: bool = True  #: also report greedy@1 (one temperature-0 answer per prompt)
    #: use the first N held-out prompts (0: all)
    max_prompts: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    before_training: bool = True  #: evaluate once before the first RL step


@torch.no_grad()
def evaluate(
    rollout: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    scorer: RewardScorer,
    cfg: EvalConfig,
    env: Any,
    *,
    max_new_tokens: int,
    seed: int = 10_007,
    multi_turn: MultiTurnConfig = MultiTurnConfig(),
    environments: Callable[[Example], Any] | None = None,
    chat_template: str = "auto",
) -> dict[str, float]:
    """The metrics of the module docstring over ``examples`` (see there)."""
    examples = list(examples[: cfg.max_prompts] if cfg.max_prompts else examples)
    sources = sorted({e.source for e in examples})
    mine = examples[env.rank :: env.world_size]
    padding = not mine and bool(examples)  # sampled so the engine's peers are not left waiting; not counted
    if padding:
        mine = examples[:1]
    sampled = SamplingConfig(
        n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_new_tokens=max_new_tokens
    )
    # per source: [successes, score sum, samples] sampled, then [successes, prompts] greedy
    sums = torch.zeros(len(sources), 5, dtype=torch.float64)
    index = {s: i for i, s in enumerate(sources)}
    passes = [(sampled, 0)] + ([(attrs.evolve(sampled, n=1, temperature=0.0), 3)] if cfg.greedy else [])
    for sampling, column in passes:
        if not mine:
            continue
        batch = sample(
            rollout,
            mine,
            tokenizer,
            sampling,
            seed=seed + env.rank,
            multi_turn=multi_turn,
            environments=environments,
            chat_template=chat_template,
        ).batch
        if padding:
            continue
        rows = [mine[g] for g in batch.group_ids.tolist()]
        outcome = scorer.score(answer_texts(tokenizer, batch), rows).scores
        success = (outcome >= scorer.cfg.max_score).double()
        scores = outcome if batch.token_rewards is None else outcome + batch.token_rewards.sum(-1).to(outcome.dtype)
        for row, ok, score in zip(rows, success.tolist(), scores.tolist()):
            s = index[row.source]
            sums[s, column] += ok
            if column == 0:
                sums[s, 1] += score
                sums[s, 2] += 1
            else:
                sums[s, 4] += 1
    if env.world_size > 1:
        dist.all_reduce(sums, group=getattr(env, "group", None))
    return _metrics(sums, sources, cfg)


def _metrics(sums: torch.Tensor, sources: list[str], cfg: EvalConfig) -> dict[str, float]:
    out: dict[str, float] = {}
    for prefix, row in [("val", sums.sum(0))] + [(f"val/{s}", sums[i]) for i, s in enumerate(sources)]:
        if prefix != "val" and len(sources) == 1:
            continue  # one source: its metrics are the overall ones
        samples, prompts = max(float(row[2]), 1.0), max(float(row[4]), 1.0)
        out[f"{prefix}/mean@{cfg.n}"] = float(row[0]) / samples
        out[f"{prefix}/score@{cfg.n}"] = float(row[1]) / samples
        if cfg.greedy:
            out[f"{prefix}/greedy@1"] = float(row[3]) / prompts
    return out
