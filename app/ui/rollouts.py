"""Rollouts: filter by job, iteration and prompt (all of them at once, as GET /api/rollouts
does; "(all jobs)" lifts the job filter); each group is one row of its G images, sorted by
advantage (else reward), with a named reward and the advantage under each and the anchors
outlined; a click on an image opens its details (seed, member index, sigma, solver,
checkpoint, every reward). Large images (a real model's) show as their stored thumbnails,
with a link to the full image."""

from __future__ import annotations

import math
from typing import Any

import gradio as gr

from app.errors import BadRequest
from app.limits import MAX_ID
from app.services import jobs as jobs_svc
from app.services import rollouts
from app.ui.common import (
    admin_or_toast,
    caller,
    error_text,
    esc,
    field_error,
    fmt,
    image_src,
    media_link,
    notice,
    number,
    session,
    whole_number,
)

PAGE_SIZE = 20
# the Job picker's "no job filter" choice; no job has id 0 (ids start at 1)
ALL_JOBS = 0
ALL_JOBS_CHOICE = ("(all jobs)", ALL_JOBS)


def headline_reward(rewards: dict[str, Any]) -> tuple[str, float]:
    """The reward shown under a member's image, named: the only one when there is one; the
    shapes world's `combined` when it was scored (the others are its parts: a sum would count
    them twice); else the sum of the rewards, called that (every reward is in the details)."""
    numbers = {k: float(v) for k, v in rewards.items() if isinstance(v, int | float)}
    if len(numbers) == 1:
        return next(iter(numbers.items()))
    if "combined" in numbers:
        return "combined", numbers["combined"]
    return "sum", sum(numbers.values())


def _rank(member: Any) -> float:
    # a group's members by advantage (the group-normalised reward the run used), else by the
    # shown reward (an evaluate job's single samples have no advantage)
    if member.advantage is not None:
        return float(member.advantage)
    return headline_reward(member.rewards or {})[1]


def group_source(group: Any, details: dict[int, dict[str, Any]]) -> str:
    """Where a group's images came from, for its header: the arena's reveal words
    (`rollouts.source_label`, through `sample_details`), after the job that sampled them when
    that is not a training job sampling its own policy. "job 6 iteration 18 · evaluate" read
    as job 6's iteration 18, where 18 was the evaluated checkpoint's training iteration; now
    "job 6 (evaluate) · checkpoint iter-000018 (#3) of job 2"."""
    d = next((details[m.id] for m in group.samples if m.id in details), None)
    if d is None:  # no member to describe (none is ever recorded without members)
        return f"job {fmt(group.job_id)} ({esc(group.purpose)}) iteration {group.iteration}"
    kind = d["job_kind"] or group.purpose
    if kind == "train" and group.job_id is not None and d["checkpoint_id"] is None:
        # "training job N iteration I": the source is the job itself
        return esc(d["source"])
    return f"job {fmt(group.job_id)} ({esc(kind)}) &middot; {esc(d['source'])}"


def group_html(group: Any, details: dict[int, dict[str, Any]]) -> str:
    """One group as a row; `group` is a RolloutGroup with samples loaded."""
    members = sorted(group.samples, key=_rank, reverse=True)
    head = (f'<div class="ngs-group-head"><b>group {group.id}</b> &middot; '
            f"{esc(group.prompt_text)} &middot; {group_source(group, details)} &middot; "
            f"G={len(members)}</div>")
    cells = []
    for m in members:
        d = details.get(m.id, {})
        thumb = rollouts.thumbnail_of(m.image_path)
        img = (f'<img class="ngs-thumb" alt="sample {m.id}" src="{image_src(thumb)}">' if thumb
               else f'<img alt="sample {m.id}" src="{image_src(m.image_path)}">')
        full = (f'<br><a href="{esc(media_link(m.image_path))}" target="_blank" '
                f'rel="noopener">full image</a>' if thumb else "")
        rewards = ", ".join(f"{esc(k)}={fmt(v, 2)}" for k, v in sorted((m.rewards or {}).items()))
        cls = "ngs-member anchor" if m.is_anchor else "ngs-member"
        name, value = headline_reward(m.rewards or {})
        summed = ", ".join(sorted(m.rewards or {})) if name == "sum" else ""
        label = (f'<span title="the sum of {esc(summed)}">sum</span>' if summed
                 else esc(name))
        cells.append(
            f'<details class="{cls}" data-sample="{m.id}" data-reward="{value:.6f}" '
            f'data-reward-name="{esc(name)}"><summary>'
            f"{img}<br>"
            f"{label} {fmt(value, 2)}<br>adv {fmt(m.advantage, 2)}"
            f'{"<br><b>anchor</b>" if m.is_anchor else ""}</summary>'
            f'<div class="ngs-details">sample {m.id}<br>member {m.member_index}<br>'
            f"seed {group.seed}<br>sigma {fmt(group.sigma, 2)}<br>solver {esc(group.solver)} "
            f"({group.steps} steps)<br>{esc(d.get('source', '–'))}<br>"
            f"{rewards}{full}</div></details>")
    return head + '<div class="ngs-group">' + "".join(cells) + "</div>"


def groups_html(groups: list[Any], session_: Any) -> str:
    if not groups:
        return notice("No rollout groups match.")
    ids = [m.id for g in groups for m in g.samples]
    details = rollouts.sample_details(session_, ids)
    return "".join(group_html(g, details) for g in groups)


def job_choices() -> list[tuple[str, int]]:
    """The Job picker's choices: "(all jobs)" first, then the newest jobs of the kinds that
    sample rollout groups (a fit_preference job never does). The picker takes no typed value,
    so clearing its box put the job back: "(all jobs)" is how to lift it."""
    with session() as s:
        rows, _ = jobs_svc.list_jobs(s, limit=200)
        return [ALL_JOBS_CHOICE, *[(f"#{j.id} {j.kind} ({j.status})", j.id) for j in rows
                                   if j.kind in rollouts.PURPOSES]]


def refresh_jobs(user_state: dict | None) -> Any:
    """The Job picker's choices, for an admin (re-authenticated, never the role the session
    state claims); a revoked or unknown token is an error (Gradio's toast)."""
    if admin_or_toast(user_state) is None:
        return gr.skip()
    return gr.Dropdown(choices=job_choices())


# The filter's checked fields -> the label the page shows. Each has an error box
# `#rollouts-err-<field>` beside it (`build_rollouts`), as the upload and launch forms do.
FILTER_FIELDS: dict[str, str] = {"iteration": "Iteration (empty: all)", "page": "Page"}
# the prompt as the count line repeats it: a 20,000-character filter ran off the page
PROMPT_ECHO_CHARS = 200


def filter_values(iteration: str | None, page_no: Any) -> tuple[int | None, int,
                                                                 dict[str, str]]:
    """The filter's iteration (None: every one) and page under GET /api/rollouts' rules,
    and each problem by field, its message without the label (the box beside the field
    needs none): every problem at once, where the first one used to hide the others. An
    empty Iteration box is every iteration (its label says so); an empty Page box is
    refused, as every number field of the UI (the upload form's too): taking it for page 1
    put a number the user never typed on the page."""
    found: dict[str, str] = {}
    iteration_no, page = None, 1
    label = FILTER_FIELDS["page"]
    try:
        page = whole_number(page_no, label, 1, MAX_ID)
    except BadRequest as exc:
        found["page"] = exc.message.removeprefix(f"{label}: ")
    typed = str(iteration or "").strip()
    label = FILTER_FIELDS["iteration"]
    if typed:
        try:
            iteration_no = whole_number(typed, label, 0, MAX_ID)
        except BadRequest as exc:
            found["iteration"] = exc.message.removeprefix(f"{label}: ")
    # in the page's order, Iteration before Page
    return iteration_no, page, {f: found[f] for f in FILTER_FIELDS if f in found}


def filter_errors(iteration: str | None, page_no: Any) -> tuple[str, ...]:
    """The error boxes beside Iteration and Page, in FILTER_FIELDS' order (empty: fine).
    Run after `show`, which names the same problems with their labels."""
    found = filter_values(iteration, page_no)[2]
    return tuple(field_error(found.get(f)) for f in FILTER_FIELDS)


def shortened(text: str, limit: int = PROMPT_ECHO_CHARS) -> str:
    """`text` cut to `limit` characters, an ellipsis saying it was."""
    return text if len(text) <= limit else text[:limit].rstrip() + "…"


def show(user_state: dict | None, job_id: int | None, iteration: str | None,
         prompt: str, page_no: float | None) -> str:
    try:
        caller(user_state, "admin")
        iteration_no, page_no, found = filter_values(iteration, page_no)
        if found:
            raise BadRequest("; ".join(f"{FILTER_FIELDS[f]}: {m}" for f, m in found.items()))
        query = {"job_id": int(job_id) if job_id else None, "iteration": iteration_no,
                 "prompt": (prompt or "").strip() or None, "limit": PAGE_SIZE}
        with session() as s:
            groups, total = rollouts.list_groups(s, **query, offset=(page_no - 1) * PAGE_SIZE)
            pages = max(1, math.ceil(total / PAGE_SIZE))
            past = page_no > pages
            if past and total:  # past the end: the last page, saying so
                groups, total = rollouts.list_groups(s, **query,
                                                     offset=(pages - 1) * PAGE_SIZE)
            body = groups_html(groups, s)
    except Exception as exc:  # noqa: BLE001 - shown to the user
        return notice(error_text(exc), "error")
    where = (f"page {pages} of {pages} (page {page_no} is past the end)" if past
             else f"page {page_no} of {pages}")
    # the filters combine: say which ones the count is under, so that "0 group(s)" for a
    # prompt reads as "not in this job" rather than "never sampled"
    filters = [f"job {query['job_id']}" if query["job_id"] is not None else "",
               f"iteration {query['iteration']}" if query["iteration"] is not None else "",
               f"prompt “{shortened(query['prompt'])}”" if query["prompt"] else ""]
    under = ", ".join(f for f in filters if f)
    return (f'<div id="rollouts-count" data-total="{total}" data-page="{min(page_no, pages)}">'
            f"{total} group(s){esc(f' of {under}' if under else '')}; {where}</div>{body}")


def build_rollouts(user: gr.State, tab: gr.Tab | None = None) -> gr.Blocks:
    with gr.Blocks() as page:
        with gr.Row():
            job = gr.Dropdown(label="Job", choices=[ALL_JOBS_CHOICE], value=ALL_JOBS,
                              allow_custom_value=False, elem_id="rollouts-job")
            boxes: dict[str, Any] = {}  # each checked field's error box, under it
            # ngs-field: the field with an error under it takes the red border (common.CSS);
            # as narrow as a field of the row may be (a Column's own minimum is 320 px)
            with gr.Column(min_width=160, elem_classes=["ngs-field"]):
                iteration = gr.Textbox(label=FILTER_FIELDS["iteration"],
                                       elem_id="rollouts-iteration")
                boxes["iteration"] = gr.HTML(elem_id="rollouts-err-iteration")
            # the filters combine (a group must match all of them, as in GET /api/rollouts): a
            # prompt within one job is how it changed over training; "(all jobs)" for every job
            prompt = gr.Textbox(label="Prompt (exact text; empty: all; combines with Job and "
                                "Iteration)", elem_id="rollouts-prompt")
            # its minimum guides the browser only: Gradio's own check of it answered 0 with a
            # toast naming no field and left the old results on screen; `show` says what
            # Page allows, as it does for 2.5 (common.number)
            with gr.Column(min_width=160, elem_classes=["ngs-field"]):
                page_no = number(1, label=FILTER_FIELDS["page"], minimum=1,
                                 elem_id="rollouts-page")
                boxes["page"] = gr.HTML(elem_id="rollouts-err-page")
            go = gr.Button("Show", variant="primary", elem_id="rollouts-show")
        gr.HTML("<small>Each group's members sorted by advantage (else reward); anchors are "
                "outlined in orange; click an image for its details.</small>")
        out = gr.HTML(elem_id="rollouts-groups")

        user.change(refresh_jobs, user, job, api_visibility="private")
        job.focus(refresh_jobs, user, job, api_visibility="private")
        # Enter in any filter box, or a job picked from the list (by the user: the list's
        # own refreshes change no filter), applies the filters as Show does
        triggers = [go.click, prompt.submit, iteration.submit, page_no.submit, job.input]
        if tab is not None:  # shown: the groups under the filters as they stand, no click
            triggers.append(tab.select)
        for trigger in triggers:
            # the boxes beside the fields after the groups (or the problems, each after its
            # field's label): `show` stays the one output of the page's filter
            trigger(show, [user, job, iteration, prompt, page_no], out,
                    api_visibility="private").then(
                filter_errors, [iteration, page_no], [boxes[f] for f in FILTER_FIELDS],
                show_progress="hidden", api_visibility="private")
    return page
