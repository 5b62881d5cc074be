"""Humans in the loop: the fitted preference models, annotator quality, annotator accounts."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query

from app.api.deps import MAX_ID, AdminDep, FileReaderDep, PathId, SessionDep, UserDep
from app.api.media import StoredFileResponse, add_head_route
from app.api.strict_json import StrictJSONRoute
from app.models import PreferenceModelRow
from app.schemas import (
    AnnotatorStats,
    Page,
    PreferenceModelOut,
    UserCreated,
    UserExcluded,
    UserIn,
    UserOut,
    UserPatch,
    UserRevoked,
    UserTokenReplaced,
)
from app.services import annotators, auth, storage
from app.services import preference as svc

router = APIRouter(tags=["preference"], route_class=StrictJSONRoute)


def _out(row: PreferenceModelRow) -> PreferenceModelOut:
    out = PreferenceModelOut.model_validate(row)
    out.download_url = f"/api/preference-models/{row.version}/download"
    return out


@router.get("/preference-models", response_model=Page[PreferenceModelOut])
def list_models(session: SessionDep, _user: UserDep,
                limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                offset: Annotated[int, Query(ge=0, le=MAX_ID)] = 0) -> Page[PreferenceModelOut]:
    """Newest first; the first is what training (`preference_model: latest`) and active pair
    selection use."""
    rows, total = svc.list_models(session, limit=limit, offset=offset)
    return Page(items=[_out(r) for r in rows], total=total, limit=limit, offset=offset)


# a version as configs spell it ("v3", `preference_model`) or as the list gives it (3)
VersionPath = Annotated[str, Path(pattern=r"^v?[0-9]{1,12}$",
                                  description="The model's version: 3 or v3.")]


@router.get("/preference-models/{version}/download", responses={401: {}, 404: {}})
def download(version: VersionPath, session: SessionDep,
             _user: FileReaderDep) -> StoredFileResponse:
    row = svc.get_model(session, int(version.removeprefix("v")))
    return StoredFileResponse(storage.resolve(row.path), media_type="application/octet-stream",
                              filename=f"preference-v{row.version}.safetensors")


add_head_route(router, "/preference-models/{version}/download", download,
               operation_id="download_preference_model_head", responses={401: {}, 404: {}})


@router.get("/annotators", response_model=list[AnnotatorStats])
def annotator_stats(session: SessionDep, _admin: AdminDep) -> list[AnnotatorStats]:
    """Votes, median decision time, agreement with the majority on shared pairs and with the
    automatic reward, and `flagged` for votes that look random (not dropped)."""
    return [AnnotatorStats(**row) for row in annotators.stats(session)]


@router.post("/users", response_model=UserCreated, status_code=201)
def create_user(body: UserIn, session: SessionDep, _admin: AdminDep) -> UserCreated:
    """A new user and its API token (shown once)."""
    user, token = auth.create_user(session, body.name, body.role)
    session.commit()
    return UserCreated(id=user.id, name=user.name, role=user.role,
                       created_at=user.created_at, token=token)


@router.get("/users", response_model=list[UserOut])
def list_users(session: SessionDep, _admin: AdminDep) -> list[UserOut]:
    """Every user, with how many live tokens it has (0: revoked, cannot log in)."""
    return [UserOut(**row) for row in auth.list_users(session)]


@router.post("/users/{user_id}/revoke", response_model=UserRevoked, responses={404: {}, 422: {}})
def revoke_user(user_id: PathId, session: SessionDep, admin: AdminDep) -> UserRevoked:
    """Revoke every token of the user at once (their votes stay); not your own."""
    n = auth.revoke_user(session, user_id, by=admin)
    session.commit()
    return UserRevoked(id=user_id, tokens_revoked=n)


@router.post("/users/{user_id}/token", response_model=UserTokenReplaced, status_code=201,
             responses={404: {}, 422: {}})
def replace_token(user_id: PathId, session: SessionDep, admin: AdminDep) -> UserTokenReplaced:
    """A new API token for the user (shown once), for one lost or leaked, or to give a
    revoked user access again: their earlier tokens and UI sessions are revoked. Not your
    own."""
    user, token, revoked = auth.replace_token(session, user_id, by=admin)
    session.commit()
    return UserTokenReplaced(id=user.id, name=user.name, role=user.role,
                             created_at=user.created_at, token=token, tokens_revoked=revoked)


@router.patch("/users/{user_id}", response_model=UserExcluded, responses={404: {}, 422: {}})
def update_user(user_id: PathId, body: UserPatch, session: SessionDep,
                _admin: AdminDep) -> UserExcluded:
    """Exclude a user's votes from fitting and the leaderboard, or include them again (the
    Annotators page's switch): the flag on the user and on every vote they cast."""
    changed = annotators.set_excluded(session, user_id, body.excluded)
    session.commit()
    return UserExcluded(id=user_id, excluded=body.excluded, votes_changed=changed)
