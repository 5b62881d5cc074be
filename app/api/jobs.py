from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from app.api.deps import (
    MAX_ID,
    AdminDep,
    EnqueuerDep,
    LauncherDep,
    PathId,
    SessionDep,
    UserDep,
)
from app.api.strict_json import StrictJSONRoute
from app.job_kinds import KINDS, KindName
from app.models import Job, JobStatus
from app.schemas import JobDetail, JobIn, JobOut, MetricPoint, Page, ResumeIn
from app.services import jobs as svc
from app.services import workers

router = APIRouter(prefix="/jobs", tags=["jobs"], route_class=StrictJSONRoute)


def job_out(job: Job, cls: type[JobOut] = JobOut, waiting: dict[int, str] | None = None,
            **extra: Any) -> Any:
    out = cls.model_validate(job)
    out.waiting_for = (waiting or {}).get(job.id)
    out.progress = job.progress
    for k, v in extra.items():
        setattr(out, k, v)
    return out


@router.post("", response_model=JobOut, status_code=201, responses={422: {}})
def create_job(body: JobIn, session: SessionDep, user: LauncherDep,
               enqueuer: EnqueuerDep) -> JobOut:
    # who may launch which kind is the job registry's rule (JobKind.launch_role), checked
    # in launch_job as for the UI and the demo: a 403 for a role the kind does not allow
    # (LauncherDep refuses a role that may launch no kind, before the body is judged)
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


@router.post("/{job_id}/resume", response_model=JobOut, responses={404: {}, 409: {}, 422: {}})
def resume_job(job_id: PathId, session: SessionDep, _admin: AdminDep,
               enqueuer: EnqueuerDep, body: ResumeIn | None = None) -> JobOut:
    job = svc.relaunch_job(session, enqueuer, job_id, body.config if body else None)
    return job_out(job, waiting=workers.waiting_for(session, [job]))
