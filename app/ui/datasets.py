"""Datasets: upload (the API's formats, checks and error messages: `datasets.import_dataset`),
the counts (prompts, eval split, duplicates dropped), a preview of the rows a page at a time,
the list,
and Delete (`datasets.delete_dataset`, as DELETE /api/datasets/{id}: refused while an active
job uses the dataset), which takes a ticked confirmation so that one click deletes nothing."""

from __future__ import annotations

import contextlib
import json
import math
import re
from pathlib import Path
from typing import Any

import gradio as gr

from app.config import get_settings
from app.errors import BadRequest, ServiceError
from app.limits import MAX_ID
from app.services import datasets as svc
from app.ui.common import (
    admin_or_none,
    admin_or_toast,
    caller,
    dataset_options,
    error_text,
    esc,
    field_error,
    notice,
    number,
    number_below,
    session,
    table,
    uploaded_file,
    whole_number,
)

PREVIEW_ROWS = 10  # a preview page's rows
PAGE_LABEL = "Page"
CONFIRM_DELETE = "Yes, delete it and its prompts (cannot be undone)"


def dataset_list() -> str:
    with session() as s:
        rows, total = svc.list_datasets(s, limit=200)
        return f"<p>{total} dataset(s)</p>" + table(
            ["id", "name", "file", "format", "prompts", "train", "eval", "duplicates dropped",
             "blank lines skipped", "created"],
            [[d.id, d.name, d.filename, d.format, d.num_prompts, d.num_prompts - d.num_eval,
              d.num_eval, d.duplicates_dropped, d.blank_lines_skipped,
              d.created_at.strftime("%Y-%m-%d %H:%M")]
             for d in rows], "ngs-datasets")


def preview(dataset_id: int, page: int = 1) -> str:
    """The dataset's counts and its rows on `page` (PREVIEW_ROWS a page, as GET /api/prompts
    pages them), with "rows X–Y of N"; a page past the end shows the last one, saying so (as
    the Rollouts page does). The preview showed the first rows only: a user could not see
    row 11 of a dataset. `data-page` is the page shown, which Previous/Next turn from."""
    with session() as s:
        ds = svc.get_dataset(s, dataset_id)
        rows, total = svc.list_prompts(s, dataset_id=dataset_id, limit=PREVIEW_ROWS,
                                       offset=(page - 1) * PREVIEW_ROWS)
        pages = max(1, math.ceil(total / PREVIEW_ROWS))
        shown = min(page, pages)
        if shown != page:
            rows, total = svc.list_prompts(s, dataset_id=dataset_id, limit=PREVIEW_ROWS,
                                           offset=(shown - 1) * PREVIEW_ROWS)
        body = table(["#", "prompt", "split", "metadata"],
                     [[p.position + 1, p.text, p.split,
                       json.dumps(p.meta, ensure_ascii=False) if p.meta else ""] for p in rows],
                     "ngs-preview")
        first = (shown - 1) * PREVIEW_ROWS + 1
        where = (f"Rows {first}–{first + len(rows) - 1} of {total}" if rows
                 else f"No rows of {total}")
        where += (f", page {shown} of {pages} (page {page} is past the end)" if shown != page
                  else f", page {shown} of {pages}")
        return (f'<div id="dataset-preview" data-dataset="{ds.id}" data-page="{shown}" '
                f'data-pages="{pages}"><b>{esc(ds.name)}</b> '
                f"(#{ds.id}, {esc(ds.filename)}): {ds.num_prompts} prompts &middot; "
                f"train {ds.num_prompts - ds.num_eval} / eval {ds.num_eval} &middot; "
                f"{ds.duplicates_dropped} duplicate(s) dropped, {ds.blank_lines_skipped} blank "
                f'line(s) skipped. <span id="dataset-rows">{where}</span>:'
                f"{body}</div>")


def _discard_upload(path: Path) -> None:
    """Gradio's copy of an uploaded file, gone once read: the dataset (or the refusal) is
    what stays, and the upload folder lies outside DATA_DIR, where nothing deletes it."""
    path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # Gradio's per-file folder, when nothing else is in it
        path.parent.rmdir()


def discard_refused_types(picker: gr.File) -> None:
    """Gradio refuses a file of a type the picker does not list (dropped onto it, or sent by
    a script) before `upload` runs, and left its copy in the upload folder: delete it too, as
    `upload` deletes every file it reads. gr.File's preprocessing calls
    self._process_single_file for each file: the instance's attribute wins (and a session's
    copy of the picker, made by an update, gets it too: app.ui.keep_instance_overrides)."""
    check = picker._process_single_file

    def checked(data: Any) -> Any:
        try:
            return check(data)
        except Exception:
            with contextlib.suppress(BadRequest):  # never a file outside the upload folder
                _discard_upload(uploaded_file(data.path))
            raise

    picker._process_single_file = checked


def _content_problems(filename: str, data: bytes, name: str,
                      by_field: dict[str, str] | None = None) -> list[str]:
    """What is wrong with the dataset name an upload gives (a name another dataset has) and
    with its file (its type, size, lines), as the import would say each; [] for an upload it
    would take. Read only: for a form whose own fields are wrong, so that one message lists
    everything to fix, as the API's 422 does. The name's problems also go to `by_field`
    (for the box beside the Name field)."""
    settings = get_settings()
    with session() as s:
        taken = svc.name_problems(s, filename=filename, name=name or None)
    found = [f"{NAME_LABEL if p['field'] == NAME_FIELD else p['field']}: {p['message']}"
             for p in taken]
    if by_field is not None and (named := [p["message"] for p in taken
                                           if p["field"] == NAME_FIELD]):
        by_field[NAME_FIELD] = "; ".join(named)
    try:
        svc.parse_upload(filename, data, max_prompt_length=settings.max_prompt_length,
                         max_bytes=settings.max_upload_bytes)
    except ServiceError as exc:
        found.append(exc.message)  # names the file and line itself ("p.txt: line 2: ...")
    return found


# The upload form's number fields: the API's form field (its 422 names it) -> the label the
# page shows. Each has an error box `#dataset-err-<field>` beside it (`upload_form`).
UPLOAD_FIELDS: dict[str, str] = {"eval_fraction": "Eval fraction", "seed": "Split seed"}


def _field_values(eval_fraction: Any, seed: Any) -> tuple[float, int, dict[str, str]]:
    """The form's eval fraction and split seed under the API's rules (eval_fraction in
    [0, 1), seed a whole number in [0, MAX_ID]), and each problem by field (its message
    without the label, which the box beside the field needs no more than the launch form's).
    An empty box is refused, as every other number field of the UI: the slider it replaced
    sent 0.95 for a typed 5 and the page never said so."""
    found: dict[str, str] = {}
    fraction, split_seed = 0.0, 0
    label = UPLOAD_FIELDS["eval_fraction"]
    try:
        fraction = number_below(eval_fraction, label, 0.0, 1.0)
    except BadRequest as exc:
        found["eval_fraction"] = exc.message.removeprefix(f"{label}: ")
    label = UPLOAD_FIELDS["seed"]
    try:
        split_seed = whole_number(seed, label, 0, MAX_ID)
    except BadRequest as exc:
        found["seed"] = exc.message.removeprefix(f"{label}: ")
    return fraction, split_seed, found


# the file picker's problem (none chosen) in `_upload`'s problems by field: its box
# `#dataset-err-file` is under the picker; the status says it without a label, as the API does
FILE_FIELD = "file"
# the Name field: a name another dataset has is said in `#dataset-err-name` beside it
NAME_FIELD, NAME_LABEL = "name", "Name"


def _name_problems_of(exc: Exception) -> str | None:
    """The dataset name's problems in an import's refusal (a name taken: the 409 alone, or
    beside the file's problems in one 422), for the Name field's box; None when none."""
    if not isinstance(exc, ServiceError):
        return None
    errors = exc.details.get("errors") or [{"field": exc.details.get("field"),
                                            "message": exc.message}]
    named = [str(e["message"]).removeprefix(f"{NAME_FIELD}: ") for e in errors
             if isinstance(e, dict) and e.get("field") == NAME_FIELD]
    return "; ".join(named) or None


def _labelled(found: dict[str, str]) -> list[str]:
    return [f"{UPLOAD_FIELDS[f]}: {m}" for f, m in found.items()]


def with_retry(message: str) -> str:
    """A refused upload's message, then how to retry: the picker was emptied (its copy is
    deleted once read), and a rename and a second Upload met "choose a file first". The
    messages end without a full stop ("line 5 (row 4): empty prompt"), and the retry ran on
    as if it were the same sentence."""
    stop = "" if message.rstrip().endswith((".", "!", "?")) else "."
    return f"{message.rstrip()}{stop} Choose the file again to upload it once this is fixed."


def _upload(user_state: dict | None, file: str | None, name: str, eval_fraction: Any,
            seed: Any) -> tuple[tuple[str, str, Any, Any, Any], dict[str, str]]:
    """`upload`'s outputs, and the form's field problems by field (for their boxes)."""
    found: dict[str, str] = {}
    try:
        caller(user_state, "admin")
        fraction, split_seed, found = _field_values(eval_fraction, seed)
        # only a file the user uploaded: the value is the client's, and can name any path
        try:
            path = uploaded_file(file)
        except BadRequest as no_file:
            # the fields' problems beside it, as the API's 422 lists a missing file with them
            message = "; ".join([*_labelled(found), no_file.message])
            found[FILE_FIELD] = no_file.message  # and in the picker's own box
            raise BadRequest(message) from None
        limit = get_settings().max_upload_bytes
        try:
            with path.open("rb") as fh:
                data = fh.read(limit + 1)
        finally:
            _discard_upload(path)
        if found:
            # the file's own problems in the same message, as the API's 422 lists them
            # (nothing is imported either way)
            raise BadRequest("; ".join([*_labelled(found),
                                           *_content_problems(path.name, data, name, found)]))
        with session() as s:
            result = svc.import_dataset(
                s, filename=path.name, data=data, name=name or None,
                eval_fraction=fraction, seed=split_seed,
                max_prompt_length=get_settings().max_prompt_length, max_bytes=limit)
            ds_id, dropped = result.dataset.id, result.duplicates_dropped
            blank = result.blank_lines_skipped
            count, n_eval = result.dataset.num_prompts, result.dataset.num_eval
    except Exception as exc:  # noqa: BLE001 - the service's message, as the API returns it
        if (named := _name_problems_of(exc)) is not None:
            found[NAME_FIELD] = named
        text = error_text(exc)
        if text.startswith(f"{NAME_FIELD}: "):  # the field by the label the page shows
            text = f"{NAME_LABEL}: {text.removeprefix(f'{NAME_FIELD}: ')}"
        # the picker is emptied (its copy is deleted once read): say so, or a rename and a
        # second Upload met "choose a file first"
        return ((f'<div class="ngs-notice ngs-error" id="dataset-error">'
                 f"{esc(with_retry(text) if file else text)}</div>",
                 "", gr.skip(), None if file else gr.skip(), gr.skip()), found)
    status = (f'<div class="ngs-notice ngs-ok" id="dataset-ok" data-dataset="{ds_id}">'
              f"Imported dataset {ds_id}: {count} prompts, {dropped} duplicate(s) dropped, "
              f"{blank} blank line(s) skipped."
              # a train job trains on the train split: say now, not at the job's launch
              + (" Every prompt went to the eval split: a train job cannot train on this "
                 "dataset (rollout and evaluate jobs can sample its 'eval' split); upload it "
                 "again with a lower eval fraction to train on it." if n_eval == count else "")
              + "</div>")
    return (status, preview(ds_id), dataset_list(), None, ds_id), {}


def clear_refusal(status: str | None) -> tuple[Any, str]:
    """A new file chosen: the last upload's refusal (and the picker's "choose a file first")
    goes, since it was about another file; an import's message stays. Outputs: the Upload
    message, the picker's error box."""
    refused = 'id="dataset-error"' in (status or "")
    return ("" if refused else gr.skip()), ""


def upload(user_state: dict | None, file: str | None, name: str, eval_fraction: Any,
           seed: Any) -> tuple[str, str, Any, Any, Any]:
    """Outputs: status, preview, list, the file picker (emptied: the server read the file and
    deleted its copy, so an Upload again needs the file chosen again), and the "Preview
    dataset #" field: the new dataset's id, as the preview shows it (the field kept an older
    id, which Delete then took for the one on screen). Every problem is in the status, each
    field's after its label; `upload_form` also puts each beside its field."""
    return _upload(user_state, file, name, eval_fraction, seed)[0]


def upload_form(user_state: dict | None, file: str | None, name: str, eval_fraction: Any,
                seed: Any) -> tuple[Any, ...]:
    """What Upload shows: `upload`'s outputs, the file picker's error box (no file chosen),
    the Name field's (a name taken), then one error box per UPLOAD_FIELDS entry, in its order
    (empty where the field is fine), as the launch form shows its fields' errors, and the
    Name box (emptied after an import)."""
    outputs, found = _upload(user_state, file, name, eval_fraction, seed)
    imported = 'id="dataset-ok"' in outputs[0]
    # the Name box emptied once its dataset is imported (its label says "default: the file
    # name"): kept, the next file's upload met "a dataset named ... already exists"
    return (*outputs, field_error(found.get(FILE_FIELD)), field_error(found.get(NAME_FIELD)),
            *[field_error(found.get(f)) for f in UPLOAD_FIELDS],
            "" if imported else gr.skip())


def show(user_state: dict | None, dataset_id: float | None, page: Any = 1) -> str:
    """Preview (or Enter in its fields): the dataset's rows on the page asked for."""
    try:
        caller(user_state, "admin")
        if dataset_id is None:
            raise BadRequest("enter a dataset id")
        dataset_no = whole_number(dataset_id, "Preview dataset #", 1, MAX_ID)
        return preview(dataset_no, whole_number(page, PAGE_LABEL, 1, MAX_ID))
    except Exception as exc:  # noqa: BLE001
        return notice(error_text(exc), "error")


_SHOWN = re.compile(
    r'id="dataset-preview" data-dataset="(\d+)" data-page="(\d+)" data-pages="(\d+)"')


def shown_page(shown: str | None) -> int:
    """The page of the preview on screen (1 without one): the Page field follows the preview
    an upload or a deletion put there, so that Preview and Next go on from what is shown."""
    return _page_shown_or(shown, 1)


def page_of_preview(shown: str | None) -> int | Any:
    """After Preview: the Page field says the page shown (the last for a page past the end, the
    field stayed at 9 beside "page 3 of 3"); left as typed when the answer was an error about
    it."""
    return _page_shown_or(shown, gr.skip())


def _page_shown_or(shown: str | None, otherwise: Any) -> int | Any:
    found = _SHOWN.search(shown or "")
    return int(found.group(2)) if found else otherwise


def turn(user_state: dict | None, shown: str | None, step: int) -> tuple[str | Any, Any]:
    """Previous (`step` -1) or Next (+1): the page before or after the preview on screen, of
    the dataset it shows (whatever "Preview dataset #" holds now), staying on the first or
    last page at either end. Outputs: the preview, the Page field (the page now shown)."""
    found = _SHOWN.search(shown or "")
    try:
        caller(user_state, "admin")
        if not found:
            raise BadRequest("preview a dataset first")
        dataset_id, page, pages = (int(g) for g in found.groups())
        html = preview(dataset_id, min(max(1, page + step), pages))
    except Exception as exc:  # noqa: BLE001
        return notice(error_text(exc), "error"), gr.skip()
    return html, shown_page(html)


def newest_dataset_id() -> int | None:
    """The id of the dataset the list shows first (the newest), None without one."""
    with session() as s:
        rows, _ = svc.list_datasets(s, limit=1)
        return rows[0].id if rows else None


def listing_for(user_state: dict | None) -> tuple[str, int | None]:
    """The dataset list for an admin (re-authenticated: a revoked token gets an error), nothing
    for anyone else (a login, a logout); and the "Preview dataset #" field's value: the first
    dataset of the list, else empty. A gr.Number built without a value shows 0, below the
    field's minimum of 1, and the browser shows it empty only once an event sends None."""
    try:
        if not admin_or_none(user_state):
            return "", None
        return dataset_list(), newest_dataset_id()
    except Exception as exc:  # noqa: BLE001 - shown to the user
        return notice(error_text(exc), "error"), None


def delete_choices(user_state: dict | None) -> Any:
    """The Delete picker's choices (every dataset, by id, name and size), for an admin
    (re-authenticated: a revoked or unknown token is an error, Gradio's toast). Set at the
    login and after an upload or a deletion, never while the list is open: Gradio 6.31's
    dropdown throws (and the page stops applying updates) when an open list's choices
    shrink, as a focus handler's would after a deletion elsewhere. A dataset deleted
    elsewhere stays listed until then, and Delete says it is not found."""
    if admin_or_toast(user_state) is None:
        return gr.skip()
    return gr.Dropdown(choices=dataset_options())


def _about(html: str | None, dataset_id: int) -> bool:
    """Whether a message or preview of this page is about `dataset_id` (each carries the
    dataset's id as data-dataset)."""
    return f'data-dataset="{dataset_id}"' in (html or "")


def on_show(user_state: dict | None, doomed: float | None) -> tuple[str, Any]:
    """The tab shown again: the list and the Delete picker as the database has them (a dataset
    uploaded or deleted through the API meanwhile), for an admin; nothing for anyone else.
    The picked dataset stays picked while it exists (a value outside the choices made every
    control of the page show Gradio's error). The "Preview dataset #" field is left as typed.
    Outputs: list, Delete picker."""
    try:
        if not admin_or_none(user_state):
            return gr.skip(), gr.skip()
        choices = dataset_options()
    except Exception as exc:  # noqa: BLE001 - shown to the user
        return notice(error_text(exc), "error"), gr.skip()
    kept = doomed if doomed in {value for _, value in choices} else None
    return dataset_list(), gr.Dropdown(choices=choices, value=kept)


def delete(user_state: dict | None, dataset_id: float | None, confirmed: bool,
           previewed: float | None, preview_shown: str | None = None,
           upload_status: str | None = None) -> tuple[str, Any, Any, Any, Any, Any, Any]:
    """Delete the picked dataset and its prompts with the API's service, once `confirmed`
    (one click must not delete a dataset); an active job using it is the service's Conflict,
    which names the jobs. `previewed` is the "Preview dataset #" field, `preview_shown` the
    preview on screen and `upload_status` the Upload's message: a preview of the deleted
    dataset goes (whichever id the field holds: a typed id is not previewed until Preview),
    the field moves to the newest one left, and "Imported dataset N" goes with dataset N.
    Outputs: status, preview, list, preview picker, Delete picker, confirmation box, Upload's
    message."""
    unchanged = (gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip())
    try:
        caller(user_state, "admin")
        if not dataset_id:
            raise BadRequest("pick the dataset to delete")
        if not confirmed:
            raise BadRequest(f"tick “{CONFIRM_DELETE}” first, then Delete")
        with session() as s:
            ds = svc.get_dataset(s, int(dataset_id))
            what = f"dataset {ds.id} ({ds.name}) and its {ds.num_prompts} prompt(s)"
            svc.delete_dataset(s, ds.id)
    except Exception as exc:  # noqa: BLE001 - the service's message, as the API returns it
        return (f'<div class="ngs-notice ngs-error" id="dataset-delete-error">'
                f"{esc(error_text(exc))}</div>", *unchanged)
    gone = int(dataset_id)
    was_previewed = (previewed is not None and previewed == gone) or _about(preview_shown, gone)
    # the confirmation is for one deletion: the next one is ticked again
    return (f'<div class="ngs-notice ngs-ok" id="dataset-deleted" data-dataset="{int(dataset_id)}">'
            f"Deleted {esc(what)}.</div>",
            "" if was_previewed else gr.skip(), dataset_list(),
            newest_dataset_id() if was_previewed else gr.skip(),
            gr.Dropdown(choices=dataset_options(), value=None), False,
            "" if _about(upload_status, gone) else gr.skip())


def build_datasets(user: gr.State, tab: gr.Tab | None = None) -> gr.Blocks:
    with gr.Blocks() as page:
        gr.Markdown("Upload prompts as `.txt` (one a line), `.csv` or `.parquet` with a "
                    "`prompt` column, `.jsonl` with `{\"prompt\": ...}`, or `.json`, an "
                    "array of prompts or of `{\"prompt\": ...}` (HPDv2's files as published); "
                    "other columns are kept as metadata. Whitespace is normalised and "
                    "duplicates dropped.")
        with gr.Row():
            with gr.Column():
                file = gr.File(label="Prompt file", file_types=[".txt", ".csv", ".jsonl",
                                                                ".json", ".parquet"],
                               type="filepath", elem_id="dataset-file")
                discard_refused_types(file)
                file_error = gr.HTML(elem_id=f"dataset-err-{FILE_FIELD}")
            with gr.Column():
                with gr.Column(elem_classes=["ngs-field"]):
                    name = gr.Textbox(label="Name (default: the file name)",
                                      elem_id="dataset-name")
                    name_error = gr.HTML(elem_id=f"dataset-err-{NAME_FIELD}")
                # number fields, not a slider: Gradio's slider sent 0.95 for a typed 5 (its
                # box still showing 5) and 0 for -1. The handler checks the API's range
                # ([0, 1); the arrow keys stop at 0.95) and says what is wrong beside the
                # field; ngs-field gives the field the error's red border (common.CSS)
                boxes: dict[str, Any] = {}
                with gr.Column(elem_classes=["ngs-field"]):
                    eval_fraction = number(0.0, label=UPLOAD_FIELDS["eval_fraction"],
                                           minimum=0, maximum=0.95, step=0.05,
                                           elem_id="dataset-eval")
                    boxes["eval_fraction"] = gr.HTML(elem_id="dataset-err-eval_fraction")
                with gr.Column(elem_classes=["ngs-field"]):
                    seed = number(0, label=UPLOAD_FIELDS["seed"], minimum=0, maximum=MAX_ID,
                                  elem_id="dataset-seed")
                    boxes["seed"] = gr.HTML(elem_id="dataset-err-seed")
                go = gr.Button("Upload", variant="primary", elem_id="dataset-upload")
        status = gr.HTML(elem_id="dataset-status")
        prev = gr.HTML(elem_id="dataset-preview-box")
        with gr.Row():
            # the login fills it (listing_for); its minimum guides the browser, `show` checks
            pick = number(None, label="Preview dataset #", minimum=1, elem_id="dataset-pick")
            page_no = number(1, label=PAGE_LABEL, minimum=1, elem_id="dataset-page")
            show_btn = gr.Button("Preview", elem_id="dataset-show")
            back = gr.Button("◀ Previous", elem_id="dataset-prev")
            forward = gr.Button("Next ▶", elem_id="dataset-next")
        listing = gr.HTML(elem_id="dataset-list")
        with gr.Row(equal_height=False):
            doomed = gr.Dropdown([], value=None, label="Dataset to delete", scale=3,
                                 elem_id="dataset-delete-pick")
            confirm = gr.Checkbox(False, label=CONFIRM_DELETE, elem_id="dataset-delete-confirm")
            delete_btn = gr.Button("Delete dataset", variant="stop", elem_id="dataset-delete")
        delete_status = gr.HTML(elem_id="dataset-delete-status")
        go.click(upload_form, [user, file, name, eval_fraction, seed],
                 [status, prev, listing, file, pick, file_error, name_error,
                  *[boxes[f] for f in UPLOAD_FIELDS], name],
                 api_visibility="private").then(delete_choices, user, doomed,
                                                api_visibility="private").then(
            shown_page, prev, page_no, show_progress="hidden", api_visibility="private")
        for trigger in (show_btn.click, pick.submit, page_no.submit):
            trigger(show, [user, pick, page_no], prev, api_visibility="private").then(
                page_of_preview, prev, page_no, show_progress="hidden", api_visibility="private")
        # another dataset typed in: its preview starts at its first page
        pick.input(lambda: 1, None, page_no, api_visibility="private")

        def previous(u: dict | None, shown: str | None) -> tuple[Any, Any]:
            return turn(u, shown, -1)

        def following(u: dict | None, shown: str | None) -> tuple[Any, Any]:
            return turn(u, shown, 1)

        back.click(previous, [user, prev], [prev, page_no], api_visibility="private")
        forward.click(following, [user, prev], [prev, page_no], api_visibility="private")
        user.change(listing_for, user, [listing, pick], api_visibility="private")
        user.change(delete_choices, user, doomed, api_visibility="private")
        if tab is not None:  # shown again: datasets uploaded or deleted elsewhere meanwhile
            tab.select(on_show, [user, doomed], [listing, doomed], show_progress="hidden",
                       api_visibility="private")
        # a confirmation is for the dataset it was given for: another pick takes a new one
        doomed.change(lambda: False, None, confirm, api_visibility="private")
        # a message is about the file or dataset it was given for: the user picking another
        # (`.upload`/`.input` fire for the user's picks only, not for the handlers' own
        # updates, so an answer is never wiped the moment it shows)
        file.upload(clear_refusal, status, [status, file_error], api_visibility="private")
        doomed.input(lambda: "", None, delete_status, api_visibility="private")
        delete_btn.click(delete, [user, doomed, confirm, pick, prev, status],
                         [delete_status, prev, listing, pick, doomed, confirm, status],
                         api_visibility="private").then(
            shown_page, prev, page_no, show_progress="hidden", api_visibility="private")
    return page
