"""HEAD wherever GET answers, as RFC 9110 §9.3.2 has it, on the app's own routes.

FastAPI serves a route for exactly the methods it is declared with, so `HEAD /api/jobs` (a
monitor's or a proxy's probe) was a 405 although GET answers there. This middleware gives
such a HEAD the answer GET would get, its status and headers (Content-Length included) with
no body, through GET's own dependencies (a HEAD without a token is the same 401). Routes that
declare HEAD themselves (the downloads, app/api/media.py) answer it as they do; the UI under
`ui_path` is Gradio's to answer. Found by behaviour (the route's 405), not by reading the
router's tables, whose layout FastAPI changes between versions.
"""

from __future__ import annotations

import re
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.config import UI_PATH


class HeadWhereGetAnswers:
    """ASGI middleware: a HEAD the routes answer with 405 is answered as GET, without a body."""

    def __init__(self, app: ASGIApp, ui_path: str = UI_PATH) -> None:
        self.app, self.ui_path = app, ui_path.rstrip("/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["method"] != "HEAD"
                or scope["path"] == self.ui_path or scope["path"].startswith(self.ui_path + "/")):
            await self.app(scope, receive, send)
            return
        held: list[Message] = []  # a HEAD's answer is headers alone: small to hold

        async def hold(message: Message) -> None:
            held.append(message)

        await self.app(scope, receive, hold)
        if not held or held[0].get("status") != 405:
            for message in held:
                await send(message)
            return
        await self.app({**scope, "method": "GET"}, _no_body(receive), _without_body(send))


# an OpenAPI path template's parameter: `{job_id}`, or `{path:path}` that spans slashes
_PARAMETER = re.compile(r"\{[^}:]+(:path)?\}")


def _template_pattern(template: str) -> re.Pattern[str]:
    parts, at = [], 0
    for m in _PARAMETER.finditer(template):
        parts += [re.escape(template[at:m.start()]), ".+" if m.group(1) else "[^/]+"]
        at = m.end()
    return re.compile("".join(parts + [re.escape(template[at:])]) + "$")


def allowed_methods(schema: dict[str, Any], path: str) -> list[str]:
    """Every method the app's routes answer at `path`, for a 405's `Allow` (RFC 9110 §15.5.6
    says the header lists the target's methods, all of them). Starlette's 405 names those of
    the first route whose path matched, so `PUT /api/jobs` said `Allow: POST` although GET
    answers there too. Read from the OpenAPI schema (`schema`, the app's `openapi()`), the
    routes' public description; HEAD wherever GET answers (HeadWhereGetAnswers)."""
    found: set[str] = set()
    for template, operations in schema.get("paths", {}).items():
        if _template_pattern(template).match(path):
            found |= {method.upper() for method in operations
                      if method in ("get", "head", "post", "put", "patch", "delete")}
    if "GET" in found:
        found.add("HEAD")
    order = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")
    return [m for m in order if m in found]


def _no_body(receive: Receive) -> Receive:
    """`receive` for the second pass: a HEAD's empty body once more (the first pass may have
    read it), then whatever the connection says (a disconnect)."""
    given = False

    async def again() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": b"", "more_body": False}
        return await receive()
    return again


def _without_body(send: Send) -> Send:
    """`send` with every body chunk emptied: GET's status and headers, no bytes."""
    async def head_send(message: Message) -> None:
        if message["type"] == "http.response.body":
            message = {**message, "body": b""}
        await send(message)
    return head_send
