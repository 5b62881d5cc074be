"""Jobs: a launch form built from `TrainConfig.describe()` (fields grouped in sections, the
rarely changed ones folded away; help as tooltips; presets; every validation error at once,
each beside the field it names), the job list with progress bars, and a job page
with live plots polled by a `gr.Timer`, the newest sample grid, and Cancel / Resume / "Send
newest rollouts to the arena" (a rollout job from the job's newest checkpoint, whose groups the
arena then serves)."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import gradio as gr
from sqlalchemy import select

from app.errors import BadRequest
from app.job_kinds import KINDS
from app.models import ACTIVE_JOB_STATUSES, Checkpoint, JobStatus
from app.services import checkpoints, rollouts, workers
from app.services import jobs as svc
from app.services.jobs import Enqueuer
from app.ui.common import (
    Raw,
    admin_or_toast,
    as_typed,
    caller,
    dataset_options,
    error_text,
    esc,
    field_error,
    fmt,
    line_plot,
    notice,
    number,
    progress_bar,
    session,
    table,
)
from app.ui.rollouts import groups_html

DEFAULTS = "(defaults)"
# the field the service's errors about the Dataset picker name (the request's dataset_id)
DATASET_FIELD = "dataset_id"
POLL_SECONDS = 1.5

# The form's sections: (title, fields shown, fields folded away as rarely changed). Layout
# only: what a field means and allows comes from TrainConfig.describe(). A field listed
# nowhere (a new one) is folded into the section of its describe() group (FALLBACK).
SECTIONS: list[tuple[str, list[str], list[str]]] = [
    ("Model", ["model", "model_path", "base_checkpoint", "finetune"],
     ["lora_rank", "lora_alpha", "lora_target_modules", "resolution", "guidance_scale",
      "mixed_precision", "gradient_checkpointing", "gradient_checkpointing_fraction",
      "torch_compile", "parallelism"]),
    ("Rollouts", ["prompts", "prompts_per_iteration", "group_size", "rollout_steps"],
     ["rollout_solver", "rollout_batch_size"]),
    ("Neighbor GRPO", ["method", "sigma", "num_anchors", "num_train_timesteps"],
     ["quasi_norm_p", "temperature", "old_policy", "kl_coefficient", "eta"]),
    ("Optimisation", ["learning_rate", "clip_range"],
     ["weight_decay", "max_grad_norm", "train_batch_size", "shuffle_advantages"]),
    ("Rewards", ["reward_weights", "preference_model"],
     ["preference_uncertainty_penalty", "preference_refit_every", "reward_model_paths",
      "reward_server_url"]),
    ("Schedule", ["iterations", "sample_every", "checkpoint_every", "seed", "device"],
     ["eval_every", "eval_seeds"]),
]
FALLBACK = {"model": "Model", "algorithm": "Neighbor GRPO", "run": "Schedule",
            "studio": "Schedule"}


def sections() -> list[tuple[str, list[dict[str, Any]], list[dict[str, Any]]]]:
    """SECTIONS with each name replaced by its describe() entry; every field exactly once."""
    by_name = {d["name"]: d for d in describe()}
    out = [(title, [by_name.pop(n) for n in shown if n in by_name],
            [by_name.pop(n) for n in folded if n in by_name]) for title, shown, folded in SECTIONS]
    for d in list(by_name.values()):
        title = FALLBACK.get(d["group"], SECTIONS[-1][0])
        next(sec for sec in out if sec[0] == title)[2].append(d)
    return out


def _in_sentence(title: str) -> str:
    """A section title as a sentence writes it: "Optimisation" -> "optimisation", a name in
    capitals kept ("Neighbor GRPO" -> "neighbor GRPO")."""
    return " ".join(w if w.isupper() else w.lower() for w in title.split())


def _slug(title: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in title.lower())


def describe() -> list[dict[str, Any]]:
    from trainer.config import TrainConfig

    return TrainConfig.describe()


def presets() -> dict[str, dict[str, Any]]:
    from trainer.config import PRESETS

    return PRESETS


def _tooltip(d: dict[str, Any]) -> str:
    extra = []
    if d["min"] is not None or d["max"] is not None:
        extra.append(f"range [{d['min']}, {d['max']}]")
    extra.append(f"default {json.dumps(d['default'])}")
    return f"{d['help']} ({'; '.join(extra)})"


def field_component(d: dict[str, Any], value: Any) -> gr.components.Component:
    kw = {"label": d["name"], "elem_id": f"cfg-{d['name']}", "elem_classes": ["ngs-help"]}
    if d["type"] == "bool":
        return gr.Checkbox(value=bool(value), **kw)
    if d["choices"]:
        return gr.Dropdown(choices=d["choices"], value=value, **kw)
    if d["name"] == "model_path":
        # the complete model directories under MODELS_DIR of the model chosen, filled at login
        # and refreshed when the model changes or the tab is shown (model_path_choices); a
        # path typed by hand is kept, and the server's error about it shows beside the field
        return gr.Dropdown(choices=[], value=value, allow_custom_value=True, filterable=True,
                           **kw)
    if d["type"] in ("int", "float"):
        # the field's range is the browser's min and max (its arrow keys stop there), checked
        # by the server, whose error names the field and shows beside it (common.number). A
        # float steps by "any": with step 1 the browser took 0.3 for off-step, and a finer step
        # counts from the minimum (1e-9 for learning_rate), so most defaults would still be off
        # it. No precision: precision=0 rounds 1.5 to 2 before any handler sees it, and
        # parse_form's "whole number" error beside the field would never show
        return number(value, minimum=d["min"], maximum=d["max"],
                      step=1 if d["type"] == "int" else "any", **kw)
    # `value` is the form's value (form_values): a list or dict field is already JSON text
    return gr.Textbox(value=value, **kw)


def form_values(preset: str | None) -> list[Any]:
    """The form's values in describe() order: list and dict fields as JSON text."""
    data = dict(presets().get(preset or "", {}))
    out = []
    for d in describe():
        v = data.get(d["name"], d["default"])
        out.append(json.dumps(v) if d["type"] in ("list", "dict") else v)
    return out


def _form_value(d: dict[str, Any], value: Any) -> Any:
    """A form value as its field holds it, for comparing: a list or dict field's JSON text
    parsed (text that does not parse stays text)."""
    if d["type"] in ("list", "dict") and isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def form_for_model(*values: Any) -> list[Any]:
    """Every field when the model changes (`values` and the result in describe() order): a
    field still at a model's starting value (the one a job of that model without a preset
    gets, `model_preset`: flux-lora's or sd3-lora's fields for flux or sd3, the defaults for
    shapes) moves to the new model's, so that the form launches what the API and the CLI do
    for the same fields; a value someone typed or a preset set stays. Then the fields the new
    model refuses go back to their defaults (`fields_for_model`). Only the reward and
    finetune fields followed the model before: flux launched from the form with the shapes
    defaults' batch sizes, learning rate, resolution and LoRA rank."""
    from trainer.config import model_preset
    from trainer.models import model_names

    fields = describe()
    names = [d["name"] for d in fields]
    form = dict(zip(names, values, strict=True))
    starts = [dict(zip(names, form_values(model_preset(m)), strict=True))
              for m in model_names()]
    if form["model"] in model_names():
        new = dict(zip(names, form_values(model_preset(form["model"])), strict=True))
        for d in fields:
            name = d["name"]
            if name != "model" and any(_form_value(d, form[name]) == _form_value(d, start[name])
                                       for start in starts):
                form[name] = new[name]
    reset = fields_for_model(*[form[n] for n in names])
    form.update((n, v) for n, v in zip(MODEL_DEPENDENT_FIELDS, reset, strict=True)
                if v != gr.skip())
    # plain values, the unchanged ones too: a number field takes no update (common.number)
    return [form[n] for n in names]


def model_changed(*values: Any) -> list[Any]:
    """`form_for_model` without the model field, the outputs of the model's change event:
    the model set by its own change handler fired the handler again, and the form never
    settled."""
    names = [d["name"] for d in describe()]
    return [v for n, v in zip(names, form_for_model(*values), strict=True) if n != "model"]


def finetune_for_model(model: str | None, finetune: str | None) -> str | Any:
    """The finetune field when the model changes: a real model with a LoRA preset (flux,
    sd3) takes 'lora' where the field holds the default 'full' (a full fine-tune of FLUX.1
    is 12B trained weights, for several cards with `parallelism` 'fsdp'), and shapes, which
    trains in full only, takes 'full' back."""
    from trainer.config import PRESETS, default_preset

    lora = PRESETS.get(default_preset(model or "shapes"), {}).get("finetune") == "lora"
    if lora and finetune == "full":
        return "lora"
    if not lora and finetune == "lora":
        return "full"
    return gr.skip()


# the fields whose allowed values depend on the model or on finetune: what a real model's
# preset sets (LoRA, its resolution, compilation, checkpointing, guidance) the shapes model or
# a full fine-tune refuses
MODEL_DEPENDENT_FIELDS = ("lora_rank", "lora_alpha", "lora_target_modules", "resolution",
                          "guidance_scale", "mixed_precision", "torch_compile",
                          "gradient_checkpointing", "gradient_checkpointing_fraction")


def fields_for_model(*values: Any) -> list[Any]:
    """The model-dependent fields (MODEL_DEPENDENT_FIELDS, in that order) when the model or
    finetune changes: each one the new choice refuses goes back to its default; the others
    stay. Preset flux-lora then model shapes failed on lora_rank with "... or leave lora_rank
    out", which a form, holding every field, cannot do. `values` are the form's, in
    describe() order; the finetune field follows the model first (`finetune_for_model`, its
    own handler, whose update this one does not see)."""
    names = [d["name"] for d in describe()]
    form = dict(zip(names, values, strict=True))
    if isinstance(finetune := finetune_for_model(form["model"], form["finetune"]), str):
        form["finetune"] = finetune
    defaults = dict(zip(names, form_values(None), strict=True))
    reset: set[str] = set()
    # again after each reset: a default can make another field's value wrong (checkpointing
    # off refuses the preset's gradient_checkpointing_fraction)
    for _round in MODEL_DEPENDENT_FIELDS:
        config, _ = parse_form([form[n] for n in names])
        try:
            with session() as s:
                svc.validate_config(s, "train", config)
            break
        except Exception as exc:  # noqa: BLE001 - only the fields' errors matter here
            refused = {e["field"] for e in getattr(exc, "details", {}).get("errors") or []}
        newly = refused.intersection(MODEL_DEPENDENT_FIELDS) - reset
        if not newly:
            break
        reset |= newly
        form.update({n: defaults[n] for n in newly})
    return [defaults[n] if n in reset else gr.skip() for n in MODEL_DEPENDENT_FIELDS]


def _number(v: Any) -> float | None:
    """A number field's value as a finite float, else None (empty, text, inf, NaN)."""
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def parse_form(values: list[Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The config from the form's values, and per-field parse errors."""
    config, errors = {}, {}
    for d, v in zip(describe(), values, strict=True):
        name = d["name"]
        if d["type"] in ("list", "dict"):
            try:
                config[name] = json.loads(v) if str(v).strip() else ([] if d["type"] == "list"
                                                                       else {})
            except json.JSONDecodeError as exc:
                # json's own words ("Expecting value: line 1 column 1 (char 0)") say where,
                # not what the field wants
                example = '["one red circle"]' if d["type"] == "list" else '{"count": 1.0}'
                errors[name] = (f"not valid JSON ({exc.msg} at character {exc.pos}): write a "
                                f"JSON {'list' if d['type'] == 'list' else 'object'} such as "
                                f"{example}, or leave it empty")
        elif d["type"] == "int":
            x = _number(v)
            if x is None:
                errors[name] = "a whole number is required"
            elif x != int(x):
                errors[name] = f"must be a whole number, got {as_typed(v, x)}"
            else:
                config[name] = int(x)
        elif d["type"] == "float":
            x = _number(v)
            if x is None:
                errors[name] = "a number is required"
            else:
                config[name] = x
        elif d["type"] == "bool":
            config[name] = bool(v)
        else:
            config[name] = "" if v is None else str(v)
    return config, errors


def _error_outputs(names: list[str], found: dict[str, list[str]]) -> list[Any]:
    """The status line and one error box per field (in `names` order)."""
    shown = {n: "; ".join(found[n]) for n in names if n in found}
    others = [f"{f}: {'; '.join(m)}" for f, m in found.items() if f not in shown]
    head = f"{len(found)} field(s) need fixing" + (f" ({'; '.join(others)})" if others else "")
    return [notice(head, "error"), *[field_error(shown.get(n)) for n in names]]


def launch(enqueuer: Enqueuer | None, user_state: dict | None, dataset_id: int | None,
           *values: Any, boxes: list[str] | None = None) -> tuple[int | None, list[Any]]:
    """Validate and launch a train job. Returns the job id (None on an error) and the outputs:
    the status, then one error box per name in `boxes` (default: the config's fields in
    describe() order; the page puts the Dataset picker's, DATASET_FIELD, first). An error
    about a field without a box is named in the status line."""
    names = [d["name"] for d in describe()] if boxes is None else boxes
    blank = ["" for _ in names]
    try:
        user = caller(user_state, KINDS["train"].launch_role)  # the kind says who launches it
    except Exception as exc:  # noqa: BLE001
        return None, [notice(error_text(exc), "error"), *blank]
    config, errors = parse_form(list(values))
    if errors:
        # the fields that parsed are still checked, and the dataset, so every problem shows
        # at once
        found: dict[str, list[str]] = {n: [m] for n, m in errors.items()}
        try:
            with session() as s:
                svc.validate_config(s, "train", config, dataset_id=dataset_id or None)
        except Exception as exc:  # noqa: BLE001
            for err in getattr(exc, "details", {}).get("errors") or []:
                # a check against a field the form could not read compares with that field's
                # default ("must be <= group_size (12)" with group_size empty): left out, said
                # again once that field is fixed
                if err["field"] not in errors and not any(
                        re.search(rf"\b{re.escape(name)}\b", err["message"]) for name in errors):
                    found.setdefault(err["field"], []).append(err["message"])
        return None, _error_outputs(names, found)
    try:
        with session() as s:
            job_id = svc.launch_job(s, enqueuer, "train", config,
                                    dataset_id=dataset_id or None, user=user).id
    except Exception as exc:  # noqa: BLE001
        # the service lists every bad field at once; each message goes beside its field
        found = {}
        for err in getattr(exc, "details", {}).get("errors") or []:
            found.setdefault(err["field"], []).append(err["message"])
        if any(n in found for n in names):
            return None, _error_outputs(names, found)
        return None, [notice(error_text(exc), "error"), *blank]
    return job_id, [f'<div class="ngs-notice ngs-ok" id="launched" data-job="{job_id}">Launched '
            f"train job {job_id}.</div>", *blank]


def jobs_table(rows: list[Any]) -> str:
    out = []
    for j in rows:
        frac = j.progress  # None: a bar at zero
        label = f"{j.iteration}/{j.total_iterations or '?'}"
        out.append([j.id, j.kind, Raw(f'<span class="ngs-status ngs-status-{esc(j.status)}">'
                                      f"{esc(j.status)}</span>"),
                    Raw(progress_bar(frac, label, f"job-progress-{j.id}")),
                    fmt((j.metrics or {}).get("reward_mean")), j.created_at.strftime(
                        "%Y-%m-%d %H:%M:%S") if j.created_at else "", (j.error or "")[:120]])
    return table(["job", "kind", "status", "progress", "reward", "created", "error"], out,
                 "ngs-jobs")


# a checkpoint's reward mean in an evaluate job's metrics (worker.sampling.run_evaluate)
_EVALUATED = re.compile(r"^checkpoint/(\d+)/(.+)$")


def evaluated_ids(job: Any) -> list[int]:
    """The checkpoints an evaluate job's metrics score."""
    return sorted({int(m.group(1)) for key in (job.metrics or {})
                   if (m := _EVALUATED.match(key))})


def checkpoint_names(s: Any, ids: list[int]) -> dict[int, str]:
    """Checkpoint id -> name, for those of `ids` that still exist."""
    return {c.id: c.name for c in s.scalars(select(Checkpoint).where(Checkpoint.id.in_(ids)))}


def results_html(job: Any, names: dict[int, str] | None = None) -> str:
    """What a rollout, evaluate or fit_preference job reports (its latest metrics), in place
    of a train job's curves, which these kinds never draw: an evaluate job's reward means as
    a checkpoint x reward table, anything else as a table of names and values. `names`:
    checkpoint id -> name, so that a checkpoint reads as the leaderboard names it
    ("job2-it21 (#2)"; a deleted one as its id alone)."""
    names = names or {}
    metrics = dict(job.metrics or {})
    if not metrics:
        waits = job.status in (JobStatus.QUEUED, JobStatus.RUNNING)
        return notice("Results appear here as the job reports them." if waits
                      else "This job reported no results.")
    scored: dict[int, dict[str, Any]] = {}
    rest = {}
    for key, value in metrics.items():
        if found := _EVALUATED.match(key):
            scored.setdefault(int(found.group(1)), {})[found.group(2)] = value
        elif key != "checkpoint_id":  # the progress row's, said by the table's rows
            rest[key] = value
    html = '<div class="ngs-results" id="job-results">'
    if scored:
        rewards = sorted({name for row in scored.values() for name in row})
        html += ("<h4>Reward means per checkpoint</h4>"
                 + table(["checkpoint", *rewards],
                         [[f"{names[c]} (#{c})" if c in names else f"#{c}",
                           *[row.get(name) for name in rewards]]
                          for c, row in sorted(scored.items())], "ngs-evaluated"))
    if rest:
        html += ("<h4>Results</h4>"
                 + table(["", "value"], _result_rows(rest), "ngs-job-results"))
    return html + "</div>"


def _result_rows(values: dict[str, Any], prefix: str = "") -> list[list[Any]]:
    """A report's values as rows a person reads: a nested report spread into one row per
    value (`extra.epochs`), an empty one as "none", a missing value (a fit without a held-out
    split) as "–", never JSON's null and {}."""
    rows: list[list[Any]] = []
    for key, value in values.items():
        if isinstance(value, dict) and value:
            rows += _result_rows(value, f"{prefix}{key}.")
        elif isinstance(value, dict | list) and not value:
            rows.append([prefix + key, "none"])
        elif isinstance(value, list):
            rows.append([prefix + key, ", ".join(fmt(v) for v in value)])
        else:  # a number, text, a flag or None: fmt writes None as "–"
            rows.append([prefix + key, value])
    return rows


def plots_html(history: list[Any]) -> str:
    xs = [m.iteration for m in history]

    def col(key: str) -> list[float | None]:
        return [m.metrics.get(key) for m in history]

    mean, std = col("reward_mean"), col("reward_std")
    lo = [None if a is None or b is None else a - b for a, b in zip(mean, std, strict=True)]
    hi = [None if a is None or b is None else a + b for a, b in zip(mean, std, strict=True)]
    # each reward's raw mean (trainer.grpo.reward_metrics logs `reward/<name>`): the blend
    # above can hold still while one reward climbs and another is traded away for it. One
    # plot each, on its own scale: PickScore sits near 20 and HPSv2 near 0.3, and on one
    # axis the smaller one would draw as a flat line
    names = sorted({k.removeprefix("reward/") for m in history for k in m.metrics
                    if k.startswith("reward/")})
    return ('<div class="ngs-plots">'
            + line_plot("reward mean ± std", xs, {"reward mean": mean}, band=(lo, hi),
                        elem_id="plot-reward")
            + "".join(line_plot(f"raw reward: {name}", xs, {name: col(f"reward/{name}")},
                                elem_id=f"plot-reward-{name}") for name in names)
            + line_plot("loss", xs, {"loss": col("loss")}, elem_id="plot-loss")
            + line_plot("clipped fraction", xs, {"clip fraction": col("clip_fraction")},
                        elem_id="plot-clip")
            + line_plot("seconds per iteration", xs, {"seconds": col("seconds")},
                        elem_id="plot-seconds")
            + "</div>")


def job_header(job: Any, waiting: str | None = None) -> str:
    frac = job.progress
    return (f'<div id="job-detail" data-job="{job.id}" data-status="{esc(job.status)}" '
            f'data-iteration="{job.iteration}"><b>Job {job.id}</b> ({esc(job.kind)}) &middot; '
            f"status <b>{esc(job.status)}</b>"
            f'{" (cancel requested)" if job.cancel_requested and job.status == JobStatus.RUNNING else ""}'
            f" &middot; worker {esc(job.worker or '–')} &middot; attempts {job.attempts}"
            f"{progress_bar(frac, f'{job.iteration}/{job.total_iterations or chr(63)}', 'job-detail-progress')}"
            f'{notice(job.error, "error") if job.error else ""}'
            f'{notice(waiting, "info") if waiting else ""}</div>')


def job_notice(job: Any, text: str) -> str:
    """An action's message about `job`, marked with the job and the status it was written
    at, so that the page can tell when it is out of date (`action_update`)."""
    return (f'<div class="ngs-notice ngs-ok" id="job-action" data-job="{job.id}" '
            f'data-status="{esc(job.status)}">{esc(text)}</div>')


_ACTION_MARK = re.compile(r'id="job-action" data-job="(\d+)" data-status="(\w+)"')


def action_update(message: str | None, job: Any) -> Any:
    """The action's message once `job` has moved on from the status it was written at:
    "Cancel requested for job 2 (running)." stayed beside a header saying cancelled. It is
    replaced by the status the header shows; a message about another job, or still true, is
    left as it is."""
    mark = _ACTION_MARK.search(message or "")
    if mark is None or int(mark.group(1)) != job.id or mark.group(2) == job.status:
        return gr.skip()
    return job_notice(job, f"Job {job.id} is now {job.status}.")


def action_buttons(job: Any | None, view: dict[str, Any]) -> tuple[Any, Any, Any]:
    """Cancel, Resume and Send as they apply to `job`: one that could only answer with an
    error (Cancel on a finished job, Send on a fit_preference job) is not clickable. The
    rules are the services' (`request_cancel`, `relaunch_job`, `send_to_arena`); with no job
    picked each is clickable and says to pick one. Skipped while the job's status and kind
    are as `view` last showed them (updated here)."""
    key = None if job is None else [job.id, job.status, job.kind, bool(job.cancel_requested)]
    if "actions" in view and view["actions"] == key:
        return gr.skip(), gr.skip(), gr.skip()
    view["actions"] = key
    if job is None:
        return tuple(gr.Button(interactive=True) for _ in range(3))
    cancellable = job.status in ACTIVE_JOB_STATUSES
    # a queued job's Resume sends its message again (relaunch_job); a stopped one restarts
    resumable = (job.status in (JobStatus.FAILED, JobStatus.CANCELLED)
                 or (job.status == JobStatus.QUEUED and not job.cancel_requested))
    return (gr.Button(interactive=cancellable), gr.Button(interactive=resumable),
            gr.Button(interactive=job.kind == "train"))


def job_view(user_state: dict | None, job_id: int | None, view: dict | None,
             action_message: str | None = None):
    """Outputs: list, header, plots, samples, view state, the Cancel, Resume and Send buttons
    (`action_buttons`), the action's message (`action_update`: replaced once out of date).
    Unchanged parts are skipped."""
    view = dict(view or {})
    try:
        caller(user_state, "admin")
        with session() as s:
            rows, _ = svc.list_jobs(s, limit=50)
            listing = jobs_table(rows)
            if not job_id:
                buttons = action_buttons(None, view)
                return (listing, notice("Pick a job to see its curves and samples."), "", "",
                        view, *buttons, gr.skip())
            job = svc.get_job(s, int(job_id))
            action = action_update(action_message, job)
            buttons = action_buttons(job, view)
            header = job_header(job, workers.waiting_for(s, [job]).get(job.id))
            history = svc.metric_history(s, job.id)
            key_plots = (job.id, job.status, len(history),
                         history[-1].iteration if history else None)
            # a train job draws its curves; the other kinds report results, not curves
            plots = ((plots_html(history) if job.kind == "train" else results_html(
                job, checkpoint_names(s, evaluated_ids(job))))
                     if view.get("plots") != list(key_plots) else gr.skip())
            newest, _ = rollouts.list_groups(s, job_id=job.id, limit=1)
            samples: Any = gr.skip()
            key_samples = [job.id, newest[0].id if newest else None]
            if view.get("samples") != key_samples:
                if newest:
                    groups, _ = rollouts.list_groups(s, job_id=job.id,
                                                     iteration=newest[0].iteration, limit=8)
                    # a train job's own iteration; a sampling job's model
                    ckpt_id = newest[0].checkpoint_id
                    at = (f"iteration {newest[0].iteration}" if job.kind == "train" else
                          f"checkpoint #{ckpt_id}" if ckpt_id is not None else "the base model")
                    samples = f"<h4>Newest samples ({at})</h4>" + groups_html(groups, s)
                elif KINDS[job.kind].stores_samples:
                    samples = notice("No samples yet.")
                else:  # a preference fit samples nothing: "yet" promised some
                    samples = ""
            view.update(plots=list(key_plots), samples=key_samples)
    except Exception as exc:  # noqa: BLE001
        return (gr.skip(), notice(error_text(exc), "error"), gr.skip(), gr.skip(), view,
                gr.skip(), gr.skip(), gr.skip(), gr.skip())
    return listing, header, plots, samples, view, *buttons, action


_LAUNCHED = re.compile(r'id="launched" data-job="(\d+)"')


def launch_update(message: str | None, job_id: int | None = None) -> Any:
    """Launch's message once the page has moved on: "Launched train job 3." stayed under
    whatever was done next. Cleared when another job is picked (`job_id`) or an action is
    taken (no `job_id`); kept while the launched job is the one picked (the launch picks it),
    and the form's errors stay: they are about the form's values, which have not changed."""
    launched = _LAUNCHED.search(message or "")
    if launched is None or (job_id and int(launched.group(1)) == int(job_id)):
        return gr.skip()
    return ""


def resumed_text(s: Any, job: Any) -> str:
    """What Resume queued. A train job resumes from the checkpoint the worker will load (the
    newest, `checkpoints.latest_checkpoint`), or starts over when it has none: "from its
    newest checkpoint" promised progress a job that never saved one does not keep."""
    if job.kind != "train":
        return f"Job {job.id} ({job.kind}) queued to resume."
    ckpt = checkpoints.latest_checkpoint(s, job.id)
    if ckpt is None:
        return (f"Job {job.id} queued to restart from the beginning: it has no checkpoint "
                "to resume from.")
    return (f"Job {job.id} queued to resume from its newest checkpoint, {ckpt.name} "
            f"(iteration {ckpt.iteration}).")


# Cancel's safeguard for a running job, as Delete's on the Datasets page
# (app.ui.datasets.CONFIRM_DELETE): the iteration it is in is lost (a queued job loses nothing,
# and is cancelled without it)
CONFIRM_CANCEL = "Yes, cancel it (a running job loses the iteration in progress)"


def act(enqueuer: Enqueuer | None, action: str, user_state: dict | None,
        job_id: int | None, confirmed: bool = False) -> str:
    """Cancel, Resume or Send newest rollouts to the arena, on the picked job. A running job
    is cancelled only once `confirmed` (CONFIRM_CANCEL ticked)."""
    try:
        # cancel and resume are an admin's (as their routes); sending to the arena launches a
        # rollout job: the kind's launch_role says who may (the registry's rule, as for train)
        role = "admin" if action in ("cancel", "resume") else KINDS["rollout"].launch_role
        user = caller(user_state, role)
        if not job_id:
            raise BadRequest("pick a job first")
        with session() as s:
            if action == "cancel":
                if not confirmed and svc.get_job(s, int(job_id)).status == JobStatus.RUNNING:
                    raise BadRequest(f"job {int(job_id)} is running: tick “{CONFIRM_CANCEL}” "
                                     "first, then Cancel")
                job = svc.request_cancel(s, int(job_id))
                s.commit()
                return job_notice(job, f"Cancel requested for job {job.id} ({job.status}).")
            if action == "resume":
                was_queued = svc.get_job(s, int(job_id)).status == JobStatus.QUEUED
                job = svc.relaunch_job(s, enqueuer, int(job_id))
                if was_queued:
                    return job_notice(job, f"Job {job.id} was still queued: its message was "
                                      "sent to the queue again (a worker takes it once).")
                return job_notice(job, resumed_text(s, job))
            # send newest rollouts to the arena: sample fresh groups from the newest checkpoint
            job, ckpt = svc.send_to_arena(s, enqueuer, int(job_id), user=user)
            what = f"checkpoint {ckpt.name}" if ckpt else "the base model"
            return notice(f"Rollout job {job.id} queued: {job.config['max_prompts']} prompts "
                          f"from {what}; its groups go to the arena as they arrive.", "ok")
    except Exception as exc:  # noqa: BLE001
        return notice(error_text(exc), "error")


def _admin(user_state: dict | None) -> Any:
    """The admin behind `user_state` (re-authenticated), None for anyone else and for a login
    that ended (the login area says so); these handlers' outputs are pickers, so any other
    failure is Gradio's toast (`admin_or_toast`)."""
    return admin_or_toast(user_state)


def _job_options() -> list[tuple[str, int]]:
    with session() as s:
        rows, _ = svc.list_jobs(s, limit=200)
        return [(f"#{j.id} {j.kind}", j.id) for j in rows]


def job_choices(user_state: dict | None) -> Any:
    """The Job picker's choices (admins; a dropdown's focus refreshes them)."""
    if _admin(user_state) is None:
        return gr.skip()
    return gr.Dropdown(choices=_job_options())


NO_DATASET = ("(none)", 0)  # the Dataset picker's choice for a config's own prompts


def dataset_choices(user_state: dict | None) -> Any:
    """The Dataset picker's choices (admins; a dropdown's focus refreshes them)."""
    if _admin(user_state) is None:
        return gr.skip()
    return gr.Dropdown(choices=[NO_DATASET, *dataset_options()])


def model_path_options(model: str | None) -> list[str]:
    """The model_path picker's choices for `model`: the model directories under MODELS_DIR
    holding that model and complete (`svc.model_directories`), as a job's model_path names
    them; none for a model without a directory (shapes)."""
    return [d["path"] for d in svc.model_directories()
            if d["model"] == model and d["problem"] is None]


def model_path_choices(user_state: dict | None, model: str | None) -> Any:
    """The model_path picker's choices for the model chosen (admins; at login, when the model
    changes and when the tab is shown: directories come and go as an operator installs
    them). Its value is left alone: one typed by hand stays, to be judged at launch."""
    if _admin(user_state) is None:
        return gr.skip()
    return gr.Dropdown(choices=model_path_options(model))


def on_login(user_state: dict | None) -> tuple[Any, Any, Any]:
    """A login (or logout): the progress timer runs and the pickers fill for an admin only.
    Outputs: timer, job picker, dataset picker."""
    if _admin(user_state) is None:
        return gr.Timer(active=False), gr.skip(), gr.skip()
    return gr.Timer(active=True), job_choices(user_state), dataset_choices(user_state)


def build_jobs(user: gr.State, tab: gr.Tab | None = None,
               enqueuer: Enqueuer | None = None) -> gr.Blocks:
    fields = describe()
    with gr.Blocks() as page:
        with gr.Accordion("Launch a training job", open=True, elem_id="jobs-launch"):
            with gr.Row():
                preset = gr.Dropdown([DEFAULTS, *presets()], value=DEFAULTS, label="Preset",
                                     elem_id="jobs-preset")
                # ngs-field: the field shows its error's red border (common.CSS)
                with gr.Column(min_width=200, elem_classes=["ngs-field"]):
                    # "(none)" shown from the start, as chosen (a blank box read as missing)
                    dataset = gr.Dropdown([NO_DATASET], value=NO_DATASET[1],
                                          label="Dataset (optional: prompts "
                                          "come from the config otherwise)",
                                          elem_id="jobs-dataset")
                    # the service's errors about the dataset (no train prompts, ...), as the
                    # fields' errors show beside them
                    dataset_err = gr.HTML(elem_id=f"err-{DATASET_FIELD}")
            # components by name, laid out by section; `inputs` / `errors` in describe() order
            comps: dict[str, Any] = {}
            errs: dict[str, Any] = {}
            start_values = dict(zip([d["name"] for d in fields], form_values(None), strict=True))
            folds: list[tuple[Any, list[str]]] = []  # each accordion and the fields inside it

            def grid(ds: list[dict[str, Any]]) -> None:
                for start in range(0, len(ds), 4):
                    with gr.Row(equal_height=False):
                        for d in ds[start:start + 4]:
                            with gr.Column(min_width=200, elem_classes=["ngs-field"]):
                                comps[d["name"]] = field_component(d, start_values[d["name"]])
                                errs[d["name"]] = gr.HTML(elem_id=f"err-{d['name']}")

            for title, shown, folded in sections():
                slug = _slug(title)
                with gr.Accordion(title, open=True, elem_id=f"jobs-section-{slug}") as acc:
                    grid(shown)
                    if folded:
                        with gr.Accordion(f"More {_in_sentence(title)} settings", open=False,
                                          elem_id=f"jobs-more-{slug}") as more:
                            grid(folded)
                        folds.append((more, [d["name"] for d in folded]))
                folds.append((acc, [d["name"] for d in shown + folded]))
            inputs = [comps[d["name"]] for d in fields]
            errors = [errs[d["name"]] for d in fields]
            launch_btn = gr.Button("Launch", variant="primary", elem_id="jobs-launch-button")
            launch_status = gr.HTML(elem_id="jobs-launch-status")
            help_map = {d["name"]: _tooltip(d) for d in fields}
            tips = gr.HTML("", visible=True, js_on_load=f"window.ngsTooltips({json.dumps(help_map)});")
        gr.Markdown("### Jobs")
        listing = gr.HTML(elem_id="jobs-list")
        with gr.Row():
            pick = gr.Dropdown([], value=None, label="Job", elem_id="jobs-pick", scale=2)
            cancel_confirm = gr.Checkbox(False, label=CONFIRM_CANCEL, elem_id="job-cancel-confirm")
            cancel = gr.Button("Cancel", variant="stop", elem_id="job-cancel")
            resume = gr.Button("Resume", elem_id="job-resume")
            send = gr.Button("Send newest rollouts to the arena", elem_id="job-send")
        action_status = gr.HTML(elem_id="job-action-status")
        header = gr.HTML(elem_id="job-header")
        plots = gr.HTML(elem_id="job-plots")
        samples = gr.HTML(elem_id="job-samples")
        view = gr.State({})
        timer = gr.Timer(POLL_SECONDS, active=False)

        user.change(on_login, user, [timer, pick, dataset], api_visibility="private")
        # a preset's values replace the form's, and the errors about the old values go with
        # them (launch's message and every field's box)
        preset.change(lambda p: [*form_values(None if p == DEFAULTS else p),
                                 *[""] * (len(errors) + 2)],
                      preset, [*inputs, launch_status, dataset_err, *errors],
                      api_visibility="private")
        # the fields still at the old model's starting values move to the new model's, and
        # those it refuses go back to their defaults; a finetune change resets the latter
        comps["model"].change(model_changed, inputs,
                              [comps[d["name"]] for d in fields if d["name"] != "model"],
                              api_visibility="private")
        # the model_path picker offers the new model's directories (its value is model_changed's)
        model_dirs = ([user, comps["model"]], comps["model_path"])
        comps["model"].change(model_path_choices, *model_dirs, show_progress="hidden",
                              api_visibility="private")
        user.change(model_path_choices, *model_dirs, show_progress="hidden",
                    api_visibility="private")
        comps["finetune"].change(fields_for_model, inputs,
                                 [comps[n] for n in MODEL_DEPENDENT_FIELDS],
                                 api_visibility="private")
        # the dataset list is re-read when the tab is shown (datasets come and go on the
        # Datasets page), not when the picker opens: Gradio's dropdown throws when its list
        # shrinks while it is open, and the page then stops applying updates
        if tab is not None:
            tab.select(dataset_choices, user, dataset, show_progress="hidden",
                       api_visibility="private")
            tab.select(model_path_choices, *model_dirs, show_progress="hidden",
                       api_visibility="private")

        boxes = [DATASET_FIELD, *[d["name"] for d in fields]]  # launch's error boxes

        def do_launch(user_state, dataset_id, *values):
            job_id, out = launch(enqueuer, user_state, dataset_id, *values, boxes=boxes)
            # a job id means launch() re-authenticated an admin
            pick_update = (gr.Dropdown(choices=_job_options(), value=job_id)
                           if job_id else gr.skip())
            # a section (folded or not) holding a field with an error opens to show it
            bad = {name for name, e in zip(boxes, out[1:], strict=True) if e}
            opened = [gr.Accordion(open=True) if bad & set(names) else gr.skip()
                      for _, names in folds]
            return [*out, pick_update, *opened]

        launch_btn.click(do_launch, [user, dataset, *inputs],
                         [launch_status, dataset_err, *errors, pick,
                          *[acc for acc, _ in folds]],
                         api_visibility="private")
        outputs = [listing, header, plots, samples, view, cancel, resume, send, action_status]
        timer.tick(job_view, [user, pick, view, action_status], outputs, show_progress="hidden",
                   api_visibility="private")
        pick.change(lambda u, j: job_view(u, j, {}), [user, pick], outputs,
                    api_visibility="private")
        # an action's message and Cancel's confirmation are about the job they were given
        # for: another job clears them, and launch's message unless it is about that job
        pick.change(lambda: ("", False), None, [action_status, cancel_confirm],
                    api_visibility="private")
        pick.change(lambda j, m: launch_update(m, j), [pick, launch_status], launch_status,
                    api_visibility="private")
        pick.focus(job_choices, user, pick, api_visibility="private")

        def do_cancel(user_state: dict | None, job_id: int | None, confirmed: bool):
            # the confirmation is for one cancellation: the next one is ticked again
            return act(enqueuer, "cancel", user_state, job_id, confirmed), False

        cancel.click(do_cancel, [user, pick, cancel_confirm], [action_status, cancel_confirm],
                     api_visibility="private")
        for button, action in ((resume, "resume"), (send, "send")):
            button.click(lambda u, j, a=action: act(enqueuer, a, u, j), [user, pick],
                         action_status, api_visibility="private")
        gr.on([cancel.click, resume.click, send.click], launch_update, launch_status,
              launch_status, show_progress="hidden", api_visibility="private")
        del tips
    return page
