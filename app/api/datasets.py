from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Coroutine
from typing import Annotated, Any, Literal

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import WithJsonSchema
from python_multipart.multipart import parse_options_header
from sqlalchemy.orm import Session
from starlette.types import Message

from app import db
from app.api.body_limit import FORM_OVERHEAD
from app.api.deps import (
    AdminDep,
    PathId,
    PromptQuery,
    QueryId,
    SessionDep,
    SettingsDep,
    UserDep,
    admin_user,
    bearer,
    current_user,
    settings_dep,
)
from app.api.media import add_head_route, as_requested
from app.api.strict_json import StrictJSONRoute, query_checker, query_invalid
from app.errors import BadRequest, Invalid, PayloadTooLarge
from app.job_kinds import SplitName
from app.limits import MAX_ID, NAME_LENGTH
from app.schemas import DatasetCreated, DatasetOut, Page, PromptOut
from app.services import datasets as svc

router = APIRouter(tags=["datasets"], route_class=StrictJSONRoute)

# A multipart part with an empty filename arrives as a plain string, not an UploadFile; taking
# both lets the route say what is wrong instead of pydantic's "Expected UploadFile". The schema
# stays the file's.
FilePart = Annotated[
    UploadFile | str,
    File(description="prompts as .txt, .csv, .jsonl, .json or .parquet"),
    WithJsonSchema({"type": "string", "contentMediaType": "application/octet-stream"}),
]


def _json(value: object) -> str:
    # allow_nan=False: the export is strict JSON (the service already made NaN/inf null)
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


async def _admin_within_limit(request: Request) -> None:
    """The upload's checks that need no body: the caller (401), the role (403) and the
    declared size (413), through the same dependencies the route declares (AdminDep)."""
    admin_user(await current_user(await bearer(request)))
    limit = settings_dep().max_upload_bytes
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit + FORM_OVERHEAD:
        raise PayloadTooLarge(f"file: the upload ({int(length)} bytes) is larger than the "
                              f"limit of {limit} bytes (MAX_UPLOAD_BYTES)", field="file")


UPLOAD_FIELDS = ("file", "name", "eval_fraction", "seed")


FILE_REQUIRED = "a file with a name is required (.txt, .csv, .jsonl, .json or .parquet)"


class _ClosingBoundaryWatch:
    """Watches a multipart body, as it is received, for its close delimiter (CRLF
    `--boundary--`). Starlette's parser takes a body cut off mid-part without a word and drops
    the unfinished part, so a truncated upload was answered "file: Field required" as if the
    client had sent no file. `receive` replaces the request's own."""

    def __init__(self, request: Request) -> None:
        media_type, options = parse_options_header(request.headers.get("content-type", ""))
        # lower-cased by the parser, as Starlette's form parser reads it: `Multipart/Form-Data`
        # is parsed as a form too, so it is watched and checked as one
        self.multipart = media_type == b"multipart/form-data"
        boundary = options.get(b"boundary")
        self.delimiter = b"\r\n--" + boundary + b"--" if boundary else None
        self.seen = False
        self.received = 0  # bytes: an empty body is a form without its file, not a cut-off one
        self._tail = b"\r\n"  # the body's start counts as a line's: no preamble before it
        self._receive = request.receive

    async def receive(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.request" and self.delimiter and not self.seen:
            # the last bytes of the chunk before are kept: a delimiter may span two chunks
            data = self._tail + message.get("body", b"")
            self.received += len(message.get("body", b""))
            self.seen = self.delimiter in data
            self._tail = data[-len(self.delimiter):]
        return message


async def _known_form_fields(request: Request, watch: _ClosingBoundaryWatch) -> None:
    """Every problem with the upload's form that FastAPI's validation of the declared fields
    does not see: a form field the upload does not take (a misspelt `eval_fracton` was dropped
    without a word, as JSON bodies' unknown keys are not), one given twice, a file without a
    name or of a type no importer reads. They are kept on the request's state (shared with the
    422 handler, app.main), so a bad `eval_fraction` and a `.pdf` are answered in one 422
    rather than in turn. The parsed form is kept on the request, so the route's own
    parameters read it without parsing it again."""
    if not watch.multipart:
        return
    form = await request.form()
    if watch.delimiter and not watch.seen and watch.received:
        # what the parser took of a cut-off body would be judged as if it were all there
        await form.close()
        if "file" in form:
            raise BadRequest("body: malformed multipart: the body ended before its closing "
                             "boundary (cut off?); send the whole form", field="body")
        raise BadRequest("file: the upload was cut off: the multipart body ended before its "
                         "closing boundary, so the file's part is missing or incomplete; "
                         "send the whole file", field="file")
    unknown = sorted({key for key in form if key not in UPLOAD_FIELDS})
    problems = [{"field": key[:100], "message": "unknown field; the upload takes "
                 f"{', '.join(UPLOAD_FIELDS)}"} for key in unknown]
    # a second file (or name) was dropped without a word: the route reads the last one
    problems += [{"field": key, "message": f"given {n} times; the upload takes one"}
                 for key in UPLOAD_FIELDS if (n := len(form.getlist(key))) > 1]
    file = form.get("file")  # left out: FastAPI's validation says "Field required"
    if isinstance(file, str) or (file is not None and not file.filename):
        problems.append({"field": "file", "message": FILE_REQUIRED})
    elif file is not None:
        try:
            svc.detect_format(file.filename or "")
        except BadRequest as e:
            problems.append({"field": "file", "message": e.message, "file_type": True})
    request.state.upload_problems = problems
    request.state.upload_form = form


def upload_problems(request: Request) -> list[dict[str, str]]:
    """The form's own problems found before the body was validated (see _known_form_fields)."""
    return [{"field": p["field"], "message": p["message"]}
            for p in getattr(request.state, "upload_problems", [])]


def upload_content_problems(request: Request, invalid: set[str]) -> list[dict[str, str]]:
    """For a 422 about the form's declared fields (`invalid`: those already refused, such as
    an eval_fraction out of range): the file's content and the dataset name's problems
    beside them, so that one answer lists every problem (nothing is written). Only for a file
    the form took: one with a name, of a type an importer reads; for any other, the name's
    problems alone (a name another dataset has is wrong whatever the file). Blocking: run it
    in a thread."""
    form = getattr(request.state, "upload_form", None)
    if form is None:
        return []
    file, name = form.get("file"), form.get("name")
    name = name if isinstance(name, str) else None
    filename = "" if file is None or isinstance(file, str) else file.filename or ""
    if not filename or "file" in invalid or any(
            p["field"] == "file" for p in getattr(request.state, "upload_problems", [])):
        # the content cannot be read, but the name it would be stored under can be judged
        if "name" in invalid or not (filename or (name or "").strip()):
            return []
        with db.new_session() as session:
            return svc.name_problems(session, filename=filename, name=name)
    settings = settings_dep()
    file.file.seek(0)
    data = file.file.read(settings.max_upload_bytes + 1)
    with db.new_session() as session:
        found = svc.upload_content_problems(
            session, filename=file.filename, data=data,
            name=name, check_name="name" not in invalid,
            max_prompt_length=settings.max_prompt_length, max_bytes=settings.max_upload_bytes)
    return [{"field": p["field"], "message": f"{p['where']}: {p['message']}" if p.get("where")
             else p["message"]} for p in found]


def _raise_upload_problems(request: Request, session: Session) -> None:
    """The form's own problems, when its declared fields were valid. A wrong file type alone
    stays the service's 400 (what the upload has always answered); with anything else wrong
    (a dataset name another dataset has included) it is one more line of the 422."""
    found = getattr(request.state, "upload_problems", [])
    if not found:
        return
    problems = upload_problems(request)
    if len(found) == 1 and found[0].get("file_type"):
        # the file's content cannot be read, but the name it would be stored under can
        form = request.state.upload_form
        name = form.get("name")
        named = svc.name_problems(session, filename=form.get("file").filename,
                                  name=name if isinstance(name, str) else None)
        if not named:
            return
        problems += named
    else:
        problems += upload_content_problems(request, {p["field"] for p in problems})
    raise Invalid("; ".join(f"{p['field']}: {p['message']}" for p in problems),
                  field=problems[0]["field"], errors=problems)


class _CheckedBeforeBody(APIRoute):
    """A route whose caller, role and declared size are checked before its body is read.
    FastAPI reads a form body before it solves the dependencies, so without this an
    unauthenticated 300 MB upload would be received whole before its 401. The route keeps
    its declared File/Form parameters and dependencies: the docs and the validation stay
    FastAPI's."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        check_query = query_checker(self)  # as every StrictJSONRoute's

        async def checked_first(request: Request) -> Response:
            await _admin_within_limit(request)
            if problems := await check_query(request):
                raise query_invalid(problems)
            watch = _ClosingBoundaryWatch(request)
            request = Request(request.scope, watch.receive)
            await _known_form_fields(request, watch)
            return await handler(request)

        return checked_first


def upload_dataset(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    _admin: AdminDep,
    file: FilePart,
    name: Annotated[str | None, Form(max_length=NAME_LENGTH)] = None,
    eval_fraction: Annotated[float, Form(ge=0.0, lt=1.0, allow_inf_nan=False)] = 0.0,
    seed: Annotated[int, Form(ge=0, le=MAX_ID)] = 0,
) -> DatasetCreated:
    _raise_upload_problems(request, session)
    if isinstance(file, str) or not file.filename:  # a body that was not multipart
        raise Invalid(f"file: {FILE_REQUIRED}", field="file")
    filename = file.filename
    limit = settings.max_upload_bytes
    data = file.file.read(limit + 1)
    result = svc.import_dataset(session, filename=filename, data=data, name=name,
                                eval_fraction=eval_fraction + 0.0, seed=seed,  # -0 is 0
                                max_prompt_length=settings.max_prompt_length, max_bytes=limit)
    session.commit()
    return DatasetCreated.model_validate(result.dataset)


router.add_api_route("/datasets", upload_dataset, methods=["POST"], status_code=201,
                     response_model=DatasetCreated, route_class_override=_CheckedBeforeBody,
                     responses={400: {}, 401: {}, 403: {}, 409: {}, 413: {}, 422: {}})


@router.get("/datasets", response_model=Page[DatasetOut])
def list_datasets(session: SessionDep, _user: UserDep,
                  limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                  offset: Annotated[int, Query(ge=0, le=MAX_ID)] = 0) -> Page[DatasetOut]:
    rows, total = svc.list_datasets(session, limit=limit, offset=offset)
    return Page(items=[DatasetOut.model_validate(r) for r in rows], total=total, limit=limit,
                offset=offset)


@router.get("/datasets/{dataset_id}", response_model=DatasetOut, responses={404: {}})
def get_dataset(dataset_id: PathId, session: SessionDep, _user: UserDep) -> DatasetOut:
    return DatasetOut.model_validate(svc.get_dataset(session, dataset_id))


@router.get("/datasets/{dataset_id}/export", responses={404: {}})
def export_dataset(dataset_id: PathId, request: Request, session: SessionDep, _user: UserDep,
                   format: Literal["jsonl", "csv"] = "jsonl") -> Response:
    rows = svc.export_rows(session, dataset_id)
    if format == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf)
        writer.writerow(["id", "prompt", "split", "metadata"])
        for r in rows:
            writer.writerow([r["id"], r["prompt"], r["split"],
                             _json(r["metadata"]) if r["metadata"] else ""])
        body, media = buf.getvalue(), "text/csv"
    else:
        body = "".join(_json(r) + "\n" for r in rows)
        media = "application/x-ndjson"
    return as_requested(request, StreamingResponse(
        iter([body]), media_type=media,
        headers={"Content-Disposition": f'attachment; filename="dataset-{dataset_id}.{format}"'},
    ))


add_head_route(router, "/datasets/{dataset_id}/export", export_dataset,
               operation_id="export_dataset_head", responses={404: {}})


@router.delete("/datasets/{dataset_id}", status_code=204, responses={404: {}, 409: {}})
def delete_dataset(dataset_id: PathId, session: SessionDep, _admin: AdminDep) -> Response:
    svc.delete_dataset(session, dataset_id)
    session.commit()
    return Response(status_code=204)


@router.get("/prompts", response_model=Page[PromptOut])
def list_prompts(session: SessionDep, _user: UserDep,
                 dataset_id: QueryId = None,
                 split: SplitName | None = None,
                 q: PromptQuery = None,
                 limit: Annotated[int, Query(ge=1, le=1000)] = 50,
                 offset: Annotated[int, Query(ge=0, le=MAX_ID)] = 0) -> Page[PromptOut]:
    rows, total = svc.list_prompts(session, dataset_id=dataset_id, split=split, q=q,
                                   limit=limit, offset=offset)
    return Page(items=[PromptOut.model_validate(r) for r in rows], total=total, limit=limit,
                offset=offset)
