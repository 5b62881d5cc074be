from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from app.api.deps import (
    MAX_ID,
    PathId,
    PromptQuery,
    QueryId,
    SessionDep,
    UserDep,
    media_url,
)
from app.api.strict_json import StrictJSONRoute
from app.job_kinds import PurposeName
from app.models import RolloutGroup
from app.schemas import GroupOut, Page, SampleOut, refuse_nul
from app.services import rollouts as svc

router = APIRouter(tags=["rollouts"], route_class=StrictJSONRoute)


def _thumbnail_url(image_path: str) -> str | None:
    thumb = svc.thumbnail_of(image_path)
    return media_url(thumb) if thumb else None


def group_out(g: RolloutGroup) -> GroupOut:
    return GroupOut(
        id=g.id, job_id=g.job_id, iteration=g.iteration, purpose=g.purpose,
        prompt_id=g.prompt_id, prompt_text=g.prompt_text, checkpoint_id=g.checkpoint_id,
        solver=g.solver, steps=g.steps, sigma=g.sigma, seed=g.seed, created_at=g.created_at,
        samples=[SampleOut(id=s.id, member_index=s.member_index, image_url=media_url(s.image_path),
                           thumbnail_url=_thumbnail_url(s.image_path), rewards=s.rewards or {},
                           advantage=s.advantage, is_anchor=s.is_anchor)
                 for s in g.samples],
    )


@router.get("/rollouts", response_model=Page[GroupOut])
def list_groups(session: SessionDep, _user: UserDep, job_id: QueryId = None,
                iteration: Annotated[int | None, Query(ge=0, le=MAX_ID)] = None,
                prompt_id: QueryId = None,
                prompt: PromptQuery = None,
                checkpoint_id: QueryId = None,
                purpose: PurposeName | None = None,
                limit: Annotated[int, Query(ge=1, le=500)] = 50,
                offset: Annotated[int, Query(ge=0, le=MAX_ID)] = 0) -> Page[GroupOut]:
    refuse_nul("prompt", prompt)  # as GET /api/prompts refuses it in q
    rows, total = svc.list_groups(session, job_id=job_id, iteration=iteration,
                                  prompt_id=prompt_id, prompt=prompt,
                                  checkpoint_id=checkpoint_id, purpose=purpose,
                                  limit=limit, offset=offset)
    return Page(items=[group_out(g) for g in rows], total=total, limit=limit, offset=offset)


@router.get("/rollouts/{group_id}", response_model=GroupOut, responses={404: {}})
def get_group(group_id: PathId, session: SessionDep, _user: UserDep) -> GroupOut:
    return group_out(svc.get_group(session, group_id))
