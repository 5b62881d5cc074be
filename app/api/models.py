"""The model directories a flux / sd3 job's `model_path` may name (those under MODELS_DIR)."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

from app.api.deps import UserDep
from app.api.strict_json import StrictJSONRoute
from app.services import jobs as svc

router = APIRouter(tags=["jobs"], route_class=StrictJSONRoute)


class ModelDirOut(BaseModel):
    path: str  # as a job's model_path takes it: relative to MODELS_DIR
    model: str | None  # flux / sd3, from model_index.json's _class_name; None when none
    problem: str | None  # None when a job of `model` can load it, else what submission says


@router.get("/models", response_model=list[ModelDirOut])
def list_models(_user: UserDep) -> list[ModelDirOut]:
    """MODELS_DIR's subdirectories, each with its model and what keeps a job from it."""
    return [ModelDirOut(**d) for d in svc.model_directories()]
