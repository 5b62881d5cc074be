"""Fixtures for the browser tests: the app under uvicorn with a real worker (one per session),
Debian's chromium driven by Playwright, a fresh browser context per test (`ui_helpers`)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import pytest
from ui_helpers import CHROMIUM, CHROMIUM_ARGS, Server, seed_groups, start_server


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Iterator[Server]:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium; `make setup` does it)")
    tmp = tmp_path_factory.mktemp("ui")
    s = start_server(tmp)
    seed_groups(40, g=4, seed=1)
    try:
        yield s
    finally:
        s.stop()
        from app.config import get_settings

        get_settings.cache_clear()


@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser, request):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    pg.set_default_timeout(60_000)  # generous: the 2-core box is often loaded
    # what the page did, for the report of a failed test: console lines and the app's own
    # requests (Gradio's queue, the API; not static assets), with seconds since the start
    start = time.monotonic()
    events: deque[str] = deque(maxlen=400)

    def note(*parts: object) -> None:
        events.append(f"{time.monotonic() - start:7.2f} " + " ".join(str(p) for p in parts))

    def wanted(url: str) -> bool:
        return "/assets/" not in url and "/static/" not in url and "theme.css" not in url

    pg.on("console", lambda m: note("console", m.type, m.text[:500]))
    pg.on("pageerror", lambda e: note("pageerror", str(e)[:500]))
    pg.on("request", lambda r: wanted(r.url) and note(">", r.method, r.url.split("/", 3)[-1]))
    pg.on("response", lambda r: wanted(r.url) and note("<", r.status, r.url.split("/", 3)[-1]))
    pg.on("requestfailed", lambda r: wanted(r.url) and note("x", r.url.split("/", 3)[-1],
                                                            r.failure))
    request.node.browser_events = events
    try:
        yield pg
    finally:
        context.close()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    if rep.when == "call" and rep.failed and "server" in item.fixturenames:
        s = item.funcargs.get("server")
        if s is not None:
            rep.sections.append(("server logs", s.log_text()))
        events = getattr(item, "browser_events", None)
        if events:
            rep.sections.append(("browser events", "\n".join(events)))
    return rep
