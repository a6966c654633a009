"""LoRA actors from the config: only the adapter trains; the rollout and HF exports get the merged weights."""

from __future__ import annotations

import copy

import pytest
import torch

from backends.checkpoint.hf_export import export_hf
from backends.distributed.setup import init_distributed
from backends.distributed.sharded_state import full_state_dict
from backends.models import TinyModelConfig, build_tiny_model, write_tiny_model
from backends.rollout.native import build_native_rollout, sync_weights
from backends.training.engines import select_engine
from backends.training.fsdp import build_actor, compute_logprobs, update
from backends.training.lora import LoraConfig
from backends.training.optim import OptimConfig
from tests.test_reference import make_batch, pg_loss

TINY = TinyModelConfig(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=96, max_position_embeddings=64, seed=5
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("lora") / "model", TINY)


@pytest.fixture(scope="module")
def trained(model_dir):
    env = init_distributed(device="cpu")
    cfg = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
    lora = cfg.build_kwargs(select_engine("fsdp"))
    actor = build_actor(model_dir, env, OptimConfig(lr=1e-2, weight_decay=0.0), **lora)
    for seed in range(2):
        actor, metrics = update(actor, make_batch(seed), pg_loss)
        assert metrics["update_skipped"] == 0.0
    return actor


def test_the_merged_weights_are_peft_merge_and_unload(trained):
    names = dict(full_state_dict(trained))
    reference = copy.deepcopy(trained.module).merge_and_unload().state_dict()
    assert names.keys() == reference.keys()  # the base model's names: no peft prefix, no lora factors
    for name, tensor in names.items():
        torch.testing.assert_close(tensor, reference[name], atol=1e-6, rtol=0, msg=name)
    base = build_tiny_model(TINY).state_dict()
    moved = [n for n in names if not torch.equal(names[n], base[n])]
    assert moved and all(any(t in n for t in ("q_proj", "v_proj", "down_proj")) for n in moved)


def test_the_rollout_and_an_hf_export_get_the_merged_model(trained, model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    batch = make_batch(9)
    trained_logprobs = compute_logprobs(trained, batch).logprobs
    rollout = sync_weights(build_native_rollout(model_dir), full_state_dict(trained))
    rolled = dict(rollout.model.state_dict())
    for name, tensor in full_state_dict(trained):
        torch.testing.assert_close(rolled[name], tensor, msg=name)
    path = export_hf(trained, tmp_path / "merged")
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert not any("lora" in n for n in model.state_dict())
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()).logits.float()
    p = batch.prompt_ids.shape[1]
    logprobs = torch.log_softmax(logits[:, p - 1 : -1], -1).gather(-1, batch.response_ids[..., None])[..., 0]
    torch.testing.assert_close(torch.where(batch.response_mask, logprobs, 0.0), trained_logprobs, atol=1e-5, rtol=0)


def test_lora_config_is_checked_before_any_model_is_built():
    assert LoraConfig().build_kwargs(select_engine("fsdp")) == {}  # rank 0: every weight trains
    with pytest.raises(ValueError, match="actor.lora needs an engine that trains LoRA adapters .* the megatron engine"):
        LoraConfig(rank=4).build_kwargs(select_engine("megatron"))
    with pytest.raises(ValueError):
        LoraConfig(rank=-1)
