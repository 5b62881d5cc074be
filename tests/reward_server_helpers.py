"""A real reward server for tests: `trainer.rewards.serve.ServerThread` (uvicorn serving
`create_app` on a free port of 127.0.0.1, in a daemon thread of the test process, so a test
can register a reward the server then serves), and a URL where nothing listens. Shared by
tests/trainer/test_reward_server.py and the job tests; and `held_reward`, a reward that
holds the server's scoring at a chosen point, for the tests of jobs stopped while they wait."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

from trainer.rewards.serve import ServerThread

__all__ = ["ServerThread", "free_port_url", "held_reward"]


@contextlib.contextmanager
def held_reward(after: int, name: str = "test_held"
                ) -> Iterator[tuple[list[int], threading.Event, threading.Event]]:
    """Registers the reward `name` in this process (it scores as the count does), which holds
    the call that comes once `after` images are scored until released. Yields (the images of
    each call scored, the event set while it holds, the one that releases); on exit the held
    call is released and the registry is as it was (a built-in of that name back)."""
    from trainer.rewards import get_reward, register_reward, registry

    count = get_reward("count")
    replaced = registry._REWARDS.get(name)
    shapes_only = name in registry._SHAPES_ONLY
    scored: list[int] = []
    holding, release = threading.Event(), threading.Event()

    def held(images, prompts):
        if sum(scored) >= after:
            holding.set()
            release.wait(60)
        scored.append(len(images))
        return count(images, prompts)

    register_reward(name, held, shapes_only=shapes_only)
    try:
        yield scored, holding, release
    finally:
        release.set()
        if replaced is None:
            registry._REWARDS.pop(name, None)
        else:
            register_reward(name, replaced, shapes_only=shapes_only)


def free_port_url() -> str:
    """The URL of a port of 127.0.0.1 that nobody listens on (bound, then let go)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"
