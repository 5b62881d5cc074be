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


def test_a_page_logged_out_in_another_tab_reloads_to_the_login_saying_why(server, page):
    """Log out in another tab of the same browser (or an expired session cookie): the server
    refuses every event of the page (app/ui/sessions.py), and each tab opened showed red
    "Error" toasts and badges under "Logged in as". The page reloads instead, to the login
    box saying why."""
    name = f"eli-{time.monotonic_ns()}"
    with session_scope() as s:
        token = auth.create_user(s, name, "admin")[1]
    login(page, server, token)
    _log_out_in_another_tab(page, server)
    page.get_by_role("tab", name="Rollouts").click()
    ended = page.locator("#login-ended")
    ended.wait_for()
    # (only the reload says so here: the server refuses the page's own events) and, once
    # said, the address forgets it: a later reload of its own says nothing of an ended login
    assert "log in again" in ended.inner_text()
    page.wait_for_function("() => !location.search.includes('login_ended')")
    assert page.locator("#whoami").count() == 0
    time.sleep(2)
    assert page.locator(".toast-body").count() == 0, page.locator(".toast-body").all_inner_texts()
    # logging in again: the pages are back, and a later reload says nothing of an ended login
    page.locator("#login-token input").fill(token)
    page.locator("#login-button").click()
    page.locator("#whoami").wait_for()
    assert page.locator("#login-ended").count() == 0 and "login_ended" not in page.url
    page.get_by_role("tab", name="Rollouts").click()
    page.locator("#rollouts-count").wait_for()
    # ended again within the minute the page script waits between reloads: logging in again
    # let the next end reload too, where the second within a minute brought the toasts back
    _log_out_in_another_tab(page, server)
    page.get_by_role("tab", name="Jobs").click()
    # at once, not once the minute is over (the Jobs page's timer's refused events reload then)
    page.locator("#login-ended").wait_for(timeout=20_000)
    time.sleep(2)
    assert page.locator(".toast-body").count() == 0, page.locator(".toast-body").all_inner_texts()
    assert page.locator("#whoami").count() == 0


def _log_out_in_another_tab(page, server, then_token: str | None = None) -> None:
    other = page.context.new_page()
    other.goto(server.ui)
    other.locator("#whoami").wait_for()  # the same browser: its cookie logs the tab in
    other.locator("#logout").click()
    other.locator("#login-button").wait_for()
    if then_token:
        other.locator("#login-token input").fill(then_token)
        other.locator("#login-button").click()
        other.locator("#whoami").wait_for()
    other.close()


def test_a_reload_that_restores_the_browsers_new_login_forgets_the_ended_one(server, page):
    """Another tab logs out and logs in as someone else: the page reloads and takes the
    browser's login, and its address no longer says the login ended (a Log out chosen later
    was answered "Your sign-in has expired or was ended elsewhere")."""
    with session_scope() as s:
        first = auth.create_user(s, f"fay-{time.monotonic_ns()}", "admin")[1]
        second = auth.create_user(s, f"gus-{time.monotonic_ns()}", "admin")[1]
    login(page, server, first)
    _log_out_in_another_tab(page, server, then_token=second)
    page.get_by_role("tab", name="Rollouts").click()
    page.locator("#whoami").filter(has_text="gus-").wait_for()
    page.wait_for_function("() => !location.search.includes('login_ended')")
    page.locator("#logout").click()
    page.locator("#login-button").wait_for()
    page.reload()
    page.locator("#login-button").wait_for()
    time.sleep(1)
    assert page.locator("#login-ended").count() == 0


def test_a_tab_restored_from_the_cookie_reloads_when_another_tab_logs_out(server, page):
    """A second tab of the browser logs in from the cookie; Log out in the first revokes
    that cookie's session token, the second tab's own login. Its events went on to the
    handlers: the header still said "Logged in as", and the Jobs page's timer and every vote
    said "invalid or revoked token" under it. It reloads to the login box instead."""
    name = f"finn-{time.monotonic_ns()}"
    with session_scope() as s:
        token = auth.create_user(s, name, "admin")[1]
    login(page, server, token)
    second = page.context.new_page()
    second.goto(server.ui)
    second.locator("#whoami").wait_for()  # restored from the cookie
    second.get_by_role("tab", name="Jobs").click()
    second.locator("#jobs-launch").wait_for()
    page.locator("#logout").click()
    page.locator("#login-button").wait_for()
    # no click in the second tab: the Jobs page's own timer finds the login ended
    second.locator("#login-ended").wait_for(timeout=20_000)
    assert "log in again" in second.locator("#login-ended").inner_text()
    assert second.locator("#whoami").count() == 0
    time.sleep(2)
    assert second.locator(".toast-body").count() == 0, \
        second.locator(".toast-body").all_inner_texts()
