"""A model whose lm_head returns a view, sharded with FSDP2 on 2 gloo ranks: no "returned a view tensor" warning, and
the gradients of a multi-turn-shaped update (only the model's own tokens in the loss) equal an unsharded run's.

A linear layer that computes a 2-D product and reshapes it with ``.view`` (what a fused CPU linear does for large
products, such as the lm_head of a multi-turn micro-batch with its long responses) makes the root module's logits a
view, and FSDP2 then warns "FSDP2-wrapped module (Qwen2ForCausalLM) returned a view tensor ... can cause backward to
fail or produce wrong gradients" on every rank. ``ViewLinear`` below returns such a view at every size, so this test
exercises the engine's guard (``backends.training.hf_modules.outputs_without_views``) on any CPU.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from backends.models import TinyModelConfig, load_causal_lm, write_tiny_model
from backends.training.common import ModelOutputs
from rlfunc.aggregation import aggregate
from rlfunc.batch import RolloutBatch, loss_tokens, select
from tests.distributed import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.multiturn]

TINY = TinyModelConfig(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, max_position_embeddings=64, seed=3
)


class ViewLinear(torch.nn.Linear):
    """``nn.Linear`` whose result is a ``.view`` of a 2-D product, as the fused CPU linear's is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias)
        return out.view(*x.shape[:-1], self.weight.shape[0])


def model_with_view_head(model_dir: str) -> torch.nn.Module:
    model, _ = load_causal_lm(model_dir)
    model.lm_head.__class__ = ViewLinear  # same parameters, the forward above
    return model


def multi_turn_batch(rows: int = 8, prompt: int = 4, response: int = 10) -> RolloutBatch:
    """Trajectories of two model turns around a tool observation: every token is read, the model's own carry loss."""
    g = torch.Generator().manual_seed(0)
    loss_mask = torch.zeros(rows, response, dtype=torch.bool)
    loss_mask[:, :3] = True  # the model's first turn
    loss_mask[:, 6:] = True  # its answer after the observation (tokens 3..5)
    return RolloutBatch(
        prompt_ids=torch.randint(4, 90, (rows, prompt), generator=g),
        prompt_mask=torch.ones(rows, prompt, dtype=torch.bool),
        response_ids=torch.randint(4, 90, (rows, response), generator=g),
        response_mask=torch.ones(rows, response, dtype=torch.bool),
        loss_mask=loss_mask,
        group_ids=torch.arange(rows) // 4,
        advantages=torch.randn(rows, response, generator=g),
    )


def pg_loss(outputs: ModelOutputs, mb: RolloutBatch, norms) -> tuple[torch.Tensor, dict]:
    return aggregate(-mb.advantages * outputs.logprobs, loss_tokens(mb), mode="token-mean", norms=norms), {}


def _sharded_update(rank: int, world_size: int, model_dir: str) -> dict:
    from backends.distributed.setup import init_distributed
    from backends.training.fsdp import build_actor, update
    from backends.training.fsdp_state import FSDPConfig
    from backends.training.optim import OptimConfig

    env = init_distributed()
    state = build_actor(
        model_with_view_head(model_dir), env, OptimConfig(lr=1e-3, clip_grad=1e9), FSDPConfig(micro_batch_size=2)
    )
    names = {id(p): n for n, p in state.module.named_parameters()}
    grads = {}
    state.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: grads.update(
            {names[id(p)]: p.grad.full_tensor().numpy().copy() for group in opt.param_groups for p in group["params"]}
        )
    )
    batch = multi_turn_batch()
    half = batch.prompt_ids.shape[0] // world_size
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        update(state, select(batch, slice(rank * half, (rank + 1) * half)), pg_loss)
    return {"warnings": [str(w.message) for w in caught if "view tensor" in str(w.message)], "grads": grads}


@pytest.mark.timeout(300)
def test_a_view_returning_head_under_fsdp2_warns_nothing_and_gives_the_unsharded_gradients(tmp_path):
    model_dir = str(write_tiny_model(tmp_path / "model", TINY))
    reference = model_with_view_head(model_dir)
    batch = multi_turn_batch()
    hidden = torch.randn(2, 3, TINY.hidden_size)
    assert reference.lm_head(hidden)._base is not None  # the head does return a view

    from backends.training.hf_forward import forward_micro_batch
    from rlfunc.aggregation import local_normalizers

    outputs = forward_micro_batch(reference, batch, with_entropy=False)
    loss, _ = pg_loss(outputs, batch, local_normalizers(loss_tokens(batch)))
    loss.backward()
    expected = {n: p.grad.numpy() for n, p in reference.named_parameters()}

    results = run_distributed(_sharded_update, 2, model_dir, timeout=240)
    for rank, result in enumerate(results):
        assert result["warnings"] == [], f"rank {rank}: {result['warnings']}"
        assert set(result["grads"]) == set(expected)
        worst = max(float(np.abs(result["grads"][n] - expected[n]).max()) for n in expected)
        assert worst < 1e-5, f"rank {rank}: gradients differ from the unsharded run by {worst}"
