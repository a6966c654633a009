"""Reward-model role: scores equal a plain HF forward at the last real token; loading errors; combine_rewards.

The single-process tests run the replicated reward model (no process group). One 2-rank gloo spawn
checks the FSDP2-sharded variant against the replicated one.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from backends.models import (
    TinyModelConfig,
    build_char_tokenizer,
    write_tiny_model,
    write_tiny_reward_model,
    write_tiny_value_model,
)
from backends.training.reward_model import (
    RewardModelConfig,
    build_reward_model,
    combine_rewards,
    load_reward_model,
    score,
)
from rlfunc.batch import RolloutBatch, select
from tests.distributed import run_distributed

TINY = TinyModelConfig(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, max_position_embeddings=64, seed=3
)
# left-padded prompts, right-padded responses of different lengths; row 3 has an empty response
PROMPT_LENS = [6, 3, 5, 2, 4, 6, 1, 5]
RESPONSE_LENS = [7, 1, 4, 0, 7, 2, 3, 6]


def make_batch(seed: int = 0, prompt_lens=PROMPT_LENS, response_lens=RESPONSE_LENS, vocab: int = 80) -> RolloutBatch:
    """Real tokens are ids >= 4 (never the pad id); padding holds junk ids, also never the pad id."""
    g = torch.Generator().manual_seed(seed)
    b, p, t = len(prompt_lens), max(prompt_lens), max(max(response_lens), 1)
    return RolloutBatch(
        prompt_ids=torch.randint(4, vocab, (b, p), generator=g),
        prompt_mask=torch.arange(p).flip(0)[None, :] < torch.tensor(prompt_lens)[:, None],
        response_ids=torch.randint(4, vocab, (b, t), generator=g),
        response_mask=torch.arange(t)[None, :] < torch.tensor(response_lens)[:, None],
        group_ids=torch.arange(b) // 2,
        scores=torch.rand(b, generator=g),
    )


def real_tokens(batch: RolloutBatch, i: int) -> torch.Tensor:
    return torch.cat([batch.prompt_ids[i][batch.prompt_mask[i]], batch.response_ids[i][batch.response_mask[i]]])


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return str(write_tiny_reward_model(tmp_path_factory.mktemp("rm") / "model", TINY))


@pytest.fixture(scope="module")
def hf_rm(rm_dir):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(rm_dir, local_files_only=True).eval()


@pytest.fixture(scope="module")
def rm(rm_dir):
    return build_reward_model(rm_dir, None, RewardModelConfig(micro_batch_size=3))


# ------------------------------------------------------------------------------------ scores


def test_scores_equal_plain_hf_forward_per_row(rm, hf_rm):
    batch = make_batch(0)
    got = score(rm, batch)
    assert got.shape == (8,) and got.dtype == torch.float32 and not got.requires_grad
    with torch.no_grad():
        # each row alone, unpadded: HF pools at the last token (no pad ids present)
        expected = torch.stack([hf_rm(input_ids=real_tokens(batch, i)[None]).logits[0, 0] for i in range(8)])
    np.testing.assert_allclose(got.numpy(), expected.numpy(), atol=1e-5, rtol=1e-5)
    assert got.std() > 0  # the rows really differ


def test_scores_equal_hf_convention_with_pad_token_filled(rm, hf_rm):
    # HF's own batched pooling (rightmost token != pad_token_id) after writing pad ids into the padding
    batch = make_batch(1)
    pad = hf_rm.config.pad_token_id
    input_ids = torch.cat(
        [
            batch.prompt_ids.masked_fill(~batch.prompt_mask, pad),
            batch.response_ids.masked_fill(~batch.response_mask, pad),
        ],
        dim=1,
    )
    attention_mask = torch.cat([batch.prompt_mask, batch.response_mask], dim=1).long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = hf_rm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits[:, 0]
    np.testing.assert_allclose(score(rm, batch).numpy(), expected.numpy(), atol=1e-5, rtol=1e-5)


def test_pad_equal_to_eos_scores_the_eos_token(rm, hf_rm):
    # A tokenizer whose pad token is its EOS: a response ending in that id is scored AT that token
    # (mask-based index), where HF's pad-id rule would fall back to the token before it.
    batch = make_batch(2)
    pad = hf_rm.config.pad_token_id
    lens = torch.tensor(RESPONSE_LENS)
    rows = torch.nonzero(lens > 0).squeeze(1)
    response_ids = batch.response_ids.clone()
    response_ids[rows, lens[rows] - 1] = pad
    batch = batch.replace(response_ids=response_ids)
    got = score(rm, batch)
    with torch.no_grad():
        for i in range(8):
            ids = real_tokens(batch, i)[None]
            per_token = hf_rm.score(hf_rm.model(input_ids=ids).last_hidden_state)[0, :, 0]
            assert got[i] == pytest.approx(float(per_token[-1]), abs=1e-5)
            if RESPONSE_LENS[i] > 0:
                assert abs(float(per_token[-1] - per_token[-2])) > 1e-4  # the two rules would differ


def test_micro_batch_size_and_determinism(rm):
    batch = make_batch(0)
    a = score(rm, batch)
    assert torch.equal(a, score(rm, batch))  # deterministic
    for mbs in (1, 8):
        np.testing.assert_allclose(score(rm, batch, micro_batch_size=mbs).numpy(), a.numpy(), atol=1e-5, rtol=1e-5)
    # a row's score does not depend on the other rows (padding / batch composition)
    np.testing.assert_allclose(score(rm, select(batch, [4, 0])).numpy(), a[[4, 0]].numpy(), atol=1e-5, rtol=1e-5)


def test_no_grad_and_eval(rm, rm_dir):
    assert not rm.module.training
    assert all(not p.requires_grad for p in rm.module.parameters())
    before = {k: v.clone() for k, v in rm.module.state_dict().items()}
    score(rm, make_batch(0))
    assert all(torch.equal(before[k], v) for k, v in rm.module.state_dict().items())
    # a module can be passed in directly
    model, _ = load_reward_model(rm_dir)
    same = build_reward_model(model, None, RewardModelConfig(micro_batch_size=3))
    assert torch.equal(score(same, make_batch(0)), score(rm, make_batch(0)))


def test_bfloat16_scores_are_close(rm_dir, rm):
    rm16 = build_reward_model(rm_dir, None, RewardModelConfig(param_dtype="bfloat16"))
    assert next(rm16.module.parameters()).dtype == torch.bfloat16
    got = score(rm16, make_batch(0))
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), score(rm, make_batch(0)).numpy(), atol=5e-2)


# -------------------------------------------------------------------------------------- errors


def test_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_reward_model(tmp_path / "nope")


def test_causal_lm_dir_is_not_a_reward_model(tmp_path):
    path = write_tiny_model(tmp_path / "lm", TINY)
    with pytest.raises(ValueError, match="not a sequence classifier.*ForCausalLM"):
        build_reward_model(path)
    value = write_tiny_value_model(tmp_path / "value", TINY)
    with pytest.raises(ValueError, match="not a sequence classifier.*ForTokenClassification"):
        load_reward_model(value)


def test_wrong_num_labels(tmp_path, rm_dir):
    import shutil

    path = tmp_path / "two_labels"
    shutil.copytree(rm_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["id2label"] = {"0": "bad", "1": "good"}
    config["label2id"] = {"bad": 0, "good": 1}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="2 labels"):
        build_reward_model(path)


def test_module_of_wrong_kind():
    from backends.models import build_tiny_model

    with pytest.raises(ValueError, match="ForSequenceClassification"):
        build_reward_model(build_tiny_model(TINY))


def test_bad_batches(rm):
    batch = make_batch(0)
    with pytest.raises(ValueError, match="empty prompt"):
        score(rm, batch.replace(prompt_mask=torch.zeros_like(batch.prompt_mask)))
    with pytest.raises(ValueError, match="vocabulary"):
        score(rm, batch.replace(response_ids=batch.response_ids + 1000))
    with pytest.raises(TypeError, match="bool"):
        score(rm, batch.replace(response_mask=batch.response_mask.long()))


# ----------------------------------------------------------------------------- combine_rewards


def test_combine_rewards():
    rule = torch.tensor([1.0, 0.0, 1.0])
    rm_scores = torch.tensor([0.5, -2.0, 0.25])
    torch.testing.assert_close(combine_rewards(rule, rm_scores), torch.tensor([1.5, -2.0, 1.25]))
    torch.testing.assert_close(combine_rewards(rule, rm_scores, rm_weight=0.5), torch.tensor([1.25, -1.0, 1.125]))
    torch.testing.assert_close(combine_rewards(None, rm_scores, rm_weight=2.0), torch.tensor([1.0, -4.0, 0.5]))
    assert torch.equal(rule, torch.tensor([1.0, 0.0, 1.0]))  # inputs untouched


def test_combine_rewards_errors():
    with pytest.raises(ValueError, match="rm_scores"):
        combine_rewards(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="rm_scores must have shape"):
        combine_rewards(None, torch.zeros(3, 2))
    with pytest.raises(ValueError, match="non-finite"):
        combine_rewards(torch.zeros(2), torch.tensor([0.0, float("nan")]))
    with pytest.raises(TypeError, match="floating"):
        combine_rewards(torch.zeros(2, dtype=torch.long), torch.zeros(2))


# -------------------------------------------------------------------------- sharded (2 ranks)


def _sharded_worker(rank, world_size, rm_dir):
    from backends.distributed.setup import init_distributed

    env = init_distributed()
    sharded = build_reward_model(rm_dir, env, RewardModelConfig(micro_batch_size=2, shard=True))
    local_shapes = {tuple(p.to_local().shape) for p in sharded.module.parameters()}
    # uneven row counts: rank 0 has 5 rows (3 micro-batches), rank 1 has 3 (2): dummy micro-batches
    rows = [0, 1, 2, 3, 4] if rank == 0 else [5, 6, 7]
    got = score(sharded, select(make_batch(0), rows))
    again = score(sharded, select(make_batch(0), rows))
    return {
        "scores": got.numpy().copy(),
        "again": again.numpy().copy(),
        "rows": rows,
        "sharded": len(local_shapes) > 0,
        "types": sorted({type(p).__name__ for p in sharded.module.parameters()}),
    }


@pytest.mark.distributed
def test_sharded_reward_model_equals_replicated(rm_dir, rm):
    results = run_distributed(_sharded_worker, 2, rm_dir)
    expected = score(rm, make_batch(0))
    for r in results:
        assert r["types"] == ["DTensor"]
        np.testing.assert_allclose(r["scores"], expected[r["rows"]].numpy(), atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(r["scores"], r["again"])


def test_char_tokenizer_pad_is_zero():
    # the fixtures rely on real tokens never being the pad id
    assert build_char_tokenizer().pad_token_id == 0
