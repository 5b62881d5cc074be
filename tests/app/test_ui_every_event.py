"""Every event handler of the built UI, called as a logged-out visitor and as an annotator:
none of them changes a row, enqueues a job or shows stored data unless its caller may.

tests/app/test_route_access.py walks the routes with one dummy Gradio event, and
tests/app/test_ui_security.py drives hand-picked handlers; this walks `blocks.fns` of the
UI as `build_ui` builds it, with inputs that name the seeded rows (a dataset, two jobs, a
rollout group on screen in the arena state, a user to revoke), so that a handler added
without its login check acts or shows something, and fails here. A handler that takes no
user state must be listed in NO_USER_STATE with the reason it needs none."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import json
from typing import Any

import pytest
from sqlalchemy import inspect as sa_inspect
from sqlalchemy import text

SECRET_DATASET = "zebra-secret-dataset"  # a launch's (the launch form's picker)
SECRET_DATASET2 = "yak-secret-dataset"  # the Datasets page's (Delete, Preview)
SECRET_PROMPTS = ["an owl beneath quiet moonlight", "seven amber lanterns afloat"]
SECRET_GROUP_PROMPT = "a secret violet heptagon"
ADMIN, ANNOTATOR, TARGET = "ann-secret-admin", "ben-secret-annotator", "cy-secret-target"

# handlers without the user state as an input (keyed by __qualname__): none of them reads or
# writes users' data, and the walk below still checks that they change, enqueue and show nothing
NO_USER_STATE = {
    "Login.wire.<locals>.login": "the login itself: checks the typed token (a wrong one here)",
    "Login.wire.<locals>.logout": "ends this session's login (the cookie's token, none here)",
    "Login.wire.<locals>.closed": "the page closed: forgets its session binding",
    "keep_event_stream_open": "idles to keep Gradio's event stream open (reads nothing)",
    "filter_errors": "checks the rollouts filter fields' syntax only",
    "build_jobs.<locals>.<lambda>": "the preset's form values, clearing a status or checkbox",
    "model_changed": "the launch form's fields for a model (static)",
    "fields_for_model": "the launch form's fields for a finetune mode (static)",
    "launch_update": "re-renders the launch status the page already holds",
    "build_datasets.<locals>.<lambda>": "clears the delete confirmation checkbox or message, "
                                        "or puts the preview's Page back to 1",
    "shown_page": "the page of the dataset preview the page already holds",
    "page_of_preview": "the page of the dataset preview the page already holds",
    "build_annotators.<locals>.<lambda>": "clears the revoke confirmation checkbox or a message",
    "clear_refusal": "takes the last upload's refusal, which the page already holds, off it",
    "forget_token": "clears the shown new token from the page",
}
# handlers an annotator may use (checked logged out only): what they do for an annotator is
# theirs to do
ANNOTATOR_MAY = {
    "dispatch": "the arena's vote buttons: an annotator's vote is the point",
    "load": "the arena's pair for the logged-in annotator",
    "poll": "the arena's pair for the logged-in annotator",
    "Login.wire.<locals>.restore": "a reload's login from the browser's own cookie",
}

# handlers that act on the seeded rows for an admin given the walk's inputs, each with the job
# it is given (0: the queued job, 1: the cancelled one); one of the jobs page's lambdas resumes
ACTIONS = {"build_jobs.<locals>.do_launch": 0, "upload_form": 0, "set_excluded": 0, "build_annotators.<locals>.create_and_refresh": 0,
           "build_annotators.<locals>.revoke_and_refresh": 0, "delete": 0,
           "build_annotators.<locals>.<lambda>": 0, "build_jobs.<locals>.do_cancel": 0,
           "build_jobs.<locals>.<lambda>": 1}


def _token(headers: dict[str, str]) -> str:
    return headers["Authorization"].split(" ", 1)[1]


def _snapshot() -> dict[str, tuple[int, str]]:
    """Each table's row count and a hash of its rows, in a stable order."""
    from app import db

    engine = db.get_engine()
    out = {}
    with engine.connect() as conn:
        for table in sorted(sa_inspect(engine).get_table_names()):
            if table == "alembic_version":
                continue
            rows = sorted(repr(tuple(r)) for r in conn.execute(text(f'SELECT * FROM "{table}"')))
            out[table] = (len(rows), hashlib.sha256("\n".join(rows).encode()).hexdigest())
    return out


def _run(fn, args: list[Any]) -> Any:
    """The handler's result, a generator's every yield."""
    if inspect.isasyncgenfunction(fn):
        pytest.fail(f"{fn.__qualname__}: an async generator handler, drain it here")
    if inspect.iscoroutinefunction(fn):
        return asyncio.run(fn(*args))
    result = fn(*args)
    if inspect.isgenerator(result):
        return list(result)
    return result


@pytest.fixture
def world(settings, client, make_user, make_group, vote_seeder, enqueuer, tmp_path,
          monkeypatch):
    uploads = tmp_path / "gradio-uploads"
    uploads.mkdir()
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(uploads))
    admin = make_user(ADMIN, "admin")
    annotator = make_user(ANNOTATOR, "annotator")
    target = make_user(TARGET, "annotator")
    dataset_ids = []
    # the launch's dataset holds prompts the tiny preset's shapes model draws
    for name, prompts in ((SECRET_DATASET, ["three blue squares", "four yellow circles"]),
                          (SECRET_DATASET2, SECRET_PROMPTS)):
        r = client.post("/api/datasets", headers=admin, data={"name": name},
                        files={"file": ("z.txt", "\n".join(prompts).encode(), "text/plain")})
        assert r.status_code == 201, r.text
        dataset_ids.append(r.json()["id"])
    jobs = []
    for _ in range(2):
        r = client.post("/api/jobs", headers=admin, json={"kind": "train", "preset": "tiny"})
        assert r.status_code == 201, r.text
        jobs.append(r.json()["id"])
    queued, cancelled = jobs
    assert client.post(f"/api/jobs/{cancelled}/cancel", headers=admin).status_code == 200
    group = make_group(queued, prompt=SECRET_GROUP_PROMPT)
    vote_seeder(4)
    from sqlalchemy import select

    from app.db import session_scope
    from app.models import Sample, User

    with session_scope() as s:
        samples = list(s.scalars(select(Sample.id).where(Sample.group_id == group)
                                 .order_by(Sample.id)))
        users = {u.name: u.id for u in s.scalars(select(User))}
    from app.ui import build_ui

    blocks = build_ui(enqueuer=enqueuer)
    enqueuer.calls.clear()
    return {"blocks": blocks, "datasets": dataset_ids, "jobs": [queued, cancelled],
            "samples": samples, "users": users, "uploads": uploads,
            "tokens": {ADMIN: _token(admin), ANNOTATOR: _token(annotator),
                       TARGET: _token(target)}}


def _inputs(block_fn, world: dict, user_state: Any, job_id: int, user_comp) -> list[Any]:
    """Plausible values for the handler's inputs: the seeded rows' ids, a confirmation ticked,
    the tiny preset's launch form, a prompt file in Gradio's upload folder."""
    import gradio as gr

    from app.ui import jobs

    form = dict(zip([d["name"] for d in jobs.describe()], jobs.form_values("tiny"),
                    strict=True))
    a, b = world["samples"][:2]
    nonce = "probe-nonce"
    values = []
    for comp in block_fn.inputs:
        label = getattr(comp, "label", None) or ""
        if comp is user_comp:
            values.append(user_state)
        elif isinstance(comp, gr.State):
            # the arena's session state holds a pair on screen (a vote would judge it); the
            # others (the jobs page's view) start empty
            values.append({"session_id": "probe", "user_id": world["users"][ANNOTATOR],
                           "current": {"a_id": a, "b_id": b, "prompt": "the pair on screen",
                                       "selection": "random", "nonce": nonce},
                           "next": None, "session_votes": 0, "my_total": 0, "all_total": 0,
                           "last": None} if block_fn.name in ("dispatch", "load", "poll")
                          else comp.value)
        elif label == "API token":
            values.append("ngs_not-a-token")
        elif label == "Job":
            values.append(job_id)
        elif label.startswith("Dataset (optional") or label == "Held-out prompts":
            values.append(world["datasets"][0])
        elif label in ("Dataset to delete", "Preview dataset #"):
            values.append(world["datasets"][1])
        elif label == "prompts":  # the dataset's prompts, not the preset's beside them
            values.append("")
        elif label in ("User", "Annotator"):
            values.append(world["users"][TARGET])
        elif label == "Name":
            values.append("mallory-new-admin")
        elif label == "Role":
            values.append("admin")
        elif isinstance(comp, gr.Checkbox) and (label.startswith("Yes") or "Exclude" in label):
            values.append(True)
        elif isinstance(comp, gr.File):
            path = world["uploads"] / f"u{len(list(world['uploads'].iterdir()))}" / "p.txt"
            path.parent.mkdir()
            path.write_text("a fresh upload prompt\n")
            values.append(str(path))
        elif isinstance(comp, gr.Textbox) and not label:  # the arena's vote meta
            values.append(json.dumps({"outcome": "a", "nonce": nonce,
                                      "client_vote_id": "probe-vote"}))
        elif label == "Page":
            values.append(1)
        elif label in form:
            values.append(form[label])
        else:
            values.append(comp.value)
    return values


def _call(block_fn, values: list[Any]):
    import gradio as gr
    from gradio.helpers import special_args
    from starlette.requests import Request

    request = gr.Request(request=Request({"type": "http", "method": "POST", "path": "/ui/",
                                          "headers": [], "query_string": b""}),
                         session_hash="probe-session")
    args, *_ = special_args(block_fn.fn, list(values), request=request)
    return _run(block_fn.fn, args)


def _leaks(out: str, secrets: list[str]) -> list[str]:
    found = [s for s in secrets if s in out]
    if "data:image/png" in out:
        found.append("an inlined image")
    return found


def test_every_ui_event_needs_its_login(world, enqueuer):
    import gradio as gr

    from app.errors import ServiceError

    blocks = world["blocks"]
    login = next(f for f in blocks.fns.values()
                 if getattr(f.fn, "__qualname__", "") == "Login.wire.<locals>.login")
    user_comp = login.inputs[1]  # the gr.State every page's handlers get
    tokens = world["tokens"]
    everything = [SECRET_DATASET, SECRET_DATASET2, *SECRET_PROMPTS, SECRET_GROUP_PROMPT,
                  ADMIN, ANNOTATOR, TARGET, *tokens.values()]
    others = [s for s in everything if s not in (ANNOTATOR, tokens[ANNOTATOR])]
    callers = [("logged out", None, everything),
               ("an unknown token", {"token": "ngs_nope", "name": ADMIN, "role": "admin"},
                everything),
               ("an annotator claiming admin", {"token": tokens[ANNOTATOR], "name": ANNOTATOR,
                                                "role": "admin"}, others)]
    before = _snapshot()
    problems: list[str] = []
    covered = 0
    for index, block_fn in blocks.fns.items():
        if block_fn.fn is None:  # a client-side event (js only)
            continue
        name = block_fn.fn.__qualname__
        if name in NO_USER_STATE and name == "keep_event_stream_open":
            continue  # never returns: nothing to call
        if user_comp not in block_fn.inputs and name not in NO_USER_STATE:
            problems.append(f"#{index} {name}: takes no user state and is not in NO_USER_STATE")
        covered += 1
        job_ids = world["jobs"] if any(getattr(c, "label", None) == "Job"
                                       for c in block_fn.inputs) else world["jobs"][:1]
        for who, state, secrets in callers:
            if who.startswith("an annotator") and name in ANNOTATOR_MAY:
                continue
            for job_id in job_ids:
                where = f"#{index} {name} ({who}, job {job_id})"
                try:
                    out = repr(_call(block_fn, _inputs(block_fn, world, state, job_id,
                                                       user_comp)))
                except (gr.Error, ServiceError) as exc:
                    out = str(exc)
                except Exception as exc:  # noqa: BLE001 - reported below
                    problems.append(f"{where}: raised {exc!r} (give it plausible inputs)")
                    continue
                if leaked := _leaks(out, secrets):
                    problems.append(f"{where}: shows {leaked}")
                if enqueuer.calls:
                    problems.append(f"{where}: enqueued {enqueuer.calls}")
                    enqueuer.calls.clear()
                after = _snapshot()
                if changed := [t for t in after if after[t] != before.get(t)]:
                    problems.append(f"{where}: changed {changed}")
                    before = after
    assert not problems, "\n".join(problems)
    print(f"{covered} handlers walked")
    assert covered >= 60, covered  # the whole UI, not a page of it

    # the control: the same inputs from the admin do act, so the refusals above are the
    # login checks' and not inputs no handler would act on (a launch's job
    # holds the other dataset than the one Delete removes)
    admin = {"token": tokens[ADMIN], "name": ADMIN, "role": "admin"}
    acted = []
    for block_fn in blocks.fns.values():
        name = getattr(block_fn.fn, "__qualname__", "")
        if name not in ACTIONS or block_fn.inputs[:1] != [user_comp]:
            continue
        job_id = world["jobs"][ACTIONS[name]]
        with contextlib.suppress(gr.Error):
            _call(block_fn, _inputs(block_fn, world, admin, job_id, user_comp))
        after = _snapshot()
        if after != before or enqueuer.calls:
            acted.append(name)
        before = after
        enqueuer.calls.clear()
    assert set(acted) == set(ACTIONS), sorted(set(ACTIONS) - set(acted))
