"""Three pages' fixes in a real browser: the leaderboard's evaluate form shows every problem
at once, each under its own field; the Datasets page deletes a dataset after a ticked
confirmation, and its list and picker follow; the Rollouts page's Job filter goes back to
"(all jobs)"."""

from __future__ import annotations

import uuid

from stored_checkpoints import stored_checkpoint
from ui_helpers import login, screenshot, seed_groups

from app.db import session_scope
from app.services import datasets, jobs, rollouts


def _tab(page, name: str) -> None:
    page.get_by_role("tab", name=name).click()


def _pick_option(page, picker: str, option: str) -> None:
    page.locator(f"#{picker} input").click()
    page.get_by_role("option", name=option).click()


def _under(page, box: str, field: str) -> bool:
    """Whether `box` sits under `field` in the page, in its column."""
    b = page.locator(f"#{box}").bounding_box()
    f = page.locator(f"#{field}").bounding_box()
    return (b["y"] >= f["y"] + f["height"] - 1 and b["x"] < f["x"] + f["width"]
            and f["x"] < b["x"] + b["width"])


def test_evaluate_form_shows_every_error_under_its_field(server, page):
    """Seeds 0, Rewards `nope, hpsv2` and a dataset without an eval split: one error at a
    time, in the status line, by the config's names; now all three at once, each under its
    field, and the status line names the fields by their labels."""
    name = f"no-eval-{uuid.uuid4().hex[:6]}"
    with session_scope() as s:
        stored_checkpoint(s, None, 0, f"lb/{name}.safetensors",
                                             name=f"ck-{name}")
        ds = datasets.import_dataset(s, filename=f"{name}.txt", data=b"one red circle\n",
                                     name=name).dataset
        label = f"#{ds.id} {name} (1 prompts)"
        jobs_before = jobs.list_jobs(s, limit=1)[1]
    login(page, server, server.admin_token)
    _tab(page, "Leaderboard")
    page.locator("#leaderboard-ckpts").get_by_text(f"ck-{name}").click()
    seeds = page.locator("#leaderboard-seeds input").first
    seeds.fill("0")
    seeds.press("Tab")
    page.locator("#leaderboard-rewards input, #leaderboard-rewards textarea").first.fill(
        "nope, hpsv2")
    _pick_option(page, "leaderboard-dataset", label)
    page.locator("#leaderboard-evaluate").click()
    status = page.locator("#leaderboard-status")
    status.get_by_text("3 field(s) need fixing: Seeds per prompt, Rewards, Split").wait_for()
    assert "config." not in status.inner_text()
    for field, box, words in (
            ("leaderboard-seeds", "seeds", "a whole number from 1 to"),
            ("leaderboard-rewards", "reward_names", "unknown reward 'nope'"),
            ("leaderboard-rewards", "reward_names", "reward 'hpsv2'"),
            ("leaderboard-split", "split", f"dataset {ds.id} has no 'eval' prompts")):
        shown = page.locator(f"#leaderboard-err-{box} .ngs-field-error")
        shown.wait_for()
        assert words in shown.inner_text(), box
        assert _under(page, f"leaderboard-err-{box}", field), box
    for box in ("checkpoint_ids", "dataset_id"):
        assert page.locator(f"#leaderboard-err-{box}").inner_text().strip() == ""
    # the text fields with an error take the red border the job form's do
    def border(field: str) -> str:
        return page.locator(f"#{field} input, #{field} textarea").first.evaluate(
            "e => getComputedStyle(e).borderTopColor")

    error_red = page.evaluate("() => { const e = document.createElement('div');"
                              " e.style.color = 'var(--error-border-color)';"
                              " document.body.appendChild(e);"
                              " const c = getComputedStyle(e).color; e.remove(); return c; }")
    assert border("leaderboard-rewards") == border("leaderboard-seeds") == error_red
    screenshot(page, "leaderboard-evaluate-errors")
    with session_scope() as s:
        assert jobs.list_jobs(s, limit=1)[1] == jobs_before  # nothing launched


def test_datasets_page_deletes_a_dataset_after_confirming(server, page):
    name = f"doomed-{uuid.uuid4().hex[:6]}"
    with session_scope() as s:
        ds = datasets.import_dataset(s, filename=f"{name}.txt",
                                     data=b"one red circle\ntwo blue squares\n",
                                     name=name).dataset.id
    label = f"#{ds} {name} (2 prompts)"
    with session_scope() as s:  # so that the pickers list something after the deletion
        kept = datasets.import_dataset(s, filename=f"kept-{name}.txt", data=b"one red circle\n",
                                       name=f"kept-{name}").dataset.id
    kept_label = f"#{kept} kept-{name} (1 prompts)"
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    login(page, server, server.admin_token)  # the Jobs page's Dataset picker now lists it
    _tab(page, "Datasets")
    listing = page.locator("#dataset-list")
    listing.get_by_text(name, exact=True).wait_for()
    _pick_option(page, "dataset-delete-pick", label)
    page.locator("#dataset-delete").click()  # not confirmed: nothing is deleted
    page.locator("#dataset-delete-error").get_by_text("tick").wait_for()
    with session_scope() as s:
        assert datasets.get_dataset(s, ds).num_prompts == 2
    page.locator("#dataset-delete-confirm input").check()
    page.locator("#dataset-delete").click()
    page.locator(f'#dataset-deleted[data-dataset="{ds}"]').wait_for()
    listing.get_by_text(name, exact=True).wait_for(state="detached")
    assert not page.locator("#dataset-delete-confirm input").is_checked()  # one deletion each
    with session_scope() as s:
        assert name not in {d.name for d in datasets.list_datasets(s, limit=1000)[0]}
    # the Delete picker no longer offers it
    page.locator("#dataset-delete-pick input").click()
    page.get_by_role("option", name=kept_label).wait_for()
    assert page.get_by_role("option", name=label).count() == 0
    page.keyboard.press("Escape")
    # nor does the Jobs page's Dataset picker, which offered it before: its list is re-read
    # when the tab is shown (it was re-read when the picker opened, and Gradio's dropdown
    # threw as the open list shrank; the page then stopped applying updates)
    _tab(page, "Jobs")
    page.wait_for_timeout(1000)  # the tab's refresh lands
    page.locator("#jobs-dataset input").click()
    page.get_by_role("option", name=kept_label).wait_for()
    assert page.get_by_role("option", name=label).count() == 0
    page.keyboard.press("Escape")
    assert errors == []


def test_rollouts_job_filter_goes_back_to_all_jobs(server, page):
    """A job picked could not be unpicked (the box snapped back to it): "(all jobs)" is a
    choice, and the prompt field says that it combines with the job."""
    with session_scope() as s:
        job = jobs.create_job(s, "train", {"iterations": 1}).id
        jobs.request_cancel(s, job)  # never run: the server's worker would take it
    seed_groups(2, g=2, seed=11, job_id=job)
    with session_scope() as s:
        everything = rollouts.list_groups(s, limit=1)[1]
    login(page, server, server.admin_token)
    _tab(page, "Rollouts")
    assert "combines with Job" in page.locator("#rollouts-prompt").inner_text()
    count = page.locator("#rollouts-count")
    _pick_option(page, "rollouts-job", f"#{job} train (cancelled)")
    page.locator("#rollouts-show").click()
    page.locator(f"#rollouts-count:has-text('of job {job}')").wait_for()
    assert count.get_attribute("data-total") == "2"
    _pick_option(page, "rollouts-job", "(all jobs)")
    page.locator("#rollouts-show").click()
    page.locator(f'#rollouts-count[data-total="{everything}"]').wait_for()
    assert "of job" not in count.inner_text()
    assert page.locator("#rollouts-job input").input_value() == "(all jobs)"
