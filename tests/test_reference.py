"""Reference-model options: compiled forward, offload guard, backend choice, LoRA reference in the actor.

Single process (a one-rank gloo group from init_distributed), tiny Qwen2.
"""

from __future__ import annotations

import logging

import pytest
import torch

from backends.distributed.setup import init_distributed
from backends.models import TinyModelConfig, write_tiny_model
from backends.training.fsdp import (
    FSDPConfig,
    build_actor,
    build_reference,
    compile_layers,
    compute_logprobs,
    update,
)
from backends.training.optim import OptimConfig
from backends.training.reference import ReferenceConfig, build_reference_role
from rlfunc.aggregation import aggregate
from rlfunc.batch import RolloutBatch

TINY = TinyModelConfig(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=96, max_position_embeddings=64, seed=3
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("ref") / "model", TINY)


@pytest.fixture(scope="module")
def env():
    return init_distributed(device="cpu")


def make_batch(seed: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    prompt_lens, response_lens = torch.tensor([4, 2, 5, 3]), torch.tensor([6, 3, 1, 5])
    p, t = 5, 6
    prompt_mask = torch.arange(p).flip(0)[None, :] < prompt_lens[:, None]
    response_mask = torch.arange(t)[None, :] < response_lens[:, None]
    return RolloutBatch(
        prompt_ids=torch.randint(4, 60, (4, p), generator=g),
        prompt_mask=prompt_mask,
        response_ids=torch.randint(4, 60, (4, t), generator=g),
        response_mask=response_mask,
        group_ids=torch.arange(4),
        advantages=torch.randn(4, t, generator=g),
    )


def pg_loss(outputs, mb, norms):
    return aggregate(-mb.advantages * outputs.logprobs, mb.response_mask, mode="token-mean", norms=norms), {}


def test_log_prob_micro_batch_size_is_the_reference_default(model_dir, env):
    batch = make_batch()
    ref = build_reference_role(ReferenceConfig(log_prob_micro_batch_size=1), model_dir, env, FSDPConfig())
    assert ref.log_prob_micro_batch_size == 1
    whole = build_reference(model_dir, env, FSDPConfig(micro_batch_size=8))
    torch.testing.assert_close(
        compute_logprobs(ref, batch).logprobs, compute_logprobs(whole, batch).logprobs, atol=1e-5, rtol=0
    )


@pytest.mark.slow  # an Inductor compilation on CPU
def test_compiled_reference_equals_eager(model_dir, env):
    """torch.compile (inductor, C++ on CPU) of each decoder layer: same log-probs as eager to 1e-5."""
    batch = make_batch(1)
    eager = compute_logprobs(build_reference(model_dir, env), batch).logprobs
    compiled_state = build_reference_role(ReferenceConfig(use_torch_compile=True), model_dir, env, FSDPConfig())
    compiled = compute_logprobs(compiled_state, batch).logprobs
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=0)


def test_compile_without_a_cpp_compiler_falls_back_to_eager(model_dir, env, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    batch = make_batch(2)
    ref = build_reference(model_dir, env)
    with caplog.at_level(logging.WARNING, logger="rlfunc.compile"):
        assert compile_layers(ref.module) is False
    lines = [r.getMessage() for r in caplog.records if r.name == "rlfunc.compile"]
    assert len(lines) == 1 and "no C++ compiler" in lines[0] and "eagerly" in lines[0]
    fresh = build_reference(model_dir, env)
    torch.testing.assert_close(compute_logprobs(ref, batch).logprobs, compute_logprobs(fresh, batch).logprobs)


def test_param_offload_needs_cuda(model_dir, env):
    with pytest.raises(ValueError, match="param_offload=True needs a CUDA device"):
        build_reference_role(ReferenceConfig(param_offload=True), model_dir, env, FSDPConfig())


@pytest.mark.gpu
def test_param_offload_on_gpu_equals_resident(model_dir):
    gpu_env = init_distributed(device="cuda")
    batch = make_batch(3)
    fsdp = FSDPConfig(param_dtype="float32")
    offloaded = build_reference(model_dir, gpu_env, fsdp, param_offload=True)
    resident = build_reference(model_dir, gpu_env, fsdp)
    assert next(offloaded.module.parameters()).to_local().device.type == "cpu"
    torch.testing.assert_close(compute_logprobs(offloaded, batch).logprobs, compute_logprobs(resident, batch).logprobs)


def test_backend_options_are_checked_before_loading(model_dir, env):
    with pytest.raises(ValueError, match="reference.tp=2 / reference.pp=1 need reference.backend=megatron"):
        build_reference_role(ReferenceConfig(tp=2), model_dir, env, FSDPConfig())
    with pytest.raises(ValueError, match="does not take ref_in_actor, use_torch_compile or param_offload"):
        build_reference_role(ReferenceConfig(backend="megatron", use_torch_compile=True), model_dir, env, FSDPConfig())
    with pytest.raises(ValueError, match=r"'jax' is not one of 'actor', 'fsdp', 'megatron'"):  # when the config is read
        ReferenceConfig(backend="jax")


def test_ref_in_actor_needs_a_lora_actor(model_dir, env):
    actor = build_actor(model_dir, env)
    with pytest.raises(ValueError, match="only when the actor trains a LoRA adapter"):
        build_reference_role(ReferenceConfig(ref_in_actor=True), model_dir, env, FSDPConfig(), actor=actor)
    with pytest.raises(ValueError, match="needs the actor on this rank"):
        build_reference_role(ReferenceConfig(ref_in_actor=True), model_dir, env, FSDPConfig())


def test_lora_reference_is_the_base_model_without_a_second_copy(model_dir, env):
    from peft import LoraConfig

    batch = make_batch(4)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    actor = build_actor(model_dir, env, OptimConfig(lr=1e-2, weight_decay=0.0), lora=lora)
    ref = build_reference_role(
        ReferenceConfig(ref_in_actor=True, log_prob_micro_batch_size=2), model_dir, env, FSDPConfig(), actor=actor
    )
    # no second set of weights: the reference is the actor's module; only the adapter is trainable
    assert ref.module is actor.module and ref.optimizer is None and ref.adapter_disabled
    trainable = [n for n, p in actor.module.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    optimized = {id(p) for group in actor.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in actor.module.parameters() if p.requires_grad}

    base = compute_logprobs(build_reference(model_dir, env), batch).logprobs  # separately loaded base model
    torch.testing.assert_close(compute_logprobs(ref, batch).logprobs, base, atol=1e-6, rtol=0)
    before = compute_logprobs(actor, batch).logprobs
    torch.testing.assert_close(before, base, atol=1e-6, rtol=0)  # LoRA B starts at 0

    for _ in range(2):
        actor, metrics = update(actor, batch, pg_loss)
        assert metrics["update_skipped"] == 0.0
    after = compute_logprobs(actor, batch).logprobs
    assert (after - base).abs().max() > 1e-4  # the policy moved
    torch.testing.assert_close(compute_logprobs(ref, batch).logprobs, base, atol=1e-6, rtol=0)  # the reference did not
    assert actor.module.training  # the reference pass left the actor in train mode
