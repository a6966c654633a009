"""Environments and tools for multi-turn rollouts: what answers a model's turn.

An :class:`Environment` is made per trajectory from its data row (``factory(example)``) and answers each model
turn, given as text, with an :class:`Observation`: chat messages that go back to the model (a tool's result,
an environment's reply), a reward for the turn and whether the trajectory is done. The agent loop
(:mod:`backends.rollout.agent_loop`) turns those messages into tokens with the chat template and feeds them to
the model: the model's own tokens are kept exactly as sampled (nothing is decoded and re-encoded).

:class:`ToolEnvironment` is the built-in one: the model calls tools in the Hermes / Qwen format,
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the calls run (each under a time limit) and their
results come back as ``tool`` messages; a turn without a tool call is the final answer and ends the trajectory.
A tool is a Python function with type hints and a Google-style docstring; its JSON schema
(``transformers.utils.get_json_schema``) is what the chat template shows the model (``tools=`` of
``apply_chat_template``, see :func:`tool_schemas`) and what each call's arguments are checked against. A
malformed call (not JSON, no such tool, arguments that do not fit the schema) or a tool that raises or runs out
of time is answered with an error message the model can read, never a crash. rlfunc executes no model-written
code: a tool that does (a code interpreter) needs a sandbox of its own, which is outside rlfunc.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
from typing import Any, Callable, Mapping, Protocol, Sequence

import attrs

from backends.config import ConfigError, resolve_function
from backends.data import Example, prompt_token_ids

__all__ = [
    "Environment",
    "MultiTurnConfig",
    "Observation",
    "ToolEnvironment",
    "argument_errors",
    "environment_factory",
    "load_tools",
    "observation_token_ids",
    "parse_tool_calls",
    "tool_schema",
    "tool_schemas",
]

#: the markers of a tool call (Hermes / Qwen2.5 chat templates; one token each in the tiny char tokenizer)
TOOL_CALL_MARKER = re.compile(r"</?tool_call>")


@attrs.frozen
class MultiTurnConfig:
    """Multi-turn rollouts (``rollout.multi_turn.*``): turns, budgets, the environment and its tools."""

    #: model turns per trajectory; 1: single-turn sampling, no environment
    max_turns: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    #: budget of one trajectory: prompt, every turn and every observation
    max_total_tokens: int = attrs.field(default=1024, validator=attrs.validators.ge(2))
    #: tools: the built-in tool-calling environment over multi_turn.tools; else a reference package.module:factory /
    #: path/to/file.py:factory, called with a data row (backends.data.Example) and returning an Environment
    environment: str = "tools"
    tools: tuple[str, ...] = ()  #: tool functions by reference (package.module:function / path/to/file.py:function)
    #: limit of one tool call or environment step
    call_timeout_s: float = attrs.field(default=10.0, validator=attrs.validators.gt(0))
    #: environment steps of different trajectories run at once
    workers: int = attrs.field(default=8, validator=attrs.validators.ge(1))
    #: an environment that raises or hangs: stop with an error naming the row, or end that trajectory and count it
    on_error: str = attrs.field(default="error", validator=attrs.validators.in_(("error", "end")))


@attrs.frozen
class Observation:
    """What an environment answers a model turn with."""

    #: chat messages back to the model
    messages: tuple[Mapping[str, str], ...] = attrs.field(default=(), converter=tuple)
    reward: float = 0.0  #: this turn's reward (added to the trajectory's outcome reward)
    done: bool = False  #: no further turn
    metrics: Mapping[str, float] = attrs.field(factory=dict)  #: numbers to log (summed over the batch's turns)


class Environment(Protocol):
    def step(self, response: str) -> Observation:
        """Answer the model's latest turn (its text, special tokens stripped)."""


# ------------------------------------------------------------------------------------------ tools


def parse_tool_calls(text: str) -> list[tuple[str, dict[str, Any]] | str]:
    """The tool calls in a model turn, in order: ``(name, arguments)``, or an error message for a malformed one. Every
    ``<tool_call>`` / ``</tool_call>`` marker belongs to some call: a call left open, or a closing marker without its
    opening, is a malformed call too (an empty list: the turn holds no marker at all)."""
    calls: list[tuple[str, dict[str, Any]] | str] = []
    opened: int | None = None  # where the body of the call now open starts
    for marker in TOOL_CALL_MARKER.finditer(text):
        if marker.group() == "<tool_call>":
            if opened is not None:
                calls.append(
                    f"the tool call is not closed with </tool_call> before the next <tool_call>: "
                    f"{text[opened : marker.start()].strip()[:200]}"
                )
            opened = marker.end()
        elif opened is None:
            calls.append(f"</tool_call> without an opening <tool_call>: ...{text[: marker.start()].strip()[-200:]}")
        else:
            calls.append(_parse_call(text[opened : marker.start()]))
            opened = None
    if opened is not None:
        calls.append(f"the tool call is not closed with </tool_call>: {text[opened:].strip()[:200]}")
    return calls


def _parse_call(body: str) -> tuple[str, dict[str, Any]] | str:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return f"the tool call is not valid JSON ({e.msg} at character {e.pos}): {body.strip()[:200]}"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return f'a tool call is {{"name": ..., "arguments": {{...}}}}, got {body.strip()[:200]}'
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some templates write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(arguments, dict):
        return f"the arguments of {call['name']!r} must be a JSON object, got {str(call.get('arguments'))[:200]}"
    return call["name"], arguments


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of a tool function (from its type hints and Google-style docstring)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # transformers raises its own parsing errors
        raise ConfigError(
            f"tool {getattr(fn, '__name__', fn)!r} has no usable JSON schema: {e} (a tool needs type hints "
            "and a docstring with an Args: line per argument)"
        ) from None


_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def argument_errors(schema: Mapping[str, Any], arguments: Mapping[str, Any]) -> list[str]:
    """What is wrong with a call's ``arguments`` under a tool's JSON schema: missing and unknown arguments,
    values of the wrong JSON type (empty: nothing)."""
    params = schema["function"].get("parameters", {})
    properties = params.get("properties", {})
    errors = [f"missing argument {name!r}" for name in params.get("required", []) if name not in arguments]
    errors += [f"unknown argument {name!r}" for name in arguments if name not in properties]
    for name, value in arguments.items():
        kinds = properties.get(name, {}).get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if kinds and not any(_JSON_TYPES.get(k, lambda v: True)(value) for k in kinds):
            errors.append(f"argument {name!r} must be {' or '.join(kinds)}, got {json.dumps(value)[:60]}")
    return errors


class ToolEnvironment:
    """Runs the tool calls of each model turn; a turn without one ends the trajectory (see the module doc).

    ``tools``: name -> function; each call is checked against the tool's schema and runs in a worker thread
    under ``timeout_s`` (a tool that does not return is left running and reported as timed out). Metrics:
    ``tool_calls``, ``tool_call_errors``.
    """

    def __init__(self, tools: Mapping[str, Callable[..., Any]], *, timeout_s: float = 10.0) -> None:
        self.tools, self.timeout_s = dict(tools), timeout_s
        self.schemas = {name: tool_schema(fn) for name, fn in self.tools.items()}

    def step(self, response: str) -> Observation:
        calls = parse_tool_calls(response)
        if not calls:  # no tool-call marker: the final answer
            return Observation(done=True, metrics={"tool_calls": 0.0, "tool_call_errors": 0.0})
        results = [self._call(call) for call in calls]
        errors = sum(1.0 for ok, _ in results if not ok)
        return Observation(
            messages=tuple({"role": "tool", "content": text} for _, text in results),
            metrics={"tool_calls": float(len(calls)), "tool_call_errors": errors},
        )

    def _call(self, call: tuple[str, dict[str, Any]] | str) -> tuple[bool, str]:
        if isinstance(call, str):
            return False, f"error: {call}"
        name, arguments = call
        tool = self.tools.get(name)
        if tool is None:
            return False, f"error: no tool named {name!r} (tools: {', '.join(sorted(self.tools))})"
        problems = argument_errors(self.schemas[name], arguments)
        if problems:
            return False, f"error: wrong arguments for {name}: {'; '.join(problems)}"
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        try:
            result = pool.submit(tool, **arguments).result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            return False, f"error: {name} did not return within {self.timeout_s:g} s"
        except Exception as e:  # the tool's own failure goes back to the model as text
            return False, f"error: {name} raised {type(e).__name__}: {e}"
        finally:
            pool.shutdown(wait=False)
        return True, result if isinstance(result, str) else json.dumps(result)


def load_tools(specs: Sequence[str]) -> dict[str, Callable[..., Any]]:
    """Tool functions by reference (``package.module:function`` / ``path/to/file.py:function``), by their names;
    each must have a JSON schema (:func:`tool_schema`)."""
    tools: dict[str, Callable[..., Any]] = {}
    for spec in specs:
        fn = resolve_function(spec, {}, "rollout.multi_turn.tools")
        name = tool_schema(fn)["function"]["name"]
        if name in tools:
            raise ConfigError(f"rollout.multi_turn.tools has two tools named {name!r}")
        tools[name] = fn
    return tools


def tool_schemas(cfg: MultiTurnConfig) -> list[dict[str, Any]]:
    """The schemas the chat template shows the model (``apply_chat_template(tools=...)``): those of the built-in
    tool environment's tools, none otherwise."""
    if cfg.max_turns == 1 or cfg.environment != "tools":
        return []
    return [tool_schema(fn) for fn in load_tools(cfg.tools).values()]


def environment_factory(cfg: MultiTurnConfig) -> Callable[[Example], Environment]:
    """``factory(example) -> Environment`` from the config; resolved at start-up, so a bad reference fails there."""
    if cfg.environment == "tools":
        if not cfg.tools:
            raise ConfigError(
                "rollout.multi_turn.environment=tools needs rollout.multi_turn.tools (your tool functions "
                "as package.module:function or path/to/file.py:function)"
            )
        tools = load_tools(cfg.tools)
        return lambda example: ToolEnvironment(tools, timeout_s=cfg.call_timeout_s)
    return resolve_function(cfg.environment, {}, "rollout.multi_turn.environment")


# ------------------------------------------------------------------------------------------ tokens


def observation_token_ids(
    messages: Sequence[Mapping[str, str]], tokenizer: Any, *, chat_template: str = "auto"
) -> list[int]:
    """The tokens that follow a model turn when ``messages`` answer it, up to the next generation prompt.

    Rendered by the chat template as the difference between a conversation with and without the messages,
    so the template's own framing (role markers, the next assistant prompt) is exactly what a chat with these
    messages would hold; the model's earlier tokens are never re-rendered.
    """
    anchor = [{"role": "user", "content": "x"}]
    base = _template_ids(anchor, tokenizer, chat_template, generation_prompt=False)
    full = _template_ids(anchor + [dict(m) for m in messages], tokenizer, chat_template, generation_prompt=True)
    if full[: len(base)] != base:
        raise ValueError(
            "the chat template renders a conversation's start differently once messages follow it; "
            "observation tokens cannot be cut from it"
        )
    return full[len(base) :]


def _template_ids(messages: list[dict], tokenizer: Any, chat_template: str, *, generation_prompt: bool) -> list[int]:
    if generation_prompt:
        return prompt_token_ids(messages, tokenizer, chat_template=chat_template)
    template = None if chat_template == "auto" else open(chat_template).read()
    encoded = tokenizer.apply_chat_template(messages, tokenize=True, chat_template=template)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
