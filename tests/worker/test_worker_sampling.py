"""Rollout and evaluate jobs through a real worker: groups stored for voting (within-group and
cross-checkpoint pairs come out of `GET /api/votes/next`'s service), automatic rewards and
summary metrics recorded; a fit_preference job without votes fails saying why."""

from __future__ import annotations

import shutil

import pytest
from worker_helpers import create_train_job, job_row, wait_for


def _done(job_id: int):
    job = job_row(job_id)
    return job if job.status in ("succeeded", "failed", "cancelled") else None


@pytest.mark.parametrize("stack", ["postgres-fs"], indirect=True)
def test_rollout_then_evaluate_from_a_trained_checkpoint(stack):
    from app.db import session_scope
    from app.models import RolloutGroup
    from app.services import checkpoints, datasets, jobs, rollouts
    from trainer.shapes.world import all_prompts

    stack.start_worker()
    train = create_train_job(iterations=2, sample_every=2, checkpoint_every=1)
    stack.send(train)
    assert wait_for(lambda: _done(train), 60, "training", stack).status == "succeeded"
    with session_scope() as s:
        ckpts, _ = checkpoints.list_checkpoints(s, job_id=train)
        ckpt_ids = sorted(c.id for c in ckpts)
        data = ("\n".join(all_prompts()[:5]) + "\n").encode()
        ds = datasets.import_dataset(s, filename="p.txt", data=data).dataset.id
        roll = jobs.create_job(s, "rollout", {"dataset_id": ds, "checkpoint_id": ckpt_ids[-1],
                                              "group_size": 4, "steps": 4, "max_prompts": 3}).id
        ev = jobs.create_job(s, "evaluate", {"checkpoint_ids": ckpt_ids, "max_prompts": 2,
                                             "seeds": [0, 1], "steps": 4}).id
    stack.send(roll, "rollout")
    stack.send(ev, "evaluate")
    job = wait_for(lambda: _done(roll), 60, "the rollout job", stack)
    assert job.status == "succeeded", job.error
    assert job.iteration == 3 and job.total_iterations == 3
    with session_scope() as s:
        groups, total = rollouts.list_groups(s, job_id=roll)
        assert total == 3
        for g in groups:
            assert g.purpose == "rollout" and g.checkpoint_id == ckpt_ids[-1]
            assert g.prompt_id is not None and len(g.samples) == 4
            assert {"count", "color", "shape"} <= set(g.samples[0].rewards)
            assert abs(sum(sm.advantage for sm in g.samples)) < 1e-3  # z-scored per group

    job = wait_for(lambda: _done(ev), 90, "the evaluate job", stack)
    assert job.status == "succeeded", job.error
    with session_scope() as s:
        groups, total = rollouts.list_groups(s, job_id=ev)
        assert total == 2 * 2 * 2  # checkpoints x prompts x seeds, one image each
        assert all(g.purpose == "evaluate" and len(g.samples) == 1 for g in groups)
        by_key: dict[tuple, set] = {}
        for g in groups:
            by_key.setdefault((g.prompt_text, g.seed), set()).add(g.checkpoint_id)
        assert all(v == set(ckpt_ids) for v in by_key.values())  # cross-checkpoint pairs
        assert s.query(RolloutGroup).filter_by(job_id=ev).count() == 8
    for cid in ckpt_ids:
        assert f"checkpoint/{cid}/exact_count" in job.metrics
    # each checkpoint carries its scores, the job's summary means
    with session_scope() as s:
        for cid in ckpt_ids:
            scores = checkpoints.get_checkpoint(s, cid).scores
            assert set(scores) == {"count", "exact_count", "color", "shape", "combined"}
            for name, entry in scores.items():
                assert entry["mean"] == pytest.approx(job.metrics[f"checkpoint/{cid}/{name}"])
                assert entry["n"] == 4 and entry["job_id"] == ev and entry["seeds"] == 2
                assert entry["prompts"] == "2 of the shapes prompts"


def test_evaluate_with_a_model_reward_merges_scores_and_checks_weights_at_start(
        stack, tiny_clip_path):
    """An evaluate job scoring a model-backed reward (clip_score, tiny random CLIP weights
    under REWARD_MODELS_DIR) adds it to each checkpoint's scores beside the earlier ones and
    replaces the reward it re-scores; with the weights gone by the time it runs, it fails
    before sampling, naming the reward and the files expected."""
    from app.config import get_settings
    from app.db import session_scope
    from app.services import checkpoints, jobs

    stack.start_worker()
    train = create_train_job(iterations=2, sample_every=2, checkpoint_every=1)
    stack.send(train)
    assert wait_for(lambda: _done(train), 60, "training", stack).status == "succeeded"
    weights = get_settings().resolved_reward_models_dir / "clip_score"
    shutil.copytree(tiny_clip_path, weights)
    config = {"max_prompts": 1, "seeds": [0], "steps": 2, "reward_names": ["clip_score", "count"]}
    with session_scope() as s:
        ids = sorted(c.id for c in checkpoints.list_checkpoints(s, job_id=train)[0])
        for cid in ids:  # an earlier evaluation with other rewards
            checkpoints.record_scores(s, cid, {"count": {"mean": -1.0}, "shape": {"mean": 0.5}})
        early = jobs.create_job(s, "evaluate", {"checkpoint_ids": ids, **config}).id
        ev = jobs.create_job(s, "evaluate", {"checkpoint_ids": ids, **config}).id
    weights.rename(weights.with_name("moved"))  # gone after submission, before the run
    stack.send(early, "evaluate")
    job = wait_for(lambda: _done(early), 60, "the evaluate job without weights", stack)
    assert job.status == "failed" and "'clip_score'" in job.error
    assert "config.json" in job.error and job.iteration == 0
    weights.with_name("moved").rename(weights)
    stack.send(ev, "evaluate")
    job = wait_for(lambda: _done(ev), 90, "the clip_score evaluate job", stack)
    assert job.status == "succeeded", job.error
    with session_scope() as s:
        for cid in ids:
            scores = checkpoints.get_checkpoint(s, cid).scores
            assert set(scores) == {"clip_score", "count", "shape"}
            assert scores["shape"]["mean"] == 0.5  # kept
            assert scores["count"]["job_id"] == ev and scores["count"]["mean"] >= 0.0  # replaced
            assert scores["clip_score"]["job_id"] == ev and scores["clip_score"]["n"] == 1
            assert scores["clip_score"]["mean"] == pytest.approx(
                job.metrics[f"checkpoint/{cid}/clip_score"])


def test_fit_preference_without_votes_fails_saying_why(stack):
    """Refused at submission (422); a job whose votes went after it was accepted (excluded
    by an admin meanwhile: written here as the row a submission made) fails saying why."""
    from app.db import session_scope
    from app.errors import Invalid
    from app.job_kinds import KINDS
    from app.models import Job
    from app.services import jobs

    with session_scope() as s, pytest.raises(Invalid, match="0 clean vote"):
        jobs.create_job(s, "fit_preference", {})
    stack.start_worker(queues="cpu")
    with session_scope() as s:
        job = Job(kind="fit_preference", status="queued",
                  config=KINDS["fit_preference"].config().model_dump())
        s.add(job)
        s.flush()
        job_id = job.id
    stack.send(job_id, "fit_preference")
    job = wait_for(lambda: _done(job_id), 60, "the fit job", stack)
    assert job.status == "failed" and "0 clean votes" in job.error
    assert "Traceback" not in job.error and 'File "' not in job.error  # the reason alone


def test_fit_preference_on_clip_features_scores_the_stored_samples(stack, tiny_clip_path):
    """features="clip" through the worker: a frozen CLIP from a local path (the tiny one of
    tests/conftest.py), votes on a rollout's groups, the fitted model's score cached on every
    stored sample; a clip_path that is missing or outside MODELS_DIR is refused at submission,
    naming it."""
    from sqlalchemy import select

    from app.config import get_settings
    from app.db import session_scope
    from app.errors import Invalid
    from app.models import PreferenceModelRow, Sample
    from app.services import auth, datasets, jobs, rollouts
    from app.services.votes import record_vote
    from trainer.shapes.world import all_prompts

    stack.start_worker()
    with session_scope() as s:
        data = ("\n".join(all_prompts()[:4]) + "\n").encode()
        ds = datasets.import_dataset(s, filename="p.txt", data=data).dataset.id
        roll = jobs.create_job(s, "rollout", {"dataset_id": ds, "group_size": 4, "steps": 4}).id
    stack.send(roll, "rollout")
    assert wait_for(lambda: _done(roll), 60, "the rollout job", stack).status == "succeeded"
    with session_scope() as s:
        annotator, _ = auth.create_user(s, "ann", "annotator")
        groups, _ = rollouts.list_groups(s, job_id=roll)
        pairs = [(g.samples[i].id, g.samples[j].id) for g in groups
                 for i in range(4) for j in range(i + 1, 4)]
        for n, (a, b) in enumerate(pairs):
            record_vote(s, annotator, client_vote_id=f"v{n}", sample_a_id=a, sample_b_id=b,
                        outcome="a" if n % 3 else "b")
    # weights the worker cannot find, or outside MODELS_DIR/STORAGE_DIR: refused at submission
    models = get_settings().resolved_models_dir
    shutil.copytree(tiny_clip_path, models / "tiny-clip")
    for bad in (str(models / "nowhere"), str(tiny_clip_path)):
        with session_scope() as s, pytest.raises(Invalid) as err:
            jobs.create_job(s, "fit_preference", {"features": "clip", "clip_path": bad})
        assert err.value.details["field"] == "clip_path" and bad in err.value.message
    with session_scope() as s:
        fit = jobs.create_job(s, "fit_preference", {
            "features": "clip", "clip_path": "tiny-clip", "epochs": 2, "ensemble": 2,
            "device": "cpu"}).id
    stack.send(fit, "fit_preference")
    job = wait_for(lambda: _done(fit), 120, "the CLIP fit job", stack)
    assert job.status == "succeeded", job.error
    with session_scope() as s:
        record = s.scalars(select(PreferenceModelRow)).one()
        assert record.votes_used == len(pairs) == 24
        scored = s.execute(select(Sample.preference_score, Sample.preference_version)).all()
        assert len(scored) == 16
        assert all(score is not None and version == record.version for score, version in scored)
        assert len({round(score, 6) for score, _ in scored}) > 1  # scores differ per image

    # a refit after more votes starts from that model (warm_start_epochs: the same network,
    # seed and held-out votes, which are chosen by vote id); one on another seed from scratch
    with session_scope() as s:
        second, _ = auth.create_user(s, "ann2", "annotator")
        for n, (a, b) in enumerate(pairs):
            record_vote(s, second, client_vote_id=f"w{n}", sample_a_id=a, sample_b_id=b,
                        outcome="b" if n % 3 else "a")
        warm = jobs.create_job(s, "fit_preference", {
            "features": "clip", "clip_path": "tiny-clip", "epochs": 2, "ensemble": 2,
            "device": "cpu", "warm_start_epochs": 1}).id
    stack.send(warm, "fit_preference")
    job = wait_for(lambda: _done(warm), 120, "the warm refit", stack)
    assert job.status == "succeeded", job.error
    assert job.metrics["extra"]["warm_start_version"] == 1 and job.metrics["extra"]["epochs"] == 1
    assert job.metrics["votes_fitted"] == 48 and job.metrics["preference_model_version"] == 2
    with session_scope() as s:
        cold = jobs.create_job(s, "fit_preference", {
            "features": "clip", "clip_path": "tiny-clip", "epochs": 2, "ensemble": 2,
            "device": "cpu", "warm_start_epochs": 1, "seed": 5}).id
    stack.send(cold, "fit_preference")
    job = wait_for(lambda: _done(cold), 120, "the refit on another seed", stack)
    assert job.status == "succeeded", job.error
    assert job.metrics["extra"]["warm_start"] is False and job.metrics["extra"]["epochs"] == 2


def test_progress_inside_a_long_step_is_written_at_most_once_a_second():
    """What an evaluate job's batches and a fit's epochs report through: every call would be
    a database write per batch or epoch; at most one a second goes through."""
    import time

    from worker.job_helpers import throttled

    written: list[int] = []
    write = throttled(written.append, every=0.2)
    for n in range(1, 13):
        write(n)
        time.sleep(0.05)
    assert 1 <= len(written) <= 4 and written == sorted(written)
