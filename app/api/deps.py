"""Shared dependencies: the DB session, the calling user, role checks, the job enqueuer."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Annotated, Any

from fastapi import Depends, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import AfterValidator
from pydantic_core import PydanticCustomError
from sqlalchemy.orm import Session

from app import db
from app.config import Settings, get_settings
from app.errors import Forbidden, ServiceError, Unauthorized
from app.limits import MAX_ID
from app.models import User
from app.schemas import NUL_MESSAGE
from app.services import auth
from app.services.jobs import Enqueuer

# the UI's login stores the API token in this HttpOnly cookie (POST /api/auth/session)
SESSION_COOKIE = "ngs_session"

def session_cookie(cookies: Mapping[str, str]) -> str | None:
    return cookies.get(SESSION_COOKIE) or None


def authenticated(token: str | None) -> User | None:
    """The owner of `token`, an API token or a UI session's (cached, as for every API call),
    or None: for the routes a browser's cookie reaches (stored files)."""
    if not token:
        return None
    try:
        return _authenticate(token, session_ok=True)
    except Unauthorized:
        return None


bearer = HTTPBearer(auto_error=False, description="API token from `python -m app create-user`")


def get_session() -> Iterator[Session]:
    session = db.new_session()
    try:
        yield session
    finally:
        session.close()


SessionDep = Annotated[Session, Depends(get_session)]


def _authenticate(token: str | None, *, session_ok: bool) -> User:
    # (auth.authenticate answers a cached token without a query)
    with db.new_session() as session:
        return auth.authenticate(session, token, session_ok=session_ok)


async def _caller(token: str | None, *, session_ok: bool) -> User:
    """Async: a cached token costs no thread hop and no query."""
    if token:
        cached = auth.token_cache.get(auth.hash_token(token))
        if cached is not None and (session_ok or not cached[1]):
            return cached[0]
    return await run_in_threadpool(lambda: _authenticate(token, session_ok=session_ok))


async def current_user(
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> User:
    """The caller of an API route: the bearer token, an API token (a UI session's is refused:
    it is the browser's cookie, not a credential for scripts)."""
    return await _caller(creds.credentials if creds else None, session_ok=False)


async def file_reader(
    request: Request, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> User:
    """The caller of a route that returns stored bytes (images, checkpoints): the bearer token,
    or else the session cookie the UI sets at login, because a browser's `<img src>` cannot
    send a header. Only read-only routes take the cookie, so it can never trigger an action."""
    if creds:
        return await _caller(creds.credentials, session_ok=False)
    return await _caller(session_cookie(request.cookies), session_ok=True)


def admin_user(user: Annotated[User, Depends(current_user)]) -> User:
    return auth.require_role(user, "admin")


def job_launcher(user: Annotated[User, Depends(current_user)]) -> User:
    """A caller who may launch some kind of job (the job registry's launch roles); which kinds
    is launch_job's rule. Here, so that a role that may launch none is refused 403 before a
    malformed body is judged (refused_caller)."""
    from app.job_kinds import KINDS
    from app.services.jobs import launch_roles

    return auth.require_role(user, *dict.fromkeys(r for kind in KINDS
                                                    for r in launch_roles(kind)))


def _dependency_calls(dependant: Any) -> set[Any]:
    calls = set()
    for sub in getattr(dependant, "dependencies", []):
        calls.add(sub.call)
        calls |= _dependency_calls(sub)
    return calls


# the dependencies that check the caller's token
CALLER_CHECKS = {current_user, file_reader}


def route_checks(dependant: Any) -> set[Any]:
    """What of the caller a route's dependencies (`dependant`) check: its token
    (CALLER_CHECKS) and its role (admin_user, job_launcher); empty for a public route."""
    return _dependency_calls(dependant) & {*CALLER_CHECKS, admin_user, job_launcher}


async def refused_caller(request: Request, calls: set[Any] | None = None
                         ) -> ServiceError | None:
    """The 401 or 403 the matched route's own dependencies would have answered, for a request
    refused before they ran: FastAPI parses a JSON body before it resolves dependencies, so a
    malformed body would otherwise tell a caller without a token (or without the role) how
    the route reads its input. None when the caller may call the route. `calls`: the
    route's `route_checks`, found when it was built (else from the matched route now)."""
    if calls is None:
        calls = _dependency_calls(getattr(request.scope.get("route"), "dependant", None))
    if not calls & CALLER_CHECKS:
        return None
    creds = await bearer(request)
    try:
        user = await (file_reader(request, creds) if file_reader in calls
                      else current_user(creds))
        for role_gate in calls & {admin_user, job_launcher}:
            role_gate(user)
    except (Unauthorized, Forbidden) as exc:
        return exc
    return None


def get_enqueuer(request: Request) -> Enqueuer | None:
    return getattr(request.app.state, "enqueuer", None)


def settings_dep() -> Settings:
    return get_settings()


UserDep = Annotated[User, Depends(current_user)]
FileReaderDep = Annotated[User, Depends(file_reader)]
AdminDep = Annotated[User, Depends(admin_user)]
LauncherDep = Annotated[User, Depends(job_launcher)]
EnqueuerDep = Annotated[Enqueuer | None, Depends(get_enqueuer)]
SettingsDep = Annotated[Settings, Depends(settings_dep)]

PathId = Annotated[int, Path(ge=1, le=MAX_ID)]
QueryId = Annotated[int | None, Query(ge=1, le=MAX_ID)]


def _prompt_length(value: str | None) -> str | None:
    # read per request, not fixed when the route is declared: a prompt the MAX_PROMPT_LENGTH
    # setting lets an upload hold can be searched for. An error of the query's own check (as
    # max_length says it), so it comes beside the other parameters' problems in one 422.
    # a NUL is refused here too, not by the service once the other parameters passed: one 422
    # then names it beside a bad split (SQLite ends a LIKE pattern at a NUL, matching all)
    if value is not None and "\x00" in value:
        raise PydanticCustomError("nul", NUL_MESSAGE)
    limit = get_settings().max_prompt_length
    if value is not None and len(value) > limit:
        raise PydanticCustomError("string_too_long",
                                  "String should have at most {max_length} characters",
                                  {"max_length": limit})
    return value


PromptQuery = Annotated[str | None, Query(description="At most MAX_PROMPT_LENGTH characters, "
                                          "as an uploaded prompt."),
                        AfterValidator(_prompt_length)]
"""A query parameter that searches prompts: no longer than the longest prompt a dataset or
a job may hold (the MAX_PROMPT_LENGTH setting)."""


def media_url(rel_path: str) -> str:
    return f"/api/media/{rel_path}"
