"""A login that ends under an open page (its token replaced or revoked by an admin, its
session expired, logged out elsewhere), in a real browser: every tab the user opened put two
or three red "Error" toasts on the page ("invalid or revoked token ...", one per picker it
refreshes) while the header still said "Logged in as". Now the first tab opened logs the page
out with one message in the login area, and the login box is back to log in again."""

from __future__ import annotations

import json
import time
import urllib.request

from ui_helpers import login

from app.db import session_scope
from app.services import auth


def _api(server, method: str, path: str) -> dict:
    request = urllib.request.Request(server.base + path, method=method, headers={
        "Authorization": f"Bearer {server.admin_token}"})
    with urllib.request.urlopen(request) as response:
        return json.loads(response.read() or b"null")


def test_a_login_replaced_elsewhere_says_so_once_in_the_login_area(server, page):
    name = f"dora-{time.monotonic_ns()}"
    with session_scope() as s:
        user, token = auth.create_user(s, name, "admin")
        user_id = user.id
    login(page, server, token)
    page.get_by_role("tab", name="Rollouts").click()
    page.locator("#rollouts-count").wait_for()
    # an admin gives dora a new token: the one this page holds is revoked (through the
    # server, whose token cache forgets it at once)
    new_token = _api(server, "POST", f"/api/users/{user_id}/token")["token"]
    page.get_by_role("tab", name="Jobs").click()
    ended = page.locator("#login-ended")
    ended.wait_for()
    assert "log in again" in ended.inner_text()
    assert page.locator("#whoami").count() == 0  # no "Logged in as" above the message
    page.locator("#login-button").wait_for()  # the login box, to log in again
    assert page.get_by_role("tab", name="Jobs").count() == 0  # the pages went with the login
    time.sleep(2)  # the tab's own handlers have answered by now: none of them raised a toast
    assert page.locator(".toast-body").count() == 0, page.locator(".toast-body").all_inner_texts()
    # the new token logs in again, and the message goes
    login(page, server, new_token)
    assert page.locator("#login-ended").count() == 0
    page.get_by_role("tab", name="Jobs").click()
    page.locator("#jobs-launch").wait_for()
    assert page.locator(".toast-body").count() == 0
