"""Check-then-write races, made deterministic: one side holds its transaction open (its lock
taken, not committed) while the other side's request runs in a thread; the first then
commits. On SQLite and PostgreSQL alike the second must wait and then see the first's write:

- a job submitted on a dataset while the dataset is deleted: the job is refused (its dataset
  is gone) or the delete is (a job uses it); never a 500, never a job without its dataset;
- two users, or two datasets, whose names only differ in case or width, created at once: one
  of them is refused (the unique constraint cannot tell look-alike names apart)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import func, select
from test_datasets import upload

HOLD_SECONDS = 1.5  # how long the first side keeps its transaction open


def _while_held(first, second):
    """first(session) in a transaction held open while second() runs in a thread; returns
    (second's result, how long second took). second must wait for the commit."""
    from app import db

    with db.new_session() as held, ThreadPoolExecutor(1) as pool:
        first(held)
        started = time.monotonic()
        future = pool.submit(second)
        time.sleep(HOLD_SECONDS)
        assert not future.done(), "the second writer did not wait for the first's lock"
        held.commit()
        return future.result(timeout=60), time.monotonic() - started


def test_a_job_submitted_while_its_dataset_is_deleted_is_refused(client, admin, session):
    from app.models import Job
    from app.services.datasets import delete_dataset

    ds = upload(client, admin, "d.txt", b"one red circle\ntwo red circles\n").json()["id"]
    r, waited = _while_held(lambda s: delete_dataset(s, ds), lambda: client.post(
        "/api/jobs", json={"kind": "rollout", "config": {"dataset_id": ds}}, headers=admin))
    assert waited >= HOLD_SECONDS
    assert r.status_code == 422 and r.json()["field"] == "dataset_id", r.text
    assert f"dataset {ds} not found" in r.json()["detail"]
    assert session.scalar(select(func.count()).select_from(Job)) == 0


def test_a_dataset_deleted_while_a_job_is_submitted_on_it_is_refused(client, admin,
                                                                      session):
    from app.models import Job
    from app.services.jobs import create_job

    ds = upload(client, admin, "d.txt", b"one red circle\ntwo red circles\n").json()["id"]
    r, _ = _while_held(lambda s: create_job(s, "rollout", {"dataset_id": ds}),
                       lambda: client.delete(f"/api/datasets/{ds}", headers=admin))
    assert r.status_code == 409 and r.json()["field"] == "dataset_id", r.text
    job = session.scalars(select(Job)).one()
    assert job.dataset_id == ds
    assert client.get(f"/api/datasets/{ds}", headers=admin).status_code == 200


def test_look_alike_user_names_created_at_once_make_one_user(client, admin, session):
    from app.models import User
    from app.services.auth import create_user

    r, _ = _while_held(lambda s: create_user(s, "carol", "annotator"), lambda: client.post(
        "/api/users", json={"name": "CAROL", "role": "annotator"}, headers=admin))
    assert r.status_code == 409 and "'carol' already exists" in r.json()["detail"], r.text
    r, _ = _while_held(lambda s: create_user(s, "dave", "annotator"), lambda: client.post(
        "/api/users", json={"name": "dave", "role": "annotator"}, headers=admin))
    assert r.status_code == 409, r.text  # the same name: the unique constraint's 500 before
    names = session.scalars(select(User.name).where(User.name.in_(
        ["carol", "CAROL", "dave"]))).all()
    assert sorted(names) == ["carol", "dave"]


def test_look_alike_dataset_names_uploaded_at_once_make_one_dataset(client, admin, session):
    from app.models import Dataset
    from app.services.datasets import import_dataset

    gate = threading.Event()

    def first(s):
        import_dataset(s, filename="a.txt", data=b"one red circle\n", name="HPDv2")
        gate.set()

    r, _ = _while_held(first, lambda: upload(client, admin, "b.txt", b"two red circles\n",
                                             name="hpdv2"))
    assert gate.is_set()
    assert r.status_code == 409 and "'HPDv2'" in r.json()["detail"], r.text
    assert session.scalars(select(Dataset.name)).all() == ["HPDv2"]
