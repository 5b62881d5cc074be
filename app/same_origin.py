"""A browser's request on behalf of another page is refused: the studio answers its own pages.

The UI's session cookie is SameSite=Strict, which keeps other *sites* from sending it; but a
page on another port of the same host, or on a sibling subdomain, is the same site, and its
`fetch(..., {credentials: "include"})` carries the cookie. Gradio's own CORS middleware answers
such origins (any localhost one, any at all off localhost) with credentials allowed, so such a
page could drive a logged-in admin's UI: create an admin and read its token. Two locks:

- `SameOriginGuard` (outermost): a request whose `Origin` header names another origin than the
  studio's own (its Host, or X-Forwarded-Host behind a proxy; or one listed in ALLOWED_ORIGINS)
  is a 403 before anything reads it. Browsers send Origin on every cross-origin request and on
  every POST; scripts (curl, requests) send none and pass. A link followed to the studio is a
  navigation without Origin and passes too.
- `no_cross_origin_sharing`: a Starlette CORSMiddleware allowing no origin, which Gradio's
  middleware defers to (it steps aside where the parent app configures CORS), so no response
  says `Access-Control-Allow-Origin` to a foreign page.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

DEFAULT_PORTS = {"http": "80", "https": "443", "ws": "80", "wss": "443"}


def _netloc(scheme: str, host: str) -> str:
    """host[:port] lower-cased, the scheme's default port left out."""
    host = host.strip().lower()
    default = DEFAULT_PORTS.get(scheme)
    if default and host.endswith(f":{default}") and not host.endswith("]"):
        host = host[: -len(default) - 1]
    return host


def parse_allowed_origins(text: str) -> list[str]:
    """ALLOWED_ORIGINS as a list of `scheme://host[:port]` (comma-separated, blanks dropped)."""
    return [o.strip().rstrip("/").lower() for o in text.split(",") if o.strip()]


def origin_allowed(origin: str, headers: Headers, allowed: list[str]) -> bool:
    """Whether a request with `Origin: origin` comes from the studio's own pages."""
    origin = origin.strip().rstrip("/").lower()
    if origin in allowed:
        return True
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False  # "null" (a sandboxed frame, a file), or no origin at all
    theirs = _netloc(parts.scheme, parts.netloc)
    # the names this server answers to: the Host the browser sent, and the one a proxy
    # forwarded (X-Forwarded-Host, its first value)
    own = [headers.get("host", "")]
    if forwarded := headers.get("x-forwarded-host"):
        own.append(forwarded.split(",")[0])
    return any(theirs == _netloc(parts.scheme, host) for host in own if host)


class SameOriginGuard:
    """ASGI middleware: 403 for a request whose Origin is not the studio's (module doc)."""

    def __init__(self, app: ASGIApp, allowed_origins: list[str] | None = None) -> None:
        self.app, self.allowed = app, list(allowed_origins or [])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        if origin is None or origin_allowed(origin, headers, self.allowed):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        response = JSONResponse({
            "detail": f"a request from a page at {origin[:200]!r} is refused: the studio "
                      "answers its own pages only (a studio served under another name than "
                      "its Host, behind a proxy, lists that name in ALLOWED_ORIGINS)",
            "field": "origin"}, status_code=403)
        await response(scope, receive, send)


def no_cross_origin_sharing(app: FastAPI) -> None:
    """A CORS policy that shares nothing with other origins; Gradio's own middleware, which
    would allow them with credentials, defers to it (module doc)."""
    app.add_middleware(CORSMiddleware, allow_origins=[], allow_credentials=False)
