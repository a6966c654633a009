"""The generic SFT stage (backends.training.sft): batch layout, loss, data-parallel shares, and a real
engine whose NLL on its examples falls."""

from __future__ import annotations

import pytest
import torch

import rlfunc as rf
from backends.training.optim import OptimConfig
from backends.training.sft import SFTConfig, SFTExample, nll_loss, run_sft, sft_batch, sft_optim

PAD = 0


def _examples() -> list[SFTExample]:
    return [
        SFTExample([5, 6, 7], [8, 9]),
        SFTExample([4], [3, 2, 1]),
        SFTExample([7, 7], [1]),
        SFTExample([2, 3], [4, 5]),
    ]


def test_batch_left_pads_prompts_and_right_pads_responses():
    batch = sft_batch(_examples()[:2], pad_token_id=PAD)
    assert batch.prompt_ids.tolist() == [[5, 6, 7], [PAD, PAD, 4]]
    assert batch.prompt_mask.tolist() == [[True, True, True], [False, False, True]]
    assert batch.response_ids.tolist() == [[8, 9, PAD], [3, 2, 1]]
    assert batch.response_mask.tolist() == [[True, True, False], [True, True, True]]
    assert batch.group_ids.tolist() == [0, 1]


def test_example_needs_prompt_and_response_tokens():
    with pytest.raises(ValueError, match="at least one prompt token and one response token"):
        SFTExample([1], [])


def test_nll_loss_is_the_token_mean_over_the_global_count():
    class Out:
        logprobs = torch.tensor([[-1.0, -2.0, -9.0], [-3.0, -4.0, -5.0]])

    mask = torch.tensor([[True, True, False], [True, True, True]])
    mb = rf.RolloutBatch(
        prompt_ids=torch.ones(2, 1, dtype=torch.long),
        prompt_mask=torch.ones(2, 1, dtype=torch.bool),
        response_ids=torch.zeros(2, 3, dtype=torch.long),
        response_mask=mask,
        group_ids=torch.arange(2),
    )
    loss, _ = nll_loss(Out(), mb, rf.local_normalizers(mask))
    assert loss.item() == pytest.approx((1 + 2 + 3 + 4 + 5) / 5)


def test_each_rank_trains_on_its_share_and_losses_are_logged_before_step_one():
    seen, logged = [], []

    def fake_update(state, batch, loss_fn):
        assert loss_fn is nll_loss
        seen.append(batch.response_ids[:, 0].tolist())
        return state + 1, {"loss": float(state)}

    class Log:
        def log(self, step, row):
            logged.append((step, row))

    cfg = SFTConfig(steps=3, batch_size=4)
    out = run_sft(
        0,
        lambda step: _examples(),
        cfg,
        pad_token_id=PAD,
        data_parallel=(1, 2),
        update_fn=fake_update,
        metrics_log=Log(),
    )
    assert out == 3
    assert seen == [[3, 4]] * 3  # examples 1 and 3 of each step's four
    assert logged == [(-3, {"sft_loss": 0.0}), (-1, {"sft_loss": 2.0})]  # every 20th step and the last


def test_a_batch_of_the_wrong_size_is_an_error():
    with pytest.raises(ValueError, match="gave 4 examples, the stage's batch_size is 8"):
        run_sft(
            0,
            lambda step: _examples(),
            SFTConfig(steps=1, batch_size=8),
            pad_token_id=PAD,
            data_parallel=(0, 1),
            update_fn=lambda s, b, f: (s, {"loss": 0.0}),
        )


def test_optimizer_is_scheduled_over_the_stage():
    cfg = SFTConfig(steps=17)
    assert sft_optim(cfg).total_training_steps == 17 and sft_optim(cfg).lr == cfg.optim.lr


@pytest.mark.slow
def test_nll_falls_with_a_real_engine(tmp_path):
    """A tiny model, the FSDP engine on one process: the NLL of the fixed examples falls by half."""
    from backends.distributed.setup import init_distributed, shutdown
    from backends.models import TinyModelConfig, build_char_tokenizer, write_tiny_model
    from backends.training.fsdp import FSDPConfig, build_actor, compute_logprobs, update

    torch.manual_seed(0)
    tokenizer = build_char_tokenizer()
    write_tiny_model(
        tmp_path / "model",
        TinyModelConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=96),
        tokenizer,
    )
    texts = [("12+3=", "15"), ("40+7=", "47"), ("9+9=", "18"), ("71+2=", "73")]
    examples = [SFTExample(tokenizer.encode(p), tokenizer.encode(a) + [tokenizer.eos_token_id]) for p, a in texts]
    batch = sft_batch(examples, tokenizer.pad_token_id)
    cfg = SFTConfig(steps=30, batch_size=4, optim=OptimConfig(lr=1e-2, weight_decay=0.0))
    env = init_distributed()
    try:
        state = build_actor(tmp_path / "model", env, sft_optim(cfg), FSDPConfig(micro_batch_size=4))

        def nll(state) -> float:
            logprobs = compute_logprobs(state, batch).logprobs
            return float(-(logprobs * batch.response_mask).sum() / batch.response_mask.sum())

        before = nll(state)
        state = run_sft(
            state,
            lambda step: examples,
            cfg,
            pad_token_id=tokenizer.pad_token_id,
            data_parallel=(0, 1),
            update_fn=update,
        )
        after = nll(state)
    finally:
        shutdown(env)
    assert after < 0.5 * before, (before, after)
