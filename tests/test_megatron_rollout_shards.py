"""Megatron's tensor-parallel peers sample one shard each of their replica's prompts (issue 37, finding 6).

Before, every rank of a TP x PP replica sampled the replica's whole share and one copy was kept (8 times the
rollout at TP4 x PP2). Now the step's prompts are split over every rank of the world and each replica gathers
its ranks' scored shards. The contract, checked here on 2 real gloo ranks with megatron's own TP = 2 groups:
the replica's batch is identical on its ranks, each rank sampled half the prompts, and the batch is the
concatenation of what the FSDP engine's 2 ranks sample for the same seed (same prompts, seeds and tokens).
What changes against the old code at TP x PP > 1: the samples are those of the data-parallel layout, not those
of one rank drawing the whole share with the replica's seed; at TP = PP = 1 nothing changes.
"""

from __future__ import annotations

import types

import attrs
import pytest
import torch
import torch.distributed as dist

from backends.distributed.sample_shards import gather_shards, sampling_shard
from backends.models import TinyModelConfig, write_tiny_model
from tests.distributed import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.megatron]

TINY = TinyModelConfig(
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=96,
    max_position_embeddings=64,
    initializer_range=0.2,
    seed=4,
)


def _examples(tokenizer):
    from backends.data import Example

    sums = [(a, b) for a, b in zip(range(10, 18), range(3, 11))]
    return [
        Example(
            prompt_ids=tuple(tokenizer.encode(f"{a}+{b}=")),
            ground_truth=str(a + b),
            source="default",
            columns={},
            where=f"train.jsonl:line {i + 1}",
        )
        for i, (a, b) in enumerate(sums)
    ]


class _CountingRollout:
    """The rollout engine, with the number of prompts of each ``generate`` call recorded in ``sampled``."""

    def __init__(self, rollout, sampled: list[int]) -> None:
        self.rollout, self.sampled = rollout, sampled

    def __getattr__(self, name):
        return getattr(self.rollout, name)

    def generate(self, prompts, *args, **kwargs):
        self.sampled.append(len(prompts))
        return self.rollout.generate(prompts, *args, **kwargs)


def _shards_worker(rank, world_size, path):
    pytest.importorskip("megatron.core")
    from backends.data import PromptStream
    from backends.distributed.setup import init_distributed
    from backends.loop.sampling import sample_and_score
    from backends.models import load_tokenizer
    from backends.rewards import RewardConfig, RewardScorer
    from backends.rollout.native import build_native_rollout
    from backends.training.engines import select_engine
    from backends.training.megatron.parallel import destroy_model_parallel, init_model_parallel
    from experiments import grpo

    env = init_distributed(device="cpu")
    dims = init_model_parallel(tp=2, pp=1)
    tokenizer = load_tokenizer(path)
    rollout = build_native_rollout(path, tokenizer)
    scorer = RewardScorer(RewardConfig(fn=("exact",), workers=0))
    cfg = attrs.evolve(
        grpo.Config(), prompts_per_step=4, seed=3, rollout=attrs.evolve(grpo.Config().rollout, n=2, max_new_tokens=5)
    )
    sampled: list[int] = []
    rollout = _CountingRollout(rollout, sampled)
    out = {}
    for name, engine, state in (
        ("megatron", select_engine("megatron", tp=2), types.SimpleNamespace(dims=dims)),
        ("fsdp", select_engine("fsdp"), types.SimpleNamespace(env=env)),
    ):
        sampled.clear()
        stream = PromptStream(_examples(tokenizer), seed=cfg.seed)
        batch, rows, _ = sample_and_score(
            rollout, stream, scorer, tokenizer, cfg, 1, engine, state, env=types.SimpleNamespace(group=None)
        )
        out[name] = {
            "batch": batch,
            "rows": [r.where for r in rows],
            "sampled": list(sampled),
            "shard": engine.sample_shard(state),
        }
    fsdp_shards = [None] * world_size
    dist.all_gather_object(fsdp_shards, (out["fsdp"]["batch"], out["fsdp"]["rows"]))
    out["fsdp_shards"] = fsdp_shards
    destroy_model_parallel()
    return out


def test_tensor_parallel_peers_sample_one_shard_each_and_share_the_replica_batch(tmp_path):
    pytest.importorskip("megatron.core")
    from backends.distributed.placement import concat_padded

    path = write_tiny_model(tmp_path / "model", TINY)
    r0, r1 = run_distributed(_shards_worker, 2, str(path), timeout=300)
    m0, m1 = r0["megatron"], r1["megatron"]
    assert (m0["shard"], m1["shard"]) == ((0, 2), (1, 2))
    assert m0["sampled"] == m1["sampled"] == [2]  # 2 of the step's 4 prompts each, not 4 on each rank
    for field in ("prompt_ids", "response_ids", "response_mask", "rollout_logprobs", "group_ids", "scores"):
        assert torch.equal(getattr(m0["batch"], field), getattr(m1["batch"], field)), field
    assert m0["rows"] == m1["rows"]
    assert m0["batch"].group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    # the replica's batch is the FSDP ranks' batches, in rank order, rank 1's groups after rank 0's
    (b0, rows0), (b1, rows1) = r0["fsdp_shards"]
    expected = concat_padded([b0, b1.replace(group_ids=b1.group_ids + 2)])
    for field in ("prompt_ids", "response_ids", "rollout_logprobs", "group_ids", "scores"):
        assert torch.equal(getattr(m0["batch"], field), getattr(expected, field)), field
    assert m0["rows"] == rows0 + rows1
    assert r0["fsdp"]["shard"] == (0, 2) and r0["fsdp"]["sampled"] == [2]


def test_a_replica_of_one_rank_samples_its_data_parallel_share_unchanged():
    assert sampling_shard(3, 8, None) == (3, 8)
    batch = types.SimpleNamespace(response_ids=torch.zeros(2, 1))
    assert gather_shards(batch, ["a", "b"], None) == (batch, ["a", "b"])
