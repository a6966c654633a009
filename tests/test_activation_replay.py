"""Reusing the rollout's activations in the update: the recorded linear outputs stand in for the
trainer's forward products, and the update's gradients equal a recomputed forward's to float rounding.

``generate_recording`` records every linear layer's output for every token the rollout ran;
``fsdp_engine.update(..., activations=)`` feeds them to the packed forward (``cpu_fused``'s replay), so
only the backward's products run. Checked on one process and on 2 real gloo ranks (FSDP2), with
several micro-batches, shared prompts, skipped rows, and for the errors that guard its one condition:
the actor's weights must be the ones the rollout ran.
"""

from __future__ import annotations

import pytest
import torch

import rlfunc as rf
from backends.cpu.kernels import norm_act_kernel, packed_attention_kernel
from backends.training import fsdp as fsdp_engine
from backends.distributed.setup import init_distributed
from backends.training.fsdp import FSDPConfig, build_actor, full_state_dict, update
from backends.models import TinyModelConfig, build_char_tokenizer, load_causal_lm, write_tiny_model
from backends.training.optim import OptimConfig
from backends.packing import pack_rows
from backends.rollout.native import SamplingConfig, build_native_rollout, generate, generate_recording, sync_weights
from tests.distributed import run_distributed

CFG = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
                      initializer_range=0.2, seed=3)
OPTIM = OptimConfig(lr=1e-3, weight_decay=0.01, clip_grad=1.0, eps=1e-5)
SAMPLING = SamplingConfig(n=3, temperature=1.0, max_new_tokens=8)
PROMPTS = {0: ["12+34=", "7+8=", "99+1="], 1: ["5+5=", "40+2=", "3+3="]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("replay") / "model", CFG, build_char_tokenizer()))


def _loss(outputs, mb, norms):
    """PPO clip plus an entropy bonus: the gradient reaches the LM head through both."""
    loss, metrics = rf.ppo_policy_loss(outputs.logprobs, mb.old_logprobs, mb.advantages, mb.response_mask, norms=norms)
    return loss - 0.01 * rf.aggregate(outputs.entropy, mb.response_mask, "token-mean", norms), metrics


def _grads_before_step(state, sink: list):
    names = {id(p): n for n, p in state.module.named_parameters()}

    def hook(optimizer, args, kwargs):
        sink.append({names[id(p)]: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                     for g in optimizer.param_groups for p in g["params"]})

    state.optimizer.register_step_pre_hook(hook)


def _replay_vs_recompute(rank, world_size, model_dir, micro_batch_size, skip_some_rows):
    """Two GRPO-shaped steps on two actors from the same weights: one reuses the rollout's activations,
    the other recomputes its forward. Returns the worst relative gradient gap, and the losses."""
    env = init_distributed()
    tokenizer = build_char_tokenizer()
    cfg = FSDPConfig(use_remove_padding=True, micro_batch_size=micro_batch_size)
    actors = {side: build_actor(model_dir, env, OPTIM, cfg) for side in ("replay", "recompute")}
    grads = {side: [] for side in actors}
    for side, state in actors.items():
        _grads_before_step(state, grads[side])
    rollout = build_native_rollout(model_dir, tokenizer)
    prompts = [tokenizer.encode(p) for p in PROMPTS[rank]]
    losses = []
    for step in range(2):
        rollout = sync_weights(rollout, full_state_dict(actors["replay"]), tag=actors["replay"].step)
        batch, activations = generate_recording(rollout, prompts, SAMPLING, seed=10 * step + rank)
        g = torch.Generator().manual_seed(step)
        advantages = torch.randn(batch.response_ids.shape[0], 1, generator=g).expand_as(batch.rollout_logprobs)
        batch = batch.replace(old_logprobs=batch.rollout_logprobs, advantages=advantages.contiguous())
        skip = (torch.arange(batch.response_ids.shape[0]) % 4 == 1) if skip_some_rows else None
        step_losses = {}
        for side in actors:
            actors[side], metrics = update(actors[side], batch, _loss, with_entropy=True, skip_rows=skip,
                                           activations=activations if side == "replay" else None)
            step_losses[side] = metrics["loss"]
        losses.append(step_losses)
    gap = 0.0
    for replayed, recomputed in zip(grads["replay"], grads["recompute"]):
        for name, ref in recomputed.items():
            gap = max(gap, float((replayed[name] - ref).abs().max() / ref.abs().max().clamp(min=1e-12)))
    return {"gap": gap, "losses": losses}


kernels = pytest.mark.skipif(norm_act_kernel() is None or packed_attention_kernel(32) is None,
                             reason="the fused CPU modules (AVX-512 C kernels) do not run here")


def test_recorded_outputs_are_the_models_linear_outputs(model_dir):
    tokenizer = build_char_tokenizer()
    rollout = build_native_rollout(model_dir, tokenizer)
    prompts = [tokenizer.encode(p) for p in PROMPTS[0]]
    plain = generate(rollout, prompts, SAMPLING, seed=5)
    batch, activations = generate_recording(rollout, prompts, SAMPLING, seed=5)
    assert torch.equal(plain.response_ids, batch.response_ids)
    assert torch.equal(batch.rollout_rows, torch.arange(batch.response_ids.shape[0]))
    model = load_causal_lm(model_dir, dtype=torch.float32)[0].eval()
    seen = {}
    for name, module in model.named_modules():
        if name in activations.outputs or name.endswith(("q_proj", "k_proj", "v_proj")):
            module.register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, o[0]))
    worst = 0.0
    for row in range(batch.response_ids.shape[0]):
        prompt = batch.prompt_ids[row][batch.prompt_mask[row]]
        ids = torch.cat([prompt, batch.response_ids[row][batch.response_mask[row]][:-1]])  # the last is never input
        with torch.no_grad():
            model(ids[None])
        rows, positions = torch.full((ids.shape[0],), row), torch.arange(ids.shape[0])
        at = activations.record_rows(rows, positions)
        for name, recorded in activations.outputs.items():
            if name == activations.lm_head_name:  # the LM head ran from the last prompt token on
                start = prompt.shape[0] - 1
                expected = seen[name][start:]
                got = recorded[activations.record_rows(rows[start:], positions[start:], logits=True)]
            elif name.endswith("self_attn"):
                expected = torch.cat([seen[f"{name}.{p}_proj"] for p in "qkv"], dim=-1)
                got = recorded[at]
            else:
                expected, got = seen[name], recorded[at]
            worst = max(worst, float((got - expected).abs().max() / expected.abs().max()))
    print(f"max |recorded - HF forward| / max |HF forward| over every linear output: {worst:.2e}")
    assert worst < 1e-5
    with pytest.raises(ValueError, match="no recorded activations for rollout row 0 at position"):
        activations.record_rows(torch.tensor([0]), torch.tensor([ids.shape[0] + 30]))


def test_records_are_the_step_major_packing_of_the_batch(model_dir):
    """The records hold exactly the tokens a trainer runs, in ``pack_rows(step_major=True)``'s order, so a
    whole batch reads them in place; rows finish at different steps (finished rows' steps keep nothing)."""
    tokenizer = build_char_tokenizer()
    rollout = build_native_rollout(model_dir, tokenizer)
    prompts = [tokenizer.encode(p) for p in ["12+34=", "7+8=", "99+1=", "5+5="]]
    batch, activations = generate_recording(rollout, prompts, SamplingConfig(n=4, max_new_tokens=24), seed=4)
    lengths = batch.response_mask.sum(-1)
    assert len(set(lengths.tolist())) > 2 and int(lengths.min()) < 24  # some rows stopped early, at different steps
    packed = pack_rows(batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask,
                       share_prompts=True, step_major=True)
    slots = activations.record_rows(batch.rollout_rows[packed.token_rows], packed.position_ids[0])
    assert slots.tolist() == list(range(packed.num_tokens))
    assert all(t.shape[0] == packed.num_tokens for n, t in activations.outputs.items() if n != activations.lm_head_name)
    assert activations.outputs[activations.lm_head_name].shape[0] == len(prompts) + int((lengths - 1).sum())


@kernels
@pytest.mark.parametrize("micro_batch_size,skip_some_rows", [(9, False), (5, False), (4, True)])
def test_replayed_update_equals_recomputed_update(model_dir, micro_batch_size, skip_some_rows, monkeypatch):
    in_place = []  # the whole batch (9 rows) in one micro-batch reads the records in place, the rest gathers
    leading_rows = fsdp_engine._leading_rows
    monkeypatch.setattr(fsdp_engine, "_leading_rows", lambda *a: in_place.append(1) or leading_rows(*a))
    out = _replay_vs_recompute(0, 1, model_dir, micro_batch_size, skip_some_rows)
    print(f"worst relative gradient gap, replayed vs recomputed forward: {out['gap']:.2e}; losses {out['losses']}")
    assert out["gap"] < 1e-4
    assert bool(in_place) == (micro_batch_size == 9 and not skip_some_rows)
    for step in out["losses"]:
        assert step["replay"] == pytest.approx(step["recompute"], rel=1e-4, abs=1e-6)


@kernels
@pytest.mark.distributed
def test_replayed_update_equals_recomputed_update_on_two_fsdp_ranks(model_dir):
    results = run_distributed(_replay_vs_recompute, 2, model_dir, 4, False)
    gap = max(r["gap"] for r in results)
    print(f"2 ranks: worst relative gradient gap, replayed vs recomputed forward: {gap:.2e}")
    assert gap < 1e-4


@kernels
def test_update_reads_the_recorded_outputs(model_dir):
    """Corrupted records change the step: the forward took its products from them."""
    env = init_distributed()
    tokenizer = build_char_tokenizer()
    rollout = build_native_rollout(model_dir, tokenizer)
    cfg = FSDPConfig(use_remove_padding=True, micro_batch_size=16)
    prompts = [tokenizer.encode(p) for p in PROMPTS[0]]
    actor = build_actor(model_dir, env, OPTIM, cfg)
    rollout = sync_weights(rollout, full_state_dict(actor), tag=actor.step)
    batch, activations = generate_recording(rollout, prompts, SAMPLING, seed=1)
    batch = batch.replace(old_logprobs=batch.rollout_logprobs, advantages=torch.ones_like(batch.rollout_logprobs))
    corrupted = activations.outputs | {activations.lm_head_name: activations.outputs[activations.lm_head_name] + 1.0,
                                       "model.layers.0.mlp.up_proj": activations.outputs["model.layers.0.mlp.up_proj"] * 2}
    _, clean = update(build_actor(model_dir, env, OPTIM, cfg), batch, _loss, with_entropy=True, activations=activations)
    _, bad = update(build_actor(model_dir, env, OPTIM, cfg), batch, _loss, with_entropy=True,
                    activations=type(activations)(outputs=corrupted, slots=activations.slots,
                                                  logit_slots=activations.logit_slots,
                                                  lm_head_name=activations.lm_head_name, weights_tag=activations.weights_tag))
    assert bad["grad_norm"] != pytest.approx(clean["grad_norm"], rel=1e-3)


def test_stale_or_misapplied_activations_are_refused(model_dir):
    env = init_distributed()
    tokenizer = build_char_tokenizer()
    rollout = build_native_rollout(model_dir, tokenizer)
    prompts = [tokenizer.encode(p) for p in PROMPTS[1]]
    actor = build_actor(model_dir, env, OPTIM, FSDPConfig(use_remove_padding=True))
    batch, untagged = generate_recording(rollout, prompts, SAMPLING, seed=2)
    batch = batch.replace(old_logprobs=batch.rollout_logprobs, advantages=torch.ones_like(batch.rollout_logprobs))
    with pytest.raises(ValueError, match="tagged None; this actor is at step 0"):
        update(actor, batch, _loss, with_entropy=True, activations=untagged)
    rollout = sync_weights(rollout, full_state_dict(actor), tag=actor.step)
    batch, activations = generate_recording(rollout, prompts, SAMPLING, seed=2)
    batch = batch.replace(old_logprobs=batch.rollout_logprobs, advantages=torch.ones_like(batch.rollout_logprobs))
    stepped, _ = update(actor, batch, _loss, with_entropy=True, activations=activations)
    with pytest.raises(ValueError, match="tagged 0; this actor is at step 1"):  # a second update on the same batch
        update(stepped, batch, _loss, with_entropy=True, activations=activations)
    padded = build_actor(model_dir, env, OPTIM, FSDPConfig(use_remove_padding=False))
    with pytest.raises(ValueError, match="use_remove_padding=true"):
        update(padded, batch, _loss, with_entropy=True, activations=activations)
    with pytest.raises(ValueError, match="no rollout_rows"):
        update(actor, batch.replace(rollout_rows=None), _loss, with_entropy=True, activations=activations)
    generate_recording(rollout, prompts, SAMPLING, seed=3)  # the engine's next recording reuses the buffers
    with pytest.raises(ValueError, match="overwritten by a later recording rollout"):
        update(actor, batch, _loss, with_entropy=True, activations=activations)
