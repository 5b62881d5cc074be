"""The jobs page in a real browser with a real worker: a bad field shows its error beside it,
the quick demo launches from the form, its progress bar and reward plot move, Cancel stops it."""

from __future__ import annotations

from ui_helpers import login, screenshot

from app.db import session_scope
from app.services import jobs


def _open_jobs(page, server) -> None:
    login(page, server, server.admin_token)
    page.get_by_role("tab", name="Jobs").click()
    page.locator("#jobs-launch-button").wait_for()


def _set_number(page, name: str, value: str) -> None:
    box = page.locator(f"#cfg-{name} input").first
    box.fill(value)
    box.press("Tab")


def test_launch_watch_and_cancel_quick_demo(server, page):
    _open_jobs(page, server)
    # help text is a tooltip on each field
    page.wait_for_function("() => document.getElementById('cfg-sigma').title.length > 10")
    page.locator("#jobs-preset input").fill("shapes-quick-demo")
    page.get_by_role("option", name="shapes-quick-demo").click()
    page.wait_for_function(
        "() => document.querySelector('#cfg-iterations input').value === '60'")
    # a bad value: the error shows beside the field it names, nothing is launched
    _set_number(page, "num_anchors", "50")
    page.locator("#jobs-launch-button").click()
    page.locator("#err-num_anchors .ngs-field-error").wait_for()
    assert "group_size" in page.locator("#err-num_anchors").inner_text()
    with session_scope() as s:
        assert jobs.list_jobs(s)[1] == 0
    screenshot(page, "jobs-form-error")
    _set_number(page, "num_anchors", "4")
    # the shapes quick demo, fewer prompts per iteration so iterations are quick on a CPU
    _set_number(page, "prompts_per_iteration", "2")
    _set_number(page, "group_size", "6")
    _set_number(page, "num_anchors", "2")
    _set_number(page, "sample_every", "2")
    page.locator("#jobs-launch-button").click()
    launched = page.locator("#launched")
    launched.wait_for()
    job_id = int(launched.get_attribute("data-job"))
    assert page.locator("#err-num_anchors").inner_text().strip() == ""
    # the job page follows it (gr.Timer): the progress bar and the reward plot move
    page.wait_for_function(
        "(id) => { const d = document.querySelector('#job-detail');"
        " return d && d.dataset.job == id && Number(d.dataset.iteration) >= 1; }",
        arg=job_id, timeout=180_000)
    first_points = int(page.locator("#plot-reward").get_attribute("data-points"))
    first_progress = float(page.locator("#job-header [role=progressbar]")
                           .get_attribute("aria-valuenow"))
    assert first_points >= 1 and first_progress > 0
    page.wait_for_function(
        "(n) => { const p = document.querySelector('#plot-reward');"
        " return p && Number(p.dataset.points) >= n + 2; }", arg=first_points,
        timeout=120_000)
    later = float(page.locator("#job-header [role=progressbar]").get_attribute("aria-valuenow"))
    assert later > first_progress
    assert page.locator(f"#jobs-list .job-progress-{job_id}").count() == 1
    page.locator("#job-samples .ngs-member img").first.wait_for(timeout=60_000)
    screenshot(page, "jobs")
    page.locator("#job-cancel").click()
    page.locator("#job-action-status").get_by_text("Cancel requested").wait_for()
    page.wait_for_function(
        "() => { const d = document.querySelector('#job-detail');"
        " return d && d.dataset.status === 'cancelled'; }", timeout=120_000)
    with session_scope() as s:
        job = jobs.get_job(s, job_id)
        assert job.status == "cancelled"
        assert 1 <= job.iteration < job.total_iterations
