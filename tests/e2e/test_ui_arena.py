"""The arena in a real browser: log in, vote with the mouse and with every shortcut, a double
click records one vote, the source shows only after the vote, an annotator sees no jobs page."""

from __future__ import annotations

from sqlalchemy import select
from ui_helpers import login, screenshot

from app.db import session_scope
from app.models import User, Vote


def _votes_of(name: str) -> list[Vote]:
    with session_scope() as s:
        uid = s.scalar(select(User.id).where(User.name == name))
        return list(s.scalars(select(Vote).where(Vote.annotator_id == uid).order_by(Vote.id)))


def _image_bytes(sample_id: int) -> bytes:
    from app.models import Sample
    from app.services import storage

    with session_scope() as s:
        return storage.resolve(s.get(Sample, sample_id).image_path).read_bytes()


def _data(src: str) -> bytes:
    import base64

    return base64.b64decode(src.split(",", 1)[1])


def _shown_pair(page) -> tuple[str, str, str]:
    pair = page.locator("#arena-pair .ngs-pair")
    nonce = pair.get_attribute("data-nonce")
    a = page.locator("#arena-pair img[alt='image A']").get_attribute("src")
    b = page.locator("#arena-pair img[alt='image B']").get_attribute("src")
    return nonce, a, b


def _wait_new_pair(page, old_nonce: str) -> None:
    page.wait_for_function(
        "(old) => { const p = document.querySelector('#arena-pair .ngs-pair');"
        " return p && p.dataset.nonce && p.dataset.nonce !== old; }", arg=old_nonce)


def _wait_count(page, n: int) -> None:
    page.wait_for_function(
        "(n) => { const c = document.querySelector('#arena-counter-values');"
        " return c && Number(c.dataset.session) === n; }", arg=n)


def test_login_and_vote_with_mouse_and_keys(server, page):
    login(page, server, server.annotator_token)
    assert page.locator("#whoami").get_attribute("data-role") == "annotator"
    page.locator("#arena-pair .ngs-pair[data-nonce]").wait_for()
    # identities stay hidden until the vote: no ids, paths or rewards in the page
    html = page.locator("#arena-pair").inner_html()
    assert "/api/media" not in html and "rollouts/" not in html and "reward" not in html
    assert "[1]" in page.locator("#vote-a").inner_text()
    assert "[space]" in page.locator("#vote-skip").inner_text()
    # the 32x32 images are upscaled without blur
    rendering = page.locator("#arena-pair img").first.evaluate(
        "e => getComputedStyle(e).imageRendering")
    assert rendering in ("pixelated", "crisp-edges")
    screenshot(page, "arena")

    actions = [("mouse", "#vote-a", "a"), ("key", "1", "a"), ("key", "2", "b"),
               ("key", "3", "tie"), ("key", "4", "both_bad"), ("key", " ", "skip"),
               ("mouse", "#vote-b", "b"), ("mouse", "#vote-tie", "tie")]
    before = len(_votes_of("bob"))
    for k, (how, what, outcome) in enumerate(actions, 1):
        nonce, a_src, b_src = _shown_pair(page)
        if how == "mouse":
            page.locator(what).click()
        else:
            page.keyboard.press("Space" if what == " " else what)
        _wait_new_pair(page, nonce)
        _wait_count(page, k)
        votes = _votes_of("bob")
        assert len(votes) == before + k, (how, what)
        v = votes[-1]
        assert v.outcome == outcome, (how, what)
        # sample_a is the image that was on the left, sample_b the right
        assert (_image_bytes(v.sample_a_id), _image_bytes(v.sample_b_id)) == (
            _data(a_src), _data(b_src)), (how, what)
        # the sides recorded are those shown: the reveal names them after the vote
        reveal = page.locator("#arena-reveal .ngs-reveal")
        assert reveal.get_attribute("data-vote") == str(v.id)
        # the seeded groups come from no job and no checkpoint: the base model
        # text_content: the reveal fades out (CSS), and faded text has no inner_text
        assert reveal.text_content().count("base model") == 2
        if k == 1:
            screenshot(page, "arena-after-vote")
    assert all(v.session_id == votes[0].session_id for v in votes[before:])
    assert all(v.latency_ms is not None and v.latency_ms >= 0 for v in votes[before:])


def test_sides_match_what_was_shown(server, page):
    """The image on the left is sample_a: the shown bytes are the files' bytes."""
    login(page, server, server.annotator_token)
    page.locator("#arena-pair .ngs-pair[data-nonce]").wait_for()
    nonce, a_src, b_src = _shown_pair(page)
    page.locator("#vote-b").click()
    _wait_new_pair(page, nonce)
    # attached, not visible: the reveal fades out, on a loaded box before this looks
    page.locator("#arena-reveal .ngs-reveal").wait_for(state="attached")
    v = _votes_of("bob")[-1]
    assert v.outcome == "b"
    assert _image_bytes(v.sample_a_id) == _data(a_src)
    assert _image_bytes(v.sample_b_id) == _data(b_src)
    assert _data(a_src) != _data(b_src)


def test_double_click_records_one_vote(server, page):
    login(page, server, server.annotator_token)
    page.locator("#arena-pair .ngs-pair[data-nonce]").wait_for()
    before = len(_votes_of("bob"))
    nonce, _, _ = _shown_pair(page)
    page.locator("#vote-a").dblclick()
    _wait_new_pair(page, nonce)
    _wait_count(page, 1)
    page.wait_for_timeout(1500)  # anything late would have landed by now
    assert len(_votes_of("bob")) == before + 1
    assert page.locator("#arena-counter-values").get_attribute("data-session") == "1"
    # a second vote on the same pair with the same client id (a retried click) is deduped
    nonce, _, _ = _shown_pair(page)
    page.evaluate("() => { document.getElementById('vote-b').click();"
                  " document.getElementById('vote-b').click(); }")
    _wait_new_pair(page, nonce)
    page.wait_for_timeout(1500)
    assert len(_votes_of("bob")) == before + 2
    # Enter after a mouse vote votes nothing: the clicked button kept the focus, and Enter
    # clicked it again, the same vote on a pair nobody had looked at
    nonce, _, _ = _shown_pair(page)
    page.locator("#vote-tie").click()
    _wait_new_pair(page, nonce)
    _wait_count(page, 3)
    page.keyboard.press("Enter")
    page.wait_for_timeout(1500)
    assert len(_votes_of("bob")) == before + 3
    assert page.locator("#arena-counter-values").get_attribute("data-session") == "3"


def test_enter_after_a_double_click_votes_nothing(server, page):
    """The second click of a double click focused its button again (its mousedown), and Enter
    then clicked it: the same vote on the next pair, which no one had judged."""
    login(page, server, server.annotator_token)
    page.locator("#arena-pair .ngs-pair[data-nonce]").wait_for()
    nonce, _, _ = _shown_pair(page)
    page.locator("#vote-b").dblclick()
    _wait_new_pair(page, nonce)
    _wait_count(page, 1)
    page.wait_for_timeout(1000)  # the double click's vote has landed
    before = len(_votes_of("bob"))
    page.keyboard.press("Enter")
    page.wait_for_timeout(1500)  # a vote would have landed by now
    assert len(_votes_of("bob")) == before
    assert page.locator("#arena-counter-values").get_attribute("data-session") == "1"
    assert page.evaluate("() => document.activeElement && document.activeElement.id") != "vote-b"


def test_a_page_out_of_step_with_its_session_is_brought_back(server, page):
    """A page that shows a pair its session does not hold (two events drew pairs at once as
    the login set the arena up) used to have every vote taken for a repeat: the arena ignored
    every key until a reload. The next key now brings the held pair back, says that nothing
    was recorded, and the key after it votes."""
    login(page, server, server.annotator_token)
    page.locator("#arena-pair .ngs-pair[data-nonce]").wait_for()
    before = len(_votes_of("bob"))
    _, shown_a, shown_b = _shown_pair(page)
    # the page out of step: it shows a pair the session never held
    page.evaluate("() => { document.querySelector('#arena-pair .ngs-pair').dataset.nonce"
                  " = 'drawn-by-another-event'; }")
    page.keyboard.press("1")
    _wait_new_pair(page, "drawn-by-another-event")
    held, a_src, b_src = _shown_pair(page)  # the pair the session holds, with a new nonce
    assert (a_src, b_src) == (shown_a, shown_b)
    page.locator("#arena-reveal .ngs-notice").wait_for(state="attached")
    assert "nothing was recorded" in page.locator("#arena-reveal").text_content()
    assert len(_votes_of("bob")) == before
    page.keyboard.press("2")
    _wait_new_pair(page, held)
    _wait_count(page, 1)
    votes = _votes_of("bob")
    assert len(votes) == before + 1 and votes[-1].outcome == "b"

# Holds back, while `window.ngsHold` is true, the server-sent message that ends a Gradio event
# (the browser's fetch of /queue/data is wrapped; every other message passes at once). With it
# a test can act while an event is still running, however fast the server is. It also counts
# the server's close_stream messages (`window.ngsCloseStreams`).
HOLD_COMPLETION = r"""
(() => {
  const fetch0 = window.fetch;
  window.ngsHold = false;
  window.ngsCloseStreams = 0;
  window.fetch = async (...args) => {
    const resp = await fetch0(...args);
    const url = typeof args[0] === "string" ? args[0] : args[0].url;
    if (!url.includes("/queue/data") || !resp.body) return resp;
    const reader = resp.body.getReader(), dec = new TextDecoder(), enc = new TextEncoder();
    let buf = "";
    const body = new ReadableStream({
      async pull(ctrl) {
        for (;;) {
          const m = /\r?\n\r?\n/.exec(buf);
          if (m) {
            const ev = buf.slice(0, m.index + m[0].length);
            buf = buf.slice(m.index + m[0].length);
            if (ev.includes("close_stream")) window.ngsCloseStreams += 1;
            while (window.ngsHold && ev.includes("process_completed")) {
              await new Promise((r) => setTimeout(r, 20));
            }
            ctrl.enqueue(enc.encode(ev));
            return;
          }
          const {done, value} = await reader.read();
          if (done) { if (buf) ctrl.enqueue(enc.encode(buf)); ctrl.close(); return; }
          buf += dec.decode(value, {stream: true});
        }
      },
      cancel(reason) { return reader.cancel(reason); },
    });
    return new Response(body, {status: resp.status, statusText: resp.statusText,
                               headers: resp.headers});
  };
})();
"""


def test_a_vote_on_the_new_pair_while_the_last_one_prefetches_is_recorded(server, page):
    """A vote shows the next pair and then prefetches the one after it in the same event.
    With trigger_mode "once", a click on the new pair made during that prefetch was dropped:
    the annotator clicked and nothing happened (CI's arena tests timed out on a loaded box).
    Here the event's end is held back while B is clicked on the new pair: the click must
    count, on that pair. Then two buttons clicked in one tick on one pair: the first counts,
    the second adds nothing."""
    page.add_init_script(HOLD_COMPLETION)
    login(page, server, server.annotator_token)
    page.locator("#arena-pair .ngs-pair[data-nonce]").wait_for()
    before = len(_votes_of("bob"))
    first, _, _ = _shown_pair(page)
    page.evaluate("() => { window.ngsHold = true; }")
    page.locator("#vote-a").click()
    _wait_new_pair(page, first)  # shown by the first yield; the event has not ended
    second, _, _ = _shown_pair(page)
    page.locator("#vote-b").click()
    assert [v.outcome for v in _votes_of("bob")[before:]] == ["a"]
    page.evaluate("() => { window.ngsHold = false; }")
    _wait_new_pair(page, second)
    _wait_count(page, 2)
    # two buttons in one tick on the third pair; then an ordinary vote on the fourth, handled
    # after anything still waiting, so the list below is final
    third, _, _ = _shown_pair(page)
    page.evaluate("() => { document.getElementById('vote-a').click();"
                  " document.getElementById('vote-tie').click(); }")
    _wait_new_pair(page, third)
    _wait_count(page, 3)
    fourth, _, _ = _shown_pair(page)
    page.locator("#vote-both_bad").click()
    _wait_new_pair(page, fourth)
    _wait_count(page, 4)
    new = _votes_of("bob")[before:]
    assert [v.outcome for v in new] == ["a", "b", "a", "both_bad"]
    assert len({(v.sample_a_id, v.sample_b_id) for v in new}) == 4  # four pairs, once each


def test_the_event_stream_stays_open_between_votes(server, page):
    """Gradio's server closed a session's event stream whenever no event was pending, and a
    vote submitted at that moment could be answered down the closing stream: the browser
    client then took the page for disconnected and ignored every later click (CI's arena
    tests timed out that way on a loaded box). The UI keeps one event pending per page
    (app.ui.keep_event_stream_open), so after login no close_stream ever arrives."""
    page.add_init_script(HOLD_COMPLETION)
    login(page, server, server.annotator_token)
    page.locator("#arena-pair .ngs-pair[data-nonce]").wait_for()
    page.evaluate("() => { window.ngsCloseStreams = 0; }")
    before = len(_votes_of("bob"))
    for k, button in enumerate(("#vote-a", "#vote-b", "#vote-tie"), 1):
        nonce, _, _ = _shown_pair(page)
        page.locator(button).click()
        _wait_new_pair(page, nonce)
        _wait_count(page, k)
    page.wait_for_timeout(1000)  # the last vote's prefetch ends, its completion arrives
    assert len(_votes_of("bob")) == before + 3
    assert page.evaluate("() => window.ngsCloseStreams") == 0


def test_annotator_cannot_open_admin_pages(server, page):
    login(page, server, server.annotator_token)
    for tab in ("Jobs", "Datasets", "Rollouts", "Leaderboard"):
        assert page.get_by_role("tab", name=tab).count() == 0
    assert page.locator("#jobs-launch").count() == 0 or not page.locator(
        "#jobs-launch").is_visible()


def test_bad_token_is_refused(server, page):
    page.goto(server.ui)
    page.locator("#login-token input, #login-token textarea").first.fill("ngs_wrong")
    page.locator("#login-button").click()
    page.get_by_text("invalid or revoked token").wait_for()
    assert page.get_by_role("tab", name="Arena").count() == 0
    # the login box's own answer: no "reload the page" (that is for a login that ended)
    assert "reload the page" not in page.locator("#login-status").inner_text()
    # an empty box says what to enter, not "log in first" (the click was the login)
    page.locator("#login-token input, #login-token textarea").first.fill("")
    page.locator("#login-button").click()
    page.get_by_text("enter your token").wait_for()
    assert "log in first" not in page.locator("#login-status").inner_text()


def test_own_vote_count_updates_without_refresh(server, page):
    """An annotator's row on the Annotators page counts the votes just cast in the arena when
    the page is shown again, no Refresh click."""
    login(page, server, server.annotator_token)
    page.locator("#arena-pair .ngs-pair[data-nonce]").wait_for()
    page.get_by_role("tab", name="Annotators").click()
    mine = page.locator(".ngs-votes[data-user='bob']")
    mine.wait_for()
    assert int(mine.inner_text()) == len(_votes_of("bob"))
    page.get_by_role("tab", name="Arena").click()
    for k in (1, 2):
        nonce, _, _ = _shown_pair(page)
        page.locator("#vote-a").click()
        _wait_new_pair(page, nonce)
        _wait_count(page, k)
    page.get_by_role("tab", name="Annotators").click()
    page.wait_for_function(
        "(n) => { const e = document.querySelector(\".ngs-votes[data-user='bob']\");"
        " return e && Number(e.textContent) === n; }", arg=len(_votes_of("bob")))


def test_vote_buttons_draw_each_label_in_one_font(server, page):
    """The first letter of "A is better" / "B is better" came from a font that holds only a
    few glyphs and looked smaller than the rest: each button's text uses one font."""
    login(page, server, server.annotator_token)
    page.locator("#vote-a").wait_for()
    cdp = page.context.new_cdp_session(page)
    cdp.send("DOM.enable")
    cdp.send("CSS.enable")
    root = cdp.send("DOM.getDocument")["root"]["nodeId"]
    for button in ("#vote-a", "#vote-b", "#vote-both_bad"):
        node = cdp.send("DOM.querySelector", {"nodeId": root, "selector": button})["nodeId"]
        fonts = cdp.send("CSS.getPlatformFontsForNode", {"nodeId": node})["fonts"]
        assert len(fonts) == 1, (button, fonts)


def test_reveal_names_training_rollouts_and_checkpoints(server, page):
    """Issue 18: the reveal said "base model" for a training job's own rollouts and named the
    evaluate job for cross-checkpoint pairs. A new annotator who has judged everything else
    gets only pairs from a train job's iteration 10 and from two of its checkpoints: each
    reveal names the training job, its iteration or checkpoint, never the base model or the
    evaluate job."""
    from itertools import combinations

    from sqlalchemy import delete
    from stored_checkpoints import stored_checkpoint
    from ui_helpers import seed_groups

    from app.models import Checkpoint, Job, RolloutGroup, Sample
    from app.services.auth import create_user

    with session_scope() as s:
        user, token = create_user(s, "carol-reveal", "annotator")
        uid = user.id
        # finished: a running job without a heartbeat would be taken up again by the worker
        train, evaluate = Job(kind="train", status="succeeded", config={}), \
            Job(kind="evaluate", status="succeeded", config={})
        s.add_all([train, evaluate])
        s.flush()
        train_id, eval_id = train.id, evaluate.id
        ckpts = [stored_checkpoint(s, train_id, it, f"c{it}.safetensors", name=f"iter-{it:06d}")
                 for it in (10, 20)]
        # every pair already there counts as judged: only the new groups are left to offer
        rows = s.execute(select(Sample.id, Sample.group_id, RolloutGroup.purpose,
                                RolloutGroup.prompt_text)
                         .join(RolloutGroup, RolloutGroup.id == Sample.group_id)).all()
        pairs = {(min(x[0], y[0]), max(x[0], y[0])) for x, y in combinations(rows, 2)
                 if x[1] == y[1] or (x[2] == y[2] == "evaluate" and x[3] == y[3])}
        s.add_all(Vote(client_vote_id=f"seen-{lo}-{hi}", annotator_id=uid, sample_a_id=lo,
                       sample_b_id=hi, pair_lo_id=lo, pair_hi_id=hi, outcome="skip",
                       selection="test") for lo, hi in pairs)
    groups = seed_groups(1, g=2, seed=7, job_id=train_id, iteration=10, purpose="train")
    for ckpt in ckpts:  # the same prompt and seed from both checkpoints: cross-checkpoint pairs
        groups += seed_groups(1, g=2, seed=8, job_id=eval_id, purpose="evaluate",
                              checkpoint_id=ckpt)
    try:
        login(page, server, token)
        seen: list[tuple[str, str]] = []  # (selection, reveal text) of each vote
        page.locator("#arena-pair .ngs-pair[data-nonce]").wait_for()
        for _ in range(8):  # 1 + 2 within-group pairs and 2 cross-checkpoint pairs
            nonce = page.locator("#arena-pair .ngs-pair").get_attribute("data-nonce")
            if not nonce:  # "No pairs left to judge": all five are judged
                break
            page.locator("#vote-a").click()
            page.wait_for_function(  # the next pair, or the empty notice after the last
                "(old) => { const p = document.querySelector('#arena-pair .ngs-pair');"
                " return p && p.dataset.nonce !== old; }", arg=nonce)
            v = _votes_of("carol-reveal")[-1]
            reveal = page.locator(f"#arena-reveal .ngs-reveal[data-vote='{v.id}']")
            reveal.wait_for(state="attached")  # it fades out
            text = reveal.text_content()
            assert "base model" not in text and f"job {eval_id}" not in text, text
            seen.append((v.selection, text))
        assert len(_votes_of("carol-reveal")) == len(pairs) + 5
        # nothing left to judge: the vote buttons look and act disabled (they stayed
        # coloured, and a click did nothing visible)
        page.locator("#arena-pair .ngs-empty").wait_for(state="attached")
        assert page.locator("#vote-a").evaluate("e => getComputedStyle(e).pointerEvents") \
            == "none"
        page.wait_for_function(  # greyed out (through the button's own transition)
            "() => Number(getComputedStyle(document.querySelector('#vote-a')).opacity) < 0.5")
        assert any(f"training job {train_id} iteration 10" in t for _, t in seen), seen
        cross = [t for selection, t in seen if selection == "cross_checkpoint"]
        assert cross, seen
        for ckpt, it in zip(ckpts, (10, 20), strict=True):
            assert all(f"checkpoint iter-{it:06d} (#{ckpt}) of job {train_id}" in t
                       for t in cross), seen
    finally:
        with session_scope() as s:
            s.execute(delete(Vote).where(Vote.annotator_id == uid))
            s.execute(delete(Sample).where(Sample.group_id.in_(groups)))
            s.execute(delete(RolloutGroup).where(RolloutGroup.id.in_(groups)))
            s.execute(delete(Checkpoint).where(Checkpoint.id.in_(ckpts)))
            s.execute(delete(Job).where(Job.id.in_([train_id, eval_id])))
            s.execute(delete(User).where(User.id == uid))


def _set_visibility(page, state: str) -> None:
    """What the browser does when a tab goes out of sight or comes back (headless tabs are
    always in sight)."""
    page.evaluate("(s) => { Object.defineProperty(document, 'visibilityState',"
                  " {value: s, configurable: true});"
                  " document.dispatchEvent(new Event('visibilitychange')); }", state)


def test_tabs_out_of_sight_let_go_of_their_streams_so_a_third_tab_opens(server, browser):
    """Each studio tab holds two long-lived connections (its event stream and Gradio's
    heartbeat) of the six chromium opens to one host; with every tab holding both, a third tab
    in one browser never got its events answered. A tab out of sight lets go of its stream,
    and takes it back when shown: the third tab votes, and so does the first one after."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.add_init_script("window.ngsStreamPauseMs = 300;" + HOLD_COMPLETION)
    try:
        def open_tab():
            tab = context.new_page()
            tab.set_default_timeout(60_000)
            if not tabs:
                login(tab, server, server.annotator_token)
            else:  # the login's session cookie logs the later tabs in
                tab.goto(server.ui)
                tab.locator("#whoami").wait_for()
            tab.locator("#arena-pair .ngs-pair[data-nonce]").wait_for()
            return tab

        tabs = []
        for _ in range(2):
            tab = open_tab()
            _set_visibility(tab, "hidden")
            tabs.append(tab)
        for tab in tabs:  # each lets go: the server ends its stream
            tab.wait_for_function("() => window.ngsCloseStreams >= 1")
        third = open_tab()
        for tab in (third, tabs[0]):
            if tab is tabs[0]:
                _set_visibility(tab, "visible")
            nonce, _, _ = _shown_pair(tab)
            tab.keyboard.press("1")
            _wait_new_pair(tab, nonce)
            _wait_count(tab, 1)
    finally:
        context.close()


def test_a_laptop_screen_shows_the_pair_the_buttons_and_the_reveal(server, browser):
    """At 1366x768 the 520 px images pushed the vote buttons below the fold, and the reveal
    (which fades after a few seconds) to y=861: a mouse user voted blind and missed it."""
    context = browser.new_context(viewport={"width": 1366, "height": 768})
    page = context.new_page()
    try:
        login(page, server, server.annotator_token)
        page.locator("#arena-pair .ngs-pair[data-nonce]").wait_for()
        for button in ("#vote-a", "#vote-b", "#vote-tie"):
            box = page.locator(button).bounding_box()
            assert box is not None and box["y"] + box["height"] <= 768, (button, box)
        nonce, _, _ = _shown_pair(page)
        page.locator("#vote-a").click()
        _wait_new_pair(page, nonce)
        reveal = page.locator("#arena-reveal .ngs-reveal")
        reveal.wait_for()
        box = reveal.bounding_box()
        assert box is not None and box["y"] + box["height"] <= 768, box
        screenshot(page, "arena_1366x768")
    finally:
        context.close()
