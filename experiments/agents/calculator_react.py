"""A ReAct agent for the calculator task (:mod:`experiments.tasks.calculator`), written with the ``openai`` client.

It knows nothing of rlfunc: it asks the model, runs the calculator tool the model calls (its own, below), hands the
result back as a ``tool`` message, and stops at the first reply without a call, which the reward function
(``reward.fn=arithmetic``) then scores. Trained through the endpoint with ::

    python -m experiments.tasks.calculator --out runs/data/calculator
    torchrun --standalone --nproc_per_node 2 experiments/grpo.py preset=demo/calculator \\
        rollout.agent=experiments/agents/calculator_react.py:run rollout.multi_turn.max_turns=1

A call is the task's format, ``<tool_call>{"name": "multiply", "arguments": {"a": 347, "b": 291}}</tool_call>``;
the tool also takes an arithmetic expression (``{"name": "calculate", "arguments": {"expression": "3*(4+5)"}}``),
which it parses itself: nothing the model writes is evaluated as code.
"""

from __future__ import annotations

import json
import re
from typing import Any

from openai import DefaultHttpxClient, OpenAI

__all__ = ["calculate", "run", "run_tool"]

MAX_TURNS = 3  #: model replies per trajectory
#: one connection pool for every trajectory of the process: a client of its own per trajectory builds a TLS context
#: each time, which costs more than a small model's reply
_HTTP = DefaultHttpxClient()
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_TOKEN = re.compile(r"\s*(\d+|[-+*/()])")


def calculate(expression: str) -> int:
    """The value of an integer expression of ``+ - * /`` (``/`` floors) and parentheses; ValueError otherwise."""
    tokens, at = [], 0
    expression = expression.strip()
    while at < len(expression):
        match = _TOKEN.match(expression, at)
        if match is None:
            raise ValueError(f"cannot read {expression[at : at + 10]!r}")
        tokens.append(match.group(1))
        at = match.end()
    value, rest = _sum(tokens)
    if rest:
        raise ValueError(f"unexpected {rest[0]!r}")
    return value


def _sum(tokens: list[str]) -> tuple[int, list[str]]:
    value, tokens = _product(tokens)
    while tokens and tokens[0] in "+-":
        op, (right, tokens) = tokens[0], _product(tokens[1:])
        value = value + right if op == "+" else value - right
    return value, tokens


def _product(tokens: list[str]) -> tuple[int, list[str]]:
    value, tokens = _atom(tokens)
    while tokens and tokens[0] in "*/":
        op, (right, tokens) = tokens[0], _atom(tokens[1:])
        if op == "/" and right == 0:
            raise ValueError("division by zero")
        value = value * right if op == "*" else value // right
    return value, tokens


def _atom(tokens: list[str]) -> tuple[int, list[str]]:
    if not tokens:
        raise ValueError("the expression ends too early")
    head, rest = tokens[0], tokens[1:]
    if head == "-":
        value, rest = _atom(rest)
        return -value, rest
    if head == "(":
        value, rest = _sum(rest)
        if not rest or rest[0] != ")":
            raise ValueError("a '(' is not closed")
        return value, rest[1:]
    if head.isdigit():
        return int(head), rest
    raise ValueError(f"unexpected {head!r}")


def run_tool(call: str) -> str:
    """What the tool answers to a call's JSON: the result, or an error the model can read."""
    try:
        request = json.loads(call)
        name, args = request["name"], request["arguments"]
        if name == "multiply":
            return str(calculate(f"({int(args['a'])})*({int(args['b'])})"))
        if name == "calculate":
            return str(calculate(str(args["expression"])))
        return f"error: unknown tool {name!r}"
    except (ValueError, KeyError, TypeError) as e:
        return f"error: {type(e).__name__}: {e}"


def run(row: dict[str, Any], *, base_url: str, api_key: str, model: str) -> None:
    """One trajectory of ``row`` (its chat ``prompt``): reply, tool, reply... Returns None: the reward function
    scores the last reply."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=_HTTP)
    messages = [dict(m) for m in row["prompt"]]
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model=model, messages=messages).choices[0].message.content or ""
        messages.append({"role": "assistant", "content": reply})
        call = _CALL.search(reply)
        if call is None:
            return None
        messages.append({"role": "tool", "content": run_tool(call.group(1))})
    return None
