"""Generate tests/golden/losses.safetensors: verl 0.9.1 policy and value losses on small fixed inputs.

Run with the verl venv (rlfunc is not needed):

    /work/peer-verl/bin/python tests/golden/make_losses_golden.py

For every case it stores verl's loss, the gradient of the loss with respect to ``log_prob`` (``vpreds``
for the value loss) and verl's metrics. The case list (loss name, verl settings, the equivalent rlfunc
keyword arguments) is JSON in the file's metadata under ``"cases"``; tests/test_policy_losses.py and
tests/test_value_loss.py replay each case with rlfunc and compare.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from verl.trainer.ppo import core_algos
from verl.workers.config.actor import ActorConfig, PolicyLossConfig

OUT = Path(__file__).with_name("losses.safetensors")
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
NO_DUAL_CLIP = 1e10  # verl cannot turn dual clip off; a huge clip_ratio_c never bites


def make_inputs(seed: int, b: int, t: int, *, empty_row: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3.0
    log_prob = old + 0.5 * torch.randn(b, t, generator=g)
    # outcome-style advantages (constant per row), some rows exactly 0, plus token noise on half the rows
    adv = torch.randn(b, 1, generator=g).expand(b, t).clone()
    adv[1] = 0.0
    adv[b // 2 :] += 0.5 * torch.randn(b - b // 2, t, generator=g)
    lengths = torch.randint(2, t + 1, (b,), generator=g)
    lengths[0] = t
    if empty_row:
        lengths[2] = 0
    mask = torch.arange(t)[None, :] < lengths[:, None]
    is_weights = torch.exp(0.2 * torch.randn(b, t, generator=g))
    values = torch.randn(b, t, generator=g)
    old_values = values + 0.3 * torch.randn(b, t, generator=g)
    returns = values + torch.randn(b, t, generator=g)
    return {
        "old_log_prob": old,
        "log_prob": log_prob,
        "advantages": adv,
        "response_mask": mask,
        "is_weights": is_weights,
        "values": values,
        "old_values": old_values,
        "returns": returns,
    }


def actor_config(verl: dict, global_info: dict) -> ActorConfig:
    policy_loss = PolicyLossConfig(**verl.pop("policy_loss", {}))
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, policy_loss=policy_loss, **verl)
    cfg.global_batch_info.update(global_info)
    return cfg


def run_verl_policy_loss(case: dict, inp: dict[str, torch.Tensor], *, seed: int):
    """verl's loss, its gradient with respect to ``log_prob``, and its metrics for one case."""
    torch.manual_seed(seed)  # clip_cov draws from the global RNG
    log_prob = inp["log_prob"].clone().requires_grad_(True)
    cfg = actor_config(dict(case["verl"], loss_agg_mode=case["agg"]), case["global_info"])
    loss, metrics = core_algos.get_policy_loss_fn(case["loss"])(
        old_log_prob=inp["old_log_prob"],
        log_prob=log_prob,
        advantages=inp["advantages"],
        response_mask=inp["response_mask"],
        loss_agg_mode=case["agg"],
        config=cfg,
        rollout_is_weights=inp["is_weights"] if case["is_weights"] else None,
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss, grad, metrics


def main() -> None:
    tensors: dict[str, torch.Tensor] = {}
    inputs = {"with_empty": make_inputs(0, 8, 16, empty_row=True), "no_empty": make_inputs(1, 5, 9, empty_row=False)}
    for set_name, inp in inputs.items():
        for k, v in inp.items():
            tensors[f"inputs/{set_name}/{k}"] = v.contiguous()

    cases: list[dict] = []

    def policy_case(loss: str, inputs_name: str, agg: str, verl: dict, ours: dict, *, global_info=None, weights=False):
        cases.append(
            dict(
                kind="policy",
                loss=loss,
                inputs=inputs_name,
                agg=agg,
                verl=verl,
                ours=ours,
                global_info=global_info or {},
                is_weights=weights,
            )
        )

    sym = dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2)
    dapo = dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28)
    for agg in AGG_MODES:
        policy_case("vanilla", "with_empty", agg, dict(sym, clip_ratio_c=3.0), dict(clip_low=0.2, dual_clip=3.0))
        policy_case(
            "vanilla",
            "with_empty",
            agg,
            dict(dapo, clip_ratio_c=NO_DUAL_CLIP),
            dict(clip_low=0.2, clip_high=0.28, dual_clip=None),
        )
    # tight clip and a low dual clip so both clips bite on many tokens; rollout IS weights; global normalisers
    policy_case(
        "vanilla",
        "with_empty",
        "token-mean",
        dict(clip_ratio=0.05, clip_ratio_low=0.05, clip_ratio_high=0.1, clip_ratio_c=1.2),
        dict(clip_low=0.05, clip_high=0.1, dual_clip=1.2),
    )
    policy_case(
        "vanilla",
        "with_empty",
        "token-mean",
        dict(dapo, clip_ratio_c=3.0),
        dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0),
        weights=True,
    )
    for agg, info in [
        ("token-mean", {"batch_num_tokens": 100}),
        ("seq-mean-token-mean", {"global_batch_size": 11}),
        ("seq-mean-token-sum", {"global_batch_size": 11}),
        ("seq-mean-token-sum-norm", {"global_batch_size": 11, "loss_scale_factor": 16}),
    ]:
        policy_case(
            "vanilla",
            "with_empty",
            agg,
            dict(sym, clip_ratio_c=3.0),
            dict(clip_low=0.2, dual_clip=3.0),
            global_info=info,
        )

    for agg in ["token-mean", "seq-mean-token-mean"]:
        for clip in [(0.2, 0.2), (0.003, 0.004)]:
            policy_case(
                "gspo",
                "with_empty",
                agg,
                dict(clip_ratio=clip[0], clip_ratio_low=clip[0], clip_ratio_high=clip[1]),
                dict(clip_low=clip[0], clip_high=clip[1]),
            )
    policy_case("gspo", "with_empty", "seq-mean-token-mean", dict(sym), dict(clip_low=0.2), weights=True)

    # verl's sapo always aggregates with seq-mean-token-mean
    policy_case(
        "sapo", "with_empty", "seq-mean-token-mean", dict(tau_pos=1.0, tau_neg=1.05), dict(tau_pos=1.0, tau_neg=1.05)
    )
    policy_case(
        "sapo",
        "with_empty",
        "seq-mean-token-mean",
        dict(tau_pos=2.0, tau_neg=4.0),
        dict(tau_pos=2.0, tau_neg=4.0),
        weights=True,
    )

    for agg in ["token-mean", "seq-mean-token-sum"]:
        policy_case("cispo", "with_empty", agg, dict(dapo), dict(clip_low=0.2, clip_high=0.28))
    policy_case("cispo", "with_empty", "token-mean", dict(sym), dict(clip_low=0.2), weights=True)

    for agg in ["token-mean", "seq-mean-token-mean"]:
        policy_case("gpg", "with_empty", agg, {}, {})
    policy_case("gpg", "with_empty", "token-mean", {}, {}, weights=True)

    # clip_cov: settings where every candidate is picked (the pick is random otherwise), and none
    for lb, ub, ratio in [(0.0, 5.0, 0.9), (0.2, 1.0, 0.5), (100.0, 200.0, 0.0002)]:
        policy_case(
            "clip_cov",
            "with_empty",
            "token-mean",
            dict(sym, policy_loss=dict(clip_cov_ratio=ratio, clip_cov_lb=lb, clip_cov_ub=ub)),
            dict(clip_low=0.2, clip_cov_ratio=ratio, clip_cov_lb=lb, clip_cov_ub=ub),
        )

    for ratio, coef in [(0.0002, 0.1), (0.2, 1.0)]:
        for agg in ["token-mean", "seq-mean-token-sum"]:
            policy_case(
                "kl_cov",
                "with_empty",
                agg,
                dict(policy_loss=dict(kl_cov_ratio=ratio, ppo_kl_coef=coef)),
                dict(kl_cov_ratio=ratio, ppo_kl_coef=coef),
            )

    # verl's geo_mean ignores loss_agg_mode (plain mean over rows): compare with rows all non-empty
    for clip in [(0.2, 0.2), (0.1, 0.4)]:
        policy_case(
            "geo_mean",
            "no_empty",
            "seq-mean-token-mean",
            dict(clip_ratio=clip[0], clip_ratio_low=clip[0], clip_ratio_high=clip[1]),
            dict(clip_low=clip[0], clip_high=clip[1]),
        )
    policy_case("geo_mean", "no_empty", "seq-mean-token-mean", dict(sym), dict(clip_low=0.2), weights=True)

    for i, case in enumerate(cases):
        inp = inputs[case["inputs"]]
        loss, grad, metrics = run_verl_policy_loss(case, inp, seed=0)
        for seed in (1, 2, 3):  # the stored result must not depend on verl's random draws
            loss2, grad2, _ = run_verl_policy_loss(case, inp, seed=seed)
            assert torch.equal(loss, loss2) and torch.equal(grad, grad2), f"case {i} depends on the RNG"
        tensors[f"case{i}/loss"] = loss.detach().reshape(())
        tensors[f"case{i}/grad"] = grad.contiguous()
        case["metrics"] = sorted(metrics)
        for name, value in metrics.items():
            tensors[f"case{i}/metric/{name}"] = torch.tensor(float(value), dtype=torch.float32)

    # value loss: verl has no "unclipped" switch; a huge clip range never bites
    value_cases = [(agg, c) for agg in AGG_MODES for c in (0.2, 0.5)] + [
        ("token-mean", None),
        ("seq-mean-token-sum", None),
    ]
    value_globals = [{}, {"batch_num_tokens": 80, "global_batch_size": 9, "loss_scale_factor": 20}]
    for agg, clip in value_cases:
        for info in value_globals:
            cases.append(dict(kind="value", inputs="with_empty", agg=agg, clip_range=clip, global_info=info))
    for i, case in enumerate(cases):
        if case["kind"] != "value":
            continue
        inp = inputs[case["inputs"]]
        vpreds = inp["values"].clone().requires_grad_(True)
        loss, clipfrac = core_algos.compute_value_loss(
            vpreds=vpreds,
            returns=inp["returns"],
            values=inp["old_values"],
            response_mask=inp["response_mask"],
            cliprange_value=1e10 if case["clip_range"] is None else case["clip_range"],
            loss_agg_mode=case["agg"],
            **case["global_info"],
        )
        (grad,) = torch.autograd.grad(loss, vpreds)
        tensors[f"case{i}/loss"] = loss.detach().reshape(())
        tensors[f"case{i}/grad"] = grad.contiguous()
        tensors[f"case{i}/metric/vf_clipfrac"] = clipfrac.detach().reshape(()).float()

    save_file(tensors, str(OUT), metadata={"cases": json.dumps(cases), "verl_version": _verl_version()})
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(cases)} cases)")


def _verl_version() -> str:
    import verl

    return str(getattr(verl, "__version__", "unknown"))


if __name__ == "__main__":
    main()
