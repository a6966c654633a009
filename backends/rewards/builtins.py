"""The built-in reward functions a config names (``reward.fn=gsm8k``), each ``fn(response, ground_truth) -> float``.

Most are rlfunc's pure parsers (:mod:`rlfunc.rewards`); ``math`` checks LaTeX answers with
`math-verify <https://github.com/huggingface/Math-Verify>`_ (symbolic equivalence through sympy), which is
why it lives here and not in the pure core. ``format`` matches the response against ``reward.format_pattern``
and ignores the ground truth. None of them evaluates the response: they parse it.
"""

from __future__ import annotations

import re
from types import MappingProxyType
from typing import Any, Callable, Mapping

from rlfunc.rewards import arithmetic_reward, boxed_reward, exact_reward, format_reward, gsm8k_reward

__all__ = ["BUILTIN_REWARDS", "builtin_reward", "math_reward"]


def math_reward(response: str, ground_truth: Any) -> float:
    r"""1.0 if the response's final answer is mathematically equal to ``ground_truth``, else 0.0.

    The ground truth is read as LaTeX (boxed for extraction, as verl's ``math_verify`` scorer does); the
    response's last ``\boxed{}`` / ``$...$`` answer or plain expression is extracted by ``math-verify`` and
    compared symbolically (``\frac{1}{2}`` equals ``0.5``, ``x+1`` equals ``1+x``). A response with no
    parsable answer scores 0.0.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    if not isinstance(response, str) or ground_truth is None:
        return 0.0
    truth = str(ground_truth)
    gold = parse(truth if "\\boxed" in truth else f"\\boxed{{{truth}}}", extraction_config=[LatexExtractionConfig()])
    if not gold:
        raise ValueError(f"math: the ground truth {truth!r} does not parse as a LaTeX answer")
    answer = parse(response, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()])
    return 1.0 if answer and verify(gold, answer) else 0.0


def _gsm8k_flexible(response: str, ground_truth: str) -> float:
    return gsm8k_reward(response, ground_truth, method="flexible")


def _gsm8k(response: str, ground_truth: Any) -> float:
    return gsm8k_reward(response, str(ground_truth))


def _arithmetic(response: str, ground_truth: Any) -> float:
    return arithmetic_reward(response, ground_truth)


def _boxed(response: str, ground_truth: Any) -> float:
    return boxed_reward(response, str(ground_truth))


BUILTIN_REWARDS: Mapping[str, Callable[..., float]] = MappingProxyType(
    {
        "exact": exact_reward,  # the stripped response equals the stripped ground truth
        "arithmetic": _arithmetic,  # the integer answer of the a+b= task
        "gsm8k": _gsm8k,  # verl's GSM8K scorer: the number after "#### "
        "gsm8k_flexible": _gsm8k_flexible,  # GSM8K, the last number anywhere
        "boxed": _boxed,  # the last \boxed{} equals the ground truth as a normalised string
        "math": math_reward,  # math-verify's symbolic equality
        "format": format_reward,  # the response matches reward.format_pattern (bound by builtin_reward)
    }
)


def builtin_reward(name: str, *, format_pattern: str) -> Callable[..., float]:
    """The built-in ``name`` as ``fn(response, ground_truth) -> float`` (``format`` bound to its pattern)."""
    if name == "format":
        pattern = re.compile(format_pattern, re.DOTALL)

        def format_score(response: str, ground_truth: Any = None) -> float:
            return format_reward(response, pattern)

        return format_score
    return BUILTIN_REWARDS[name]
