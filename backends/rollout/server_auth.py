"""Who may call a rollout server: every request carries a run's token, and only the trainer's reaches the weight and
admin routes. One check for both server stacks (:func:`who_calls`): rlfunc's own (:mod:`backends.rollout.server`)
and vLLM's OpenAI server (:class:`RunTokenAuth`).

The run generates its tokens (:func:`new_tokens`, ``secrets.token_urlsafe``) and hands them to its servers in the
environment (never on a command line, never logged): the **trainer token** may call everything; an **agent token**
only the OpenAI-compatible sampling routes (:data:`AGENT_ROUTES`), so an agent cannot push weights, pause or drain a
server. vLLM's servers take one agent token for the run; rlfunc's server hands out one agent key per trajectory
(and checks its deadline after this check). A refusal is 401 (no token, or one the server does not know) or 403 (an
agent token off its routes), with an OpenAI-style JSON error (:class:`TokenRefused`). :class:`RunTokenAuth` is an
ASGI middleware (vLLM takes it with ``--middleware``); vLLM's own ``--api-key`` guards ``/v1`` alone, and its
weight-update, pause and ``collective_rpc`` routes not at all.
"""

from __future__ import annotations

import json
import os
import secrets
from typing import Any, Callable

import attrs

__all__ = [
    "AGENT_ROUTES",
    "AGENT_TOKEN_ENV",
    "TRAINER_TOKEN_ENV",
    "RunTokenAuth",
    "RunTokens",
    "TokenRefused",
    "bearer_token",
    "new_tokens",
    "who_calls",
]

TRAINER_TOKEN_ENV = "RLFUNC_SERVER_TRAINER_TOKEN"
AGENT_TOKEN_ENV = "RLFUNC_SERVER_AGENT_TOKEN"
#: what an agent token may call
AGENT_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models")


@attrs.frozen(repr=False)
class RunTokens:
    """A run's two server tokens (kept out of reprs and logs)."""

    trainer: str
    agent: str

    def environ(self) -> dict[str, str]:
        return {TRAINER_TOKEN_ENV: self.trainer, AGENT_TOKEN_ENV: self.agent}

    def __repr__(self) -> str:
        return "RunTokens(<hidden>)"


def new_tokens() -> RunTokens:
    return RunTokens(trainer=secrets.token_urlsafe(32), agent=secrets.token_urlsafe(32))


class TokenRefused(Exception):
    """A request refused for its token: 401 (none, or one the server does not know) or 403 (an agent token off its
    routes)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message
        self.kind = "authentication_error" if status == 401 else "permission_error"

    def body(self) -> dict[str, Any]:
        """The OpenAI-style JSON error."""
        return {"error": {"message": self.message, "type": self.kind, "param": None, "code": self.status}}


def bearer_token(authorization: str) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header's value; None without one."""
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def who_calls(token: str | None, method: str, path: str, *, trainer: str, is_agent: Callable[[str], bool]) -> str:
    """``"trainer"`` or ``"agent"``: who sent ``token`` to ``method path`` (``is_agent``: whether a token is one of
    the server's agent tokens); :class:`TokenRefused` when that caller may not call there."""
    if token is None:
        raise TokenRefused(401, "no bearer token: every request needs the run's token (Authorization: Bearer <token>)")
    if secrets.compare_digest(token.encode(), trainer.encode()):
        return "trainer"
    if not is_agent(token):
        raise TokenRefused(401, "the bearer token is not one this server accepts")
    if path not in AGENT_ROUTES:
        raise TokenRefused(
            403, f"an agent token may call only {', '.join(AGENT_ROUTES)}; {method} {path} needs the trainer's token"
        )
    return "agent"


class RunTokenAuth:
    """ASGI middleware: 401 without a known token, 403 for an agent token off :data:`AGENT_ROUTES`, with a JSON error
    that says which. The tokens come from the environment (:data:`TRAINER_TOKEN_ENV`, :data:`AGENT_TOKEN_ENV`); a
    server started without a trainer token refuses to start."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.trainer = os.environ.get(TRAINER_TOKEN_ENV, "")
        self.agent = os.environ.get(AGENT_TOKEN_ENV, "")
        if not self.trainer:
            raise RuntimeError(f"a rollout server needs its run's trainer token in ${TRAINER_TOKEN_ENV}")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        try:
            who_calls(
                bearer_token(header.decode("latin-1")),
                scope.get("method", ""),
                scope.get("path", ""),
                trainer=self.trainer,
                is_agent=lambda token: bool(self.agent) and secrets.compare_digest(token.encode(), self.agent.encode()),
            )
        except TokenRefused as e:
            return await _refuse(send, e)
        return await self.app(scope, receive, send)


async def _refuse(send: Any, refusal: TokenRefused) -> None:
    body = json.dumps(refusal.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
