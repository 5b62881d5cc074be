"""What a client without a login can make the server log through Gradio's queue: the studio
served by uvicorn (UI mounted), its log read as written.

Before: an event whose input a component could not take (`null` for a checkbox group) printed two
chained tracebacks, and a `queue/data` stream whose session was gone (an unknown one, or a
page's two streams ended together by a reload) logged "Exception in ASGI application" with
two more (and the stream was cut off without its end). Now the first is one line and the second ends as a finished stream; a handler's own
error is still printed in full."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from trainer.rewards.serve import ServerThread


@pytest.fixture
def served(settings):
    """(url, the UI's root Blocks) of the studio under uvicorn in this process."""
    from app.config import UI_PATH
    from app.main import create_app

    app = create_app(settings, enqueuer=lambda job_id, kind: None, mount_ui=True)
    blocks = next(r.app for r in app.routes if getattr(r, "path", None) == UI_PATH).get_blocks()
    with ServerThread(app) as running:
        yield running.url, blocks


def _fn_index(blocks, name: str, inputs: list[str] | None = None) -> int:
    """The event handler `name` (of these input component types, if given)."""
    return next(i for i, fn in blocks.fns.items() if fn.name == name and
                (inputs is None or [b.get_block_name() for b in fn.inputs] == inputs))


def _join(url: str, fn_index: int, data: list, session: str) -> None:
    body = json.dumps({"data": data, "fn_index": fn_index, "session_hash": session,
                       "event_data": None, "trigger_id": None}).encode()
    request = urllib.request.Request(f"{url}/ui/gradio_api/queue/join", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        assert reply.status == 200


def _stream(url: str, session: str) -> str:
    with urllib.request.urlopen(f"{url}/ui/gradio_api/queue/data?session_hash={session}",
                                timeout=30) as reply:
        return reply.read().decode()


def _log_after(capfd, seconds: float = 0.5) -> str:
    time.sleep(seconds)  # the server's thread writes its log after the reply's last byte
    return capfd.readouterr().err


def test_an_input_a_component_cannot_take_is_one_log_line_a_handler_error_a_traceback(
        served, capfd, caplog):
    url, blocks = served
    # the leaderboard's Evaluate: its checkpoint picker given null (the example was the
    # bootstrap slider given null; it is a number field now, whose handler checks anything)
    inputs = ["state", "checkboxgroup", "number", "textbox", "dropdown", "radio", "checkbox"]
    evaluate = _fn_index(blocks, "<lambda>", inputs)
    _join(url, evaluate, [None, None, 4, "", 0, "eval", False], "bad-input")
    reply = _stream(url, "bad-input")
    assert "Could not preprocess input component at index 1" in reply  # the page still learns why
    log = _log_after(capfd)
    assert "Traceback" not in log
    assert [r.getMessage() for r in caplog.records if r.name == "app.ui"] == [
        "refused the inputs of UI event '<lambda>': 'Could not preprocess input component at "
        "index 1 (a `checkboxgroup` component) of the event handler with input components: [state, checkboxgroup, number, textbox, dropdown, radio, checkbox].'"]

    caplog.clear()
    # a value a dropdown does not offer: Gradio's own gr.Error, which it printed in full
    job_view = _fn_index(blocks, "job_view", ["state", "dropdown", "state", "html"])
    _join(url, job_view, [None, 0, 1, ""], "not-a-choice")
    assert "is not in the list of choices" in _stream(url, "not-a-choice")
    log = _log_after(capfd)
    assert "Traceback" not in log, log
    assert [r.getMessage() for r in caplog.records if r.name == "app.ui"] == [
        "refused the inputs of UI event 'job_view': 'Value: 0 is not in the list of choices: "
        "[]'"], caplog.records

    def broken_handler(*args):  # a real bug in a handler, reached with valid inputs
        raise RuntimeError("the handler itself failed")

    blocks.fns[evaluate].fn = broken_handler
    _join(url, evaluate, [None, [], 4, "", 0, "eval", False], "handler-error")
    _stream(url, "handler-error")
    log = _log_after(capfd)
    assert "Traceback" in log and "RuntimeError: the handler itself failed" in log


def test_a_stream_of_a_gone_session_ends_without_a_traceback(served, capfd):
    url, _ = served
    # an unknown session: Gradio raises its 404 after the stream began (the same error as a
    # reloaded page's stream whose session its other stream removed); the stream used to be
    # cut off mid-reply (IncompleteRead here) and the log got two tracebacks
    assert '"session_not_found":true' in _stream(url, "never-joined")
    log = _log_after(capfd)
    assert "Traceback" not in log and "Exception in ASGI application" not in log
