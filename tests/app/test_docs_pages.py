"""/docs and /redoc work offline: FastAPI's own pages load Swagger UI and ReDoc from a CDN,
so /docs was blank on a machine without internet access (app/docs.py)."""

from __future__ import annotations

import re

import pytest


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_the_docs_pages_load_nothing_from_another_site(client, page):
    r = client.get(page)  # no token: the docs hold no user data
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", r.text), r.text
    assert "cdn.jsdelivr.net" not in r.text and "fonts.googleapis.com" not in r.text
    assets = re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']""", r.text)
    assert {"script": any(a.endswith(".js") for a in assets),
            "style": page == "/redoc" or any(a.endswith(".css") for a in assets)} == \
        {"script": True, "style": True}, assets
    for asset in assets:
        got = client.get(asset)
        assert got.status_code == 200, asset
        if asset.endswith(".js"):
            assert got.headers["content-type"].startswith("text/javascript")
            assert len(got.content) > 100_000  # the whole bundle
        elif asset.endswith(".css"):
            assert got.headers["content-type"].startswith("text/css")
            assert b".swagger-ui" in got.content
    # the OpenAPI document the page reads is the app's
    assert "'/openapi.json'" in r.text or '"/openapi.json"' in r.text


def test_swagger_ui_reads_openapi_3_1(client):
    """The served Swagger UI knows the OpenAPI version FastAPI writes (Swagger UI 4 said
    "Unable to render this definition" for 3.1)."""
    version = client.get("/openapi.json").json()["openapi"]
    assert version.startswith("3.1")
    bundle = client.get("/docs/assets/swagger-ui-bundle.js").content
    assert b"openapi: 3.1.x" in bundle or b"openapi: 3.1.0" in bundle


def test_only_the_pages_own_files_are_served(client):
    for name in ("core.py", "..%2F__init__.py", "favicon.png", "swagger-ui.css.map"):
        assert client.get(f"/docs/assets/{name}").status_code == 404, name
