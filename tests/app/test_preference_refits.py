"""Cancelling a running fit_preference or rollout job; which stored preference model a
fit_preference job starts from (worker.preference
newest_model): the newest, loaded, when the fit's settings allow it; otherwise, and when its
file is gone or unreadable, none (the fit starts from scratch instead of failing)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from app.db import session_scope
from app.services import preference as pref_svc
from app.services import storage
from trainer.rewards.preference import FitConfig, PreferencePair, fit_preference_model
from worker.preference import newest_model


def _record(version: int, model) -> None:
    path = storage.storage_root() / pref_svc.model_path(version)
    path.parent.mkdir(parents=True, exist_ok=True)
    if model is not None:
        model.save(path)
    else:
        path.write_bytes(b"not a safetensors file")
    with session_scope() as s:
        pref_svc.record_model(s, version=version, path=pref_svc.model_path(version), report={})


def test_a_fit_starts_from_the_newest_model_when_it_can(settings):
    config = FitConfig(epochs=1, ensemble=1, warm_start_epochs=2)
    assert newest_model(config) is None  # no model yet
    rng = np.random.default_rng(0)
    pairs = [PreferencePair(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8),
                            rng.integers(0, 255, (32, 32, 3), dtype=np.uint8),
                            "one red circle", "a" if i % 2 else "b", key=str(i))
             for i in range(12)]
    model = fit_preference_model(pairs, config, version=1)
    _record(1, model)
    loaded = newest_model(config)
    assert loaded is not None and loaded.report.version == 1
    assert newest_model(replace(config, seed=1)) is None  # other held-out votes
    assert newest_model(replace(config, warm_start_epochs=0)) is None  # asked for scratch
    _record(2, None)  # the newest file does not load: from scratch, not a failed fit
    assert newest_model(config) is None
    (storage.storage_root() / pref_svc.model_path(2)).unlink()
    assert newest_model(config) is None


def _stored_group(rng: np.random.Generator, prompt: str = "one red circle", size: int = 32,
                  voter: str = "voter") -> tuple[int, list[tuple[int, int]]]:
    """One stored group of six random `size` px samples for `prompt` and an annotator named
    `voter` (made if new): (their id, the group's 15 pairs of sample ids)."""
    import io
    from itertools import combinations

    from PIL import Image
    from sqlalchemy import select

    from app.models import Sample
    from app.services import auth
    from app.services.rollouts import record_rollout_group

    def png() -> bytes:
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
        return buf.getvalue()

    with session_scope() as s:
        group = record_rollout_group(
            s, job_id=None, iteration=0, prompt_text=prompt, checkpoint_id=None,
            solver="dpm++", steps=8, sigma=0.3, seed=0, purpose=None,
            samples=[{"png": png(), "member_index": i, "rewards": {}, "advantage": 0.0,
                      "is_anchor": i == 0} for i in range(6)])
        from app.models import User

        voter = (s.scalar(select(User).where(User.name == voter))
                 or auth.create_user(s, voter, "annotator")[0])
        ids = list(s.scalars(select(Sample.id).where(Sample.group_id == group)
                             .order_by(Sample.id)))
    return voter.id, list(combinations(ids, 2))


def _vote(voter_id: int, pairs: list[tuple[int, int]], n: int, outcome: str) -> None:
    """The annotator's vote `outcome` on the group's pair `n`."""
    from app.models import User
    from app.services import votes

    with session_scope() as s:
        votes.record_vote(s, s.get(User, voter_id), client_vote_id=f"v{n}",
                          sample_a_id=pairs[n][0], sample_b_id=pairs[n][1], outcome=outcome)


def _claimed_refitting_job(seed: int):
    """Eight votes on a stored group, a tiny train config that scores with the preference
    model and refits it every iteration, and a train job claimed by worker "w1" to refit
    under (the row carries only the job's lease and cancel; the config is the one returned):
    (voter id, the group's pairs, config, job id)."""
    from datetime import timedelta

    from app.services import jobs
    from trainer.config import PRESETS, TrainConfig

    voter_id, pairs = _stored_group(np.random.default_rng(seed))
    for n in range(8):
        _vote(voter_id, pairs, n, "ab"[n % 2])
    config = TrainConfig.from_dict({**PRESETS["tiny"], "device": "cpu",
                                    "reward_weights": {"count": 1.0, "preference": 1.0},
                                    "preference_refit_every": 1})
    with session_scope() as s:
        job_id = jobs.create_job(s, "train", {"device": "cpu"}, preset="tiny").id
        assert jobs.claim(s, job_id, "w1", timedelta(seconds=60)) is not None
    return voter_id, pairs, config, job_id


def test_a_fit_preference_job_cancelled_mid_fit_stops_and_saves_nothing(settings):
    """A running fit_preference job obeys its cancel between epochs: the job ends cancelled
    (at once, not when a reaper finds it), and no model version is written or recorded."""
    from datetime import timedelta

    from app.services import jobs
    from worker.preference import run_fit_preference

    voter_id, pairs = _stored_group(np.random.default_rng(1))
    for n in range(12):
        _vote(voter_id, pairs, n, "ab"[n % 2])
    with session_scope() as s:
        job_id = jobs.create_job(s, "fit_preference", {"epochs": 400, "ensemble": 2,
                                                       "score_samples": False}).id
        assert jobs.claim(s, job_id, "w1", timedelta(seconds=60)) is not None
        jobs.request_cancel(s, job_id)
    assert run_fit_preference(job_id, "w1") == "cancelled"
    with session_scope() as s:
        job = jobs.get_job(s, job_id)
        assert job.status == "cancelled" and job.finished_at is not None
        assert pref_svc.latest_model(s) is None
    assert not (storage.storage_root() / pref_svc.model_path(1)).exists()


def test_a_rollout_job_cancelled_between_chunks_is_stored_as_cancelled(settings):
    """The progress report that finds a cancel marks the job cancelled in a transaction that
    commits (raising inside it rolled the status back: 'running' until the reaper came)."""
    from datetime import timedelta

    import pytest

    from app.services import datasets, jobs
    from worker.sampling import Cancelled, _progress

    with session_scope() as s:
        ds = datasets.import_dataset(s, filename="p.txt", data=b"one red circle\n").dataset.id
        job_id = jobs.create_job(s, "rollout", {"dataset_id": ds}).id
        assert jobs.claim(s, job_id, "w1", timedelta(seconds=60)) is not None
    _progress(job_id, "w1", 0, 1)  # no cancel asked: goes on
    with session_scope() as s:
        jobs.request_cancel(s, job_id)
    with pytest.raises(Cancelled):
        _progress(job_id, "w1", 1, 1)
    with session_scope() as s:
        job = jobs.get_job(s, job_id)
        assert job.status == "cancelled" and job.finished_at is not None and job.iteration == 1


def test_a_rollout_chunk_holds_whole_groups_of_about_128_samples():
    """A cancel waits for one chunk: with large groups a chunk holds fewer prompts (one at
    G = 256, not 16 x 256 samples), never part of a group."""
    from worker.sampling import CHUNK_SAMPLES, prompts_per_chunk

    for g in range(2, 257):
        per_chunk = prompts_per_chunk(g)
        assert per_chunk >= 1 and per_chunk * g <= max(CHUNK_SAMPLES, g)
        assert (per_chunk + 1) * g > CHUNK_SAMPLES  # as full as whole groups allow
    assert prompts_per_chunk(8) == 16  # the default group: 16 prompts a chunk, as before


def test_skip_and_both_bad_votes_neither_start_a_refit_nor_count_as_fitted(settings):
    """An online refit starts only when labelled votes (a, b or tie) arrived since the model in
    use; a fit records as votes_used the labelled votes it drew on, not the skipped pairs."""
    from worker.preference import fit_and_record

    voter_id, pairs = _stored_group(np.random.default_rng(0))  # 15 pairs
    outcomes = ["a", "b", "tie", "skip", "both_bad"] * 2 + ["a", "b"]  # 8 labelled of 12

    def vote(n: int, outcome: str) -> None:
        _vote(voter_id, pairs, n, outcome)

    for n, outcome in enumerate(outcomes):
        vote(n, outcome)
    _model, row = fit_and_record(FitConfig(width=8, epochs=1, ensemble=1), score_samples=False)
    assert row["votes_used"] == 8
    # left out, but counted in the fit's report (their images are never loaded)
    assert row["report"]["votes_total"] == 12 and row["report"]["votes_fitted"] == 8
    assert row["report"]["votes_ignored"] == {"skip": 2, "both_bad": 2}
    last = row["last_vote_id"]
    vote(12, "skip")
    vote(13, "both_bad")
    with session_scope() as s:
        assert pref_svc.votes_since(s, last) == 0  # nothing a refit could learn from
    vote(14, "tie")
    with session_scope() as s:
        assert pref_svc.votes_since(s, last) == 1


def test_fits_that_finish_together_each_record_their_own_version(settings):
    """Two fits read the same next version before either records (a fit job beside a train
    job's refit, or two workers): the one that saves second takes the next free version and
    leaves the first one's file alone. A name claimed on disk without a row (a fit that died
    while saving) and a row recorded meanwhile by a fit writing to another storage directory
    are stepped over too."""
    import threading

    from safetensors import safe_open

    from app.services import jobs
    from worker.preference import fit_and_record

    voter_id, pairs = _stored_group(np.random.default_rng(1))
    for n, outcome in enumerate(["a", "b", "tie", "a", "b", "a"]):
        _vote(voter_id, pairs, n, outcome)
    root = storage.storage_root()
    (root / "preference").mkdir(parents=True, exist_ok=True)
    (root / pref_svc.model_path(1)).write_bytes(b"")  # claimed by a fit that died saving
    with session_scope() as s:
        job_ids = [jobs.create_job(s, "fit_preference", {}).id for _ in range(2)]

    def recorded_elsewhere() -> None:  # v2's row, its file in another storage directory
        with session_scope() as s:
            pref_svc.record_model(s, version=2, path="elsewhere/v2.safetensors", report={})

    # both fits have read the next version (1) when they first ask should_stop, before their
    # first epoch; the barrier holds each there until the other has read it too
    both_fitting = threading.Barrier(2, action=recorded_elsewhere, timeout=60)
    rows: dict[int, dict] = {}
    errors: list[BaseException] = []

    def fit(job_id: int) -> None:
        waited = False

        def should_stop() -> bool:
            nonlocal waited
            if not waited:
                waited = True
                both_fitting.wait()
            return False

        try:
            _model, rows[job_id] = fit_and_record(FitConfig(width=8, epochs=1, ensemble=1),
                                                  job_id=job_id, score_samples=False,
                                                  should_stop=should_stop)
        except BaseException as exc:  # noqa: BLE001 - reported by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=fit, args=(job_id,)) for job_id in job_ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert sorted(row["version"] for row in rows.values()) == [3, 4]
    for job_id, row in rows.items():
        assert row["path"] == pref_svc.model_path(row["version"])
        assert row["report"]["version"] == row["version"]
        with safe_open(str(root / row["path"]), "pt") as f:  # the file is the row's own
            meta = f.metadata()
        assert (meta["version"], meta["job_id"]) == (str(row["version"]), str(job_id))
    assert (root / pref_svc.model_path(1)).read_bytes() == b""  # left as it was
    assert not (root / pref_svc.model_path(2)).exists()  # its claim given back
    assert not list((root / "preference").glob(".tmp-*"))


def test_a_shapes_features_fit_learns_from_the_shapes_votes_and_counts_the_rest(settings):
    """Votes on a FLUX-size sample or a prompt the shapes world cannot draw are left out of
    a fit with the shapes features (it reads 32x32 images and shapes prompts) and counted;
    the samples it cannot read keep no score; submission counts what such a fit can use."""
    from sqlalchemy import select

    from app.errors import Invalid
    from app.models import RolloutGroup, Sample
    from app.services import jobs
    from worker.preference import fit_and_record

    rng = np.random.default_rng(3)
    voter_id, shapes_pairs = _stored_group(rng)
    _, big_pairs = _stored_group(rng, size=64)  # a shapes prompt drawn by another model
    _, cat_pairs = _stored_group(rng, prompt="a cat on a sofa")
    for n in range(3):
        _vote(voter_id, big_pairs, n, "a")
    for n in range(3, 5):
        _vote(voter_id, cat_pairs, n, "b")
    with session_scope() as s:  # 5 clean votes, none readable: a fit needs 4 readable
        try:
            jobs.validate_config(s, "fit_preference", {"score_samples": False})
        except Invalid as exc:
            message = exc.message
        else:
            raise AssertionError("a fit with no vote it can read was accepted")
    assert "0 clean vote(s)" in message and "(5 more are on other models' samples" in message
    for n, outcome in zip(range(5, 10), ["a", "b", "tie", "a", "b"], strict=True):
        _vote(voter_id, shapes_pairs, n, outcome)
    with session_scope() as s:
        jobs.validate_config(s, "fit_preference", {"score_samples": False})  # 5 readable
    _model, row = fit_and_record(FitConfig(width=8, epochs=1, ensemble=1))
    assert row["votes_used"] == 5 and row["report"]["votes_fitted"] == 5
    assert row["report"]["votes_ignored"] == {"unreadable_images": 5}
    with session_scope() as s:
        scored = s.execute(select(RolloutGroup.prompt_text, Sample.preference_version)
                           .join(Sample.group)).all()
    # the 32 px shapes group alone: not the 64 px one, not the cat
    assert sum(version is not None for _, version in scored) == 6
    assert {prompt for prompt, version in scored if version is not None} == {"one red circle"}


def test_a_sampling_job_obeys_a_cancel_between_solver_steps(settings):
    """A cancel does not wait for a chunk to be sampled (minutes of a large model's images):
    the sampler asks before every solver step; the check marks the job cancelled, commits,
    and raises Cancelled, which ends sample_images mid-batch."""
    import time
    from datetime import timedelta

    import pytest

    from app.services import datasets, jobs
    from trainer.evaluation import sample_images
    from trainer.models.shapes_dit import ShapesDiT, ShapesDiTConfig
    from worker.job_helpers import CANCEL_POLL_SECONDS
    from worker.sampling import CancelCheck, Cancelled

    with session_scope() as s:
        ds = datasets.import_dataset(s, filename="p.txt", data=b"one red circle\n").dataset.id
        job_id = jobs.create_job(s, "rollout", {"dataset_id": ds}).id
        assert jobs.claim(s, job_id, "w1", timedelta(seconds=60)) is not None
    check = CancelCheck(job_id, "w1")
    steps: list[int] = []

    def before_step() -> None:
        steps.append(1)
        if len(steps) == 3:  # the cancel arrives mid-batch
            with session_scope() as s:
                jobs.request_cancel(s, job_id)
            time.sleep(CANCEL_POLL_SECONDS)  # the flag is read at most once a poll
        check()

    model = ShapesDiT(ShapesDiTConfig(width=16, depth=1, heads=2)).eval()
    with pytest.raises(Cancelled):
        sample_images(model, ["one red circle"] * 4, [0, 1, 2, 3], "euler", 8,
                      before_step=before_step)
    assert len(steps) == 3  # stopped at the step after the cancel, not after 8
    with session_scope() as s:
        job = jobs.get_job(s, job_id)
        assert job.status == "cancelled" and job.finished_at is not None


def test_a_train_jobs_online_refit_obeys_its_cancel(settings):
    """A cancel that arrives while a train job refits its preference model stops the refit
    between epochs: no version is recorded, the model in use stays, and the job goes on to
    its cancel (the checkpoint of the iteration) at once rather than after the whole fit."""

    from app.services import jobs
    from trainer.loop import Trainer
    from trainer.rewards.preference import PreferenceModel
    from worker.training import maybe_refit_preference

    _voter_id, _pairs, config, job_id = _claimed_refitting_job(2)
    with session_scope() as s:
        jobs.request_cancel(s, job_id)
    in_use = PreferenceModel(FitConfig(width=8, ensemble=1, epochs=2000))
    trainer = Trainer(config)
    trainer.set_preference_model(in_use, None)
    metrics, last = maybe_refit_preference(trainer, config, job_id, 0)
    assert metrics == {"preference_refit": 0} and last == 0
    from trainer.rewards import get_reward

    assert get_reward("preference") is in_use
    with session_scope() as s:
        assert pref_svc.latest_model(s) is None


def _image_file(sample_id: int):
    from app.models import Sample

    with session_scope() as s:
        return storage.resolve(s.get(Sample, sample_id).image_path)


def test_a_fit_leaves_out_the_votes_whose_images_are_gone_and_scores_the_rest(settings):
    """One voted image moved away failed the whole fit with "no such file" (naming no file),
    and an image no vote used failed the job after its model was recorded as the newest: the
    votes on a missing image are left out and counted, its sample left unscored."""
    from sqlalchemy import select

    from app.models import Sample
    from worker.preference import fit_and_record

    voter_id, pairs = _stored_group(np.random.default_rng(3))
    for n in range(12):
        _vote(voter_id, pairs, n, "ab"[n % 2])
    gone = pairs[0][0]  # the group's first sample: in 5 of its pairs, all of them voted on
    _image_file(gone).unlink()
    model, row = fit_and_record(FitConfig(width=8, epochs=1, ensemble=1))
    touching = sum(gone in pair for pair in pairs[:12])
    assert touching == 5 and row["votes_used"] == 12 - touching
    assert row["report"]["votes_ignored"] == {"missing_images": touching}
    with session_scope() as s:
        scored = dict(s.execute(select(Sample.id, Sample.preference_version)).all())
        assert pref_svc.latest_model(s).version == row["version"] == 1
    assert scored.pop(gone) is None and set(scored.values()) == {1}


def test_an_online_refit_that_fails_keeps_training_on_the_model_in_use(settings):
    """A refit that cannot fit (here every voted image is gone, so no vote is left) failed
    the whole train job at its first refit: it is counted as failed and the run goes on with
    the model it had, trying again at the next refit."""
    from trainer.loop import Trainer
    from trainer.rewards import get_reward
    from trainer.rewards.preference import PreferenceModel
    from worker.training import maybe_refit_preference

    _voter_id, pairs, config, job_id = _claimed_refitting_job(4)
    for sample_id in {i for pair in pairs for i in pair}:
        _image_file(sample_id).unlink()
    in_use = PreferenceModel(FitConfig(width=8, ensemble=1, epochs=1))
    trainer = Trainer(config)
    trainer.set_preference_model(in_use, None)
    metrics, last = maybe_refit_preference(trainer, config, job_id, 0)
    assert metrics == {"preference_refit": 0, "preference_refit_failed": 1} and last == 0
    assert get_reward("preference") is in_use
    with session_scope() as s:
        assert pref_svc.latest_model(s) is None


def test_a_resumed_train_job_goes_on_with_the_model_in_use_at_its_checkpoint(settings):
    """A resume re-resolved the config's preference_model: the job's own online refit (v2,
    in use at its checkpoint) was forgotten, the run went back to v1 and refitted on the same
    votes again. A model given by path stays the path's unless this job refitted it."""
    from app.services import jobs
    from trainer.config import TrainConfig
    from trainer.loop import Trainer
    from trainer.rewards.preference import PreferenceModel
    from worker.training import _resume_preference

    with session_scope() as s:
        job_id = jobs.create_job(s, "train", {"device": "cpu"}, preset="tiny").id
        other = jobs.create_job(s, "train", {"device": "cpu"}, preset="tiny").id
    for version, owner, last_vote in ((1, None, 5), (2, job_id, 9), (3, other, 12)):
        path = pref_svc.model_path(version)
        (storage.storage_root() / path).parent.mkdir(parents=True, exist_ok=True)
        PreferenceModel(FitConfig(width=8, ensemble=1)).save(storage.storage_root() / path)
        with session_scope() as s:
            pref_svc.record_model(s, version=version, path=path, report={}, job_id=owner,
                                  last_vote_id=last_vote)

    def trainer_with(spec: str) -> tuple[Trainer, TrainConfig]:
        config = TrainConfig.from_dict({"device": "cpu", "preference_model": spec,
                                        "reward_weights": {"count": 1.0, "preference": 1.0}})
        trainer = Trainer(config)
        trainer.set_preference_model(PreferenceModel(FitConfig(width=8, ensemble=1)), 1)
        return trainer, config

    trainer, config = trainer_with("v1")
    assert _resume_preference(trainer, config, job_id, 2, 5) == 9
    assert trainer.preference_version == 2
    trainer, config = trainer_with("latest")  # a newer fit (v3) does not replace it either
    assert _resume_preference(trainer, config, job_id, 1, 5) == 5
    assert trainer.preference_version == 1
    trainer, config = trainer_with("mine/model.safetensors")
    assert _resume_preference(trainer, config, job_id, 3, 0) == 0  # another job's v3
    assert trainer.preference_version == 1
    assert _resume_preference(trainer, config, job_id, 2, 0) == 9  # this job's refit
    assert trainer.preference_version == 2


def test_a_queued_jobs_preference_model_whose_file_went_is_said_without_a_traceback(settings):
    import pytest

    from worker.lease import JobError
    from worker.preference import resolve_preference_spec

    path = pref_svc.model_path(1)
    with session_scope() as s:
        pref_svc.record_model(s, version=1, path=path, report={})
    with pytest.raises(JobError, match=r"^preference_model: preference model v1's file "
                       r"preference/v1\.safetensors is gone"):
        resolve_preference_spec("v1")
    with pytest.raises(JobError, match=r"^preference_model: preference model v7 not found"):
        resolve_preference_spec("v7")
