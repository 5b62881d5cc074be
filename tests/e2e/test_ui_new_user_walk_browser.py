"""What a new user's walk through the pages found, as chromium draws it: the Rollouts filter's
errors beside their fields, a long prompt filter wrapped inside the page, and a job's progress
label readable over its fill. The handlers' side: tests/app/test_ui_new_user_walk.py."""

from __future__ import annotations

from ui_helpers import login

from app.ui.common import progress_bar


def _tab(page, name: str) -> None:
    page.get_by_role("tab", name=name).click()


def _field(page, elem_id: str):
    return page.locator(f"#{elem_id} textarea, #{elem_id} input").first


def test_rollouts_filter_errors_show_beside_their_fields(server, page):
    login(page, server, server.admin_token)
    _tab(page, "Rollouts")
    page.locator("#rollouts-count").wait_for()
    _field(page, "rollouts-iteration").fill("-1")
    _field(page, "rollouts-page").fill("0")
    page.locator("#rollouts-show").click()
    iteration_error = page.locator("#rollouts-err-iteration .ngs-field-error")
    page_error = page.locator("#rollouts-err-page .ngs-field-error")
    iteration_error.wait_for()
    page_error.wait_for()
    assert "got -1" in iteration_error.inner_text()
    assert "got 0" in page_error.inner_text()
    banner = page.locator("#rollouts-groups .ngs-error").inner_text()
    assert "Iteration (empty: all):" in banner and "Page:" in banner
    # each box sits under its own field, and the field takes the error's red border
    for field, error in (("rollouts-iteration", iteration_error), ("rollouts-page", page_error)):
        above, below = page.locator(f"#{field}").bounding_box(), error.bounding_box()
        assert below["y"] >= above["y"] + above["height"] - 1, (field, above, below)
        assert abs(below["x"] - above["x"]) < 40, (field, above, below)
    red = _field(page, "rollouts-page").evaluate("e => getComputedStyle(e).borderTopColor")
    plain = _field(page, "rollouts-prompt").evaluate(
        "e => getComputedStyle(e).borderTopColor")
    assert red != plain
    # fixed: the boxes empty and the groups come back
    _field(page, "rollouts-iteration").fill("")
    _field(page, "rollouts-page").fill("1")
    page.locator("#rollouts-show").click()
    page.locator("#rollouts-count").wait_for()
    page.locator("#rollouts-err-page .ngs-field-error").wait_for(state="detached")
    assert page.locator("#rollouts-err-iteration .ngs-field-error").count() == 0


def test_a_long_prompt_filter_stays_inside_the_page(server, page):
    login(page, server, server.admin_token)
    _tab(page, "Rollouts")
    page.locator("#rollouts-count").wait_for()
    _field(page, "rollouts-prompt").fill("x" * 20_000)
    page.locator("#rollouts-show").click()
    count = page.locator('#rollouts-count[data-total="0"]')
    count.wait_for()
    assert "…" in count.inner_text()
    width = page.evaluate("document.documentElement.clientWidth")
    box = count.bounding_box()
    assert box["x"] + box["width"] <= width, (box, width)
    assert count.evaluate("e => e.scrollWidth <= e.clientWidth + 1")


def _label_contrast(page) -> float:
    """The progress label's contrast (WCAG) against the fill under its first character, for
    a bar 3% full (1/30) placed in the page as the Jobs tab places it."""
    return page.evaluate("""html => {
      const holder = document.createElement('div');
      holder.className = 'prose';
      holder.style.width = '300px';
      holder.innerHTML = html;
      document.querySelector('.gradio-container').prepend(holder);
      const span = holder.querySelector('.ngs-progress span');
      const fill = holder.querySelector('.ngs-progress-fill');
      const box = span.getBoundingClientRect();
      // the label is what the eye meets over the fill's edge, not the fill over the label
      const top = document.elementFromPoint(box.left + 2, box.top + box.height / 2);
      if (top !== span) return 0;
      const rgb = c => c.match(/[\\d.]+/g).slice(0, 3).map(Number);
      const lum = ([r, g, b]) => [r, g, b].map(v => { v /= 255;
        return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; })
        .reduce((s, v, i) => s + v * [0.2126, 0.7152, 0.0722][i], 0);
      const text = lum(rgb(getComputedStyle(span).color));
      const under = [getComputedStyle(fill).backgroundColor,
                     getComputedStyle(fill.parentElement).backgroundColor];
      const ratios = under.map(c => { const bg = lum(rgb(c));
        return (Math.max(text, bg) + 0.05) / (Math.min(text, bg) + 0.05); });
      holder.remove();
      return Math.min(...ratios);
    }""", progress_bar(1 / 30, "1/30"))


def test_the_progress_label_reads_over_its_fill_in_either_theme(server, page):
    """"1/30" over a bar 3% full: the label in the page's text colour lay half on the
    green fill; in the dark theme (light text) it was unreadable on the light track."""
    for theme in ("light", "dark"):
        page.goto(f"{server.ui}?__theme={theme}")
        page.locator("#login-button").wait_for()
        # the page's CSS in force (Gradio adds it after the first paint)
        page.wait_for_function("""() => [...document.styleSheets].some(sheet => {
          try { return [...sheet.cssRules].some(r => r.cssText.includes('ngs-progress')); }
          catch (e) { return false; } })""")
        contrast = _label_contrast(page)
        assert contrast >= 4.5, (theme, contrast)
