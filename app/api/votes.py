from __future__ import annotations

import json
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from app import db
from app.api.deps import MAX_ID, SessionDep, UserDep, media_url
from app.api.media import add_head_route, as_requested
from app.api.strict_json import StrictJSONRoute
from app.models import User
from app.schemas import NextPair, PairSide, VoteIn, VoteOut
from app.services import votes as svc

router = APIRouter(prefix="/votes", tags=["votes"], route_class=StrictJSONRoute)


# The two hot endpoints are async and do their database work in one thread-pool hop.
def _next(user_id: int, exclude: list[int]) -> tuple[svc.PairChoice, float | None] | None:
    """The pair and how far apart its images are (only the API gives it; the UI does not show
    it). The images are cached: a within-group pick has just compared the same two."""
    with db.new_session() as session:
        choice = svc.next_pair(session, user_id, exclude=exclude)
    if choice is None:
        return None
    return choice, svc.differing_fraction(choice.a_path, choice.b_path)


def _vote(user: User, body: VoteIn) -> tuple[VoteOut, bool]:
    with db.new_session() as session:
        vote, created = svc.record_vote(session, user, **body.model_dump())
        return VoteOut.model_validate(vote), created


@router.get("/next", response_model=NextPair, responses={204: {"description": "no pair left"}})
async def next_pair(user: UserDep,
                    exclude: Annotated[list[Annotated[int, Query(ge=1, le=MAX_ID)]], Query(
                        max_length=100, description="sample ids not to show (e.g. the pair "
                        "on screen, when prefetching)")] = []) -> NextPair | Response:  # noqa: B006
    found = await run_in_threadpool(_next, user.id, exclude)
    if found is None:
        return Response(status_code=204)
    choice, difference = found
    return NextPair(prompt=choice.prompt, selection=choice.selection, pixel_difference=difference,
                    a=PairSide(sample_id=choice.a_id, image_url=media_url(choice.a_path)),
                    b=PairSide(sample_id=choice.b_id, image_url=media_url(choice.b_path)))


@router.post("", response_model=VoteOut, status_code=201,
             responses={200: {"model": VoteOut, "description": "duplicate client_vote_id"},
                        409: {"description": "pair already judged, or client_vote_id already "
                              "used for a different vote"}, 422: {}})
async def post_vote(body: VoteIn, user: UserDep) -> VoteOut | Response:
    out, created = await run_in_threadpool(_vote, user, body)
    if created:
        return out
    out.duplicate = True
    return Response(out.model_dump_json(), status_code=200, media_type="application/json")


@router.get("/export", responses={200: {"content": {"application/x-ndjson": {},
                                                    "application/vnd.apache.parquet": {}}}})
def export(request: Request, session: SessionDep, user: UserDep,
           format: Literal["jsonl", "parquet"] = "jsonl") -> Response:
    """Every vote for an admin; an annotator's own votes for an annotator (who voted, when and
    how fast is per-person data, as the admin-only annotator statistics are)."""
    annotator_id = None if user.role == "admin" else user.id
    # HEAD: the export is built all the same, for its Content-Length (what GET sends)
    if format == "parquet":
        return as_requested(request, Response(
            svc.export_parquet(session, annotator_id=annotator_id),
            media_type="application/vnd.apache.parquet",
            headers={"Content-Disposition": 'attachment; filename="votes.parquet"'}))
    # allow_nan=False: strict JSON, always (no row field can hold NaN or inf today)
    body = "".join(json.dumps(r, ensure_ascii=False, allow_nan=False) + "\n"
                   for r in svc.export_votes(session, annotator_id=annotator_id))
    return as_requested(request, Response(
        body, media_type="application/x-ndjson",
        headers={"Content-Disposition": 'attachment; filename="votes.jsonl"'}))


add_head_route(router, "/export", export, operation_id="export_votes_head",
               responses={200: {"content": {"application/x-ndjson": {},
                                            "application/vnd.apache.parquet": {}}}})
