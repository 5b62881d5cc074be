"""The admin pages in a real browser: datasets (upload, preview, a bad file's error), rollouts,
leaderboard, annotators (stats and the exclude switch). Saves a screenshot of each page."""

from __future__ import annotations

import uuid

from sqlalchemy import select
from stored_checkpoints import stored_checkpoint
from ui_helpers import login, screenshot, seed_groups

from app.db import session_scope
from app.models import Checkpoint, Job, Sample, User
from app.services import checkpoints, datasets, votes


def _tab(page, name: str) -> None:
    page.get_by_role("tab", name=name).click()


def _upload(page, path) -> None:
    box = page.locator("#dataset-file")
    box.wait_for()  # the tab's content is rendered
    file_input = box.locator("input[type=file]")
    clear = box.locator("button[aria-label='Clear']")
    # Gradio shows the chosen file's name as text or, split into stem and extension, in the
    # cell's aria-label, depending on the version
    shown = box.get_by_text(path.name).or_(box.get_by_label(path.name)).first
    for attempt in range(3):
        # on a loaded machine a click or an upload can be lost while the component re-renders;
        # doing it again is what a user would do
        if clear.count():  # an earlier file is shown: clear it to get the file input back
            clear.first.click()
        try:
            file_input.wait_for(state="attached", timeout=10_000)
            file_input.set_input_files(str(path))
            shown.wait_for(timeout=20_000)
            break
        except Exception:
            if attempt == 2:
                raise
    page.locator("#dataset-upload").click()


def test_datasets_upload_preview_and_errors(server, page, tmp_path):
    login(page, server, server.admin_token)
    _tab(page, "Datasets")
    good = tmp_path / "animals.csv"
    good.write_text("prompt,style\na red  fox,photo\na blue whale,sketch\na red fox,photo\n"
                    "an owl at night,painting\n")
    _upload(page, good)
    ok = page.locator("#dataset-ok")
    ok.wait_for()
    assert "3 prompts, 1 duplicate(s) dropped" in ok.inner_text()
    preview = page.locator("#dataset-preview")
    assert "a red fox" in preview.inner_text() and "sketch" in preview.inner_text()
    assert page.locator("#dataset-preview .ngs-preview tbody tr").count() == 3
    with session_scope() as s:
        ds = datasets.get_dataset(s, int(ok.get_attribute("data-dataset")))
        assert (ds.num_prompts, ds.duplicates_dropped) == (3, 1)
    screenshot(page, "datasets")

    bad = tmp_path / "broken.csv"
    bad.write_text("prompt,style\nok prompt,photo\nbad,row,extra\n")
    _upload(page, bad)
    err = page.locator("#dataset-error")
    err.wait_for()
    # the API's message: file, line, row and reason
    assert "broken.csv: line 3 (row 2): malformed row" in err.inner_text()
    gaps = tmp_path / "gaps.txt"  # blank lines are skipped and counted, not an error
    gaps.write_text("one red circle\n   \ntwo blue squares\n\n")
    _upload(page, gaps)
    page.locator("#dataset-ok").get_by_text("2 prompts, 0 duplicate(s) dropped, "
                                            "2 blank line(s) skipped").wait_for()
    with session_scope() as s:
        names = [d.name for d in datasets.list_datasets(s)[0]]
    assert "broken" not in names


def _newest_dataset() -> int | None:
    with session_scope() as s:
        rows, _ = datasets.list_datasets(s, limit=1)
        return rows[0].id if rows else None


def _pick_shows(page, value: str) -> None:
    page.wait_for_function("(v) => { const i = document.querySelector('#dataset-pick input');"
                           " return i && i.value === v; }", arg=value)


def test_dataset_preview_picker_starts_at_a_dataset_not_zero(server, page):
    """"Preview dataset #" showed 0, below its own minimum of 1 (a gr.Number without a value
    shows 0): after the login it is empty without datasets, else the list's first dataset,
    which Preview shows."""
    login(page, server, server.admin_token)
    _tab(page, "Datasets")
    page.locator("#dataset-list").get_by_text("dataset(s)").wait_for()  # the login's listing
    newest = _newest_dataset()
    _pick_shows(page, "" if newest is None else str(newest))
    with session_scope() as s:
        made = datasets.import_dataset(s, filename=f"pick-{uuid.uuid4().hex[:8]}.txt",
                                       data=b"one red circle\n").dataset.id
    page.reload()  # the login survives it and sets the field again
    page.locator("#whoami").wait_for()
    _tab(page, "Datasets")
    _pick_shows(page, str(made))
    page.locator("#dataset-show").click()
    page.locator(f'#dataset-preview[data-dataset="{made}"]').wait_for()


def group_members_of_first(page) -> int:
    return page.locator("#rollouts-groups .ngs-group").first.locator(".ngs-member").count()


def test_rollouts_page(server, page):
    seed_groups(3, g=6, seed=7, iteration=5)
    login(page, server, server.admin_token)
    _tab(page, "Rollouts")
    # shown, the tab lists the groups at once (it was blank until Show was clicked)
    page.locator("#rollouts-count").wait_for()
    assert int(page.locator("#rollouts-count").get_attribute("data-total")) >= 3
    page.locator("#rollouts-prompt textarea, #rollouts-prompt input").first.fill(
        "two red circles")
    page.locator("#rollouts-iteration textarea, #rollouts-iteration input").first.fill("5")
    page.locator("#rollouts-show").click()
    # the filtered list replaces the unfiltered one (whose groups were already there): wait
    # for its count, not for a group, or a loaded server reads the count before the refresh
    page.wait_for_function(
        "() => document.querySelector('#rollouts-count')?.dataset.total === '1'")
    page.locator("#rollouts-groups .ngs-group").first.wait_for()
    assert page.locator("#rollouts-count").get_attribute("data-total") == "1"
    assert group_members_of_first(page) == 6
    group = page.locator("#rollouts-groups .ngs-group").first
    rewards = [float(x) for x in group.locator(".ngs-member").evaluate_all(
        "els => els.map(e => e.dataset.reward)")]
    assert rewards == sorted(rewards, reverse=True)
    assert group.locator(".ngs-member.anchor").count() >= 1
    member = group.locator(".ngs-member").first
    member.locator("summary").click()
    details = member.locator(".ngs-details")
    details.wait_for()
    text = details.inner_text()
    for word in ("seed", "member", "sigma", "solver", "base model"):
        assert word in text
    screenshot(page, "rollouts")


def _seed_leaderboard() -> None:
    """Three checkpoints with evaluation groups and cross-checkpoint votes by a third user."""
    import random

    from ui_helpers import base_samples

    from app.services.auth import create_user
    from app.services.rollouts import record_rollout_group

    rng = random.Random(3)
    pngs, _ = base_samples(["two red circles"] * 18, list(range(18)))
    with session_scope() as s:
        ids = [stored_checkpoint(s, None, it, f"lb/c{it}.safetensors",
                                             name=f"demo-it{it}") for it in (0, 20, 60)]
        groups = {}
        for c in ids:
            for seed in range(6):
                groups[(c, seed)] = record_rollout_group(
                    s, job_id=None, iteration=0, prompt_text="two red circles",
                    checkpoint_id=c, solver="dpm++", steps=8, sigma=0.3, seed=seed,
                    samples=[{"png": pngs.pop(), "member_index": 0,
                              "rewards": {"count": rng.random()}}], purpose="evaluate")
        judge, _ = create_user(s, f"judge-{uuid.uuid4().hex[:6]}", "annotator")
        # an evaluate job's reward means, which the board shows beside the human rating
        for c, (count, exact) in zip(ids, ((0.71, 0.52), (0.78, 0.61), (0.84, 0.70)),
                                     strict=True):
            checkpoints.record_scores(s, c, {"count": {"mean": count, "std": 0.2, "n": 48},
                                             "exact_count": {"mean": exact, "std": 0.5,
                                                             "n": 48}},
                                      job_id=None, prompts="48 of the shapes prompts", seeds=1)
    strength = {ids[0]: 0.2, ids[1]: 0.5, ids[2]: 0.8}
    for seed in range(6):
        for i in range(3):
            for j in range(i + 1, 3):
                a, b = ids[i], ids[j]
                with session_scope() as s:
                    sa = s.scalar(select(Sample.id).where(Sample.group_id == groups[(a, seed)]))
                    sb = s.scalar(select(Sample.id).where(Sample.group_id == groups[(b, seed)]))
                    out = "a" if rng.random() < strength[a] / (strength[a] + strength[b]) else "b"
                    votes.record_vote(s, s.get(User, judge.id), client_vote_id=uuid.uuid4().hex,
                                      sample_a_id=sa, sample_b_id=sb, outcome=out,
                                      latency_ms=rng.randint(500, 4000))


def test_leaderboard_page(server, page):
    login(page, server, server.admin_token)
    _tab(page, "Leaderboard")
    # the board as it stood at login: nothing to rate yet
    page.get_by_text("No cross-checkpoint votes or reward evaluations yet").wait_for()
    _seed_leaderboard()  # checkpoints, evaluations and votes come in while another tab is open
    _tab(page, "Rollouts")
    _tab(page, "Leaderboard")  # showing the tab again re-reads the board, no Refresh needed
    board = page.locator("#leaderboard")
    board.wait_for()
    assert int(board.get_attribute("data-n")) == 3
    assert "95% interval" in board.inner_text()
    assert page.locator("#leaderboard .ngs-matrix tbody tr").count() == 3
    # the reward columns: each checkpoint's evaluated means beside its rating
    means = board.locator('[data-reward="count"]').all_inner_texts()
    assert sorted(means) == ["0.710", "0.780", "0.840"]
    page.locator("#leaderboard-ckpts").get_by_text("demo-it0").click()
    page.locator("#leaderboard-ckpts").get_by_text("demo-it60").click()
    page.locator("#leaderboard-include-base input").check()
    page.locator("#leaderboard-evaluate").click()
    launched = page.locator("#evaluate-launched")
    launched.wait_for()
    # "Include the base model": the base's row is the job's first checkpoint
    assert "for 3 checkpoint(s)" in launched.inner_text()
    with session_scope() as s:
        job = s.get(Job, int(launched.get_attribute("data-job")))
        assert job.config["include_base"]
        assert s.get(Checkpoint, job.config["checkpoint_ids"][0]).format == "base:shapes"
    screenshot(page, "leaderboard")


def test_annotators_page_and_exclude(server, page):
    login(page, server, server.admin_token)
    _tab(page, "Annotators")
    page.locator("#annotators-refresh").click()
    page.locator("#annotators-table").get_by_text("bob").first.wait_for()
    page.locator("#annotators-pick input").fill("bob")
    page.get_by_role("option", name="bob").first.click()
    page.locator("#annotators-exclude input").check()
    page.locator("#annotators-apply").click()
    page.locator("#annotators-status").get_by_text("excluded").wait_for()
    assert page.locator(".ngs-excluded[data-user='bob']").inner_text() == "yes"
    with session_scope() as s:
        bob = s.scalar(select(User).where(User.name == "bob"))
        assert bob.excluded
    screenshot(page, "annotators")
    page.locator("#annotators-exclude input").uncheck()
    page.locator("#annotators-apply").click()
    page.locator("#annotators-status").get_by_text("included again").wait_for()
    with session_scope() as s:
        assert not s.scalar(select(User.excluded).where(User.name == "bob"))


def test_login_survives_a_reload_and_logout_forgets_it(server, page):
    login(page, server, server.admin_token)
    page.locator("#logout").click()
    page.locator("#login-button").wait_for()
    # the box kept no token (its value lives in the server's session state too)
    assert page.locator("#login-token input, #login-token textarea").first.input_value() == ""
    login(page, server, server.admin_token)
    page.reload()
    page.locator("#whoami").wait_for()  # restored from the session cookie, no token typed
    assert page.locator("#whoami").get_attribute("data-role") == "admin"
    page.get_by_role("tab", name="Jobs").wait_for()
    page.locator("#logout").click()
    page.locator("#login-button").wait_for()
    page.reload()
    page.locator("#login-button").wait_for()
    page.wait_for_timeout(1500)  # a restore would have landed by now
    assert page.locator("#whoami").count() == 0


def test_favicon(server, page):
    r = page.request.get(f"{server.base}/favicon.ico")
    assert r.status == 200 and r.headers["content-type"].startswith("image/svg+xml")
    page.goto(server.ui)
    href = page.locator("link[rel~='icon']").first.get_attribute("href")
    assert page.request.get(href if href.startswith("http") else server.base + href).ok


def test_admin_fits_the_preference_model_from_the_annotators_page(server, page):
    # a fit is accepted only with votes to fit (at least 4 clean ones): four of a fresh voter
    from app.services.auth import create_user

    group = seed_groups(1, g=4, seed=11)[0]
    with session_scope() as s:
        voter, _ = create_user(s, f"fit-voter-{uuid.uuid4().hex[:8]}", "annotator")
        ids = list(s.scalars(select(Sample.id).where(Sample.group_id == group)
                             .order_by(Sample.id)))
        for n, (a, b) in enumerate([(0, 1), (0, 2), (1, 3), (2, 3)]):
            votes.record_vote(s, voter, client_vote_id=f"fit-{group}-{n}", sample_a_id=ids[a],
                              sample_b_id=ids[b], outcome="a")
    login(page, server, server.admin_token)
    _tab(page, "Annotators")
    page.locator("#preference-models").wait_for()  # the list, or "No preference model yet"
    page.locator("#preference-fit").click()
    launched = page.locator("#fit-launched")
    launched.wait_for()
    job_id = launched.get_attribute("data-job")
    r = page.request.get(f"{server.base}/api/jobs/{job_id}",
                         headers={"Authorization": f"Bearer {server.admin_token}"})
    assert r.ok and r.json()["kind"] == "fit_preference", r.text()


def test_admin_creates_lists_and_revokes_an_annotator(server, page, browser):
    name = f"carol-{uuid.uuid4().hex[:6]}"
    login(page, server, server.admin_token)
    _tab(page, "Annotators")
    page.locator("#users-name input, #users-name textarea").first.fill(name)
    page.locator("#users-create").click()
    token = page.locator("#new-token")
    token.wait_for()
    carol_token = token.inner_text().strip()
    assert carol_token.startswith("ngs_")
    page.locator(f".ngs-access[data-user='{name}']").get_by_text("active").wait_for()
    # the new annotator logs in with the token shown
    other = browser.new_context()
    try:
        carol = other.new_page()
        login(carol, server, carol_token)
        assert carol.locator("#whoami").get_attribute("data-role") == "annotator"
    finally:
        other.close()
    screenshot(page, "annotators-accounts")
    page.locator("#users-revoke-pick input").fill(name)
    page.get_by_role("option", name=name).first.click()
    # revoking cannot be undone: one click revokes nothing, and the message says what to tick
    page.locator("#users-revoke").click()
    page.locator("#users-revoked").get_by_text("first, then Revoke access").wait_for()
    assert "Yes, revoke their access" in page.locator("#users-revoked").inner_text()
    # the token, shown once, went with that action: it never stays beside a revoked user
    token.wait_for(state="detached")
    page.locator("#users-revoke-confirm input").check()
    page.locator("#users-revoke").click()
    page.locator("#users-revoked").get_by_text("can no longer log in").wait_for()
    assert not page.locator("#users-revoke-confirm input").is_checked()
    page.locator(f".ngs-access[data-user='{name}']").get_by_text("revoked").wait_for()
    # the picker is cleared (it kept the revoked user, no longer a choice: a second click
    # made Gradio refuse the value and mark every control of the page with an error)
    assert page.locator("#users-revoke-pick input").input_value() == ""
    page.locator("#users-revoke").click()
    page.locator("#users-revoked").get_by_text("pick a user").wait_for()
    assert page.get_by_text("is not in the list of choices").count() == 0
    other = browser.new_context()
    try:
        carol = other.new_page()
        carol.goto(server.ui)
        carol.locator("#login-token input, #login-token textarea").first.fill(carol_token)
        carol.locator("#login-button").click()
        carol.get_by_text("invalid or revoked token").wait_for()
    finally:
        other.close()


def test_startup_prints_no_spurious_warnings(server, page):
    """The worker (started as `make demo` starts it, as root on this box) and the server print
    neither Celery's superuser warning (JSON-only messages: the pickle risk it names does not
    apply) nor kombu's "No hostname was supplied" for the embedded filesystem broker."""
    import os

    login(page, server, server.admin_token)  # the server has answered, the worker is ready
    text = server.log_text()
    assert "ready." in text
    assert "No hostname was supplied" not in text
    if os.geteuid() == 0:
        assert "superuser privileges" not in text
