"""Leaderboard: Bradley-Terry ratings of checkpoints with 95% bootstrap intervals, the win-rate
matrix, votes per pair, each checkpoint's automatic-reward means beside its rating, and
"Evaluate these checkpoints" (an evaluate job: the same prompts and seeds from each checkpoint,
scored with the rewards named, which the arena then serves as cross-checkpoint pairs; every
problem with the form at once, each beside its field)."""

from __future__ import annotations

from typing import Any

import gradio as gr

from app.errors import BadRequest, Invalid
from app.job_kinds import KINDS, SPLITS
from app.limits import DEFAULT_BOOTSTRAP, MAX_BOOTSTRAP
from app.services import checkpoints, leaderboard
from app.services import jobs as jobs_svc
from app.services.jobs import Enqueuer
from app.ui.common import (
    Raw,
    admin_or_none,
    caller,
    dataset_options,
    error_text,
    esc,
    field_error,
    fmt,
    notice,
    number,
    session,
    table,
    whole_number,
)


def ratings_html(board: dict[str, Any]) -> str:
    rows = board["checkpoints"]
    if not rows:
        return notice("No cross-checkpoint votes or reward evaluations yet: evaluate two or "
                      "more checkpoints, then vote in the arena.")
    rated = [r for r in rows if r["rating"] is not None]
    rewards = board.get("rewards") or []
    names = {r["checkpoint_id"]: r["name"] for r in rows}
    lo = min((r["ci_low"] for r in rated), default=0.0)
    hi = max((r["ci_high"] for r in rated), default=1.0)
    span = max(hi - lo, 1e-9)

    def bar(r: dict[str, Any]) -> Raw:
        if r["rating"] is None:
            return Raw("")
        left = (r["ci_low"] - lo) / span * 100
        width = max((r["ci_high"] - r["ci_low"]) / span * 100, 0.5)
        dot = (r["rating"] - lo) / span * 100
        return Raw(f'<div style="position:relative;height:12px;min-width:160px;'
                   f'background:#f4f4f5"><div style="position:absolute;left:{left:.1f}%;'
                   f'width:{width:.1f}%;height:100%;background:#93c5fd"></div><div style="'
                   f'position:absolute;left:calc({dot:.1f}% - 3px);width:6px;height:100%;'
                   f'background:#1d4ed8"></div></div>')

    # a reward column whose means come from different prompt sets (or seeds) says so: a
    # checkpoint scored on the eval split and one on 8 shapes prompts are not ranked by it
    # (n is prompts x seeds, so the whole description compares as the prompt set and seeds do)
    mixed = [w for w in rewards
             if len({r.get("score_sources", {}).get(w) for r in rows
                     if w in r.get("scores", {})}) > 1]

    def score(r: dict[str, Any], reward: str) -> Raw:
        value = r.get("scores", {}).get(reward)
        if value is None:
            return Raw("–")
        source = r.get("score_sources", {}).get(reward, "")
        return Raw(f'<span data-reward="{esc(reward)}" title="{esc(source)}">'
                   f'{esc(fmt(value, 3))}</span>'
                   + (f'<br><small class="ngs-score-source">{esc(source)}</small>'
                      if reward in mixed else ""))

    # the automatic-reward means stand beside the human rating: where they disagree, the
    # policy may be gaming a reward (or the raters see what no reward measures)
    resampled = board["bootstrap"] > 0  # no resamples: a rating without an interval

    def interval(r: dict[str, Any]) -> Raw | str:
        if r["rating"] is None:
            return "no votes"
        if not resampled:
            return "–"
        # the numbers and the bar that draws them on the board's common scale, in one cell
        return Raw(f"{r['ci_low']:.0f} – {r['ci_high']:.0f}{bar(r).html}")

    ranking = table(
        ["rank", "checkpoint", "rating", "95% interval", "votes", "win rate", *rewards],
        [[i + 1 if r["rating"] is not None else "–", f"{r['name']} (#{r['checkpoint_id']})",
          f"{r['rating']:.0f}" if r["rating"] is not None else "–", interval(r),
          r["num_votes"], fmt(r["win_rate"], 2), *[score(r, w) for w in rewards]]
         for i, r in enumerate(rows)], "ngs-ratings")
    ids = [r["checkpoint_id"] for r in rated]
    cell = {(p["checkpoint_id"], p["opponent_id"]): p for p in board["pairs"]}
    matrix = table(
        ["row beats column", *[names[c] for c in ids]],
        [[names[a], *[("–" if a == b else (f"{cell[(a, b)]['win_rate']:.2f} "
                                          f"(n={cell[(a, b)]['num_votes']})"
                                          if (a, b) in cell else "")) for b in ids]]
         for a in ids], "ngs-matrix")
    per_pair = table(
        ["checkpoint", "opponent", "votes", "win rate of the first"],
        [[names[p["checkpoint_id"]], names[p["opponent_id"]], p["num_votes"],
          fmt(p["win_rate"], 2)] for p in board["pairs"]
         if ids.index(p["checkpoint_id"]) < ids.index(p["opponent_id"])], "ngs-pairs")
    scores_note = (f" Reward columns: the mean of each automatic reward from the newest "
                   f"evaluate job that scored it ({', '.join(rewards)}); hover a value for "
                   f"the prompts it was scored on." if rewards else "")
    if mixed:
        scores_note += (f" Scored on different prompt sets, so not comparable down the "
                        f"column: {', '.join(mixed)} (each value says on what).")
    intervals = (f"intervals from {board['bootstrap']} bootstrap resamples" if resampled
                 else "no intervals (0 bootstrap resamples)")
    # the pair tables only once two checkpoints have met: else a header and nothing under it
    pairs = (f"<h4>Win rates</h4>{matrix}<h4>Votes per pair</h4>{per_pair}" if board["pairs"]
             else notice("No checkpoint has met another in a vote yet: the win rates and "
                         "votes per pair appear with the first cross-checkpoint vote."))
    return (f'<div id="leaderboard" data-n="{len(rows)}" data-rated="{len(rated)}">'
            f'{board["num_votes"]} clean cross-checkpoint votes; {intervals}.'
            f"{esc(scores_note)}{ranking}{pairs}</div>")


BOOTSTRAP_LABEL = "Bootstrap resamples"


def bootstrap_count(bootstrap: Any) -> int:
    """The "Bootstrap resamples" field as GET /api/leaderboard takes it (a whole number from
    0 to MAX_BOOTSTRAP), or BadRequest naming the field: the slider it replaced sent 0 for a
    typed -5 (and `int()` made 1.5 one resample) without a word."""
    return whole_number(bootstrap, BOOTSTRAP_LABEL, 0, MAX_BOOTSTRAP)


def bootstrap_error(bootstrap: Any) -> str:
    """The error box beside the "Bootstrap resamples" field: what is wrong with its value
    (empty: nothing)."""
    try:
        bootstrap_count(bootstrap)
    except BadRequest as exc:
        return field_error(exc.message.removeprefix(f"{BOOTSTRAP_LABEL}: "))
    return ""


def show(user_state: dict | None, bootstrap: Any) -> str:
    try:
        caller(user_state, "admin")
        resamples = bootstrap_count(bootstrap)
        with session() as s:
            board = leaderboard.compute(s, bootstrap=resamples)
        return ratings_html(board)
    except Exception as exc:  # noqa: BLE001
        return notice(error_text(exc), "error")


def checkpoint_choices() -> list[tuple[str, int]]:
    with session() as s:
        rows, _ = checkpoints.list_checkpoints(s, limit=500)
        return [(f"{c.name} (#{c.id})", c.id) for c in rows]


def max_seeds() -> int:
    """How many seeds an evaluate job takes (its config's own limit, read from it)."""
    from annotated_types import MaxLen

    from app.job_kinds import EvaluateConfig

    meta = EvaluateConfig.model_fields["seeds"].metadata
    return next((m.max_length for m in meta if isinstance(m, MaxLen)), 1000)


def dataset_choices() -> list[tuple[str, int]]:
    """Where the evaluated prompts come from: a dataset's split, or (0) the shapes world's."""
    return [("the shapes world's 48 prompts", 0), *dataset_options()]


# The evaluate form's fields: the config field the service's errors name -> the label the form
# shows (the service names config fields; the user sees labels). Each has an error box
# `#leaderboard-err-<field>` beside it: the Jobs page's boxes are `#err-<field>`, in the same
# document, and both forms have a dataset_id.
EVALUATE_FIELDS: dict[str, str] = {
    "checkpoint_ids": "Checkpoints", "seeds": "Seeds per prompt", "reward_names": "Rewards",
    "dataset_id": "Held-out prompts", "split": "Split", "include_base": "Include the base model"}
SEEDS_LABEL = EVALUATE_FIELDS["seeds"]


def launch_evaluate(enqueuer: Enqueuer | None, user_state: dict | None, ids: list[int] | None,
                    seeds: float | None, rewards: str | None = None,
                    dataset_id: float | None = None, split: str | None = None,
                    include_base: bool = False) -> tuple[int | None, dict[str, list[str]]]:
    """Launch an evaluate job from the form's values: the job id, or None and every problem
    at once by config field (the service's `validate_config` finds them, as for
    POST /api/jobs). `rewards` is a comma-separated list of reward names (empty: the model's
    defaults); `dataset_id` (0 or None: the shapes world's prompts) and its `split` are the
    held-out prompts (a FLUX or SD3 checkpoint is evaluated on a dataset's, as the paper on
    HPDv2's test set); `include_base` also samples the checkpoints' base model, which joins
    the board. A caller who may not launch raises, as anything not about the form."""
    user = caller(user_state, KINDS["evaluate"].launch_role)
    found: dict[str, list[str]] = {}
    if not ids:
        found["checkpoint_ids"] = ["pick one checkpoint to score, or two or more to compare"]
    names = [n.strip() for n in (rewards or "").split(",") if n.strip()]
    config: dict[str, Any] = {"checkpoint_ids": [int(i) for i in ids or []],
                              "reward_names": names, "include_base": bool(include_base)}
    try:
        # the field's own limits: 0 used to become 4 (`seeds or 4`), and -2 an empty list the
        # service then named ("seeds: ...") though the user typed a count
        config["seeds"] = list(range(whole_number(seeds, SEEDS_LABEL, 1, max_seeds())))
    except BadRequest as exc:
        found["seeds"] = [exc.message.removeprefix(f"{SEEDS_LABEL}: ")]
    if dataset_id:
        config.update(dataset_id=int(dataset_id), split=split or "eval")
    own = set(found)  # the service would repeat these in its own words
    try:
        with session() as s:
            if not found:
                return jobs_svc.launch_job(s, enqueuer, "evaluate", config, user=user).id, {}
            # the values the form could read are still checked, so every problem shows at once
            # (a seed count it could not read leaves the config's default seeds in its place)
            jobs_svc.validate_config(s, "evaluate", config)
    except Invalid as exc:
        for err in exc.details.get("errors") or [{"field": exc.details.get("field") or "config",
                                                  "message": exc.message}]:
            field, message = err["field"], err["message"]
            if field == "preference_model":
                # the form has no such field: 'preference' typed in Rewards asked for it, so
                # it is said there, in the page's words
                field = "reward_names"
                message = message.replace("reward_names has 'preference'", "'preference' is "
                                          "among the rewards").replace(
                    "run a fit_preference job first", "fit one on the Annotators page (\"Fit "
                    "preference model from the votes\"), or leave 'preference' out")
            if field not in own:
                found.setdefault(field, []).append(message)
    return None, found


def launched_html(job_id: int, n_checkpoints: int, include_base: bool = False) -> str:
    n_checkpoints += bool(include_base)
    pairs = ("; its images go to the arena as cross-checkpoint pairs" if n_checkpoints > 1
             else "")
    return (f'<div class="ngs-notice ngs-ok" id="evaluate-launched" data-job="{job_id}">'
            f"Evaluate job {job_id} queued for {n_checkpoints} checkpoint(s){pairs}; the reward "
            "means appear here when it finishes.</div>")


def _label(field: str) -> str:
    return EVALUATE_FIELDS.get(field, field)


def evaluate(enqueuer: Enqueuer | None, user_state: dict | None, ids: list[int] | None,
             seeds: float | None, rewards: str | None = None, dataset_id: float | None = None,
             split: str | None = None, include_base: bool = False) -> str:
    """`launch_evaluate` as one notice: the job launched, or every problem after its field's
    label (`data-field` holds the config field). The page's form shows each problem beside
    its field instead (`evaluate_form`)."""
    try:
        job_id, found = launch_evaluate(enqueuer, user_state, ids, seeds, rewards, dataset_id,
                                        split, include_base)
    except Exception as exc:  # noqa: BLE001
        return notice(error_text(exc), "error")
    if job_id is not None:
        return launched_html(job_id, len(ids or []), include_base)
    problems = "; ".join(f'<span data-field="{esc(f)}">{esc(_label(f))}</span>: {esc(m)}'
                         for f, messages in found.items() for m in messages)
    return f'<div class="ngs-notice ngs-error">{problems}</div>'


def evaluate_form(enqueuer: Enqueuer | None, user_state: dict | None, ids: list[int] | None,
                  seeds: float | None, rewards: str | None = None,
                  dataset_id: float | None = None, split: str | None = None,
                  include_base: bool = False) -> list[str]:
    """What "Evaluate these checkpoints" shows: the status line, then one error box per
    EVALUATE_FIELDS entry, in its order. Every problem shows at once beside its field, and
    the status line names the fields by their labels; a problem with a field the form does
    not have (a checkpoint's model, say) is spelled out in the status line."""
    blank = ["" for _ in EVALUATE_FIELDS]
    try:
        job_id, found = launch_evaluate(enqueuer, user_state, ids, seeds, rewards, dataset_id,
                                        split, include_base)
    except Exception as exc:  # noqa: BLE001
        return [notice(error_text(exc), "error"), *blank]
    if job_id is not None:
        return [launched_html(job_id, len(ids or []), include_base), *blank]
    boxed = [_label(f) for f in EVALUATE_FIELDS if f in found]
    others = [f"{f}: {m}" for f, messages in found.items() if f not in EVALUATE_FIELDS
              for m in messages]
    head = f"{len(found)} field(s) need fixing: {', '.join([*boxed, *others])}"
    return [notice(head, "error"), *[field_error(found.get(f)) for f in EVALUATE_FIELDS]]


def on_login(user_state: dict | None, bootstrap: float | None) -> tuple[Any, Any]:
    """A login, a logout or Refresh: the board and the checkpoints for an admin (the role is
    the server's, re-read from the token); a revoked or unknown token gets an error.
    Outputs: the board, the checkpoint picker, the prompt-set picker."""
    try:
        if admin_or_none(user_state) is None:
            return gr.skip(), gr.skip(), gr.skip()
    except Exception as exc:  # noqa: BLE001 - shown to the user
        return notice(error_text(exc), "error"), gr.skip(), gr.skip()
    return (show(user_state, bootstrap), gr.CheckboxGroup(choices=checkpoint_choices()),
            gr.Dropdown(choices=dataset_choices(), value=0))


def on_tab_shown(user_state: dict | None, bootstrap: float | None) -> tuple[Any, Any, Any]:
    """The tab is shown: the board as the votes and evaluations stand now (they come in while
    another tab is open), and the checkpoint and prompt-set pickers' choices (checkpoints and
    datasets come and go elsewhere); what is picked stays picked."""
    try:
        if admin_or_none(user_state) is None:
            return gr.skip(), gr.skip(), gr.skip()
    except Exception:  # noqa: BLE001 - a revoked token: on_login says so on the next login
        return gr.skip(), gr.skip(), gr.skip()
    return (show(user_state, bootstrap), gr.CheckboxGroup(choices=checkpoint_choices()),
            gr.Dropdown(choices=dataset_choices()))


def build_leaderboard(user: gr.State, tab: gr.Tab | None = None,
                      enqueuer: Enqueuer | None = None) -> gr.Blocks:
    with gr.Blocks() as page:
        with gr.Row(equal_height=False):
            # a number field, not a slider: Gradio's slider sent 0 for a typed -5 (its box
            # still showing -5). The handler checks the API's range and the error shows
            # beside the field (ngs-field: its red border, common.CSS)
            with gr.Column(elem_classes=["ngs-field"]):
                bootstrap = number(DEFAULT_BOOTSTRAP, label=BOOTSTRAP_LABEL, minimum=0,
                                   maximum=MAX_BOOTSTRAP, step=50,
                                   elem_id="leaderboard-bootstrap")
                bootstrap_err = gr.HTML(elem_id="leaderboard-err-bootstrap")
            refresh = gr.Button("Refresh", elem_id="leaderboard-refresh")
        board = gr.HTML(elem_id="leaderboard-box")
        gr.Markdown("### Evaluate these checkpoints")
        errors: dict[str, Any] = {}  # each field's error box, beside it

        def error_box(field: str) -> None:
            errors[field] = gr.HTML(elem_id=f"leaderboard-err-{field}")

        with gr.Row(equal_height=False):
            with gr.Column(scale=3):
                pick = gr.CheckboxGroup([], label=EVALUATE_FIELDS["checkpoint_ids"],
                                        elem_id="leaderboard-ckpts")
                error_box("checkpoint_ids")
                with_base = gr.Checkbox(False, label=EVALUATE_FIELDS["include_base"],
                                        info="sample the model they were fine-tuned from too: "
                                        "it joins the board and the arena's pairs",
                                        elem_id="leaderboard-include-base")
                error_box("include_base")
            # ngs-field: a text or number field with an error beside it takes the red border
            # (common.CSS), as the job form's do
            with gr.Column(elem_classes=["ngs-field"]):
                # no precision: 1.5 gets the field's error instead of becoming 2
                seeds = gr.Number(4, label=SEEDS_LABEL, elem_id="leaderboard-seeds")
                error_box("seeds")
            with gr.Column(elem_classes=["ngs-field"]):
                rewards = gr.Textbox("", label=EVALUATE_FIELDS["reward_names"],
                                     elem_id="leaderboard-rewards",
                                     placeholder="e.g. hpsv2,pickscore (empty: the model's)")
                error_box("reward_names")
        with gr.Row(equal_height=False):
            with gr.Column(scale=3):
                prompt_set = gr.Dropdown([("the shapes world's 48 prompts", 0)], value=0,
                                         label=EVALUATE_FIELDS["dataset_id"],
                                         elem_id="leaderboard-dataset")
                error_box("dataset_id")
            with gr.Column():
                # the eval split first: the one an evaluation reads unless told otherwise
                split = gr.Radio([*reversed(SPLITS), "all"], value="eval",
                                 label=EVALUATE_FIELDS["split"], elem_id="leaderboard-split")
                error_box("split")
            go = gr.Button("Evaluate these checkpoints", variant="primary",
                           elem_id="leaderboard-evaluate")
        status = gr.HTML(elem_id="leaderboard-status")

        # the board's events also fill the box beside "Bootstrap resamples": the board says
        # what is wrong, and so does the field (emptied once the value is fixed)
        def board_login(u: dict | None, b: Any) -> tuple[Any, ...]:
            return (*on_login(u, b), bootstrap_error(b))

        def board_shown(u: dict | None, b: Any) -> tuple[Any, ...]:
            return (*on_tab_shown(u, b), bootstrap_error(b))

        board_outputs = [board, pick, prompt_set, bootstrap_err]
        user.change(board_login, [user, bootstrap], board_outputs, api_visibility="private")
        refresh.click(board_login, [user, bootstrap], board_outputs, api_visibility="private")
        if tab is not None:
            tab.select(board_shown, [user, bootstrap], board_outputs, show_progress="hidden",
                       api_visibility="private")
        go.click(lambda u, i, n, r, d, sp, b=False: evaluate_form(enqueuer, u, i, n, r, d, sp,
                                                                  b),
                 [user, pick, seeds, rewards, prompt_set, split, with_base],
                 [status, *[errors[f] for f in EVALUATE_FIELDS]], api_visibility="private")
    return page
