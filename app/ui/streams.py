"""Gradio's event stream (`queue/data`) ends cleanly when its session is gone.

Gradio's stream raises once the session's message queue is gone, after it has already sent
its last message (`unexpected_error` with `session_not_found`): an `HTTPException(404)` when
the session is unknown (any `GET queue/data?session_hash=nope`, no login needed), or a
`KeyError` when two streams of one session are cancelled together (a page's reload: the first
removes the queue, the second's cleanup removes it again). The response has started by then,
so Starlette can only re-raise, and uvicorn logged "Exception in ASGI application" with two
tracebacks for what is a normal reload, and anyone could grow the log with it.
`EndedSessionStreams` ends such a stream as a finished one instead (the client already has
the message saying why); every other error of the stream propagates as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from urllib.parse import parse_qs

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was raised from or while handling."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not e for e in seen):
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def session_gone(exc: BaseException, session_hash: str | None) -> bool:
    """Whether `exc` is Gradio's stream failing because the session's queue is gone: its 404
    (raised at the top of its loop), or its KeyError for this session raised while handling
    the stream's cancellation."""
    chain = _chain(exc)
    if any(isinstance(e, HTTPException) and e.status_code == 404 for e in chain):
        return True
    return any(isinstance(e, KeyError) and e.args == (session_hash,) and
               any(isinstance(c, asyncio.CancelledError) for c in _chain(e)[1:])
               for e in chain)


class EndedSessionStreams:
    """ASGI middleware for `{ui_path}/gradio_api/queue/data`: see the module's docstring."""

    def __init__(self, app: ASGIApp, ui_path: str) -> None:
        self.app = app
        self.stream_path = re.compile(rf"^{re.escape(ui_path)}/+gradio_api/+queue/+data/*$")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.stream_path.match(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        started = ended = False

        async def watched_send(message: Message) -> None:
            nonlocal started, ended
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                ended = True
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except Exception as exc:
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            session = (query.get("session_hash") or [None])[-1]  # the one the route reads
            if not started or not session_gone(exc, session):
                raise
            log.debug("event stream of a gone UI session ended: %r", exc)
            if not ended:
                with contextlib.suppress(OSError):  # the client is gone too (a reload)
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
