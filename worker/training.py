"""The train job: build the trainer from the job's config, resume from the newest checkpoint,
and record every iteration in the database.

Each iteration, in one short transaction (files are written before it opens): the metrics and
progress (one metric row per iteration; a redone iteration replaces its row), every
`sample_every` iterations one rollout group per prompt (images, seeds, rewards, advantages,
anchors), every `checkpoint_every` iterations and at the end a checkpoint. A cancel request is
answered at the end of the iteration it is seen in: a checkpoint is saved, then `cancelled`. A
periodic evaluation pass (eval_every; up to 48,000 samples) ends at its next solver step on a
cancel or a warm shutdown, without its eval_* metrics, so neither waits for it. Nor for a
reward server's answer (a busy one may take minutes): the iteration waiting for it is given
up, and the job stops at the iteration before, with a checkpoint of it.

The same `TrainRecorder` runs in rank 0 of a torchrun launch (worker/distributed_train.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy.orm import Session

from app.db import session_scope
from app.errors import NotFound
from app.json_values import json_safe
from app.models import Job, JobStatus
from app.services import checkpoints, datasets, jobs, rollouts, storage
from app.services import preference as pref_svc
from trainer.config import ConfigError, TrainConfig
from trainer.grpo import IterationResult
from trainer.loop import Trainer, TrainingDiverged, TrainingOutOfMemory
from trainer.models import checkpoint_directory, checkpoint_weights_file, uses_model_directory
from trainer.models.base import FlowModel
from trainer.rewards.models import RewardWeightsMissing, RewardWeightsUnloadable
from trainer.rewards.remote import RewardServerError, ScoringStopped
from trainer.tracking import keeps_samples
from worker.job_helpers import cancel_requested_poll, model_directory, png_bytes, reward_model_paths
from worker.lease import JobError, LeaseLost, require_lease
from worker.preference import ImageCache, fit_and_record, resolve_preference
from worker.reaper import send_requeued

log = logging.getLogger(__name__)


def checkpoint_root(job_id: int) -> Path:
    return storage.storage_root() / "checkpoints" / f"job-{job_id}"


def tracking_root() -> Path:
    """Where report_to's trackers write, for every job: one TensorBoard logdir, one MLflow
    store and one W&B directory compare the jobs (each run is named job-<id>)."""
    return storage.storage_root() / "tracking"


def group_samples(result: IterationResult, p: int) -> list[dict[str, Any]]:
    """The G members of prompt p as `record_rollout_group` samples."""
    anchors = {int(a) for a in np.asarray(result.anchors[p]).ravel()}
    return [{"png": png_bytes(result.images[p, g]), "member_index": g,
             "rewards": {name: float(r[p, g]) for name, r in result.rewards.items()},
             "advantage": float(result.advantages[p, g]), "is_anchor": g in anchors}
            for g in range(result.images.shape[1])]


# what a training job's decoded images may hold between its online refits (32 px shapes
# images: about 85,000 of them; 512 px: about 680)
REFIT_IMAGE_CACHE_BYTES = 512 * 2**20


def stop_poll(job_id: int, config: TrainConfig, shutdown: threading.Event
              ) -> Callable[[int], bool]:
    """Whether the train job will stop after an iteration: a cancel requested (read from the
    database at most once a second), or the worker leaving (`shutdown`) before the last
    iteration. The recorder's rule, and every rank's of a distributed run."""
    cancel_poll = cancel_requested_poll(job_id)

    def will_stop(iteration: int) -> bool:
        leaving = shutdown.is_set() and iteration < config.iterations
        return leaving or cancel_poll()

    return will_stop


class TrainRecorder:
    """The trainer callback that mirrors a run into the database. Returns True to stop."""

    def __init__(self, job_id: int, worker_name: str, config: TrainConfig,
                 parent_checkpoint_id: int | None,
                 shutdown: threading.Event | None = None, preference_last_vote: int = 0) -> None:
        self.job_id, self.worker_name, self.config = job_id, worker_name, config
        self.preference_last_vote = preference_last_vote  # newest vote the model in use saw
        # the voted and stored images, decoded once for all of this job's online refits
        self.refit_images = ImageCache(max_bytes=REFIT_IMAGE_CACHE_BYTES)
        self.root = checkpoint_root(job_id)
        self.last_checkpoint_id = parent_checkpoint_id
        self.shutdown = shutdown or threading.Event()
        self._will_stop = stop_poll(job_id, config, self.shutdown)
        self.cancelled = False
        self.requeued = False  # the worker is shutting down: saved, back in the queue
        # sharded weights (parallelism 'fsdp' over several processes): every rank writes a
        # checkpoint together, so the distributed runner saves it when `checkpoint_due` says
        # so and hands it over here (`presaved`); this callback then never saves by itself
        self.collective_checkpoints = False
        self.presaved: Path | None = None

    def _stop_reasons(self, iteration: int) -> tuple[bool, bool, bool]:
        """(cancel requested, the worker leaving, the last iteration) after `iteration`."""
        final = iteration >= self.config.iterations
        with session_scope() as s:
            cancel = jobs.is_cancel_requested(s, self.job_id)
        return cancel, self.shutdown.is_set() and not final, final

    def stop_requested(self, iteration: int) -> bool:
        """Whether the job will stop after `iteration`: a cancel requested, or the worker
        leaving before the last iteration (the last one finishes, its evaluation with it).
        Asked before each solver step of a periodic evaluation pass, which then ends, and
        while the next iteration waits for the reward server, which is then given up
        (`stop_mid_iteration`)."""
        return self._will_stop(iteration)

    def checkpoint_due(self, trainer: Trainer) -> bool:
        """Whether this iteration ends with a checkpoint: cancel requested, the worker
        leaving, the last iteration, or every checkpoint_every."""
        return self._due(trainer.iteration, self._stop_reasons(trainer.iteration))

    def _due(self, iteration: int, stop_reasons: tuple[bool, bool, bool]) -> bool:
        return any(stop_reasons) or iteration % self.config.checkpoint_every == 0

    def _record_checkpoint(self, s, iteration: int, path: Path) -> None:
        # the row names the checkpoint's main weights file (what a download serves): the LoRA,
        # the shapes model or the full transformer
        weights = checkpoint_weights_file(path)
        if weights is None:
            raise RuntimeError(f"checkpoint {path} holds no weights file")
        self.last_checkpoint_id = checkpoints.record_checkpoint(
            s, self.job_id, iteration, str(weights), parent_id=self.last_checkpoint_id)

    def __call__(self, trainer: Trainer, result: IterationResult) -> bool:
        it, cfg = trainer.iteration, self.config
        if it < cfg.iterations:  # the next iterations use the refitted model
            refit, self.preference_last_vote = maybe_refit_preference(
                trainer, cfg, self.job_id, self.preference_last_vote, self.refit_images)
            result.metrics.update(refit)
        cancel, leaving, final = self._stop_reasons(it)
        saved = None
        if self.collective_checkpoints:
            saved, self.presaved = self.presaved, None
            cancel = cancel and saved is not None  # else acted on at the next iteration
        elif self._due(it, (cancel, leaving, final)):
            saved = trainer.save_checkpoint(self.root)
        groups = ([group_samples(result, p) for p in range(len(result.prompts))]
                  if keeps_samples(cfg, it) else [])
        with session_scope() as s:
            require_lease(s, self.job_id, self.worker_name)
            solver, sigma = cfg.rollout_sampler()
            for p, samples in enumerate(groups):
                rollouts.record_rollout_group(
                    s, job_id=self.job_id, iteration=it, prompt_text=result.prompts[p],
                    solver=solver, steps=cfg.rollout_steps, sigma=sigma,
                    seed=int(result.noise_seeds[p]), samples=samples, purpose="train")
            if saved is not None:
                self._record_checkpoint(s, it, saved)
            requested = jobs.update_progress(s, self.job_id, it, cfg.iterations,
                                             json_safe(result.metrics))
            # a request that arrived after a collective checkpoint's plan waits for the next
            cancel = cancel or (requested and not (self.collective_checkpoints and saved is None))
            if cancel and saved is not None:
                jobs.mark_cancelled(s, self.job_id)
            elif leaving:
                self._requeue(s, it)
                return True
        if cancel and saved is None:  # the request arrived during this transaction
            saved = trainer.save_checkpoint(self.root)
            with session_scope() as s:
                self._record_checkpoint(s, it, saved)
                jobs.mark_cancelled(s, self.job_id)
        self.cancelled = cancel
        return cancel

    def stop_mid_iteration(self, trainer: Trainer) -> None:
        """End the job after an iteration given up part-way (Trainer.run raised
        ScoringStopped: `stop_requested` said so while the iteration waited for the reward
        server). The trainer is as its last whole iteration left it, and that iteration is
        recorded: the job ends as it would have at that iteration's end, with a checkpoint
        of it (unless it has one), cancelled, or requeued when the worker is leaving. With
        `collective_checkpoints` that checkpoint is the one the distributed runner saved on
        every rank as `checkpoint_due_mid_iteration` said (`presaved`)."""
        it = trainer.iteration
        if self.collective_checkpoints:
            saved, self.presaved = self.presaved, None
        else:
            saved = (trainer.save_checkpoint(self.root)
                     if self.checkpoint_due_mid_iteration(trainer) else None)
        with session_scope() as s:
            cancel = jobs.is_cancel_requested(s, self.job_id)  # else the worker is leaving
            require_lease(s, self.job_id, self.worker_name)
            if saved is not None:
                self._record_checkpoint(s, it, saved)
            if cancel:
                jobs.mark_cancelled(s, self.job_id)
                self.cancelled = True
            else:
                self._requeue(s, it)

    def checkpoint_due_mid_iteration(self, trainer: Trainer) -> bool:
        """Whether a job stopped part-way through an iteration (`stop_mid_iteration`) needs a
        checkpoint of its last whole one: unless that one has it already (iteration 0 is the
        base model, never a checkpoint; a resumed job's is recorded)."""
        with session_scope() as s:
            newest = checkpoints.latest_checkpoint(s, self.job_id)
        return trainer.iteration > (newest.iteration if newest is not None else 0)

    def _requeue(self, s: Session, iteration: int) -> None:
        """Back to the queue, as the worker leaves after `iteration` (checkpointed); a cancel
        that arrived meanwhile ends the job instead."""
        job = jobs.requeue(s, self.job_id, reason=f"worker {self.worker_name} shut down at "
                           f"iteration {iteration}; requeued to resume from its checkpoint")
        self.requeued = job.status == JobStatus.QUEUED
        self.cancelled = not self.requeued


def _blend_preference(trainer: Trainer, path: str | Path, version: int | None) -> None:
    from safetensors import SafetensorError

    from trainer.rewards.preference import PreferenceModel

    try:
        model = PreferenceModel.load(path, str(trainer.device))
    except (SafetensorError, OSError, ValueError) as exc:  # damaged since submission
        raise JobError(f"preference_model: {exc}") from None
    trainer.set_preference_model(model, version)
    log.info("blending preference model %s (v%s)", path, version)


def attach_preference(trainer: Trainer, config: TrainConfig, latest: int | None = None) -> int:
    """Blend in the preference model the config names (the newest one for "latest" or "",
    or version `latest` when given) as the reward "preference", when reward_weights has it.
    Returns the id of the newest vote that model saw (0 without one): online refits start
    from there."""
    path, version, last_vote = resolve_preference(config, latest)
    if not path:
        return 0
    from trainer.rewards.preference import model_features_problem, saved_features

    # submission checked the model it resolved then; "latest" may be a newer fit by now
    if (problem := model_features_problem(saved_features(path), config.model)) is not None:
        raise JobError(f"preference_model: preference model "
                       f"{f'v{version}' if version else str(path)} {problem}")
    _blend_preference(trainer, path, version)
    return last_vote


def attach_preference_version(trainer: Trainer, version: int) -> None:
    """Blend in recorded preference model `version`: how the other ranks of a torchrun launch
    follow rank 0's online refit (worker/distributed_train.py)."""
    _blend_preference(trainer, storage.resolve(pref_svc.model_path(version)), version)


def maybe_refit_preference(trainer: Trainer, config: TrainConfig, job_id: int,
                           last: int, images: ImageCache | None = None
                           ) -> tuple[dict[str, Any], int]:
    """Online refit (preference_refit_every): every N iterations, if votes arrived since the
    model in use was fitted (its newest vote id is `last`), fit a new version on all clean
    votes and swap it in. Returns the metrics to add and the new model's newest vote id."""
    n = config.preference_refit_every
    if not n or "preference" not in config.reward_weights or trainer.iteration % n:
        return {}, last
    with session_scope() as s:
        new = pref_svc.votes_since(s, last)
    if not new:
        return {"preference_refit": 0}, last
    from trainer.rewards import get_reward
    from trainer.rewards.preference import FitConfig, FitStopped, PreferenceModel

    # the same fit settings as the model in use (a model given by path may have none), and
    # that model to start from where its settings allow (FitConfig.warm_start_epochs)
    in_use = get_reward("preference")
    fit_config = getattr(in_use, "config", None) or FitConfig()
    began = time.perf_counter()
    try:
        # a cancel of the job stops the refit between epochs (nothing recorded); the job
        # then saves its checkpoint and ends as it would without one
        model, row = fit_and_record(
            fit_config, job_id=job_id, images=images,
            warm_start=in_use if isinstance(in_use, PreferenceModel) else None,
            should_stop=cancel_requested_poll(job_id))
    except FitStopped:
        return {"preference_refit": 0}, last
    except LeaseLost:  # the job is another worker's now: nothing more of it is ours
        raise
    except Exception as exc:  # noqa: BLE001 - a refit that fails costs the refit, not the run
        # (votes excluded meanwhile below a fit's minimum, a full disk, a lost image): the
        # run goes on with the model in use and tries again at the next refit
        log.warning("job %s: online preference refit failed at iteration %d, training goes "
                    "on with the model in use: %s", job_id, trainer.iteration, exc,
                    exc_info=not isinstance(exc, JobError))
        return {"preference_refit": 0, "preference_refit_failed": 1}, last
    trainer.set_preference_model(model, row["version"])
    # the new votes the fit read, up to its last vote: votes go on arriving while it starts,
    # so the count that decided to refit is short of them
    with session_scope() as s:
        new = pref_svc.votes_since(s, last, up_to=row["last_vote_id"])
    # the time training stood still for it (the fit and the scores of the stored samples)
    return ({"preference_refit": 1, "preference_refit_votes": new,
             "preference_refit_seconds": time.perf_counter() - began,
             "preference_refit_warm_start": int(bool(model.report.extra.get("warm_start"))),
             "preference_heldout_accuracy": row["heldout_accuracy"]}, row["last_vote_id"])


def train_config_of(session: Session, job: Job) -> TrainConfig:
    """The config a train job runs: its stored config (job_train_config), training on the
    train split of the job's dataset when it names one and the config gives no prompts
    (submission checked that the split has prompts the model can draw)."""
    prompts = None
    if job.dataset_id is not None and not job.config.get("prompts"):
        prompts = datasets.prompt_texts(session, job.dataset_id, "train")
        if not prompts:
            raise JobError(f"dataset {job.dataset_id} has no 'train' prompts left to train on")
    return job_train_config(job.config, prompts=prompts)


def job_train_config(config: dict[str, Any], prompts: list[str] | None = None) -> TrainConfig:
    """A train job's stored config as the trainer takes it: the typed form submission
    validated (read, not checked again: TrainConfig.from_stored), with a relative
    base_checkpoint resolved the way submission checked it (inside STORAGE_DIR or MODELS_DIR,
    `storage.job_path`) and model_path under MODELS_DIR (a missing or incomplete model
    directory is a JobError), so the worker's working directory never matters. `prompts`
    (a dataset's, which submission checked) replace the config's own."""
    data = dict(config) if prompts is None else {**config, "prompts": prompts}
    directory_model = uses_model_directory(data.get("model", "shapes"))
    if directory_model:
        data["model_path"] = str(model_directory(data["model"], data.get("model_path", "")))
    if data.get("base_checkpoint"):
        try:
            data["base_checkpoint"] = str(storage.job_path(
                data["base_checkpoint"], want="dir" if directory_model else "file"))
        except ValueError as exc:  # moved or deleted since submission
            raise JobError(f"base_checkpoint: {exc}") from None
    # model-backed rewards: every one the job uses gets its directory from the studio's
    # settings (REWARD_MODELS_DIR may be set in .env, which the trainer does not read); with a
    # reward server the server holds the weights and the job names none
    if not data.get("reward_server_url"):
        data["reward_model_paths"] = reward_model_paths(data.get("reward_weights") or {},
                                                        data.get("reward_model_paths"))
    config = TrainConfig.from_stored(data)
    if config.base_checkpoint:
        from trainer.models import ModelSpec, base_checkpoint_problem

        # submission's check again: the weights may have been replaced since (damaged, or
        # another run's), and the loader's own error would not name the field
        if (problem := base_checkpoint_problem(ModelSpec.from_config(config),
                                               config.base_checkpoint)) is not None:
            raise JobError(f"base_checkpoint: {problem} (it changed after the job was "
                           "submitted)")
    return config


def prepare_trainer(job_id: int, model: FlowModel | None = None
                    ) -> tuple[Trainer, TrainConfig, int | None, int]:
    """The job's trainer, resumed from its newest recorded checkpoint (if any); also the
    checkpoint's id and the newest vote its preference model saw (0 without one)."""
    with session_scope() as s:
        config = train_config_of(s, jobs.get_job(s, job_id))
        ckpt = checkpoints.latest_checkpoint(s, job_id)
        ckpt_id, ckpt_path = (ckpt.id, ckpt.path) if ckpt is not None else (None, None)
    try:
        trainer = Trainer(config, model=model)
    except (RewardServerError, RewardWeightsMissing, RewardWeightsUnloadable) as exc:
        # down or lacking a reward; or weights that passed the submission check but are gone
        # now, or do not load: the message names the reward, its setting and its files
        raise JobError(str(exc)) from None
    except ConfigError as exc:
        # a job stored before a rule it breaks (a FLUX job without prompts), or weights
        # that no longer fit: the field and the reason, without a traceback
        raise JobError(str(exc)) from None
    trainer.track(tracking_root(), f"job-{job_id}")  # prepared on rank 0 alone when distributed
    last_vote = attach_preference(trainer, config)
    if ckpt_path is not None:
        try:
            with session_scope() as s:
                weights = checkpoints.checkpoint_file(s, ckpt_id)
        except NotFound as exc:  # the resume's check passed; the files went since
            raise JobError(exc.message) from None
        directory = checkpoint_directory(weights)
        trainer.load_checkpoint(directory)
        log.info("job %s resumes from %s (iteration %d)", job_id, directory, trainer.iteration)
    with session_scope() as s:  # iterations after the checkpoint are redone and re-recorded
        jobs.truncate_history(s, job_id, trainer.iteration)
        in_use = (jobs.get_job(s, job_id).metrics or {}).get("preference_model_version")
    if ckpt_path is not None:
        last_vote = _resume_preference(trainer, config, job_id, in_use, last_vote)
    return trainer, config, ckpt_id, last_vote


def _resume_preference(trainer: Trainer, config: TrainConfig, job_id: int, in_use: Any,
                       last_vote: int) -> int:
    """A resumed job goes on with the preference model it used at its checkpoint (version
    `in_use`, from the checkpoint iteration's metrics), not the one its config resolves to
    now: "latest" was a newer fit by then, and an online refit's version (recorded by this
    job) was forgotten, so the run went back to its first model and refitted on the same
    votes again. Returns the newest vote id the model in use saw."""
    if (not isinstance(in_use, int) or isinstance(in_use, bool) or in_use < 1
            or in_use == trainer.preference_version):
        return last_vote
    with session_scope() as s:
        try:
            row = pref_svc.get_model(s, in_use)
        except NotFound:
            return last_vote  # deleted since: the config's model, as at a first start
        refitted_here, row_last_vote = row.job_id == job_id, row.last_vote_id
    # a model given by path carries a version of its own report, not a recorded one's
    if pref_svc.parse_spec(config.preference_model).kind == "path" and not refitted_here:
        return last_vote
    attach_preference_version(trainer, in_use)
    log.info("job %s resumes with preference model v%d, in use at its checkpoint", job_id, in_use)
    return row_last_vote


# errors whose message says it all, named the way the job's error shows them (no traceback):
# what prepare_trainer and run_training turn into JobErrors, and a rank of a distributed job
# reports as such (worker.distributed_train)
SELF_EXPLAINING_ERRORS = (JobError, ConfigError, TrainingDiverged, TrainingOutOfMemory,
                          RewardServerError, RewardWeightsMissing, RewardWeightsUnloadable)

def run_training(job_id: int, worker_name: str, shutdown: threading.Event | None = None) -> str:
    """Train in this process (the job is already claimed). Returns the final status."""
    trainer, config, ckpt_id, last_vote = prepare_trainer(job_id)
    recorder = TrainRecorder(job_id, worker_name, config, ckpt_id, shutdown, last_vote)
    if trainer.iteration < config.iterations:
        try:
            trainer.run(recorder, stop_requested=lambda: recorder.stop_requested(
                trainer.iteration))
        except ScoringStopped:  # a cancel or a shutdown while the reward server scored
            recorder.stop_mid_iteration(trainer)
        except RewardServerError as exc:  # went away or timed out mid-run; resumable
            raise JobError(f"{exc} (at iteration {trainer.iteration + 1}; resume the job "
                           "to go on from its last checkpoint)") from None
        except TrainingDiverged as exc:  # the message says what and what to do
            raise JobError(str(exc)) from None
        except TrainingOutOfMemory as exc:  # the same, and how a studio job changes them
            raise JobError(f"{exc} Here: POST /api/jobs/{job_id}/resume with a body such as "
                           '{"config": {"train_batch_size": 1}} (the fields a resume may '
                           "change: train_batch_size, rollout_batch_size, "
                           "gradient_checkpointing, gradient_checkpointing_fraction).") from None
    if recorder.cancelled:
        return JobStatus.CANCELLED
    if recorder.requeued:
        send_requeued(job_id, "train", worker_name)
        return JobStatus.QUEUED
    with session_scope() as s:
        require_lease(s, job_id, worker_name)
        job = jobs.mark_succeeded(s, job_id)
        return job.status
