from __future__ import annotations

import json
from typing import Annotated, Literal

from fastapi import APIRouter, Query
from fastapi.responses import Response

from app.api.deps import MAX_ID, SessionDep, UserDep, media_url
from app.schemas import NextPair, PairSide, VoteIn, VoteOut
from app.services import votes as svc

router = APIRouter(prefix="/votes", tags=["votes"])


@router.get("/next", response_model=NextPair, responses={204: {"description": "no pair left"}})
def next_pair(session: SessionDep, user: UserDep,
              exclude: Annotated[list[Annotated[int, Query(ge=1, le=MAX_ID)]], Query(
                  max_length=100, description="sample ids not to show (e.g. the pair on "
                  "screen, when prefetching)")] = []) -> NextPair | Response:  # noqa: B006
    choice = svc.next_pair(session, user.id, exclude=exclude)
    if choice is None:
        return Response(status_code=204)
    return NextPair(prompt=choice.prompt, selection=choice.selection,
                    a=PairSide(sample_id=choice.a_id, image_url=media_url(choice.a_path)),
                    b=PairSide(sample_id=choice.b_id, image_url=media_url(choice.b_path)))


@router.post("", response_model=VoteOut, status_code=201,
             responses={200: {"model": VoteOut, "description": "duplicate client_vote_id"},
                        409: {}, 422: {}})
def post_vote(body: VoteIn, session: SessionDep, user: UserDep) -> VoteOut | Response:
    vote, created = svc.record_vote(session, user, **body.model_dump())
    out = VoteOut.model_validate(vote)
    if created:
        return out
    out.duplicate = True
    return Response(out.model_dump_json(), status_code=200, media_type="application/json")


@router.get("/export", responses={200: {"content": {"application/x-ndjson": {},
                                                    "application/vnd.apache.parquet": {}}}})
def export(session: SessionDep, _user: UserDep,
           format: Literal["jsonl", "parquet"] = "jsonl") -> Response:
    if format == "parquet":
        return Response(svc.export_parquet(session), media_type="application/vnd.apache.parquet",
                        headers={"Content-Disposition": 'attachment; filename="votes.parquet"'})
    body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in svc.export_votes(session))
    return Response(body, media_type="application/x-ndjson",
                    headers={"Content-Disposition": 'attachment; filename="votes.jsonl"'})
