"""Annotators: votes per annotator, median decision time, agreement with the majority and with
the automatic reward on shared pairs (`app.services.annotators.stats`). Admins see everyone and
the switch that excludes an annotator's votes from fitting; annotators see their own row."""

from __future__ import annotations

import gradio as gr

from app.services import annotators as svc
from app.ui.common import Raw, caller, error_text, esc, notice, session, table


def _pct(x: float | None, n: int) -> str:
    return "–" if x is None else f"{100 * x:.0f}% (n={n})"


def stats_html(user_state: dict | None) -> str:
    try:
        user = caller(user_state)
        with session() as s:
            rows = svc.stats(s, annotator_id=None if user.role == "admin" else user.id)
    except Exception as exc:  # noqa: BLE001
        return notice(error_text(exc), "error")
    body = table(
        ["user", "role", "votes", "clean votes", "median latency", "agrees with majority",
         "agrees with reward", "excluded"],
        [[f"{r['name']} (#{r['user_id']})", r["role"], r["votes"], r["clean_votes"],
          "–" if r["median_latency_ms"] is None else f"{r['median_latency_ms'] / 1000:.1f} s",
          _pct(r["majority_agreement"], r["majority_n"]),
          _pct(r["reward_agreement"], r["reward_n"]),
          Raw(f'<span class="ngs-excluded" data-user="{esc(r["name"])}">'
              f'{"yes" if r["excluded"] else "no"}</span>')] for r in rows],
        "ngs-annotators")
    return f'<div id="annotators-table">{body}</div>'


def user_choices() -> list[tuple[str, int]]:
    with session() as s:
        return [(f"{r['name']} (#{r['user_id']})", r["user_id"]) for r in svc.stats(s)]


def set_excluded(user_state: dict | None, user_id: int | None, excluded: bool) -> tuple[str, str]:
    try:
        caller(user_state, "admin")
        if not user_id:
            raise ValueError("pick an annotator")
        with session() as s:
            changed = svc.set_excluded(s, int(user_id), bool(excluded))
        verb = "excluded" if excluded else "included again"
        msg = notice(f"User #{user_id} {verb}; {changed} vote(s) updated.", "ok")
    except Exception as exc:  # noqa: BLE001
        msg = notice(error_text(exc), "error")
    return msg, stats_html(user_state)


def build_annotators(user: gr.State) -> gr.Blocks:
    with gr.Blocks() as page:
        refresh = gr.Button("Refresh", size="sm", elem_id="annotators-refresh")
        out = gr.HTML(elem_id="annotators-box")
        with gr.Row(visible=False) as admin_row:
            who = gr.Dropdown([], label="Annotator", elem_id="annotators-pick")
            excluded = gr.Checkbox(label="Exclude this annotator's votes from fitting",
                                   elem_id="annotators-exclude")
            apply = gr.Button("Apply", elem_id="annotators-apply")
        status = gr.HTML(elem_id="annotators-status")

        def on_login(user_state: dict | None):
            admin = bool(user_state) and user_state.get("role") == "admin"
            return (stats_html(user_state) if user_state else "",
                    gr.Row(visible=admin),
                    gr.Dropdown(choices=user_choices()) if admin else gr.skip())

        user.change(on_login, user, [out, admin_row, who], api_visibility="private")
        refresh.click(on_login, user, [out, admin_row, who], api_visibility="private")
        apply.click(set_excluded, [user, who, excluded], [status, out],
                    api_visibility="private")
    return page
