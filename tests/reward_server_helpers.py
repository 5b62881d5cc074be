"""A real reward server for tests: uvicorn serving `trainer.rewards.serve.create_app` on a free
port of 127.0.0.1, in a daemon thread of the test process (so a test can register a reward
the server then serves). Shared by tests/trainer/test_reward_server.py and the job tests."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


class ServerThread:
    """uvicorn serving `app` on a free port of 127.0.0.1, in a daemon thread."""

    def __init__(self, app) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
        self.sock.close()


def free_port_url() -> str:
    """The URL of a port of 127.0.0.1 that nobody listens on (bound, then let go)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"
