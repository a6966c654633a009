"""The shape of rlfunc's public API: keyword-only arguments, read-only registries, the version.

A verbatim positional port of a verl call must fail loudly, not compute something else: verl orders
several tensors differently (``compute_policy_loss_*(old_log_prob, log_prob, ...)``,
``compute_value_loss(vpreds, returns, values, ...)``), so every argument after the first tensor of a
loss, estimator or correction is keyword-only.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import types
from pathlib import Path

import pytest
import torch

import rlfunc as rf

B, T = 4, 5

# Module functions that are not losses, estimators or corrections, and so keep positional arguments:
# a mask utility, the name lookups and a one-argument KL controller.
NOT_KEYWORD_ONLY = {
    "zero_advantage_rows",
    "get_advantage_estimator",
    "get_policy_loss",
    "fixed_kl_controller",
}
# By module path: ``rlfunc.value_loss`` is the function (the package star-imports its modules).
LOSS_AND_ESTIMATOR_MODULES = [
    importlib.import_module(f"rlfunc.{name}")
    for name in (
        "token_advantages",
        "outcome_advantages",
        "advantages",
        "policy_losses",
        "policy_loss_registry",
        "value_loss",
        "kl",
        "importance",
    )
]


def _inputs():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(B, T, generator=g) * 3
    new = old + 0.3 * torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) < 0.8
    return {
        "logprobs": new,
        "old_logprobs": old,
        "advantages": torch.randn(B, T, generator=g),
        "mask": mask,
        "values": torch.randn(B, T, generator=g),
        "returns": torch.randn(B, T, generator=g),
        "scores": torch.rand(B, generator=g),
        "ids": torch.tensor([0, 0, 1, 1]),
    }


def _public_functions(module: types.ModuleType) -> list[tuple[str, object]]:
    return [
        (name, getattr(module, name))
        for name in module.__all__
        if inspect.isfunction(getattr(module, name))
        and getattr(module, name).__module__ == module.__name__  # re-exports are tested at their home
        and name not in NOT_KEYWORD_ONLY
    ]


def _assert_keyword_only_after_first(name: str, fn: object) -> None:
    params = list(inspect.signature(fn).parameters.values())
    assert params, name
    assert params[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, f"{name}: first argument {params[0].name}"
    positional = [p.name for p in params[1:] if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert not positional, f"{name}: {positional} can be passed positionally; make them keyword-only"


# ----------------------------------------------------------------------------------------------------
# keyword-only after the first tensor


@pytest.mark.parametrize(
    "name, fn",
    [(f"{m.__name__}.{n}", f) for m in LOSS_AND_ESTIMATOR_MODULES for n, f in _public_functions(m)],
)
def test_losses_estimators_and_corrections_are_keyword_only_after_the_first_tensor(name, fn):
    _assert_keyword_only_after_first(name, fn)


@pytest.mark.parametrize(
    "registry",
    [rf.ADVANTAGE_ESTIMATORS, rf.POLICY_LOSSES],
    ids=["ADVANTAGE_ESTIMATORS", "POLICY_LOSSES"],
)
def test_registry_functions_are_keyword_only_after_the_first_argument(registry):
    for name, fn in registry.items():
        _assert_keyword_only_after_first(name, fn)


@pytest.mark.parametrize("fn", sorted(set(rf.POLICY_LOSSES.values()), key=lambda f: f.__name__))
def test_policy_loss_in_verl_positional_order_raises(fn):
    x = _inputs()
    # verl: compute_policy_loss_*(old_log_prob, log_prob, advantages, response_mask, ...)
    with pytest.raises(TypeError, match="positional argument"):
        fn(x["old_logprobs"], x["logprobs"], x["advantages"], x["mask"])
    loss, _ = fn(x["logprobs"], old_logprobs=x["old_logprobs"], advantages=x["advantages"], response_mask=x["mask"])
    assert loss.dim() == 0


def test_swapping_old_and_new_logprobs_changes_the_ppo_loss():
    """Why the keywords matter: the verl order, read with our names, is a different (wrong) loss."""
    x = _inputs()
    right, _ = rf.ppo_policy_loss(
        x["logprobs"], old_logprobs=x["old_logprobs"], advantages=x["advantages"], response_mask=x["mask"]
    )
    swapped, _ = rf.ppo_policy_loss(
        x["old_logprobs"], old_logprobs=x["logprobs"], advantages=x["advantages"], response_mask=x["mask"]
    )
    assert not torch.allclose(right, swapped)


def test_value_loss_in_verl_positional_order_raises():
    x = _inputs()
    # verl: compute_value_loss(vpreds, returns, values, response_mask, cliprange_value, ...)
    with pytest.raises(TypeError, match="positional argument"):
        rf.value_loss(x["values"], x["returns"], x["old_logprobs"], x["mask"], 0.5)
    rf.value_loss(x["values"], old_values=x["old_logprobs"], returns=x["returns"], response_mask=x["mask"])


def test_token_level_estimators_in_verl_positional_order_raise():
    x = _inputs()
    rewards = torch.randn(B, T)
    # verl: compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam)
    with pytest.raises(TypeError, match="positional argument"):
        rf.gae(rewards, x["values"], x["mask"], 1.0, 0.95)
    # verl: compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, gamma)
    with pytest.raises(TypeError, match="positional argument"):
        rf.reinforce_pp(rewards, x["mask"], 1.0)
    rf.gae(rewards, values=x["values"], response_mask=x["mask"], gamma=1.0, lam=0.95)
    rf.reinforce_pp(rewards, response_mask=x["mask"], gamma=1.0)


@pytest.mark.parametrize("fn", [rf.grpo, rf.grpo_passk, rf.rloo, rf.reinforce_pp_baseline, rf.opo, rf.gpg])
def test_outcome_estimators_in_verl_positional_order_raise(fn):
    x = _inputs()
    # verl: compute_*_outcome_advantage(token_level_rewards, response_mask, index, ...)
    with pytest.raises(TypeError, match="positional argument"):
        fn(x["scores"], x["mask"], x["ids"])
    fn(x["scores"], group_ids=x["ids"], response_mask=x["mask"])


def test_remax_in_verl_positional_order_raises():
    x = _inputs()
    # verl: compute_remax_outcome_advantage(token_level_rewards, reward_baselines, response_mask)
    with pytest.raises(TypeError, match="positional argument"):
        rf.remax(x["scores"], x["scores"], x["mask"])
    rf.remax(x["scores"], baseline_scores=torch.zeros(B), response_mask=x["mask"])


def test_kl_functions_in_verl_positional_order_raise():
    x = _inputs()
    lp, ref, mask = x["logprobs"], x["old_logprobs"], x["mask"]
    # verl: kl_penalty(logprob, ref_logprob, kl_penalty)
    with pytest.raises(TypeError, match="positional argument"):
        rf.kl_penalty(lp, ref, "kl")
    with pytest.raises(TypeError, match="positional argument"):
        rf.kl_loss(lp, ref, mask)
    with pytest.raises(TypeError, match="positional argument"):
        rf.apply_kl_penalty_to_rewards(torch.zeros(B, T), lp, ref, mask, beta=0.1)
    rf.kl_penalty(lp, ref_logprobs=ref, kind="kl")
    rf.kl_loss(lp, ref_logprobs=ref, mask=mask)
    rf.apply_kl_penalty_to_rewards(torch.zeros(B, T), logprobs=lp, ref_logprobs=ref, mask=mask, beta=0.1)


def test_importance_weights_positionally_raise():
    x = _inputs()
    with pytest.raises(TypeError, match="positional argument"):
        rf.rollout_is_weights(x["logprobs"], x["old_logprobs"], x["mask"])
    rf.rollout_is_weights(x["logprobs"], rollout_logprobs=x["old_logprobs"], response_mask=x["mask"])


def test_aggregate_in_verl_positional_order_raises():
    """verl's ``agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size)``: the fourth argument must not land in norms."""
    x = _inputs()
    v, mask = x["values"], x["mask"]
    with pytest.raises(TypeError, match="positional argument"):
        rf.aggregate(v, mask, "token-sum", 4)
    with pytest.raises(TypeError, match="positional argument"):
        rf.aggregate(v, mask, "token-mean")
    with pytest.raises(TypeError, match=r"verl's keyword\(s\) loss_agg_mode, dp_size: here loss_agg_mode= -> mode"):
        rf.aggregate(v, mask, loss_agg_mode="token-mean", dp_size=2)
    assert rf.aggregate(v, mask, mode="token-sum") == torch.where(mask, v, 0.0).sum()


def test_masked_ops_take_dim_by_keyword():
    x = _inputs()
    v, mask = x["values"], x["mask"]
    for fn in (rf.masked_mean, rf.masked_sum, rf.masked_var):
        with pytest.raises(TypeError, match="positional argument"):
            fn(v, mask, -1)
        assert fn(v, mask, dim=-1).shape == (B,)


def test_value_loss_with_verls_keyword_names_raises_naming_ours():
    """verl's ``values`` is the OLD prediction (``compute_value_loss(vpreds, returns, values, ...)``): a by-name
    port must fail, naming new_values / old_values, not compute a different loss."""
    x = _inputs()
    new, old = x["values"], x["values"] + 0.5
    with pytest.raises(TypeError, match=r"values= -> old_values \(verl's `values` is the prediction when"):
        rf.value_loss(new, values=old, returns=x["returns"], response_mask=x["mask"])
    with pytest.raises(TypeError, match=r"vpreds= -> new_values.*values= -> old_values.*cliprange_value= -> clip"):
        rf.value_loss(vpreds=new, returns=x["returns"], values=old, response_mask=x["mask"], cliprange_value=0.5)
    params = list(inspect.signature(rf.value_loss).parameters)
    assert params[:2] == ["new_values", "old_values"] and "values" not in params and "vpreds" not in params


@pytest.mark.parametrize("fn", sorted(set(rf.POLICY_LOSSES.values()), key=lambda f: f.__name__))
def test_policy_loss_with_verls_keyword_names_raises_naming_ours(fn):
    x = _inputs()
    with pytest.raises(TypeError, match=r"old_log_prob= -> old_logprobs.*loss_agg_mode= -> agg"):
        fn(
            x["logprobs"],
            old_log_prob=x["old_logprobs"],
            advantages=x["advantages"],
            response_mask=x["mask"],
            loss_agg_mode="token-mean",
        )


def test_every_policy_loss_takes_the_uniform_call():
    """What a loop passes, the same for every built-in (rlfunc.policy_losses' docstring)."""
    x = _inputs()
    norms = rf.local_normalizers(x["mask"])
    for name, fn in rf.POLICY_LOSSES.items():
        loss, metrics = fn(
            x["logprobs"],
            old_logprobs=x["old_logprobs"],
            advantages=x["advantages"],
            response_mask=x["mask"],
            behaviour_logprobs=x["old_logprobs"] - 0.1,
            is_weights=None,
            agg="token-mean",
            norms=norms,
            horizon=T,
            seed=3,
        )
        assert loss.dim() == 0 and torch.isfinite(loss), name


# ----------------------------------------------------------------------------------------------------
# registries: public, read-only, built-ins only


REGISTRIES = {
    "ADVANTAGE_ESTIMATORS": rf.ADVANTAGE_ESTIMATORS,
    "ADVANTAGE_ESTIMATOR_ALIASES": rf.ADVANTAGE_ESTIMATOR_ALIASES,
    "POLICY_LOSSES": rf.POLICY_LOSSES,
    "REWARD_FUNCTIONS": rf.REWARD_FUNCTIONS,
}


@pytest.mark.parametrize("name", sorted(REGISTRIES))
def test_registries_are_read_only_mappings(name):
    registry = REGISTRIES[name]
    assert isinstance(registry, types.MappingProxyType)
    key = next(iter(registry))
    with pytest.raises(TypeError):
        registry["mine"] = registry[key]  # type: ignore[index]
    with pytest.raises(TypeError):
        del registry[key]  # type: ignore[attr-defined]
    for method in ("update", "pop", "setdefault", "clear", "popitem"):
        assert not hasattr(registry, method), method
    assert "mine" not in registry and key in registry


def test_lookups_return_the_registered_functions_and_name_the_known_ones():
    for name, fn in rf.ADVANTAGE_ESTIMATORS.items():
        assert rf.get_advantage_estimator(name) is fn
    for name, fn in rf.POLICY_LOSSES.items():
        assert rf.get_policy_loss(name) is fn
    for name, fn in rf.REWARD_FUNCTIONS.items():
        assert rf.get_reward_fn(name) is fn
    with pytest.raises(ValueError, match="known: .*grpo"):
        rf.get_advantage_estimator("my_estimator")
    with pytest.raises(ValueError, match="known policy losses: .*ppo"):
        rf.get_policy_loss("my_loss")
    with pytest.raises(KeyError, match="known: .*gsm8k"):
        rf.get_reward_fn("my_reward")


def test_no_public_mutable_module_state():
    """A user's function is resolved by reference outside rlfunc, so nothing here needs to be writable."""
    package = Path(rf.__file__).parent
    for path in sorted(package.glob("*.py")):
        module = importlib.import_module(f"rlfunc.{path.stem}") if path.stem != "__init__" else rf
        for name, value in vars(module).items():
            if not name.startswith("_"):
                assert not isinstance(value, (dict, list, set, bytearray)), f"{module.__name__}.{name} is mutable"


def test_advantage_estimators_importable_from_their_old_home():
    from rlfunc.advantages import gae, grpo, remax, zero_advantage_rows

    assert gae is rf.gae and grpo is rf.grpo and remax is rf.remax and zero_advantage_rows is rf.zero_advantage_rows


# ----------------------------------------------------------------------------------------------------
# version


def test_version_is_the_installed_distribution_version():
    assert rf.__version__ == importlib.metadata.version("rlfunc") == "0.1.0"


def test_version_falls_back_to_the_literal_when_not_installed(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    # A second copy of the package's __init__ under another name: ``rlfunc`` itself is left untouched.
    spec = importlib.util.spec_from_file_location("rlfunc_uninstalled_copy", rf.__file__)
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    assert copy.__version__ == "0.1.0"
    assert copy.gae is rf.gae
