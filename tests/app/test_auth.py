from __future__ import annotations

import subprocess
import sys

from sqlalchemy import select


def test_missing_and_wrong_token_are_401(client):
    r = client.get("/api/datasets")
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    r = client.get("/api/datasets", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401


def test_me(client, admin, annotator):
    assert client.get("/api/auth/me", headers=admin).json()["role"] == "admin"
    me = client.get("/api/auth/me", headers=annotator).json()
    assert (me["name"], me["role"]) == ("bob", "annotator")


def test_annotator_cannot_upload_launch_cancel_or_delete(client, admin, annotator):
    files = {"file": ("p.txt", b"a prompt\n", "text/plain")}
    assert client.post("/api/datasets", files=files, headers=annotator).status_code == 403
    r = client.post("/api/datasets", files=files, headers=admin)
    assert r.status_code == 201
    ds = r.json()["id"]
    assert client.delete(f"/api/datasets/{ds}", headers=annotator).status_code == 403
    assert client.post("/api/jobs", json={"kind": "train"}, headers=annotator).status_code == 403
    job = client.post("/api/jobs", json={"kind": "train", "preset": "tiny"}, headers=admin).json()
    assert client.post(f"/api/jobs/{job['id']}/cancel", headers=annotator).status_code == 403
    assert client.post(f"/api/jobs/{job['id']}/resume", headers=annotator).status_code == 403
    # annotators can read
    assert client.get("/api/datasets", headers=annotator).status_code == 200
    assert client.get(f"/api/jobs/{job['id']}", headers=annotator).status_code == 200


def test_cli_create_user_prints_token_once_and_stores_hash(settings, session, client):
    from app.models import ApiToken

    out = subprocess.run([sys.executable, "-m", "app", "create-user", "carol", "--role", "admin"],
                         capture_output=True, text=True, check=True)
    token = out.stdout.strip().splitlines()[-1]
    assert token.startswith("ngs_")
    stored = session.scalars(select(ApiToken.token_hash)).all()
    assert token not in stored and len(stored) == 1 and len(stored[0]) == 64
    me = client.get("/api/auth/me", headers={"Authorization": f"Bearer {token}"})
    assert me.status_code == 200 and me.json()["name"] == "carol"
    dup = subprocess.run([sys.executable, "-m", "app", "create-user", "carol"],
                         capture_output=True, text=True)
    assert dup.returncode == 1 and "already exists" in dup.stderr


def test_admin_lists_and_revokes_users(client, admin, annotator):
    """GET /api/users and POST /api/users/{id}/revoke (admins only): a revoked user's token
    stops working at once, their votes stay, an admin cannot revoke themself."""
    r = client.post("/api/users", json={"name": "carol", "role": "annotator"}, headers=admin)
    shouted = client.post("/api/users", json={"name": "CAROL", "role": "admin"}, headers=admin)
    assert shouted.status_code == 409 and "differ in case only" in shouted.json()["detail"]
    # full-width letters look the same too
    wide = client.post("/api/users", json={"name": "ｃａｒｏｌ", "role": "admin"}, headers=admin)
    assert wide.status_code == 409 and wide.json()["field"] == "name"
    assert "user 'carol' already exists (names differ in case or character width only)" \
        in wide.json()["detail"]
    again = client.post("/api/users", json={"name": "carol", "role": "admin"}, headers=admin)
    assert again.status_code == 409 and again.json()["field"] == "name", again.text
    assert again.json()["errors"] == [{"field": "name",
                                       "message": "user 'carol' already exists"}]
    assert r.status_code == 201
    carol = {"Authorization": f"Bearer {r.json()['token']}"}
    assert client.get("/api/auth/me", headers=carol).status_code == 200
    assert client.get("/api/users", headers=annotator).status_code == 403
    assert client.post(f"/api/users/{r.json()['id']}/revoke", headers=annotator).status_code == 403
    users = {u["name"]: u for u in client.get("/api/users", headers=admin).json()}
    assert set(users) == {"alice", "bob", "carol"}
    assert users["carol"]["active_tokens"] == 1 and not users["carol"]["revoked"]
    assert r.json()["created_at"] == users["carol"]["created_at"]  # one format everywhere
    assert "token" not in users["carol"] and "token_hash" not in users["carol"]
    done = client.post(f"/api/users/{users['carol']['id']}/revoke", headers=admin)
    assert done.status_code == 200 and done.json()["tokens_revoked"] == 1
    assert client.get("/api/auth/me", headers=carol).status_code == 401
    users = {u["name"]: u for u in client.get("/api/users", headers=admin).json()}
    assert users["carol"]["revoked"] and users["carol"]["active_tokens"] == 0
    own = client.post(f"/api/users/{users['alice']['id']}/revoke", headers=admin)
    assert own.status_code == 422 and "your own" in own.json()["detail"]
    assert client.post("/api/users/999999/revoke", headers=admin).status_code == 404


def test_a_new_token_replaces_a_lost_one_and_gives_a_revoked_user_access_again(
        client, admin, annotator):
    """A token is shown once: one lost (or leaked) left its user nothing but a new account
    under another name, splitting their votes, and a revoked user could never come back.
    POST /api/users/{id}/token issues a new one (admins only, not their own), revoking the
    user's earlier tokens and UI sessions."""
    r = client.post("/api/users", json={"name": "dave", "role": "annotator"}, headers=admin)
    dave_id, first = r.json()["id"], {"Authorization": f"Bearer {r.json()['token']}"}
    session_token = client.post("/api/auth/session", headers=first).cookies
    assert session_token
    assert client.post(f"/api/users/{dave_id}/token", headers=annotator).status_code == 403
    r = client.post(f"/api/users/{dave_id}/token", headers=admin)
    assert r.status_code == 201, r.text
    body = r.json()
    assert (body["id"], body["name"], body["role"]) == (dave_id, "dave", "annotator")
    assert body["tokens_revoked"] == 2  # the API token and the UI session
    assert client.get("/api/auth/me", headers=first).status_code == 401
    client.cookies.clear()
    second = {"Authorization": f"Bearer {body['token']}"}
    assert client.get("/api/auth/me", headers=second).json()["name"] == "dave"
    # revoked, then given access again under the same name (their votes stay theirs)
    assert client.post(f"/api/users/{dave_id}/revoke", headers=admin).json()["tokens_revoked"] == 1
    assert client.get("/api/auth/me", headers=second).status_code == 401
    third = client.post(f"/api/users/{dave_id}/token", headers=admin).json()
    assert third["tokens_revoked"] == 0
    assert client.get("/api/auth/me", headers={
        "Authorization": f"Bearer {third['token']}"}).json()["name"] == "dave"
    users = {u["name"]: u for u in client.get("/api/users", headers=admin).json()}
    assert users["dave"]["active_tokens"] == 1 and not users["dave"]["revoked"]
    own = client.post(f"/api/users/{users['alice']['id']}/token", headers=admin)
    assert own.status_code == 422 and "your own" in own.json()["detail"]
    assert client.get("/api/auth/me", headers=admin).status_code == 200  # still works
    assert client.post("/api/users/999999/token", headers=admin).status_code == 404


def test_a_request_without_a_token_is_refused_before_its_body_is_read(client, annotator):
    """Every route that takes a token answers 401 (and a role-gated one 403) without reading
    the body: FastAPI parsed a JSON body whole before it checked the token, so an anonymous
    client could make the server read and parse what it sent. Streamed, so that a chunk the
    server asked for is seen."""
    from fastapi.routing import iter_route_contexts

    from app.api.deps import _dependency_calls, admin_user, current_user, file_reader

    writes = {"POST", "PUT", "PATCH", "DELETE"}
    routes = [ctx for ctx in iter_route_contexts(client.app.routes)
              if ctx.methods and ctx.methods & writes
              and _dependency_calls(getattr(ctx.route, "dependant", None))
              & {current_user, file_reader}]
    assert {"/api/jobs", "/api/votes", "/api/datasets"} <= {ctx.path for ctx in routes}
    for ctx in routes:
        path = ctx.path
        for param in ctx.route.param_convertors:
            path = path.replace(f"{{{param}}}", "1")
        for method in ctx.methods & writes:
            cases = [({}, 401), ({"Authorization": "Bearer nope"}, 401)]
            if admin_user in _dependency_calls(ctx.route.dependant):
                cases.append((annotator, 403))
            for headers, status in cases:
                read: list[int] = []

                def body(read: list[int] = read):
                    for i in range(3):  # malformed JSON and multipart alike
                        read.append(i)
                        yield b'{"kind": "train", --xx\r\n'

                r = client.request(method, path, content=body(), headers={
                    **headers, "Content-Type": "application/json"})
                assert (r.status_code, read) == (status, []), (method, ctx.path, r.text)
