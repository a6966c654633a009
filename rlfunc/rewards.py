r"""Verifiable (rule-based) reward functions: pure ``str -> float``.

Every function here only *parses* text: no ``eval``/``exec``, no imports, no I/O, and never raises on
any response string (a response that does not parse scores 0 or ``format_score``). Regexes are linear
(no nested quantifiers), and numbers are compared as digit strings, so a response of a million digits
costs linear time and no int-conversion limit is hit.

The answer extractors return the answer as a string, or ``None`` when there is none.

Registry: :func:`get_reward_fn` maps a name in :data:`REWARD_FUNCTIONS` to a
``(response, ground_truth) -> float`` function.
"""

from __future__ import annotations

import re
from types import MappingProxyType
from typing import Callable, Literal, Mapping

__all__ = [
    "RewardFn",
    "extract_gsm8k_answer",
    "extract_boxed_answer",
    "extract_last_number",
    "canonical_integer",
    "normalize_math_answer",
    "exact_reward",
    "arithmetic_reward",
    "gsm8k_reward",
    "boxed_reward",
    "format_reward",
    "REWARD_FUNCTIONS",
    "get_reward_fn",
]

RewardFn = Callable[[str, str], float]

# verl's gsm8k scorer looks only at the last 300 characters (the answer is at the end; it also bounds
# the regex work on very long responses).
_GSM8K_CLIP_CHARS = 300
_GSM8K_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_GSM8K_FLEXIBLE = re.compile(r"(-?[0-9.,]+)")

# The whole (stripped) answer of the arithmetic task: a signed integer, optionally with a final full stop.
_ARITH_ANSWER = re.compile(r"([+-]?[0-9]+)\.?")
_NUMBER = re.compile(r"-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|-?\.[0-9]+")


def _text(x: object) -> str | None:
    return x if isinstance(x, str) else None


# ---------------------------------------------------------------------------------------------------------
# Extractors


def extract_gsm8k_answer(text: str, *, method: Literal["strict", "flexible"] = "strict") -> str | None:
    """The final answer of a GSM8K-style solution, as verl's ``gsm8k.extract_solution``.

    - ``strict``: the last ``#### <number>`` (exactly one space after ``####``); ``<number>`` is a run of
      digits, ``.`` and ``,`` with an optional leading ``-``; commas are removed (``"#### 1,234"`` ->
      ``"1234"``, ``"#### -3.5"`` -> ``"-3.5"``). A trailing full stop is kept, as in verl
      (``"#### 42."`` -> ``"42."``, which does not equal ``"42"``).
    - ``flexible``: the last such run anywhere that is not ``""`` or ``"."`` (commas kept, as verl).

    Only the last 300 characters are searched (verl does the same). ``None`` if nothing matches.
    """
    text = _text(text)
    if text is None:
        return None
    if method not in ("strict", "flexible"):
        raise ValueError(f"unknown gsm8k extraction method {method!r}; known: strict, flexible")
    text = text[-_GSM8K_CLIP_CHARS:]
    if method == "strict":
        found = _GSM8K_STRICT.findall(text)
        return found[-1].replace(",", "").replace("$", "") if found else None
    found = _GSM8K_FLEXIBLE.findall(text)
    if not found:
        return None
    # verl returns the last candidate that is not "" or "."; when all are "." it returns the first one
    # it looked at, i.e. the last candidate.
    for candidate in reversed(found):
        if candidate not in ("", "."):
            return candidate
    return found[0]


def extract_boxed_answer(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` (or, if there is none, ``\fbox{...}``), braces balanced.

    ``"so \boxed{\frac{1}{2}}."`` -> ``"\frac{1}{2}"``. As in verl's ``math_reward``, the brace-less form
    ``\boxed 5`` anywhere takes precedence and gives the text after its last occurrence up to the next
    ``$``. ``None`` when there is no box, its braces never close, or something other than whitespace
    sits between the name and its ``{`` (verl raises and scores 0 there; it also scores every ``\fbox``
    0, which is read here).
    """
    text = _text(text)
    if text is None:
        return None
    if "\\boxed " in text:
        return text.split("\\boxed ")[-1].split("$")[0]
    name = "\\boxed"
    start = text.rfind(name)
    if start < 0:
        name = "\\fbox"
        start = text.rfind(name)
        if start < 0:
            return None
    open_at = text.find("{", start + len(name))
    if open_at < 0 or text[start + len(name) : open_at].strip():
        return None
    depth = 0
    for i in range(open_at, len(text)):
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i]
    return None


def extract_last_number(text: str) -> str | None:
    """The last number in ``text``, commas removed: ``"it costs $1,234.50, or -3"`` -> ``"-3"``.

    A number is an optional ``-``, digits (optionally grouped by commas in threes) and an optional
    decimal part, or a bare decimal like ``.5``. ``None`` if there is no number.
    """
    text = _text(text)
    if text is None:
        return None
    last = None
    for last in _NUMBER.finditer(text):
        pass
    return None if last is None else last.group(0).replace(",", "")


def canonical_integer(x: object) -> str | None:
    """A canonical spelling of an integer (``"+007"`` -> ``"7"``, ``"-0"`` -> ``"0"``), or ``None``.

    Accepts an ``int`` or a string of an optional sign and ASCII digits (surrounding whitespace
    ignored). Works on the digits, so arbitrarily long integers are fine.
    """
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return str(x)
    if not isinstance(x, str):
        return None
    s = x.strip()
    sign = ""
    if s[:1] in ("+", "-"):
        sign, s = ("-" if s[0] == "-" else ""), s[1:]
    if not s or not (s.isascii() and s.isdigit()):
        return None
    s = s.lstrip("0") or "0"
    return s if s == "0" else sign + s


def normalize_math_answer(answer: str) -> str:
    r"""Light normalisation of a math answer before string comparison.

    Removes whitespace, ``$``, ``\!``, ``\left``/``\right``, degree marks, ``\%``/``%``, a trailing
    ``.``, turns ``\dfrac``/``\tfrac`` into ``\frac``, ``a/b`` of two integers into ``\frac{a}{b}``, a
    short ``x=`` prefix away, and plain numbers into a canonical form (``"1,000"`` -> ``"1000"``,
    ``"2.50"`` -> ``"2.5"``, ``".5"`` -> ``"0.5"``). A subset of the Hendrycks MATH ``strip_string``
    that verl's ``math_reward`` uses (see :func:`boxed_reward` for the differences).
    """
    s = answer.replace("\n", "").replace("\\!", "")
    s = s.replace("\\\\", "\\").replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    s = s.replace("\\%", "").replace("%", "")
    s = "".join(s.split())
    parts = s.split("=")
    if len(parts) == 2 and len(parts[0]) <= 2:
        s = parts[1]
    s = s.rstrip(".") if not re.fullmatch(r"\.+", s) else s
    m = re.fullmatch(r"(-?)([0-9]+)/([0-9]+)", s)
    if m:
        s = f"{m.group(1)}\\frac{{{m.group(2)}}}{{{m.group(3)}}}"
    number = re.fullmatch(r"(-?)([0-9]{1,3}(?:,[0-9]{3})+|[0-9]*)(?:\.([0-9]*))?", s)
    if number and (number.group(2) or number.group(3)):
        sign, whole, frac = number.group(1), number.group(2).replace(",", ""), (number.group(3) or "").rstrip("0")
        whole = whole.lstrip("0") or "0"
        s = f"{whole}.{frac}" if frac else whole
        if s != "0":
            s = sign + s
    return s


# ---------------------------------------------------------------------------------------------------------
# Rewards


def exact_reward(response: str, ground_truth: object) -> float:
    """1.0 if the response equals ``str(ground_truth)``, both stripped of surrounding whitespace, else 0.0."""
    if not isinstance(response, str) or ground_truth is None:
        return 0.0
    return 1.0 if response.strip() == str(ground_truth).strip() else 0.0


def arithmetic_reward(response: str, expected: int | str) -> float:
    r"""1.0 if the response's integer answer equals ``expected``, else 0.0 (the synthetic ``a+b=`` task).

    Response format: the decoded completion (special tokens such as EOS already stripped by the
    tokenizer's ``decode(..., skip_special_tokens=True)``) must be the answer, accepted as

    - the bare integer, optionally surrounded by whitespace and a final ``.``: ``"42"``, ``" -7\n"``;
    - or ending in ``#### <int>``: ``"3+4 is 7 #### 7"``;
    - or with its last ``\boxed{<int>}``: ``"\boxed{42}"``.

    Anything else (``"42 apples"``, ``"4 2"``, ``"42.0"``, ``"1,000"``) scores 0.0: the policy is rewarded
    for the exact format, which keeps the task unambiguous. Leading zeros and ``+`` are tolerated
    (``"007"`` equals 7). Whether the completion actually ended with EOS (rather than being truncated) is
    the caller's to check, as the text does not say.
    """
    want = canonical_integer(expected)
    if want is None:
        raise ValueError(f"expected must be an int or an integer string, got {expected!r}")
    got = _arithmetic_answer(response)
    return 1.0 if got is not None and got == want else 0.0


def _arithmetic_answer(response: object) -> str | None:
    if not isinstance(response, str):
        return None
    # Plain str operations and anchored regexes only: linear time on any input.
    text = response.strip()
    hashes = text.rfind("####")
    if hashes >= 0:
        text = text[hashes + 4 :].strip()
    m = _ARITH_ANSWER.fullmatch(text)
    if m:
        return canonical_integer(m.group(1))
    boxed = extract_boxed_answer(response)
    return canonical_integer(boxed) if boxed is not None else None


def gsm8k_reward(
    response: str,
    ground_truth: str,
    *,
    method: Literal["strict", "flexible"] = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """GSM8K reward, as verl's ``verl.utils.reward_score.gsm8k.compute_score``.

    ``score`` if the extracted answer (:func:`extract_gsm8k_answer` with ``method``) equals the ground
    truth string exactly, ``format_score`` if an answer was found but differs, 0.0 if none was found.
    The ground truth is compared as given (GSM8K's ``#### 1234`` answers have no commas).
    """
    answer = extract_gsm8k_answer(response, method=method)
    if answer is None:
        return 0.0
    return float(score) if answer == ground_truth else float(format_score)


def boxed_reward(response: str, ground_truth: str) -> float:
    r"""1.0 if the last ``\boxed{...}`` equals the ground truth after :func:`normalize_math_answer`.

    Like verl's ``math_reward.compute_score`` (Hendrycks MATH answers), with a lighter normalisation:
    verl additionally rewrites ``\sqrt2`` -> ``\sqrt{2}`` and ``\frac12`` -> ``\frac{1}{2}``, drops a
    ``\text{ units}`` suffix and maps ``0.5`` to ``\frac{1}{2}``; here numbers are canonicalised instead
    (``"1,000"``, ``"1000.0"`` and ``"1000"`` all match). The ground truth may itself be a boxed string.
    """
    if not isinstance(response, str) or not isinstance(ground_truth, str):
        return 0.0
    answer = extract_boxed_answer(response)
    if answer is None:
        return 0.0
    truth = extract_boxed_answer(ground_truth) if "\\boxed" in ground_truth else ground_truth
    if truth is None:
        return 0.0
    return 1.0 if normalize_math_answer(answer) == normalize_math_answer(truth) else 0.0


def format_reward(response: str, pattern: str | re.Pattern[str]) -> float:
    r"""1.0 if ``pattern`` matches the *whole* response (``re.fullmatch``, with ``re.DOTALL`` for a str
    pattern so ``.`` spans lines), else 0.0. E.g. ``r"<think>.*</think>\s*<answer>.*</answer>"``.
    """
    if not isinstance(response, str):
        return 0.0
    regex = pattern if isinstance(pattern, re.Pattern) else re.compile(pattern, re.DOTALL)
    return 1.0 if regex.fullmatch(response) else 0.0


# ---------------------------------------------------------------------------------------------------------
# Registry


def _arithmetic(response: str, ground_truth: str) -> float:
    return arithmetic_reward(response, ground_truth)


def _gsm8k_flexible(response: str, ground_truth: str) -> float:
    return gsm8k_reward(response, ground_truth, method="flexible")


REWARD_FUNCTIONS: Mapping[str, RewardFn] = MappingProxyType(
    {
        "exact": exact_reward,
        "arithmetic": _arithmetic,
        "gsm8k": gsm8k_reward,
        "gsm8k_flexible": _gsm8k_flexible,
        "boxed": boxed_reward,
        "format": format_reward,
    }
)
"""The built-in reward functions by name: a read-only mapping (``types.MappingProxyType``).

Nothing registers into it: rlfunc holds no mutable global state. A user's own reward function is named
in a recipe config by reference (``package.module:function`` or ``path/to/file.py:function``) and
resolved outside rlfunc (``backends.config``).
"""


def get_reward_fn(name: str) -> RewardFn:
    """The reward function called ``name``: ``fn(response, ground_truth) -> float``.

    For ``"format"`` the ground truth is the regex the response must match. Unknown names raise
    ``KeyError`` listing the known ones.
    """
    try:
        return REWARD_FUNCTIONS[name]
    except (KeyError, TypeError):
        raise KeyError(f"unknown reward function {name!r}; known: {', '.join(REWARD_FUNCTIONS)}") from None
