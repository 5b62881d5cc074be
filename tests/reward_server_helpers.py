"""A real reward server for tests: `trainer.rewards.serve.ServerThread` (uvicorn serving
`create_app` on a free port of 127.0.0.1, in a daemon thread of the test process, so a test
can register a reward the server then serves), and a URL where nothing listens. Shared by
tests/trainer/test_reward_server.py and the job tests."""

from __future__ import annotations

import socket

from trainer.rewards.serve import ServerThread

__all__ = ["ServerThread", "free_port_url"]


def free_port_url() -> str:
    """The URL of a port of 127.0.0.1 that nobody listens on (bound, then let go)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"
