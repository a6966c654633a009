"""Restarting the vLLM rollout servers a run started (``rollout.vllm_server.restart``).

A server that dies (its process exits; connections are refused or cut) or stops answering (a request passes
``rollout.vllm_server.request_timeout_s``) fails the requests sent to it as unreachable. Without ``restart`` that is
the run's error, naming the server. With it, the ranks that share the servers learn in the same ``generate`` call
which servers failed on any of them (one collective per call); the first rank stops each such server (its process
group), starts it again on its port (on a new one if that is taken), forms a new weight-transfer group with it and
pushes the weights of the engine's current version through the same checked push; then every rank sends its
unanswered requests again. Their answers are checked as every answer is: each token carries its weight version and
must be the engine's, so no token of a stale or half-synced server is trained on.

A frozen server is found by the request deadline (``request_timeout_s``), while the other ranks wait in that
collective: keep the deadline below the process group's (``deadlines.process_group``), or the group's watchdog ends
the run first.

At most ``rollout.vllm_server.max_restarts`` restarts over the run; a failure after that is an error naming the
server and the count. A server pointed at (``rollout.vllm_server.urls``) is not restarted: its failure is an error
that says so. To push the current weights, the first rank keeps the last set it pushed (references to the tensors
``sync_weights`` received).

The native engine's server (:mod:`backends.rollout.server`) has no such restart: a run starts it only on a thread of
its own process (the agents' endpoint), never as a process of its own.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import attrs
from torch import Tensor

from backends.rollout.vllm_server import RolloutServer, RolloutServerError, port_is_free

__all__ = ["ServerKeeper"]

log = logging.getLogger("rlfunc.rollout")


@attrs.define(eq=False)
class ServerKeeper:
    """What restarts one engine's servers; every value of the engine shares it. The first rank's can start a server
    (``start``: (server index, port or None, restart count) -> a server answering ``/health``); every rank's holds
    the count of restarts."""

    max_restarts: int
    start: Callable[[int, int | None, int], RolloutServer] | None = None
    #: a weight pusher for a server's client (the first rank's)
    pusher_for: Callable[[Any], Any] | None = None
    initial_weights: Callable[[], list[tuple[str, Tensor]]] | None = None  #: the policy the servers start on
    host: str = "127.0.0.1"
    weights: list[tuple[str, Tensor]] | None = attrs.field(default=None, repr=False)  #: the last set pushed
    restarts: int = 0

    def remember(self, named: list[tuple[str, Tensor]]) -> None:
        """``named`` was pushed to every server: what a restarted one gets."""
        if self.start is not None:
            self.weights = named

    def restart(self, failures: dict[int, str], rollout: Any) -> list[str]:
        """Restart the servers of ``rollout`` that failed (server index -> what a request to it saw) and load the
        current weights into each; every server's URL after. Raises what may not be restarted, naming it."""
        if self.start is None or self.pusher_for is None or self.initial_weights is None:
            raise RuntimeError("ServerKeeper.restart runs on the rank that started the servers")
        for index, cause in sorted(failures.items()):
            client = rollout.clients[index]
            if index >= len(rollout.servers):
                raise RolloutServerError(
                    f"{cause}\n(rollout server {client.url} was pointed at with rollout.vllm_server.urls: the run "
                    "restarts only the servers it started)"
                )
            if self.restarts >= self.max_restarts:
                raise RolloutServerError(
                    f"{cause}\n(rollout server {client.url} failed after {self.restarts} restart(s) of the run's "
                    f"servers: rollout.vllm_server.max_restarts={self.max_restarts})"
                )
            old = rollout.servers[index]
            old.stop(grace_s=5.0)  # what is left of its process group: a frozen server, its engine processes
            self.restarts += 1
            server = self.start(index, old.port if port_is_free(self.host, old.port) else None, self.restarts)
            rollout.servers[index] = server
            rollout.pushers[index].close()
            client.move_to(server.url)
            rollout.pushers[index] = self.pusher_for(client)
            weights = self.weights if self.weights is not None else self.initial_weights()
            rollout.pushers[index].push(weights, version=rollout.weights_version)
            log.warning(
                "rollout server %s did not answer (%s); restarted it (%d of at most %d restarts) on %s with the "
                "weights of version %d",
                old.url,
                cause.splitlines()[0],
                self.restarts,
                self.max_restarts,
                server.url,
                rollout.weights_version,
            )
        return [c.url for c in rollout.clients]
