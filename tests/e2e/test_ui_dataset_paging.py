"""The Datasets page's preview, in a real browser: it showed a dataset's first 10 rows and
no way to see row 11. It pages now: Next and Previous turn the preview on screen, the Page
field jumps to a page, and "Rows X–Y of N" says which rows show."""

from __future__ import annotations

import re

from ui_helpers import login

from app.db import session_scope
from app.services import datasets


def _rows(page) -> list[str]:
    return [re.sub(r"\s+", " ", t).strip() for t in
            page.locator("#dataset-preview .ngs-preview tbody tr td:nth-child(2)")
            .all_inner_texts()]


def _wait_rows(page, text: str) -> None:
    page.wait_for_function(
        "(t) => { const r = document.querySelector('#dataset-rows');"
        " return r && r.textContent.includes(t); }", arg=text)


def test_the_dataset_preview_pages_past_the_first_ten_rows(server, page):
    with session_scope() as s:
        data = "".join(f"paged prompt {k}\n" for k in range(1, 26)).encode()
        ds_id = datasets.import_dataset(s, filename="paged-25.txt", data=data).dataset.id
    login(page, server, server.admin_token)
    page.get_by_role("tab", name="Datasets").click()
    pick = page.locator("#dataset-pick input")
    pick.fill(str(ds_id))
    page.locator("#dataset-show").click()
    _wait_rows(page, "Rows 1–10 of 25, page 1 of 3")
    assert _rows(page) == [f"paged prompt {k}" for k in range(1, 11)]

    page.locator("#dataset-next").click()
    _wait_rows(page, "Rows 11–20 of 25, page 2 of 3")
    assert _rows(page) == [f"paged prompt {k}" for k in range(11, 21)]
    assert page.locator("#dataset-page input").input_value() == "2"  # the field follows
    page.locator("#dataset-next").click()
    _wait_rows(page, "Rows 21–25 of 25, page 3 of 3")
    assert _rows(page) == [f"paged prompt {k}" for k in range(21, 26)]
    page.locator("#dataset-prev").click()
    _wait_rows(page, "Rows 11–20 of 25")

    # a page typed in the Page field, with Enter
    field = page.locator("#dataset-page input")
    field.fill("1")
    field.press("Enter")
    _wait_rows(page, "Rows 1–10 of 25, page 1 of 3")
    assert _rows(page)[0] == "paged prompt 1"
    # a page past the end: the last shows, and the field says so (it stayed at 9)
    field.fill("9")
    page.locator("#dataset-show").click()
    _wait_rows(page, "page 9 is past the end")
    page.wait_for_function(
        "() => document.querySelector('#dataset-page input').value === '3'")


def test_the_pager_fits_a_phone_and_turns_there(server, browser):
    """At 390 px the Datasets tab sits in the tab bar's "More tabs" menu; the pager's Page
    field and both buttons stay on the screen, side by side or wrapped, and Next turns."""
    from test_ui_mobile import PHONE

    with session_scope() as s:
        data = "".join(f"phone prompt {k}\n" for k in range(1, 13)).encode()
        ds_id = datasets.import_dataset(s, filename="phone-12.txt", data=data).dataset.id
    context = browser.new_context(viewport=PHONE)
    page = context.new_page()
    page.set_default_timeout(60_000)
    try:
        login(page, server, server.admin_token)
        page.get_by_role("button", name="More tabs").click()
        page.locator(".overflow-dropdown button", has_text="Datasets").click()
        page.locator("#dataset-pick input").fill(str(ds_id))
        page.locator("#dataset-show").click()
        _wait_rows(page, "Rows 1–10 of 12, page 1 of 2")
        width = page.evaluate("() => window.innerWidth")
        for part in ("#dataset-page input", "#dataset-prev", "#dataset-next"):
            page.locator(part).scroll_into_view_if_needed()
            box = page.locator(part).bounding_box()
            assert box and box["x"] >= 0 and box["x"] + box["width"] <= width, (part, box)
            assert box["width"] >= 40 and box["height"] >= 24, (part, box)  # tappable
        page.locator("#dataset-next").click()
        _wait_rows(page, "Rows 11–12 of 12, page 2 of 2")
        assert _rows(page) == ["phone prompt 11", "phone prompt 12"]
    finally:
        context.close()
