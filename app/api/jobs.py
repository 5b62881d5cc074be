from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from app import db
from app.api.deps import MAX_ID, AdminDep, EnqueuerDep, PathId, SessionDep, UserDep
from app.job_kinds import KINDS, KindName
from app.models import Job, JobStatus
from app.schemas import JobDetail, JobIn, JobOut, MetricPoint, Page
from app.services import jobs as svc
from app.services import workers

router = APIRouter(prefix="/jobs", tags=["jobs"])


def job_out(job: Job, cls: type[JobOut] = JobOut, waiting: dict[int, str] | None = None,
            **extra: Any) -> Any:
    out = cls.model_validate(job)
    out.waiting_for = (waiting or {}).get(job.id)
    if job.total_iterations:
        out.progress = min(1.0, job.iteration / job.total_iterations)
    elif job.status == JobStatus.SUCCEEDED:
        out.progress = 1.0
    for k, v in extra.items():
        setattr(out, k, v)
    return out


# the request's own fields beside its config, which validate_config checks with it
REQUEST_FIELDS = ("preset", "dataset_id")


def config_problems_beside(token: str | None, body: Any) -> list[tuple[str, str]]:
    """The config's own problems in a POST /api/jobs whose envelope failed validation (an
    unknown top-level field, a bad preset type), so that its 422 lists every problem at once
    instead of the envelope's first. Only for a caller who may launch the kind (the config's
    checks look at datasets and files), and only when the kind is usable; when the config is
    not an object (the envelope's problem), only the request's other fields (preset,
    dataset_id) are checked."""
    from app.api.deps import authenticated
    from app.errors import Invalid
    from app.limits import MAX_ID

    if not isinstance(body, dict) or body.get("kind") not in KINDS:
        return []
    config = body.get("config") if body.get("config") is not None else {}
    config_usable = isinstance(config, dict)
    kind = body["kind"]
    user = authenticated(token)
    if user is None or user.role not in svc.launch_roles(kind):
        return []
    preset = body.get("preset") if isinstance(body.get("preset"), str) else None
    dataset_id = body.get("dataset_id")
    if isinstance(dataset_id, bool) or not isinstance(dataset_id, int) \
            or not 1 <= dataset_id <= MAX_ID:
        dataset_id = None  # the envelope's problem, already reported
    try:
        with db.new_session() as session:
            svc.validate_config(session, kind, config if config_usable else {}, preset,
                                dataset_id=dataset_id)
    except Invalid as exc:
        return [(e["field"], e["message"]) for e in exc.details.get("errors", [])
                if config_usable or e["field"] in REQUEST_FIELDS]
    return []


@router.post("", response_model=JobOut, status_code=201, responses={422: {}})
def create_job(body: JobIn, session: SessionDep, user: UserDep,
               enqueuer: EnqueuerDep) -> JobOut:
    # who may launch which kind is the job registry's rule (JobKind.launch_role), checked
    # in launch_job as for the UI and the demo: a 403 for a role the kind does not allow
    job = svc.launch_job(session, enqueuer, body.kind, body.config, preset=body.preset,
                         dataset_id=body.dataset_id, user=user)
    return job_out(job, waiting=workers.waiting_for(session, [job]))


@router.get("", response_model=Page[JobOut])
def list_jobs(session: SessionDep, _user: UserDep,
              status: JobStatus | None = None,
              kind: KindName | None = None,
              limit: Annotated[int, Query(ge=1, le=500)] = 50,
              offset: Annotated[int, Query(ge=0, le=MAX_ID)] = 0) -> Page[JobOut]:
    rows, total = svc.list_jobs(session, status=status, kind=kind, limit=limit, offset=offset)
    waiting = workers.waiting_for(session, rows)
    return Page(items=[job_out(j, waiting=waiting) for j in rows], total=total, limit=limit,
                offset=offset)


@router.get("/config-schema")
def config_schema(_user: UserDep) -> dict[str, Any]:
    """The train config's fields (help, ranges, choices) and presets, for forms."""
    from trainer.config import PRESETS, TrainConfig

    return {"train": TrainConfig.describe(), "presets": PRESETS,
            **{k.name: k.config.model_json_schema() for k in KINDS.values() if k.config}}


@router.get("/{job_id}", response_model=JobDetail, responses={404: {}})
def get_job(job_id: PathId, session: SessionDep, _user: UserDep) -> JobDetail:
    job = svc.get_job(session, job_id)
    history = [MetricPoint.model_validate(m) for m in svc.metric_history(session, job_id)]
    return job_out(job, JobDetail, waiting=workers.waiting_for(session, [job]),
                   metric_history=history)


@router.post("/{job_id}/cancel", response_model=JobOut, responses={404: {}, 409: {}})
def cancel_job(job_id: PathId, session: SessionDep, _admin: AdminDep) -> JobOut:
    job = svc.request_cancel(session, job_id)
    session.commit()
    return job_out(job)


@router.post("/{job_id}/resume", response_model=JobOut, responses={404: {}, 409: {}})
def resume_job(job_id: PathId, session: SessionDep, _admin: AdminDep,
               enqueuer: EnqueuerDep) -> JobOut:
    job = svc.relaunch_job(session, enqueuer, job_id)
    return job_out(job, waiting=workers.waiting_for(session, [job]))
