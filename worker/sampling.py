"""Rollout and evaluate jobs: sample from a checkpoint (or the shipped base) and store the
images with their automatic rewards for voting.

- rollout: one group of G neighbouring noises per dataset prompt (as in training), rewards and
  advantages, so annotators can compare members of one group.
- evaluate: fixed prompts x fixed seeds from each checkpoint, one image per (prompt, seed); the
  same (prompt, seed) from two checkpoints is a cross-checkpoint pair for the leaderboard. Each
  checkpoint's reward means (and std, image count, prompt set) are stored on the checkpoint
  (`checkpoints.record_scores`), where the leaderboard shows them beside the human rating.

Model-backed rewards (hpsv2, pickscore, ...) are checked before the first model loads: missing
weights fail the job at once, naming the reward, the setting and the files expected. A job with
`reward_server_url` scores every reward on that reward server instead (as a train job does,
through `trainer.rewards.remote.prepare_scorer`): a server that is down or lacks a reward fails
the job the same way, naming the URL, before any sampling.

A cancel stops either job where it is seen: before a solver step, or while the job waits for
the reward server's scores (its request's connection is cut: the server drops it). Either way
the chunk or checkpoint in progress is dropped and what was stored before it stays. A worker's
warm shutdown does not stop them (they run to their end).

Both are idempotent: groups already stored for the job are skipped, so a rerun after a crash
finishes the rest. Progress counts prompts (rollout) or images over all checkpoints
(evaluate: written as each batch ends, at most every PROGRESS_SECONDS; the metric history has
one row per checkpoint, keyed by its index).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np
import torch

from app.db import session_scope
from app.errors import NotFound
from app.job_kinds import EvaluateConfig, RolloutConfig, SamplingConfig, default_reward_names
from app.json_values import json_safe
from app.models import JobStatus
from app.services import checkpoints, datasets, jobs, rollouts
from trainer.config import SHAPES_SAMPLE_BATCH  # a real model's 0 is set at submission
from trainer.evaluation import sample_images, stepping
from trainer.grpo import blended_group_rewards, group_advantages, group_noises
from trainer.loop import resolve_device
from trainer.models import (
    ModelSpec,
    checkpoint_spec,
    load_flow_model,
    resolution_limit_problem,
    uses_model_directory,
)
from trainer.models.base import FlowModel, micro_batches, repeat_cond, to_uint8
from trainer.rewards.models import RewardWeightsMissing, RewardWeightsUnloadable
from trainer.rewards.remote import RewardServerError, Scorer, ScoringStopped, prepare_scorer
from trainer.shapes.world import all_prompts
from trainer.solvers import rollout
from worker.job_helpers import (
    cancel_requested_poll,
    model_directory,
    png_bytes,
    reward_model_paths,
    throttled,
)
from worker.lease import JobError, require_lease

log = logging.getLogger(__name__)

# a rollout job samples, records and reports progress (where a cancel is seen) a chunk of
# whole groups at a time: 16 prompts of the default G = 8, fewer for larger groups, so that a
# chunk stays ~128 samples (a cancel waits for one chunk, not 16 x 256 samples)
CHUNK_SAMPLES = 128


def prompts_per_chunk(group_size: int) -> int:
    """How many prompts' groups one chunk of a rollout job holds (at least one)."""
    return max(1, CHUNK_SAMPLES // group_size)


class Cancelled(Exception):
    pass


def sampling_spec(cfg: SamplingConfig, checkpoint_id: int | None) -> ModelSpec:
    """What a rollout or evaluate job samples: a recorded checkpoint's model as its run built
    it (the run config it carries), or for None the base of the config's model. The config's
    model_path, resolution and guidance_scale replace the checkpoint's when set. A missing or
    incomplete model directory is a JobError, raised before anything loads."""
    model = cfg.model or "shapes"
    if checkpoint_id is None:
        spec = ModelSpec.base(model)
    else:
        try:
            with session_scope() as s:
                ckpt = checkpoints.get_checkpoint(s, checkpoint_id)
                base = checkpoints.base_spec(ckpt) if checkpoints.is_base(ckpt) else None
                path = checkpoints.stored_file(ckpt) if base is None else None
        except NotFound as exc:  # its files went after submission checked them
            raise JobError(exc.message) from None
        spec = base if base is not None else checkpoint_spec(path)
    if uses_model_directory(spec.name):
        spec.path = str(model_directory(spec.name, cfg.model_path or spec.path))
    if cfg.resolution:
        spec.resolution = cfg.resolution
    if cfg.guidance_scale is not None:
        spec.guidance_scale = cfg.guidance_scale
    if spec.path and (problem := resolution_limit_problem(spec.name, spec.path,
                                                          spec.resolution)) is not None:
        raise JobError(f"resolution: {problem}")  # submission checks it too
    spec.inference_only = True  # sampled, never trained: in its loaded dtype, no gradients
    return spec


def load_sampling_model(cfg: SamplingConfig, checkpoint_id: int | None) -> FlowModel:
    """The model `sampling_spec` describes, on this worker's device."""
    return load_flow_model(sampling_spec(cfg, checkpoint_id), device=resolve_device("auto"))


def release_device_memory() -> None:
    """Give the memory of models no longer referenced back to the device (a reference cycle
    in a diffusers pipeline would otherwise keep it until the collector runs)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def reward_names(kind: str, cfg: RolloutConfig | EvaluateConfig) -> list[str]:
    """The rewards a job scores: its config's (submission fills in the model's defaults; rows
    stored before that hold none)."""
    return list(cfg.reward_names or default_reward_names(kind, cfg.model or "shapes"))


def prepare_rewards(names: list[str], given: dict[str, str] | None = None,
                    server_url: str = "",
                    stop_requested: Callable[[], bool] | None = None) -> Scorer:
    """What scores the job's rewards `names` (`prepare_scorer`, as for a train job), checked
    now, before any sampling: a JobError when one cannot be scored. With `server_url`, the
    reward server there must be up and serve them all, and `stop_requested` (the job's
    `CancelCheck.requested`) may end a wait for its scores (ScoringStopped). Without, the
    model-backed rewards point at their weights (worker.job_helpers.reward_model_paths) on this
    worker's device."""
    if server_url:
        try:
            return prepare_scorer(names, server_url, stop_requested=stop_requested)
        except RewardServerError as exc:  # down, or lacks a reward: the message says it in full
            raise JobError(str(exc)) from None
    paths = reward_model_paths(names, given)
    try:
        return prepare_scorer(names, "", paths, resolve_device("auto"))
    except (RewardWeightsMissing, RewardWeightsUnloadable) as exc:
        raise JobError(str(exc)) from None


def score(scorer: Scorer, names: list[str], images: np.ndarray, prompts: list[str],
          cancel: CancelCheck) -> dict[str, np.ndarray]:
    """`scorer(names, images, prompts)`; a reward server that goes away or times out mid-job
    fails the job with its message alone (groups and checkpoints already stored are kept: a
    resumed job finishes the rest). A cancel seen while the server scores (the scorer's
    `stop_requested` is `cancel.requested`) ends the job as one seen before a solver step
    does: cancelled, Cancelled raised, the images being scored dropped."""
    try:
        return scorer(names, images, prompts)
    except ScoringStopped:
        cancel.stop()
    except RewardServerError as exc:
        raise JobError(f"{exc} (resume the job to score the rest)") from None


def dataset_prompts(dataset_id: int, split: str, limit: int | None) -> list[tuple[int, str]]:
    """`datasets.prompt_rows` in a session of its own."""
    with session_scope() as s:
        return datasets.prompt_rows(s, dataset_id, split, limit)


def prompt_seed(seed: int, prompt_key: int) -> int:
    """A reproducible 62-bit noise seed for one prompt of a rollout job."""
    state = np.random.SeedSequence([seed, prompt_key]).generate_state(1, np.uint64)[0]
    return int(state >> np.uint64(2))


def _progress(job_id: int, worker_name: str, done: int, total: int,
              metrics: dict[str, Any] | None = None, history_at: int | None = None) -> None:
    """Progress `done` of `total`; `metrics` recorded as the history row of `done`, or of
    `history_at` when the history counts other steps than the progress (evaluate)."""
    with session_scope() as s:
        require_lease(s, job_id, worker_name)
        if history_at is not None and metrics is not None:
            jobs.update_progress(s, job_id, history_at, None, metrics)
            metrics = None
        cancelled = jobs.update_progress(s, job_id, done, total, metrics)
        if cancelled:
            jobs.mark_cancelled(s, job_id)
    # raised once the session has committed: inside it, the exception would roll the
    # cancelled status back and leave the job "running" until a reaper found it stale
    if cancelled:
        raise Cancelled


class CancelCheck:
    """How a sampling job sees its cancel. `requested()`: whether it was asked (the flag read
    at most once a second, worker.job_helpers.cancel_requested_poll); asked before every
    solver step and, as the scorer's `stop_requested`, while a reward server scores. The
    check itself (calling it: a `before_step` for sampling) `stop()`s the job once it was, so
    that a cancel does not wait for the rest of a chunk (minutes of a large model's images)."""

    def __init__(self, job_id: int, worker_name: str) -> None:
        self.job_id, self.worker_name = job_id, worker_name
        self.requested = cancel_requested_poll(job_id)

    def __call__(self) -> None:
        if self.requested():
            self.stop()

    def stop(self) -> NoReturn:
        """Mark the job cancelled and raise Cancelled (its cancel was seen)."""
        with session_scope() as s:
            require_lease(s, self.job_id, self.worker_name)
            jobs.mark_cancelled(s, self.job_id)
        raise Cancelled  # after the commit, as in _progress


def run_rollout(job_id: int, worker_name: str) -> str:
    with session_scope() as s:
        cfg = RolloutConfig.from_stored(jobs.get_job(s, job_id).config)
        done_ids = rollouts.prompts_done(s, job_id)
        ckpt_iteration = (checkpoints.get_checkpoint(s, cfg.checkpoint_id).iteration
                          if cfg.checkpoint_id else 0)
    prompts = dataset_prompts(cfg.dataset_id, cfg.split, cfg.max_prompts)
    if not prompts:
        raise JobError(f"dataset {cfg.dataset_id} has no {cfg.split!r} prompts")
    names = reward_names("rollout", cfg)
    cancel = CancelCheck(job_id, worker_name)
    scorer = prepare_rewards(names, cfg.reward_model_paths, cfg.reward_server_url,
                             cancel.requested)
    model = load_sampling_model(cfg, cfg.checkpoint_id)
    weights = {name: 1.0 for name in names}
    g, steps, batch = cfg.group_size, cfg.steps, cfg.batch_size
    device = next(model.parameters()).device
    timesteps = model.sigmas(steps)  # the model's grid: laid out once, not per chunk
    todo = [(pid, text) for pid, text in prompts if pid not in done_ids]
    done = len(prompts) - len(todo)
    velocity = stepping(model, cancel)
    try:
        _progress(job_id, worker_name, done, len(prompts))
        per_chunk = prompts_per_chunk(g)
        for start in range(0, len(todo), per_chunk):
            chunk = todo[start:start + per_chunk]
            seeds = [prompt_seed(cfg.seed, pid) for pid, _ in chunk]
            texts = [text for _, text in chunk]
            p = len(chunk)
            with torch.no_grad():
                model.eval()
                noises = group_noises(seeds, g, cfg.sigma, model.latent_shape, device)
                cond = repeat_cond(model.encode_prompts(texts), g)
                traj = rollout(cfg.solver, velocity, noises.flatten(0, 1), cond, steps,
                               shift=model.flow_shift, batch_size=batch,
                               timesteps=timesteps)
                final = traj.final
                images = np.concatenate([to_uint8(model.decode(final[rows])) for rows in
                                         micro_batches(final.shape[0], batch)])  # (P*G, H, W, 3)
            raw = score(scorer, names, images, [t for t in texts for _ in range(g)], cancel)
            advantages = group_advantages(blended_group_rewards(raw, weights, (p, g))).numpy()
            images = images.reshape(p, g, *images.shape[1:])
            with session_scope() as s:
                require_lease(s, job_id, worker_name)
                for i, (pid, text) in enumerate(chunk):
                    samples = [{"png": png_bytes(images[i, m]), "member_index": m,
                                "rewards": {n: float(raw[n][i * g + m]) for n in names},
                                "advantage": float(advantages[i, m])} for m in range(g)]
                    rollouts.record_rollout_group(
                        s, job_id=job_id, iteration=ckpt_iteration, prompt_id=pid,
                        prompt_text=text, checkpoint_id=cfg.checkpoint_id,
                        solver=cfg.solver, steps=steps, sigma=cfg.sigma, seed=seeds[i],
                        samples=samples, purpose="rollout")
            done += p
            _progress(job_id, worker_name, done, len(prompts),
                      {"groups": done, "reward_mean": float(np.mean(sum(raw.values()) / len(raw)))})
    except Cancelled:
        return JobStatus.CANCELLED
    with session_scope() as s:
        return jobs.mark_succeeded(s, job_id).status


class EvaluationPreference:
    """The fitted preference model an evaluate job scores 'preference' with, and the name its
    scores are stored under ("v3", or a path's relative to STORAGE_DIR). Its score is the
    ensemble's mean (the Bradley-Terry utility): a measurement, without the uncertainty
    penalty a training reward subtracts."""

    def __init__(self, model: Any, label: str) -> None:
        self.model = model
        self.label = label

    @classmethod
    def load(cls, cfg: EvaluateConfig, history: Any) -> EvaluationPreference:
        """The model `cfg.preference_model` names; on a resume (`history`: the metric rows
        of checkpoints already scored) the version those were scored with, not a newer
        'latest'. Checked before any sampling: a JobError names what is wrong."""
        from trainer.rewards.preference import (
            PreferenceModel,
            model_features_problem,
            saved_features,
        )
        from worker.preference import resolve_preference_spec

        begun = next((row["preference_model"] for row in history
                      if isinstance(row, dict) and row.get("preference_model")), None)
        spec = begun if begun is not None else cfg.preference_model
        try:
            path, version, _ = resolve_preference_spec(spec, named_in="reward_names")
            problem = model_features_problem(saved_features(path), cfg.model or "shapes")
            if problem is not None:
                raise ValueError(f"preference model {spec or 'latest'!r} {problem}")
            model = PreferenceModel.load(path, str(resolve_device("auto")))
        except (OSError, ValueError, NotFound) as exc:
            raise JobError(f"preference_model: {exc}") from None
        label = f"v{version}" if version is not None else storage_label(path)
        return cls(model, label)

    def scores(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        from trainer.rewards.preference import image_batch

        return self.model.scores(image_batch(list(images)), prompts)


def storage_label(path: str) -> str:
    """`path` relative to STORAGE_DIR where it lies there (what a user typed), else as is."""
    from pathlib import Path

    from app.services import storage

    root = storage.storage_root().resolve()
    full = Path(path).resolve()
    return str(full.relative_to(root)) if full.is_relative_to(root) else str(full)


def like_for_like(cfg: EvaluateConfig, specs: dict[int, ModelSpec], bases: set[int]) -> None:
    """A base model among fine-tuned checkpoints samples at their resolution, guidance and
    precision (where the job sets none), so that a (prompt, seed) of the two is one picture
    drawn by each: the base's row knows only its model and directory."""
    tuned = [spec for cid, spec in specs.items() if cid not in bases]
    if not tuned:
        return
    for cid in bases & specs.keys():
        spec = specs[cid]
        if not cfg.resolution:
            spec.resolution = tuned[0].resolution
        if cfg.guidance_scale is None:
            spec.guidance_scale = tuned[0].guidance_scale
        spec.mixed_precision = tuned[0].mixed_precision


def run_evaluate(job_id: int, worker_name: str) -> str:
    with session_scope() as s:
        job = jobs.get_job(s, job_id)
        cfg = EvaluateConfig.from_stored(job.config)
        history = {m.iteration: m.metrics for m in jobs.metric_history(s, job_id)}
        rows = [checkpoints.get_checkpoint(s, c) for c in cfg.checkpoint_ids]
        ckpts = [(c.id, c.iteration) for c in rows]
        bases = {c.id for c in rows if checkpoints.is_base(c)}
    if cfg.prompts:
        prompts, source = list(cfg.prompts), "the job's prompts"
    elif cfg.dataset_id:
        prompts = [t for _, t in dataset_prompts(cfg.dataset_id, cfg.split, None)]
        source = f"dataset {cfg.dataset_id} ({cfg.split} split)"
    else:
        prompts, source = all_prompts(), "the shapes prompts"
    prompts = prompts[:cfg.max_prompts] if cfg.max_prompts else prompts
    if not prompts:
        raise JobError(f"no prompts to evaluate in {source}")
    # what the stored scores were measured on, so two evaluations can be told apart
    about = {"job_id": job_id, "prompts": f"{len(prompts)} of {source}",
             "seeds": len(cfg.seeds)}
    names = reward_names("evaluate", cfg)
    cancel = CancelCheck(job_id, worker_name)
    # 'preference' is the fitted model's score here, not the registry's or a server's
    scored = [n for n in names if n != "preference"]
    scorer = (prepare_rewards(scored, cfg.reward_model_paths, cfg.reward_server_url,
                              cancel.requested) if scored else None)
    preference = (EvaluationPreference.load(cfg, history.values())
                  if "preference" in names else None)
    # every checkpoint's model directory checked before the first loads
    specs = {ckpt_id: sampling_spec(cfg, ckpt_id) for ckpt_id, _ in ckpts}
    like_for_like(cfg, specs, bases)
    pairs = [(p, seed) for p in prompts for seed in cfg.seeds]
    summary: dict[str, Any] = {}
    for row in history.values():
        summary.update({k: v for k, v in row.items() if k.startswith("checkpoint/")})
    if preference is not None:  # the job's results name the model that gave 'preference'
        summary["preference_model"] = preference.label
    total = len(ckpts) * len(pairs)  # progress counts images: a checkpoint's can take minutes
    done = len(history) * len(pairs)
    try:
        _progress(job_id, worker_name, done, total)
        for index, (ckpt_id, ckpt_iteration) in enumerate(ckpts, start=1):
            if index in history:  # done before a crash
                continue
            # the last checkpoint's model goes first: two FLUX transformers (48 GB in bf16)
            # were on the card while the next loaded
            model = None
            release_device_memory()
            model = load_flow_model(specs[ckpt_id], device=resolve_device("auto"))
            before = done
            images = sample_images(model, [p for p, _ in pairs], [s for _, s in pairs],
                                   cfg.solver, cfg.steps,
                                   batch_size=cfg.batch_size or SHAPES_SAMPLE_BATCH,
                                   before_step=cancel,
                                   on_batch=throttled(lambda n, before=before: _progress(
                                       job_id, worker_name, before + n, total)))
            texts = [p for p, _ in pairs]
            scores = dict(score(scorer, scored, images, texts, cancel)) if scorer else {}
            if preference is not None:
                scores["preference"] = preference.scores(images, texts)
            with session_scope() as s:
                require_lease(s, job_id, worker_name)
                for j, (text, seed) in enumerate(pairs):
                    rollouts.record_rollout_group(
                        s, job_id=job_id, iteration=ckpt_iteration, prompt_text=text,
                        checkpoint_id=ckpt_id, solver=cfg.solver, steps=cfg.steps,
                        sigma=0.0, seed=int(seed), purpose="evaluate",
                        samples=[{"png": png_bytes(images[j]), "member_index": 0,
                                  "rewards": {n: float(scores[n][j]) for n in names},
                                  "advantage": None}])
                # in the images' transaction: the scores are stored exactly when they are
                checkpoints.record_scores(s, ckpt_id, json_safe({
                    n: {"mean": float(scores[n].mean()), "std": float(scores[n].std()),
                        "n": len(pairs),
                        **({"preference_model": preference.label}
                           if n == "preference" and preference else {})} for n in names}),
                    **about)
            row = {f"checkpoint/{ckpt_id}/{n}": float(scores[n].mean()) for n in names}
            summary.update(row)
            done += len(pairs)
            # the version scored with travels in the history: a resumed job keeps it
            _progress(job_id, worker_name, done, total,
                      json_safe({"checkpoint_id": ckpt_id, **row,
                                 **({"preference_model": preference.label}
                                    if preference else {})}), history_at=index)
    except Cancelled:
        return JobStatus.CANCELLED
    with session_scope() as s:
        return jobs.mark_succeeded(s, job_id, metrics=json_safe(summary)).status
