"""The optimizer: its state exists from the start, and the steps are the ones a lazily built AdamW takes."""

from __future__ import annotations

import torch

from backends.training.optim import OptimConfig, build_optimizer


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(7, generator=g))]


def test_state_is_allocated_at_build_and_the_steps_are_unchanged():
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    eager_params, lazy_params = _params(0), _params(0)
    eager = build_optimizer(eager_params, cfg)
    # the moments exist before any step, at zero, with the step counters at 0; the weights did not move
    assert len(eager.state) == 2
    for p, start in zip(eager_params, _params(0)):
        state = eager.state[p]
        assert torch.equal(p.detach(), start.detach()) and p.grad is None
        assert float(state["step"]) == 0.0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    lazy = torch.optim.AdamW(
        lazy_params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, fused=True
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in eager_params]
        for ps, opt in ((eager_params, eager), (lazy_params, lazy)):
            for p, grad in zip(ps, grads):
                p.grad = grad.clone()
            opt.step()
    for a, b in zip(eager_params, lazy_params):
        assert torch.equal(a, b)
    assert float(eager.state[eager_params[0]]["step"]) == 3.0
