"""The rollout engine's log-probs and the FSDP trainer's recomputed log-probs of the same tokens agree.

The actor is sharded over 2 real gloo ranks and trained one step; the rollout receives the streamed full
weights through ``sync_weights``; each rank samples its own prompts and both sides score the same tokens.
"""

import pytest
import torch

import rlfunc as rf
from backends.distributed.setup import init_distributed
from backends.models import TinyModelConfig, build_char_tokenizer, write_tiny_model
from backends.rollout.native import SamplingConfig, build_native_rollout, generate, sync_weights
from backends.training.fsdp import FSDPConfig, build_actor, compute_logprobs, full_state_dict, update
from backends.training.optim import OptimConfig
from tests.distributed import run_distributed

CFG = TinyModelConfig(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, initializer_range=0.2
)


def _agreement(rank, world_size, model_dir):
    env = init_distributed()
    tokenizer = build_char_tokenizer()
    actor = build_actor(model_dir, env, OptimConfig(lr=1e-2, total_training_steps=2), FSDPConfig(micro_batch_size=4))
    rollout = build_native_rollout(model_dir, tokenizer)
    prompts = [tokenizer.encode(p) for p in (["12+34=", "7+8=", "99+1="] if rank == 0 else ["5+5=", "40+2="])]
    sampling = SamplingConfig(n=3, temperature=1.0, max_new_tokens=8)
    gaps = []
    for step in range(2):
        rollout = sync_weights(rollout, full_state_dict(actor))
        batch = generate(rollout, prompts, sampling, seed=100 * step + rank)
        trainer = compute_logprobs(actor, batch).logprobs
        gaps.append(float((trainer - batch.rollout_logprobs).abs().masked_fill(~batch.response_mask, 0).max()))
        # move the actor so that the second round checks the sync, not the initial weights
        adv = torch.randn(batch.response_ids.shape[0], 1).expand_as(trainer).contiguous()
        batch = batch.replace(old_logprobs=trainer, advantages=adv)
        actor, _ = update(
            actor,
            batch,
            lambda o, mb, n: rf.ppo_policy_loss(
                o.logprobs,
                old_logprobs=mb.old_logprobs,
                advantages=mb.advantages,
                response_mask=mb.response_mask,
                norms=n,
            ),
        )
    return gaps


@pytest.mark.distributed
def test_rollout_and_trainer_logprobs_agree_after_sync(tmp_path):
    model_dir = write_tiny_model(tmp_path / "m", CFG, build_char_tokenizer())
    gaps = run_distributed(_agreement, 2, str(model_dir))
    worst = max(max(g) for g in gaps)
    print(f"max |rollout - trainer| log-prob gap over both ranks and syncs: {worst:.2e}")
    assert worst < 5e-5, gaps
