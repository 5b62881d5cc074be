"""Who am I, and the UI's session cookie (so that a browser's `<img src>` can fetch stored
images from /api/media, which cannot carry an Authorization header)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from app.api.deps import SESSION_COOKIE, UserDep
from app.schemas import Me

router = APIRouter(prefix="/auth", tags=["auth"])

SESSION_MAX_AGE = 7 * 24 * 3600


@router.get("/me", response_model=Me)
def me(user: UserDep) -> Me:
    return Me.model_validate(user)


@router.post("/session", response_model=Me, responses={401: {}})
def start_session(user: UserDep, request: Request, response: Response) -> Me:
    """Set the session cookie to the bearer token of this call (HttpOnly: page scripts cannot
    read it; SameSite=Strict: other sites cannot make the browser send it). Only routes that
    return stored files accept it (`app.api.deps.file_reader`)."""
    token = request.headers["authorization"].partition(" ")[2].strip()
    response.set_cookie(SESSION_COOKIE, token, max_age=SESSION_MAX_AGE, path="/",
                        httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")
    return Me.model_validate(user)


@router.delete("/session", status_code=204)
def end_session(response: Response) -> Response:
    """Forget the session cookie (the UI's Log out)."""
    response.delete_cookie(SESSION_COOKIE, path="/")
    response.status_code = 204
    return response
