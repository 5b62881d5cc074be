"""Found by a new user's walk through the UI, in a real browser: the page script's hidden
stream buttons (app.ui.build_ui) were reached by Tab, read out by screen readers as "pause"
and "resume", and in the text of every page."""

from __future__ import annotations

from ui_helpers import login

STREAM_BUTTONS = ("ngs-stream-pause", "ngs-stream-resume")


def test_tab_from_the_last_vote_button_never_reaches_the_stream_buttons(server, page):
    login(page, server, server.annotator_token)
    page.locator("#arena-pair .ngs-pair[data-nonce]").wait_for()
    page.locator("#vote-skip").focus()
    focused = []
    for _ in range(25):
        page.keyboard.press("Tab")
        focused.append(page.evaluate(
            "(ids) => { const a = document.activeElement;"
            " return ids.find((id) => { const b = document.getElementById(id);"
            " return b && (b === a || b.contains(a)); }) || (a && (a.id || a.tagName)); }",
            list(STREAM_BUTTONS)))
    assert not set(focused) & set(STREAM_BUTTONS), focused
    # in the page, for the page script to click...
    for elem_id in STREAM_BUTTONS:
        assert page.locator(f"#{elem_id}").count() == 1
    # ...but not shown, nor offered to a screen reader or in the page's text
    assert page.get_by_role("button", name="pause", exact=True).count() == 0
    assert page.get_by_role("button", name="resume", exact=True).count() == 0
    lines = [line.strip() for line in page.locator("body").inner_text().splitlines()]
    assert "pause" not in lines and "resume" not in lines
