from __future__ import annotations

import time
from datetime import timedelta

import pytest
from sqlalchemy import func, select


def test_create_train_job_validates_and_enqueues_after_commit(client, admin, enqueuer, session):
    from app.models import Job

    seen_status = []

    def check_committed(job_id, kind):
        # the enqueuer runs after the commit: a fresh session sees the queued row
        from app.db import new_session

        with new_session() as s:
            seen_status.append(s.get(Job, job_id).status)
        enqueuer(job_id, kind)

    client.app.state.enqueuer = check_committed
    r = client.post("/api/jobs", json={"kind": "train", "preset": "tiny",
                                       "config": {"learning_rate": 1e-5}}, headers=admin)
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["status"] == "queued" and job["kind"] == "train"
    assert job["config"]["iterations"] == 3 and job["config"]["learning_rate"] == 1e-5
    assert job["config"]["method"] == "neighbor"  # the full config is stored
    assert job["total_iterations"] == 3 and job["progress"] == 0.0
    assert enqueuer.calls == [(job["id"], "train")] and seen_status == ["queued"]
    # a null config is one left out: the preset's
    r = client.post("/api/jobs", json={"kind": "train", "preset": "tiny", "config": None},
                    headers=admin)
    assert r.status_code == 201 and r.json()["config"]["iterations"] == 3, r.text


@pytest.mark.parametrize("config,field", [
    ({"group_size": 1}, "group_size"),
    ({"lerning_rate": 1e-5}, "lerning_rate"),
    ({"method": "ppo"}, "method"),
    ({"num_anchors": 50}, "num_anchors"),
    # each within its own range, together a quarter of a million rollouts an iteration
    ({"prompts_per_iteration": 1024, "group_size": 256}, "group_size"),
])
def test_bad_train_config_is_422_naming_field(client, admin, enqueuer, session, config, field):
    from sqlalchemy import func, select

    from app.models import Job

    r = client.post("/api/jobs", json={"kind": "train", "config": config}, headers=admin)
    assert r.status_code == 422
    assert r.json()["field"] == field and field in r.json()["detail"]
    assert enqueuer.calls == [] and session.scalar(select(func.count()).select_from(Job)) == 0


def test_other_kinds_validate(client, admin, vote_seeder):
    from trainer.rewards.preference import FitConfig

    r = client.post("/api/jobs", json={"kind": "rollout", "config": {}}, headers=admin)
    assert r.status_code == 422 and r.json()["field"] == "dataset_id"
    r = client.post("/api/jobs", json={"kind": "rollout", "config": {"dataset_id": 5}},
                    headers=admin)
    assert r.status_code == 422 and "dataset 5 not found" in r.json()["detail"]
    r = client.post("/api/jobs", json={"kind": "evaluate", "config": {"checkpoint_ids": [],
                                                                      "seeds": [1]}},
                    headers=admin)
    assert r.status_code == 422 and r.json()["field"] == "checkpoint_ids"
    r = client.post("/api/jobs", json={"kind": "fit_preference", "config": {"epochs": 0}},
                    headers=admin)
    assert r.status_code == 422 and r.json()["field"] == "epochs"
    # ... and the vote shortage beside it (a bad field hid it: one 422 has every problem)
    assert [e["field"] for e in r.json()["errors"]] == ["epochs", "min_votes"], r.json()
    assert "0 clean vote(s)" in r.json()["detail"], r.json()
    r = client.post("/api/jobs", json={"kind": "fit_preference", "config": {"features": "clip"}},
                    headers=admin)
    assert r.status_code == 422 and r.json()["field"] == "clip_path", r.json()
    assert "CLIP weights" in r.json()["detail"]
    # a fit needs votes to fit: refused at submission, not failed by the worker
    r = client.post("/api/jobs", json={"kind": "fit_preference"}, headers=admin)
    assert r.status_code == 422 and r.json()["field"] == "min_votes", r.json()
    assert "0 clean vote(s)" in r.json()["detail"] and "at least 4" in r.json()["detail"]
    vote_seeder(3)
    r = client.post("/api/jobs", json={"kind": "fit_preference"}, headers=admin)
    assert r.status_code == 422 and "3 clean vote(s)" in r.json()["detail"]
    vote_seeder(1)
    r = client.post("/api/jobs", json={"kind": "fit_preference",
                                       "config": {"min_votes": 5}}, headers=admin)
    assert r.status_code == 422 and "4 clean vote(s)" in r.json()["detail"]
    assert "at least 5" in r.json()["detail"]
    r = client.post("/api/jobs", json={"kind": "fit_preference"}, headers=admin)
    assert r.status_code == 201 and r.json()["config"]["epochs"] == FitConfig().epochs  # default
    r = client.post("/api/jobs", json={"kind": "bake"}, headers=admin)
    assert r.status_code == 422


def test_worker_lifecycle_progress_metrics_cancel_resume(client, admin, enqueuer, session,
                                                        tmp_path):
    from app.db import session_scope
    from app.services import checkpoints, jobs, storage

    job_id = client.post("/api/jobs", json={"kind": "train", "preset": "tiny"},
                         headers=admin).json()["id"]
    with session_scope() as s:
        job = jobs.mark_running(s, job_id, "gpu-worker-1")
        assert job.attempts == 1
    for it in (1, 2):
        with session_scope() as s:
            assert jobs.update_progress(s, job_id, it, 3, {"reward_mean": 0.1 * it}) is False
    with session_scope() as s:  # re-recording an iteration replaces it (a resumed run)
        jobs.update_progress(s, job_id, 2, 3, {"reward_mean": 0.25})
    storage.write_bytes("checkpoints/job1/it2.safetensors", b"weights")
    with session_scope() as s:
        ck = checkpoints.record_checkpoint(s, job_id, 2, "checkpoints/job1/it2.safetensors")
        assert checkpoints.record_checkpoint(s, job_id, 2, "checkpoints/job1/it2.safetensors") == ck
        assert checkpoints.latest_checkpoint(s, job_id).id == ck
    got = client.get(f"/api/jobs/{job_id}", headers=admin).json()
    assert got["status"] == "running" and got["worker"] == "gpu-worker-1"
    assert got["iteration"] == 2 and got["progress"] == pytest.approx(2 / 3)
    assert got["metrics"] == {"reward_mean": 0.25}
    assert [(m["iteration"], m["metrics"]["reward_mean"]) for m in got["metric_history"]] == \
        [(1, 0.1), (2, 0.25)]

    r = client.post(f"/api/jobs/{job_id}/cancel", headers=admin)
    assert r.status_code == 200 and r.json()["cancel_requested"] is True
    assert r.json()["status"] == "running"  # the worker stops it cooperatively
    with session_scope() as s:
        assert jobs.is_cancel_requested(s, job_id)
        assert jobs.heartbeat(s, job_id) is True
        jobs.mark_cancelled(s, job_id)
    assert client.get(f"/api/jobs/{job_id}", headers=admin).json()["status"] == "cancelled"
    r = client.post(f"/api/jobs/{job_id}/cancel", headers=admin)
    assert r.status_code == 409 and "has already finished (cancelled)" in r.text

    r = client.post(f"/api/jobs/{job_id}/resume", headers=admin)
    assert r.status_code == 200 and r.json()["status"] == "queued"
    assert r.json()["cancel_requested"] is False
    assert enqueuer.calls == [(job_id, "train"), (job_id, "train")]
    with session_scope() as s:
        jobs.mark_running(s, job_id, "gpu-worker-2")
        jobs.mark_failed(s, job_id, "CUDA out of memory")
    got = client.get(f"/api/jobs/{job_id}", headers=admin).json()
    assert got["status"] == "failed" and got["error"] == "CUDA out of memory"
    assert got["attempts"] == 1  # the resume started a new budget of JOB_MAX_ATTEMPTS
    assert client.post(f"/api/jobs/{job_id}/resume", headers=admin).status_code == 200
    with session_scope() as s:
        jobs.mark_running(s, job_id, "w")
        jobs.mark_succeeded(s, job_id)
        with pytest.raises(Exception, match="succeeded"):
            jobs.mark_running(s, job_id, "w")
    assert client.post(f"/api/jobs/{job_id}/resume", headers=admin).status_code == 409

    listed = client.get("/api/jobs", params={"status": "succeeded"}, headers=admin).json()
    assert [j["id"] for j in listed["items"]] == [job_id]
    ckpts = client.get("/api/checkpoints", params={"job_id": job_id}, headers=admin).json()
    assert ckpts["total"] == 1
    dl = client.get(ckpts["items"][0]["download_url"], headers=admin)
    assert dl.status_code == 200 and dl.content == b"weights"
    assert "safetensors" in dl.headers["content-disposition"]


def test_cancel_queued_job_is_immediate_and_stale_jobs(client, admin, session):
    from app.db import session_scope
    from app.services import jobs

    a = client.post("/api/jobs", json={"kind": "train", "preset": "tiny"},
                    headers=admin).json()["id"]
    r = client.post(f"/api/jobs/{a}/cancel", headers=admin)
    assert r.json()["status"] == "cancelled" and r.json()["finished_at"]
    with session_scope() as s, pytest.raises(Exception, match="cancelled"):
        jobs.mark_running(s, a, "w")
    b = client.post("/api/jobs", json={"kind": "train", "preset": "tiny"},
                    headers=admin).json()["id"]
    with session_scope() as s:
        jobs.mark_running(s, b, "w")
    with session_scope() as s:
        assert jobs.stale_jobs(s, timedelta(minutes=5)) == []
        assert [j.id for j in jobs.stale_jobs(s, timedelta(seconds=-1))] == [b]
        jobs.requeue(s, b, "worker w shut down at iteration 0")
    got = client.get(f"/api/jobs/{b}", headers=admin).json()
    assert got["status"] == "queued" and got["error"] == "worker w shut down at iteration 0"
    # a worker's own shutdown gives back the attempt: JOB_MAX_ATTEMPTS counts lost workers
    assert got["attempts"] == 0
    with session_scope() as s:  # taken again: running, the requeue's reason cleared
        assert jobs.claim(s, b, "w2", timedelta(minutes=5)) is not None
    got = client.get(f"/api/jobs/{b}", headers=admin).json()
    assert got["status"] == "running" and got["error"] is None and got["attempts"] == 1


def test_an_unreachable_broker_is_a_503_and_leaves_no_job_waiting(settings, admin, monkeypatch,
                                                                   session, caplog):
    """A job whose message cannot be sent would wait queued for ever: the submission is a 503
    naming the broker and no job is kept; a resume leaves the job as it was. Against a real
    broker address nothing listens on (port 1), with the app's own enqueuer. The server's log
    says it in one line a request, not a traceback (an outage, not a bug: before, each 503
    logged kombu's and redis's chained tracebacks, over 100 lines)."""
    from fastapi.testclient import TestClient

    from app.config import get_settings
    from app.db import session_scope
    from app.main import create_app
    from app.models import Job
    from app.services import jobs

    with TestClient(create_app(settings, mount_ui=False)) as c:
        stopped = c.post("/api/jobs", json={"kind": "train", "preset": "tiny"}, headers=admin)
    with session_scope() as s:
        jobs.request_cancel(s, stopped.json()["id"])
    monkeypatch.setenv("BROKER_URL", "redis://127.0.0.1:1/0")
    get_settings.cache_clear()
    with TestClient(create_app(settings, mount_ui=False)) as c:
        began = time.monotonic()
        r = c.post("/api/jobs", json={"kind": "train", "preset": "tiny"}, headers=admin)
        waited = time.monotonic() - began
        assert r.status_code == 503, r.text
        assert r.json()["field"] == "broker" and "BROKER_URL" in r.json()["detail"]
        assert waited < 15, f"the submission waited {waited:.0f} s for the broker"
        session.expire_all()
        assert session.scalar(select(func.count()).select_from(Job)) == 1  # only the first
        r = c.post(f"/api/jobs/{stopped.json()['id']}/resume", headers=admin)
        assert r.status_code == 503, r.text
        got = c.get(f"/api/jobs/{stopped.json()['id']}", headers=admin).json()
        assert got["status"] == "cancelled" and got["finished_at"] is not None
    logged = [r for r in caplog.records if r.name == "app.services.jobs"]
    assert len(logged) == 2 and not any(r.exc_info for r in logged), logged
    assert all("the job queue (BROKER_URL) cannot be reached" in r.getMessage() for r in logged)


def test_a_shutdown_requeue_the_broker_cannot_take_is_left_for_the_reaper(settings, admin,
                                                                          client, monkeypatch,
                                                                          caplog):
    """A worker's warm shutdown requeues its job, then sends the message. With the broker
    away (Redis stopped first, say) a queued job with no message would wait for ever: the job
    goes back to running with no heartbeat, which the next reaper round requeues (and sends),
    and the worker says so in one line. A job no longer queued (cancelled meanwhile) is left
    as it is. Against a real broker address nothing listens on (port 1)."""
    from app.config import get_settings
    from app.db import session_scope
    from app.services import jobs
    from worker.reaper import send_requeued

    ids = [client.post("/api/jobs", json={"kind": "train", "preset": "tiny"},
                       headers=admin).json()["id"] for _ in range(2)]
    for job_id in ids:
        with session_scope() as s:
            jobs.mark_running(s, job_id, "polite:1:w")
        with session_scope() as s:
            jobs.requeue(s, job_id, "worker polite:1:w shut down at iteration 3")
    with session_scope() as s:
        jobs.request_cancel(s, ids[1])  # a queued job's cancel is immediate
    monkeypatch.setenv("BROKER_URL", "redis://127.0.0.1:1/0")
    get_settings.cache_clear()
    for job_id in ids:
        send_requeued(job_id, "train", "polite:1:w")
    left = client.get(f"/api/jobs/{ids[0]}", headers=admin).json()
    assert left["status"] == "running" and left["heartbeat_at"] is None, left
    assert client.get(f"/api/jobs/{ids[1]}", headers=admin).json()["status"] == "cancelled"
    logged = [r for r in caplog.records if r.name == "worker.reaper"]
    assert [bool(r.exc_info) for r in logged] == [False, False], logged
    assert "left for a reaper" in logged[0].getMessage()
    assert "no longer queued" in logged[1].getMessage()
    with session_scope() as s:  # stale at once: the next round requeues it
        assert jobs.reap_stale(s, timedelta(seconds=60), 3) == [(ids[0], "train", "queued")]


def test_resuming_a_queued_job_sends_its_message_again(client, admin, enqueuer):
    """A queued job whose message was lost (a broker restart, a worker that took and dropped
    it) is sent again by a resume; a worker's atomic claim makes a duplicate harmless."""
    job = client.post("/api/jobs", json={"kind": "train", "preset": "tiny"}, headers=admin).json()
    r = client.post(f"/api/jobs/{job['id']}/resume", headers=admin)
    assert r.status_code == 200 and r.json()["status"] == "queued"
    assert enqueuer.calls == [(job["id"], "train"), (job["id"], "train")]


def test_default_enqueuer_sends_celery_task(settings, admin, monkeypatch, vote_seeder):
    from fastapi.testclient import TestClient

    from app import queue
    from app.main import create_app

    sent = []  # what would go to the broker: the task of the kind, on the kind's queue
    monkeypatch.setattr(queue.client(settings), "send_task",
                        lambda name, args, queue, **options: sent.append((name, args, queue)))
    vote_seeder(4)  # what a fit_preference job needs
    with TestClient(create_app(settings, mount_ui=False)) as c:
        j = c.post("/api/jobs", json={"kind": "train", "preset": "tiny"}, headers=admin).json()
        k = c.post("/api/jobs", json={"kind": "fit_preference"}, headers=admin).json()
    assert sent == [("worker.tasks.train", [j["id"]], "gpu"),
                    ("worker.tasks.fit_preference", [k["id"]], "cpu")]


def test_a_sent_job_reaches_the_workers_queue(settings):
    """The app's client and the worker's Celery app meet on one broker: a message the app
    sends is one the worker's consumer reads from the kind's queue (the embedded broker)."""
    from app import queue
    from worker.celery_app import make_celery

    queue.client(settings).send_task("worker.tasks.rollout", args=[7], queue="gpu")
    worker_app = make_celery(settings)
    try:
        with worker_app.connection_for_read() as conn:
            message = conn.SimpleQueue("gpu", no_ack=True).get(timeout=5)
        assert message.headers["task"] == "worker.tasks.rollout"
        assert message.payload[0] == [7]  # (args, kwargs, embed)
    finally:
        worker_app.close()


def test_the_app_imports_no_worker_code(tmp_path):
    """DESIGN: app/ never imports worker/ (the enqueuer sends by task name); the server, the
    UI and `python -m app serve` load without it."""
    import os
    import subprocess
    import sys

    code = ("import sys; import app.main, app.serve, app.ui, app.__main__; "
            "app.main.create_app(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'worker'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "DATA_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_config_schema(client, annotator):
    r = client.get("/api/jobs/config-schema", headers=annotator).json()
    assert any(f["name"] == "sigma" for f in r["train"]) and "tiny" in r["presets"]
    assert "dataset_id" in r["rollout"]["properties"]


@pytest.mark.parametrize("layout", ["lora", "full"])
def test_a_checkpoint_downloads_whole_as_a_zip_without_its_resume_state(
        client, admin, annotator, session, layout):
    """`?format=zip` takes the checkpoint away: its weights (a LoRA, or a full fine-tune's
    transformer/ with the config from_pretrained needs), its model card, nothing of the
    optimizer state; the plain download stays the weights file alone."""
    import io
    import zipfile

    from app.services import checkpoints, jobs, storage

    job = jobs.create_job(session, "train", {"iterations": 2}, preset="tiny")
    session.commit()
    directory = storage.storage_root() / f"checkpoints/job-{job.id}/iter-000002"
    files = {"README.md": b"# model card\n", "trainer_state.safetensors": b"optimizer" * 100}
    if layout == "lora":
        files["pytorch_lora_weights.safetensors"] = b"lora weights"
        weights = "pytorch_lora_weights.safetensors"
    else:
        files["transformer/config.json"] = b'{"_class_name": "FluxTransformer2DModel"}'
        files["transformer/diffusion_pytorch_model.safetensors"] = b"full weights" * 1000
        weights = "transformer/diffusion_pytorch_model.safetensors"
    for rel, data in files.items():
        (directory / rel).parent.mkdir(parents=True, exist_ok=True)
        (directory / rel).write_bytes(data)
    ckpt_id = checkpoints.record_checkpoint(session, job.id, 2, str(directory / weights))
    session.commit()

    plain = client.get(f"/api/checkpoints/{ckpt_id}/download", headers=annotator)
    assert plain.status_code == 200 and plain.content == files[weights]
    r = client.get(f"/api/checkpoints/{ckpt_id}/download", params={"format": "zip"},
                   headers=annotator)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/zip"
    name = client.get(f"/api/checkpoints/{ckpt_id}", headers=admin).json()["name"]
    assert f'filename="{name}.zip"' in r.headers["content-disposition"]
    with zipfile.ZipFile(io.BytesIO(r.content)) as zf:
        assert zf.testzip() is None
        got = {n.split("/", 1)[1]: zf.read(n) for n in zf.namelist()}
    assert got == {rel: data for rel, data in files.items()
                   if rel != "trainer_state.safetensors"}
    assert client.get(f"/api/checkpoints/{ckpt_id}/download",
                      params={"format": "zip"}).status_code == 401
    assert client.get(f"/api/checkpoints/{ckpt_id}/download", params={"format": "tar"},
                      headers=admin).status_code == 422


def test_job_statuses_are_one_enum_stored_and_listed_as_plain_values(client, admin, session):
    """The five statuses are declared once (app.models.JobStatus): the API documents exactly
    them, a bad filter is a 422 naming them, and the database holds the plain value."""
    from sqlalchemy import text

    from app.db import session_scope
    from app.models import JobStatus

    values = [s.value for s in JobStatus]
    assert values == ["queued", "running", "succeeded", "failed", "cancelled"]
    schema = client.get("/openapi.json").json()
    status_schema = schema["components"]["schemas"]["JobStatus"]
    assert status_schema["enum"] == values
    r = client.get("/api/jobs", params={"status": "done"}, headers=admin)
    assert r.status_code == 422 and all(v in r.text for v in values)

    job_id = client.post("/api/jobs", json={"kind": "train", "preset": "tiny"},
                         headers=admin).json()["id"]
    client.post(f"/api/jobs/{job_id}/cancel", headers=admin)
    with session_scope() as s:
        stored = s.execute(text("SELECT status FROM jobs WHERE id = :i"), {"i": job_id}).scalar()
    assert type(stored) is str and stored == "cancelled"
    listed = client.get("/api/jobs", params={"status": "cancelled"}, headers=admin).json()
    assert [j["id"] for j in listed["items"]] == [job_id]


def test_a_worker_with_a_long_host_name_still_holds_the_job_it_claimed(session):
    """A worker's name (host:pid:nonce) longer than the column is cut the same way wherever
    it is stored and compared: the claim, the heartbeat, `holds` and the workers table."""
    from datetime import timedelta

    from app.limits import NAME_LENGTH
    from app.services import jobs, workers

    name = "h" * (NAME_LENGTH + 40) + ":123:abcd1234"
    job = jobs.create_job(session, "train", {}, preset="tiny")
    session.commit()
    assert jobs.claim(session, job.id, name, timedelta(seconds=60)) is not None
    session.commit()
    assert jobs.holds(session, job.id, name)
    assert not jobs.holds(session, job.id, "other-host:1:abcd1234")
    jobs.heartbeat(session, job.id, name)
    session.commit()
    assert jobs.holds(session, job.id, name)
    assert workers.report(session, name, ["gpu"], 0, []).name == name[:NAME_LENGTH]
    assert len(jobs.get_job(session, job.id).worker) == NAME_LENGTH


def test_a_jobs_progress_is_one_rule_for_the_api_and_the_ui():
    from datetime import UTC, datetime

    from app.models import Job, JobStatus
    from app.ui.jobs import jobs_table

    assert Job(iteration=2, total_iterations=3, status=JobStatus.RUNNING).progress == 2 / 3
    # a resumed job may record an iteration past its total: the bar stops at full
    assert Job(iteration=5, total_iterations=3, status=JobStatus.RUNNING).progress == 1.0
    # a rollout counts no iterations: unknown while it runs, full once it succeeded
    assert Job(iteration=0, total_iterations=None, status=JobStatus.RUNNING).progress is None
    assert Job(iteration=0, total_iterations=None, status=JobStatus.SUCCEEDED).progress == 1.0
    row = Job(id=7, kind="rollout", iteration=0, total_iterations=None,
              status=JobStatus.SUCCEEDED, created_at=datetime.now(UTC), metrics={})
    assert 'aria-valuenow="100.0"' in jobs_table([row])
    row.status = JobStatus.RUNNING
    assert 'aria-valuenow="0.0"' in jobs_table([row])


def test_a_cancel_that_lands_while_a_job_is_requeued_is_never_left_queued(settings, admin,
                                                                          monkeypatch):
    """A cancel landing while a worker shut down (its requeue) or while the reaper requeued
    a stale job left the job queued with its cancel flag set: every message for it was
    skipped and resume refused it, for ever. The requeue now sees the flag and cancels; the
    reaper's compare-and-set leaves it to its next round; and a claim of a job left so (by
    an older version) cancels it."""
    from sqlalchemy import update

    from app.db import session_scope
    from app.models import Job
    from app.services import jobs

    def running_job() -> int:
        with session_scope() as s:
            job_id = jobs.create_job(s, "train", {"device": "cpu"}, preset="tiny").id
            assert jobs.claim(s, job_id, "w1", timedelta(minutes=5)) is not None
        return job_id

    def status(job_id: int) -> str:
        with session_scope() as s:
            return jobs.get_job(s, job_id).status

    # the worker's shutdown: the cancel arrived after the worker last read the flag
    shutdown = running_job()
    with session_scope() as s:
        jobs.request_cancel(s, shutdown)  # running: a flag for the worker
    with session_scope() as s:
        assert jobs.requeue(s, shutdown, "worker w1 shut down").status == "cancelled"
    assert status(shutdown) == "cancelled"

    # the reaper: it read the job (no cancel yet), then the cancel landed, then it wrote
    stale = running_job()
    with session_scope() as s:
        s.execute(update(Job).where(Job.id == stale).values(heartbeat_at=None))
    with session_scope() as s:
        seen = jobs.stale_jobs(s, timedelta(seconds=-1))
        s.expunge_all()  # what the reaper read, before the cancel
    with session_scope() as s:
        jobs.request_cancel(s, stale)
    monkeypatch.setattr(jobs, "stale_jobs", lambda _s, _older: seen)
    with session_scope() as s:
        assert jobs.reap_stale(s, timedelta(seconds=-1), 3) == []  # not requeued
    assert status(stale) == "running"
    monkeypatch.undo()
    with session_scope() as s:  # its next round
        assert jobs.reap_stale(s, timedelta(seconds=-1), 3) == [(stale, "train", "cancelled")]

    # a job an older version left queued with the flag: the message that would run it ends it
    stuck = running_job()
    with session_scope() as s:
        s.execute(update(Job).where(Job.id == stuck).values(status="queued",
                                                            cancel_requested=True))
    with session_scope() as s:
        assert jobs.claim(s, stuck, "w2", timedelta(minutes=5)) is None
    assert status(stuck) == "cancelled"


def test_cancelling_a_job_whose_worker_is_lost_cancels_it_at_once(settings, admin):
    """A running job whose worker died (no heartbeat for JOB_STALE_SECONDS) stayed running
    with its cancel flag set until some worker's reaper came round (never, with none live),
    and its page said the reaper would requeue it. A job whose worker is alive keeps running
    with the flag, for its worker to obey."""
    from sqlalchemy import update

    from app.db import session_scope
    from app.models import Job, utcnow
    from app.services import jobs, workers

    def running_job(beat_seconds_ago: float) -> int:
        with session_scope() as s:
            job_id = jobs.create_job(s, "train", {"device": "cpu"}, preset="tiny").id
            assert jobs.claim(s, job_id, "w1", timedelta(minutes=5)) is not None
            s.execute(update(Job).where(Job.id == job_id).values(
                heartbeat_at=utcnow() - timedelta(seconds=beat_seconds_ago)))
        return job_id

    stale = settings.job_stale_seconds
    lost = running_job(stale + 30)
    with session_scope() as s:
        job = jobs.request_cancel(s, lost)
        assert job.status == "cancelled" and job.finished_at is not None
    with session_scope() as s:
        job = jobs.get_job(s, lost)
        assert job.status == "cancelled" and job.cancel_requested and job.finished_at
        assert workers.waiting_for(s, [job]) == {}

    alive = running_job(stale / 2)
    with session_scope() as s:
        assert jobs.request_cancel(s, alive).status == "running"
    # its worker died after the cancel: the page says the reaper cancels it, not requeues it
    with session_scope() as s:
        s.execute(update(Job).where(Job.id == alive).values(
            heartbeat_at=utcnow() - timedelta(seconds=stale + 30)))
    with session_scope() as s:
        waiting = workers.waiting_for(s, [jobs.get_job(s, alive)])[alive]
        assert "it is lost; a live worker's reaper cancels the job (a cancel was requested)" \
            in waiting and "requeue" not in waiting, waiting
        assert jobs.reap_stale(s, timedelta(seconds=stale), 3) == [(alive, "train", "cancelled")]


def test_a_job_read_as_queued_and_then_claimed_is_not_queued_behind_itself(settings, admin):
    """waiting_for reads the running jobs after the page's job list: a job listed as queued
    that the only worker claimed in between said it was "queued behind job #N", itself."""
    from app.db import session_scope
    from app.services import jobs, workers

    with session_scope() as s:
        workers.report(s, "solo", ["gpu", "cpu"], 0, [])
        first = jobs.create_job(s, "train", {"device": "cpu"}, preset="tiny")
        second = jobs.create_job(s, "train", {"device": "cpu"}, preset="tiny")
    assert first.status == second.status == "queued"  # as the page read them
    with session_scope() as s:  # the worker takes the first
        assert jobs.claim(s, first.id, workers.lease_name("solo"), timedelta(minutes=5))
    with session_scope() as s:
        waiting = workers.waiting_for(s, [first, second])
    assert first.id not in waiting
    assert waiting[second.id].startswith(f"queued behind job #{first.id}: ")


def test_a_queued_job_whose_message_was_lost_is_found_once_a_worker_that_takes_it_idles(
        settings, admin):
    """A queued job whose broker message was lost (a Redis restart: it keeps nothing on disk;
    a worker killed holding it) stayed queued for ever while the workers idled. It is found
    (jobs.lost_messages, for the reaper to send again) once it has been queued for longer than
    JOB_STALE_SECONDS while a live worker of its queue has run nothing for as long; then not
    again until as long has passed. A worker that runs a job, started or ended one lately, or
    serves another queue does not count; a job queued lately is not lost."""
    from sqlalchemy import update

    from app.db import session_scope
    from app.models import Job, WorkerRow, utcnow
    from app.services import jobs, workers

    stale = timedelta(seconds=settings.job_stale_seconds)
    long_ago = utcnow() - 2 * stale

    def queued_job(since) -> int:
        with session_scope() as s:
            job_id = jobs.create_job(s, "train", {"device": "cpu"}, preset="tiny").id
            s.execute(update(Job).where(Job.id == job_id).values(queued_at=since))
        return job_id

    def worker(name: str, queues: list[str], started) -> None:
        with session_scope() as s:
            workers.report(s, name, queues, 0, [])
            s.execute(update(WorkerRow).where(WorkerRow.name == name)
                      .values(started_at=started))

    def lost() -> list[tuple[int, str, str]]:
        with session_scope() as s:
            return jobs.lost_messages(s, stale)

    lost_one = queued_job(long_ago)
    queued_job(utcnow())  # queued lately: never found below
    assert lost() == []  # no worker live
    worker("cpu@h", ["cpu"], long_ago)  # not the train jobs' queue
    worker("new@h", ["gpu"], utcnow())  # just started: it may be about to take the message
    assert lost() == []
    worker("idle@h", ["gpu"], long_ago)
    assert lost() == [(lost_one, "train", "idle@h")]  # not `fresh`
    assert lost() == []  # marked queued afresh: the next look is JOB_STALE_SECONDS later

    # a worker running a job, or whose last job ended lately, may just not have come to it
    with session_scope() as s:
        s.execute(update(Job).where(Job.id == lost_one).values(queued_at=long_ago))
        running = jobs.create_job(s, "train", {"device": "cpu"}, preset="tiny").id
        assert jobs.claim(s, running, workers.lease_name("idle@h"), stale) is not None
    assert lost() == []
    with session_scope() as s:
        jobs.mark_succeeded(s, running)
    assert lost() == []
    with session_scope() as s:  # it ended long ago
        s.execute(update(Job).where(Job.id == running).values(finished_at=long_ago))
    assert lost() == [(lost_one, "train", "idle@h")]
    # a resumed or requeued job counts from then
    with session_scope() as s:
        s.execute(update(Job).where(Job.id == lost_one).values(queued_at=long_ago))
        assert jobs.request_cancel(s, lost_one).status == "cancelled"
        jobs.resume_job(s, lost_one)
    assert lost() == []


def test_a_queued_job_says_its_only_worker_holds_and_why(settings, admin):
    """A worker that cannot write STORAGE_DIR takes no job until it can (worker.tasks.
    wait_for_storage). Its row says why; a queued job that only it could take said nothing
    (a live worker, no job running: it seemed to wait for no reason). A worker that takes
    jobs, busy or not, is what the job waits for instead."""
    from app.db import session_scope
    from app.services import jobs, workers

    why = "STORAGE_DIR /data/storage cannot be written (the disk is full); checked again"
    with session_scope() as s:
        workers.report(s, "held", ["gpu", "cpu"], 0, [], holding=why)
        job = jobs.create_job(s, "train", {"device": "cpu"}, preset="tiny")
    with session_scope() as s:
        said = workers.waiting_for(s, [job])[job.id]
    assert said.startswith("waiting: every live worker on queue 'gpu' takes no job for now "
                           f"(held: {why})"), said
    with session_scope() as s:  # another worker, busy with a job of its own
        workers.report(s, "busy", ["gpu", "cpu"], 0, [])
        other = jobs.create_job(s, "train", {"device": "cpu"}, preset="tiny")
        assert jobs.claim(s, other.id, workers.lease_name("busy"), timedelta(minutes=5))
    with session_scope() as s:
        said = workers.waiting_for(s, [job])[job.id]
    assert said.startswith(f"queued behind job #{other.id}: "), said
    with session_scope() as s:  # the hold is over: the row says it takes jobs again
        assert workers.report(s, "held", ["gpu", "cpu"], 0, []).holding is None
