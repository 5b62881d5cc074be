from __future__ import annotations

import csv
import io
import json
from typing import Annotated, Literal

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import Response, StreamingResponse

from app.api.deps import AdminDep, PathId, QueryId, SessionDep, SettingsDep, UserDep
from app.errors import PayloadTooLarge
from app.schemas import DatasetOut, Page, PromptOut
from app.services import datasets as svc

router = APIRouter(tags=["datasets"])


@router.post("/datasets", response_model=DatasetOut, status_code=201,
             responses={400: {}, 413: {}, 422: {}})
def upload_dataset(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    _admin: AdminDep,
    file: Annotated[UploadFile, File(description="prompts as .txt, .csv, .jsonl or .parquet")],
    name: Annotated[str | None, Form(max_length=200)] = None,
    eval_fraction: Annotated[float, Form(ge=0.0, lt=1.0)] = 0.0,
    seed: Annotated[int, Form(ge=0, le=2**31 - 1)] = 0,
) -> DatasetOut:
    filename = file.filename or ""
    limit = settings.max_upload_bytes
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit + 1024 * 1024:
        raise PayloadTooLarge(f"{filename}: file is larger than the limit of {limit} bytes",
                              file=filename)
    data = file.file.read(limit + 1)
    result = svc.import_dataset(session, filename=filename, data=data, name=name,
                                eval_fraction=eval_fraction, seed=seed,
                                max_prompt_length=settings.max_prompt_length, max_bytes=limit)
    session.commit()
    return DatasetOut.model_validate(result.dataset)


@router.get("/datasets", response_model=Page[DatasetOut])
def list_datasets(session: SessionDep, _user: UserDep,
                  limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                  offset: Annotated[int, Query(ge=0, le=2**31)] = 0) -> Page[DatasetOut]:
    rows, total = svc.list_datasets(session, limit=limit, offset=offset)
    return Page(items=[DatasetOut.model_validate(r) for r in rows], total=total, limit=limit,
                offset=offset)


@router.get("/datasets/{dataset_id}", response_model=DatasetOut, responses={404: {}})
def get_dataset(dataset_id: PathId, session: SessionDep, _user: UserDep) -> DatasetOut:
    return DatasetOut.model_validate(svc.get_dataset(session, dataset_id))


@router.get("/datasets/{dataset_id}/export", responses={404: {}})
def export_dataset(dataset_id: PathId, session: SessionDep, _user: UserDep,
                   format: Literal["jsonl", "csv"] = "jsonl") -> Response:
    rows = svc.export_rows(session, dataset_id)
    if format == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf)
        writer.writerow(["id", "prompt", "split", "metadata"])
        for r in rows:
            writer.writerow([r["id"], r["prompt"], r["split"],
                             json.dumps(r["metadata"]) if r["metadata"] else ""])
        body, media = buf.getvalue(), "text/csv"
    else:
        body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        media = "application/x-ndjson"
    return StreamingResponse(
        iter([body]), media_type=media,
        headers={"Content-Disposition": f'attachment; filename="dataset-{dataset_id}.{format}"'},
    )


@router.delete("/datasets/{dataset_id}", status_code=204, responses={404: {}, 409: {}})
def delete_dataset(dataset_id: PathId, session: SessionDep, _admin: AdminDep) -> Response:
    svc.delete_dataset(session, dataset_id)
    session.commit()
    return Response(status_code=204)


@router.get("/prompts", response_model=Page[PromptOut])
def list_prompts(session: SessionDep, _user: UserDep,
                 dataset_id: QueryId = None,
                 split: Literal["train", "eval"] | None = None,
                 q: Annotated[str | None, Query(max_length=2000)] = None,
                 limit: Annotated[int, Query(ge=1, le=1000)] = 50,
                 offset: Annotated[int, Query(ge=0, le=2**31)] = 0) -> Page[PromptOut]:
    rows, total = svc.list_prompts(session, dataset_id=dataset_id, split=split, q=q,
                                   limit=limit, offset=offset)
    return Page(items=[PromptOut.model_validate(r) for r in rows], total=total, limit=limit,
                offset=offset)
