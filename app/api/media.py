"""Stored files (images, checkpoints, preference models): the one access rule for every byte
under STORAGE_DIR.

The rule: a stored file leaves the server only to a caller with a valid token, given as
`Authorization: Bearer` or as the UI's session cookie (`ngs_session`, HttpOnly, set by
`POST /api/auth/session` when someone logs in to the UI). It is enforced here, twice over:

- `GET /api/media/{path}` is the only route that serves a file by its storage path (the UI's
  images larger than it inlines point here too), and it needs `file_reader`;
- the Gradio UI never serves the storage directory (`blocked_paths` in `app.ui.mount`), and
  `StoredFilesGuard` answers 401 on every Gradio route that serves or accepts files (uploaded
  prompt files are users' data too), and on every Gradio request whose body is not JSON (a
  file coming in, whatever the route), unless the request carries a valid token; and 403
  unless it is an admin's (only the Datasets page uploads, and reads its upload back).
  Gradio's deep links, which hand a session's component values to whoever knows its id, and
  its programmatic API (/run, /api, /call: what gradio_client calls) are refused outright
  (404): the UI offers neither.

Checkpoint and preference-model downloads (`/api/checkpoints/{id}/download`,
`/api/preference-models/{version}/download`) take the same `file_reader`, and send their file
the same way (`StoredFileResponse`). Every download route answers HEAD too (`add_head_route`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Request, Response
from fastapi.responses import FileResponse, JSONResponse
from starlette.responses import MalformedRangeHeader
from starlette.types import ASGIApp, Receive, Scope, Send

from app.api.deps import FileReaderDep, SettingsDep, authenticated, session_cookie
from app.api.strict_json import StrictJSONRoute
from app.config import UI_PATH
from app.errors import NotFound
from app.services import storage

router = APIRouter(tags=["media"], route_class=StrictJSONRoute)


class StoredFileResponse(FileResponse):
    """A stored file as Starlette's FileResponse sends it (HEAD without the bytes, a bytes
    range as 206, a range past the end as 416 with `Content-Range: bytes */<size>`), except
    for a Range header it cannot read: a unit other than bytes, or a ranges-specifier that is
    not one (`bytes=abc`, `bytes=5-3`). Starlette answers those 400 text/plain; RFC 9110 §14.2
    says a server ignores such a header, so the client (a download manager, a browser's
    player) gets the whole file, 200, with the headers it would get without the Range."""

    @classmethod
    def _parse_range_header(cls, http_range: str, file_size: int) -> list[tuple[int, int]]:
        try:
            return super()._parse_range_header(http_range, file_size)
        except MalformedRangeHeader:
            # no ranges: FileResponse then sends the whole file, as it does when a header
            # asks for more ranges than it serves
            return []


class HeadersOnly(Response):
    """What HEAD gets of a generated download (an export, a zip): the status and headers of
    the answer GET gets, its Content-Length included when it has one (none when it streams),
    and no body. A FileResponse needs none of this: it answers HEAD itself."""

    def __init__(self, response: Response) -> None:
        super().__init__(status_code=response.status_code)
        # GET's headers as they are: a fresh Response would add `content-length: 0`
        self.raw_headers = list(response.raw_headers)


def as_requested(request: Request, response: Response) -> Response:
    """`response` for GET; for HEAD, its headers only (see HeadersOnly). A generated download
    (an export, a zip) is made anew for each request, whole: it says `Accept-Ranges: none`
    (RFC 9110 §14.3), so a download manager does not ask for a part, get the whole body
    with a 200 and take it for one."""
    if isinstance(response, FileResponse):
        return response
    response.headers["Accept-Ranges"] = "none"
    return HeadersOnly(response) if request.method == "HEAD" else response


def add_head_route(router: APIRouter, path: str, endpoint: Callable[..., Any], *,
                   operation_id: str, **kwargs: Any) -> None:
    """HEAD for a download route: a download manager or `curl -I` asks for the size and the
    name before the bytes. The GET route's endpoint, so its dependencies too (the same 401,
    the same 403 or 200 for an annotator); the endpoint answers through `as_requested` or
    with a FileResponse. A route of its own, with its own operation id: one route of two
    methods gave both one id in the OpenAPI schema."""
    router.add_api_route(path, endpoint, methods=["HEAD"], operation_id=operation_id, **kwargs)


@router.get("/media/{path:path}", response_class=FileResponse,
            responses={304: {}, 401: {}, 404: {}})
def media(path: str, request: Request, _user: FileReaderDep, settings: SettingsDep) -> Response:
    """A file from the storage directory (never outside it), cacheable: files never change.
    A client that holds it (If-None-Match with its ETag) gets a 304 without the bytes."""
    full = storage.resolve(path)
    # stat given: the ETag and Last-Modified are set now, to compare with what the client holds
    try:
        stat = os.stat(full)
    except FileNotFoundError:  # deleted since resolve found it
        raise NotFound("no such file") from None
    response = StoredFileResponse(full, stat_result=stat, headers={
        "Cache-Control": f"private, max-age={settings.image_cache_seconds}, immutable"})
    held = request.headers.get("if-none-match", "")
    if held and (held.strip() == "*" or response.headers["etag"] in
                 [tag.strip().removeprefix("W/") for tag in held.split(",")]):
        return Response(status_code=304, headers={
            k: response.headers[k] for k in ("etag", "cache-control", "last-modified")})
    return response


add_head_route(router, "/media/{path:path}", media, response_class=FileResponse,
               operation_id="media_head", responses={304: {}, 401: {}, 404: {}})


# Gradio's routes that serve a file from disk or take one in (relative to the UI's mount);
# the UI shell (page, scripts, config, the queue its handlers run on) stays public so that the
# login box can load, and every handler checks the token itself (app.ui.common.caller).
GRADIO_FILE_ROUTES = re.compile(
    r"^/(gradio_api/)?(file=|file/|proxy=|stream/|upload|run-history/|custom_component/)")
# Gradio's deep links (a session's component values, saved and reloaded by hash): refused
GRADIO_DEEP_LINKS = re.compile(r"^/(gradio_api/)?deep_link")
# Gradio's programmatic API (gradio_client's /run, /api and /call routes): the pages' events
# go through the queue (queue/join, queue/data) and the studio's API is /api, so the UI offers
# none. Refused outright (404): GET /call/<api>/<id> streams the events of whichever session
# an unknown <id> names, around the session guard (app.ui.sessions)
GRADIO_PROGRAMMATIC_API = re.compile(r"^/(gradio_api/)?(run|api|call)/")
# Gradio's routes for its own development and hosting (the reload stream of `gradio app.py`,
# an endless event stream that polls 20 times a second per connection; event monitoring; the
# "vibe" editor), which a mounted UI never uses: refused (404) to everyone, since each would
# otherwise answer any caller, some at a cost to the server
GRADIO_UNUSED = re.compile(r"^/(gradio_api/)?(dev/|monitoring|vibe-|undo-vibe-)")
# What the public shell posts is JSON (queue/join, component_server, reset, cancel). A body
# of any other kind (multipart, a form, raw bytes) is a file coming in, whatever the route:
# /upload, /process_recording, or one a later Gradio adds, so it needs a token too.
JSON_TYPES = ("application/json",)
BODY_METHODS = ("POST", "PUT", "PATCH")


def content_type(scope: Scope) -> str:
    """An ASGI request's media type, lower case, without parameters ("" when none)."""
    value = next((v.decode("latin-1") for k, v in scope.get("headers", [])
                  if k == b"content-type"), "")
    return value.split(";", 1)[0].strip().lower()


def takes_files(scope: Scope) -> bool:
    """Whether a Gradio request carries a body that is not JSON (files, a form, bytes)."""
    if scope.get("method", "GET") not in BODY_METHODS:
        return False
    return content_type(scope) not in JSON_TYPES


def unauthorized(detail: str) -> JSONResponse:
    """The 401 of the UI's guards (what the API's answer says too: a bearer token is due)."""
    return JSONResponse({"detail": detail}, status_code=401,
                        headers={"WWW-Authenticate": "Bearer"})


def asks_for_deep_link(scope: Scope) -> bool:
    """Whether a request's query names a Gradio deep link (`?deep_link=`: the page and its
    config load the saved values)."""
    query = scope.get("query_string", b"").decode("latin-1")
    return "deep_link" in parse_qs(query, keep_blank_values=True)


def request_token(scope: Scope) -> str | None:
    """The bearer token of an ASGI request, or else its session cookie."""
    request = Request(scope)
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return session_cookie(request.cookies)


class StoredFilesGuard:
    """ASGI middleware: Gradio's file routes under `ui_path` need a valid token or cookie."""

    def __init__(self, app: ASGIApp, ui_path: str = UI_PATH) -> None:
        self.app, self.ui_path = app, ui_path.rstrip("/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = re.sub(r"/{2,}", "/", scope["path"])  # "/ui//file=" routes like "/ui/file="
            if path.startswith(self.ui_path + "/"):
                sub = path[len(self.ui_path):]
                incoming = takes_files(scope)
                if GRADIO_DEEP_LINKS.match(sub) or asks_for_deep_link(scope):
                    # Gradio saves a session's component values (the login box's token, the
                    # pages' tables) under a hash any caller who knows the session id could
                    # ask for, and loads them for anyone holding the link: the UI offers no
                    # deep links, so neither way in exists
                    response = JSONResponse({"detail": "this UI does not offer deep links"},
                                            status_code=404)
                    await response(scope, receive, send)
                    return
                if GRADIO_UNUSED.match(sub):
                    response = JSONResponse({"detail": "not a route of this UI"},
                                            status_code=404)
                    await response(scope, receive, send)
                    return
                if GRADIO_PROGRAMMATIC_API.match(sub):
                    response = JSONResponse({"detail": "this UI offers no programmatic API: "
                                                       "use the studio's REST API under /api"},
                                            status_code=404)
                    await response(scope, receive, send)
                    return
                if GRADIO_FILE_ROUTES.match(sub) or incoming:
                    from starlette.concurrency import run_in_threadpool

                    user = await run_in_threadpool(authenticated, request_token(scope))
                    if user is None:
                        response = unauthorized("stored files need a valid token: log in "
                                                "to the UI, or send Authorization: Bearer "
                                                "<token>")
                        await response(scope, receive, send)
                        return
                    if user.role != "admin":
                        # only the Datasets page (admins) sends files, or gets one back (the
                        # picker's file, which is another admin's upload): an annotator's
                        # upload would only take the server's disk, and their images come
                        # through /api/media
                        response = JSONResponse(
                            {"detail": "only admins upload files or read uploads back (the "
                                       "Datasets page)"},
                            status_code=403)
                        await response(scope, receive, send)
                        return
        await self.app(scope, receive, send)
