"""The jobs page in a real browser with a real worker: a bad field shows its error beside it,
the quick demo launches from the form, its progress bar and reward plot move, Cancel stops it;
the form's own defaults launch; every error shows at once, a folded section opening to show
its own; the cancel message goes when another job is picked; a model change resets the
fields the new model refuses, and the others follow the model (flux-lora's for flux)."""

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


def _help_marks(page, name: str) -> list[str]:
    """What the page draws after a field's label (the CSS "(?)" that says it has help)."""
    return page.locator(f"#cfg-{name} [data-testid=block-info], #cfg-{name} .label-text"
                        ).evaluate_all("els => els.map(e => getComputedStyle(e, '::after')"
                                       ".content)")


def test_launch_watch_and_cancel_quick_demo(server, page):
    with session_scope() as s:  # other tests of the session's server may have made jobs
        jobs_before = jobs.list_jobs(s)[1]
    _open_jobs(page, server)
    # help text is a tooltip on each field, and every kind of field says it has one: a
    # number, a dropdown (it had no "(?)"; a checkbox: the next test)
    page.wait_for_function("() => document.getElementById('cfg-sigma').title.length > 10")
    for name in ("sigma", "model"):
        assert '" (?)"' in _help_marks(page, name), name
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
        assert jobs.list_jobs(s)[1] == jobs_before
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
    page.locator("#job-cancel-confirm input").check()  # a running job's cancel is confirmed
    page.locator("#job-cancel").click()
    page.locator("#job-action-status").get_by_text("Cancel requested").wait_for()
    page.wait_for_function(
        "() => { const d = document.querySelector('#job-detail');"
        " return d && d.dataset.status === 'cancelled'; }", timeout=120_000)
    with session_scope() as s:
        job = jobs.get_job(s, job_id)
        assert job.status == "cancelled"
        assert 1 <= job.iteration < job.total_iterations


def _field(page, name: str):
    return page.locator(f"#cfg-{name} textarea, #cfg-{name} input").first


def test_defaults_launch_and_every_error_shows_at_once(server, page):
    _open_jobs(page, server)
    # list and dict fields show their JSON once (they showed "[]" and the launch failed)
    assert _field(page, "prompts").input_value() == "[]"
    assert _field(page, "reward_weights").input_value() == '{"count": 1.0}'
    # the Dataset picker shows its "(none)" choice, not a blank box
    assert page.locator("#jobs-dataset input").input_value() == "(none)"
    # rarely changed fields are folded away
    assert not page.locator("#cfg-weight_decay").is_visible()
    # three bad fields, one of them folded away: every error shows beside its field at once
    more = page.locator("#jobs-more-optimisation").get_by_text("More optimisation settings")
    # open the folded section first: its fields mount when it first opens, and a value typed
    # while they mount can be replaced by the default (seen on a loaded 2-core box)
    more.click()
    page.locator("#cfg-weight_decay input").first.wait_for()
    assert '" (?)"' in _help_marks(page, "shuffle_advantages")  # a checkbox had none
    _set_number(page, "num_anchors", "50")
    _field(page, "reward_weights").fill("{not json")
    _set_number(page, "weight_decay", "5")
    page.wait_for_function(
        "() => document.querySelector('#cfg-weight_decay input').value === '5'")
    page.locator("#jobs-launch-button").click()
    page.locator("#jobs-launch-status").get_by_text("3 field(s) need fixing").wait_for()
    for name, words in (("num_anchors", "group_size"), ("reward_weights", "not valid JSON"),
                        ("weight_decay", "[0.0, 1.0]")):
        box = page.locator(f"#err-{name} .ngs-field-error")
        box.wait_for()
        assert words in box.inner_text(), name
    # folded away again, the section opens by itself to show its field's error
    more.click()
    page.locator("#err-weight_decay").wait_for(state="hidden")
    page.locator("#jobs-launch-button").click()
    page.locator("#err-weight_decay .ngs-field-error").wait_for()
    screenshot(page, "jobs-form-errors")
    # a preset replaces the values: the errors about the old ones go with them
    page.locator("#jobs-preset input").fill("shapes-quick-demo")
    page.get_by_role("option", name="shapes-quick-demo").click()
    page.wait_for_function("() => !document.querySelector('#jobs-launch-status')"
                           "  .innerText.includes('need fixing')")
    for name in ("num_anchors", "reward_weights", "weight_decay"):
        assert page.locator(f"#err-{name} .ngs-field-error").count() == 0, name
    with session_scope() as s:
        before = jobs.list_jobs(s)[1]
    # the defaults, as the page first showed them, launch (the reload keeps the login)
    page.reload()
    page.locator("#whoami").wait_for()
    page.get_by_role("tab", name="Jobs").click()
    page.locator("#jobs-launch-button").wait_for()
    page.locator("#jobs-launch-button").click()
    launched = page.locator("#launched")
    launched.wait_for()
    job_id = int(launched.get_attribute("data-job"))
    with session_scope() as s:
        assert jobs.list_jobs(s)[1] == before + 1
        assert jobs.get_job(s, job_id).config["prompts"] == []
    page.wait_for_function(
        "(id) => { const d = document.querySelector('#job-detail');"
        " return d && d.dataset.job == id; }", arg=job_id)
    page.locator("#job-cancel-confirm input").check()  # it may be running already
    page.locator("#job-cancel").click()
    message = page.locator("#job-action-status").get_by_text("Cancel requested")
    message.wait_for()
    # the launch's message went with the action: the page has moved on
    page.locator("#launched").wait_for(state="detached")
    assert not page.locator("#job-cancel-confirm input").is_checked()  # one tick, one cancel
    # another job picked: the message about this one goes
    with session_scope() as s:
        other = jobs.create_job(s, "train", {"iterations": 1}).id
    page.locator("#jobs-pick input").click()
    page.get_by_role("option", name=f"#{other} train").click()
    page.wait_for_function(
        "(id) => { const d = document.querySelector('#job-detail');"
        " return d && d.dataset.job == id; }", arg=other)
    message.wait_for(state="detached")
    with session_scope() as s:
        jobs.request_cancel(s, other)


def test_a_model_change_resets_the_fields_the_model_refuses(server, page):
    """Preset flux-lora, then model shapes: launch failed on lora_rank ("... or leave lora_rank
    out", which a form cannot do); the change resets it, and the other fields shapes refuses,
    through the chain of the model's and finetune's change events."""
    _open_jobs(page, server)
    # LoRA's fields are folded away, and mount when their section first opens
    page.locator("#jobs-more-model").get_by_text("More model settings").click()
    page.locator("#cfg-lora_rank input").first.wait_for()
    page.locator("#jobs-preset input").fill("flux-lora")
    page.get_by_role("option", name="flux-lora").click()
    page.wait_for_function("() => document.querySelector('#cfg-lora_rank input').value === '64'")
    page.locator("#cfg-model input").fill("shapes")
    page.get_by_role("option", name="shapes", exact=True).click()
    page.wait_for_function("() => document.querySelector('#cfg-lora_rank input').value === '32'"
                           " && document.querySelector('#cfg-finetune input').value === 'full'")
    page.locator("#jobs-launch-button").click()
    launched = page.locator("#launched")
    launched.wait_for()
    with session_scope() as s:
        jobs.request_cancel(s, int(launched.get_attribute("data-job")))
    # and flux again: the fields follow to flux-lora's, as the API's job without a preset
    # (the LoRA rank stayed at shapes' 32, the resolution at 0)
    page.locator("#cfg-model input").fill("flux")
    page.get_by_role("option", name="flux", exact=True).click()
    page.wait_for_function("() => document.querySelector('#cfg-lora_rank input').value === '64'"
                           " && document.querySelector('#cfg-resolution input').value === '512'"
                           " && document.querySelector('#cfg-finetune input').value === 'lora'")
