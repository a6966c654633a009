"""The request bodies a rollout server accepts and the OpenAI-shaped responses it returns.

Requests are pydantic models that refuse fields they do not know (``extra="forbid"``): an option the server does not
implement (``stop``, ``logit_bias``, ``presence_penalty``...) is a 400 naming it, never silently ignored. Responses
follow the ``openai`` package's ``Completion`` and ``ChatCompletion`` types, plus what a trainer needs beside them
(as vLLM does with ``return_token_ids``): ``prompt_token_ids``, each choice's ``token_ids`` and the
``policy_version`` of the weights that sampled them. Log-probs are the sampled tokens' raw log-probs (temperature
1, no top-k / top-p), as the engines' ``rollout_logprobs``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from backends.rollout.common import SamplingConfig

__all__ = [
    "ChatBody",
    "ChatMessage",
    "CompletionBody",
    "GenerateBody",
    "RegisterBody",
    "SampledRow",
    "SamplingBody",
    "TEMPLATE_OWN_ARGS",
    "WeightsVersionBody",
    "chat_response",
    "completion_response",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingBody(_Strict):
    """:class:`backends.rollout.common.SamplingConfig`'s fields (``/generate``)."""

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 16
    seed: int = 0
    truncate_prompts: bool = False

    def config(self) -> SamplingConfig:
        return SamplingConfig(**self.model_dump())


class GenerateBody(_Strict):
    """``POST /generate``: the loop's batched generate."""

    prompts: list[list[int]]
    sampling: SamplingBody = SamplingBody()
    seed: int | None = None
    group_ids: list[int] | None = None


class _OpenAISampling(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  #: vLLM's extra parameter; -1 or 0: off
    n: int = Field(default=1, ge=1)
    seed: int | None = None
    stream: bool = False
    user: str | None = None

    def sampling(self, defaults: SamplingConfig, max_new_tokens: int, seed: int) -> SamplingConfig:
        """The request's options; what it leaves out comes from the server's ``defaults`` (the run's sampling)."""
        return SamplingConfig(
            n=self.n,
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            top_k=defaults.top_k if self.top_k is None else max(0, self.top_k),
            max_new_tokens=max_new_tokens,
            seed=seed,
        )


class CompletionBody(_OpenAISampling):
    """``POST /v1/completions``: one prompt (text or ids) or a list of them."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=0)  #: 0: the sampled tokens' log-probs; no alternatives
    echo: Literal[False] = False


class _TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; keys beyond role and content (``name``, ``tool_call_id``) pass to the chat template."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None

    def for_template(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {**(self.model_extra or {}), "role": self.role, "content": "" if content is None else content}


#: names ``apply_chat_template`` takes itself: a request's ``chat_template_kwargs`` may not set them
TEMPLATE_OWN_ARGS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class ChatBody(_OpenAISampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=0)  #: no alternatives: 0 or none
    #: variables for the chat template (vLLM's parameter, e.g. ``{"enable_thinking": false}``)
    chat_template_kwargs: dict[str, Any] | None = None


class RegisterBody(_Strict):
    """``POST /trajectories``: a trajectory an agent's key will identify."""

    id: str = Field(min_length=1, max_length=200)
    deadline_s: float | None = Field(default=None, gt=0.0)


class WeightsVersionBody(_Strict):
    version: int = Field(ge=0)


class SampledRow(BaseModel):
    """One sampled row of a call: what the engine fed and sampled."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finished: bool  #: ended with an EOS token (else cut at ``max_tokens``)
    text: str  #: the sampled ids as text, EOS dropped


def _ids() -> tuple[str, int]:
    return uuid.uuid4().hex, int(time.time())


def _usage(rows: list[SampledRow], prompts: list[list[int]]) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(r.token_ids) for r in rows)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_response(
    model: str,
    prompts: list[list[int]],
    rows: list[SampledRow],
    pieces: list[list[str]],
    *,
    logprobs: bool,
    version: int,
) -> dict[str, Any]:
    """An OpenAI ``Completion``: choice ``i`` is row ``i`` (``n`` rows per prompt, prompts in order); ``pieces``:
    each row's tokens as text."""
    request_id, created = _ids()
    choices = []
    for i, (row, tokens) in enumerate(zip(rows, pieces)):
        offsets, at = [], 0
        for piece in tokens:
            offsets.append(at)
            at += len(piece)
        choices.append(
            {
                "index": i,
                "text": row.text,
                "finish_reason": "stop" if row.finished else "length",
                "logprobs": (
                    {"tokens": tokens, "token_logprobs": row.logprobs, "top_logprobs": None, "text_offset": offsets}
                    if logprobs
                    else None
                ),
                "token_ids": row.token_ids,
                "prompt_token_ids": row.prompt_ids,
            }
        )
    return {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": _usage(rows, prompts),
        "policy_version": version,
    }


def chat_response(
    model: str, prompt: list[int], rows: list[SampledRow], pieces: list[list[str]], *, logprobs: bool, version: int
) -> dict[str, Any]:
    """An OpenAI ``ChatCompletion`` of ``rows`` (the ``n`` samples of one rendered ``prompt``)."""
    request_id, created = _ids()
    choices = []
    for i, (row, tokens) in enumerate(zip(rows, pieces)):
        content = [
            {"token": piece, "logprob": lp, "bytes": list(piece.encode("utf-8")), "top_logprobs": []}
            for piece, lp in zip(tokens, row.logprobs)
        ]
        choices.append(
            {
                "index": i,
                "message": {"role": "assistant", "content": row.text},
                "finish_reason": "stop" if row.finished else "length",
                "logprobs": {"content": content} if logprobs else None,
                "token_ids": row.token_ids,
            }
        )
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": _usage(rows, [prompt]),
        "prompt_token_ids": prompt,
        "policy_version": version,
    }
