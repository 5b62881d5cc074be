"""The API's documentation pages (/docs: Swagger UI, /redoc: ReDoc), their scripts and styles
served by the app itself.

FastAPI's own pages load Swagger UI and ReDoc from a CDN (cdn.jsdelivr.net), so on a machine
without internet access /docs was a blank page. The same files come here from the
`fastapi-offline` package (Swagger UI 5, which reads the OpenAPI 3.1 document FastAPI writes;
`swagger-ui-bundle` holds Swagger UI 4, which refuses it). Like the pages, they hold no user
data and need no token.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.resources import files

from fastapi import FastAPI, Request
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
    swagger_ui_default_parameters,
)
from fastapi.responses import FileResponse, HTMLResponse

# as FastAPI's own pages (Starlette routes) answer
PAGE_METHODS = ["GET", "HEAD"]
# where the pages' scripts and styles are served
ASSETS_PATH = "/docs/assets"
# the files the pages load (name: media type); nothing else in the package is served
ASSETS = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css",
          "redoc.standalone.js": "text/javascript"}


def add_docs_routes(app: FastAPI) -> None:
    """/docs, its OAuth2 redirect and /redoc, as FastAPI's own (create the app with
    `docs_url=None, redoc_url=None`), with every file they load served from ASSETS_PATH."""
    openapi_url = app.openapi_url or "/openapi.json"
    oauth2_redirect_url = app.swagger_ui_oauth2_redirect_url or "/docs/oauth2-redirect"

    def root(request: Request) -> str:
        # behind a proxy that serves the app under a prefix, as FastAPI's own pages do
        return str(request.scope.get("root_path", "")).rstrip("/")

    @app.api_route("/docs", methods=PAGE_METHODS, include_in_schema=False)
    def swagger_ui(request: Request) -> HTMLResponse:
        prefix = root(request)
        return get_swagger_ui_html(
            openapi_url=prefix + openapi_url, title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=prefix + oauth2_redirect_url,
            swagger_js_url=f"{prefix}{ASSETS_PATH}/swagger-ui-bundle.js",
            swagger_css_url=f"{prefix}{ASSETS_PATH}/swagger-ui.css",
            swagger_favicon_url=f"{prefix}/favicon.ico",
            # no call to validator.swagger.io from the browser, which may be offline too
            swagger_ui_parameters={**swagger_ui_default_parameters, "validatorUrl": None,
                                   **(app.swagger_ui_parameters or {})})

    @app.api_route(oauth2_redirect_url, methods=PAGE_METHODS, include_in_schema=False)
    def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.api_route("/redoc", methods=PAGE_METHODS, include_in_schema=False)
    def redoc(request: Request) -> HTMLResponse:
        prefix = root(request)
        # without Google's fonts (ReDoc falls back to the system's); the logo of its "API docs by
        # Redocly" link, from cdn.redoc.ly, is the one thing the page cannot show offline
        return get_redoc_html(openapi_url=prefix + openapi_url, title=f"{app.title} - ReDoc",
                              redoc_js_url=f"{prefix}{ASSETS_PATH}/redoc.standalone.js",
                              redoc_favicon_url=f"{prefix}/favicon.ico", with_google_fonts=False)

    static = files("fastapi_offline") / "static"
    for name, media_type in ASSETS.items():  # one route each: no path reaches another file
        app.add_api_route(f"{ASSETS_PATH}/{name}", _asset(str(static / name), media_type),
                          methods=["GET"], include_in_schema=False, name=f"docs_asset_{name}")


def _asset(path: str, media_type: str) -> Callable[[], FileResponse]:
    def asset() -> FileResponse:
        """A script or style sheet of the docs pages."""
        return FileResponse(path, media_type=media_type,
                            headers={"Cache-Control": "public, max-age=86400"})

    return asset
