"""A browser's request on behalf of another page is refused: the studio answers its own pages.

The UI's session cookie is SameSite=Strict, which keeps other *sites* from sending it; but a
page on another port of the same host, or on a sibling subdomain, is the same site, and its
`fetch(..., {credentials: "include"})` carries the cookie. Gradio's own CORS middleware answers
such origins (any localhost one, any at all off localhost) with credentials allowed, so such a
page could drive a logged-in admin's UI: create an admin and read its token. Two locks:

- `SameOriginGuard` (outermost): a request whose `Origin` header names another origin than the
  studio's own (its Host, or X-Forwarded-Host behind a proxy; or one listed in ALLOWED_ORIGINS)
  is a 403 before anything reads it (scheme, host and port compared: an http page of the
  same host is another origin than an https studio). Browsers send Origin on every cross-origin request and on
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


def normalised_origin(origin: str) -> str | None:
    """`scheme://host[:port]` lower-cased, the scheme's default port left out; None for what
    is no http(s) origin ("null", a bare host name, a path)."""
    parts = urlsplit(origin.strip().rstrip("/").lower())
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path \
            or parts.query or parts.fragment or "@" in parts.netloc:
        return None
    return f"{parts.scheme}://{_netloc(parts.scheme, parts.netloc)}"


def allowed_origins_problem(text: str) -> str | None:
    """What is wrong with ALLOWED_ORIGINS, or None."""
    bad = [o.strip() for o in text.split(",") if o.strip() and normalised_origin(o) is None]
    if bad:
        return (f"each entry must be an origin, scheme://host[:port] (e.g. "
                f"https://studio.example.com), got {', '.join(map(repr, bad[:5]))}")
    return None


def parse_allowed_origins(text: str) -> list[str]:
    """ALLOWED_ORIGINS (comma-separated, blanks dropped) as normalised origins."""
    return [n for o in text.split(",") if o.strip() and (n := normalised_origin(o))]


def origin_allowed(origin: str, headers: Headers, allowed: list[str], scheme: str = "http"
                   ) -> bool:
    """Whether a request with `Origin: origin` comes from the studio's own pages: the same
    scheme, host and port as the request itself (its Host or X-Forwarded-Host, its scheme or
    X-Forwarded-Proto), or one of `allowed`."""
    theirs = normalised_origin(origin)
    if theirs is None:
        return False  # "null" (a sandboxed frame, a file), or no origin at all
    if theirs in allowed:
        return True
    own_scheme = (headers.get("x-forwarded-proto") or scheme).split(",")[0].strip().lower()
    # the names this server answers to: the Host the browser sent, and the one a proxy
    # forwarded (X-Forwarded-Host, its first value)
    hosts = [headers.get("host", "")]
    if forwarded := headers.get("x-forwarded-host"):
        hosts.append(forwarded.split(",")[0])
    return any(theirs == f"{own_scheme}://{_netloc(own_scheme, host)}" for host in hosts
               if host.strip())


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
        scheme = {"https": "https", "wss": "https"}.get(scope.get("scheme", "http"), "http")
        if origin is None or origin_allowed(origin, headers, self.allowed, scheme):
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
