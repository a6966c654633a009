"""Generate tests/golden/kl.safetensors from verl 0.9.1 (run with the verl venv):

    /work/peer-verl/bin/python tests/golden/make_kl_golden.py            # writes the golden file
    /work/peer-verl/bin/python tests/golden/make_kl_golden.py --print    # also prints the schedule and
                                                                         # gsm8k values hard-coded in
                                                                         # tests/test_schedules.py, test_rewards.py

Contents (fp32 unless noted; tiny shapes, well under 200 KB):
- ``kl/logprobs``, ``kl/ref_logprobs`` (b t), ``kl/weights`` (b t) and for every kind K of verl's
  ``core_algos.kl_penalty``: ``kl/K/value`` and ``kl/K/grad`` (the gradient of ``sum(weights * value)``
  w.r.t. logprobs). The inputs include log-ratios beyond verl's clamps.
- ``kl_loss/mask`` (b t, bool) and ``kl_loss/<agg>`` for ``agg_loss(kl_penalty(.., "low_var_kl"), ..)``.
- ``reward_kl/*``: verl's ``ray_trainer.apply_kl_penalty`` with an ``AdaptiveKLController``: token scores,
  the new token rewards, the observed KL and the coefficient before/after the update (float64).
- ``ctrl/*``: a sequence of ``AdaptiveKLController.update`` calls (observed KLs, n_steps, betas, float64).
- ``logits/*``: ``logprobs_from_logits`` and ``entropy_from_logits`` values and gradients (fp32 logits),
  plus verl's bf16 ``logprobs_from_logits`` output for bf16 logits (to document the difference).

``ray_trainer`` cannot be imported in the CPU verl venv (it needs torchdata), so ``apply_kl_penalty`` is
taken from the verl source file by name with ``ast`` and executed against verl's own ``core_algos`` and
``masked_mean``; nothing of verl's is copied into this repository.
"""

from __future__ import annotations

import ast
import pathlib
import sys

import torch
import verl
import verl.trainer.ppo.core_algos as core_algos
import verl.utils.torch_functional as verl_F
from safetensors.torch import save_file

OUT = pathlib.Path(__file__).with_name("kl.safetensors")
KINDS = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"]
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def load_apply_kl_penalty():
    """verl's ``ray_trainer.apply_kl_penalty``, executed from its source file (see module docstring)."""
    path = pathlib.Path(verl.__file__).parent / "trainer" / "ppo" / "ray_trainer.py"
    tree = ast.parse(path.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "apply_kl_penalty")
    fn.args.args[0].annotation = None
    fn.args.args[1].annotation = None
    namespace = {"torch": torch, "core_algos": core_algos, "masked_mean": verl_F.masked_mean}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), namespace)
    return namespace["apply_kl_penalty"]


class _Batch(dict):
    def __init__(self, tensors, batch_size):
        super().__init__(tensors)
        self.batch_size = torch.Size([batch_size])


class _Data:
    """The two attributes of ``DataProto`` that ``apply_kl_penalty`` touches."""

    def __init__(self, tensors, batch_size):
        self.batch = _Batch(tensors, batch_size)


def main() -> None:
    g = torch.Generator().manual_seed(1234)
    out: dict[str, torch.Tensor] = {}

    # ---- kl_penalty: every kind, value and gradient ----------------------------------------------------
    b, t = 4, 7
    logprobs = -torch.rand(b, t, generator=g) * 4.0
    ref_logprobs = logprobs + torch.randn(b, t, generator=g) * 1.5
    # log-ratios beyond the clamps: |log r| > 20 and r - 1 - log r > 10 on both sides
    logprobs[0, 0], ref_logprobs[0, 0] = -1.0, -30.0
    logprobs[0, 1], ref_logprobs[0, 1] = -30.0, -1.0
    logprobs[0, 2], ref_logprobs[0, 2] = -3.0, -15.0
    logprobs[0, 3], ref_logprobs[0, 3] = -15.0, -3.0
    logprobs[0, 4], ref_logprobs[0, 4] = -2.0, -2.0
    weights = torch.randn(b, t, generator=g)
    out["kl/logprobs"], out["kl/ref_logprobs"], out["kl/weights"] = logprobs, ref_logprobs, weights
    for kind in KINDS:
        lp = logprobs.clone().requires_grad_()
        value = core_algos.kl_penalty(lp, ref_logprobs, kind)
        (value * weights).sum().backward()
        out[f"kl/{kind}/value"] = value.detach().contiguous()
        out[f"kl/{kind}/grad"] = lp.grad.detach().contiguous()

    # ---- kl loss: verl's actor KL loss (kl_penalty + agg_loss), every aggregation mode ----------------
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[0, :5] = True
    mask[3] = False  # an empty sequence
    mask[3, -1] = False
    out["kl_loss/mask"] = mask
    kld = core_algos.kl_penalty(logprobs, ref_logprobs, "low_var_kl")
    for mode in AGG_MODES:
        out[f"kl_loss/{mode}"] = core_algos.agg_loss(kld, mask.float(), mode).reshape(())
    out["kl_loss/token-mean/k1"] = core_algos.agg_loss(
        core_algos.kl_penalty(logprobs, ref_logprobs, "k1"), mask.float(), "token-mean"
    ).reshape(())

    # ---- KL in the reward: apply_kl_penalty + AdaptiveKLController ------------------------------------
    apply_kl_penalty = load_apply_kl_penalty()
    scores = torch.zeros(b, t)
    scores[:, -1] = torch.randn(b, generator=g)
    old_lp = -torch.rand(b, t, generator=g) * 3.0
    ref_lp = old_lp + torch.randn(b, t, generator=g) * 0.3
    out["reward_kl/scores"], out["reward_kl/old_logprobs"], out["reward_kl/ref_logprobs"] = scores, old_lp, ref_lp
    out["reward_kl/mask"] = mask.clone()
    for kind in ["kl", "low_var_kl"]:
        ctrl = core_algos.AdaptiveKLController(init_kl_coef=0.05, target_kl=0.02, horizon=100)
        data = _Data(
            {
                "response_mask": mask.float(),
                "token_level_scores": scores,
                "old_log_probs": old_lp,
                "ref_log_prob": ref_lp,
            },
            batch_size=b,
        )
        data, metrics = apply_kl_penalty(data, ctrl, kl_penalty=kind)
        out[f"reward_kl/{kind}/token_rewards"] = data.batch["token_level_rewards"].contiguous()
        out[f"reward_kl/{kind}/observed_kl"] = torch.tensor(metrics["actor/reward_kl_penalty"], dtype=torch.float64)
        out[f"reward_kl/{kind}/beta_before"] = torch.tensor(
            metrics["actor/reward_kl_penalty_coeff"], dtype=torch.float64
        )
        out[f"reward_kl/{kind}/beta_after"] = torch.tensor(ctrl.value, dtype=torch.float64)

    # ---- adaptive controller over many updates ----------------------------------------------------------
    observed = torch.rand(40, generator=g, dtype=torch.float64) * 0.08
    n_steps = torch.randint(1, 64, (40,), generator=g)
    ctrl = core_algos.AdaptiveKLController(init_kl_coef=0.1, target_kl=0.03, horizon=500)
    betas = []
    for kl, n in zip(observed.tolist(), n_steps.tolist()):
        ctrl.update(current_kl=kl, n_steps=n)
        betas.append(ctrl.value)
    out["ctrl/observed_kl"], out["ctrl/n_steps"] = observed, n_steps
    out["ctrl/betas"] = torch.tensor(betas, dtype=torch.float64)
    fixed = core_algos.FixedKLController(kl_coef=0.07)
    fixed.update(current_kl=0.5, n_steps=8)
    out["ctrl/fixed_beta"] = torch.tensor(fixed.value, dtype=torch.float64)

    # ---- log-probs and entropy from logits ----------------------------------------------------------------
    b, t, v = 2, 5, 33
    logits = torch.randn(b, t, v, generator=g) * 3.0
    labels = torch.randint(0, v, (b, t), generator=g)
    w = torch.randn(b, t, generator=g)
    out["logits/logits"], out["logits/labels"], out["logits/weights"] = logits, labels, w
    x = logits.clone().requires_grad_()
    lp = verl_F.logprobs_from_logits(x, labels)
    (lp * w).sum().backward()
    out["logits/logprobs"], out["logits/logprobs_grad"] = lp.detach(), x.grad.clone()
    x.grad = None
    ent = verl_F.entropy_from_logits(x)
    (ent * w).sum().backward()
    out["logits/entropy"], out["logits/entropy_grad"] = ent.detach(), x.grad.clone()
    out["logits/entropy_chunked"] = verl_F.entropy_from_logits_with_chunking(
        logits.reshape(b * t, v), chunk_size=3
    ).reshape(b, t)
    logits_bf16 = logits.to(torch.bfloat16)
    out["logits/logits_bf16"] = logits_bf16
    out["logits/verl_bf16_logprobs"] = verl_F.logprobs_from_logits(logits_bf16, labels)

    out = {k: v.detach().clone().contiguous() for k, v in out.items()}
    save_file(out, str(OUT), metadata={"generator": f"tests/golden/make_kl_golden.py with verl {verl.__version__}"})
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(out)} tensors)")

    if "--print" in sys.argv:
        print_schedules()
        print_gsm8k()


def print_schedules() -> None:
    """Values of verl's FSDP-engine schedules (``LambdaLR`` multipliers) for tests/test_schedules.py."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    configs = {
        "constant_warmup": lambda: verl_F.get_constant_schedule_with_warmup(opt, num_warmup_steps=4),
        "cosine": lambda: verl_F.get_cosine_schedule_with_warmup(
            opt, num_warmup_steps=3, num_training_steps=12, min_lr_ratio=0.1
        ),
        "cosine_no_warmup": lambda: verl_F.get_cosine_schedule_with_warmup(
            opt, num_warmup_steps=0, num_training_steps=10
        ),
        "cosine_cycles": lambda: verl_F.get_cosine_schedule_with_warmup(
            opt, num_warmup_steps=2, num_training_steps=10, num_cycles=1.0, min_lr_ratio=0.2
        ),
        "cosine_one_indexed": lambda: verl_F.get_cosine_schedule_with_warmup(
            opt, num_warmup_steps=3, num_training_steps=12, min_lr_ratio=0.1, zero_indexed_step=False
        ),
        "cosine_init": lambda: verl_F.get_cosine_schedule_with_warmup(
            opt, num_warmup_steps=4, num_training_steps=12, init_lr_ratio=0.25
        ),
    }
    for name, make in configs.items():
        for group in opt.param_groups:
            group["lr"] = 1.0
            group.pop("initial_lr", None)
        sched = make()
        steps = 13 if name != "cosine_no_warmup" and name != "cosine_cycles" else 11
        values = [sched.lr_lambdas[0](s) for s in range(steps)]
        print(f"    {name!r}: {values!r},")


def print_gsm8k() -> None:
    from verl.utils.reward_score import gsm8k

    cases = [
        ("The answer is #### 42", "42"),
        ("#### 1,234", "1234"),
        ("#### -7", "-7"),
        ("#### 3.5", "3.5"),
        ("#### 42.", "42"),
        ("####42", "42"),
        ("#### 41 then #### 42", "42"),
        ("no answer here", "42"),
        ("The answer is 42", "42"),
        ("x" * 400 + "#### 42", "42"),
        ("#### 42" + "x" * 400, "42"),
        ("#### $42", "42"),
        ("#### 4,2", "42"),
        ("#### 43", "42"),
        ("so 1 . 2 .", "2"),
        (". . .", "2"),
        ("", "0"),
    ]
    for response, truth in cases:
        strict = gsm8k.compute_score(response, truth, method="strict", format_score=0.1, score=1.0)
        flexible = gsm8k.compute_score(response, truth, method="flexible", format_score=0.1, score=1.0)
        print(f"    ({response!r}, {truth!r}, {float(strict)!r}, {float(flexible)!r}),")


if __name__ == "__main__":
    main()
