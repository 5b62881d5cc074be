"""Login by API token. The token stays in the per-session state, never in a global; the
session is bound to its browser's session cookie (app/ui/sessions.py), so that its id alone
acts for no one."""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from app.api.deps import session_cookie
from app.errors import Unauthorized
from app.services import auth
from app.ui.common import caller, error_text, esc, login_ended, notice, session
from app.ui.sessions import forget_login, remember_login

ANNOTATOR_TABS = ("arena", "annotators")  # annotators see their own stats on the last one
ADMIN_TABS = ("arena", "rollouts", "jobs", "leaderboard", "datasets", "annotators")
# the login area's message for a page whose login ended under it (`Login.wire`'s check)
LOGIN_ENDED = ("Your sign-in has expired or was ended elsewhere (logged out, or the token "
               "revoked or replaced): log in again below (with a new token from an admin if "
               "yours was revoked).")


# Before the server checks the token, the browser trades it for the HttpOnly session cookie
# that lets <img src="/api/media/..."> load stored images (app/api/media.py); a wrong token
# gets no cookie and the server's answer below says why.
START_SESSION_JS = """async (token, state) => {
  const t = (token || "").trim();
  // a page reloaded because its login ended (app.ui.common's page script): logged in again,
  // a later reload need not say so, and a login that ends again reloads again (the script
  // reloads once a minute at most, against a loop no login can end: a login is a user's act)
  if (location.search.includes("login_ended")) history.replaceState(null, "", location.pathname);
  sessionStorage.removeItem("ngsLoginEndedAt");
  if (t) {
    try {
      await fetch("/api/auth/session", {method: "POST", credentials: "same-origin",
                                        headers: {Authorization: "Bearer " + t}});
    } catch (e) { /* the server-side login reports any problem */ }
  }
  return [token, state];
}"""


FORGET_LOGIN_ENDED_JS = """() => {
  if (location.search.includes("login_ended")) history.replaceState(null, "", location.pathname);
}"""


def ended_notice() -> str:
    """The login area's message for a page whose login ended under it."""
    return f'<div id="login-ended">{notice(LOGIN_ENDED, "error")}</div>'


@dataclass
class Login:
    box: gr.Column
    token: gr.Textbox
    button: gr.Button
    status: gr.HTML
    logout: gr.Button
    user: gr.State

    def wire(self, pages: dict[str, gr.Tab], tabs: gr.Tabs, ui: gr.Blocks | None = None) -> None:
        keys = list(pages)

        def login(token: str, _state: dict | None, request: gr.Request, quiet: bool = False):
            token = (token or "").strip()
            if not token:  # "log in first" would answer a click on Log in itself
                return (None, "" if quiet else notice(
                            "enter your token (an admin creates it: the Annotators page, or "
                            "python -m app create-user)", "error"),
                        gr.update(visible=True), gr.update(visible=False), gr.skip(),
                        *[gr.update(visible=False) for _ in keys], gr.skip())
            try:
                user = caller({"token": token})
            except Exception as exc:  # noqa: BLE001 - shown to the user
                # the login box's own answer (a wrong token): no "reload to log in again"
                message = exc.message if isinstance(exc, Unauthorized) else error_text(exc)
                return (None, "" if quiet else notice(message, "error"),
                        gr.update(visible=True), gr.update(visible=False), gr.skip(),
                        *[gr.update(visible=False) for _ in keys], gr.skip())
            # from now on this session acts only for requests carrying the user's session
            # cookie, not for whoever learns its id (app/ui/sessions.py)
            remember_login(getattr(request, "session_hash", None), token)
            allowed = ADMIN_TABS if user.role == "admin" else ANNOTATOR_TABS
            state = {"token": token, "name": user.name, "role": user.role}
            status = (f'<div id="whoami" data-role="{esc(user.role)}">Logged in as '
                      f"<b>{esc(user.name)}</b> ({esc(user.role)})</div>")
            return (state, status, gr.update(visible=False), gr.update(visible=True),
                    gr.Tabs(selected="arena"), *[gr.update(visible=k in allowed) for k in keys],
                    "")  # the box forgets the token: it lives in `state` only

        def logged_out(message: str) -> tuple:
            # no user, `message` in the login area, the login box shown and the pages hidden
            return (None, message, gr.update(visible=True), gr.update(visible=False),
                    gr.skip(), *[gr.update(visible=False) for _ in keys], "")

        def logout(request: gr.Request):
            """The server ends the login: this session's binding and the browser's session
            token (revoked here, from the cookie this request carries; the cookie left
            behind names nothing, and the next login replaces it). A script deleting the
            cookie first would leave this request without the cookie its session is bound
            to; one deleting it after could delete a new login's cookie."""
            forget_login(getattr(request, "session_hash", None))
            token = session_cookie(dict(request.cookies)) if request is not None else None
            if token:
                with session() as s:
                    auth.end_session(s, token)
            return logged_out("")

        outputs = [self.user, self.status, self.box, self.logout, tabs, *pages.values(),
                   self.token]
        for trigger in (self.button.click, self.token.submit):
            trigger(login, [self.token, self.user], outputs, api_visibility="private",
                    js=START_SESSION_JS)
        self.logout.click(logout, None, outputs, api_visibility="private")

        def check(state: dict | None, request: gr.Request):
            """A tab shown: a login that ended under the page (its token revoked or replaced,
            its session expired or logged out elsewhere) logs the page out, with one message
            in the login area, which shows the login box again. Each tab's own handlers said
            it in their way, with two or three red "Error" toasts on every tab opened, while
            the header still said "Logged in as"; they now leave a login that ended to this
            (`common.admin_or_toast`). A login that holds, or none, changes nothing."""
            if not (state or {}).get("token"):
                return tuple(gr.skip() for _ in outputs)
            try:
                caller(state)
            except Exception as exc:  # noqa: BLE001 - only an ended login is this one's
                if not login_ended(exc):
                    return tuple(gr.skip() for _ in outputs)
                forget_login(getattr(request, "session_hash", None))
                return logged_out(ended_notice())
            return tuple(gr.skip() for _ in outputs)

        for page in pages.values():
            page.select(check, self.user, outputs, show_progress="hidden",
                        api_visibility="private")

        def restore(state: dict | None, request: gr.Request):
            """A reload keeps the login: the session cookie set at login (HttpOnly, so only
            the server reads it) names the token. Without a valid one, or once someone has
            logged in on this page (a click can beat this load event), nothing changes, but
            for a page the page script reloaded because its login ended under it
            (`?login_ended`, app.ui.common): the login area says so."""
            token = session_cookie(dict(request.cookies)) if request is not None else None
            ended = request is not None and "login_ended" in request.query_params
            unchanged = tuple(gr.skip() for _ in outputs)
            if ended and not state:
                unchanged = (gr.skip(), ended_notice(), *unchanged[2:])
            if state or not token:
                return unchanged
            out = login(token, None, request, quiet=True)
            return out if out[0] else unchanged

        def closed(request: gr.Request) -> None:
            forget_login(getattr(request, "session_hash", None))

        if ui is not None:
            # once restore has read it, `?login_ended` goes from the address: a reload that
            # restored another login (the browser's, logged in in another tab) kept it, and a
            # later reload after a chosen Log out said the login had ended
            ui.load(restore, self.user, outputs, api_visibility="private",
                    show_progress="hidden").then(None, js=FORGET_LOGIN_ENDED_JS)
            ui.unload(closed)  # the page closed: its session id binds nothing any more


def build_login(user: gr.State) -> Login:
    # not equal_height: it stretched Log out to the height of the wrapped title on a phone
    with gr.Row(elem_id="ngs-header"):
        gr.Markdown("## Neighbor GRPO Studio", elem_id="ngs-title")
        status = gr.HTML(elem_id="login-status")
        logout = gr.Button("Log out", visible=False, size="sm", scale=0, elem_id="logout")
    with gr.Column(elem_id="login-box") as box:
        token = gr.Textbox(label="API token", type="password", elem_id="login-token",
                           placeholder="ngs_... (from `python -m app create-user` or the "
                                       "token `make demo` printed)")
        button = gr.Button("Log in", variant="primary", elem_id="login-button")
    return Login(box, token, button, status, logout, user)
