"""Which browser a logged-in UI session belongs to.

Gradio names a page's session by a random id (`session_hash`) that the page sends with every
event (`queue/join`), stream (`queue/data`) and heartbeat, and it runs each event with that
session's state, where the login keeps its token (app/ui/login.py). The id alone would
therefore act as the logged-in user: anyone who learnt it (from a proxy's or the server's
log, a shared screen) could join the queue under it and run any handler as them. So a logged
in session is bound to the credential its browser holds, the HttpOnly session cookie set at
login: `UiSessionGuard` refuses a request naming a logged-in session unless it carries a
token (that cookie, or an Authorization header) of the same user. Sessions no one is logged
into (the login box's own events) pass. A session whose login no longer authenticates (Log
out in another tab revoked the session token a restored page rests on; an admin revoked the
user) is refused, with the answer that reloads its page to the login box
(`SESSION_NOT_THIS_BROWSERS`), and its first refused event unbinds it: there is nothing to take
over, and a page that may not reload again yet goes on as the login box's, its handlers saying
the login ended.

The table lives in this process's memory, as Gradio's session states do.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any
from urllib.parse import parse_qs

from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.deps import authenticated
from app.api.media import BODY_METHODS, content_type, request_token, unauthorized
from app.config import UI_PATH

_lock = threading.Lock()
_logins: dict[str, str] = {}  # session_hash -> the token its login holds
MAX_SESSIONS = 100_000  # logins not logged out; the oldest go first past this many

# the session id where Gradio's client puts it outside a JSON body: /heartbeat/<id>,
# /stream/<id>/..., or ?session_hash=<id>
_PATH_SESSION = re.compile(r"^/(?:gradio_api/)?(?:heartbeat|stream)/([^/?]+)")
# What a page hears when its login is no longer its browser's. Most often a login or a Log out
# in another tab of the same browser replaced the session cookie this page's login rests on;
# the page still shows its pages and its Log out (refused too), and "log in here" named a box
# it does not show: a reload shows the browser's login as it now is.
SESSION_NOT_THIS_BROWSERS = (
    "this page's login is no longer this browser's: someone logged in or out in another tab "
    "of this browser (or this session is being used from another browser). Reload the page "
    "to go on as whoever this browser is logged in as now, or to log in again")
# a JSON body is read for its session id only up to this size (component values are small;
# the request body limit outside caps every body anyway)
MAX_JSON_BODY = 8 * 1024 * 1024


def remember_login(session_hash: str | None, token: str) -> None:
    """Bind the UI session `session_hash` to the login `token` (a login, a reload's restore)."""
    if not session_hash:
        return
    with _lock:
        _logins.pop(session_hash, None)
        if len(_logins) >= MAX_SESSIONS:
            del _logins[next(iter(_logins))]
        _logins[session_hash] = token


def forget_login(session_hash: str | None) -> None:
    """The UI session `session_hash` logged out (or its page closed)."""
    if session_hash:
        with _lock:
            _logins.pop(session_hash, None)


def login_of(session_hash: str | None) -> str | None:
    return _logins.get(session_hash) if session_hash else None


def _query_sessions(scope: Scope) -> list[str]:
    """Every `session_hash` value of the query: a route reads one of them (Starlette hands a
    handler the last), so all of them are checked."""
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
    return query.get("session_hash") or []


def _body_sessions(body: bytes) -> list[str]:
    """Every top-level `session_hash` string of a JSON body (a key given twice: both)."""
    try:
        data = json.loads(body, object_pairs_hook=lambda pairs: pairs)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return []
    if not isinstance(data, list):
        return []
    return [value for pair in data if isinstance(pair, tuple) and len(pair) == 2
            and pair[0] == "session_hash" and isinstance(value := pair[1], str)]


def _json_body(scope: Scope) -> bool:
    """Whether a request's body is parsed as JSON by the routes under it: FastAPI reads a body
    without a content type, and any application/json or application/*+json, as JSON."""
    kind = content_type(scope)
    return scope.get("method") in BODY_METHODS and (
        kind in ("", "application/json") or (kind.startswith("application/")
                                             and kind.endswith("+json")))


def _may_act_for_all(sessions: list[str], scope: Scope) -> bool:
    """Whether this request may act for every UI session it names (blocking: queries). The
    caller's token is read once, and only when a named session is logged in."""
    caller: Any = _UNREAD
    for session_hash in dict.fromkeys(sessions):
        login = login_of(session_hash)
        if login is None:  # no login: the login box's own events
            continue
        owner = authenticated(login)
        if owner is None:
            # its login ended under the page: passed on, each handler said "invalid or
            # revoked token" beside a header still saying "Logged in as", vote after vote.
            # Unbound by the refused event (the page script reloads on that one), not by its
            # heartbeat or stream, which the script does not hear
            if scope.get("path", "").endswith("/queue/join"):
                forget_login(session_hash)
            return False
        if caller is _UNREAD:
            caller = authenticated(request_token(scope))
        if caller is None or caller.id != owner.id:
            return False
    return True


_UNREAD = object()  # the caller not authenticated yet


class UiSessionGuard:
    """ASGI middleware: a request under `ui_path` that names a logged-in UI session needs a
    token of that session's user (its browser's session cookie); see the module doc."""

    def __init__(self, app: ASGIApp, ui_path: str = UI_PATH) -> None:
        self.app, self.ui_path = app, ui_path.rstrip("/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = re.sub(r"/{2,}", "/", scope.get("path", "")) if scope["type"] == "http" else ""
        if not path.startswith(self.ui_path + "/") or not _logins:
            await self.app(scope, receive, send)
            return
        sub = path[len(self.ui_path):]
        # every place a route may read the session from: the path, each query value, the
        # JSON body's (Gradio's queue/join reads the body's even when the query names another)
        found = _PATH_SESSION.match(sub)
        sessions = [found.group(1)] if found else []
        sessions += _query_sessions(scope)
        if _json_body(scope):
            body, receive = await _buffered(receive)
            if len(body) > MAX_JSON_BODY:  # too large to read for its session: not passed on
                response = JSONResponse({"detail": f"a UI request's JSON body may hold at most "
                                                   f"{MAX_JSON_BODY} bytes"}, status_code=413)
                await response(scope, receive, send)
                return
            sessions += _body_sessions(body)
        if sessions and not await run_in_threadpool(_may_act_for_all, sessions, scope):
            response = unauthorized(SESSION_NOT_THIS_BROWSERS)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def _buffered(receive: Receive) -> tuple[bytes, Receive]:
    """The request's whole body, and a `receive` that hands it to the app again."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return body, replay
