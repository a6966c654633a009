"""Tests for rlfunc.rewards: verifiable reward functions (parse, never evaluate)."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfunc.rewards import (
    REWARD_FUNCTIONS,
    arithmetic_reward,
    boxed_reward,
    canonical_integer,
    extract_boxed_answer,
    extract_gsm8k_answer,
    extract_last_number,
    format_reward,
    get_reward_fn,
    gsm8k_reward,
    normalize_math_answer,
)

ADVERSARIAL = [
    "__import__('os').system('echo pwned')",
    "eval('40+2')",
    "exec('x=42')",
    "40+2",
    "6*7",
    "42 if True else 0",
    "${42}",
    "{{42}}",
    "\x00",
    "\\boxed{",
    "\\boxed{{{{",
    "}}}}\\boxed",
    "#### ",
    "####",
    "",
    "   ",
    "٤٢",  # Arabic-Indic digits for 42: not ASCII, not accepted
    "４２",  # full-width digits
    "42\u200b",  # zero-width space is not whitespace to str.strip
    "1e400",
    "nan",
    "inf",
]


# ---------------------------------------------------------------------------------------------------------
# arithmetic_reward (the synthetic a+b= task)


@pytest.mark.parametrize(
    ("response", "expected", "score"),
    [
        ("42", 42, 1.0),
        ("42", "42", 1.0),
        (" 42 \n", 42, 1.0),
        ("42.", 42, 1.0),
        ("-7", -7, 1.0),
        ("+7", 7, 1.0),
        ("007", 7, 1.0),
        ("-0", 0, 1.0),
        ("0", 0, 1.0),
        ("#### 42", 42, 1.0),
        ("3+39 makes #### 42", 42, 1.0),
        ("####42", 42, 1.0),
        ("#### -5", -5, 1.0),
        ("\\boxed{42}", 42, 1.0),
        ("The sum is \\boxed{ 42 }.", 42, 1.0),
        ("\\boxed{41} no, \\boxed{42}", 42, 1.0),
        ("43", 42, 0.0),
        ("4 2", 42, 0.0),
        ("42 apples", 42, 0.0),
        ("42.0", 42, 0.0),
        ("1,000", 1000, 0.0),
        ("#### 42 and more", 42, 0.0),
        ("#### 41 #### 42", 42, 1.0),
        ("#### 42 #### 41", 42, 0.0),
        ("\\boxed{40+2}", 42, 0.0),
        ("4242", 42, 0.0),
        ("-42", 42, 0.0),
        ("12345678901234567890123456789", 12345678901234567890123456789, 1.0),
    ],
)
def test_arithmetic_cases(response, expected, score):
    assert arithmetic_reward(response, expected) == score


@pytest.mark.parametrize("response", ADVERSARIAL)
def test_arithmetic_adversarial_scores_zero(response):
    assert arithmetic_reward(response, 42) == 0.0
    assert arithmetic_reward(response, 0) == 0.0


@settings(max_examples=50, deadline=None)
@given(st.integers())
def test_property_str_of_int_scores_one(n):
    assert arithmetic_reward(str(n), n) == 1.0
    assert arithmetic_reward(str(n), str(n)) == 1.0
    assert arithmetic_reward(f"#### {n}", n) == 1.0
    assert arithmetic_reward(f"\\boxed{{{n}}}", n) == 1.0
    assert arithmetic_reward(str(n + 1), n) == 0.0


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=60), st.integers(-1000, 1000))
def test_property_never_raises_and_is_binary(text, n):
    assert arithmetic_reward(text, n) in (0.0, 1.0)
    assert gsm8k_reward(text, str(n), format_score=0.1) in (0.0, 0.1, 1.0)
    assert boxed_reward(text, str(n)) in (0.0, 1.0)
    for extract in (extract_gsm8k_answer, extract_boxed_answer, extract_last_number):
        out = extract(text)
        assert out is None or isinstance(out, str)


def test_arithmetic_bad_expected():
    with pytest.raises(ValueError, match="expected must be an int"):
        arithmetic_reward("42", "forty-two")
    with pytest.raises(ValueError, match="expected must be an int"):
        arithmetic_reward("42", 42.0)  # type: ignore[arg-type]
    assert arithmetic_reward(None, 42) == 0.0  # type: ignore[arg-type]


def test_huge_inputs_are_fast():
    """Linear-time parsing: no regex backtracking blow-up, no int() digit limit."""
    t0 = time.perf_counter()
    assert arithmetic_reward("1" + " " * 200_000 + "x", 1) == 0.0
    assert arithmetic_reward("9" * 100_000, int("9" * 4000)) == 0.0
    assert arithmetic_reward("#### " + "1" * 100_000, 5) == 0.0
    assert arithmetic_reward("{" * 100_000 + "\\boxed" + "{" * 100_000, 5) == 0.0
    assert extract_last_number("1," * 100_000) == "1"
    assert gsm8k_reward("9" * 100_000, "9") == 0.0
    assert boxed_reward("\\boxed{" * 50_000, "1") == 0.0
    assert time.perf_counter() - t0 < 5.0


# ---------------------------------------------------------------------------------------------------------
# GSM8K: verl parity


# (response, ground truth, verl strict score, verl flexible score) with format_score=0.1, score=1.0, from
# verl.utils.reward_score.gsm8k.compute_score (printed by tests/golden/make_kl_golden.py --print).
VERL_GSM8K = [
    ("The answer is #### 42", "42", 1.0, 1.0),
    ("#### 1,234", "1234", 1.0, 0.1),
    ("#### -7", "-7", 1.0, 1.0),
    ("#### 3.5", "3.5", 1.0, 1.0),
    ("#### 42.", "42", 0.1, 0.1),
    ("####42", "42", 0.0, 1.0),
    ("#### 41 then #### 42", "42", 1.0, 1.0),
    ("no answer here", "42", 0.0, 0.0),
    ("The answer is 42", "42", 0.0, 1.0),
    ("x" * 400 + "#### 42", "42", 1.0, 1.0),
    ("#### 42" + "x" * 400, "42", 0.0, 0.0),
    ("#### $42", "42", 0.0, 1.0),
    ("#### 4,2", "42", 1.0, 0.1),
    ("#### 43", "42", 0.1, 0.1),
    ("so 1 . 2 .", "2", 0.0, 1.0),
    (". . .", "2", 0.0, 0.1),
    ("", "0", 0.0, 0.0),
]


@pytest.mark.parametrize(("response", "truth", "strict", "flexible"), VERL_GSM8K)
def test_gsm8k_matches_verl(response, truth, strict, flexible):
    assert gsm8k_reward(response, truth, format_score=0.1) == strict
    assert gsm8k_reward(response, truth, method="flexible", format_score=0.1, score=1.0) == flexible


def test_gsm8k_extraction():
    assert extract_gsm8k_answer("so #### -1,234.5") == "-1234.5"
    assert extract_gsm8k_answer("#### 42.") == "42."  # as verl: the full stop is part of the match
    assert extract_gsm8k_answer("no marker 42") is None
    assert extract_gsm8k_answer("a 1,5 b", method="flexible") == "1,5"  # as verl: commas kept
    assert gsm8k_reward("#### 7", "7", score=2.5) == 2.5
    with pytest.raises(ValueError, match="known: strict, flexible"):
        extract_gsm8k_answer("#### 1", method="loose")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------------
# Boxed / math answers


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("\\boxed{42}", "42"),
        ("so $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
        ("\\boxed{a} then \\boxed{b}", "b"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed{{x}^{2}}", "{x}^{2}"),
        ("\\boxed 5$ done", "5"),
        ("\\fbox{7}", "7"),
        ("\\boxed{", None),
        ("\\boxed{unclosed {", None),
        ("\\boxedx{5}", None),
        ("no box", None),
        ("}\\boxed{3}", "3"),
    ],
)
def test_extract_boxed(text, answer):
    assert extract_boxed_answer(text) == answer


@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        ("\\boxed{42}", "42", 1.0),
        ("\\boxed{ 42 }", "42", 1.0),
        ("\\boxed{1,000}", "1000", 1.0),
        ("\\boxed{1000.0}", "1000", 1.0),
        ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),
        ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),
        ("\\boxed{x = 5}", "5", 1.0),
        ("\\boxed{50\\%}", "50", 1.0),
        ("\\boxed{90^\\circ}", "90", 1.0),
        ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
        ("\\boxed{.5}", "0.5", 1.0),
        ("\\boxed{7}", "\\boxed{7}", 1.0),
        ("\\boxed{41}", "42", 0.0),
        ("42", "42", 0.0),  # no box
        ("\\boxed{}", "0", 0.0),
    ],
)
def test_boxed_reward(response, truth, score):
    assert boxed_reward(response, truth) == score


def test_normalize_math_answer():
    assert normalize_math_answer("-0.0") == "0"
    assert normalize_math_answer("-2.50") == "-2.5"
    assert normalize_math_answer("007") == "7"
    assert normalize_math_answer("\\$5") == "5"
    assert normalize_math_answer("...") == "..."


def test_extract_last_number():
    assert extract_last_number("it costs $1,234.50, or -3") == "-3"
    assert extract_last_number("it costs $1,234.50") == "1234.50"
    assert extract_last_number("pi is 3.14.") == "3.14"
    assert extract_last_number("a .5 b") == ".5"
    assert extract_last_number("x-1") == "-1"
    assert extract_last_number("no digits") is None
    assert extract_last_number("12,34") == "34"  # not a thousands group: two numbers


# ---------------------------------------------------------------------------------------------------------
# format_reward


def test_format_reward():
    pattern = r"<think>.*</think>\s*<answer>.*</answer>"
    assert format_reward("<think>a\nb</think>\n<answer>42</answer>", pattern) == 1.0
    assert format_reward("<think>a</think><answer>42</answer> trailing", pattern) == 0.0  # full match only
    assert format_reward("<answer>42</answer>", pattern) == 0.0
    import re

    assert format_reward("AB", re.compile("ab", re.IGNORECASE)) == 1.0
    assert format_reward(None, pattern) == 0.0  # type: ignore[arg-type]


def test_canonical_integer():
    assert canonical_integer("+007") == "7"
    assert canonical_integer("-0") == "0"
    assert canonical_integer(-12) == "-12"
    assert canonical_integer(" 5 ") == "5"
    for bad in ("", "-", "1.0", "1e3", "٤٢", True, 1.0, None, "+-1"):
        assert canonical_integer(bad) is None


# ---------------------------------------------------------------------------------------------------------
# Registry


def test_registry():
    assert get_reward_fn("arithmetic")("42", "42") == 1.0
    assert get_reward_fn("gsm8k")("#### 42", "42") == 1.0
    assert get_reward_fn("gsm8k_flexible")("the answer is 42", "42") == 1.0
    assert get_reward_fn("boxed")("\\boxed{42}", "42") == 1.0
    assert get_reward_fn("format")("<a>", "<.>") == 1.0
    for name, fn in REWARD_FUNCTIONS.items():
        assert fn("__import__('os')", "0") == 0.0, name
    with pytest.raises(TypeError):
        REWARD_FUNCTIONS["mine"] = lambda r, g: 1.0  # type: ignore[index]


def test_registry_unknown_name_lists_known():
    with pytest.raises(KeyError, match="unknown reward function 'gsm9k'; known: exact, arithmetic, gsm8k"):
        get_reward_fn("gsm9k")
    with pytest.raises(KeyError, match="unknown reward function"):
        get_reward_fn(None)  # type: ignore[arg-type]
