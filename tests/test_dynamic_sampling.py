"""DAPO's dynamic sampling in the GRPO recipe, on a real tiny model, rollout engine and reward function."""

from __future__ import annotations

import json

import pytest

import rlfunc as rf
from backends.config import apply_overrides
from backends.data import PromptStream, load_examples
from backends.distributed.setup import init_distributed
from backends.loop.sampling import sample_and_score
from backends.models import TinyModelConfig, load_tokenizer, write_tiny_model
from backends.rewards import RewardScorer
from backends.rollout.api import build_rollout
from backends.training.engines import select_engine
from backends.training.optim import OptimConfig
from experiments import grpo

pytestmark = pytest.mark.data

REWARD = '''
def starts_with_a_digit(response, ground_truth):
    """A random tiny model starts with a digit now and then: some groups disagree, most do not."""
    return 1.0 if response[:1].isdigit() else 0.0
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dynamic")
    model_dir = write_tiny_model(
        root / "model",
        TinyModelConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=96, seed=1),
    )
    (root / "train.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "0"}) + "\n" for i in range(40)))
    (root / "reward.py").write_text(REWARD)
    env = init_distributed(device="cpu")
    tokenizer = load_tokenizer(model_dir)
    return root, model_dir, env, tokenizer


def sample(setup, *overrides):
    root, model_dir, env, tokenizer = setup
    cfg = apply_overrides(
        grpo.Config(),
        [
            "prompts_per_step=8",
            "rollout.n=4",
            "rollout.max_new_tokens=4",
            f"reward.fn={root / 'reward.py'}:starts_with_a_digit",
            "reward.workers=0",
            *overrides,
        ],
    )
    examples, _ = load_examples([str(root / "train.jsonl")], cfg.data, tokenizer)
    engine = select_engine("fsdp", fsdp=cfg.actor.fsdp)
    actor = engine.build_actor(model_dir, env, OptimConfig())
    rollout = build_rollout(cfg.rollout, model_dir, tokenizer)
    stream = PromptStream(examples, seed=0)
    batch, rows, stats = sample_and_score(
        rollout, stream, RewardScorer(cfg.reward), tokenizer, cfg, 1, engine, actor, env=env
    )
    return batch, rows, stats, stream


def test_dynamic_sampling_fills_the_batch_with_groups_whose_rewards_differ(setup):
    batch, rows, stats, stream = sample(setup, "algo.dynamic_sampling=true", "algo.max_sampling_rounds=8")
    groups = batch.group_ids.tolist()
    assert len(set(groups)) == 8 and all(groups.count(g) == 4 for g in set(groups))  # the batch is full
    assert rf.informative_groups(batch.scores, group_ids=batch.group_ids).all()  # every group carries signal
    assert stats["sampling/informative_groups"] == 1.0
    assert (
        stats["sampling/rounds"] > 1 and stats["sampling/prompts_drawn"] == 8 * stats["sampling/rounds"] == stream.drawn
    )
    for g, example in zip(groups, rows):  # each row still knows its prompt: rows of a group share one example
        assert rows[groups.index(g)] is example
    prompts = {tuple(batch.prompt_ids[i][batch.prompt_mask[i]].tolist()) for i in range(len(rows))}
    assert prompts == {e.prompt_ids for e in rows}
    adv, _ = rf.grpo(batch.scores, group_ids=batch.group_ids, response_mask=batch.response_mask)
    assert (adv.abs().sum(-1) > 0).all()  # no zero-advantage row left


def test_at_the_round_cap_the_batch_fills_up_with_what_was_drawn(setup):
    batch, rows, stats, _ = sample(setup, "algo.dynamic_sampling=true", "algo.max_sampling_rounds=1")
    assert len(set(batch.group_ids.tolist())) == 8 and len(rows) == 32
    assert stats["sampling/rounds"] == 1.0 and stats["sampling/informative_groups"] < 1.0


def test_without_dynamic_sampling_one_round_is_drawn(setup):
    batch, rows, stats, stream = sample(setup)
    assert stream.drawn == 8 and len(rows) == 32 and "sampling/rounds" not in stats
    from backends.rollout.api import decode_responses

    texts = decode_responses(setup[3], batch)
    assert batch.scores.tolist() == [1.0 if t[:1].isdigit() else 0.0 for t in texts]
