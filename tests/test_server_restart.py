"""Which servers a run restarts (backends/rollout/server_restart.py), without starting one: a server pointed at by
URL is never restarted, and a crash loop ends once rollout.vllm_server.max_restarts is spent, each in an error that
says so. (tests/test_vllm_server.py kills a server the run started and sees it restarted.)

What it costs: a `sleep` process that is killed, requests to a closed loopback port and to a stdlib HTTP server that
refuses them (milliseconds).
"""

from __future__ import annotations

import http.server
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from backends.rollout.common import SamplingConfig
from backends.rollout.server_auth import RunTokens
from backends.rollout.server_restart import ServerKeeper
from backends.rollout.server_rollout import ServerRollout
from backends.rollout.vllm_server import RolloutServer, RolloutServerError, ServerClient

pytestmark = pytest.mark.service


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed: connections are refused


def _engine(keeper: ServerKeeper, servers: list) -> ServerRollout:
    url = f"http://127.0.0.1:{_closed_port()}"
    return ServerRollout(
        clients=(ServerClient(url, "token", timeout_s=5.0),),
        pad_token_id=0,
        eos_token_ids=(1,),
        max_context=32,
        vocab_size=64,
        servers=servers,
        keeper=keeper,
    )


def _never_started(*args):
    raise AssertionError("no server may be started here")


def test_a_server_pointed_at_is_not_restarted():
    keeper = ServerKeeper(max_restarts=3, start=_never_started, pusher_for=_never_started, initial_weights=list)
    engine = _engine(keeper, servers=[])
    with pytest.raises(RolloutServerError, match=r"ConnectError(.|\n)*pointed at with rollout.vllm_server.urls"):
        engine.generate([[5, 6]], SamplingConfig(n=1, max_new_tokens=2), seed=0)
    assert keeper.restarts == 0 and engine.server_metrics() == {"rollout/server_restarts": 0.0}


def test_a_crash_loop_ends_once_the_restarts_are_spent(tmp_path):
    dead = subprocess.Popen(["sleep", "60"], start_new_session=True)
    dead.kill()
    dead.wait()
    keeper = ServerKeeper(max_restarts=2, start=_never_started, pusher_for=_never_started, initial_weights=list)
    keeper.restarts = 2  # spent by earlier failures of the run
    server = RolloutServer(
        process=dead, url="http://127.0.0.1:1", log_path=Path(tmp_path / "x.log"), tokens=RunTokens("t", "a")
    )
    engine = _engine(keeper, servers=[server])
    with pytest.raises(
        RolloutServerError,
        match=r"failed after 2 restart\(s\) of the run's servers: rollout.vllm_server.max_restarts=2",
    ):
        engine.generate([[5, 6]], SamplingConfig(n=1, max_new_tokens=2), seed=0)
    assert keeper.restarts == 2


class _Refusing(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        self.send_response(400)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": {"message": "bad sampling params"}}')

    def log_message(self, *args):
        pass


def test_a_refused_request_is_the_requests_fault_not_a_dead_server():
    """A server that answers, with an error, is not restarted: the run's error is its answer."""
    keeper = ServerKeeper(max_restarts=3, start=_never_started, pusher_for=_never_started, initial_weights=list)
    refusing = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    thread = threading.Thread(target=refusing.serve_forever, daemon=True)
    thread.start()
    try:
        engine = _engine(keeper, servers=[])
        engine.clients[0].move_to(f"http://127.0.0.1:{refusing.server_address[1]}")
        with pytest.raises(RolloutServerError, match="answered 400: .*bad sampling params"):
            engine.generate([[5, 6]], SamplingConfig(n=1, max_new_tokens=2), seed=0)
    finally:
        refusing.shutdown()
    assert keeper.restarts == 0
