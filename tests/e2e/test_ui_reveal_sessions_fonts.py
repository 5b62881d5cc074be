"""UI fixes found by a new user's probe, in a real browser: every vote's reveal shows (not
only the first of a page load), a login as another user in the same tab starts a fresh arena
session, bold text takes one font for all its letters, the Name field empties after Create
user, and a form's text field with an error has the red border a number field has. Each test
logs in as users of its own, so that the shared server's other tests see no votes of theirs."""

from __future__ import annotations

import time

from sqlalchemy import select
from ui_helpers import login

from app.db import session_scope
from app.models import User, Vote
from app.services import auth
from app.ui.arena import STALE_PAIR


def _new_user(name: str, role: str) -> str:
    with session_scope() as s:
        return auth.create_user(s, name, role)[1]


def _votes_of(name: str) -> list[Vote]:
    with session_scope() as s:
        uid = s.scalar(select(User.id).where(User.name == name))
        return list(s.scalars(select(Vote).where(Vote.annotator_id == uid).order_by(Vote.id)))


def _nth_vote_of(name: str, n: int, timeout: float = 30.0) -> Vote:
    """The annotator's n-th vote (1-based) once it is stored: the arena shows the next pair
    while the vote is still being written, so on a loaded machine the pair can come first."""
    deadline = time.monotonic() + timeout
    while len(votes := _votes_of(name)) < n:
        assert time.monotonic() < deadline, f"{name}'s vote {n} was never stored"
        time.sleep(0.1)
    return votes[n - 1]


def _shown_nonce(page) -> str:
    return page.locator("#arena-pair .ngs-pair[data-nonce]").get_attribute("data-nonce")


def _vote(page, button: str) -> None:
    """Click a vote button and wait for the next pair. A click that raced the arena's own
    set-up on a loaded machine is refused with STALE_PAIR (nothing recorded, the pair the
    session holds shown instead): the click is made again on that pair, as a person would."""
    for _ in range(3):
        old = _shown_nonce(page)
        page.locator(button).click()
        page.wait_for_function(
            "(old) => { const p = document.querySelector('#arena-pair .ngs-pair');"
            " return p && p.dataset.nonce && p.dataset.nonce !== old; }", arg=old)
        if STALE_PAIR not in page.locator("#arena-reveal").inner_text():
            return


# every reveal's visibility and opacity when it appears or changes (vote id, visibility,
# opacity), recorded by a MutationObserver: its callback runs before the next frame
RECORD_REVEAL_STYLES_JS = """() => {
  window.__revealStyles = [];
  new MutationObserver(() => {
    for (const e of document.querySelectorAll('#arena-reveal .ngs-reveal')) {
      const c = getComputedStyle(e);
      window.__revealStyles.push([e.dataset.vote, c.visibility, Number(c.opacity)]);
    }
  }).observe(document.body, {subtree: true, childList: true, attributes: true,
                             characterData: true});
}"""


def _wait_reveal(page, vote_id: int) -> None:
    page.locator(f"#arena-reveal .ngs-reveal[data-vote='{vote_id}']").wait_for(state="attached")


def _fonts_of(page, selector: str) -> list[str]:
    """The fonts the browser drew the element's text with (DevTools' "Rendered Fonts")."""
    cdp = page.context.new_cdp_session(page)
    cdp.send("DOM.enable")
    cdp.send("CSS.enable")
    root = cdp.send("DOM.getDocument", {"depth": -1})["root"]["nodeId"]
    node = cdp.send("DOM.querySelector", {"nodeId": root, "selector": selector})["nodeId"]
    assert node, f"{selector} is not in the page"
    fonts = cdp.send("CSS.getPlatformFontsForNode", {"nodeId": node})["fonts"]
    cdp.detach()
    return [f["postScriptName"] for f in fonts]


# Bold text (computed weight 600 or more) still in the theme's Source Sans Pro, whose weight-600
# face holds only a few glyphs: the page's visible elements with text of their own
BOLD_IN_SOURCE_SANS_JS = """() => [...document.querySelectorAll('.gradio-container *')]
  .filter((e) => e.offsetParent !== null && [...e.childNodes].some(
    (n) => n.nodeType === 3 && n.textContent.trim()))
  .filter((e) => { const c = getComputedStyle(e);
    return Number(c.fontWeight) >= 600 && c.fontFamily.startsWith('"Source Sans Pro"'); })
  .map((e) => e.tagName + ' ' + e.textContent.trim().slice(0, 40))"""


def test_every_votes_reveal_shows_and_bold_text_takes_one_font(server, page):
    token = _new_user("reveal-voter", "annotator")
    login(page, server, token)
    page.locator("#arena-pair .ngs-pair[data-nonce]").wait_for()

    _vote(page, "#vote-tie")
    first_at = time.monotonic()
    first = _nth_vote_of("reveal-voter", 1)
    _wait_reveal(page, first.id)
    # past the first reveal's fade (3.5 s): the animation has run out
    time.sleep(max(0.0, first_at + 4.2 - time.monotonic()))
    # the reveal's style as the page patches it in, read in the same task as the change: a
    # loaded machine that answers seconds later would see the new fade run out (the bug this
    # guards against is a reveal that is hidden from its first frame)
    page.evaluate(RECORD_REVEAL_STYLES_JS)
    _vote(page, "#vote-b")
    second = _nth_vote_of("reveal-voter", 2)
    assert second.id != first.id
    _wait_reveal(page, second.id)
    styles = page.evaluate("() => window.__revealStyles")
    style = next(s[1:] for s in styles if s[0] == str(second.id))
    assert style[0] == "visible" and style[1] > 0.5, style
    # "B is better" in bold: every letter from one font (the B came from another)
    assert "B is better" in page.locator("#arena-reveal .ngs-reveal b").nth(1).inner_text()
    assert len(_fonts_of(page, "#arena-reveal .ngs-reveal b:nth-of-type(2)")) == 1
    assert page.evaluate(BOLD_IN_SOURCE_SANS_JS) == []


def test_a_login_as_another_user_in_the_same_tab_starts_a_fresh_arena_session(server, page):
    first_token = _new_user("tab-admin", "admin")
    second_token = _new_user("tab-annotator", "annotator")
    login(page, server, first_token)
    page.locator("#arena-pair .ngs-pair[data-nonce]").wait_for()
    for button in ("#vote-tie", "#vote-a"):
        _vote(page, button)
    page.wait_for_function(
        "() => document.querySelector('#arena-counter-values')?.dataset.session === '2'")
    first_session = {v.session_id for v in _votes_of("tab-admin")}
    assert len(first_session) == 1
    shown_to_first = _shown_nonce(page)

    page.locator("#logout").click()
    page.locator("#login-token input, #login-token textarea").first.fill(second_token)
    page.locator("#login-button").click()
    page.wait_for_function(
        "() => document.querySelector('#whoami')?.textContent.includes('tab-annotator')")
    page.wait_for_function(
        "(old) => { const p = document.querySelector('#arena-pair .ngs-pair');"
        " return p && p.dataset.nonce && p.dataset.nonce !== old; }", arg=shown_to_first)
    counter = page.locator("#arena-counter-values")
    assert counter.get_attribute("data-session") == "0"
    assert "This session: 0" in counter.inner_text()

    _vote(page, "#vote-b")
    page.wait_for_function(
        "() => document.querySelector('#arena-counter-values')?.dataset.session === '1'")
    second = _votes_of("tab-annotator")
    assert len(second) == 1 and second[0].session_id not in first_session
    assert len(_votes_of("tab-admin")) == 2


def test_create_user_empties_the_name_and_errored_text_fields_are_red(server, page):
    login(page, server, _new_user("form-admin", "admin"))
    page.get_by_role("tab", name="Annotators").click()
    name = page.locator("#users-name input, #users-name textarea").first
    name.fill("form-new-user")
    page.locator("#users-create").click()
    page.locator("#user-created").wait_for()
    page.wait_for_function(
        "() => { const e = document.querySelector('#users-name input, #users-name textarea');"
        " return e && e.value === ''; }")
    # the "Accounts" heading: every letter from one font (its A came from another)
    heading = page.get_by_role("heading", name="Accounts")
    heading.wait_for()
    heading.evaluate("e => e.setAttribute('data-probe', 'accounts')")
    assert len(_fonts_of(page, "[data-probe='accounts']")) == 1
    assert page.evaluate(BOLD_IN_SOURCE_SANS_JS) == []

    page.get_by_role("tab", name="Jobs").click()
    page.locator("#jobs-launch-button").wait_for()
    untouched = page.locator("#cfg-model_path input, #cfg-model_path textarea").first
    prompts = page.locator("#cfg-prompts textarea, #cfg-prompts input").first
    weights = page.locator("#cfg-reward_weights textarea, #cfg-reward_weights input").first
    anchors = page.locator("#cfg-num_anchors input").first
    prompts.fill("not json")
    weights.fill("{not json")
    anchors.fill("0")  # out of the field's range: Gradio's own red border
    anchors.press("Tab")
    page.locator("#jobs-launch-button").click()
    for field in ("prompts", "reward_weights", "num_anchors"):
        page.locator(f"#err-{field} .ngs-field-error").wait_for()

    def border(locator) -> str:
        return locator.evaluate("e => getComputedStyle(e).borderTopColor")

    red = border(anchors)
    assert red != border(untouched)
    assert border(prompts) == red and border(weights) == red
