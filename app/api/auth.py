from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import UserDep
from app.schemas import Me

router = APIRouter(prefix="/auth", tags=["auth"])


@router.get("/me", response_model=Me)
def me(user: UserDep) -> Me:
    return Me.model_validate(user)
