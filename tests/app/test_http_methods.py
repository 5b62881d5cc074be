"""HEAD wherever GET answers on the app's own routes (app/api/methods.py, RFC 9110 §9.3.2):
GET's status and headers, no body, behind GET's own auth and checks. `HEAD /api/jobs` was a
405 (FastAPI serves a route for the methods it declares only)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("path", ["/api/jobs", "/api/auth/me", "/api/prompts?limit=2",
                                  "/api/users", "/healthz"])
def test_head_answers_where_get_does(client, admin, path):
    got = client.get(path, headers=admin)
    head = client.head(path, headers=admin)
    assert got.status_code == 200, got.text
    assert head.status_code == 200 and head.content == b"", (path, head.status_code)
    assert head.headers["content-length"] == str(len(got.content))
    assert head.headers["content-type"] == got.headers["content-type"]


def test_head_is_behind_gets_auth_and_checks(client, annotator):
    assert client.head("/api/jobs").status_code == 401
    assert client.head("/api/users", headers=annotator).status_code == 403  # admins' route
    r = client.head("/api/jobs?jobid=1", headers=annotator)  # GET's query check too
    assert r.status_code == 422 and r.content == b""
    assert client.head("/api/jobs/999999", headers=annotator).status_code == 404


def test_head_where_no_get_answers_is_still_a_405(client, admin):
    r = client.head("/api/votes", headers=admin)  # POST only
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert client.head("/api/nothing-here", headers=admin).status_code == 404
    # a download's own HEAD route answers as before (tests/app/test_download_heads_ranges.py)
    assert client.head("/api/media/missing.png", headers=admin).status_code == 404


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("PUT", "/api/jobs", "GET, HEAD, POST"),      # Starlette said POST: the first route's
    ("DELETE", "/api/datasets", "GET, HEAD, POST"),
    ("POST", "/api/jobs/1", "GET, HEAD"),
    ("PUT", "/api/votes", "POST")])
def test_a_405_allows_every_method_the_path_answers(client, admin, method, path, allow):
    r = client.request(method, path, headers=admin)
    assert r.status_code == 405 and r.headers["allow"] == allow, (r.status_code, r.headers)
    for listed in allow.split(", "):  # and each one it lists is answered, not a 405
        if listed in ("GET", "HEAD"):
            assert client.request(listed, path, headers=admin).status_code != 405
