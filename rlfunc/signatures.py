"""Signature guards for ports from verl: its keyword names refused with ours, and verl-named variants.

A port of a verl call that passes verl's keyword names (``compute_value_loss(vpreds=..., values=...)``,
``agg_loss(..., loss_agg_mode=...)``) must fail before any work, naming the keywords to use here, not compute
a different quantity: verl's ``values`` in its value loss is the *old* prediction, for instance.
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any, Callable, Mapping, TypeVar

__all__ = ["VERL_POLICY_LOSS_KEYWORDS", "refuse_verl_keywords", "with_defaults"]

F = TypeVar("F", bound=Callable[..., Any])

#: verl's keywords of ``compute_policy_loss_*(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
#: config, rollout_is_weights)`` -> what a policy loss here takes instead
VERL_POLICY_LOSS_KEYWORDS: Mapping[str, str] = types.MappingProxyType(
    {
        "log_prob": "logprobs (the first argument: the policy being trained)",
        "old_log_prob": "old_logprobs",
        "loss_agg_mode": "agg",
        "rollout_is_weights": "is_weights",
        "config": "the loss's own keywords (clip_low, clip_high, ...; see its signature)",
    }
)


def refuse_verl_keywords(**ours: str) -> Callable[[F], F]:
    """Decorator: a call passing one of verl's keyword names (the keys of ``ours``) raises ``TypeError`` naming
    what to pass here instead (the values), before any work. The signature seen by ``inspect`` is unchanged."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            if verl := [key for key in kwargs if key in ours]:
                hints = "; ".join(f"{key}= -> {ours[key]}" for key in verl)
                raise TypeError(f"{fn.__name__}() got verl's keyword(s) {', '.join(verl)}: here {hints}")
            return fn(*args, **kwargs)

        checked.verl_keywords = types.MappingProxyType(dict(ours))  # type: ignore[attr-defined]
        return checked  # type: ignore[return-value]

    return wrap


def with_defaults(fn: Callable[..., Any], name: str, doc: str, **defaults: Any) -> Callable[..., Any]:
    """A copy of the function ``fn`` named ``name`` whose keyword-only defaults are ``defaults`` (the rest as
    ``fn``'s), with ``fn``'s verl-keyword guard: e.g. verl's ``vanilla`` loss, PPO with dual clip on at 3.0.

    A real function (not a ``functools.partial``), so ``inspect.signature`` shows the defaults it runs with.
    """
    inner = inspect.unwrap(fn)
    kwdefaults: Mapping[str, Any] = inner.__kwdefaults__ or {}
    if unknown := sorted(set(defaults) - set(kwdefaults)):
        raise TypeError(f"with_defaults({inner.__name__}): {unknown} are not keyword arguments with a default")
    code = inner.__code__.replace(co_name=name, co_qualname=name)  # Python's own TypeErrors name the variant
    copy = types.FunctionType(code, inner.__globals__, name, inner.__defaults__, inner.__closure__)
    copy.__kwdefaults__ = {**kwdefaults, **defaults}
    copy.__annotations__ = dict(inner.__annotations__)
    copy.__qualname__, copy.__module__, copy.__doc__ = name, inner.__module__, doc
    guard = getattr(fn, "verl_keywords", None)
    return refuse_verl_keywords(**guard)(copy) if guard else copy
