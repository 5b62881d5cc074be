"""Issue 14: every route the app mounts, the Gradio UI's included, walked with no token and with
an annotator's token. No byte of a stored file leaves the server without a valid token (by any
route, with any spelling of its path), every /api route but a few public ones needs a token,
and the admin-only actions refuse annotators. A route added later fails `test_every_route` until
it is classified in ROUTES below."""

from __future__ import annotations

import base64
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote

import anyio
import httpx
import pytest
from fastapi.testclient import TestClient
from route_walk import mounted_routes

TIMEOUT_S = 1.0  # Gradio's event streams (heartbeat, dev reload) never end by themselves
# every other route answers; on a loaded CI box a first call (lazy imports) can take seconds
ANSWER_TIMEOUT_S = 60.0
STREAMS = ("heartbeat", "dev/reload", "/stream/", "queue/data", "upload_progress", "/call/")

# --- how each mounted route is classified ----------------------------------------------------
PUBLIC = "public"  # no token needed (docs, health, forgetting the session cookie)
USER = "user"  # any valid token
ADMIN = "admin"  # admins only: an annotator gets 403
FILE = "file"  # returns stored bytes: a valid token (header, or the UI's session cookie)
UI = "ui"  # the Gradio shell: may load without a token, never with a stored byte in it
UI_FILE = "ui-file"  # Gradio routes that serve or take files: refused without a token
UI_UPLOAD = "ui-upload"  # Gradio's file upload: refused without a token, 403 for an annotator
UI_REFUSED = "ui-refused"  # what the UI does not offer (deep links, the programmatic API): 404

ROUTES: dict[str, str] = {
    "GET /openapi.json": PUBLIC, "HEAD /openapi.json": PUBLIC,
    "GET /docs": PUBLIC, "HEAD /docs": PUBLIC,
    "GET /docs/oauth2-redirect": PUBLIC, "HEAD /docs/oauth2-redirect": PUBLIC,
    "GET /redoc": PUBLIC, "HEAD /redoc": PUBLIC,
    # the docs pages' scripts and styles (app/docs.py)
    "GET /docs/assets/swagger-ui-bundle.js": PUBLIC, "GET /docs/assets/swagger-ui.css": PUBLIC,
    "GET /docs/assets/redoc.standalone.js": PUBLIC,
    "GET /healthz": PUBLIC,
    "GET /favicon.ico": PUBLIC,  # the studio's icon, no user data
    "DELETE /api/auth/session": PUBLIC,  # logging out needs no token (it only clears a cookie)
    "GET /api/auth/me": USER,
    "POST /api/auth/session": USER,
    "POST /api/datasets": ADMIN,
    "GET /api/datasets": USER,
    "GET /api/datasets/{dataset_id}": USER,
    "GET /api/datasets/{dataset_id}/export": USER,
    "HEAD /api/datasets/{dataset_id}/export": USER,
    "DELETE /api/datasets/{dataset_id}": ADMIN,
    "GET /api/prompts": USER,
    "GET /api/rollouts": USER,
    "GET /api/rollouts/{group_id}": USER,
    "GET /api/media/{path:path}": FILE, "HEAD /api/media/{path:path}": FILE,
    "GET /api/votes/next": USER,
    "POST /api/votes": USER,
    "GET /api/votes/export": USER,
    "HEAD /api/votes/export": USER,
    "POST /api/jobs": ADMIN,
    "GET /api/jobs": USER,
    "GET /api/jobs/config-schema": USER,
    "GET /api/models": USER,
    "GET /api/jobs/{job_id}": USER,
    "POST /api/jobs/{job_id}/cancel": ADMIN,
    "POST /api/jobs/{job_id}/resume": ADMIN,
    "GET /api/checkpoints": USER,
    "GET /api/checkpoints/{checkpoint_id}": USER,
    "GET /api/checkpoints/{checkpoint_id}/download": FILE,
    "HEAD /api/checkpoints/{checkpoint_id}/download": FILE,
    "GET /api/leaderboard": USER,
    "GET /api/preference-models": USER,
    "GET /api/preference-models/{version}/download": FILE,
    "HEAD /api/preference-models/{version}/download": FILE,
    "GET /api/annotators": ADMIN,
    "POST /api/users": ADMIN,
    "GET /api/users": ADMIN,
    "POST /api/users/{user_id}/revoke": ADMIN,
    "POST /api/users/{user_id}/token": ADMIN,
    "PATCH /api/users/{user_id}": ADMIN,
}
_UI_SHELL = """
GET /ui/openapi.json|HEAD /ui/openapi.json|POST /ui/login/|POST /ui/login|GET /ui/logout
GET /ui/svelte/{path:path}|GET /ui/|HEAD /ui/|GET /ui/config
GET /ui/config/|GET /ui/static/{path:path}|GET /ui/assets/{path:path}|GET /ui/favicon.ico
GET /ui/theme.css|GET /ui/robots.txt|GET /ui/pwa_icon/{size}|GET /ui/pwa_icon|GET /ui/manifest.json
GET /ui/monitoring|GET /ui/monitoring/summary|GET /ui/monitoring/{key}|GET /ui/gradio_api/user/
GET /ui/gradio_api/user|GET /ui/gradio_api/login_check/|GET /ui/gradio_api/login_check
GET /ui/gradio_api/token/|GET /ui/gradio_api/token|GET /ui/gradio_api/app_id/
GET /ui/gradio_api/app_id|GET /ui/gradio_api/dev/reload|GET /ui/gradio_api/runs/
GET /ui/gradio_api/runs|GET /ui/gradio_api/info|GET /ui/gradio_api/info/
GET /ui/gradio_api/openapi.json|POST /ui/gradio_api/reset|POST /ui/gradio_api/reset/
GET /ui/gradio_api/heartbeat/{session_hash}
POST /ui/gradio_api/queue/join|POST /ui/gradio_api/cancel
GET /ui/gradio_api/queue/data|POST /ui/gradio_api/component_server/
POST /ui/gradio_api/component_server|GET /ui/gradio_api/queue/status
GET /ui/gradio_api/startup-events|GET /ui/gradio_api/theme.css
POST /ui/gradio_api/process_recording|POST /ui/gradio_api/vibe-edit|POST /ui/gradio_api/vibe-edit/
POST /ui/gradio_api/undo-vibe-edit|POST /ui/gradio_api/undo-vibe-edit/|GET /ui/gradio_api/vibe-code
GET /ui/gradio_api/vibe-code/|POST /ui/gradio_api/vibe-code|POST /ui/gradio_api/vibe-code/
POST /ui/gradio_api/vibe-starter-queries|POST /ui/gradio_api/vibe-starter-queries/
"""
_UI_FILES = """
POST /ui/gradio_api/run-history/connect|GET /ui/gradio_api/run-history/buckets
GET /ui/gradio_api/run-history/records
GET /ui/gradio_api/run-history/records/{endpoint}/{record_id}/assets/{asset_id}
GET /ui/gradio_api/custom_component/{id}/{environment}/{type}/{file_name}
GET /ui/gradio_api/proxy={url_path:path}|HEAD /ui/gradio_api/proxy={url_path:path}
GET /ui/gradio_api/file={path_or_url:path}|HEAD /ui/gradio_api/file={path_or_url:path}
POST /ui/gradio_api/stream/{event_id}|POST /ui/gradio_api/stream/{event_id}/close
GET /ui/gradio_api/stream/{session_hash}/{run}/{component_id}/playlist.m3u8
GET /ui/gradio_api/stream/{session_hash}/{run}/{component_id}/{segment_id}.{ext}
GET /ui/gradio_api/stream/{session_hash}/{run}/{component_id}/playlist-file
GET /ui/gradio_api/file/{path:path}|GET /ui/gradio_api/upload_progress
"""
_UI_REFUSED = """
GET /ui/gradio_api/deep_link|POST /ui/gradio_api/api/{api_name}/
POST /ui/gradio_api/api/{api_name}|POST /ui/gradio_api/run/{api_name}/
POST /ui/gradio_api/run/{api_name}|POST /ui/gradio_api/call/v2/{api_name}/
POST /ui/gradio_api/call/v2/{api_name}|POST /ui/gradio_api/call/{api_name}/
POST /ui/gradio_api/call/{api_name}
GET /ui/gradio_api/call/{api_name}/{event_id}|GET /ui/gradio_api/call/v2/{api_name}/{event_id}
"""
for _text, _kind in ((_UI_SHELL, UI), (_UI_FILES, UI_FILE), (_UI_REFUSED, UI_REFUSED)):
    ROUTES.update({key.strip(): _kind for key in _text.replace("\n", "|").split("|")
                   if key.strip()})
ROUTES["POST /ui/gradio_api/upload"] = UI_UPLOAD

# paths that no route mounts, tried anyway: the spellings older Gradio versions served files by
EXTRA_FILE_URLS = ["/ui/file={p}", "/ui/file/{p}", "/ui//file={p}", "/ui/gradio_api//file={p}",
                   "/file={p}", "/gradio_api/file={p}", "/ui/static/{p}", "/ui/assets/{p}"]
PATH_PARAMS = ("path", "path_or_url", "url_path", "file_name")


# --- a raw ASGI call with a time limit (TestClient would wait forever on an event stream) -----
@dataclass
class Answer:
    status: int
    body: bytes
    headers: dict[str, str]


async def _asgi(app, request: httpx.Request, timeout: float, state: dict) -> Answer:
    body = request.read()
    raw_path = request.url.raw_path.decode()
    path, _, query = raw_path.partition("?")
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": request.method, "scheme": "http",
             "path": unquote(path), "raw_path": path.encode(), "query_string": query.encode(),
             "root_path": "", "client": ("testclient", 50000), "server": ("testserver", 80),
             "headers": [(k.lower().encode(), v.encode()) for k, v in request.headers.items()],
             "extensions": {}, "state": dict(state)}
    status, chunks, headers = 0, [], {}
    sent = False
    done = anyio.Event()

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
            headers.update({k.decode().lower(): v.decode() for k, v in message["headers"]})
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    with anyio.move_on_after(timeout):
        try:
            await app(scope, receive, send)
        except Exception:  # the error middleware has answered 500 already, or nothing at all
            status = status or 500
    done.set()
    return Answer(status or 599, b"".join(chunks), headers)


class Caller:
    def __init__(self, client: TestClient) -> None:
        self.client = client

    def __call__(self, method: str, url: str, headers: dict[str, str] | None = None,
                 **kw) -> Answer:
        request = httpx.Request(method, "http://testserver" + url, headers=headers or {}, **kw)
        timeout = TIMEOUT_S if any(s in url for s in STREAMS) else ANSWER_TIMEOUT_S
        return self.client.portal.call(_asgi, self.client.app, request, timeout,
                                       self.client.app_state)


# --- the world: rows of every kind, and stored files of every kind ----------------------------
@dataclass
class World:
    call: Caller
    admin: dict[str, str]
    annotator: dict[str, str]
    annotator_token: str
    ids: dict[str, int]
    files: dict[str, bytes]  # path relative to STORAGE_DIR -> content
    storage: Path


@pytest.fixture
def world(db_url, tmp_path, monkeypatch, make_user, make_group) -> World:
    from sqlalchemy import select

    from app import db
    from app.config import get_settings
    from app.db import session_scope
    from app.main import create_app
    from app.models import Sample
    from app.services.checkpoints import record_checkpoint
    from app.services.preference import record_model
    from app.services.storage import write_bytes

    # (the `settings` fixture under make_user has emptied the database) the production layout:
    # STORAGE_DIR unset means ./data/storage, relative to the server's working directory
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DATA_DIR", "data")
    monkeypatch.delenv("STORAGE_DIR", raising=False)
    monkeypatch.delenv("MODELS_DIR", raising=False)
    get_settings.cache_clear()
    settings = get_settings()
    db.configure(settings)
    admin, annotator = make_user("alice", "admin"), make_user("bob", "annotator")

    app = create_app(settings, enqueuer=lambda job_id, kind: None, mount_ui=True)
    client = TestClient(app, raise_server_exceptions=False)
    client.__enter__()
    try:
        r = client.post("/api/datasets", headers=admin,
                        files={"file": ("p.txt", b"two red circles\none blue square\n",
                                        "text/plain")})
        assert r.status_code == 201, r.text
        dataset_id = r.json()["id"]
        r = client.post("/api/jobs", json={"kind": "train", "preset": "tiny"}, headers=admin)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        marker = f"SECRET-CKPT-{uuid.uuid4().hex}".encode()
        ckpt_rel = f"checkpoints/job-{job_id}/iter-000001/model.safetensors"
        write_bytes(ckpt_rel, marker)
        pref_rel = "preference/v1.safetensors"
        pref_bytes = f"SECRET-PREF-{uuid.uuid4().hex}".encode()
        write_bytes(pref_rel, pref_bytes)
        with session_scope() as s:
            ckpt_id = record_checkpoint(s, job_id, 1, ckpt_rel)
            record_model(s, version=1, path=pref_rel, report={})
        group_id = make_group(job_id, g=3, checkpoint_id=ckpt_id)
        make_group(None, g=3, seed=1)
        with session_scope() as s:
            samples = list(s.execute(select(Sample.id, Sample.image_path).order_by(Sample.id)))
        images = [path for _, path in samples]
        files = {rel: (settings.resolved_storage_dir / rel).read_bytes() for rel in images}
        files[ckpt_rel], files[pref_rel] = marker, pref_bytes
        yield World(Caller(client), admin, annotator,
                    annotator["Authorization"].partition(" ")[2],
                    {"dataset_id": dataset_id, "job_id": job_id, "checkpoint_id": ckpt_id,
                     "group_id": group_id, "version": 1, "sample_a": samples[0][0],
                     "sample_b": samples[1][0]},
                    files, settings.resolved_storage_dir)
    finally:
        client.__exit__(None, None, None)
        get_settings.cache_clear()


def file_spellings(world: World, rel: str) -> list[str]:
    """Every way to name one stored file: absolute, relative to the storage dir, relative to
    the server's cwd (`data/storage/...`), with `..` in it, and as a file:// URL."""
    full = world.storage / rel
    return [str(full), rel, os.path.relpath(full), f"data/../data/storage/{rel}",
            f"./{os.path.relpath(full)}", f"file://{full}", str(full).replace("/", "//", 1)]


def stored_bytes_in(world: World, body: bytes) -> list[str]:
    """The stored files whose content (raw or base64) is in `body`."""
    return [rel for rel, data in world.files.items()
            if body and (data in body or base64.b64encode(data) in body)]


def fill(path: str, world: World, file_value: str) -> str:
    def one(m: re.Match) -> str:
        name = m.group(1).split(":")[0]
        if name in world.ids:
            return str(world.ids[name])
        if name in PATH_PARAMS:
            return quote(file_value, safe="/:")
        return {"size": "192", "ext": "ts"}.get(name, "x")

    return re.sub(r"\{([^}]+)\}", one, path)


def request_kw(key: str, world: World) -> dict:
    """A valid body for the routes that take one (so that a refusal is about the caller)."""
    if key == "POST /api/datasets":
        return {"files": {"file": ("q.txt", b"a green triangle\n", "text/plain")}}
    if key == "POST /api/jobs":
        return {"json": {"kind": "train", "preset": "tiny"}}
    if key == "POST /api/users":
        return {"json": {"name": f"eve-{uuid.uuid4().hex[:6]}", "role": "admin"}}
    if key == "POST /api/votes":
        return {"json": {"client_vote_id": uuid.uuid4().hex, "outcome": "a",
                         "sample_a_id": world.ids["sample_a"],
                         "sample_b_id": world.ids["sample_b"]}}
    if key.startswith("POST /ui/gradio_api/upload"):
        return {"files": {"files": ("x.png", next(iter(world.files.values())), "image/png")}}
    if key.startswith("POST /ui/"):
        return {"json": {"data": [], "fn_index": 0, "session_hash": "x", "event_data": None}}
    return {}


def probes(key: str, world: World) -> list[str]:
    """The URLs to call for a route: one per spelling of every stored file if it takes a path."""
    path = key.split(" ", 1)[1]
    if not any(f"{{{p}" in path for p in PATH_PARAMS):
        return [fill(path, world, "x")]
    if key.endswith(" /api/media/{path:path}"):  # its own valid spellings are relative paths
        return [fill(path, world, v) for rel in world.files for v in file_spellings(world, rel)]
    return [fill(path, world, v) for rel in world.files for v in file_spellings(world, rel)[:4]]


def assert_every_route_classified(app) -> set[str]:
    """The app's mounted routes ("METHOD /path"), each of them classified in ROUTES."""
    mounted = {f"{m} {p}" for m, p in mounted_routes(app.routes)}
    unclassified = mounted - set(ROUTES)
    assert not unclassified, f"classify these new routes in ROUTES: {sorted(unclassified)}"
    assert not set(ROUTES) - mounted, f"gone: {sorted(set(ROUTES) - mounted)}"
    return mounted


def test_every_route_is_classified(settings):
    """The fast loop's share of the walk below: a route added to the app (or to Gradio's
    mount by an upgrade) fails `make check` until ROUTES says who may call it."""
    from app.main import create_app

    assert_every_route_classified(create_app(settings, enqueuer=lambda job_id, kind: None,
                                             mount_ui=True))


def test_every_route(world):
    call = world.call
    mounted = assert_every_route_classified(world.call.client.app)

    problems: list[str] = []
    tested: set[str] = set()
    for key, kind in ROUTES.items():
        method = key.split(" ", 1)[0]
        for url in probes(key, world):
            kw = request_kw(key, world)
            for who, headers in (("no token", {}), ("bogus token", {
                    "Authorization": "Bearer nope", "Cookie": "ngs_session=nope"})):
                r = call(method, url, headers, **kw)
                leaked = stored_bytes_in(world, r.body)
                if leaked:
                    problems.append(f"{who}: {method} {url} -> {r.status} LEAKS {leaked}")
                if kind == PUBLIC and who == "no token" and not 200 <= r.status < 400:
                    problems.append(f"{who}: {method} {url} -> {r.status} (public)")
                if kind in (USER, ADMIN, FILE) and r.status != 401:
                    problems.append(f"{who}: {method} {url} -> {r.status} (want 401)")
                if kind == UI_UPLOAD and r.status != 401:
                    problems.append(f"{who}: {method} {url} -> {r.status} (want 401)")
                if kind == UI_REFUSED and r.status != 404:
                    problems.append(f"{who}: {method} {url} -> {r.status} (want 404)")
                if kind == UI_FILE and r.status not in (401, 403, 404):
                    problems.append(f"{who}: {method} {url} -> {r.status} (want 401/403/404)")
            tested.add(key)

            r = call(method, url, world.annotator, **request_kw(key, world))
            if kind == UI_REFUSED and r.status != 404:
                problems.append(f"annotator: {method} {url} -> {r.status} (want 404)")
            if kind in (ADMIN, UI_UPLOAD) and r.status != 403:
                problems.append(f"annotator: {method} {url} -> {r.status} (want 403)")
            # Gradio's file routes are the Datasets page's (admins): refused to an annotator
            # (a spelling with ../ that the client folds into another path finds no route)
            if kind == UI_FILE and r.status not in (403, 404):
                problems.append(f"annotator: {method} {url} -> {r.status} (want 403)")
            if kind in (USER, FILE) and (r.status in (401, 403) or r.status >= 500):
                problems.append(f"annotator: {method} {url} -> {r.status}")
            if kind in (UI, UI_FILE, UI_UPLOAD, UI_REFUSED) and stored_bytes_in(world, r.body):
                # stored files reach the page through /api/media only, never through Gradio
                problems.append(f"annotator: {method} {url} -> {r.status} LEAKS "
                                f"{stored_bytes_in(world, r.body)}")

    for template in EXTRA_FILE_URLS:  # spellings no route mounts: still never a stored byte
        for rel in world.files:
            for value in file_spellings(world, rel):
                url = template.format(p=quote(value, safe="/:"))
                for method in ("GET", "HEAD"):
                    r = call(method, url)
                    if stored_bytes_in(world, r.body) or 200 <= r.status < 300:
                        problems.append(f"no token: {method} {url} -> {r.status}")

    assert tested == mounted, sorted(mounted ^ tested)
    assert not problems, "\n".join(problems)


def test_stored_files_with_a_token(world):
    """What the routes are for: the stored bytes come back to a valid token, by header or by the
    UI's session cookie, and the cookie alone does nothing but read files."""
    call = world.call
    image = next(rel for rel in world.files if rel.endswith(".png"))
    r = call("GET", f"/api/media/{image}", world.annotator)
    assert r.status == 200 and r.body == world.files[image]
    r = call("GET", f"/api/checkpoints/{world.ids['checkpoint_id']}/download", world.annotator)
    assert r.status == 200 and r.body == world.files[next(f for f in world.files
                                                          if f.startswith("checkpoints/"))]

    cookie = {"Cookie": f"ngs_session={world.annotator_token}"}
    r = call("GET", f"/api/media/{image}", cookie)
    assert r.status == 200 and r.body == world.files[image]
    r = call("GET", f"/api/checkpoints/{world.ids['checkpoint_id']}/download", cookie)
    assert r.status == 200
    for bad in ("ngs_session=bogus", "ngs_session=", f"other={world.annotator_token}"):
        r = call("GET", f"/api/media/{image}", {"Cookie": bad})
        assert r.status == 401 and not stored_bytes_in(world, r.body), bad
    # the cookie is not a token for anything else: no action, no data beyond stored files
    assert call("GET", "/api/auth/me", cookie).status == 401
    assert call("POST", "/api/votes", cookie, **request_kw("POST /api/votes", world)).status == 401
    # and Gradio's file routes stay shut to it too: stored files come from /api/media only
    for value in file_spellings(world, image)[:3]:
        r = call("GET", f"/ui/gradio_api/file={quote(value, safe='/:')}", cookie)
        assert not stored_bytes_in(world, r.body), (value, r.status)


def test_session_cookie_login_and_logout(world):
    """The cookie holds a session of its own, never the API token (a copied cookie was a
    permanent token, and logging out left it valid): it reads stored files until logout
    revokes it, and logging out leaves the API token alone."""
    call = world.call
    image = next(rel for rel in world.files if rel.endswith(".png"))
    r = call("POST", "/api/auth/session", world.annotator)
    assert r.status == 200
    set_cookie = r.headers.get("set-cookie", "")
    session_token = re.match(r"ngs_session=([^;]+);", set_cookie).group(1)
    assert session_token != world.annotator_token and world.annotator_token not in set_cookie
    assert "httponly" in set_cookie.lower() and "samesite=strict" in set_cookie.lower()
    assert "max-age=604800" in set_cookie.lower()
    cookie = {"Cookie": f"ngs_session={session_token}"}
    assert call("GET", f"/api/media/{image}", cookie).status == 200
    # the session's token is the browser's cookie, not a credential: as a bearer token it
    # mints no new session (which logging out would not end) and reaches no API route
    as_bearer = {"Authorization": f"Bearer {session_token}"}
    for method, path in (("POST", "/api/auth/session"), ("GET", "/api/auth/me"),
                         ("GET", "/api/jobs"), ("GET", f"/api/media/{image}")):
        r = call(method, path, as_bearer)
        assert r.status == 401 and b"session" in r.body, (method, path, r.body)
    assert call("POST", "/api/auth/session").status == 401
    assert call("POST", "/api/auth/session", {"Authorization": "Bearer nope"}).status == 401
    # a cookie holding an API token (set by hand) is not a session: logout does not revoke it
    r = call("DELETE", "/api/auth/session", {"Cookie": f"ngs_session={world.annotator_token}"})
    assert r.status == 204
    assert call("GET", "/api/auth/me", world.annotator).status == 200
    r = call("DELETE", "/api/auth/session", cookie)
    assert r.status == 204
    assert re.match(r'ngs_session=("")?;', r.headers.get("set-cookie", ""))
    r = call("GET", f"/api/media/{image}", cookie)
    assert r.status == 401 and not stored_bytes_in(world, r.body)
    assert call("GET", "/api/auth/me", world.annotator).status == 200
    # a session past its expiry reads nothing either
    from datetime import timedelta

    from sqlalchemy import update

    from app.db import session_scope
    from app.models import ApiToken, utcnow
    from app.services import auth

    r = call("POST", "/api/auth/session", world.annotator)
    fresh = {"Cookie": re.match(r"(ngs_session=[^;]+);", r.headers["set-cookie"]).group(1)}
    assert call("GET", f"/api/media/{image}", fresh).status == 200
    with session_scope() as s:
        s.execute(update(ApiToken).where(ApiToken.is_session.is_(True))
                  .values(expires_at=utcnow() - timedelta(seconds=1)))
    auth.token_cache.clear()
    assert call("GET", f"/api/media/{image}", fresh).status == 401
