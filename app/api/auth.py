"""Who am I, and the UI's session cookie (so that a browser's `<img src>` can fetch stored
images from /api/media, which cannot carry an Authorization header)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from app.api.deps import SESSION_COOKIE, SessionDep, UserDep, session_cookie
from app.api.strict_json import StrictJSONRoute
from app.schemas import Me
from app.services import auth

router = APIRouter(prefix="/auth", tags=["auth"], route_class=StrictJSONRoute)


@router.get("/me", response_model=Me)
def me(user: UserDep) -> Me:
    return Me.model_validate(user)


@router.post("/session", response_model=Me, responses={401: {}})
def start_session(user: UserDep, request: Request, response: Response,
                  session: SessionDep) -> Me:
    """Log the browser in: the session cookie gets a session token of its own (not the bearer
    token of this call), which expires with the cookie and which logging out revokes.
    HttpOnly: page scripts cannot read it; SameSite=Strict: other sites cannot make the
    browser send it. Only routes that return stored files accept it as a cookie
    (`app.api.deps.file_reader`)."""
    token = auth.start_session(session, user)
    session.commit()
    response.set_cookie(SESSION_COOKIE, token,
                        max_age=int(auth.SESSION_LIFETIME.total_seconds()), path="/",
                        httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")
    return Me.model_validate(user)


@router.delete("/session", status_code=204)
def end_session(request: Request, response: Response, session: SessionDep) -> Response:
    """Log out (the UI's Log out): the cookie's session token is revoked and the cookie
    cleared. Needs no other token: only the cookie's holder can name its session."""
    if auth.end_session(session, session_cookie(request.cookies)):
        session.commit()
    # with the attributes it was set with (a browser matches a cookie by them)
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict",
                           secure=request.url.scheme == "https")
    response.status_code = 204
    return response
