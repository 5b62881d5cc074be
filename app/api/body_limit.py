"""The size limit on every request body, enforced before the body is read whole.

A declared `Content-Length` over the limit is answered 413 before a byte of the body is read.
A body sent without one (chunked) is counted as it arrives, and the request is cut off with
a 413 as soon as it passes the limit: neither FastAPI (which reads a JSON or form body before
it checks the token) nor Gradio (whose queue keeps what it was sent) ever holds more than the
limit of one request.

The limits: a dataset upload (`POST /api/datasets`, and a file sent to the UI, which only the
Datasets page does) may be MAX_UPLOAD_BYTES plus the multipart form around the file; every
other body (votes, job configs, the UI's events) MAX_REQUEST_BYTES.
"""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.media import takes_files
from app.config import UI_PATH, Settings

# what a multipart body may hold beyond the file (the other fields, part headers, boundaries)
FORM_OVERHEAD = 1024 * 1024
# the routes whose body is a dataset upload (method, path)
UPLOAD_ROUTES = {("POST", "/api/datasets")}


class BodyTooLarge(Exception):
    """Raised from `receive` when a body passes its limit (the request is answered 413)."""


def body_limit(scope: Scope, settings: Settings, ui_path: str = UI_PATH) -> tuple[int, str, bool]:
    """The largest body this request may send, the setting that says so, and whether it is
    an upload (whose route checks a declared size itself, after the caller: a 401 comes
    before a 413 there)."""
    path = scope["path"]
    if ((scope.get("method", "GET"), path.rstrip("/")) in UPLOAD_ROUTES
            or (path.startswith(ui_path + "/") and takes_files(scope))):
        return settings.max_upload_bytes + FORM_OVERHEAD, "MAX_UPLOAD_BYTES", True
    return settings.max_request_bytes, "MAX_REQUEST_BYTES", False


def _too_large(limit: int, setting: str, size: int | None = None) -> JSONResponse:
    sent = f" ({size} bytes)" if size is not None else ""
    message = f"the request body{sent} is larger than the limit of {limit} bytes ({setting})"
    return JSONResponse({"detail": f"body: {message}", "field": "body",
                         "errors": [{"field": "body", "message": message}]},
                        status_code=413, headers={"Connection": "close"})


class RequestBodyLimit:
    """ASGI middleware: a 413 for a body over `body_limit`, declared or counted."""

    def __init__(self, app: ASGIApp, settings: Settings, ui_path: str = UI_PATH) -> None:
        self.app, self.settings, self.ui_path = app, settings, ui_path.rstrip("/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, setting, upload = body_limit(scope, self.settings, self.ui_path)
        declared = next((v for k, v in scope.get("headers", []) if k == b"content-length"), b"")
        if not upload and declared.isdigit() and int(declared) > limit:
            await _too_large(limit, setting, int(declared))(scope, receive, send)
            return

        received, cut_off, answered = 0, False, False

        async def counted_receive() -> Message:
            nonlocal received, cut_off
            if cut_off:  # whoever asks again after the cut is told the client has gone
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    cut_off = True
                    raise BodyTooLarge
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal answered
            if cut_off:  # the app's own answer to the cut (a 400 or a 500) is replaced
                return
            answered = answered or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except Exception:
            if not cut_off:
                raise
        if cut_off and not answered:
            await _too_large(limit, setting)(scope, receive, send)
