from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, Response, StreamingResponse

from app.api.deps import MAX_ID, FileReaderDep, PathId, QueryId, SessionDep, UserDep
from app.api.media import StoredFileResponse, add_head_route, as_requested
from app.api.strict_json import StrictJSONRoute
from app.limits import DEFAULT_BOOTSTRAP, MAX_BOOTSTRAP
from app.models import Checkpoint
from app.schemas import CheckpointOut, Leaderboard, Page
from app.services import checkpoints as svc
from app.services import leaderboard as lb

router = APIRouter(tags=["checkpoints"], route_class=StrictJSONRoute)


def ckpt_out(c: Checkpoint) -> CheckpointOut:
    out = CheckpointOut.model_validate(c)
    # a base model's row (an evaluate job's include_base) has no files of its own
    out.download_url = "" if svc.is_base(c) else f"/api/checkpoints/{c.id}/download"
    return out


@router.get("/checkpoints", response_model=Page[CheckpointOut])
def list_checkpoints(session: SessionDep, _user: UserDep, job_id: QueryId = None,
                     limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                     offset: Annotated[int, Query(ge=0, le=MAX_ID)] = 0) -> Page[CheckpointOut]:
    rows, total = svc.list_checkpoints(session, job_id=job_id, limit=limit, offset=offset)
    return Page(items=[ckpt_out(c) for c in rows], total=total, limit=limit, offset=offset)


@router.get("/checkpoints/{checkpoint_id}", response_model=CheckpointOut,
            responses={401: {}, 404: {}})
def get_checkpoint(checkpoint_id: PathId, session: SessionDep, _user: UserDep) -> CheckpointOut:
    return ckpt_out(svc.get_checkpoint(session, checkpoint_id))


@router.get("/checkpoints/{checkpoint_id}/download", response_class=FileResponse,
            responses={401: {}, 404: {}})
def download(checkpoint_id: PathId, request: Request, session: SessionDep,
             _user: FileReaderDep, format: Literal["weights", "zip"] = "weights") -> Response:
    """The weights file (a diffusers LoRA a stock pipeline loads, the shapes model, a full
    fine-tune's transformer weights); `format=zip`: the whole checkpoint directory to take
    away (weights, config, model card), without the optimizer state."""
    if format == "zip":
        name, chunks = svc.checkpoint_archive(session, checkpoint_id)
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)  # a header takes no quotes or non-ASCII
        # HEAD: the headers only, the zip never built (GET streams it, without a length)
        return as_requested(request, StreamingResponse(
            chunks, media_type="application/zip",
            headers={"Content-Disposition": f'attachment; filename="{safe}.zip"'}))
    ckpt = svc.get_checkpoint(session, checkpoint_id)
    full = svc.checkpoint_file(session, checkpoint_id)
    suffix = Path(full).suffix or ".safetensors"
    return StoredFileResponse(full, media_type="application/octet-stream",
                              filename=f"{ckpt.name}{suffix}")


add_head_route(router, "/checkpoints/{checkpoint_id}/download", download,
               response_class=FileResponse, operation_id="download_checkpoint_head",
               responses={401: {}, 404: {}})


@router.get("/leaderboard", response_model=Leaderboard, tags=["leaderboard"])
def leaderboard(session: SessionDep, _user: UserDep,
                bootstrap: Annotated[int, Query(ge=0, le=MAX_BOOTSTRAP)] = DEFAULT_BOOTSTRAP,
                seed: Annotated[int, Query(ge=0, le=MAX_ID)] = 0) -> Leaderboard:
    return Leaderboard.model_validate(lb.compute(session, bootstrap=bootstrap, seed=seed))
