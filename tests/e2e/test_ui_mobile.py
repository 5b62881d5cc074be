"""The UI on a phone (390 px wide): wide tables scroll sideways instead of being cut off, the
header's title keeps its words whole, and Log out stays a small button."""

from __future__ import annotations

from ui_helpers import login, screenshot

PHONE = {"width": 390, "height": 844}

# For each word of the title: how many line boxes it spans (2 = broken mid-word).
WORD_LINES_JS = """() => {
  const h2 = [...document.querySelectorAll('h2')]
    .find(e => e.textContent.includes('Neighbor GRPO Studio'));
  const node = [...h2.childNodes].find(n => n.nodeType === Node.TEXT_NODE);
  const out = {};
  let i = 0;
  for (const word of node.textContent.split(' ')) {
    const range = document.createRange();
    range.setStart(node, i);
    range.setEnd(node, i + word.length);
    out[word] = range.getClientRects().length;
    i += word.length + 1;
  }
  return out;
}"""


def test_phone_layout_header_and_wide_tables(server, browser):
    context = browser.new_context(viewport=PHONE)
    page = context.new_page()
    page.set_default_timeout(60_000)
    try:
        login(page, server, server.admin_token)
        assert page.evaluate(WORD_LINES_JS) == {"Neighbor": 1, "GRPO": 1, "Studio": 1}
        logout = page.locator("#logout").bounding_box()
        assert logout["height"] < 48 and logout["width"] < 160, logout  # a button, not a block

        # the narrow tab bar folds the later tabs into its "More tabs" menu
        page.get_by_role("button", name="More tabs").click()
        page.locator(".overflow-dropdown button", has_text="Annotators").click()
        table = page.locator("#annotators-table table")
        table.wait_for()
        box = page.evaluate("""() => {
          const wrap = document.querySelector('#annotators-table .ngs-table-wrap');
          const r = wrap.getBoundingClientRect();
          return {overflow: getComputedStyle(wrap).overflowX, client: wrap.clientWidth,
                  scroll: wrap.scrollWidth, right: r.right, viewport: window.innerWidth};
        }""")
        # the table is wider than the phone; its box scrolls and stays on the screen
        assert box["scroll"] > box["client"] and box["overflow"] == "auto", box
        assert box["right"] <= box["viewport"], box
        last = page.locator("#annotators-table th").last
        last.scroll_into_view_if_needed()
        assert last.is_visible()
        screenshot(page, "annotators-phone")
    finally:
        context.close()


def test_phone_arena_shows_the_pair_every_vote_button_and_the_reveal(server, browser):
    """Gradio stacked the five vote buttons one a row under the pair's 300 px minimum: at
    375x667 Both bad and Skip lay below the fold, and at 390x844 the reveal of a vote did
    (y=836), so an annotator on a phone scrolled for every skip and missed every reveal."""
    for viewport, reveal_shows in (({"width": 375, "height": 667}, False), (PHONE, True)):
        context = browser.new_context(viewport=viewport, has_touch=True, is_mobile=True)
        page = context.new_page()
        page.set_default_timeout(60_000)
        try:
            login(page, server, server.annotator_token)
            pair = page.locator("#arena-pair .ngs-pair[data-nonce]")
            pair.wait_for()
            image = page.locator("#arena-pair img[alt='image B']").bounding_box()
            assert image is not None and image["y"] >= 0
            for outcome in ("a", "b", "tie", "both_bad", "skip"):
                box = page.locator(f"#vote-{outcome}").bounding_box()
                assert box is not None and box["y"] + box["height"] <= viewport["height"], (
                    viewport, outcome, box)
            nonce = pair.get_attribute("data-nonce")
            page.locator("#vote-skip").tap()
            page.wait_for_function(
                "(old) => { const p = document.querySelector('#arena-pair .ngs-pair');"
                " return p && p.dataset.nonce && p.dataset.nonce !== old; }", arg=nonce)
            if reveal_shows:
                # where it is laid out, from the page: it fades to visibility hidden after
                # 3.5 s, and a loaded box reaches this line later (a wait for it visible, or
                # Playwright's bounding_box, which is None for a hidden element, then failed)
                reveal = page.locator("#arena-reveal .ngs-reveal")
                reveal.wait_for(state="attached")
                box = reveal.evaluate("e => { const r = e.getBoundingClientRect();"
                                      " return {y: r.y, height: r.height}; }")
                assert box["height"] > 0 and box["y"] + box["height"] <= viewport["height"], box
                screenshot(page, "arena-phone")
        finally:
            context.close()
