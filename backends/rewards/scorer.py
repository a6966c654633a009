"""Scoring sampled responses with the reward functions a config names: routing, weights, workers, errors.

``reward.fn`` lists one or more functions (built-in names or ``package.module:function`` /
``path/to/file.py:function`` references), summed with ``reward.weights``; ``reward.by_source`` entries
``source=function`` give the rows of one ``data_source`` their own function instead. Each is called once
per sample as ``fn(response, ground_truth, **columns)``, where ``columns`` are the row's other columns
(those the function names as parameters, or all of them when it takes ``**kwargs``), and returns a number
or a dict with a ``score`` and extra numbers, which are logged.

Every function is resolved when the scorer is built (a misspelt name fails at start-up). User functions run in worker
processes (``reward.workers``, :mod:`backends.rewards.workers`), each call under ``reward.timeout_s``: a call that
raises, runs out of time or ends its worker process (named at once, with how it ended) is an error naming the function
and the row, or, with ``reward.on_error=zero``, a zero that ``reward/errors`` counts (a worker lost is said on the
console too). A result that is not a finite number (in float32, where scores are kept) is always an error.
"""

from __future__ import annotations

import inspect
import math
import numbers
import sys
from typing import Any, Callable, Literal, Mapping, Sequence

import attrs
import torch

from backends.config import ConfigError, resolve_function
from backends.data import Example
from backends.rewards.builtins import BUILTIN_REWARDS, builtin_reward
from backends.rewards.workers import CallTimeout, WorkerPool, time_limit

__all__ = ["RewardConfig", "RewardError", "RewardResult", "RewardScorer", "resolve_reward"]


#: the largest finite float32: scores and advantages are float32 tensors, so a larger reward would become inf
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class RewardError(RuntimeError):
    """A reward call that failed, timed out or returned something that is not a finite score."""


@attrs.frozen
class RewardConfig:
    """Which reward functions score a response, and how they are run."""

    #: reward functions, summed: built-in names (exact, arithmetic, gsm8k, gsm8k_flexible, boxed, math,
    #: format) or references package.module:function / path/to/file.py:function
    fn: tuple[str, ...] = ()
    weights: tuple[float, ...] = ()  #: one weight per reward.fn entry; empty: 1 each
    #: source=function entries: rows of that data_source use that function instead of reward.fn
    by_source: tuple[str, ...] = ()
    format_pattern: str = r".*"  #: the regex the built-in `format` reward needs the whole response to match
    max_score: float = 1.0  #: the best score; a sample "succeeds" when its score reaches it (success_rate, eval)
    #: worker processes for the calls; 0: in this process; -1: 0 if every function is built in, else 2
    workers: int = -1
    #: limit of one call (in a worker, or in-process on the main thread)
    timeout_s: float = attrs.field(default=60.0, validator=attrs.validators.gt(0))
    #: a call that raises or times out: stop with an error, or score 0 and count it
    on_error: Literal["error", "zero"] = "error"
    #: DAPO's overlong shaping: a linear penalty over the last overlong_buffer_len tokens of the response
    #: budget, reaching -overlong_penalty_factor at the budget; 0 turns it off
    overlong_buffer_len: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    overlong_penalty_factor: float = 1.0  #: DAPO's overlong penalty at the full response budget


@attrs.frozen
class _Function:
    label: str  #: the name metrics use
    spec: str  #: what the config said
    fn: Callable[..., Any]
    params: frozenset[str] | None  #: the column names it accepts (None: all, it takes **kwargs)


def resolve_reward(spec: str, *, key: str = "reward.fn", format_pattern: str = r".*") -> Callable[..., Any]:
    """The callable that the config value ``spec`` names (a built-in, or a reference resolved by import)."""
    spec = spec.strip()
    if spec in BUILTIN_REWARDS:
        return builtin_reward(spec, format_pattern=format_pattern)
    return resolve_function(spec, BUILTIN_REWARDS, key)


def _describe(spec: str, key: str, format_pattern: str) -> _Function:
    fn = resolve_reward(spec, key=key, format_pattern=format_pattern)
    kind = _not_a_plain_function(fn)
    if kind:  # it would hand back a generator / coroutine per call, which no worker can send back
        raise ConfigError(
            f"{key}={spec!r} is {kind}; a reward function returns its score: a number, or a dict with a "
            "'score' number (return, not yield; no async)"
        )
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: give it every column
        return _Function(label=_label(spec), spec=spec, fn=fn, params=None)
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in parameters):
        raise ConfigError(
            f"{key}={spec!r}: a reward function is called as fn(response, ground_truth, **columns); "
            f"this one takes {len(positional)} positional argument(s)"
        )
    if any(p.kind == p.VAR_KEYWORD for p in parameters):
        return _Function(label=_label(spec), spec=spec, fn=fn, params=None)
    names = frozenset(p.name for p in parameters if p.kind != p.VAR_POSITIONAL) - {
        positional[0].name,
        positional[1].name,
    }
    return _Function(label=_label(spec), spec=spec, fn=fn, params=names)


def _not_a_plain_function(fn: Callable[..., Any]) -> str:
    """What ``fn`` is when a call of it does not return its result ("a generator function", ...), else ""."""
    target = getattr(fn, "__call__", fn) if not inspect.isfunction(fn) and not inspect.ismethod(fn) else fn
    for test, kind in (
        (inspect.isasyncgenfunction, "an async generator function (it yields)"),
        (inspect.isgeneratorfunction, "a generator function (it yields)"),
        (inspect.iscoroutinefunction, "an async function"),
    ):
        if test(fn) or test(target):
            return kind
    return ""


def _label(spec: str) -> str:
    return spec.rpartition(":")[2] if ":" in spec else spec


@attrs.frozen
class RewardResult:
    """Scores of a batch of samples, in order, with what went into them."""

    scores: torch.Tensor  #: (b,) float32, the weighted sum (or the routed function's score)
    parts: Mapping[str, list[float | None]]  #: each function's raw score per sample (None: not used for it)
    extras: Mapping[str, list[float | None]]  #: extra numbers from dict results, "<function>/<key>"
    errors: int  #: calls scored 0 under reward.on_error=zero

    def metrics(self) -> dict[str, float]:
        """Means over the samples each value exists for: ``reward/<function>``, extras, ``reward/errors``."""
        out = {}
        for name, values in {**self.parts, **self.extras}.items():
            present = [v for v in values if v is not None]
            if present:
                out[f"reward/{name}"] = sum(present) / len(present)
        out["reward/errors"] = float(self.errors)
        return out


class RewardScorer:
    """The configured reward functions, resolved once; :meth:`score` scores a batch of responses."""

    def __init__(self, cfg: RewardConfig) -> None:
        if not cfg.fn and not cfg.by_source:
            raise ConfigError(
                "reward.fn is empty: name a built-in reward ("
                + ", ".join(BUILTIN_REWARDS)
                + ") or your own function, package.module:function or path/to/file.py:function"
            )
        if cfg.weights and len(cfg.weights) != len(cfg.fn):
            raise ConfigError(f"reward.weights has {len(cfg.weights)} entries for {len(cfg.fn)} reward.fn entries")
        self.cfg = cfg
        describe = lambda spec, key: _describe(spec, key, cfg.format_pattern)
        self.default = [(describe(s, "reward.fn"), w) for s, w in zip(cfg.fn, cfg.weights or [1.0] * len(cfg.fn))]
        self.routes: dict[str, _Function] = {}
        for entry in cfg.by_source:
            source, sep, spec = entry.partition("=")
            if not sep or not source.strip() or not spec.strip():
                raise ConfigError(f"reward.by_source entry {entry!r} must look like source=function")
            self.routes[source.strip()] = describe(spec, f"reward.by_source[{source.strip()}]")
        labels = [f.label for f in self._functions()]
        if len(set(labels)) < len(labels):  # two functions of the same name: metrics use the full reference
            self.default = [(attrs.evolve(f, label=f.spec), w) for f, w in self.default]
            self.routes = {s: attrs.evolve(f, label=f.spec) for s, f in self.routes.items()}
        builtin_only = all(f.spec in BUILTIN_REWARDS for f in self._functions())
        self.workers = cfg.workers if cfg.workers >= 0 else (0 if builtin_only else 2)
        self._pool: Any = None

    def _functions(self) -> list[_Function]:
        return [f for f, _ in self.default] + list(self.routes.values())

    def check_sources(self, sources: Sequence[str]) -> None:
        """Fail before any work when a data source has no reward function (no reward.fn and no route)."""
        if self.default:
            return
        missing = sorted(set(sources) - set(self.routes))
        if missing:
            raise ConfigError(
                f"no reward function for data_source {', '.join(map(repr, missing))}: reward.fn is empty "
                f"and reward.by_source routes only {', '.join(self.routes)}"
            )

    def plan(self, source: str) -> list[tuple[_Function, float]]:
        """The functions (and weights) that score a row of ``source``."""
        return [(self.routes[source], 1.0)] if source in self.routes else self.default

    def score(self, responses: Sequence[str], examples: Sequence[Example]) -> RewardResult:
        """Scores of ``responses[i]`` as an answer to ``examples[i]``."""
        if len(responses) != len(examples):
            raise ValueError(
                f"RewardScorer.score: {len(responses)} responses for {len(examples)} examples; "
                "give one response per example, in the same order"
            )
        calls, weights = [], []  # (sample, function, args), and the function's weight for that sample
        for i, (response, example) in enumerate(zip(responses, examples)):
            for function, weight in self.plan(example.source):
                columns = (
                    dict(example.columns)
                    if function.params is None
                    else {k: v for k, v in example.columns.items() if k in function.params}
                )
                calls.append((i, function, (response, example.ground_truth, columns)))
                weights.append(weight)
        raw = self._run(calls, examples)
        labels = dict.fromkeys(f.label for f in self._functions())
        parts: dict[str, list[float | None]] = {label: [None] * len(responses) for label in labels}
        extras: dict[str, list[float | None]] = {}
        totals = [0.0] * len(responses)
        errors = 0
        for (i, function, _), weight, outcome in zip(calls, weights, raw):
            if isinstance(outcome, _Failure):
                errors += 1
                value, more = 0.0, {}
            else:
                value, more = _checked_score(outcome, function, examples[i].where)
            totals[i] += weight * value
            parts[function.label][i] = value
            for key, extra in more.items():
                extras.setdefault(f"{function.label}/{key}", [None] * len(responses))[i] = extra
        for i, total in enumerate(totals):
            if (
                not abs(total) <= FLOAT32_MAX
            ):  # each score fits, but their weighted sum does not (or a weight is not finite)
                raise RewardError(
                    f"the weighted sum of the reward functions on {examples[i].where} is {total:g} "
                    f"(reward.weights={list(self.cfg.weights)}): beyond float32's range, where scores "
                    f"are kept (|score| <= {FLOAT32_MAX:.4g})"
                )
        return RewardResult(scores=torch.tensor(totals, dtype=torch.float32), parts=parts, extras=extras, errors=errors)

    # ------------------------------------------------------------------------------------ running calls

    def _run(self, calls: list, examples: Sequence[Example]) -> list[Any]:
        if self.workers == 0:
            return [self._in_process(function, args, examples[i]) for i, function, args in calls]
        return self._in_pool(calls, examples)

    def _failed(self, function: _Function, example: Example, what: str) -> "_Failure":
        if self.cfg.on_error == "zero":
            return _Failure(what)
        raise RewardError(
            f"reward function {function.spec!r} {what} on {example.where} "
            "(reward.on_error=zero scores such calls 0 and counts them)"
        )

    def _in_process(self, function: _Function, args: tuple, example: Example) -> Any:
        response, ground_truth, columns = args
        try:
            with time_limit(self.cfg.timeout_s):
                return function.fn(response, ground_truth, **columns)
        except CallTimeout:
            return self._failed(function, example, f"ran longer than reward.timeout_s={self.cfg.timeout_s:g}")
        except SystemExit as e:  # it would end the trainer, unexplained
            return self._failed(function, example, f"called sys.exit({e.code!r}) (a reward function returns a score)")
        except Exception as e:
            return self._failed(function, example, f"raised {type(e).__name__}: {e}")

    def _in_pool(self, calls: list, examples: Sequence[Example]) -> list[Any]:
        if self._pool is None:
            self._pool = WorkerPool(self.workers, sorted({f.spec for f in self._functions()}), self.cfg.format_pattern)
        # on_error=error stops at the first worker lost: the run ends with its error anyway
        outcomes = self._pool.run(
            [(f.spec, args) for _, f, args in calls],
            self.cfg.timeout_s,
            max_deaths=1 if self.cfg.on_error == "error" else None,
        )
        out, lost, skipped = [], [], []
        for (i, function, _), (status, value) in zip(calls, outcomes):
            if status == "ok":
                out.append(value)
                continue
            if (
                status == "not-a-score"
            ):  # what could not travel back (a generator, a lock, ...): named like any non-score
                out.append(_NotAScore(*value))
                continue
            what = {"died": f"ended its worker process: {value}", "skipped": f"was {value}"}.get(status, value)
            if status in ("died", "hung"):
                lost.append(f"reward function {function.spec!r} {what} on {examples[i].where}")
            elif status == "skipped":
                skipped.append(value)
            out.append(self._failed(function, examples[i], what))
        if lost:  # on_error=zero: the step goes on, and the console says why some scores are 0
            rest = f", and {len(skipped)} more were {skipped[0]}" if skipped else ""
            sys.stderr.write(
                f"[rlfunc] WARNING reward.on_error=zero: {len(lost)} call(s) scored 0 because their worker "
                f"process died or hung{rest}; first: {lost[0]}\n"
            )
        return out

    def close(self) -> None:
        """Stop the worker processes (a new pool starts on the next call that needs one)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None


@attrs.frozen
class _Failure:
    what: str


def _checked_score(value: Any, function: _Function, where: str) -> tuple[float, dict[str, float]]:
    """``(score, extra numbers)`` from a function's result; anything but a finite number is an error."""
    extras: dict[str, float] = {}
    if isinstance(value, Mapping):
        if "score" not in value:
            raise RewardError(
                f"reward function {function.spec!r} returned a dict without 'score' on {where} (keys: {sorted(value)})"
            )
        extras = {k: float(v) for k, v in value.items() if k != "score" and isinstance(v, numbers.Real)}
        value = value["score"]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, _NotAScore):
        raise RewardError(
            f"reward function {function.spec!r} returned {value.type_name} {value.text} on {where}; "
            "a reward is a number or a dict with a 'score' number"
        )
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardError(
            f"reward function {function.spec!r} returned {type(value).__name__} {value!r:.60} on {where}; "
            "a reward is a number or a dict with a 'score' number"
        )
    if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise RewardError(
            f"reward function {function.spec!r} returned {value} on {where}; a reward must be finite "
            f"in float32, where scores are kept (|score| <= {FLOAT32_MAX:.4g})"
        )
    return float(value), extras


@attrs.frozen
class _NotAScore:
    """A worker's stand-in for a result that could not be sent back: its type and text."""

    type_name: str
    text: str
