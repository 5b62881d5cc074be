"""Annotators: votes per annotator, median decision time, agreement with the majority and with
the automatic reward on shared pairs (`app.services.annotators.stats`). Admins see everyone and
the switch that excludes an annotator's votes from fitting, and the accounts: create a user
(its token shown once), list them, revoke one, give one a new token (shown once: a lost or
leaked one, or access given back); annotators see their own row. The stats are
re-read whenever the page is shown, so an annotator's own vote count is current after voting.
Admins also see the fitted preference models and launch a fit from the votes."""

from __future__ import annotations

import re
from typing import Any

import gradio as gr
from sqlalchemy.orm import Session

from app.errors import BadRequest, Invalid
from app.job_kinds import KINDS
from app.models import JobStatus, User
from app.services import annotators as svc
from app.services import auth
from app.services import jobs as jobs_svc
from app.services import preference as pref_svc
from app.services.jobs import Enqueuer
from app.ui.common import Raw, admin_or_none, caller, error_text, esc, notice, session, table
from trainer.rewards.fit_config import MIN_FIT_VOTES
from trainer.rewards.outcomes import Outcome


def _pct(x: float | None, n: int) -> str:
    return "–" if x is None else f"{100 * x:.0f}% (n={n})"


def stats_html(user_state: dict | None) -> str:
    try:
        user = caller(user_state)
        with session() as s:
            rows = svc.stats(s, annotator_id=None if user.role == "admin" else user.id)
            # a revoked user's votes still count: the row stays, saying so
            revoked = {r["id"] for r in auth.list_users(s) if r["revoked"]}
    except Exception as exc:  # noqa: BLE001
        return notice(error_text(exc), "error")
    body = table(
        ["user", "role", "votes", "clean votes", "median latency", "agrees with majority",
         "agrees with reward", "excluded"],
        [[f"{r['name']} (#{r['user_id']})",
          f"{r['role']} (revoked)" if r["user_id"] in revoked else r["role"],
          Raw(f'<span class="ngs-votes" data-user="{esc(r["name"])}">{r["votes"]}</span>'),
          r["clean_votes"],
          "–" if r["median_latency_ms"] is None else f"{r['median_latency_ms'] / 1000:.1f} s",
          _pct(r["majority_agreement"], r["majority_n"]),
          _pct(r["reward_agreement"], r["reward_n"]),
          Raw(f'<span class="ngs-excluded" data-user="{esc(r["name"])}">'
              f'{"yes" if r["excluded"] else "no"}</span>')] for r in rows],
        "ngs-annotators")
    return f'<div id="annotators-table">{body}{COLUMNS_NOTE}</div>'


# what the columns count, in the words the arena's buttons use (trainer.rewards.outcomes)
COLUMNS_NOTE = (
    '<small id="annotators-columns">Clean votes: the '
    + ", ".join(f"“{o.label}”" for o in Outcome if o.counts)
    + " answers, which fits and the leaderboard use ("
    + " and ".join(f"“{o.label}”" for o in Outcome if not o.counts)
    + " say nothing about which image is better). Agrees with majority: how often a clean "
    "vote matches the most common answer of the other annotators on the same pair. Agrees "
    "with reward: how often the preferred image is the one the automatic rewards score "
    "higher. Excluded: the annotator's votes are left out of fits and the leaderboard.</small>")


def user_choices() -> list[tuple[str, int]]:
    with session() as s:
        return [(f"{r['name']} (#{r['user_id']})", r["user_id"]) for r in svc.stats(s)]


def _user_name(s: Session, user_id: int) -> str:
    """The user's name for a message (the pickers show names, so "User #3" named someone the
    admin never saw as such); "user #<id>" only if they are gone."""
    return next((r["name"] for r in auth.list_users(s) if r["id"] == user_id),
                f"user #{user_id}")


def set_excluded(user_state: dict | None, user_id: int | None, excluded: bool) -> tuple[str, str]:
    try:
        caller(user_state, "admin")
        if not user_id:
            raise BadRequest("pick an annotator")
        with session() as s:
            changed = svc.set_excluded(s, int(user_id), bool(excluded))
            name = _user_name(s, int(user_id))
        verb = "excluded" if excluded else "included again"
        msg = notice(f"{name} {verb}; {changed} vote(s) updated.", "ok")
    except Exception as exc:  # noqa: BLE001
        msg = notice(error_text(exc), "error")
    return msg, stats_html(user_state)


def excluded_of(user_state: dict | None, user_id: int | None, shown: bool = False) -> Any:
    """The Exclude box for the annotator just picked: their excluded state as the database has
    it. The box kept the last value shown, so Apply after picking an excluded annotator
    silently included them again. Left as it is when it already says so (`shown`: a tick
    given while this answer was on its way stays), when nothing is picked, or for anyone but
    an admin (Apply says what is wrong)."""
    try:
        caller(user_state, "admin")
        if not user_id:
            return gr.skip()
        with session() as s:
            picked = s.get(User, int(user_id))  # one row, not every user's token counts
            excluded = None if picked is None else bool(picked.excluded)
    except Exception:  # noqa: BLE001 - Apply, the action, shows the error
        return gr.skip()
    return excluded if excluded is not None and excluded != bool(shown) else gr.skip()


def users_html(user_state: dict | None) -> str:
    try:
        caller(user_state, "admin")
        with session() as s:
            rows = auth.list_users(s)
    except Exception as exc:  # noqa: BLE001
        return notice(error_text(exc), "error")
    body = table(["user", "role", "created", "access"],
                 [[f"{r['name']} (#{r['id']})", r["role"],
                   r["created_at"].strftime("%Y-%m-%d %H:%M") if r["created_at"] else "",
                   Raw(f'<span class="ngs-access" data-user="{esc(r["name"])}">'
                       f'{"revoked" if r["revoked"] else "active"}</span>')] for r in rows],
                 "ngs-users")
    return f'<div id="users-table">{body}</div>'


def account_choices(user_state: dict | None) -> list[tuple[str, int]]:
    """Users that can still log in, for the Revoke picker (admins only)."""
    caller(user_state, "admin")
    with session() as s:
        return [(_account_label(r), r["id"]) for r in auth.list_users(s) if not r["revoked"]]


def _account_label(row: dict[str, Any]) -> str:
    """A user as the account pickers name them: "eve (#3, annotator)", ", revoked" added."""
    return (f"{row['name']} (#{row['id']}, {row['role']}"
            + (", revoked)" if row["revoked"] else ")"))


def _create_account(user_state: dict | None, name: str, role: str) -> tuple[str, bool]:
    """Create a user: the message (their token, shown once) and whether they were created."""
    try:
        caller(user_state, "admin")
        with session() as s:
            user, token = auth.create_user(s, name or "", role or "annotator")
            uid, uname, urole = user.id, user.name, user.role
    except Exception as exc:  # noqa: BLE001
        return notice(error_text(exc), "error"), False
    return (f'<div class="ngs-notice ngs-ok" id="user-created" data-user="{uid}">Created '
            f"{esc(urole)} <b>{esc(uname)}</b> (#{uid}). Their API token, shown once (copy it "
            f'now): <code id="new-token">{esc(token)}</code></div>'), True


def token_choices(user_state: dict | None) -> Any:
    """Every user, revoked ones too (a new token gives them access again), for the New token
    picker: admins only; nothing picked."""
    try:
        caller(user_state, "admin")
    except Exception:  # noqa: BLE001 - the accounts are the admins'; on_login says the error
        return gr.skip()
    with session() as s:
        rows = auth.list_users(s)
    return gr.Dropdown(choices=[(_account_label(r), r["id"]) for r in rows], value=None)


def replace_account_token(user_state: dict | None, user_id: int | None) -> str:
    """The New token button: a new API token for the picked user (shown once, in the Create
    user box), their earlier tokens and sessions revoked; a revoked user can log in again."""
    try:
        admin = caller(user_state, "admin")
        if not user_id:
            raise BadRequest("pick a user")
        with session() as s:
            user, token, revoked = auth.replace_token(s, int(user_id), by=admin)
            uid, uname = user.id, user.name
    except Exception as exc:  # noqa: BLE001
        return notice(error_text(exc), "error")
    return (f'<div class="ngs-notice ngs-ok" id="user-token-replaced" data-user="{uid}">New '
            f"token for <b>{esc(uname)}</b> (#{uid}); their {revoked} earlier token(s) and "
            "sessions no longer work. The token, shown once (copy it now): "
            f'<code id="new-token">{esc(token)}</code></div>')


def forget_token() -> str:
    """The Create user message, token included, taken off the page (`build_annotators`)."""
    return ""


def create_from_form(user_state: dict | None, name: str, role: str) -> tuple[str, Any]:
    """The Create user button: the message, and the Name field's new value: empty once the
    user exists, so that a second click does not try the same name again ("already
    exists"); as typed after an error, to be corrected."""
    msg, created = _create_account(user_state, name, role)
    return msg, "" if created else gr.skip()


# Revoke's safeguard, as Delete's on the Datasets page (app.ui.datasets.CONFIRM_DELETE): a
# revoked token never works again, so one click on the wrong name revokes nothing
CONFIRM_REVOKE = "Yes, revoke their access (cannot be undone: their tokens stop working)"


def revoke_account(user_state: dict | None, user_id: int | None, confirmed: bool) -> str:
    """Revoke every token of the picked user, once `confirmed` (CONFIRM_REVOKE ticked)."""
    return _revoke(user_state, user_id, confirmed)[0]


def _revoke(user_state: dict | None, user_id: int | None,
            confirmed: bool) -> tuple[str, bool]:
    """`revoke_account`'s message, and whether the user was revoked."""
    try:
        admin = caller(user_state, "admin")
        if not user_id:
            raise BadRequest("pick a user")
        if not confirmed:
            raise BadRequest(f"tick “{CONFIRM_REVOKE}” first, then Revoke access")
        with session() as s:
            n = auth.revoke_user(s, int(user_id), by=admin)
            name = _user_name(s, int(user_id))
    except Exception as exc:  # noqa: BLE001
        return notice(error_text(exc), "error"), False
    return notice(f"{name} can no longer log in ({n} token(s) revoked; their votes stay).",
                  "ok"), True


def models_html(user_state: dict | None) -> str:
    """The fitted preference models, newest first (the first is the one training's "latest"
    and the arena's active selection use), for admins; nothing for anyone else."""
    try:
        caller(user_state, "admin")
    except Exception:  # noqa: BLE001 - the section is the admins'; on_login shows the error
        return ""
    with session() as s:
        rows, total = pref_svc.list_models(s, limit=20)
        rows = [pref_svc.to_dict(r) for r in rows]
    if not rows:
        return ('<div id="preference-models" class="ngs-notice ngs-info">No preference model '
                "yet: fit one once annotators have voted (it needs at least "
                f"{MIN_FIT_VOTES} a, b or tie votes).</div>")

    def started(report: dict[str, Any]) -> str:
        extra = (report or {}).get("extra") or {}
        if extra.get("warm_start"):
            return f"v{extra.get('warm_start_version')}"
        return "scratch"

    body = table(["version", "votes", "held-out accuracy", "held-out log-loss",
                  "held-out calibration error", "started from", "job", "fitted"],
                 [[Raw(f'<span class="ngs-pref-version">v{r["version"]}</span>'), r["votes_used"],
                   r["heldout_accuracy"], r["heldout_log_loss"],
                   (r["report"] or {}).get("heldout_calibration_error"), started(r["report"]),
                   r["job_id"] or "–",
                   r["created_at"].strftime("%Y-%m-%d %H:%M") if r["created_at"] else ""]
                  for r in rows], "ngs-pref-models")
    more = f"<p>The newest 20 of {total}.</p>" if total > len(rows) else ""
    return f'<div id="preference-models">{body}{more}</div>'


def fit_now(enqueuer: Enqueuer | None, user_state: dict | None) -> str:
    """Launch a fit_preference job with the defaults (a refit starts from the newest model
    when it can, FitConfig.warm_start_epochs)."""
    try:
        user = caller(user_state, KINDS["fit_preference"].launch_role)
        with session() as s:
            job_id = jobs_svc.launch_job(s, enqueuer, "fit_preference", {}, user=user).id
    except Invalid as exc:
        # the button sends no config: its fields' names ("config.min_votes") mean nothing here
        return notice("; ".join(e["message"] for e in exc.details.get("errors") or [])
                      or exc.message, "error")
    except Exception as exc:  # noqa: BLE001
        return notice(error_text(exc), "error")
    return (f'<div class="ngs-notice ngs-ok" id="fit-launched" data-job="{job_id}">Launched '
            f"fit job {job_id} on every clean vote; its new version appears here when it "
            f"finishes (Refresh), and the Jobs page lists its progress (job {job_id}).</div>")


_FIT_LAUNCHED = re.compile(r'id="fit-launched" data-job="(\d+)"')


def fit_update(user_state: dict | None, message: str | None) -> Any:
    """The Fit button's message once its job has finished: "Launched fit job 9 ... appears
    here when it finishes (Refresh)" stayed above the version it had fitted. Replaced on the
    Refresh (or the tab's showing) that lists the outcome: the version the job fitted, or that
    it failed or was cancelled; left as it is while the job runs."""
    launched = _FIT_LAUNCHED.search(message or "")
    if launched is None:
        return gr.skip()
    job_id = int(launched.group(1))
    try:
        caller(user_state, "admin")
        with session() as s:
            job = jobs_svc.get_job(s, job_id)
            status = job.status
            if status == JobStatus.SUCCEEDED:
                rows, _ = pref_svc.list_models(s, limit=100)
                version = next((r.version for r in rows if r.job_id == job_id), None)
    except Exception:  # noqa: BLE001 - the message stays; Refresh shows the page's own errors
        return gr.skip()
    if status == JobStatus.SUCCEEDED:
        fitted = f"version v{version}, listed below" if version is not None else "no version"
        return notice(f"Fit job {job_id} finished: {fitted}.", "ok")
    if status == JobStatus.FAILED:
        return notice(f"Fit job {job_id} failed: no new version (the Jobs page shows its "
                      "error).", "error")
    if status == JobStatus.CANCELLED:
        return notice(f"Fit job {job_id} was cancelled: no new version.", "info")
    return gr.skip()


def on_login(user_state: dict | None) -> tuple[Any, ...]:
    """The page for whoever is logged in, re-authenticated each time it is shown (the role is
    the server's, never the one the session state claims): an admin's switches and accounts,
    an annotator's own row; a revoked or unknown token gets an error and no admin parts.
    Outputs: stats, admin row, annotator picker, accounts column, users list, revoke picker."""
    hidden = (gr.Row(visible=False), gr.skip(), gr.Column(visible=False), "", gr.skip())
    if not (user_state or {}).get("token"):
        return ("", *hidden)
    try:
        admin = admin_or_none(user_state) is not None
    except Exception as exc:  # noqa: BLE001 - shown to the user
        return (notice(error_text(exc), "error"), *hidden)
    if not admin:
        return (stats_html(user_state), *hidden)
    return (stats_html(user_state), gr.Row(visible=True),
            gr.Dropdown(choices=user_choices()), gr.Column(visible=True),
            users_html(user_state),
            # nothing picked: after a revoke the picked user is no longer a choice, and a
            # value outside the choices made every control of the page show Gradio's error
            gr.Dropdown(choices=account_choices(user_state), value=None))


def build_annotators(user: gr.State, tab: gr.Tab | None = None,
                     enqueuer: Enqueuer | None = None) -> gr.Blocks:
    with gr.Blocks() as page:
        refresh = gr.Button("Refresh", size="sm", elem_id="annotators-refresh")
        out = gr.HTML(elem_id="annotators-box")
        with gr.Row(visible=False) as admin_row:
            who = gr.Dropdown([], label="Annotator", elem_id="annotators-pick")
            excluded = gr.Checkbox(label="Exclude this annotator's votes from fitting",
                                   elem_id="annotators-exclude")
            apply = gr.Button("Apply", elem_id="annotators-apply")
        status = gr.HTML(elem_id="annotators-status")
        with gr.Column(visible=False) as accounts:
            gr.Markdown("### Accounts")
            with gr.Row(equal_height=True):
                new_name = gr.Textbox(label="Name", elem_id="users-name", scale=2)
                new_role = gr.Dropdown(["annotator", "admin"], value="annotator", label="Role",
                                       elem_id="users-role")
                create = gr.Button("Create user", variant="primary", elem_id="users-create")
            created = gr.HTML(elem_id="users-created")
            listing = gr.HTML(elem_id="users-list")
            with gr.Row(equal_height=True):
                revoke_who = gr.Dropdown([], label="User", elem_id="users-revoke-pick", scale=2)
                revoke_confirm = gr.Checkbox(False, label=CONFIRM_REVOKE,
                                             elem_id="users-revoke-confirm")
                revoke = gr.Button("Revoke access", variant="stop", elem_id="users-revoke")
            revoked = gr.HTML(elem_id="users-revoked")
            with gr.Row(equal_height=True):
                # a lost or leaked token (shown once), or access given back after a revoke
                token_who = gr.Dropdown([], label="User", elem_id="users-token-pick", scale=2)
                new_token = gr.Button("New token", elem_id="users-new-token")
            gr.Markdown("### Preference models")
            with gr.Row(equal_height=True):
                fit = gr.Button("Fit preference model from the votes", variant="primary",
                                elem_id="preference-fit")
            fitted = gr.HTML(elem_id="preference-fit-status")
            models = gr.HTML(elem_id="preference-models-box")

        shown = [out, admin_row, who, accounts, listing, revoke_who]
        user.change(on_login, user, shown, api_visibility="private")
        refresh.click(on_login, user, shown, api_visibility="private")
        gr.on([user.change, refresh.click, *([tab.select] if tab is not None else [])],
              token_choices, user, token_who, show_progress="hidden", api_visibility="private")
        user.change(models_html, user, models, api_visibility="private")
        refresh.click(models_html, user, models, api_visibility="private")
        refresh.click(fit_update, [user, fitted], fitted, api_visibility="private")
        if tab is not None:  # shown again (e.g. after voting in the arena): current numbers
            tab.select(on_login, user, shown, show_progress="hidden", api_visibility="private")
            tab.select(models_html, user, models, show_progress="hidden",
                       api_visibility="private")
            tab.select(fit_update, [user, fitted], fitted, show_progress="hidden",
                       api_visibility="private")
        fit.click(lambda u: (fit_now(enqueuer, u), models_html(u)), user, [fitted, models],
                  api_visibility="private")
        who.change(excluded_of, [user, who, excluded], excluded, api_visibility="private")
        apply.click(set_excluded, [user, who, excluded], [status, out],
                    api_visibility="private")

        def after(msg: str, user_state: dict | None):
            return (msg, *on_login(user_state))

        def create_and_refresh(user_state: dict | None, name: str, role: str):
            msg, name_field = create_from_form(user_state, name, role)
            return (*after(msg, user_state), name_field, token_choices(user_state))

        create.click(create_and_refresh, [user, new_name, new_role],
                     [created, *shown, new_name, token_who], api_visibility="private")

        def revoke_and_refresh(user_state: dict | None, user_id: int | None, confirmed: bool):
            msg, done = _revoke(user_state, user_id, confirmed)
            refreshed = after(msg, user_state)
            if not done:  # the pick and its tick stay, to be corrected (as Delete dataset's)
                return (*refreshed[:-1], gr.skip(), gr.skip())
            # the confirmation is for one revocation: the next one is ticked again
            return (*refreshed, False)

        def new_token_and_refresh(user_state: dict | None, user_id: int | None):
            msg = replace_account_token(user_state, user_id)
            return (*after(msg, user_state), token_choices(user_state))

        new_token.click(new_token_and_refresh, [user, token_who], [created, *shown, token_who],
                        api_visibility="private")

        revoke.click(revoke_and_refresh, [user, revoke_who, revoke_confirm],
                     [revoked, *shown, revoke_confirm], api_visibility="private")
        # a confirmation is for the user it was given for: another pick takes a new one
        revoke_who.change(lambda: False, None, revoke_confirm, api_visibility="private")
        # a message is about the user it was given for: the admin picking another takes it
        # off the screen (`.input`: the user's picks only; a revoke's own update of the list
        # keeps its answer)
        revoke_who.input(lambda: "", None, revoked, api_visibility="private")
        who.input(lambda: "", None, status, api_visibility="private")
        # the new user's token is shown once: any other action of the page (or a logout, or
        # another admin's login in this tab) takes it off the screen, so it never stays
        # beside a user since revoked, nor for whoever uses the page next
        gr.on([user.change, refresh.click, apply.click, revoke.click, fit.click,
               *([tab.select] if tab is not None else [])],
              forget_token, None, created, show_progress="hidden", api_visibility="private")
    return page
