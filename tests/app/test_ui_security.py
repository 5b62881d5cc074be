"""The UI's security rules, each driven the way an attacker would: a forged Gradio file
payload naming a server path, a revoked admin's open session (and an annotator whose session
state claims "admin"), and Gradio routes that take a body without a token."""

from __future__ import annotations

import asyncio
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from route_walk import mounted_routes

# app.ui imports gradio (about 4 s): each test imports the handlers it needs, as in
# tests/app/test_ui_handlers.py


def _token(headers: dict[str, str]) -> dict[str, str]:
    return {"token": headers["Authorization"].split(" ", 1)[1]}


def _dataset_count() -> int:
    from app.db import session_scope
    from app.services import datasets

    with session_scope() as s:
        return datasets.list_datasets(s, limit=10)[1]


@pytest.fixture
def upload_dir(tmp_path, monkeypatch) -> Path:
    """Gradio's upload folder for this test (GRADIO_TEMP_DIR, as Gradio reads it)."""
    folder = tmp_path / "gradio-uploads"
    folder.mkdir()
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(folder))
    return folder


@pytest.fixture
def secret(tmp_path) -> Path:
    """A server file no one uploaded."""
    path = tmp_path / "server-only" / "secret.txt"
    path.parent.mkdir()
    path.write_text("the server's secret line\n")
    return path


def _error(status: str) -> str:
    return re.sub(r"<[^>]+>", "", status)


# --- 1: the dataset upload reads only what was uploaded ---------------------------------------
def test_upload_reads_only_files_in_the_upload_folder(settings, admin, upload_dir, secret):
    from app.ui import datasets

    user = _token(admin)
    inside = upload_dir / "0123abcd"
    inside.mkdir()
    link = inside / "prompts.txt"
    link.symlink_to(secret)  # inside the folder by name, outside it once resolved
    for path in (str(secret), str(link), f"{upload_dir}/../server-only/secret.txt"):
        status, *_ = datasets.upload(user, path, "", 0.0, 0)
        text = _error(status)
        assert 'id="dataset-error"' in status
        assert "not uploaded through this page" in text, text
        assert str(secret.parent) not in text and str(upload_dir) not in text
    # a missing file, in the folder or not: the same kind of answer, never the path
    for path in (str(inside / "gone.txt"), str(secret.parent / "nothing-here.txt")):
        text = _error(datasets.upload(user, path, "", 0.0, 0)[0])
        assert "FileNotFoundError" not in text and "/" not in text, text
    assert _dataset_count() == 0

    good = inside / "animals.txt"
    good.write_text("a red fox\nan owl at night\n")
    status, *_, picker, _ = datasets.upload(user, str(good), "", 0.0, 0)
    assert 'id="dataset-ok"' in status and "2 prompts" in status
    assert _dataset_count() == 1
    # the server's copy of the upload is gone once read (the dataset holds the prompts),
    # a refused one's too, and the picker is emptied; the symlink's target is untouched
    assert not good.exists() and picker is None
    bad = upload_dir / "4567cdef" / "broken.csv"
    bad.parent.mkdir()
    bad.write_text('prompt\n"an unclosed quote\n')
    status, *_, picker, _ = datasets.upload(user, str(bad), "", 0.0, 0)
    assert 'id="dataset-error"' in status and picker is None
    assert "Choose the file again" in status  # the picker is empty: a retry needs it
    assert not bad.exists() and not bad.parent.exists() and secret.exists()


def _mounted_blocks(settings):
    """The app as served, and the Gradio Blocks mounted in it at /ui."""
    from starlette.routing import Mount

    from app.main import create_app

    app = create_app(settings, enqueuer=lambda job_id, kind: None, mount_ui=True)
    mount = next(r for r in app.routes if isinstance(r, Mount) and r.path == "/ui")
    return app, mount.app.get_blocks()


def test_a_forged_file_payload_never_reaches_the_handler(settings, admin, upload_dir, secret):
    """What POST /ui/gradio_api/queue/join with {"path": "/any/server/file"} runs: the event's
    preprocessing on the mounted Blocks. Gradio refuses the path before the handler runs and
    copies nothing into its upload folder (a mounted app skipped that check, and the handler
    saw the secret as a file in the upload folder)."""
    from gradio.state_holder import SessionState

    from app.ui import datasets

    _, blocks = _mounted_blocks(settings)
    fn = next(f for f in blocks.fns.values() if f.fn is datasets.upload_form)
    state = SessionState(blocks)
    state[fn.inputs[0]._id] = _token(admin)  # the logged-in admin's gr.State
    forged = {"path": str(secret), "orig_name": "secret.txt",
              "meta": {"_type": "gradio.FileData"}}
    # in a thread of its own: the browser tests' Playwright keeps an event loop running in
    # this one
    with ThreadPoolExecutor(1) as pool, pytest.raises(Exception, match="not uploaded by a user"):
        pool.submit(asyncio.run, blocks.process_api(
            fn, [None, forged, "", 0.0, 0], state=state)).result()
    assert _dataset_count() == 0
    copied = [p for p in upload_dir.rglob("*") if p.is_file()]
    assert not copied, copied


# --- 2: every handler re-authenticates; the role in the session state is never trusted --------
def _revoked_admin(make_user, admin) -> dict[str, str]:
    from app.ui import annotators

    carol = _token(make_user("carol", "admin"))
    carol_id = next(i for label, i in annotators.account_choices(_token(admin))
                    if "carol" in label)
    assert "can no longer log in" in annotators.revoke_account(_token(admin), carol_id, True)
    return {**carol, "name": "carol", "role": "admin"}  # her browser's state, unchanged


def test_a_revoked_admins_open_session_gets_errors(settings, admin, make_user):
    import gradio as gr

    from app.ui import annotators, datasets, jobs, leaderboard, rollouts

    carol = _revoked_admin(make_user, admin)
    # the pickers' refreshes (outputs with no place for a message) show nothing and raise no
    # toast: the login area says the login ended, once (app.ui.login's check, and
    # tests/e2e/test_ui_login_ended.py in a browser)
    for handler in (jobs.job_choices, jobs.dataset_choices, rollouts.refresh_jobs):
        assert handler(carol) == gr.skip()
    timer, pick, dataset = jobs.on_login(carol)
    assert timer.active is False and pick == gr.skip() and dataset == gr.skip()
    board, pick, prompt_set = leaderboard.on_login(carol, 0)
    assert "invalid or revoked" in board and pick == gr.skip() and prompt_set == gr.skip()
    stats, admin_row, who, accounts, listing, revoke_who = annotators.on_login(carol)
    assert "invalid or revoked" in stats
    assert admin_row.visible is False and accounts.visible is False
    assert who == gr.skip() and revoke_who == gr.skip() and listing == ""
    listing, preview_pick = datasets.listing_for(carol)
    assert "invalid or revoked" in listing and preview_pick is None
    # and the page says what to do: the login ended under it
    assert "reload the page and log in again" in listing and "new token" in listing


def test_a_tab_opened_after_the_login_ended_logs_the_page_out_with_one_message(
        settings, admin, make_user):
    """Each tab a revoked admin opened showed red "Error" toasts (one per picker it refreshes)
    while the header still said "Logged in as": the tab's select now checks the login, and
    one that ended empties the session state, shows the login box and says why there."""
    import gradio as gr
    from starlette.requests import Request

    from app.ui import build_ui
    from app.ui.login import LOGIN_ENDED

    ui = build_ui()
    checks = [f for f in ui.fns.values() if getattr(f.fn, "__qualname__", "")
              == "Login.wire.<locals>.check"]
    tabs = {f.targets[0] for f in checks}
    assert len(checks) == len(tabs) == 6 and all(t[1] == "select" for t in tabs)
    request = gr.Request(request=Request({"type": "http", "method": "POST", "path": "/ui/",
                                          "headers": [], "query_string": b""}),
                         session_hash="probe-session")
    check = checks[0].fn
    # a login that holds, and no login: nothing changes
    assert all(v == gr.skip() for v in check(_token(admin), request))
    assert all(v == gr.skip() for v in check(None, request))
    state, status, box, logout, _, *pages, token = check(_revoked_admin(make_user, admin),
                                                         request)
    assert state is None and 'id="login-ended"' in status and LOGIN_ENDED in status
    assert box["visible"] is True and logout["visible"] is False and token == ""
    assert len(pages) == 6 and all(p["visible"] is False for p in pages)


def test_an_annotator_claiming_admin_in_the_session_state_gets_nothing(settings, annotator,
                                                                      make_group):
    """The pickers and lists are for admins by the server's word (the token's user), not the
    role the session state carries."""
    import gradio as gr

    from app.ui import annotators, datasets, jobs, leaderboard, rollouts

    make_group(g=2)
    forged = {**_token(annotator), "role": "admin"}
    assert jobs.job_choices(forged) == gr.skip() and jobs.dataset_choices(forged) == gr.skip()
    timer, pick, dataset = jobs.on_login(forged)
    assert timer.active is False and pick == gr.skip() and dataset == gr.skip()
    assert rollouts.refresh_jobs(forged) == gr.skip()
    assert leaderboard.on_login(forged, 0) == (gr.skip(), gr.skip(), gr.skip())
    stats, admin_row, who, *_ = annotators.on_login(forged)
    assert 'data-user="bob"' in stats and admin_row.visible is False and who == gr.skip()
    assert datasets.listing_for(forged) == ("", None)  # no list, no dataset to preview


# --- 3: Gradio routes that take files need a token; uploads are capped -------------------------
@pytest.fixture
def served(settings, monkeypatch):
    """The app with the UI mounted, MAX_UPLOAD_BYTES small, behind a TestClient."""
    from fastapi.testclient import TestClient

    from app.config import get_settings
    from app.ui import sessions

    monkeypatch.setenv("MAX_UPLOAD_BYTES", "2000")
    get_settings.cache_clear()
    # the process's session bindings: a test's "tab-a" bound to a token of an earlier test's
    # database is a login that has ended here
    monkeypatch.setattr(sessions, "_logins", {})
    app, blocks = _mounted_blocks(get_settings())
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, blocks


def _ui_post_routes(app) -> list[str]:
    """Every POST route mounted under /ui (path parameters filled in)."""
    return sorted({re.sub(r"\{[^}]+\}", "x", path) for method, path in mounted_routes(app.routes)
                   if method == "POST" and path.startswith("/ui/")})


def test_every_gradio_route_taking_a_file_needs_a_token(served, admin):
    from app.api.media import GRADIO_PROGRAMMATIC_API, GRADIO_UNUSED

    client, blocks = served
    posts = _ui_post_routes(client.app)
    assert "/ui/gradio_api/process_recording" in posts and "/ui/gradio_api/upload" in posts
    files = {"files": ("x.txt", b"a red fox\n", "text/plain")}
    for path in posts:
        # Gradio's programmatic API and the routes the UI never uses are refused to everyone
        # (404), before any token is read
        sub = path.removeprefix("/ui")
        refused = 404 if GRADIO_PROGRAMMATIC_API.match(sub) or GRADIO_UNUSED.match(sub) else 401
        r = client.post(path, files=files)
        assert r.status_code == refused, (path, r.status_code)
        r = client.post(path, content=b"raw bytes", headers={"Content-Type": "text/plain"})
        assert r.status_code == refused, (path, r.status_code)
    assert sum(bool(GRADIO_PROGRAMMATIC_API.match(p.removeprefix("/ui"))) for p in posts) >= 6
    # the recording route with a token: past the guard (Gradio answers for itself)
    r = client.post("/ui/gradio_api/process_recording", headers=admin,
                    files={"video": ("v.mp4", b"\0" * 10, "video/mp4")})
    assert r.status_code != 401
    # the public shell's JSON still works without one: the login box runs on the queue
    r = client.post("/ui/gradio_api/queue/join", json={
        "data": [], "fn_index": 0, "session_hash": "x", "event_data": None})
    assert r.status_code != 401


def _join(client, fn_index: int, data: list, session_hash: str, headers=None):
    return client.post("/ui/gradio_api/queue/join", headers=headers or {}, json={
        "data": data, "fn_index": fn_index, "session_hash": session_hash,
        "event_data": None, "trigger_id": None})


def _completed(client, session_hash: str, headers=None) -> dict:
    """The next finished event of the session, read from its queue/data stream."""
    import json

    with client.stream("GET", f"/ui/gradio_api/queue/data?session_hash={session_hash}",
                       headers=headers or {}) as stream:
        for line in stream.iter_lines():
            if line.startswith("data:"):
                message = json.loads(line[5:])
                if message.get("msg") == "process_completed":
                    return message
    raise AssertionError("the stream ended before the event finished")


def test_a_page_whose_login_another_tab_replaced_is_told_to_reload(served, admin, annotator):
    """A lead logged in as admin in one tab and as an annotator in another: the second login
    replaced the browser's session cookie, and every click of the first tab (Log out
    included) answered "this UI session is logged in from another browser: log in here",
    on a page that shows no login box. It names the other tab and the way out, a reload."""
    client, blocks = served
    fns = list(blocks.fns.values())
    login_fn = next(fn._id for fn in fns if fn.name == "login")
    logout_fn = next(fn._id for fn in fns if fn.name == "logout")
    token = admin["Authorization"].split(" ", 1)[1]
    first = client.post("/api/auth/session", headers=admin).cookies["ngs_session"]
    client.cookies.clear()
    tab_a = {"Cookie": f"ngs_session={first}"}
    assert _join(client, login_fn, [token, None], "tab-a", tab_a).status_code == 200
    assert _completed(client, "tab-a", tab_a)["success"] is True
    # tab B logs in as the annotator: the browser's cookie is now theirs
    second = client.post("/api/auth/session", headers=annotator).cookies["ngs_session"]
    now = {"Cookie": f"ngs_session={second}"}
    client.cookies.clear()
    for fn in (login_fn, logout_fn):
        r = _join(client, fn, [token, None] if fn == login_fn else [], "tab-a", now)
        assert r.status_code == 401, r.text
        detail = r.json()["detail"]
        assert "another tab" in detail and "Reload the page" in detail, detail
        assert "log in here" not in detail


def test_a_logged_in_ui_session_acts_only_for_its_own_browser(served, admin, annotator,
                                                               monkeypatch):
    """Gradio runs an event with the state of the session its request names, and the login
    keeps its token there: once logged in, the session id (which a log or a proxy may show)
    must not let another client join the queue, read the session's event stream or keep it
    alive. Its own browser (the session cookie set at login) goes on; so does anyone once the
    login is over (logged out, or its token revoked)."""
    client, blocks = served
    from app.ui.sessions import login_of

    fns = list(blocks.fns.values())
    login_fn = next(fn._id for fn in fns if fn.name == "login")
    logout_fn = next(fn._id for fn in fns if fn.name == "logout")
    token = admin["Authorization"].split(" ", 1)[1]
    r = client.post("/api/auth/session", headers=admin)  # what the login button's script does
    cookie = {"Cookie": f"ngs_session={r.cookies['ngs_session']}"}
    client.cookies.clear()  # each request below says what it carries
    assert _join(client, login_fn, [token, None], "victim", cookie).status_code == 200
    assert _completed(client, "victim", cookie)["success"] is True
    assert login_of("victim") == token

    other = client.post("/api/auth/session", headers=annotator).cookies["ngs_session"]
    client.cookies.clear()
    for headers in ({}, {"Cookie": f"ngs_session={other}"}, annotator,
                    {"Cookie": "ngs_session=forged"}):
        r = _join(client, login_fn, [token, None], "victim", headers)
        assert r.status_code == 401 and "another browser" in r.text, headers
        r = client.get("/ui/gradio_api/queue/data?session_hash=victim", headers=headers)
        assert r.status_code == 401, headers
        r = client.get("/ui/gradio_api/heartbeat/victim", headers=headers)
        assert r.status_code == 401, headers
        # the session named where the guard once did not look: the body beside another
        # query value (Gradio runs the body's), a repeated query value (Starlette hands the
        # route the last), a body naming it twice, a JSON body of another JSON media type
        r = client.post("/ui/gradio_api/queue/join?session_hash=mine", headers=headers, json={
            "data": [token, None], "fn_index": login_fn, "session_hash": "victim",
            "event_data": None, "trigger_id": None})
        assert r.status_code == 401 and "another browser" in r.text, headers
        r = client.get("/ui/gradio_api/queue/data?session_hash=mine&session_hash=victim",
                       headers=headers)
        assert r.status_code == 401, headers
        body = (f'{{"data": [], "fn_index": {login_fn}, "session_hash": "victim", '
                '"session_hash": "mine"}')
        for kind in ("application/json", "application/vnd.api+json"):
            r = client.post("/ui/gradio_api/queue/join", content=body,
                            headers={**headers, "Content-Type": kind})
            # (the other media type is a body the file guard holds to an admin's token)
            assert r.status_code in (401, 403), (headers, kind)
        # Gradio's programmatic API streams the events of the session an unknown event id
        # names: the UI offers no such API, to anyone
        r = client.get("/ui/gradio_api/call/anything/victim", headers=headers)
        assert r.status_code == 404 and "no programmatic API" in r.text, headers
    for path in ("/ui/gradio_api/call/anything/victim", "/ui/gradio_api/call/v2/x/victim"):
        assert client.get(path, headers=cookie).status_code == 404
    for path in ("/ui/gradio_api/run/predict", "/ui/gradio_api/api/predict",
                 "/ui/gradio_api/call/predict", "/ui/gradio_api/call/v2/predict"):
        r = client.post(path, headers=admin, json={"data": [], "session_hash": "victim"})
        assert r.status_code == 404 and "no programmatic API" in r.text, path
    # a body too large for the guard to read is refused, not passed on unread (the limit
    # lowered here: at its own size the request body limit outside answers first)
    from app.ui import sessions

    monkeypatch.setattr(sessions, "MAX_JSON_BODY", 1000)
    r = client.post("/ui/gradio_api/queue/join", content=b" " * 1001,
                    headers={**cookie, "Content-Type": "application/json"})
    assert r.status_code == 413 and "at most 1000 bytes" in r.text
    monkeypatch.undo()
    # a session no one logged into is the login box's: open to all, as before
    assert _join(client, login_fn, ["", None], "stranger").status_code == 200
    r = client.post("/ui/gradio_api/queue/join?session_hash=stranger", json={
        "data": ["", None], "fn_index": login_fn, "session_hash": "stranger",
        "event_data": None, "trigger_id": None})
    assert r.status_code == 200

    # its own browser logs out: the binding goes, and the cookie's session token is revoked
    assert _join(client, logout_fn, [], "victim", cookie).status_code == 200
    assert _completed(client, "victim", cookie)["success"] is True
    assert login_of("victim") is None
    assert client.get("/api/media/x.png", headers=cookie).status_code == 401
    assert _join(client, logout_fn, [], "victim").status_code == 200


def test_a_page_restored_from_a_login_that_ended_is_sent_to_reload(served, admin):
    """Log out in one tab revokes the session token the browser's other tabs were restored
    from (the cookie's). Their events went on to the handlers, each saying "invalid or revoked
    token" under a header still saying "Logged in as", vote after vote: now the first is
    refused with the answer the page script reloads on (to the login box), and the binding
    goes with it, so that a page that may not reload again yet still runs its events."""
    client, blocks = served
    from app.ui.sessions import SESSION_NOT_THIS_BROWSERS, login_of, remember_login

    fns = {fn.name: fn._id for fn in blocks.fns.values()}
    cookie_token = client.post("/api/auth/session", headers=admin).cookies["ngs_session"]
    cookie = {"Cookie": f"ngs_session={cookie_token}"}
    client.cookies.clear()
    # the second tab: its page load restores the login from the cookie
    assert _join(client, fns["restore"], [None], "tab2", cookie).status_code == 200
    assert _completed(client, "tab2", cookie)["success"] is True
    assert login_of("tab2") == cookie_token
    # the first tab logs out: the cookie's session token is revoked
    assert client.delete("/api/auth/session", headers=cookie).status_code == 204
    r = _join(client, fns["logout"], [], "tab2", cookie)
    assert r.status_code == 401 and r.json()["detail"] == SESSION_NOT_THIS_BROWSERS, r.text
    assert login_of("tab2") is None
    assert _join(client, fns["logout"], [], "tab2", cookie).status_code == 200
    # a heartbeat, which the page script does not hear, is refused without unbinding
    remember_login("tab3", cookie_token)
    assert client.get("/ui/gradio_api/heartbeat/tab3", headers=cookie).status_code == 401
    assert login_of("tab3") == cookie_token


def test_the_access_log_hides_ui_session_ids_in_paths_and_queries():
    import logging

    from app.serve import _RedactSessionIds

    for line, shown in (
            ("/ui/gradio_api/heartbeat/s3cr3t", "/heartbeat/... HTTP"),
            ("/ui/gradio_api/queue/data?session_hash=s3cr3t&x=1", "session_hash=...&x=1"),
            ("/ui/gradio_api/stream/s3cr3t/playlist.m3u8", "/stream/.../playlist")):
        # uvicorn's access record: (client, method, path with query, HTTP version, status)
        record = logging.LogRecord("uvicorn.access", logging.INFO, "", 0,
                                   '%s - "%s %s HTTP/%s" %d',
                                   ("127.0.0.1:5000", "GET", line, "1.1", 200), None)
        _RedactSessionIds().filter(record)
        assert "s3cr3t" not in record.getMessage() and shown in record.getMessage(), line


def test_gradio_deep_links_are_refused(served, admin):
    """Gradio saved a session's component values (the login box's token, the pages' tables)
    for anyone who named the session id, and loaded them for anyone holding the link."""
    client, _ = served
    for path in ("/ui/gradio_api/deep_link?session_hash=s1", "/ui/deep_link?session_hash=s1",
                 "/ui/config?deep_link=abc", "/ui/?deep_link=abc", "/ui/?page=x&deep_link="):
        for headers in ({}, admin):
            r = client.get(path, headers=headers)
            assert r.status_code == 404 and "deep links" in r.text, (path, r.status_code)
    assert client.get("/ui/").status_code == 200  # the shell itself stays public
    assert client.get("/ui/config").status_code == 200


def test_gradios_development_and_monitoring_routes_are_refused(served, admin):
    """/dev/reload answered anyone with an endless stream polling 20 times a second (200 open
    streams: 8x the server's idle CPU), /monitoring/summary anyone with the UI's event
    statistics: routes a mounted UI never uses."""
    client, _ = served
    for path in ("/ui/gradio_api/dev/reload", "/ui/dev/reload", "/ui/monitoring/summary",
                 "/ui/gradio_api/monitoring/summary", "/ui/monitoring",
                 "/ui/gradio_api/vibe-code"):
        for headers in ({}, admin):
            r = client.get(path, headers=headers)
            assert r.status_code == 404 and "not a route of this UI" in r.text, (path, r.text)
    r = client.post("/ui/gradio_api/vibe-edit", json={"prompt": "x"})
    assert r.status_code == 404 and "not a route of this UI" in r.text


def test_an_upload_is_read_back_by_admins_only(served, admin, annotator, upload_dir):
    """Gradio serves an uploaded file back (the picker's link) through file=: the Datasets
    page's, so an annotator's token gets a 403, not another admin's prompt file."""
    client, _ = served
    r = client.post("/ui/gradio_api/upload", headers=admin,
                    files={"files": ("private.txt", b"an unreleased prompt\n", "text/plain")})
    assert r.status_code == 200, r.text
    path = r.json()[0]
    r = client.get(f"/ui/gradio_api/file={path}", headers=annotator)
    assert r.status_code == 403 and b"unreleased" not in r.content
    r = client.get(f"/ui/gradio_api/file={path}", headers=admin)
    assert r.status_code == 200 and r.content == b"an unreleased prompt\n"


@pytest.fixture
def no_upload_folder_named(monkeypatch):
    """GRADIO_TEMP_DIR unset, as on a server whose operator named none (restored after)."""
    monkeypatch.setenv("GRADIO_TEMP_DIR", "placeholder")  # so that teardown restores it
    monkeypatch.delenv("GRADIO_TEMP_DIR")


def test_the_ui_keeps_uploads_in_a_folder_of_its_own(settings, admin, no_upload_folder_named):
    """Gradio's default upload folder, /tmp/gradio, is every Gradio app's on the host, and its
    file route served an admin whatever another app had left there. The studio's is its own
    (this user only), and file= serves only what was uploaded to it."""
    import os
    import shutil
    import stat
    import tempfile

    from fastapi.testclient import TestClient

    shared = Path(tempfile.gettempdir()) / "gradio" / "another-apps-upload"
    shared.mkdir(parents=True, exist_ok=True)
    theirs = shared / "their-prompts.txt"
    theirs.write_text("another app's prompt\n")
    app, _ = _mounted_blocks(settings)
    own = Path(os.environ["GRADIO_TEMP_DIR"])
    try:
        assert not own.resolve().is_relative_to(shared.parent.resolve())
        assert stat.S_IMODE(own.stat().st_mode) == 0o700
        with TestClient(app, raise_server_exceptions=False) as client:
            r = client.get(f"/ui/gradio_api/file={theirs}", headers=admin)
            assert r.status_code == 403 and b"another app" not in r.content
            r = client.post("/ui/gradio_api/upload", headers=admin,
                            files={"files": ("mine.txt", b"a red fox\n", "text/plain")})
            assert r.status_code == 200, r.text
            path = Path(r.json()[0])
            assert path.resolve().is_relative_to(own.resolve())
            r = client.get(f"/ui/gradio_api/file={path}", headers=admin)
            assert r.status_code == 200 and r.content == b"a red fox\n"
    finally:
        shutil.rmtree(shared, ignore_errors=True)
        shutil.rmtree(own, ignore_errors=True)


def test_a_file_of_a_refused_type_is_deleted_too(settings, admin, upload_dir):
    """The Datasets picker lists the types it takes; Gradio refuses another (dropped onto
    the picker, or sent by a script) before the handler runs, and its copy stayed in the
    upload folder. It goes, as every file the page reads does."""
    from gradio.state_holder import SessionState

    from app.ui import datasets

    _, blocks = _mounted_blocks(settings)
    fn = next(f for f in blocks.fns.values() if f.fn is datasets.upload_form)
    state = SessionState(blocks)
    state[fn.inputs[0]._id] = _token(admin)
    refused = upload_dir / "89abcdef" / "tool.exe"
    refused.parent.mkdir()
    refused.write_bytes(b"MZ not prompts")
    payload = {"path": str(refused), "orig_name": "tool.exe",
               "meta": {"_type": "gradio.FileData"}}
    with ThreadPoolExecutor(1) as pool, pytest.raises(Exception, match="Invalid file type"):
        pool.submit(asyncio.run, blocks.process_api(
            fn, [None, payload, "", 0.0, 0], state=state)).result()
    assert not refused.exists() and not refused.parent.exists()
    assert _dataset_count() == 0


def test_gradio_uploads_are_capped_at_max_upload_bytes(served, admin):
    client, blocks = served
    assert blocks.max_file_size == 2000
    small = client.post("/ui/gradio_api/upload", headers=admin,
                        files={"files": ("ok.txt", b"a" * 1000, "text/plain")})
    assert small.status_code == 200, small.text
    big = client.post("/ui/gradio_api/upload", headers=admin,
                      files={"files": ("big.txt", b"a" * 5000, "text/plain")})
    assert big.status_code == 413, (big.status_code, big.text)


# --- 7: a user's mistake reads as a message, an unexpected error never shows its text ---------
def test_user_errors_read_clean_and_unexpected_ones_leak_nothing(settings, admin, annotator):
    from app.ui import annotators, datasets, jobs
    from app.ui.common import error_text

    user = _token(admin)
    assert _error(datasets.upload(user, None, "", 0.0, 0)[0]) == "choose a file first"
    assert re.sub(r"<[^>]+>", "", jobs.act(None, "cancel", user, None)) == "pick a job first"
    status, _ = annotators.set_excluded(user, None, True)
    assert re.sub(r"<[^>]+>", "", status) == "pick an annotator"
    assert "needs role admin" in jobs.act(None, "cancel", _token(annotator), 1)
    text = error_text(FileNotFoundError(2, "No such file", "/srv/secret/thing.txt"))
    assert "/srv/secret" not in text and "FileNotFoundError" in text


# --- another page on the same site: no request of theirs is answered --------------------------
def test_a_request_from_another_origin_is_refused_and_gets_no_cors_answer(settings, admin,
                                                                          monkeypatch):
    """A page on another port of the studio's host (or a sibling subdomain) is the same site:
    the browser sends it the UI's SameSite=Strict cookie. Its requests, which carry its
    Origin, are refused before Gradio sees them, preflights included; Gradio's CORS, which
    answered such origins with credentials allowed, no longer answers at all. The studio's
    own pages, proxies that forward the Host, ALLOWED_ORIGINS and scripts (no Origin) pass."""
    from fastapi.testclient import TestClient

    from app.config import get_settings
    from app.main import create_app

    monkeypatch.setenv("ALLOWED_ORIGINS",
                       "https://studio.example.com:443, http://10.0.0.5:8080/")
    get_settings.cache_clear()
    app = create_app(get_settings(), enqueuer=lambda job_id, kind: None, mount_ui=True)
    join = {"data": [None], "fn_index": 0, "trigger_id": None, "session_hash": "abcdefgh12"}
    evil = {"Origin": "http://127.0.0.1:9999"}
    with TestClient(app) as client:
        for method, path, body, headers in (
                ("POST", "/ui/gradio_api/queue/join", join, {}),
                ("GET", "/ui/gradio_api/queue/data?session_hash=abcdefgh12", None, {}),
                ("GET", "/api/auth/me", None, admin),
                ("GET", "/ui/", None, {})):
            r = client.request(method, path, json=body, headers={**headers, **evil})
            assert r.status_code == 403 and r.json()["field"] == "origin", (path, r.text)
            assert "access-control-allow-origin" not in r.headers, path
        r = client.options("/ui/gradio_api/queue/join", headers={
            **evil, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type"})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        assert client.post("/ui/gradio_api/queue/join", json=join,
                           headers={"Origin": "null"}).status_code == 403
        # another scheme of the same host is another origin (an http page, an https studio)
        for headers in ({"Origin": "https://testserver"},
                        {"Origin": "http://ui.example.org", "X-Forwarded-Host": "ui.example.org",
                         "X-Forwarded-Proto": "https"}):
            r = client.get("/api/auth/me", headers={**admin, **headers})
            assert r.status_code == 403, (headers, r.text)
        # the studio's own pages (Origin = Host), forwarded names, configured names, scripts
        for headers in ({"Origin": "http://testserver"},
                        {"Origin": "https://studio.example.com"},
                        {"Origin": "http://10.0.0.5:8080"},
                        {"Origin": "https://ui.example.org", "X-Forwarded-Host": "ui.example.org",
                         "X-Forwarded-Proto": "https"},
                        {"Origin": "http://testserver:80"},
                        {}):
            r = client.get("/api/auth/me", headers={**admin, **headers})
            assert r.status_code == 200, (headers, r.text)
            assert "access-control-allow-origin" not in r.headers
            r = client.post("/ui/gradio_api/queue/join", json=join, headers=headers)
            assert r.status_code != 403 and "access-control-allow-credentials" not in r.headers



def test_allowed_origins_must_be_origins(monkeypatch):
    """ALLOWED_ORIGINS with a bare host name or a path would match nothing, silently: the
    setting is refused naming the entries, beside any other setting's error."""
    from pydantic import ValidationError

    from app.config import Settings, settings_problem

    monkeypatch.setenv("ALLOWED_ORIGINS", "studio.example.com, https://ok.example.com, "
                                          "https://a.example.com/ui")
    monkeypatch.setenv("TRAIN_NPROC", "0")
    try:
        Settings()
    except ValidationError as exc:
        line = settings_problem(exc)
    else:
        raise AssertionError("a malformed ALLOWED_ORIGINS was taken")
    assert line.startswith("TRAIN_NPROC: ") and ("ALLOWED_ORIGINS: each entry must be an "
                                                 "origin") in line
    assert "'studio.example.com', 'https://a.example.com/ui'" in line
    assert "ok.example.com" not in line
