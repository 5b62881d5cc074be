"""create_app(): the FastAPI application (routers, error mapping, lifespan, the UI mount)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, Response
from sqlalchemy import text
from sqlalchemy.exc import DataError, OperationalError, SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException

from app import db, queue
from app.api.methods import HeadWhereGetAnswers, allowed_methods
from app.config import UI_PATH, Settings, get_settings
from app.docs import add_docs_routes
from app.errors import ServiceError
from app.json_values import EscapingJSONResponse
from app.limits import MAX_PROBLEMS_LISTED
from app.migrate import migrations_current
from app.same_origin import SameOriginGuard, no_cross_origin_sharing, parse_allowed_origins
from app.schemas import Problems, validation_problem
from app.services.jobs import Enqueuer

log = logging.getLogger(__name__)

FAVICON = Path(__file__).resolve().parent / "ui" / "favicon.svg"


def _document_problems(app: FastAPI) -> None:
    """Make the OpenAPI document's 422 answer (FastAPI's HTTPValidationError, on every route
    that takes input) describe what `request_invalid` sends: `Problems`."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        components = schema.get("components", {}).get("schemas", {})
        if "HTTPValidationError" in components:
            problems = Problems.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(problems.pop("$defs", {}))
            components["HTTPValidationError"] = {**problems, "title": "HTTPValidationError"}
            if "#/components/schemas/ValidationError\"" not in json.dumps(schema):
                components.pop("ValidationError", None)  # HTTPValidationError's item, unused now
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


# what FastAPI says when its body parser fails for another reason than bad JSON syntax
BODY_PARSE_ERROR = "There was an error parsing the body"


def capped_problems(problems: list[tuple[str, str]], unlisted: int = 0
                    ) -> list[tuple[str, str]]:
    """The first MAX_PROBLEMS_LISTED problems, then one saying how many more there are
    (`unlisted` more were never worded): enough to fix a request by, and bounded, however
    many keys a body holds."""
    more = unlisted + max(0, len(problems) - MAX_PROBLEMS_LISTED)
    kept = problems[:MAX_PROBLEMS_LISTED]
    if more:
        kept.append(("body", f"{more} more problem(s) not listed (the first "
                             f"{MAX_PROBLEMS_LISTED} are)"))
    return kept


def database_problem(exc: SQLAlchemyError) -> str:
    """The one line a request (503) and the log say when the database failed it: its driver's
    first line, naming the setting, or the migration to run when it has no tables."""
    lines = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    first = lines[0] if lines else type(exc).__name__
    if "no such table" in first:  # SQLite's, a database never migrated
        return f"the database has no tables yet ({first}): run `python -m app migrate`"
    return f"the database (DATABASE_URL) cannot be reached: {first}; try again when it is back"


def create_app(settings: Settings | None = None, *, enqueuer: Enqueuer | None = None,
               mount_ui: bool = True) -> FastAPI:
    """Build the app. `settings` rebinds the database engine (tests); `enqueuer(job_id, kind)`
    sends launched jobs to workers (default: `app.queue.enqueue`, the Celery message of the
    kind's task on its queue, sent by name: the app never imports the worker)."""
    if settings is not None:
        db.configure(settings)
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        settings.resolved_storage_dir.mkdir(parents=True, exist_ok=True)
        try:
            if not migrations_current():
                log.warning("database is not at the newest migration: run `python -m app migrate`")
        except Exception as exc:  # a missing database must not stop the docs from loading
            log.warning("could not check migrations: %s", exc)
        yield

    # every JSON answer, an error's or a route's, survives text UTF-8 cannot hold
    app = FastAPI(title="Neighbor GRPO Studio", version="0.1.0", lifespan=lifespan,
                  default_response_class=EscapingJSONResponse,
                  description="Datasets, rollouts, pairwise votes, jobs and checkpoints.",
                  docs_url=None, redoc_url=None)  # add_docs_routes: served without a CDN
    app.state.settings = settings
    app.state.enqueuer = enqueuer or queue.enqueue

    from app.api.deps import refused_caller

    @app.exception_handler(ServiceError)
    async def service_error(_request: Request, exc: ServiceError) -> EscapingJSONResponse:
        body: dict[str, object] = {"detail": exc.message}
        body.update({k: v for k, v in exc.details.items() if v is not None})
        listed = body.get("errors")
        if isinstance(listed, list) and len(listed) > MAX_PROBLEMS_LISTED:
            # a config with 100,000 unknown reward names: the first ones, and how many more
            kept = capped_problems([(e.get("field", "body"), e.get("message", "")) for e in listed])
            body["errors"] = [{"field": f, "message": m} for f, m in kept]
            body["detail"] = "; ".join(f"{f}: {m}" for f, m in kept)
        if exc.status_code in (400, 409, 413, 422) and body.get("errors"):
            # every answer about the request's content has the shape of a validation error's
            # (README): `field` is the first problem's
            body.setdefault("field", body["errors"][0].get("field", "body"))  # type: ignore[index]
        elif exc.status_code in (400, 409, 413, 422):  # one problem, named
            field = str(body.setdefault("field", "body"))
            message = exc.message.removeprefix(f"{field}: ")
            body["errors"] = [{"field": field, "message": message}]
        headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
        return EscapingJSONResponse(body, status_code=exc.status_code, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 400 and exc.detail == BODY_PARSE_ERROR:
            if (refused := await refused_caller(request)) is not None:
                return await service_error(request, refused)
            # FastAPI's 400 for a body its parser gave up on (JSON nested thousands deep
            # overflows Python's stack): a 422 as for any other malformed JSON, in one shape
            kind = "JSON" if "json" in request.headers.get("content-type", "") else "body"
            encoding = request.headers.get("content-encoding", "identity").strip().lower()
            if isinstance(exc.__cause__, RecursionError):
                why = "nested too deeply"
            elif encoding not in ("", "identity"):  # the server does not decompress bodies
                why = f"Content-Encoding {encoding!r} is not accepted: send it uncompressed"
            elif isinstance(exc.__cause__, UnicodeDecodeError):
                why = "not UTF-8 text"
            else:
                why = "unreadable"
            message = f"malformed {kind} ({why})"
            body = Problems(detail=f"body: {message}", field="body",
                            errors=[{"field": "body", "message": message}])
            return EscapingJSONResponse(body.model_dump(), status_code=422)
        if exc.status_code == 400 and isinstance(exc.detail, str):
            # Starlette's own 400s (a multipart body its parser refused: "Invalid multipart
            # data.", "Missing boundary in multipart.") in the shape of every other answer
            # about the request's content (README: detail, field, errors)
            message = exc.detail.rstrip(".")
            body = Problems(detail=f"body: {message}", field="body",
                            errors=[{"field": "body", "message": message}])
            return EscapingJSONResponse(body.model_dump(), status_code=400,
                                        headers=getattr(exc, "headers", None))
        if exc.status_code == 405 and (allowed := allowed_methods(app.openapi(),
                                                                  request.url.path)):
            # Starlette's Allow names the first matching route's methods only
            exc = StarletteHTTPException(405, exc.detail,
                                         headers={**(exc.headers or {}),
                                                  "Allow": ", ".join(allowed)})
        return await http_exception_handler(request, exc)

    @app.exception_handler(DataError)
    async def data_error(_request: Request, exc: DataError) -> EscapingJSONResponse:
        # a value the database cannot hold (e.g. an integer out of range): the client's fault
        return EscapingJSONResponse({"detail": f"value out of range: {exc.orig}"},
                                    status_code=422)

    @app.exception_handler(OperationalError)
    async def database_away(request: Request, exc: OperationalError) -> EscapingJSONResponse:
        # the database refused or dropped the connection (stopped, restarted, the network):
        # an outage, as the broker's is (a 503, app.services.jobs), not a bug; each request
        # was a plain-text 500 and a 220-line traceback in the log
        detail = database_problem(exc)
        log.warning("%s %s: %s", request.method, request.url.path, detail)
        return EscapingJSONResponse({"detail": detail, "field": "database"}, status_code=503)

    @app.exception_handler(RequestValidationError)
    async def request_invalid(request: Request,
                              exc: RequestValidationError) -> EscapingJSONResponse:
        # FastAPI's own answer echoes each rejected input, and a NaN or an infinity there (a
        # JSON body may carry them) cannot be written as strict JSON: it became a 500. This
        # one answers as every other 422 does (app.services.jobs' config errors), naming
        # each field and what is allowed, without the inputs.
        # a body FastAPI could not parse is refused before the route's dependencies ran:
        # the caller's 401 or 403 comes first, as for a well-formed body
        if (refused := await refused_caller(request)) is not None:
            return await service_error(request, refused)
        from app.api.strict_json import QUERY_PROBLEMS

        # the query string's own problems (an unknown or repeated parameter) first, then
        # the parameters' and the body's: one answer with all of them
        query = [(p["field"], p["message"]) for p in request.scope.get(QUERY_PROBLEMS, [])]
        errors = exc.errors()
        # worded for the first ones only (each costs; the rest are counted at the end)
        problems = [validation_problem(err) for err in errors[:MAX_PROBLEMS_LISTED]]
        unworded = len(errors) - len(problems)
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if (problems and problems[0][0] == "body" and request.method in ("POST", "PUT", "PATCH")
                and content_type != "application/json"):
            # FastAPI reads a body it was not told is JSON as text or a form ("Input should be
            # a valid dictionary"): the fix is the header, so say that. `curl -d` sends
            # application/x-www-form-urlencoded; the upload's form never gets here (its
            # problems name its fields, not the body)
            problems[0] = ("body", "send the body as JSON (Content-Type: application/json), "
                                   f"not {content_type or 'without a Content-Type'}")
        if request.method == "POST" and request.url.path == "/api/jobs":
            from app.api.deps import authenticated
            from app.services.jobs import config_problems_beside

            # the bearer token only, as the route takes it (the session cookie reads files)
            scheme, _, token = request.headers.get("authorization", "").partition(" ")

            def beside() -> list[tuple[str, str]]:
                caller = authenticated(token.strip() if scheme.lower() == "bearer" else None)
                with db.new_session() as session:
                    return config_problems_beside(session, caller, exc.body)

            problems += await run_in_threadpool(beside)
        if request.method == "POST" and request.url.path == "/api/votes":
            from app.services.votes import pair_problems_beside

            # the pair's own problems (a sample not found, two that may not be compared)
            # beside a shown_at in the future or a bad outcome
            problems += await run_in_threadpool(pair_problems_beside, exc.body,
                                                {field for field, _ in problems})
        if request.method == "POST" and request.url.path == "/api/datasets":
            from app.api.datasets import upload_content_problems, upload_problems

            # the form's own problems (an unknown field, a .pdf) in the same answer, and the
            # file's content and the name's (an empty file, a name taken)
            invalid = {field for field, _ in problems}
            found = upload_problems(request)
            found += await run_in_threadpool(upload_content_problems, request,
                                             invalid | {p["field"] for p in found})
            problems += [(p["field"], p["message"]) for p in found]
        problems = list(dict.fromkeys(query + problems)) or [("body", "invalid request")]
        problems = capped_problems(problems, unworded)
        body = Problems(detail="; ".join(f"{f}: {m}" for f, m in problems),
                        field=problems[0][0],
                        errors=[{"field": f, "message": m} for f, m in problems])
        return EscapingJSONResponse(body.model_dump(), status_code=422)

    _document_problems(app)

    from app.api import (
        auth,
        body_limit,
        checkpoints,
        datasets,
        jobs,
        media,
        models,
        preference,
        rollouts,
        votes,
    )

    for module in (auth, datasets, rollouts, media, votes, jobs, models, checkpoints,
                   preference):
        app.include_router(module.router, prefix="/api")

    add_docs_routes(app)

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon() -> FileResponse:
        """The studio's icon (browsers ask for /favicon.ico; the UI's page links it too)."""
        return FileResponse(FAVICON, media_type="image/svg+xml",
                            headers={"Cache-Control": "public, max-age=86400"})

    @app.get("/healthz", tags=["health"], response_model=dict[str, str], responses={
        503: {"description": "the database cannot be reached (`detail` says why)"}})
    def healthz() -> Any:
        """200 while the server can reach its database, else 503: what docker-compose's health
        check asks. One `SELECT 1` on a pooled connection; no token needed."""
        try:
            with db.get_engine().connect() as conn:
                conn.execute(text("SELECT 1"))
        except SQLAlchemyError as exc:
            detail = database_problem(exc)
            log.warning("GET /healthz: %s", detail)
            return EscapingJSONResponse({"status": "unavailable", "detail": detail},
                                        status_code=503)
        return {"status": "ok"}

    if mount_ui:  # the Gradio UI at /ui (gradio is a server dependency: a missing one is an error)
        from app.ui import mount
        from app.ui.sessions import UiSessionGuard

        no_cross_origin_sharing(app)  # before mount: Gradio's CORS defers to the parent's
        from app.ui.streams import EndedSessionStreams

        app = mount(app)
        # an event stream whose session is gone ends as a finished one, not as a crash in the
        # server's log (app/ui/streams.py)
        app.add_middleware(EndedSessionStreams, ui_path=UI_PATH)
        # a logged-in UI session acts only for its own browser (app/ui/sessions.py)
        app.add_middleware(UiSessionGuard, ui_path=UI_PATH)
    # HEAD wherever GET answers (app/api/methods.py)
    app.add_middleware(HeadWhereGetAnswers, ui_path=UI_PATH)
    # stored files need a token on the UI's routes too (app/api/media.py says the rule)
    app.add_middleware(media.StoredFilesGuard, ui_path=UI_PATH)
    # no body passes its limit on its way to either of the above (app/api/body_limit.py)
    app.add_middleware(body_limit.RequestBodyLimit, settings=settings, ui_path=UI_PATH)
    # outermost: another page's request is refused before anything reads it (app/same_origin.py)
    app.add_middleware(SameOriginGuard,
                       allowed_origins=parse_allowed_origins(settings.allowed_origins))
    return app
