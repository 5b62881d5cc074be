"""Jobs: validate and launch (API side), and the state transitions workers record.

Lifecycle: queued -> running -> succeeded | failed | cancelled; resume puts a failed or
cancelled job back to queued (and sends a queued job's message again). Cancel is
cooperative: `request_cancel` sets a flag that the worker reads (`is_cancel_requested`, or
the return value of `heartbeat`/`update_progress`) between iterations, then calls
`mark_cancelled`. A queued job is cancelled at once, and so is a running one whose worker is
lost (no heartbeat for JOB_STALE_SECONDS): no worker would read its flag.

Worker usage (each call in its own short transaction; worker/lease.py wraps it):

    from app.db import session_scope
    from app.services import jobs
    with session_scope() as s:
        job = jobs.claim(s, job_id, worker_name, stale_after)  # None: not this worker's
    ...
    with session_scope() as s:
        stop = jobs.update_progress(s, job_id, it, total, {"reward_mean": 0.4})

`claim` is an atomic compare-and-set that only one of several racing workers wins (two
workers on one queue, a redelivered message, a reaper); `holds` checks each iteration that
the job is still theirs. `mark_running` is the plain transition, for a caller that knows no
one else holds the job (tests, scripts). `reap_stale` is the reaper's half: a running job
whose heartbeat is stale goes back to the queue (or to failed/cancelled).

`launch_job` is the one way a job starts (the API, the UI and the demo call it): validate,
write, commit, then enqueue through the enqueuer the application was built with
(`create_app(enqueuer=...)`, default `app.queue.enqueue`: a Celery message named after the
kind, to its queue); a message that cannot be sent removes the job and is Unavailable
(503). The kinds themselves are declared once, in `app.job_kinds`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import ValidationError
from sqlalchemy import delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.config import get_settings
from app.db import write_lock
from app.errors import Conflict, Invalid, NotFound, Unavailable
from app.job_kinds import KIND_NAMES, KINDS, default_reward_names
from app.json_values import lone_surrogate
from app.limits import EVALUATE_MAX_CHECKPOINTS, MAX_CONFIG_DEPTH, MAX_CONFIG_PROMPTS, MAX_ID
from app.models import (
    FINISHED_JOB_STATUSES,
    ROLES,
    Checkpoint,
    Dataset,
    Job,
    JobMetric,
    JobStatus,
    User,
    utcnow,
)
from app.queue import broker_unreachable
from app.schemas import validation_message
from app.services import auth, checkpoints, storage, workers
from app.services.datasets import nesting_depth, normalise, prompt_texts
from trainer.config import prompt_text_problem, resolution_problem
from trainer.shapes.world import shapes_prompt_problem

log = logging.getLogger(__name__)

# (job id, kind) -> sends the job to a worker; called after the commit
Enqueuer = Callable[[int, str], None]


Problems = list[tuple[str, str]]  # (field, message), every one found


def _train_config(config: dict[str, Any], preset: str | None, top: Problems,
                  problems: Problems) -> dict[str, Any]:
    """The train config `preset` and `config` make; a bad preset goes to `top` (a field of
    the request), the config's own problems to `problems`. Without a preset, a config that
    names flux or sd3 starts from that model's preset (`default_preset`: LoRA, its batch
    sizes), as the CLI's train does; shapes from the defaults."""
    from trainer.config import PRESETS, ConfigErrors, TrainConfig, default_preset

    base: dict[str, Any] = {}
    model = config.get("model")
    if not preset and isinstance(model, str) and default_preset(model) == f"{model}-lora":
        preset = default_preset(model)
    if preset:
        if preset not in PRESETS:
            top.append(("preset", f"unknown preset {preset!r}; one of {list(PRESETS)}"))
        else:
            base.update(PRESETS[preset])
    try:
        return TrainConfig.from_layers(base, config).to_dict()
    except ConfigErrors as exc:
        problems.extend((e.field, e.message) for e in exc.errors)
    return {**TrainConfig().to_dict(), **base, **config}  # the server's own checks still run


def _shallow_fields(config: dict[str, Any], problems: Problems) -> dict[str, Any]:
    """`config` without the fields whose values nest deeper than MAX_CONFIG_DEPTH, each named
    in `problems`: the checks after this one (a train config's copy, the path and name
    checks) recurse into values, and a value 500 levels deep overflowed Python's stack."""
    deep = [key for key, value in config.items()
            if nesting_depth(value, MAX_CONFIG_DEPTH) > MAX_CONFIG_DEPTH]
    problems.extend((key, f"nests more than {MAX_CONFIG_DEPTH} levels deep (a config field is a "
                          "value, a list or an object of values)") for key in deep)
    return {key: value for key, value in config.items() if key not in deep}


def _kind_config(kind: str, config: dict[str, Any], problems: Problems) -> dict[str, Any]:
    from trainer.config import unknown_field_message

    model = KINDS[kind].config
    assert model is not None, kind
    # a key that is not text (a lone surrogate escape, "\ud800") fails pydantic's check of
    # the whole object, naming no key: named here as the unknown field it is
    unreadable = [key for key in config if lone_surrogate(key) is not None]
    for key in unreadable:
        problems.append((key, unknown_field_message(key, list(model.model_fields))))
    config = {k: v for k, v in config.items() if k not in unreadable}
    try:
        return model.model_validate(config).model_dump()
    except ValidationError as exc:
        for err in exc.errors():
            name = ".".join(str(p) for p in err["loc"][:1]) or "config"
            where = ".".join(str(p) for p in err["loc"][1:])
            if err["type"] == "extra_forbidden" and not where:  # as a train config says it
                problems.append((name, unknown_field_message(name, list(model.model_fields))))
                continue
            problems.append((name, f"{where + ': ' if where else ''}{validation_message(err)}"))
    # the server's own checks still run on it, with the defaults of the fields left out (as
    # a train config's do): a fit_preference job's vote shortage (its min_votes' default) is
    # reported beside a bad epochs, not hidden by it
    defaults = {name: field.get_default(call_default_factory=True)
                for name, field in model.model_fields.items() if not field.is_required()}
    return {**defaults, **config}


def _check_paths_and_names(session: Session, kind: str, config: dict[str, Any],
                           problems: Problems) -> None:
    """What the worker would otherwise fail on: rewards it does not know, prompts longer than
    an upload may hold, paths outside the storage and models directories, missing rows, a
    device no live worker has. Fields already found malformed are not checked again."""
    from trainer.config import RUN_TIME_REWARDS
    from trainer.rewards import reward_names

    malformed = {field for field, _ in problems}
    model = config.get("model") if "model" not in malformed else None
    expected = {"prompts": list, "reward_names": list, "base_checkpoint": str,
                "features": str, "clip_path": str, "reward_weights": dict,
                "preference_model": str, "dataset_id": int, "checkpoint_id": int,
                "checkpoint_ids": list, "device": str, "reward_model_paths": dict}
    out = {k: v for k, v in config.items()
           if k in expected and k not in malformed and isinstance(v, expected[k])
           and not isinstance(v, bool)}
    if "checkpoint_ids" in out and not all(isinstance(c, int) for c in out["checkpoint_ids"]):
        del out["checkpoint_ids"]

    limit = get_settings().max_prompt_length
    given = config.get("prompts")  # the limit holds beside any other problem with them
    if isinstance(given, list) and len(given) > MAX_CONFIG_PROMPTS and "prompts" not in malformed:
        problems.append(("prompts", f"at most {MAX_CONFIG_PROMPTS} prompts in a config, got "
                                    f"{len(given)}; upload more as a dataset (dataset_id)"))
    # numbered from 1, as an upload's items and lines are (the field stays `prompts`)
    for number, prompt in enumerate(given if isinstance(given, list) else [], 1):
        if isinstance(prompt, str) and len(prompt) > limit:
            problems.append(("prompts", f"prompt {number} has {len(prompt)} characters; the "
                                        f"limit is {limit} (MAX_PROMPT_LENGTH)"))
    for number, prompt in enumerate(out.get("prompts") or [], 1):
        if isinstance(prompt, str) and (problem := prompt_text_problem(prompt)) is not None:
            problems.append(("prompts", f"prompt {number}: {problem}"))
    # the prompts as given, even beside another problem with them (a NUL in one, a value
    # that is no text): a repeat is named in the same 422
    if _takes_field(kind, "prompts") and isinstance(given, list) \
            and (problem := repeated_prompts_problem(given)) is not None:
        problems.append(("prompts", problem))
    # 'preference' is left out of the registry's names: a process that trained with a
    # preference model has it registered (the embedded worker's), and a rollout job then took
    # it. An evaluate job scores it with a fitted model (preference_model), checked once its
    # checkpoints' model is known (_check_model)
    known = [n for n in reward_names() if n not in RUN_TIME_REWARDS]
    for name in out.get("reward_names") or []:
        if name in RUN_TIME_REWARDS and kind != "evaluate":
            problems.append(("reward_names", f"{name!r} is a fitted preference model's score: "
                             "a train job blends it in (reward_weights) and an evaluate job "
                             f"scores it; a {kind} job does not"))
        elif name not in known and name not in RUN_TIME_REWARDS:
            problems.append(("reward_names",
                             f"unknown reward {name!r}; known: {', '.join(known)}"))
    names = [n for n in out.get("reward_names") or [] if isinstance(n, str)]
    if repeated := sorted({n for n in names if names.count(n) > 1}):
        problems.append(("reward_names", f"must not repeat a reward: {repeated}"))
    if kind in ("rollout", "evaluate") and isinstance(model, str) and names:
        from trainer.rewards import shapes_only_problem

        # beside the names' other problems (checked in _check_model, it marked the field
        # malformed and an unknown or repeated name went unsaid)
        if (problem := shapes_only_problem(list(dict.fromkeys(names)), model)) is not None:
            problems.append(("reward_names", problem))
    # with a reward server (any kind that scores) the server holds the weights: the worker
    # asks it at the job's start (it may be down now; submission does not call it)
    paths = out.get("reward_model_paths") or {}
    if not paths and isinstance(given_paths := config.get("reward_model_paths"), dict):
        from trainer.rewards.models import MODEL_REWARDS

        # TrainConfig marks the whole field malformed for one unknown key: the paths of the
        # rewards it does know are judged in the same answer (they were said only once the
        # unknown key was taken out)
        paths = {name: path for name, path in given_paths.items() if name in MODEL_REWARDS}
    if config.get("reward_server_url"):
        pass
    elif kind == "train":
        problems.extend(reward_model_problems(out.get("reward_weights") or {}, paths))
    else:
        # an evaluate job may place a model-backed reward's weights (reward_model_paths),
        # of the rewards it scores (a path for another one would never be read, as a train
        # config's check says too)
        from trainer.rewards.models import MODEL_REWARDS

        problems.extend(reward_model_path_key_problems(paths))
        if "reward_names" not in malformed and kind in ("rollout", "evaluate"):
            scored = names or default_reward_names(kind, model if isinstance(model, str)
                                                   else "shapes")
            problems.extend(("reward_model_paths", f"{name!r} is not among the rewards the "
                             f"job scores ({', '.join(scored)}): its weights would never "
                             "load; add it to reward_names or take its path out")
                            for name in paths if name in MODEL_REWARDS and name not in scored)
        problems.extend((field if field == "reward_model_paths" else "reward_names", message)
                        for field, message in reward_model_problems(
                            dict.fromkeys(out.get("reward_names") or []), paths))
    if out.get("base_checkpoint"):
        from trainer.models import ModelSpec, base_checkpoint_problem, uses_model_directory

        model = config.get("model") if isinstance(config.get("model"), str) else "shapes"
        # flux / sd3 start from a checkpoint directory of an earlier run, shapes from a file
        want = "dir" if uses_model_directory(model) else "file"
        try:
            path = storage.job_path(out["base_checkpoint"], want=want)
        except ValueError as exc:
            problems.append(("base_checkpoint", str(exc)))
        else:
            # the LoRA (or full) weights must fit a train run's adapters: the loader would
            # refuse them after the job had taken a worker
            fits_run = kind == "train" and not malformed & {
                "model", "finetune", "lora_rank", "lora_target_modules"}
            spec = ModelSpec.from_config(config) if fits_run else ModelSpec(name=model)
            if (problem := base_checkpoint_problem(spec, path, fits_run=fits_run)) is not None:
                problems.append(("base_checkpoint", problem))
    if out.get("features") == "clip" and not out.get("clip_path", "").strip():
        problems.append(("clip_path", "features 'clip' needs the local path of CLIP weights "
                                      "(a transformers save_pretrained directory) under "
                                      "STORAGE_DIR or MODELS_DIR"))
    elif out.get("clip_path", "").strip():
        from trainer.rewards.preference import clip_dir_problem

        try:
            clip_dir = storage.job_path(out["clip_path"], want="dir")
        except ValueError as exc:
            problems.append(("clip_path", str(exc)))
        else:
            if (problem := clip_dir_problem(clip_dir)) is not None:
                problems.append(("clip_path", problem))
    if kind == "train" and any(n in RUN_TIME_REWARDS for n in out.get("reward_weights", {})):
        problem = preference_problem(session, out.get("preference_model", ""),
                                     model if isinstance(model, str) else "shapes")
        if problem:
            problems.append(("preference_model", problem))
    elif kind == "train" and str(out.get("preference_model", "")).strip():
        # the worker would ignore it: say so rather than store a model (or any server path)
        # that the run never reads
        problem = preference_problem(session, out["preference_model"])
        from trainer.config import PREFERENCE_WITHOUT_WEIGHT

        problems.append(("preference_model", PREFERENCE_WITHOUT_WEIGHT
                         + (f"; also: {problem}" if problem else "")))
    refit_every = config.get("preference_refit_every")
    blends_preference = any(n in RUN_TIME_REWARDS for n in out.get("reward_weights", {}))
    if kind == "train" and type(refit_every) is int and refit_every > 0 \
            and not malformed & {"reward_weights", "preference_refit_every"} \
            and not blends_preference:
        # a refit of a model the run does not blend in would spend the worker for nothing
        problems.append(("preference_refit_every", "refits the preference model, but "
                         "reward_weights has no 'preference' weight to blend it with: add one "
                         "(e.g. \"preference\": 1) or set it to 0"))
    ds_id = out.get("dataset_id")
    if ds_id is not None and session.get(Dataset, ds_id) is None:
        problems.append(("dataset_id", f"dataset {ds_id} not found"))
    elif ds_id is not None and not out.get("prompts") and "split" not in malformed:
        # the worker samples this split (a malformed one has its own error already)
        split = config.get("split") if isinstance(config.get("split"), str) else "all"
        texts = prompt_texts(session, ds_id, split)
        if not texts:
            problems.append(("split", f"dataset {ds_id} has no {split!r} prompts; choose "
                                      "another split or 'all'"))
        elif problem := _drawable_problem(model, texts, f"dataset {ds_id} ({split!r} prompts)"):
            problems.append(("dataset_id", problem))
    # a train job's own prompts are TrainConfig's to check. The prompts as given, even when
    # another check refused them (a repeated one): what the model cannot draw comes in the
    # same 422. A prompt that is no text (NUL, ...) has its own error; it is left out here,
    # as are the prompts of a kind that takes none (an unknown field, said already).
    if kind != "train" and _takes_field(kind, "prompts") and isinstance(given, list) \
            and all(isinstance(p, str) for p in given) and (problem := _drawable_problem(model, [
                p for p in given if prompt_text_problem(p) is None])):
        problems.append(("prompts", problem))
    if out.get("checkpoint_id") is not None:
        if (ckpt := session.get(Checkpoint, out["checkpoint_id"])) is None:
            problems.append(("checkpoint_id", f"checkpoint {out['checkpoint_id']} not found"))
        elif (problem := checkpoints.files_problem(ckpt)) is not None:
            problems.append(("checkpoint_id", problem))
    # the well-formed ids of a list with a bad one among them are still looked up: every
    # problem at once
    given_ids = config.get("checkpoint_ids")
    ids = [c for c in given_ids if isinstance(c, int) and not isinstance(c, bool)
           and 1 <= c <= MAX_ID] if isinstance(given_ids, list) else []
    if len(set(ids)) < len(ids):
        problems.append(("checkpoint_ids", "must not repeat a checkpoint"))
    found = {cid: session.get(Checkpoint, cid) for cid in dict.fromkeys(ids)}
    if missing := [cid for cid, ckpt in found.items() if ckpt is None]:
        problems.append(("checkpoint_ids", f"checkpoint(s) {missing} not found"))
    problems.extend(("checkpoint_ids", problem) for ckpt in found.values()
                    if ckpt is not None and (problem := checkpoints.files_problem(ckpt)))
    device = workers.device_problem(session, kind, out)
    if device:
        problems.append(("device", device))
    # the fields it reads (parallelism, prompts_per_iteration, train_nnodes) as validated
    if world := workers.world_problem(session, kind, {
            k: v for k, v in config.items() if k not in malformed}):
        problems.append(("prompts_per_iteration", world))


def resolved_reward_model_paths(paths: dict[str, Any]) -> tuple[dict[str, str], Problems]:
    """A config's `reward_model_paths` resolved by `storage.reward_model_dir` (inside
    REWARD_MODELS_DIR or MODELS_DIR), and a problem for each path outside them."""
    resolved, problems = {}, []
    for name, value in paths.items():
        if not isinstance(value, str):
            continue  # TrainConfig's own check reports it
        try:
            resolved[name] = str(storage.reward_model_dir(value))
        except ValueError as exc:
            problems.append(("reward_model_paths", f"{name!r}: {exc}"))
    return resolved, problems


def reward_model_path_key_problems(paths: dict[str, Any]) -> Problems:
    """A problem for each `reward_model_paths` key that names no model-backed reward (a train
    config's own check, TrainConfig, says the same for train jobs)."""
    from trainer.rewards.models import MODEL_REWARDS

    return [("reward_model_paths", f"{name!r} is not a model-backed reward; known: "
                                   f"{sorted(MODEL_REWARDS)}")
            for name in paths if name not in MODEL_REWARDS]


def reward_model_problems(rewards: dict[str, Any], paths: dict[str, Any]) -> Problems:
    """Why the model-backed rewards among `rewards` (a train config's reward_weights) would
    not load on a worker: a reward_model_paths entry outside REWARD_MODELS_DIR / MODELS_DIR,
    or a weights directory missing or incomplete (the message names the reward, the setting
    and the files expected; field reward_model_paths when the config gives the path, else
    reward_weights)."""
    from trainer.rewards.models import MODEL_REWARDS, weights_problem

    resolved, problems = resolved_reward_model_paths(paths)
    default_dir = get_settings().resolved_reward_models_dir
    for name in rewards:
        if name not in MODEL_REWARDS or (name in paths and name not in resolved):
            continue
        # the files only: the API's environment may lack a worker's packages (open_clip)
        problem = weights_problem(name, resolved, default_dir, check_packages=False)
        if problem is not None:
            problems.append(("reward_model_paths" if name in resolved else "reward_weights",
                             problem))
    return problems


def model_path_problem(model: str, value: str) -> str | None:
    """Why `value` cannot be the model directory of `model` (flux, sd3): outside MODELS_DIR,
    missing, or incomplete (every missing file named); None when it is complete."""
    from trainer.models import model_dir_problem

    try:
        path = storage.model_dir(value)
    except ValueError as exc:
        return str(exc)
    return model_dir_problem(model, path)


def model_directories() -> list[dict[str, Any]]:
    """The model directories under MODELS_DIR, for a job's `model_path` (GET /api/models and
    the launch form's picker): each subdirectory (one level, by name; hidden ones such as a
    `.cache` left out) as `path`, the value a job's model_path takes (relative to
    MODELS_DIR), `model`, the adapter its model_index.json's `_class_name` names (flux, sd3;
    None when none), and `problem`: None when a job of that model can load it, else what
    submission would say (`model_path_problem`: outside MODELS_DIR through a symlink,
    incomplete, damaged), or why no model can be told. No MODELS_DIR directory: none."""
    from trainer.models import directory_model

    root = get_settings().resolved_models_dir
    try:
        entries = sorted(root.iterdir(), key=lambda p: p.name)
    except OSError:  # no MODELS_DIR (the default DATA_DIR/models not made), not a directory
        return []
    out = []
    for entry in entries:
        try:
            if entry.name.startswith(".") or not entry.is_dir():
                continue
        except OSError:  # a link to nowhere readable
            continue
        try:
            full = storage.model_dir(entry.name)
        except ValueError as exc:  # a link leaving MODELS_DIR: refused as submission would
            out.append({"path": entry.name, "model": None, "problem": str(exc)})
            continue
        model, problem = directory_model(full)
        if model is not None:
            problem = model_path_problem(model, entry.name)
        out.append({"path": entry.name, "model": model, "problem": problem})
    return out


def _checkpoint_specs(session: Session, ids: list[Any]) -> dict[int, Any]:
    """The model specs of the recorded checkpoints `ids` whose files can be read (a missing
    or unreadable file is the worker's to report, as before)."""
    from trainer.models import checkpoint_spec

    specs = {}
    for cid in dict.fromkeys(i for i in ids if isinstance(i, int) and not isinstance(i, bool)):
        ckpt = session.get(Checkpoint, cid) if 1 <= cid <= MAX_ID else None
        if ckpt is None:
            continue
        if checkpoints.is_base(ckpt):
            specs[cid] = checkpoints.base_spec(ckpt)
            continue
        try:
            specs[cid] = checkpoint_spec(storage.resolve(ckpt.path))
        except (NotFound, OSError, ValueError):
            continue
    return specs


def evaluate_base(session: Session, config: dict[str, Any]) -> tuple[str, str] | str:
    """The base model an evaluate config's checkpoints share, as (model, model directory
    relative to MODELS_DIR, "" for shapes), for `include_base`; or why there is none (they
    were fine-tuned from different model directories, or a directory is not usable)."""
    model = config.get("model") or "shapes"
    if model == "shapes":  # one base, shipped: no checkpoint file needs reading
        return model, ""
    specs = _checkpoint_specs(session, config.get("checkpoint_ids") or [])
    given = config.get("model_path") or ""
    dirs: dict[str, list[int]] = {}
    for cid, spec in specs.items():
        try:
            rel = storage.model_dir(given or spec.path).relative_to(
                get_settings().resolved_models_dir.resolve()).as_posix()
        except ValueError:
            return (f"checkpoint {cid}'s model directory {spec.path!r} is not under "
                    "MODELS_DIR; give model_path")
        dirs.setdefault(rel, []).append(cid)
    if len(dirs) != 1:
        listed = "; ".join(f"{d!r}: checkpoint(s) {ids}" for d, ids in sorted(dirs.items()))
        return ("the checkpoints were fine-tuned from different model directories ("
                f"{listed}): evaluate one base's checkpoints, or give model_path")
    return model, next(iter(dirs))


def _check_resolution_limit(model: str, model_path: str, resolution: Any,
                            problems: Problems) -> None:
    """The resolution a complete model directory can draw (an SD3 transformer's position
    embedding has a largest size: trainer.models.resolution_limit_problem)."""
    from trainer.models import resolution_limit_problem

    if not isinstance(resolution, int) or "resolution" in {f for f, _ in problems}:
        return
    problem = resolution_limit_problem(model, storage.model_dir(model_path), resolution)
    if problem is not None:
        problems.append(("resolution", problem))


def _check_model(session: Session, kind: str, config: dict[str, Any], problems: Problems
                 ) -> None:
    """The model a job loads, checked before a worker tries: a flux / sd3 train job's
    model_path must be a complete diffusers directory under MODELS_DIR. A rollout or evaluate
    job samples its checkpoints' model (filled in when not given; another model is refused),
    or for a base-model rollout the model it names, whose directory must then be given; its
    resolution must suit the model; its rewards default by model (`default_reward_names`)."""
    from trainer.models import uses_model_directory

    malformed = {field for field, _ in problems}
    model_path = config.get("model_path")
    model_path = model_path if isinstance(model_path, str) and "model_path" not in malformed \
        else None
    if kind == "train":
        model = config.get("model")
        problem = (model_path_problem(model, model_path)
                   if isinstance(model, str) and "model" not in malformed and model_path
                   and uses_model_directory(model) else None)
        if problem is not None:
            problems.append(("model_path", problem))
        elif (model_path and uses_model_directory(model) and config.get("finetune") == "lora"
              and not malformed & {"finetune", "lora_target_modules"}):
            from trainer.models import lora_targets_problem

            # peft would refuse targets that name no layer once the model had loaded (the
            # directory is complete here: model_path_problem said so)
            targets = lora_targets_problem(storage.model_dir(model_path),
                                           list(config.get("lora_target_modules") or []))
            if targets is not None:
                problems.append(("lora_target_modules", targets))
        if problem is None and model_path and isinstance(model, str):
            _check_resolution_limit(model, model_path, config.get("resolution"), problems)
        return
    if kind not in ("rollout", "evaluate") or "model" in malformed:
        return
    from app.job_kinds import default_reward_names

    if kind == "rollout":
        ids = [config["checkpoint_id"]] if config.get("checkpoint_id") is not None else []
        field = "checkpoint_id"
    else:
        ids = config.get("checkpoint_ids") if isinstance(config.get("checkpoint_ids"), list) \
            else []
        field = "checkpoint_ids"
    specs = _checkpoint_specs(session, ids) if field not in malformed else {}
    found = sorted({spec.name for spec in specs.values()})
    model = config.get("model")
    if model is None:
        if len(found) > 1:
            problems.append((field, f"the checkpoints are of different models ({found}); "
                                    "compare checkpoints of one model"))
        model = found[0] if found else "shapes"
        config["model"] = model
    elif not isinstance(model, str):
        return
    else:
        other = {cid: spec.name for cid, spec in specs.items() if spec.name != model}
        if other:
            problems.append(("model", f"checkpoint(s) {sorted(other)} are of model "
                                      f"{sorted(set(other.values()))[0]!r}, not {model!r}; "
                                      "leave model empty to sample the checkpoints' own"))
    if model_path is not None:
        if uses_model_directory(model):
            if model_path:
                if (problem := model_path_problem(model, model_path)) is not None:
                    problems.append(("model_path", problem))
                else:
                    _check_resolution_limit(model, model_path, config.get("resolution"), problems)
            elif not ids:
                problems.append(("model_path", f"sampling the base {model!r} model needs "
                                               "model_path, its diffusers-format directory "
                                               "under MODELS_DIR"))
            else:
                for cid, spec in specs.items():
                    if spec.name != model:  # refused above
                        continue
                    if (problem := model_path_problem(model, spec.path)) is not None:
                        problems.append(("model_path", f"checkpoint {cid} was trained from a "
                                         f"model directory no longer usable: {problem}; give "
                                         "model_path, a directory under MODELS_DIR"))
                        break
                    # the checkpoint's own resolution unless the job names one
                    asked = config.get("resolution") or spec.resolution
                    _check_resolution_limit(model, spec.path, asked, problems)
        elif model_path:
            problems.append(("model_path", f"must be empty for model {model!r} (it has no "
                                           "model directory)"))
    resolution = config.get("resolution")
    if isinstance(resolution, int) and "resolution" not in malformed and (
            problem := resolution_problem(model, resolution)) is not None:
        problems.append(("resolution", problem))
    if model == "shapes" and config.get("guidance_scale") is not None \
            and "guidance_scale" not in malformed:
        problems.append(("guidance_scale", "applies only to flux and sd3; the shapes model "
                                           "has no guidance, and sampling would ignore it: "
                                           "leave it empty"))
    if config.get("reward_names") == [] and "reward_names" not in malformed:
        config["reward_names"] = default_reward_names(kind, model)
    if (config.get("batch_size") == 0 and "batch_size" not in malformed
            and uses_model_directory(model)):
        # 0 is "all at once": the shapes model's 32 px canvases fit, but 256 evaluate images
        # (or 16 prompts x G) of a real model at 512 px would not fit one card's memory
        config["batch_size"] = real_model_sampling_batch(session, model, list(specs))
    if kind == "evaluate":
        _check_evaluate_preference(session, config, model, problems)
        if config.get("include_base") is True and not malformed & {
                "checkpoint_ids", "model_path", "include_base"}:
            if isinstance(base := evaluate_base(session, config), str):
                problems.append(("include_base", base))
            elif len(config.get("checkpoint_ids") or []) >= EVALUATE_MAX_CHECKPOINTS:
                problems.append(("include_base", f"the base joins checkpoint_ids, which "
                                 f"hold at most {EVALUATE_MAX_CHECKPOINTS}: name one fewer"))


def _check_evaluate_preference(session: Session, config: dict[str, Any], model: str,
                               problems: Problems) -> None:
    """An evaluate job's 'preference' reward needs a preference model that can score its
    checkpoints' `model` (preference_problem, the rule of train jobs); a preference_model
    named without it would be read by nothing, and a reward server does not score it."""
    malformed = {field for field, _ in problems}
    names = config.get("reward_names")
    spec = config.get("preference_model", "")
    if not isinstance(names, list) or "reward_names" in malformed \
            or not isinstance(spec, str) or "preference_model" in malformed:
        return
    if "preference" in names:
        if (problem := preference_problem(session, spec, model, "reward_names")) is not None:
            problems.append(("preference_model", problem))
    elif spec.strip():
        problems.append(("preference_model", "names a preference model, but reward_names has "
                         "no 'preference' for it to score: add it, or leave preference_model "
                         "empty"))


def _run_rollout_batch_size(session: Session, checkpoint_id: int) -> int:
    """The rollout_batch_size of the run that wrote a checkpoint: its train job's config (as
    send_to_arena reads it), else the run config the checkpoint's trainer state carries (a
    checkpoint recorded without a job); 0 when neither says."""
    from trainer.models import config_rollout_batch_size, run_rollout_batch_size

    ckpt = session.get(Checkpoint, checkpoint_id)
    if ckpt is None or checkpoints.is_base(ckpt):  # a base model ran no rollouts
        return 0
    job = session.get(Job, ckpt.job_id) if ckpt.job_id is not None else None
    if job is None:
        try:
            return run_rollout_batch_size(storage.resolve(ckpt.path))
        except NotFound:  # its files are gone: submission says so beside this
            return 0
    return config_rollout_batch_size(job.config or {})


def real_model_sampling_batch(session: Session, model: str, checkpoint_ids: list[int]) -> int:
    """The batch size of a flux / sd3 rollout or evaluate job whose config gives 0: the
    trainer's rule (trainer.config.default_sampling_batch) over its checkpoints' runs."""
    from trainer.config import default_sampling_batch

    return default_sampling_batch(
        model, [_run_rollout_batch_size(session, cid) for cid in checkpoint_ids],
        uses_directory=True)


def preference_problem(session: Session, spec: str, model: str = "shapes",
                       named_in: str = "reward_weights") -> str | None:
    """Why the preference model a train config names cannot be loaded, or cannot score the
    run's `model` (a shapes-features model reads the shapes world alone), or None."""
    from app.services import preference as pref_svc
    from trainer.models import weights_problem
    from trainer.rewards.preference import (
        model_features_problem,
        model_file_problem,
        saved_features,
    )

    parsed = pref_svc.parse_spec(spec)
    if parsed.kind == "latest":
        row = pref_svc.latest_model(session)
        if row is None:
            return (f"{named_in} has 'preference' but no preference model has been fitted "
                    "yet: run a fit_preference job first")
        name = f"preference model v{row.version}"
    elif parsed.kind == "version":
        try:
            row = pref_svc.get_model(session, parsed.version)
        except NotFound:
            return f"preference model version {spec.strip()!r} not found"
        name = f"preference model v{row.version}"
    else:
        row, name = None, "the preference model"
    try:
        path = storage.job_path(row.path if row is not None else parsed.path)
    except ValueError as exc:
        return (f"{name}'s file is gone: {exc}" if row is not None
                else f"must be '', 'latest', 'vN' or a path: {exc}")
    if (problem := weights_problem("preference", path, weight_format="preference-model")):
        return f"{name}: {problem}"
    try:
        features = saved_features(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # a header without fit settings
        return f"{name}: {path} holds no readable fit settings ({exc!r})"
    if (problem := model_file_problem(path)) is not None:  # damaged inside (the weights)
        return f"{name}: {problem}"
    if (problem := model_features_problem(features, model)) is not None:
        return f"{name} {problem}"
    return None


def _training_dataset_problems(session: Session, dataset_id: int, config: dict[str, Any],
                               problems: Problems) -> Problems:
    """A train job's dataset gives its prompts (its train split; the worker reads them when
    the job starts): it must have some, the config must not give prompts of its own, and the
    shapes model must be able to draw them."""
    out: Problems = []
    if (problem := prompts_beside_dataset_problem("train", config.get("prompts"))) is not None:
        out.append(("dataset_id", problem))
        return out
    texts = prompt_texts(session, dataset_id, "train")
    if not texts:
        out.append(("dataset_id", f"dataset {dataset_id} has no 'train' prompts to train on "
                                  "(upload it with a smaller eval_fraction)"))
    elif problem := _drawable_problem(config.get("model"), texts, f"dataset {dataset_id}"):
        out.append(("dataset_id", problem))
    return out


def _takes_field(kind: str, name: str) -> bool:
    """Whether a `kind` job's config has the field `name` (a train job's: TrainConfig's)."""
    from trainer.config import TrainConfig

    model = KINDS[kind].config
    return name in (TrainConfig.__dataclass_fields__ if model is None else model.model_fields)


def normalise_config_prompts(config: dict[str, Any]) -> None:
    """A config's `prompts` normalised in place as an upload's are (datasets.normalise: runs
    of whitespace collapsed, the ends stripped), so a config and a dataset give a worker the
    same text for the same prompt, and a repeat is found the way an upload drops one. What
    is not a string is left for the config's own type check to name."""
    prompts = config.get("prompts")
    if isinstance(prompts, list):
        config["prompts"] = [normalise(p) if isinstance(p, str) else p for p in prompts]


def _position_list(numbers: list[int]) -> str:
    return f"{', '.join(map(str, numbers[:-1]))} and {numbers[-1]}"


def repeated_prompts_problem(prompts: list[Any]) -> str | None:
    """The rule for every kind that takes `prompts`: no prompt twice (after normalising, as
    an upload drops a repeat; `prompts` are normalised already). A repeated prompt is trained
    on twice as often, or, evaluated, counted twice in the reward means stored on the
    checkpoints. Each repeat is named with its positions, numbered from 1; a prompt that is
    no text, or blank, has its own error and is left out here."""
    positions: dict[str, list[int]] = {}
    for number, prompt in enumerate(prompts, 1):
        if isinstance(prompt, str) and prompt_text_problem(prompt) is None:
            positions.setdefault(prompt, []).append(number)
    repeats = [(text, numbers) for text, numbers in positions.items() if len(numbers) > 1]
    if not repeats:
        return None
    shown = 5  # as the text problems are cut: a message, not a copy of the config
    said = "; ".join(f"{text[:80]!r}{'...' if len(text) > 80 else ''} (prompts "
                     f"{_position_list(numbers)})" for text, numbers in repeats[:shown])
    more = f"; and {len(repeats) - shown} more" if len(repeats) > shown else ""
    return f"must not repeat a prompt: {said}{more}"


# what a kind does with its prompts, for the message that refuses two sources of them
_PROMPT_USE = {"train": ("training", "train on"), "evaluate": ("evaluation", "evaluate")}


def prompts_beside_dataset_problem(kind: str, prompts: Any) -> str | None:
    """The rule for every kind that takes both a dataset and `prompts`: not both. A dataset
    the job would not read still holds it against deletion while the job is queued, and
    which of the two the job samples is not for the reader of its config to guess."""
    if not (isinstance(prompts, list) and prompts):
        return None
    noun, verb = _PROMPT_USE.get(kind, (kind, f"run the {kind} job on"))
    return (f"a dataset and config.prompts both give {noun} prompts; leave config.prompts "
            f"empty to {verb} the dataset, or give no dataset")


def _drawable_problem(model: Any, texts: list[str], source: str = "") -> str | None:
    """What in `texts` the model cannot draw: the shapes model draws only its world's
    prompts (trainer.shapes.world), the real models any text. `source` prefixes the message."""
    if model != "shapes" or not texts or (problem := shapes_prompt_problem(texts)) is None:
        return None
    return f"{source}: {problem}" if source else problem


def _check_votes_to_fit(session: Session, config: dict[str, Any], problems: Problems) -> None:
    """A fit_preference job needs the votes its fit would refuse to start without (the
    worker checks the same rule, `preference.votes_short_of_a_fit`, when the job runs)."""
    from app.services import preference

    min_votes = config.get("min_votes")
    if "min_votes" in {f for f, _ in problems} or not isinstance(min_votes, int):
        return
    features = str(config.get("features", "shapes"))
    clean, unreadable = preference.readable_clean_vote_count(session, features)
    if needed := preference.votes_short_of_a_fit(clean, min_votes):
        problems.append(("min_votes", f"the studio has {clean} clean vote(s) (a, b or tie, not "
                                      "excluded)"
                         + (f" on images the {features!r} features read ({unreadable} more are "
                            "on other models' samples or prompts; features 'clip' reads any)"
                            if unreadable else "")
                         + f"; a fit needs at least {needed}: vote in the arena first"))


def validate_config(session: Session, kind: str, config: dict[str, Any] | None,
                    preset: str | None = None, *, dataset_id: int | None = None
                    ) -> dict[str, Any]:
    """The full validated config of a job (defaults filled in). Everything a worker would
    reject is rejected here, every problem at once: Invalid whose `errors` lists
    {field, message} for each (and `field` names the first). `dataset_id` is the request's
    own (beside the config: a train job's dataset), checked with the rest."""
    if kind not in KINDS:
        raise Invalid(f"kind must be one of {list(KIND_NAMES)}, got {kind!r}", field="kind")
    if config is not None and not isinstance(config, dict):
        raise Invalid("config: must be a JSON object", field="config")
    config = dict(config or {})
    # a request field the config names too (dataset_id, or a train config's unknown "preset"):
    # two values, so the config's problems name theirs config.<field> in errors[].field (the
    # request's keeps the bare name, the one the UI places errors by)
    collides = {f for f, v in (("preset", preset), ("dataset_id", dataset_id))
                if v is not None and f in config}
    kind_config = KINDS[kind].config
    top: Problems = []  # the request's own fields (preset, dataset_id): reported first
    if dataset_id is not None and kind_config is not None:
        given = config.get("dataset_id")
        if "dataset_id" not in kind_config.model_fields:
            # recorded on the job, it would hold the dataset against deletion for nothing
            top.append(("dataset_id", f"{kind} jobs take no dataset"))
            dataset_id = None
        elif given is not None and given != dataset_id:
            top.append(("dataset_id", f"dataset {dataset_id} differs from config.dataset_id "
                                      f"{given!r}: give the dataset once"))
            dataset_id = None
        elif given is None:
            # the request's dataset is the one the kind samples when its config names none
            config["dataset_id"] = dataset_id
    problems: Problems = []  # the config's
    config = _shallow_fields(config, problems)
    if _takes_field(kind, "prompts"):
        normalise_config_prompts(config)
    # text no database holds, in any field's value (prompts: their own rule says so)
    problems += [(key, f"holds a lone surrogate escape (U+{ord(half):04X}), which is not text")
                 for key, value in config.items()
                 if key != "prompts" and (half := lone_surrogate(value)) is not None]
    if kind_config is None:
        out = _train_config(config, preset, top, problems)
    else:
        if preset:
            top.append(("preset", f"presets exist only for train jobs, not {kind}"))
        out = _kind_config(kind, config, problems)
    # the request's dataset: a train job's, or another kind's when its config names none
    if dataset_id is not None and (kind == "train" or out.get("dataset_id") is None) and (
            not 1 <= dataset_id <= MAX_ID or session.get(Dataset, dataset_id) is None):
        top.append(("dataset_id", f"dataset {dataset_id} not found"))
    elif dataset_id is not None and kind == "train":
        top += _training_dataset_problems(session, dataset_id, out, problems)
    elif kind != "train" and _takes_field(kind, "dataset_id") and _takes_field(kind, "prompts"):
        ds_id = out.get("dataset_id")
        # as a train job's rule (_training_dataset_problems): a dataset that is missing or
        # malformed has its own error, said alone
        if isinstance(ds_id, int) and not isinstance(ds_id, bool) and 1 <= ds_id <= MAX_ID \
                and "dataset_id" not in {f for f, _ in problems} \
                and session.get(Dataset, ds_id) is not None \
                and (problem := prompts_beside_dataset_problem(kind, out.get("prompts"))):
            # the request's field when the request gave the dataset, else the config's
            (top if dataset_id is not None else problems).append(("dataset_id", problem))
    if kind == "train" and isinstance(out.get("model"), str):
        from trainer.config import missing_prompts_problem

        # flux, sd3: the shapes world's 48 prompts are not theirs
        if problem := missing_prompts_problem(out["model"], out.get("prompts") or [],
                                              dataset=dataset_id is not None, studio=True):
            problems.append(("prompts", problem))
    _check_model(session, kind, out, problems)
    if kind == "evaluate" and isinstance(out.get("model"), str) and not (
            {field for field, _ in problems} & {"model", "checkpoint_ids"}):
        from trainer.config import missing_prompts_problem

        # the model is known now (its checkpoints'; not when they are of mixed models): flux,
        # sd3 are not evaluated on the shapes world's 48 prompts, the worker's fallback
        if problem := missing_prompts_problem(out["model"], out.get("prompts") or [],
                                              dataset=out.get("dataset_id") is not None,
                                              studio=True, evaluate=True):
            problems.append(("prompts", problem))
    _check_paths_and_names(session, kind, out, problems)
    if kind == "fit_preference":
        _check_votes_to_fit(session, out, problems)
    if top or problems:
        errors = [{"field": f, "message": m} for f, m in top] + [
            {"field": f"config.{f}" if f in collides else f, "message": m} for f, m in problems]
        summary = "; ".join([*(f"{f}: {m}" for f, m in top),
                             *(f"config.{f}: {m}" for f, m in problems)])
        raise Invalid(summary, field=errors[0]["field"], errors=errors)
    return out


# the request's own fields beside its config, which validate_config checks with it
REQUEST_FIELDS = ("preset", "dataset_id")


def config_problems_beside(session: Session, user: User | None, body: Any
                           ) -> list[tuple[str, str]]:
    """The config's own problems in a POST /api/jobs whose envelope failed validation (an
    unknown top-level field, a bad preset type), so that its 422 lists every problem at once
    instead of the envelope's first. Only for a caller (`user`, None when the token is not
    valid) who may launch the kind, since the config's checks look at datasets and files, and
    only when the kind is usable; when the config is not an object (the envelope's problem),
    only the request's other fields (preset, dataset_id) are checked."""
    if not isinstance(body, dict) or body.get("kind") not in KINDS:
        return []
    kind = body["kind"]
    if user is None or user.role not in launch_roles(kind):
        return []
    config = body.get("config") if body.get("config") is not None else {}
    config_usable = isinstance(config, dict)
    preset = body.get("preset") if isinstance(body.get("preset"), str) else None
    dataset_id = body.get("dataset_id")
    # a dataset_id the envelope refused was given all the same: the config's "dataset_id:
    # Field required" (a sampling kind's, which would take the request's) would name the one
    # field twice, the second time wrongly
    refused_dataset = dataset_id is not None and "dataset_id" not in (
        config if config_usable else {})
    if isinstance(dataset_id, bool) or not isinstance(dataset_id, int) \
            or not 1 <= dataset_id <= MAX_ID:
        dataset_id = None  # the envelope's problem, already reported
    else:
        refused_dataset = False
    # a request field the envelope refused, which the config names too: the envelope's error
    # has the bare name, so the config's are config.<field> (as validate_config names them
    # beside a request field it takes)
    refused_beside = {f for f, v in (("preset", preset), ("dataset_id", dataset_id))
                      if v is None and body.get(f) is not None and config_usable and f in config}
    try:
        validate_config(session, kind, config if config_usable else {}, preset,
                        dataset_id=dataset_id)
    except Invalid as exc:
        return [(f"config.{e['field']}" if e["field"] in refused_beside else e["field"],
                 e["message"]) for e in exc.details.get("errors", [])
                if (config_usable or e["field"] in REQUEST_FIELDS)
                and not (refused_dataset and e["field"] == "dataset_id")]
    return []


# --- API side ------------------------------------------------------------------------------
def create_job(session: Session, kind: str, config: dict[str, Any] | None = None, *,
               preset: str | None = None, dataset_id: int | None = None,
               user: User | None = None) -> Job:
    """Validate and write a queued job (flush, no commit). Enqueue after the commit."""
    full = validate_config(session, kind, config, preset, dataset_id=dataset_id)
    # a sampling kind's config names its dataset, a train job's request does (TrainConfig has
    # no dataset_id); only a train config has iterations
    ds = full.get("dataset_id")
    ds = ds if ds is not None else dataset_id  # validate_config found it
    total = full.get("iterations")
    gone = Invalid(f"dataset_id: dataset {ds} not found (deleted while the job was submitted)",
                   field="dataset_id")
    # held until the commit (PostgreSQL), so a delete of the dataset (datasets.delete_dataset
    # locks its row first) waits and then sees this job, or finished first and is seen here
    if ds is not None and session.scalar(select(Dataset.id).where(Dataset.id == ds)
                                         .with_for_update(read=True)) is None:
        raise gone
    if kind == "evaluate" and full.get("include_base"):
        # the base's row (made the first time) goes first: the stored config is the job's
        # whole plan, and a resumed job finds it where it was
        model, model_path = evaluate_base(session, full)  # type: ignore[misc] - validated
        base = checkpoints.base_checkpoint(session, model, model_path).id
        full["checkpoint_ids"] = [base, *(c for c in full["checkpoint_ids"] if c != base)]
    job = Job(kind=kind, status=JobStatus.QUEUED, config=full, dataset_id=ds, submitted_dataset_id=ds,
              created_by_id=user.id if user else None, total_iterations=total)
    session.add(job)
    try:
        session.flush()
    except IntegrityError:  # SQLite: the dataset's delete committed between the check and here
        session.rollback()
        if ds is not None and session.get(Dataset, ds) is None:
            raise gone from None
        raise
    return job


def launch_roles(kind: str) -> tuple[str, ...]:
    """The roles that may launch `kind`: its launch_role and those above it (ROLES runs from
    most to least trusted, and a kind open to a role is open to those above)."""
    return tuple(ROLES[:ROLES.index(KINDS[kind].launch_role) + 1])


def shapes_dataset_id(session: Session) -> int | None:
    """The dataset holding the built-in prompts (SHAPES_DATASET), if the server has loaded it."""
    return session.scalar(select(Dataset.id).where(Dataset.name == SHAPES_DATASET)
                          .order_by(Dataset.id).limit(1))


def ensure_shapes_dataset(session: Session) -> int:
    """The built-in prompts' dataset (SHAPES_DATASET), loaded when it is not there: by
    `python -m app serve` at its start, and on demand where a deployment never ran it (the
    compose api runs `migrate` and uvicorn) or it was deleted."""
    from app.services.datasets import import_dataset
    from trainer.shapes.world import all_prompts

    if (ds_id := shapes_dataset_id(session)) is not None:
        return ds_id
    data = ("\n".join(all_prompts()) + "\n").encode()
    return import_dataset(session, filename="shapes.txt", data=data,
                          name=SHAPES_DATASET).dataset.id


def launch_job(session: Session, enqueuer: Enqueuer | None, kind: str,
               config: dict[str, Any] | None = None, *, preset: str | None = None,
               dataset_id: int | None = None, user: User | None = None) -> Job:
    """The one way a job starts: the caller's role checked against the kind's, the config
    validated completely, the queued row committed, then the job enqueued."""
    if user is not None and kind in KINDS:
        auth.require_role(user, *launch_roles(kind))
    job = create_job(session, kind, config, preset=preset, dataset_id=dataset_id, user=user)
    session.commit()
    try:
        _send(enqueuer, job)
    except Unavailable:
        # no message, so no worker will ever take it: the job goes, and the caller hears it
        session.delete(job)
        session.commit()
        raise
    return job


def _send(enqueuer: Enqueuer | None, job: Job) -> None:
    """Send the job's message, or Unavailable (503) naming why it could not be sent: a job
    left queued without one would wait for ever."""
    if enqueuer is None:
        raise Unavailable("this application has no job queue (no enqueuer): nothing was sent",
                          field="broker")
    try:
        enqueuer(job.id, job.kind)
    except Exception as exc:
        reason = broker_unreachable(exc)
        if reason is not None:  # an outage the 503 reports: one line, not a traceback a request
            log.warning("could not enqueue job %s: %s", job.id, reason)
        else:  # an enqueuer's own bug: its traceback is what finds it
            log.exception("could not enqueue job %s", job.id)
        reason = reason or (f"the job queue (BROKER_URL) cannot be reached: "
                            f"{type(exc).__name__}: {exc}")
        raise Unavailable(f"{reason}; try again when it is back", field="broker") from exc


# how many prompts, and at most how many members a group, "send newest rollouts to the arena"
# samples: enough pairs for a round of votes, small enough to finish in a minute on a CPU
ARENA_ROLLOUT_PROMPTS = 16
ARENA_ROLLOUT_MAX_GROUP = 16
SHAPES_DATASET = "shapes"  # the built-in prompts, loaded by `python -m app serve`


def _next_arena_seed(session: Session, checkpoint_id: int | None, dataset_id: int) -> int:
    """One past the largest seed of the rollout jobs already sampled from this checkpoint
    (None: the base model) on this dataset: each send draws new noises. With the same seed
    a second send sampled the very same images again, and the arena offered each pair
    twice."""
    seeds = [int((job.config or {}).get("seed", 0)) for job in session.scalars(
        select(Job).where(Job.kind == "rollout"))
        if (job.config or {}).get("checkpoint_id") == checkpoint_id
        and (job.config or {}).get("dataset_id") == dataset_id]
    return max(seeds) + 1 if seeds else 0


def send_to_arena(session: Session, enqueuer: Enqueuer | None, source_job_id: int,
                  user: User | None = None) -> tuple[Job, Checkpoint | None]:
    """Launch a rollout job from a train job's newest checkpoint (the base model before the
    first), on the job's dataset or else the built-in shapes prompts, with the job's group
    size, sigma and rollout batch size (and, for the base model, its model fields); its groups
    become pairs in the arena. Returns the job and the checkpoint."""
    src = get_job(session, source_job_id)
    if src.kind != "train":
        already = {"rollout": "its groups are in the arena already",
                   "evaluate": "its images are the arena's cross-checkpoint pairs already"}
        raise Invalid(f"job {src.id} is a {src.kind} job"
                      + (f" ({already[src.kind]})" if src.kind in already else "")
                      + ": only a train job's newest checkpoint is sampled for the arena",
                      field="job_id")
    ckpt = checkpoints.latest_checkpoint(session, src.id)
    ds_id, cfg = src.dataset_id, src.config or {}
    if ds_id is None and src.submitted_dataset_id is not None:
        raise Invalid(f"job {src.id}'s dataset {src.submitted_dataset_id} was deleted: upload "
                      "its prompts again and launch a rollout job on them", field="dataset_id")
    if ds_id is None and cfg.get("prompts"):
        # another dataset's prompts would put pairs of prompts it never trained on in the arena
        raise Invalid(f"job {src.id} trained on the {len(cfg['prompts'])} prompts of its "
                      "config, not on a dataset, and the arena samples a dataset: upload them "
                      "as one and launch a rollout job on it", field="dataset_id")
    if ds_id is None:  # trained on the built-in prompts: SHAPES_DATASET, loaded if need be
        # (it was "deleted: restart the server" where only `migrate` had run, as in compose)
        ds_id = ensure_shapes_dataset(session)
    from trainer.config import TrainConfig

    run = TrainConfig.from_stored(cfg)  # a train job's stored config holds every field
    ckpt_id = ckpt.id if ckpt else None
    config = {
        "dataset_id": ds_id, "checkpoint_id": ckpt_id,
        "seed": _next_arena_seed(session, ckpt_id, ds_id),
        "max_prompts": ARENA_ROLLOUT_PROMPTS,
        "group_size": max(2, min(run.group_size, ARENA_ROLLOUT_MAX_GROUP)),
        "sigma": run.sigma,
        "batch_size": run.rollout_batch_size,
    }
    if ckpt is None and run.model != "shapes":  # a checkpoint knows its own
        config.update({"model": run.model, "model_path": run.model_path,
                       "resolution": run.resolution, "guidance_scale": run.guidance_scale})
    job = launch_job(session, enqueuer, "rollout", config, user=user)
    return job, ckpt


def get_job(session: Session, job_id: int) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"job {job_id} not found")
    return job


def list_jobs(session: Session, *, status: str | None = None, kind: str | None = None,
              limit: int = 50, offset: int = 0) -> tuple[list[Job], int]:
    stmt = select(Job)
    if status:
        stmt = stmt.where(Job.status == status)
    if kind:
        stmt = stmt.where(Job.kind == kind)
    total = session.scalar(select(func.count()).select_from(stmt.subquery())) or 0
    rows = session.scalars(stmt.order_by(Job.id.desc()).limit(limit).offset(offset))
    return list(rows), total


def metric_history(session: Session, job_id: int) -> list[JobMetric]:
    return list(session.scalars(
        select(JobMetric).where(JobMetric.job_id == job_id).order_by(JobMetric.iteration)
    ))


def _locked_job(session: Session, job_id: int) -> Job:
    """The job's row as it is now, locked until the transaction ends (`write_lock`: the row
    on PostgreSQL, the database's write lock on SQLite, which has no row locks), so that a
    cancel, a requeue and a resume of one job take turns: each sees what the other wrote.
    Read unlocked, a cancel that landed while a worker requeued the job (or the reaper did)
    left it queued with its cancel flag set, which no worker would take, for ever; and six
    resumes sent at once all answered 200, the last to commit winning."""
    write_lock(session, Job, job_id)
    job = session.get(Job, job_id, populate_existing=True)
    if job is None:
        raise NotFound(f"job {job_id} not found")
    return job


def request_cancel(session: Session, job_id: int) -> Job:
    """Ask a job to stop. Queued: cancelled now. Running: flag for the worker; but one whose
    worker is lost (no heartbeat for JOB_STALE_SECONDS) is cancelled now,
    as the reaper would cancel it. Else Conflict."""
    job = _locked_job(session, job_id)
    if job.status in FINISHED_JOB_STATUSES:
        raise Conflict(f"job {job_id} has already finished ({job.status}): nothing to cancel",
                       field="job_id")
    job.cancel_requested = True
    if job.status == JobStatus.QUEUED:
        job.status = JobStatus.CANCELLED
        job.finished_at = utcnow()
    session.flush()
    age = workers.heartbeat_age(job)
    if job.status == JobStatus.RUNNING and age is not None \
            and age > get_settings().job_stale_seconds:  # lost, as waiting_for says
        # no worker would read the flag: the job stayed running until some worker's reaper
        # came round (never, with no worker live). The reaper's compare-and-set: a worker
        # that heartbeated since the read keeps the job, and reads the flag
        session.execute(update(Job).where(_still_as_read(job))
                        .values(status=JobStatus.CANCELLED, finished_at=utcnow())
                        .execution_options(synchronize_session=False))
        session.refresh(job)
    return job


def _still_as_read(job: Job) -> Any:
    """Where the job is still running on the heartbeat `job` holds: an update of a stale job
    that acts only if no worker heartbeated (or took the job) since it was read."""
    return ((Job.id == job.id) & (Job.status == JobStatus.RUNNING)
            & (Job.heartbeat_at.is_(None) if job.heartbeat_at is None
               else Job.heartbeat_at == job.heartbeat_at))


def check_still_valid(session: Session, job: Job) -> None:
    """Conflict, naming every problem, when the job's stored config no longer passes
    submission's checks (what it names may have been deleted since it was accepted)."""
    if job.dataset_id is None and job.submitted_dataset_id is not None:
        # the dataset's deletion set dataset_id null: the job would run on other prompts
        raise Conflict(f"job {job.id} can no longer run: its dataset {job.submitted_dataset_id} "
                       "was deleted; launch a new job on another dataset", field="dataset_id",
                       errors=[{"field": "dataset_id", "message": f"dataset "
                                f"{job.submitted_dataset_id} was deleted"}])
    try:
        validate_config(session, job.kind, job.config,
                        dataset_id=job.dataset_id if job.kind == "train" else None)
    except Invalid as exc:
        raise Conflict(f"job {job.id} can no longer run: {exc.message}",
                       field=exc.details.get("field", "config"),
                       errors=exc.details.get("errors", [])) from exc
    # a train job resumes from its newest recorded checkpoint: its files must still be there
    if job.kind == "train" and (newest := checkpoints.latest_checkpoint(session, job.id)) \
            is not None and (problem := checkpoints.files_problem(newest)) is not None:
        raise Conflict(f"job {job.id} cannot resume: {problem}", field="checkpoint_id",
                       errors=[{"field": "checkpoint_id", "message": problem}])


# what a resumed train job may change: how much of an iteration runs at once and where its
# rewards are computed, never what it computes (the micro-batches and the recomputed blocks
# give the same update; a reward server that moved, or reward models taken back from the
# training card onto a server, score with the same models). A job that ran out of memory
# (trainer.loop.TrainingOutOfMemory names these) goes on from its checkpoint with its
# optimizer state, as the CLI's `train --resume --set` does.
RESUME_FIELDS = ("train_batch_size", "rollout_batch_size", "gradient_checkpointing",
                 "gradient_checkpointing_fraction", "reward_server_url", "reward_model_paths")


def resumed_config(job: Job, changes: dict[str, Any],
                   session: Session | None = None) -> dict[str, Any]:
    """`job`'s config with `changes` (RESUME_FIELDS only, a train job only) applied and
    validated as at submission: Invalid naming every problem at once. With `session`, the
    changed fields' submission checks too (a reward_model_paths directory outside
    REWARD_MODELS_DIR was a 409 "can no longer run", said only once the other fields passed);
    the unchanged fields' are check_still_valid's (what has gone since is a 409)."""
    from trainer.config import ConfigErrors, TrainConfig

    if job.kind != "train":
        raise Invalid(f"config: a {job.kind} job resumes with its config as it is; only a "
                      f"train job's {', '.join(RESUME_FIELDS)} change on resume",
                      field="config")
    fields = TrainConfig.__dataclass_fields__
    can = f"these can change on resume: {', '.join(RESUME_FIELDS)}"
    errors = [{"field": f"config.{name}", "message": (
        "cannot change on resume (what the run computes stays as it started); " + can
        if name in fields else f"unknown field; {can}")}
        for name in changes if name not in RESUME_FIELDS]
    deep: Problems = []
    changes = _shallow_fields(changes, deep)
    errors += [{"field": f"config.{name}", "message": message} for name, message in deep]
    # the fields that may change are judged too, in the same answer: a bad value beside a
    # field that may not change was found only once that one was taken out
    allowed = {name: value for name, value in changes.items() if name in RESUME_FIELDS}
    try:
        config = TrainConfig.from_layers(dict(job.config), allowed).to_dict()
    except ConfigErrors as exc:
        errors += [{"field": f"config.{e.field}", "message": e.message} for e in exc.errors]
    if session is not None and allowed:
        # the changed fields' own rules are said above; their checks against the server
        # (directories, the reward server) from submission's validation of the whole config
        said = {e["field"] for e in errors}
        try:
            validate_config(session, "train", {**job.config, **allowed},
                            dataset_id=job.dataset_id)
        except Invalid as exc:
            for e in exc.details.get("errors") or []:
                name = str(e.get("field", "")).removeprefix("config.")
                if name in allowed and f"config.{name}" not in said:
                    errors.append({"field": f"config.{name}", "message": e["message"]})
    if errors:
        raise Invalid("; ".join(f"{e['field']}: {e['message']}" for e in errors),
                      field=errors[0]["field"], errors=errors)
    return config


def resume_job(session: Session, job_id: int, changes: dict[str, Any] | None = None) -> Job:
    """Put a failed or cancelled job back in the queue (the worker resumes from the newest
    checkpoint, `checkpoints.latest_checkpoint`). Enqueue after the commit. Its config is
    checked again as at submission: what it names (a dataset, a checkpoint, a file) may have
    gone since, and the worker would fail on it (Conflict naming every problem). `changes`:
    RESUME_FIELDS to set first (`resumed_config`)."""
    job = _locked_job(session, job_id)  # resumes sent at once take turns
    if job.status == JobStatus.QUEUED and not job.cancel_requested:
        raise Conflict(f"job {job_id} was resumed by another request meanwhile: it is queued",
                       field="job_id")
    if job.status not in (JobStatus.FAILED, JobStatus.CANCELLED):
        raise Conflict(f"job {job_id} cannot resume: its status is {job.status} (only failed, "
                       "cancelled or queued jobs resume)", field="job_id")
    if changes:
        job.config = resumed_config(job, changes, session)
    check_still_valid(session, job)
    job.status, job.cancel_requested, job.error, job.finished_at = (JobStatus.QUEUED, False,
                                                                     None, None)
    job.queued_at = utcnow()
    # a person's resume starts a new budget of JOB_MAX_ATTEMPTS runs lost to dead workers
    job.attempts = 0
    session.flush()
    return job


def relaunch_job(session: Session, enqueuer: Enqueuer | None, job_id: int,
                 changes: dict[str, Any] | None = None) -> Job:
    """The one way a stopped job starts again (the API's resume and the UI's): resume_job's
    checks, the queued row committed, then the job enqueued, as launch_job does. A job still
    queued gets its message sent again: one a broker lost, or a worker that could not run it
    took and dropped, leaves it waiting for ever, and a duplicate is harmless (a worker claims
    a job atomically and skips one that another holds or that has finished). When the broker
    cannot be reached the job is left as it was and the caller gets a 503."""
    job = get_job(session, job_id)
    if job.status == JobStatus.QUEUED and not job.cancel_requested:
        if changes:
            raise Conflict(f"job {job_id} is queued: its config changes on resume only once it "
                           "has stopped (cancel it first)", field="job_id")
        _send(enqueuer, job)
        return job
    before = {name: getattr(job, name) for name in
              ("status", "cancel_requested", "error", "finished_at", "attempts", "config")}
    job = resume_job(session, job_id, changes)
    session.commit()
    try:
        _send(enqueuer, job)
    except Unavailable:
        for name, value in before.items():
            setattr(job, name, value)
        session.commit()
        raise
    return job


# --- worker side ---------------------------------------------------------------------------
def mark_running(session: Session, job_id: int, worker_name: str) -> Job:
    """queued (or running, after a crash/requeue) -> running. Conflict if the job is finished
    or was cancelled: the worker should then do nothing."""
    job = get_job(session, job_id)
    if job.status in FINISHED_JOB_STATUSES:
        raise Conflict(f"job {job_id} is {job.status}; not starting it")
    now = utcnow()
    job.status, job.heartbeat_at = JobStatus.RUNNING, now
    job.worker = workers.stored_name(worker_name)
    job.started_at, job.claimed_at = job.started_at or now, now
    job.attempts += 1
    job.error = None
    session.flush()
    return job


def heartbeat(session: Session, job_id: int, worker_name: str | None = None) -> bool:
    """Touch the heartbeat; returns whether cancel was requested."""
    job = get_job(session, job_id)
    job.heartbeat_at = utcnow()
    if worker_name:
        job.worker = workers.stored_name(worker_name)
    session.flush()
    return job.cancel_requested


def update_progress(session: Session, job_id: int, iteration: int, total: int | None = None,
                    metrics: dict[str, Any] | None = None) -> bool:
    """Record an iteration: progress, latest metrics, one metric-history row per iteration
    (re-recording an iteration replaces it), heartbeat. Returns whether cancel was requested."""
    job = get_job(session, job_id)
    job.iteration = iteration
    if total is not None:
        job.total_iterations = total
    job.heartbeat_at = utcnow()
    if metrics is not None:
        metrics = dict(metrics)
        job.metrics = metrics
        row = session.scalar(
            select(JobMetric).where(JobMetric.job_id == job_id, JobMetric.iteration == iteration)
        )
        if row is None:
            session.add(JobMetric(job_id=job_id, iteration=iteration, metrics=metrics))
        else:
            row.metrics = metrics
    session.flush()
    return job.cancel_requested


def is_cancel_requested(session: Session, job_id: int) -> bool:
    return bool(session.scalar(select(Job.cancel_requested).where(Job.id == job_id)))


def _finish(session: Session, job_id: int, status: str, error: str | None = None) -> Job:
    job = get_job(session, job_id)
    job.status, job.finished_at, job.heartbeat_at = status, utcnow(), utcnow()
    if error is not None:
        job.error = error
    session.flush()
    return job


def mark_succeeded(session: Session, job_id: int, metrics: dict[str, Any] | None = None) -> Job:
    job = _finish(session, job_id, JobStatus.SUCCEEDED)
    job.error = None
    if metrics is not None:
        job.metrics = dict(metrics)
    return job


def mark_failed(session: Session, job_id: int, error: str) -> Job:
    return _finish(session, job_id, JobStatus.FAILED, error=error or "failed")


def mark_cancelled(session: Session, job_id: int) -> Job:
    return _finish(session, job_id, JobStatus.CANCELLED)


def requeue(session: Session, job_id: int, reason: str | None = None) -> Job:
    """running -> queued, by a worker that shuts down on purpose (SIGTERM: a checkpoint
    saved, the job handed back). That run did not lose its worker, so it gives back the
    attempt its claim counted: JOB_MAX_ATTEMPTS budgets runs lost to dead workers only."""
    job = _locked_job(session, job_id)
    if job.cancel_requested:  # asked while it was stopping: cancelled, not requeued
        return _finish(session, job_id, JobStatus.CANCELLED)
    job.status, job.worker, job.queued_at = JobStatus.QUEUED, None, utcnow()
    job.attempts = max(job.attempts - 1, 0)
    if reason:
        job.error = reason
    session.flush()
    return job


def lost_messages(session: Session, older_than: timedelta) -> list[tuple[int, str, str]]:
    """Queued jobs whose broker message is lost: queued for longer than `older_than` while a
    live worker that takes them has run nothing for as long (it would have taken the message
    had there been one: a Redis restart, which keeps nothing on disk, or a worker killed while
    it held it). Each is marked queued afresh (a compare-and-set, so concurrent reapers act
    once, and the next look is `older_than` later) for the caller to send its message again
    after the commit; a duplicate of a message that was not lost is dropped by the claim.
    Returns [(job_id, kind, the idle worker's name)]."""
    now = utcnow()
    cutoff = now - older_than
    queued = list(session.scalars(select(Job).where(
        Job.status == JobStatus.QUEUED,
        func.coalesce(Job.queued_at, Job.created_at) < cutoff).order_by(Job.id)))
    if not queued:
        return []
    live = workers.live(session)
    idle = workers.idle_seconds(session, live, now)
    out = []
    for job in queued:
        waited = [w.name for w in workers.able(session, job.kind, job.config or {}, live)
                  if idle.get(w.name, 0.0) > older_than.total_seconds()]
        if not waited:
            continue
        result = session.execute(
            update(Job).where(Job.id == job.id, Job.status == JobStatus.QUEUED,
                              Job.queued_at.is_(None) if job.queued_at is None
                              else Job.queued_at == job.queued_at)
            .values(queued_at=now).execution_options(synchronize_session=False))
        if result.rowcount == 1:
            out.append((job.id, job.kind, waited[0]))
    session.flush()
    return out


def leave_for_reaper(session: Session, job_id: int, worker_name: str) -> bool:
    """queued -> running under `worker_name` with no heartbeat, for a requeue whose message the
    broker could not take (a warm shutdown while Redis is away): a queued job with no message
    would wait for ever, while a running one without a heartbeat is stale at once, so a live
    worker's reaper requeues it and sends the message (again each round until the broker is
    back). A compare-and-set: False, and nothing changed, when the job is no longer queued
    (cancelled meanwhile, or a message did arrive and a worker took it)."""
    result = session.execute(
        update(Job).where(Job.id == job_id, Job.status == JobStatus.QUEUED)
        .values(status=JobStatus.RUNNING, worker=workers.stored_name(worker_name),
                heartbeat_at=None)
        .execution_options(synchronize_session=False))
    session.flush()
    return result.rowcount == 1


def stale_jobs(session: Session, older_than: timedelta) -> list[Job]:
    """Running jobs whose heartbeat is older than `older_than` (or missing)."""
    cutoff = datetime.now(UTC) - older_than
    return list(session.scalars(
        select(Job).where(Job.status == JobStatus.RUNNING)
        .where((Job.heartbeat_at.is_(None)) | (Job.heartbeat_at < cutoff))
    ))


def claim(session: Session, job_id: int, worker_name: str, stale_after: timedelta) -> Job | None:
    """Atomically take a job: queued -> running, or running with a heartbeat older than
    `stale_after` (its worker died) -> running for `worker_name`. Returns the job, or None
    when it is finished, cancelled, or held by a live worker (then do nothing)."""
    now = utcnow()
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.cancel_requested.is_(False))
        .where((Job.status == JobStatus.QUEUED) | (
            (Job.status == JobStatus.RUNNING)
            & (Job.heartbeat_at.is_(None) | (Job.heartbeat_at < now - stale_after))))
        # the reason it was requeued (a lost or stopped worker) was the queued job's; a
        # running job shows no error
        .values(status=JobStatus.RUNNING, worker=workers.stored_name(worker_name),
                heartbeat_at=now, started_at=func.coalesce(Job.started_at, now),
                claimed_at=now, attempts=Job.attempts + 1, error=None)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:
        # a queued job whose cancel was asked (one left so by an older version, or a race
        # this code closes) is cancelled by the message that would have run it
        session.execute(update(Job).where(
            Job.id == job_id, Job.status == JobStatus.QUEUED, Job.cancel_requested.is_(True))
            .values(status=JobStatus.CANCELLED, finished_at=now)
            .execution_options(synchronize_session=False))
        return None
    return session.get(Job, job_id, populate_existing=True)


def holds(session: Session, job_id: int, worker_name: str) -> bool:
    """Whether `worker_name` still runs this job (a reaper may have handed it to another)."""
    row = session.execute(select(Job.status, Job.worker).where(Job.id == job_id)).one_or_none()
    return (row is not None and row[0] == JobStatus.RUNNING
            and row[1] == workers.stored_name(worker_name))


def truncate_history(session: Session, job_id: int, iteration: int) -> None:
    """Forget metric rows after `iteration` (a resume redoes them) and set the progress."""
    session.execute(delete(JobMetric).where(JobMetric.job_id == job_id,
                                            JobMetric.iteration > iteration))
    job = get_job(session, job_id)
    job.iteration = iteration
    last = session.scalar(select(JobMetric.metrics).where(JobMetric.job_id == job_id)
                          .order_by(JobMetric.iteration.desc()).limit(1))
    job.metrics = last
    session.flush()


def reap_stale(session: Session, older_than: timedelta, max_attempts: int
               ) -> list[tuple[int, str, str]]:
    """Settle running jobs whose heartbeat is older than `older_than`: cancelled if a cancel was
    requested, failed (with the reason) after `max_attempts` runs, else back to queued for a
    resume. Each change is a compare-and-set, so concurrent reapers act once. Returns
    [(job_id, kind, new_status)]; the caller enqueues the `queued` ones after the commit."""
    out = []
    now = utcnow()
    for job in stale_jobs(session, older_than):
        seconds = workers.heartbeat_age(job, now)
        age = f"{seconds:.0f}s" if seconds is not None else "ever"
        lost = f"worker {job.worker or '?'} stopped heartbeating (none for {age})"
        if job.cancel_requested:
            values: dict[str, Any] = {"status": JobStatus.CANCELLED, "finished_at": now}
        elif job.attempts >= max_attempts:
            values = {"status": JobStatus.FAILED, "finished_at": now,
                      "error": f"{lost}; gave up after {job.attempts} attempt(s)"}
        else:
            values = {"status": JobStatus.QUEUED, "worker": None, "queued_at": now,
                      "error": f"{lost}; requeued to resume from the newest checkpoint "
                               f"(attempt {job.attempts + 1} of {max_attempts})"}
        stmt = update(Job).where(_still_as_read(job))
        if values["status"] != JobStatus.CANCELLED:
            # a cancel that lands after the read above wins: the next round cancels the job
            # (requeued with the flag set, no worker would ever take it)
            stmt = stmt.where(Job.cancel_requested.is_(False))
        result = session.execute(stmt.values(**values).execution_options(
            synchronize_session=False))
        if result.rowcount == 1:
            out.append((job.id, job.kind, values["status"]))
    session.flush()
    return out
