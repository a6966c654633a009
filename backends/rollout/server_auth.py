"""Who may call a rollout server: every request carries a run's token, and only the trainer's reaches the weight and
admin routes.

The run generates two tokens (:func:`new_tokens`, ``secrets.token_urlsafe``) and hands them to its servers in the
environment (never on a command line, never logged): the **trainer token** may call everything; the **agent token**
only the OpenAI-compatible sampling routes (:data:`AGENT_ROUTES`), so an agent cannot push weights, pause or drain a
server. :class:`RunTokenAuth` is an ASGI middleware (vLLM takes it with ``--middleware``); vLLM's own ``--api-key``
guards ``/v1`` alone, and its weight-update, pause and ``collective_rpc`` routes not at all.
"""

from __future__ import annotations

import json
import os
import secrets
from typing import Any

import attrs

__all__ = ["AGENT_ROUTES", "AGENT_TOKEN_ENV", "TRAINER_TOKEN_ENV", "RunTokenAuth", "RunTokens", "new_tokens"]

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
        token = _bearer(scope)
        path = scope.get("path", "")
        if token is not None and secrets.compare_digest(token, self.trainer):
            return await self.app(scope, receive, send)
        if token is not None and self.agent and secrets.compare_digest(token, self.agent):
            if path in AGENT_ROUTES:
                return await self.app(scope, receive, send)
            return await _refuse(send, 403, f"{path}: an agent token may call only {', '.join(AGENT_ROUTES)}")
        what = "no bearer token" if token is None else "an unknown token"
        return await _refuse(send, 401, f"{path}: {what}; every request needs the run's token (Authorization: Bearer)")


def _bearer(scope: dict) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


async def _refuse(send: Any, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
