"""The fit_preference job and the preference reward in train jobs (issue 6).

- `run_fit_preference`: every clean vote with its two images from storage -> PreferencePairs
  (a = the left sample, b = the right) -> `fit_preference_model` (FitConfig from the job's
  config) -> STORAGE_DIR/preference/vN.safetensors, a `preference_models` row, the report on
  the job's metrics, and (by default) the new model's score cached on every stored sample so
  that active pair selection in GET /api/votes/next never runs the network.
- `fit_and_record`: the same fit, also used by a train job's online refit
  (`preference_refit_every`).
- `resolve_preference`: which model a train job blends in ("latest" or "" -> the newest row).
"""

from __future__ import annotations

import io
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np
from PIL import Image
from sqlalchemy.exc import IntegrityError

from app.db import session_scope
from app.errors import NotFound
from app.job_kinds import FitPreferenceConfig
from app.json_values import json_safe
from app.services import jobs, storage
from app.services import preference as pref_svc
from trainer.config import TrainConfig
from trainer.loop import resolve_device
from trainer.rewards.fit_config import fit_fields
from trainer.rewards.preference import (
    LABELLED_OUTCOMES,
    FitConfig,
    FitStopped,
    PreferenceModel,
    PreferencePair,
    features_problem,
    fit_preference_model,
    image_batch,
    warm_start_problem,
)
from worker.job_helpers import cancel_requested_poll, throttled
from worker.lease import JobError, LeaseLost, require_lease

log = logging.getLogger(__name__)

# the fit_preference job's config fields that are FitConfig's (the job adds min_votes and
# score_samples; the worker chooses the device): one list, FitConfig's own
FIT_FIELDS = tuple(f.name for f in fit_fields(exclude=("device",)))


class ImageCache:
    """Decoded images by storage path (a pair's images repeat across votes and fits), the
    least recently used dropped beyond `max_bytes` (a training job keeps one across its
    online refits: a 512 px image decodes to 0.75 MiB)."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self._items: OrderedDict[str, np.ndarray] = OrderedDict()
        self.max_bytes, self.nbytes = max_bytes, 0

    def get(self, rel_path: str) -> np.ndarray:
        image = self._items.get(rel_path)
        if image is not None:
            self._items.move_to_end(rel_path)
            return image
        data = storage.resolve(rel_path).read_bytes()
        image = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.uint8)
        self._items[rel_path] = image
        self.nbytes += image.nbytes
        while self.max_bytes is not None and self.nbytes > self.max_bytes and len(self._items) > 1:
            _, dropped = self._items.popitem(last=False)
            self.nbytes -= dropped.nbytes
        return image

    def shape(self, rel_path: str) -> tuple[int, ...] | None:
        """The image's (H, W, 3), or None when its file is gone or does not decode (a fit
        leaves its votes out, counted, rather than failing on the first such file)."""
        try:
            return self.get(rel_path).shape
        except (OSError, ValueError, NotFound) as exc:  # PIL's UnidentifiedImageError: OSError
            log.warning("stored image %s cannot be read: %s", rel_path, exc)
            return None


def fit_config_for_job(cfg: FitPreferenceConfig) -> FitConfig:
    """The trainer's FitConfig of a fit_preference job: its fields, the device resolved on
    this worker and clip_path inside STORAGE_DIR or MODELS_DIR (as submission checked)."""
    fields = cfg.model_dump(include=set(FIT_FIELDS))
    if cfg.features == "clip":
        fields["clip_path"] = str(storage.job_path(cfg.clip_path, want="dir"))
    return FitConfig(**fields, device=str(resolve_device(cfg.device)))


def fit_and_record(fit_config: FitConfig, *, job_id: int | None = None, min_votes: int = 0,
                   score_samples: bool = True, images: ImageCache | None = None,
                   warm_start: PreferenceModel | None = None,
                   should_stop: Callable[[], bool] | None = None,
                   on_epoch: Callable[[int, int], None] | None = None
                   ) -> tuple[PreferenceModel, dict[str, Any]]:
    """Fit on every clean vote, save vN, record the row (and cache sample scores).
    `warm_start`: the model a refit may start from (fit_config.warm_start_epochs; the votes
    are keyed by their ids, so their held-out split is the same in every fit).
    `should_stop`: passed to the fit (FitStopped, and nothing saved, when it says stop).
    `on_epoch(done, total)`: passed to the fit (its epochs over every ensemble member).
    Returns the model and its row as a dict."""
    images = images or ImageCache()
    with session_scope() as s:
        # the votes up to the newest id none below which is still being written: the model
        # records it as its last vote, and an online refit counts the votes after it
        settled = pref_svc.settled_vote_id(s)
        votes = pref_svc.fit_votes(s, up_to=settled)
    # skip and both_bad votes carry no label: their images are not loaded, only counted
    rows = [r for r in votes if r["outcome"] in LABELLED_OUTCOMES]
    unlabelled = Counter(r["outcome"] for r in votes if r["outcome"] not in LABELLED_OUTCOMES)
    # votes whose image files are gone or damaged (deleted by hand, a disk restored from an
    # older backup) are left out and counted: one such file failed the whole fit, and a
    # train job's online refit with it
    present = [r for r in rows
               if images.shape(r["a_path"]) is not None and images.shape(r["b_path"]) is not None]
    missing, rows = len(rows) - len(present), present
    # votes on images the features cannot read (a flux or sd3 sample for the shapes
    # features) are left out and counted: the same vote teaches a CLIP-features fit
    rows, unreadable = pref_svc.readable_votes(rows, fit_config.features,
                                               lambda path: images.get(path).shape)
    clean = len(rows)
    if needed := pref_svc.votes_short_of_a_fit(clean, min_votes):
        # said in full (JobError: no traceback on the job); submission refuses this too, so
        # it happens only when votes were excluded after the job was accepted
        raise JobError(f"fit_preference: {clean} clean votes (a, b or tie)"
                       + (f" on images its {fit_config.features!r} features read ({unreadable} "
                          "more are on images they cannot: other models' samples or "
                          "prompts; features 'clip' reads any)" if unreadable else "")
                       + f"; need at least {needed}")
    if unreadable:
        unlabelled["unreadable_images"] = unreadable
    if missing:
        unlabelled["missing_images"] = missing
    pairs = [PreferencePair(images.get(r["a_path"]), images.get(r["b_path"]), r["prompt"],
                            r["outcome"], key=str(r["vote_id"])) for r in rows]
    with session_scope() as s:
        version = pref_svc.next_version(s)
    model = fit_preference_model(pairs, fit_config, version=version, warm_start=warm_start,
                                 should_stop=should_stop, on_epoch=on_epoch)
    if model.report is not None:
        model.report.votes_total += sum(unlabelled.values())
        model.report.votes_ignored = {**model.report.votes_ignored, **unlabelled}
    checkpoint_ids = sorted({c for r in rows for c in r["checkpoint_ids"]},
                            key=lambda c: (c is not None, c or 0))
    out = _save_new_version(model, version, job_id=job_id, votes_used=len(rows),
                            last_vote_id=settled,
                            checkpoint_ids=checkpoint_ids)
    version = out["version"]
    log.info("preference model v%d: %d votes, held-out accuracy %s", version, len(rows),
             out["report"].get("heldout_accuracy"))
    if score_samples:
        score_all_samples(model, version, images)
    return model, out


# how many versions a fit tries to take before giving up: each try loses only to another fit
# that recorded one in between, so more than a few means something else is wrong
SAVE_VERSION_TRIES = 20


def _save_new_version(model: PreferenceModel, version: int, *, job_id: int | None,
                      votes_used: int, last_vote_id: int, checkpoint_ids: list[int | None]
                      ) -> dict[str, Any]:
    """Save `model` as the next free version (`version` or later) and record its row; the
    row as a dict. Two fits that finish together (a fit job and a train job's refit, or two
    workers) both start from the same next version: the file name is claimed with an
    exclusive create before it is written, and the row's unique version decides between
    fits whose storage directories differ; the loser takes the next version, and never
    writes over the winner's file."""
    root = storage.storage_root()
    for _ in range(SAVE_VERSION_TRIES):
        rel = pref_svc.model_path(version)
        full = root / rel
        full.parent.mkdir(parents=True, exist_ok=True)
        try:
            full.open("xb").close()  # the claim: an empty file no row points at yet
        except FileExistsError:
            version += 1
            continue
        if model.report is not None:
            model.report.version = version
        tmp = full.with_name(f".tmp-{full.name}")
        try:
            model.save(tmp, metadata={"version": str(version), "job_id": str(job_id or ""),
                                      "votes_used": str(votes_used)})
            tmp.replace(full)
            report = json_safe(asdict(model.report)) if model.report else {}
            with session_scope() as s:
                row = pref_svc.record_model(
                    s, version=version, path=rel, report=report, job_id=job_id,
                    votes_used=votes_used, last_vote_id=last_vote_id,
                    checkpoint_ids=checkpoint_ids)
                return pref_svc.to_dict(row)
        except IntegrityError:
            full.unlink(missing_ok=True)
            with session_scope() as s:
                if not pref_svc.version_exists(s, version):
                    raise  # not the version taken: something else is wrong with the row
                # the version's row came from a fit writing to another storage directory
                version = max(version + 1, pref_svc.next_version(s))
        except BaseException:
            full.unlink(missing_ok=True)  # no claim left behind by a failed save
            raise
        finally:
            tmp.unlink(missing_ok=True)
    raise RuntimeError(f"no free preference model version after {SAVE_VERSION_TRIES} tries "
                       f"(last {version}); another process keeps recording them")


def score_all_samples(model: PreferenceModel, version: int, images: ImageCache | None = None,
                      batch: int = 2000) -> int:
    """Cache `model`'s reward on every stored sample. Returns how many were scored."""
    images = images or ImageCache()
    done = 0
    with session_scope() as s:
        batches = list(pref_svc.iter_samples(s, batch))
    for rows in batches:
        # only the samples its features read (the shapes world's, for the shapes features)
        features = model.config.features
        # (and those whose file is gone or damaged: left unscored, not a failed job after
        # its model was recorded)
        rows = [(sid, path, prompt) for sid, path, prompt in rows
                if features_problem(features, prompt) is None  # before its image loads
                and (shape := images.shape(path)) is not None
                and features_problem(features, prompt, shape) is None]
        if not rows:
            continue
        pixels = image_batch([images.get(path) for _, path, _ in rows])
        scores = model.scores(pixels, [prompt for _, _, prompt in rows])
        with session_scope() as s:
            pref_svc.set_scores(s, {sid: float(v) for (sid, _, _), v in zip(rows, scores,
                                                                          strict=True)}, version)
        done += len(rows)
    return done


def newest_model(fit_config: FitConfig) -> PreferenceModel | None:
    """The newest recorded preference model, loaded, when a fit with `fit_config` may start
    from it (warm_start_epochs set and the same network and held-out votes); else None."""
    if not fit_config.warm_start_epochs:
        return None
    with session_scope() as s:
        row = pref_svc.latest_model(s)
        path = row.path if row is not None else None
    if path is None:
        return None
    try:
        model = PreferenceModel.load(storage.resolve(path), device=fit_config.device)
    except Exception as exc:  # noqa: BLE001 - a missing or unreadable file costs the warm
        # start, not the fit
        log.warning("preference fit from scratch: %s does not load (%s)", path, exc)
        return None
    if (problem := warm_start_problem(model, fit_config)) is not None:
        log.info("preference fit from scratch: it cannot start from v%s: %s",
                 model.report.version if model.report else "?", problem)
        return None
    return model


def run_fit_preference(job_id: int, worker_name: str) -> str:
    """The fit_preference job (already claimed by `worker.tasks.run_job`). A cancel stops the
    fit between epochs; nothing is saved then. Progress counts epochs over every ensemble
    member (written at most every PROGRESS_SECONDS): a fit can take minutes."""
    with session_scope() as s:
        cfg = FitPreferenceConfig.from_stored(jobs.get_job(s, job_id).config)
        # the fit says its total (a warm start trains fewer epochs) once it starts
        epochs = cfg.epochs * max(1, cfg.ensemble)
        jobs.update_progress(s, job_id, 0, epochs)
    fit_config = fit_config_for_job(cfg)
    total = epochs

    def write_progress(done: int) -> None:
        with session_scope() as s:
            require_lease(s, job_id, worker_name)
            jobs.update_progress(s, job_id, done, total)

    write = throttled(write_progress)

    def on_epoch(done: int, of: int) -> None:
        nonlocal total
        total = of
        write(done)

    try:
        _model, row = fit_and_record(fit_config, job_id=job_id, min_votes=cfg.min_votes,
                                     score_samples=cfg.score_samples,
                                     warm_start=newest_model(fit_config),
                                     should_stop=cancel_requested_poll(job_id),
                                     on_epoch=on_epoch)
    except FitStopped:
        with session_scope() as s:
            if not jobs.holds(s, job_id, worker_name):
                raise LeaseLost(f"job {job_id} is no longer held by {worker_name}") from None
            return jobs.mark_cancelled(s, job_id).status
    metrics = json_safe({"preference_model_version": row["version"],
                             "preference_model_path": row["path"],
                             "votes_used": row["votes_used"], **row["report"]})
    with session_scope() as s:
        require_lease(s, job_id, worker_name)
        jobs.update_progress(s, job_id, total, total, metrics)
        return jobs.mark_succeeded(s, job_id, metrics=metrics).status


def resolve_preference(config: TrainConfig, latest: int | None = None
                       ) -> tuple[str, int | None, int]:
    """(absolute path, version or None, last vote id it saw) of the preference model a train
    job blends in, or ("", None, 0) when `reward_weights` has no "preference".
    `preference_model`: "" or "latest" -> the newest recorded model (version `latest` when
    given: what another process resolved, as a fit may have recorded a newer one since);
    "vN" or "N" -> that version; otherwise a path (relative to the storage dir, or absolute)."""
    if "preference" not in config.reward_weights:
        return "", None, 0
    return resolve_preference_spec(config.preference_model, latest)


def resolve_preference_spec(text: str, latest: int | None = None, named_in: str = "reward_weights"
                            ) -> tuple[str, int | None, int]:
    """(absolute path, version or None, last vote id it saw) of the preference model `text`
    names, as resolve_preference reads a train config's preference_model (an evaluate job's
    too: `named_in` is the field that asked for 'preference')."""
    spec = pref_svc.parse_spec(text)
    with session_scope() as s:
        if spec.kind == "latest":
            row = pref_svc.get_model(s, latest) if latest else pref_svc.latest_model(s)
            if row is None:
                raise ValueError(f"{named_in} has 'preference' but no preference model has "
                                 "been fitted yet: run a fit_preference job first")
        elif spec.kind == "version":
            try:
                row = pref_svc.get_model(s, spec.version)
            except NotFound as exc:  # deleted while the job waited in the queue
                raise JobError(f"preference_model: {exc.message}") from None
        else:
            try:
                full = storage.job_path(spec.path)
            except ValueError as exc:
                raise FileNotFoundError(f"preference_model: {exc}") from None
            return str(full), None, 0
        try:
            full = storage.resolve(row.path)
        except NotFound as exc:  # deleted by hand while the job waited in the queue
            raise JobError(f"preference_model: preference model v{row.version}'s file "
                           f"{row.path} is gone ({exc.message}) from STORAGE_DIR; fit a new "
                           "one or name another version") from None
        return str(full), row.version, row.last_vote_id
