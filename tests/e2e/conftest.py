"""Fixtures for the browser tests: the app under uvicorn with a real worker (one per session),
Debian's chromium driven by Playwright, a fresh browser context per test (`ui_helpers`)."""

from __future__ import annotations

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
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    pg.set_default_timeout(60_000)  # generous: the 2-core box is often loaded
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
    return rep
