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
