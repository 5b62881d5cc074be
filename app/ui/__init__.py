"""The Gradio UI, mounted in the FastAPI app at /ui (`mount`).

`build_ui()` returns the whole app: a login box and one tab per page; the role of the logged-in
user decides which tabs show (annotators: the arena and their own stats; admins: everything),
and every admin handler checks the role again on the server. Pages are built by one function
each (`build_<page>(user) -> gr.Blocks`) and call `app.services`, never the ORM or SQL.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import shutil
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402
from fastapi import FastAPI  # noqa: E402

from app.config import UI_PATH  # noqa: E402
from app.services.jobs import Enqueuer  # noqa: E402
from app.ui.common import CSS, page_head  # noqa: E402

PATH = UI_PATH

log = logging.getLogger(__name__)

# how often the page's stream-holding event wakes (below); a closed page's event ends at its
# next wake, when Gradio has marked it dead
KEEP_STREAM_SECONDS = 15.0
# how long a tab is out of sight before it lets go of its event stream (the page script waits
# this long; tests set window.ngsStreamPauseMs). Long enough that switching tabs for a moment
# does not close and reopen the stream, which is when the race below could come back
STREAM_PAUSE_MS = 30_000


async def keep_event_stream_open():
    """Runs for as long as the page is open, so that Gradio's event stream never closes.

    Gradio's server closes a session's event stream (a `close_stream` message) whenever no
    event of the session is pending, and its browser client aborts the stream on that message.
    An event submitted just then (a vote the moment the last one's output shows, more likely
    on a loaded machine) had its answer sent down the closing stream, and the abort reached
    the new event as "broken connection": the client marked the whole page disconnected and
    dropped every later click without a word. With one event always pending the stream stays
    open and that race cannot happen (tests/e2e/test_ui_arena.py checks that no close_stream
    arrives). Async and idle: no worker thread is held. The cost: a tab that holds it holds two
    long-lived connections (this stream and Gradio's heartbeat) of the six a browser opens to
    one host over HTTP/1.1; with every tab holding it a third studio tab in one browser did not
    load (measured in chromium, 2026-12-01). So a tab out of sight for `STREAM_PAUSE_MS` lets
    go of it (the page script cancels this event) and takes it back when shown again: only the
    tabs in view hold two. An HTTP/2 proxy in front of uvicorn lifts the limit altogether."""
    while True:
        await asyncio.sleep(KEEP_STREAM_SECONDS)
        yield


class StudioBlocks(gr.Blocks):
    """The UI's root Blocks: an event whose inputs its components cannot take is refused with
    one log line.

    Gradio printed two chained tracebacks (the component's error, then its
    ComponentProcessingError) for every such event, and anyone can send one without a login
    (`queue/join` with `null` for a slider): the log grew by ~80 lines a request. Gradio
    prints no traceback for a `gr.Error` whose `print_exception` is off, so the input's
    failure becomes one, with the same message for the page. Only the inputs' processing is
    wrapped: an error of a handler itself (or of its outputs) is still printed in full."""

    async def preprocess_data(self, block_fn: Any, inputs: list[Any], state: Any,
                              explicit_call: bool = False) -> list[Any]:
        if state is not None:
            keep_instance_overrides(block_fn.inputs, state)
        try:
            return await super().preprocess_data(block_fn, inputs, state, explicit_call)
        except (gr.Error, ValueError) as exc:
            # every failure of the inputs' checks is a ValueError (a component's: Gradio's
            # ComponentProcessingError, too few values, a payload its data model refuses) or
            # a gr.Error a component raises itself, printed in full by default (a dropdown
            # given a value not among its choices)
            if isinstance(exc, gr.Error) and not exc.print_exception:
                raise
            message = exc.message if isinstance(exc, gr.Error) else str(exc)
            first = message.strip().splitlines()[0] if message.strip() else type(exc).__name__
            log.warning("refused the inputs of UI event %r: %r", block_fn.name, first[:300])
            raise gr.Error(message, print_exception=False) from exc


def keep_instance_overrides(inputs: list[Any], state: Any) -> None:
    """A component whose method the page replaced on the instance keeps the replacement in
    every session: a number field whose range its handler checks (`app.ui.common.number`),
    the Datasets picker that deletes a refused file's copy (`discard_refused_types`).
    Gradio builds a session's own copy of a component from its constructor arguments whenever
    an event sends it an update, `gr.skip()` included, and the copy had the class's method
    back: after a failed upload (which skips "Preview dataset #" and, without a file, the
    picker) a preview of -3, or after a finetune change (which skips the LoRA and resolution
    fields) a launch with resolution -5, answered with Gradio's toast naming no field ("Value
    -5 is less than minimum value 0.") and a traceback in the server log, and a file of a
    refused type stayed in the upload folder. The session's copy takes the replacements
    again before its inputs are read."""
    for block in inputs:
        if getattr(block, "stateful", False) or block._id not in state:
            continue
        overrides = {name: value for name, value in vars(block).items()
                     if callable(value) and callable(getattr(type(block), name, None))}
        copy = state[block._id] if overrides else block
        if copy is not block:
            for name, value in overrides.items():
                setattr(copy, name, value)


def build_ui(enqueuer: Enqueuer | None = None) -> gr.Blocks:
    """The whole UI. `enqueuer(job_id, kind)` sends launched jobs (default: Celery)."""
    from app.ui.annotators import build_annotators
    from app.ui.arena import build_arena
    from app.ui.datasets import build_datasets
    from app.ui.jobs import build_jobs
    from app.ui.leaderboard import build_leaderboard
    from app.ui.login import ADMIN_TABS, build_login
    from app.ui.rollouts import build_rollouts

    with StudioBlocks(title="Neighbor GRPO Studio", analytics_enabled=False) as ui:
        user = gr.State(None)
        login = build_login(user)
        with gr.Tabs(elem_id="pages") as tabs:
            pages = {}
            for key, title, builder in [
                ("arena", "Arena", build_arena), ("rollouts", "Rollouts", build_rollouts),
                ("jobs", "Jobs", partial(build_jobs, enqueuer=enqueuer)),
                ("leaderboard", "Leaderboard", partial(build_leaderboard, enqueuer=enqueuer)),
                ("datasets", "Datasets", build_datasets),
                ("annotators", "Annotators", partial(build_annotators, enqueuer=enqueuer)),
            ]:
                with gr.Tab(title, id=key, elem_id=f"tab-{key}", visible=False) as tab:
                    # these re-read whenever shown: the annotators' numbers, the arena's pair
                    # (if "No pairs left" was showing), the jobs' and leaderboard's pickers,
                    # the leaderboard itself, the rollouts under the filters as they stand,
                    # the datasets' list and Delete picker
                    if key in ("arena", "annotators", "datasets", "jobs", "leaderboard",
                               "rollouts"):
                        builder(user, tab)
                    else:
                        builder(user)
                pages[key] = tab
        login.wire(pages, tabs, ui)
        assert set(ADMIN_TABS) <= set(pages)
        # the page script (app.ui.common) clicks these: a tab out of sight for a while lets
        # go of its stream, and takes it back when shown. In the page but not shown
        # (display: none): moved off-screen they were still reached by Tab, read out as
        # "pause" and "resume" by screen readers, and in the page's text
        stream_pause = gr.Button("pause", elem_id="ngs-stream-pause", visible="hidden")
        stream_resume = gr.Button("resume", elem_id="ngs-stream-resume", visible="hidden")
        holds = [trigger(keep_event_stream_open, None, None, show_progress="hidden",
                         concurrency_limit=None, api_visibility="private")
                 for trigger in (ui.load, stream_resume.click)]
        stream_pause.click(None, None, None, cancels=holds, api_visibility="private")
    return ui


def own_upload_folder() -> Path:
    """The folder Gradio keeps uploads in (GRADIO_TEMP_DIR): one of this process's own, made
    now, readable by this user only and removed at exit, unless the operator named one.
    Gradio's default, /tmp/gradio, is shared by every Gradio app on the host, and its file
    route serves whatever lies in the upload folder: an admin of this studio could read
    another app's uploads through /ui/gradio_api/file=. Read by Gradio when the Blocks and
    its app are built (and by app.ui.common.uploaded_file), so set before `mount` builds
    them; the DATA_DIR cannot hold it, since the file route refuses everything under it."""
    if configured := os.environ.get("GRADIO_TEMP_DIR"):
        return Path(configured)
    folder = Path(tempfile.mkdtemp(prefix="neighbor-grpo-ui-uploads-"))  # mode 0700
    os.environ["GRADIO_TEMP_DIR"] = str(folder)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def mount(app: FastAPI) -> FastAPI:
    """Mount the UI at /ui. Gradio never serves the data or storage directories: stored
    images reach the page inlined or through /api/media with the login's session cookie
    (app/api/media.py holds the access rule)."""
    from app.config import get_settings
    from app.ui.arena import KEYS

    settings = get_settings()
    blocked = {str(settings.data_dir.resolve()), str(settings.resolved_storage_dir)}
    own_upload_folder()  # before the Blocks and Gradio's app read it
    ui = build_ui(enqueuer=getattr(app.state, "enqueuer", None))
    mounted = gr.mount_gradio_app(app, ui, path=PATH, css=CSS,
                                  head=page_head(KEYS, STREAM_PAUSE_MS),
                                  blocked_paths=sorted(blocked), footer_links=[],
                                  theme=gr.themes.Default(),
                                  # Gradio's /upload (and every route it sizes) refuses more
                                  # than the API's dataset upload takes
                                  max_file_size=settings.max_upload_bytes)
    # Gradio checks that a file named in an event's payload was uploaded (is in its upload
    # folder) only once the Blocks "has launched", which `launch()` records and a mounted app
    # never does: without this, {"path": "/any/file"} in a queue/join payload is copied into
    # the upload folder and handed to the handler as if the user had uploaded it
    # (tests/app/test_ui_security.py drives that payload through the mounted Blocks).
    ui.has_launched = True
    return mounted
