"""Critic role of the FSDP2 engine: value model loading, values at verl's positions, clipped value-loss updates.

The distributed checks run on 2 real gloo ranks (tests/distributed.py) in one module-scoped spawn; the
single-process references use a plain (unsharded) HF ``*ForTokenClassification`` and torch AdamW.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from backends.models import (
    TinyModelConfig,
    build_tiny_classifier,
    load_causal_lm,
    load_value_model,
    write_tiny_model,
    write_tiny_reward_model,
    write_tiny_value_model,
)
from backends.training.fsdp import FSDPConfig, ModelOutputs
from backends.training.optim import OptimConfig, build_optimizer, lr_at
from rlfunc.batch import RolloutBatch, select
from rlfunc.value_loss import value_loss
from tests.distributed import run_distributed

TINY = TinyModelConfig(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, max_position_embeddings=64, seed=1
)
# Per-row prompt / response lengths of the global batch (12 rows, 6 per rank). Row 3 has no loss token.
PROMPT_LENS = [6, 3, 5, 2, 4, 6, 1, 5, 3, 6, 2, 4]
RESPONSE_LENS = [7, 1, 4, 0, 7, 2, 3, 6, 5, 1, 7, 2]
# AdamW eps=1e-5 rather than 1e-8: some gradient entries are tiny at this random init, where Adam's
# g / (|g| + eps) turns fp32 summation noise (micro-batching) into visible step differences (the
# measurement is in tests/test_fsdp_engine.py).
OPTIM = OptimConfig(lr=1e-3, weight_decay=0.01, clip_grad=1.0, eps=1e-5)
CLIP = 0.2


def make_batch(seed: int = 0, prompt_lens=PROMPT_LENS, response_lens=RESPONSE_LENS, vocab: int = 80) -> RolloutBatch:
    """Left-padded prompts, right-padded responses (junk ids in the padding), random old values and returns.

    ``old_values`` ~ N(0, 0.3) sits around the fresh head's values (~0.2 in size), so with
    ``clip_range=0.2`` some tokens fall in the clipped branch of the value loss and some do not.
    """
    g = torch.Generator().manual_seed(seed)
    b, p, t = len(prompt_lens), max(prompt_lens), max(max(response_lens), 1)
    return RolloutBatch(
        prompt_ids=torch.randint(4, vocab, (b, p), generator=g),
        prompt_mask=torch.arange(p).flip(0)[None, :] < torch.tensor(prompt_lens)[:, None],
        response_ids=torch.randint(4, vocab, (b, t), generator=g),
        response_mask=torch.arange(t)[None, :] < torch.tensor(response_lens)[:, None],
        group_ids=torch.arange(b) // 3,
        old_values=0.3 * torch.randn(b, t, generator=g),
        returns=torch.randn(b, t, generator=g),
    )


def rank_rows(batch: RolloutBatch, rank: int, world_size: int) -> RolloutBatch:
    n = batch.prompt_ids.shape[0] // world_size
    return select(batch, slice(rank * n, (rank + 1) * n))


def hf_values(model, batch: RolloutBatch) -> torch.Tensor:
    """Plain HF forward over the padded batch; the value at the position that predicts each response token."""
    attention_mask = batch.attention_mask.long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=batch.input_ids, attention_mask=attention_mask, position_ids=position_ids).logits[..., 0]
    p, t = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    return out[:, p - 1 : p + t - 1]


def reference_updates(model_dir, batches, mode: str):
    """Single process, whole batch, no accumulation: forward, clipped value loss, backward, clip, AdamW."""
    model, _ = load_value_model(model_dir, seed=0)
    model.train()
    optimizer = build_optimizer(model.parameters(), OPTIM)
    losses, norms, clipfracs = [], [], []
    for step, batch in enumerate(batches):
        loss, metrics = value_loss(
            hf_values(model, batch),
            old_values=batch.old_values,
            returns=batch.returns,
            response_mask=batch.response_mask,
            clip_range=CLIP,
            agg=mode,
        )
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.clip_grad)))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(OPTIM, step)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
        clipfracs.append(float(metrics["vf_clipfrac"]))
    return _numpy(model.state_dict()), losses, norms, clipfracs


def _numpy(tree):
    if isinstance(tree, dict):
        return {k: _numpy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_numpy(v) for v in tree)
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().float().numpy().copy()
    return tree


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max(float(np.abs(np.asarray(a[k]) - np.asarray(b[k])).max()) for k in a)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("critic")
    return {
        "lm": str(write_tiny_model(root / "lm", TINY)),
        "value": str(
            write_tiny_value_model(
                root / "value",
                TinyModelConfig(
                    hidden_size=64,
                    num_layers=2,
                    num_heads=2,
                    num_kv_heads=1,
                    intermediate_size=128,
                    max_position_embeddings=64,
                    seed=4,
                ),
            )
        ),
    }


# --------------------------------------------------------------------- worker (module level: spawned)


def _error(fn):
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _critic_worker(rank, world_size, lm_dir, value_dir):
    from backends.distributed.setup import init_distributed
    from backends.training.fsdp import (
        build_actor,
        build_critic,
        compute_logprobs,
        compute_values,
        full_state_dict,
        update,
        value_loss_fn,
    )

    env = init_distributed()
    out = {}

    # Update parity: two clipped value-loss updates with accumulation (and uneven micro-batch counts).
    batches = [rank_rows(make_batch(s), rank, world_size) for s in (0, 1)]
    for name, mode, fsdp_cfg in [
        ("token-mean", "token-mean", FSDPConfig(micro_batch_size=4)),  # 6 rows -> micro-batches of 4 + 2
        ("token-budget", "seq-mean-token-mean", FSDPConfig(max_tokens_per_micro_batch=14)),
    ]:
        critic = build_critic(lm_dir, env, OPTIM, fsdp_cfg)
        loss_fn = value_loss_fn(clip_range=CLIP, agg=mode)
        seen = []

        def spy(outputs, mb, norms, loss_fn=loss_fn, seen=seen):
            seen.append(
                (
                    outputs.logprobs is None,
                    outputs.entropy is None,
                    tuple(outputs.values.shape),
                    tuple(mb.response_ids.shape),
                )
            )
            return loss_fn(outputs, mb, norms)

        metrics = []
        for batch in batches:
            critic, m = update(critic, batch, spy)
            metrics.append(m)
        out[name] = {
            "params": _numpy(dict(full_state_dict(critic))),
            "metrics": metrics,
            "seen": seen,
            "step": critic.step,
            "role": critic.role,
        }

    # Values, full weights, value-model dirs, zero head.
    local = rank_rows(make_batch(0), rank, world_size)
    critic = build_critic(lm_dir, env, OPTIM, FSDPConfig(micro_batch_size=4))
    out["values"] = _numpy(compute_values(critic, local))
    out["values_mbs1"] = _numpy(compute_values(critic, local, micro_batch_size=1))
    out["training_after"] = critic.module.training
    out["full"] = _numpy(dict(full_state_dict(critic)))
    out["shard_types"] = sorted({type(p).__name__ for p in critic.module.parameters()})
    out["value_dir_values"] = _numpy(compute_values(build_critic(value_dir, env, OPTIM), local))
    zero = build_critic(lm_dir, env, OPTIM, value_head_init="zero")
    out["zero_values"] = _numpy(compute_values(zero, local))

    # The value loss falls on a fixed regression target (PPO-style: old values refreshed each update).
    critic = build_critic(lm_dir, env, OptimConfig(lr=2e-3, eps=1e-5), FSDPConfig(micro_batch_size=4))
    # a learnable target: +-0.5 around 1 by the parity of the token read at that position (the previous one)
    previous = torch.cat([local.prompt_ids[:, -1:], local.response_ids[:, :-1]], dim=1)
    target = local.replace(returns=torch.where(local.response_mask, 1.0 + (previous % 2 - 0.5), 0.0))
    losses = []
    for _ in range(12):
        batch = target.replace(old_values=compute_values(critic, target))
        critic, m = update(critic, batch, value_loss_fn(clip_range=0.5))
        losses.append(m["loss"])
    out["regression_losses"] = losses

    # Bad input: errors before any collective, the same on every rank.
    loss_fn = value_loss_fn()
    actor = build_actor(lm_dir, env, OPTIM)
    lm_module = load_causal_lm(lm_dir)[0]
    out["errors"] = {
        "no_returns": _error(lambda: update(critic, local.replace(returns=None), loss_fn)),
        "no_old_values": _error(lambda: update(critic, local.replace(old_values=None), loss_fn)),
        "entropy": _error(lambda: update(critic, local, loss_fn, with_entropy=True)),
        "logprobs_of_critic": _error(lambda: compute_logprobs(critic, local)),
        "values_of_actor": _error(lambda: compute_values(actor, local)),
        "causal_lm_module": _error(lambda: build_critic(lm_module, env, OPTIM)),
        "loss_on_actor": _error(lambda: update(actor, local, loss_fn)),
    }
    return out


@pytest.fixture(scope="module")
def two_ranks(dirs):
    return run_distributed(_critic_worker, 2, dirs["lm"], dirs["value"])


# ----------------------------------------------------------------------------- 2 ranks: update parity


@pytest.mark.distributed
@pytest.mark.parametrize("name,mode", [("token-mean", "token-mean"), ("token-budget", "seq-mean-token-mean")])
def test_two_rank_accumulated_critic_update_equals_single_process(two_ranks, dirs, name, mode):
    batches = [make_batch(0), make_batch(1)]
    ref_params, ref_losses, ref_norms, ref_clipfracs = reference_updates(dirs["lm"], batches, mode)
    for rank in range(2):
        got = two_ranks[rank][name]
        assert got["role"] == "critic" and got["step"] == 2
        diff = _max_diff(got["params"], ref_params)
        assert diff < 1e-6, f"{name} rank {rank}: max |param diff| = {diff:.3g}"
        for step in range(2):
            m = got["metrics"][step]
            assert m["loss"] == pytest.approx(ref_losses[step], rel=1e-5, abs=1e-6)
            assert m["grad_norm"] == pytest.approx(ref_norms[step], rel=1e-5)
            assert m["update_skipped"] == 0.0
        # the loss_fn saw values only, shaped like the (trimmed) micro-batch's responses
        for no_logprobs, no_entropy, values_shape, response_shape in got["seen"]:
            assert no_logprobs and no_entropy and values_shape == response_shape
    assert 0.0 < ref_clipfracs[0] < 1.0  # both branches of the clipped loss are exercised
    assert max(ref_norms) > OPTIM.clip_grad  # and gradient clipping
    init = _numpy(load_value_model(dirs["lm"], seed=0)[0].state_dict())
    assert _max_diff(init, ref_params) > 1e-4  # the weights moved


@pytest.mark.distributed
def test_critic_metrics_are_global(two_ranks):
    m0, m1 = two_ranks[0]["token-mean"]["metrics"][0], two_ranks[1]["token-mean"]["metrics"][0]
    assert m0 == m1
    assert m0["num_tokens"] == float(sum(RESPONSE_LENS)) and m0["num_micro_batches"] == 2.0
    assert {"vf_clipfrac", "vpred_mean", "loss", "grad_norm", "lr"} <= set(m0)


# ------------------------------------------------------------------------------- 2 ranks: values


@pytest.mark.distributed
def test_compute_values_equal_plain_hf_forward(two_ranks, dirs):
    model = load_value_model(dirs["lm"], seed=0)[0]
    batch = make_batch(0)
    with torch.no_grad():
        expected = hf_values(model, batch).numpy()
        # verl's slicing of the unpadded sequence: values[seq_len - resp_len - 1 : seq_len - 1]
        for i in range(12):
            ids = torch.cat([batch.prompt_ids[i][batch.prompt_mask[i]], batch.response_ids[i][batch.response_mask[i]]])
            row = model(input_ids=ids[None]).logits[0, :, 0]
            n, r = ids.shape[0], RESPONSE_LENS[i]
            np.testing.assert_allclose(expected[i, :r], row[n - r - 1 : n - 1].numpy(), atol=1e-5, rtol=1e-5)
    for rank in range(2):
        got = two_ranks[rank]
        rows = slice(rank * 6, rank * 6 + 6)
        mask = rank_rows(batch, rank, 2).response_mask.numpy()
        np.testing.assert_allclose(got["values"][mask], expected[rows][mask], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(got["values_mbs1"], got["values"], atol=1e-5, rtol=1e-5)
        assert (got["values"][~mask] == 0).all()
        assert got["training_after"] is True
        assert (got["zero_values"] == 0).all()


@pytest.mark.distributed
def test_critic_from_value_model_dir(two_ranks, dirs):
    model = load_value_model(dirs["value"])[0]
    batch = make_batch(0)
    with torch.no_grad():
        expected = torch.where(batch.response_mask, hf_values(model, batch), 0.0).numpy()
    for rank in range(2):
        np.testing.assert_allclose(
            two_ranks[rank]["value_dir_values"], expected[rank * 6 : rank * 6 + 6], atol=1e-5, rtol=1e-5
        )


@pytest.mark.distributed
def test_full_state_dict_of_the_critic(two_ranks, dirs):
    expected = _numpy(load_value_model(dirs["lm"], seed=0)[0].state_dict())
    for rank in range(2):
        got = two_ranks[rank]["full"]
        assert list(got) == list(expected)  # HF names, in order
        assert _max_diff(got, expected) == 0.0
    assert two_ranks[0]["shard_types"] == ["DTensor"]
    assert "score.weight" in expected and "score.bias" in expected and "lm_head.weight" not in expected


@pytest.mark.distributed
def test_value_loss_decreases_on_a_fixed_target(two_ranks):
    for r in two_ranks:
        losses = r["regression_losses"]
        # below 0.125, the loss of the best constant (targets are 1 +- 0.5): the critic reads the tokens
        assert losses[-1] < 0.05 and losses[-1] < 0.1 * losses[0], losses
        # still improving late: Adam at a fixed lr oscillates near the optimum, so compare halves, not the last step
        half = len(losses) // 2
        assert min(losses[half:]) < min(losses[:half]), losses


@pytest.mark.distributed
def test_critic_bad_input_errors(two_ranks):
    errors = two_ranks[0]["errors"]
    assert errors == two_ranks[1]["errors"]
    assert "batch.returns" in errors["no_returns"]
    assert "batch.old_values" in errors["no_old_values"] and "compute_values" in errors["no_old_values"]
    assert "with_entropy" in errors["entropy"]
    assert "compute_values" in errors["logprobs_of_critic"]
    assert "critic state" in errors["values_of_actor"]
    assert "ForTokenClassification" in errors["causal_lm_module"]
    assert "outputs.values is None" in errors["loss_on_actor"]


# ------------------------------------------------------------------------------- single process


def test_value_model_from_causal_lm_keeps_backbone_and_seeds_head(dirs):
    lm = load_causal_lm(dirs["lm"])[0].state_dict()
    a, _ = load_value_model(dirs["lm"], seed=0)
    b, _ = load_value_model(dirs["lm"], seed=0)
    c, _ = load_value_model(dirs["lm"], seed=1)
    zero, _ = load_value_model(dirs["lm"], value_head_init="zero")
    sd = a.state_dict()
    assert type(a).__name__ == "Qwen2ForTokenClassification" and a.config.num_labels == 1
    for name, value in sd.items():
        if not name.startswith("score."):
            assert torch.equal(value, lm[name]), name
    assert set(sd) == {n for n in lm if n != "lm_head.weight"} | {"score.weight", "score.bias"}
    assert torch.equal(sd["score.weight"], b.state_dict()["score.weight"])  # reproducible
    assert not torch.equal(sd["score.weight"], c.state_dict()["score.weight"])
    assert 0.01 < float(sd["score.weight"].std()) < 0.04  # N(0, initializer_range=0.02)
    assert float(sd["score.bias"].abs().max()) == 0.0
    assert float(zero.score.weight.detach().abs().max()) == 0.0
    assert a.dropout.p == 0.0 and a.config.classifier_dropout == 0.0


def test_value_model_dir_loads_as_saved(dirs):
    from transformers import AutoModelForTokenClassification

    model, tokenizer = load_value_model(dirs["value"], seed=123)  # the seed is unused: the head exists
    saved = AutoModelForTokenClassification.from_pretrained(dirs["value"], local_files_only=True)
    assert _max_diff(_numpy(model.state_dict()), _numpy(saved.state_dict())) == 0.0
    assert tokenizer.pad_token_id == 0


def test_value_model_without_tokenizer(dirs, tmp_path):
    # an exported critic (save_pretrained, no tokenizer files) loads back; the tokenizer is optional
    from transformers import AutoModelForTokenClassification

    AutoModelForTokenClassification.from_pretrained(dirs["value"], local_files_only=True).save_pretrained(
        tmp_path / "v"
    )
    model, tokenizer = load_value_model(tmp_path / "v")
    assert tokenizer is None and model.config.num_labels == 1


def test_value_model_errors(dirs, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_value_model(tmp_path / "nope")
    with pytest.raises(ValueError, match="value_head_init"):
        load_value_model(dirs["lm"], value_head_init="xavier")
    rm = write_tiny_reward_model(tmp_path / "rm", TINY)
    with pytest.raises(ValueError, match="ForSequenceClassification"):
        load_value_model(rm)
    two = tmp_path / "two_labels"
    shutil.copytree(dirs["value"], two)
    config = json.loads((two / "config.json").read_text())
    config["id2label"], config["label2id"] = {"0": "a", "1": "b"}, {"a": 0, "b": 1}
    (two / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="2 labels"):
        load_value_model(two)
    with pytest.raises(ValueError, match="kind"):
        build_tiny_classifier(TINY, kind="causal")


def test_model_outputs_fields():
    lp = torch.zeros(2, 3)
    assert ModelOutputs(logprobs=lp).values is None
    v = ModelOutputs(values=lp)
    assert v.logprobs is None and v.entropy is None and v.values is lp
