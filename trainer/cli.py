"""`python -m trainer ...`: train, sample, evaluate, train-base, demo, fit-preference."""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import math
import os
import re
import shutil
import signal
import socket
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from trainer.config import (
    PATH_FIELDS,
    PREFERENCE_WITHOUT_WEIGHT,
    PRESETS,
    REAL_MODEL_SAMPLE_BATCH,
    SHAPES_SAMPLE_BATCH,
    ConfigError,
    ConfigErrors,
    TrainConfig,
    absolute_paths,
    default_preset,
    default_sampling_batch,
    load_config,
    missing_prompts_problem,
    resolution_problem,
)
from trainer.strict_json import RepeatedKeyError, loads_strict

if TYPE_CHECKING:  # torch stays unimported until a command runs
    import torch

    from trainer.rewards.preference import PreferenceModel


# argparse `type=` checks: a value no command can use is refused as the option is parsed,
# before torch loads or anything is written ("argument --steps: must be ..."), instead of
# failing deep inside (0 solver steps: an empty torch.stack) or doing nothing (0 training
# steps: an untrained base model written). They must not import torch: argparse also runs
# them on the options' string defaults.
def _number(text: str, kind: type[int] | type[float]) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"must be {noun}, got {text!r}") from None
    if not math.isfinite(value):  # float("nan") and float("inf") parse
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1: steps, seeds, batch sizes, layer sizes."""
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _field_max(name: str) -> Any:
    """TrainConfig field `name`'s upper bound (its metadata's "max")."""
    import dataclasses

    return next(f.metadata["max"] for f in dataclasses.fields(TrainConfig) if f.name == name)


# sample's and evaluate's --steps: at most rollout_steps' bound (TrainConfig's and the studio's
# evaluate job's, 1000): `--steps 100000` ran on for hours. At least 1, as before (Euler takes
# one step; rollout_steps' 2 is the training's need for a step to sample a neighbour at).
MAX_SOLVER_STEPS = _field_max("rollout_steps")
# sample's and evaluate's --seeds: the studio's evaluate job takes at most 1000 seeds
# (app/job_kinds.py EvaluateConfig.seeds, max_length); `--seeds 100000000` was killed for
# memory before the first image
MAX_SEEDS = 1000


def _bounded_count(maximum: int, whose: str) -> Callable[[str], int]:
    """An argparse type: an integer in [1, maximum]; `whose` says where the maximum comes
    from."""
    def count(text: str) -> int:
        value = positive_int(text)
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be an integer in [1, {maximum}] "
                                             f"({maximum}: {whose}), got {text!r}")
        return value
    return count


# only the upper bound is training's: a sample of one Euler step is fine (see above)
solver_steps = _bounded_count(MAX_SOLVER_STEPS, "the most training's rollout_steps takes")
seed_count = _bounded_count(MAX_SEEDS, "the most the studio's evaluate job takes")


def non_negative_int(text: str) -> int:
    """An integer >= 0: a seed, or a count where 0 means "none" (save_every, pool_size)."""
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def finite_float(text: str) -> float:
    """A float that is not nan or +-inf."""
    return _number(text, float)


def guidance_scale(text: str) -> float:
    """A guidance scale in the train config's guidance_scale range, [0, 100] (0 turns guidance
    off; below 0 means nothing; `--guidance-scale 500` was taken where a run's config refuses
    it)."""
    value = finite_float(text)
    high = _field_max("guidance_scale")
    if not 0 <= value <= high:
        raise argparse.ArgumentTypeError(f"must be a finite number in [0, {high:g}] (the train "
                                         f"config's guidance_scale range), got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite float > 0: a learning rate."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def ema_decay(text: str) -> float:
    """A decay in [0, 1): at 1 the average never moves from the random initial weights."""
    value = finite_float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text!r}")
    return value


DEVICE_CHOICES = "auto, cpu, cuda or cuda:N (N a GPU index)"


def device_name(text: str) -> str:
    """--device spelled as resolve_device takes it; whether CUDA is there is `available_device`'s to
    check (torch would reject any other name only when the model loads, listing its own
    device types, none of which the trainer runs on)."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"must be one of {DEVICE_CHOICES}, got {text!r}")
    return text


def available_device(name: str, field_name: str = "device") -> torch.device:
    """The device `name` (auto, cpu, cuda, cuda:N) resolves to, or a ConfigError naming
    `field_name` when it is not on this machine: resolve_device's RuntimeError for a missing
    CUDA is the user's to fix, not a bug to trace back; a cuda:N it lets through would fail
    at the first tensor moved there."""
    import torch

    from trainer.loop import resolve_device

    try:
        device = resolve_device(name)
    except RuntimeError as exc:  # "device 'cuda' requested but CUDA is not available"
        raise ConfigError(field_name, str(exc)) from None
    if device.type == "cuda" and device.index is not None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.index >= count:
            raise ConfigError(field_name, f"device {name!r} requested but this machine has "
                              f"{count} CUDA device(s)")
    return device


def _out_path(path: str, *, directory: bool, field_name: str = "--out") -> Path:
    """--out checked before any work: a directory to make (or a file to write, `directory`
    False) where a file (a directory) is not already in the way, and whose nearest existing
    parent is a directory; mkdir and open would otherwise fail after the model has run."""
    out = Path(path)
    if directory and out.exists() and not out.is_dir():
        raise ConfigError(field_name, f"{out} is an existing file, not a directory")
    if not directory and out.is_dir():
        raise ConfigError(field_name, f"{out} is an existing directory, not a file")
    parent = next((p for p in out.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ConfigError(field_name, f"{parent} is an existing file, not a directory, so "
                          f"{out} cannot be created")
    return out


def _parse_overrides(pairs: list[str], problems: list[ConfigError] | None = None) -> dict:
    """--set key=value (value parsed as JSON when it parses, else a string). Every malformed
    pair is a problem: added to `problems` when given (said with the config's others, the
    good pairs still checked), else raised together."""
    out, bad = {}, []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            bad.append(ConfigError("--set", f"{pair!r}: must look like key=value (a config "
                                   "field's name, then its value as JSON or text)"))
        elif not key.strip():  # "=3" was "unknown field" with nothing named
            bad.append(ConfigError(f"--set {pair}", "give KEY=VALUE (a config field's name, "
                                   "then its value as JSON or text)"))
        else:
            try:
                parsed = loads_strict(value)
            except RepeatedKeyError as exc:  # JSON all the same: which value was meant?
                bad.append(ConfigError("--set", f"{key}=...: {exc.msg} (which value is "
                                       "meant?)"))
                continue
            except json.JSONDecodeError:
                parsed = value
            if key in out and out[key] != parsed:
                # the last one won without a word, as --method beside --set method= did
                bad.append(ConfigError(f"--set {key}", f"given twice, {out[key]!r} and "
                                       f"{parsed!r}: which one is meant? give it once"))
            out[key] = parsed
    if bad and problems is None:
        raise ConfigErrors(bad) if len(bad) > 1 else bad[0]
    if problems is not None:
        problems.extend(bad)
    return out


def train_config_of(args: argparse.Namespace) -> TrainConfig:
    """`train`'s config: --config (default: the model's preset) with --set and --method on
    top, validated (ConfigErrors name every bad field)."""
    problems: list[ConfigError] = []  # every one at once, a bad prompts file's included
    overrides = _parse_overrides(args.set, problems)
    # a field given twice on the command line, two ways, with two values: which one was meant
    # is not ours to pick (the option won without a word)
    if args.method and "method" in overrides and overrides["method"] != args.method:
        problems.append(ConfigError("--method", f"{args.method!r} contradicts --set "
                                    f"method={overrides['method']!r}: give one of them"))
    if getattr(args, "prompts_file", None) and "prompts" in overrides:
        problems.append(ConfigError("--prompts-file", "--set prompts=... gives the prompts "
                                    "too: give one of them"))
    if args.method:
        overrides["method"] = args.method
    if getattr(args, "prompts_file", None):
        try:
            overrides["prompts"] = _prompt_list(args.prompts_file)
        except ConfigError as exc:
            problems.append(exc)
    # paths kept absolute in config.json and the checkpoints' run config: `evaluate
    # --checkpoint` alone then finds them from any working directory
    overrides = absolute_paths(overrides)
    model = overrides.get("model", "shapes")
    spec = args.config or default_preset(model if isinstance(model, str) else "shapes")
    saved = _resumed_config(args, problems)
    saved_run = dict(saved) if saved is not None else None  # as the run saved it
    asked: dict[str, Any] = {}  # what the command line gives a resume
    if saved is not None:
        # a resume's fields are the run's own, the command line's on top (a config file's
        # keys too: a preset is not applied): checked against the shapes preset's defaults,
        # a FLUX LoRA run's `--set lora_rank=4` was "applies only to finetune='lora'"
        saved.update(absolute_paths(_config_file_fields(args)))
        asked = {**_config_file_fields(args), **overrides}
        if asked.get("gradient_checkpointing") is False \
                and "gradient_checkpointing_fraction" not in asked:
            # the saved share of recomputed blocks (flux-lora's 0.25) belongs to the
            # checkpointing turned off now: it goes with it, as TrainConfig.from_layers does
            # for a preset's, rather than refused as a value this command never gave
            saved.pop("gradient_checkpointing_fraction", None)
        spec, overrides = None, {**saved, **overrides}
    else:
        # a JSON --config file's paths are kept absolute too, as --set's are (they were
        # saved as typed: a relative model_path broke `sample --checkpoint` and `--resume`
        # from any other directory); relative to where the command runs, as --set's
        overrides = {**{k: v for k, v in absolute_paths(_config_file_fields(args)).items()
                        if k in PATH_FIELDS}, **overrides}
    # the fields only the studio's train jobs act on, given on the command line: refused
    given = {**_config_file_fields(args), **_parse_overrides(args.set, [])}  # bad ones said
    problems += [ConfigError(name, f"{why}; leave {name} out (or {default!r})")
                 for name, (default, why) in STUDIO_ONLY_FIELDS.items()
                 if name in given and given[name] != default]
    config = None
    try:
        config = load_config(spec, overrides)
    except ConfigErrors as exc:
        # "prompts: required" beside a prompts file that could not be read says it twice
        errors = [e for e in exc.errors if not (problems and e.field == "prompts")]
        if saved_run is not None:
            errors = _resume_refusals_first(args, saved_run, asked, errors)
        problems += errors
    except ConfigError as exc:
        # the option the user gave
        problems.append(ConfigError("--config", exc.message) if exc.field == "config" else exc)
    # an unknown field (a --set or config file key) lists the fields, as fit-preference's
    # --set does: "unknown field" alone left the user to read trainer/config.py
    if any(e.message.startswith("unknown field") for e in problems):
        import dataclasses

        fields = ", ".join(f.name for f in dataclasses.fields(TrainConfig))
        problems = [ConfigError(e.field, f"{e.message}; the fields are {fields}")
                    if e.message.startswith("unknown field") else e for e in problems]
    if not problems and config is not None:
        if saved is None and spec in PRESETS:
            config = _without_studio_fields(config, spec)
        return config
    from trainer.models import model_dir_problem, uses_model_directory

    # cmd_train's weights file checks, said now too, with the fields they read as far as
    # they are valid (a bad model or LoRA field: the files are judged by the model alone)
    # (the preset's and the config file's fields under the overrides: a config file's
    # preference_model beside the preset's reward_weights was not seen)
    preset_fields = PRESETS.get(spec, {}) if isinstance(spec, str) else {}
    fields = (config.to_dict() if config is not None
              else {**preset_fields, **_config_file_fields(args), **overrides})
    problems += _weights_file_problems(fields, fits_run=config is not None,
                                       resumed=saved is not None)
    # the reward models' weights too (cmd_train's check, which runs on a valid config only)
    problems += _reward_weights_problems(fields)
    problems = _prompts_file_named(args, problems)

    if config is not None:  # the preset's model (flux-lora) when the overrides name none
        model, model_path = config.model, config.model_path
    else:
        model_path = overrides.get("model_path")
    if isinstance(model, str) and isinstance(model_path, str) and model_path \
            and uses_model_directory(model) \
            and (problem := model_dir_problem(model, model_path)) is not None:
        problems.append(ConfigError("model_path", problem))  # cmd_train's check, said now too
    if config is None and not any(e.field in ("prompts", "--prompts-file") for e in problems):
        # cmd_train's "flux trains on prompts you give", said beside the fields' problems: it
        # came only once they were fixed (a flux run without model_path, then without prompts)
        preset = PRESETS.get(spec, {}) if isinstance(spec, str) else {}
        given = {**preset, **_config_file_fields(args), **overrides}
        prompts = given.get("prompts") or []
        if isinstance(given.get("model"), str) and isinstance(prompts, list) and (
                problem := missing_prompts_problem(given["model"], prompts)) is not None:
            problems += _prompts_file_named(args, [ConfigError("prompts", problem)])
    raise ConfigErrors(problems) if len(problems) > 1 else problems[0]


# TrainConfig's fields that only the studio's train jobs act on (StudioArguments): the CLI
# trains in one process and holds no votes. Each with its "off" value and where it works.
STUDIO_ONLY_FIELDS: dict[str, tuple[Any, str]] = {
    "preference_refit_every": (0, "online refits run in the studio's train jobs, which hold "
                               "the votes; the CLI trains on the fixed preference_model and "
                               "does not refit (refit with fit-preference --warm-start, then "
                               "train again)"),
    "train_nnodes": (1, "multi-host training runs in the studio's train jobs (it starts torchrun "
                     "on each host); the CLI trains in one process"),
}


def _without_studio_fields(config: TrainConfig, preset: str) -> TrainConfig:
    """`config` with the STUDIO_ONLY_FIELDS a preset set (shapes-preference refits every 50
    iterations in the studio) put back to their off value, each said on stderr: a run's
    config.json holds what the run did, not a refit that never happened."""
    import dataclasses

    changed = {name: default for name, (default, _) in STUDIO_ONLY_FIELDS.items()
               if getattr(config, name) != default}
    for name, default in changed.items():
        print(f"note: preset {preset!r} sets {name}={getattr(config, name)!r}, which only the "
              f"studio's train jobs act on; this run uses {default!r}", file=sys.stderr)
    return dataclasses.replace(config, **changed).validate() if changed else config


@contextlib.contextmanager
def _first_interrupt_stops() -> Iterator[Callable[[], bool]]:
    """A first Ctrl-C asks the run to stop at the end of its iteration, or to drop it when it
    waits for the reward server's scores, and to checkpoint the last whole one; a second one
    interrupts at once (main: one line, exit 130). Yields whether a stop was asked."""
    asked: list[int] = []

    def on_interrupt(signum: int, frame: object) -> None:
        if asked:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a third press must not cut the exit
            raise KeyboardInterrupt
        asked.append(signum)
        print("\nstopping at the end of this iteration, or dropping it if it waits for the "
              "reward server (the last whole iteration is checkpointed); Ctrl-C again stops "
              "at once", file=sys.stderr)

    if threading.current_thread() is not threading.main_thread():
        yield lambda: False  # signals reach the main thread only
        return
    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield lambda: bool(asked)
    finally:
        signal.signal(signal.SIGINT, previous)


def _resumed_config(args: argparse.Namespace,
                    problems: list[ConfigError]) -> dict[str, Any] | None:
    """The saved config.json of the run `train --resume --out` continues, or None (no
    --resume, or no run there yet: RunDirectory.check says so). One that is not a valid
    config (edited or damaged) adds its --resume problem, naming the file, to `problems`."""
    from trainer.run_dir import saved_run_config

    if not getattr(args, "resume", False) or not args.out:
        return None
    saved = Path(args.out) / "config.json"
    if not saved.is_file():
        return None
    try:
        return saved_run_config(saved).to_dict()
    except ConfigError as exc:
        problems.append(exc)
        return None


def _resume_refusals_first(args: argparse.Namespace, saved: dict[str, Any],
                           asked: dict[str, Any],
                           errors: list[ConfigError]) -> list[ConfigError]:
    """A resume whose merged config did not parse: where the command line's fields (`asked`)
    change fields a resume keeps (`--method sde` on a run of `sigma` 0.1), those refusals,
    and the problems of the fields it gave, not the saved run's fields that the change made
    invalid ("sigma: applies only to method 'neighbor'" named a field the command never
    gave)."""
    from trainer.run_dir import changed_on_resume

    given = _given_fields(args)
    refusals = changed_on_resume(absolute_paths(saved), absolute_paths(asked), given,
                                 Path(args.out) / "config.json")
    if not refusals:
        return errors
    refused = {e.field for e in refusals}
    return refusals + [e for e in errors if e.field in given and e.field not in refused]


def _config_file_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The fields a JSON --config file names ({} for a preset, no --config, or a file that is
    not a JSON object: load_config says what is wrong with it)."""
    if not args.config or args.config in PRESETS:
        return {}
    try:
        fields = loads_strict(Path(args.config).read_text())
    except (OSError, ValueError):
        return {}
    return fields if isinstance(fields, dict) else {}


def _given_fields(args: argparse.Namespace) -> dict[str, str]:
    """The config fields `train`'s command line gives, each with the option that gave it:
    --set's keys, --method, --prompts-file, and the keys a JSON --config file names. A
    preset's fields are not among them: on --resume the run's config.json is the config, and
    a preset's untouched defaults (its learning rate, say) are nothing the user asked to
    change. A later option wins, as it does in the config."""
    given: dict[str, str] = {key: f"--config {args.config}" for key in _config_file_fields(args)}
    given.update((key, "--set") for key in _parse_overrides(args.set))
    if args.method:
        given["method"] = "--method"
    if getattr(args, "prompts_file", None):
        given["prompts"] = "--prompts-file"
    return given


def _prompts_file_named(args: argparse.Namespace, problems: list[ConfigError]
                        ) -> list[ConfigError]:
    """`problems` with those of field 'prompts' naming --prompts-file when the prompts came
    from it: the user typed the flag, and "config field 'prompts'" named nothing they gave."""
    if not getattr(args, "prompts_file", None):
        return problems
    return [ConfigError("--prompts-file", e.message) if e.field == "prompts" else e
            for e in problems]


def _weights_file_problems(fields: dict[str, Any], *, fits_run: bool = True,
                           resumed: bool = False) -> list[ConfigError]:
    """Why the base_checkpoint and preference_model files a train config names cannot be
    loaded, from their headers alone, as the studio's job submission checks them (a text
    file or a truncated one failed inside safetensors, with a traceback, after the model had
    started loading). `fits_run`: the model and LoRA fields are valid, so a flux / sd3
    checkpoint is held against the run's adapters too. `resumed`: the paths are the saved
    run's."""
    from trainer.models import (
        BASE_CHECKPOINT_TAKES,
        SHAPES_WEIGHTS,
        ModelSpec,
        base_checkpoint_problem,
        model_directory_as_checkpoint_problem,
        model_names,
        uses_model_directory,
        weights_problem,
    )

    problems: list[ConfigError] = []
    model, base = fields.get("model", "shapes"), fields.get("base_checkpoint", "")
    if isinstance(model, str) and model in model_names() and isinstance(base, str) \
            and base.strip():
        if uses_model_directory(model):
            spec = ModelSpec.from_config(fields) if fits_run else ModelSpec(name=model)
            problem = base_checkpoint_problem(spec, base, fits_run=fits_run)
        else:
            # the loader takes a checkpoint directory's model.safetensors too
            weights = Path(base) / SHAPES_WEIGHTS if Path(base).is_dir() else Path(base)
            problem = (base_checkpoint_problem(ModelSpec(name=model), weights)
                       if weights.is_file() else
                       # a diffusers model directory: said as one, not as a shapes checkpoint
                       # that lacks its file
                       model_directory_as_checkpoint_problem(base, BASE_CHECKPOINT_TAKES)
                       or f"{weights} is not a file; give a {SHAPES_WEIGHTS} (a checkpoint's, or "
                       "train-base's base.safetensors), or leave base_checkpoint out for the "
                       "shipped base")
        if problem is not None:
            problems.append(ConfigError("base_checkpoint", problem))
    # (left out: TrainConfig's default, which blends no preference)
    weights_of = fields.get("reward_weights", {})
    preference = fields.get("preference_model", "")
    if isinstance(weights_of, dict) and "preference" in weights_of \
            and isinstance(preference, str):
        if not Path(preference).is_file():
            # a run stored before paths were kept absolute holds it as typed
            where = ("; the run stores it relative to the directory it was started in: resume "
                     "from there" if resumed and preference and not Path(preference).is_absolute()
                     else "")
            problem = ("reward 'preference' needs the path of a fitted preference model "
                       f"(safetensors); {preference!r} is not a file{where}")
        else:
            problem = (weights_problem("preference", preference,
                                       weight_format="preference-model")
                       or _preference_fit_problem(preference, model))
        if problem is not None:
            problems.append(ConfigError("preference_model", problem))
    elif isinstance(weights_of, dict) and isinstance(preference, str) and preference.strip() \
            and not resumed:
        # the run would never read it (the studio refuses it too); a run saved so before is
        # resumed as it was started, not refused now
        problems.append(ConfigError("preference_model", PREFERENCE_WITHOUT_WEIGHT))
    return problems


def _reward_weights_problems(fields: dict[str, Any]) -> list[ConfigError]:
    """The weights of the model-backed rewards a train config's reward_weights blend, missing
    or incomplete where they are looked for (reward_model_paths, else REWARD_MODELS_DIR), as
    the reward loader names them. None with a reward_server_url (the server's weights are its
    own), nor while reward_weights or reward_model_paths is malformed: the config's own checks
    say that, and the directories it would name are not the ones meant."""
    from trainer.rewards.models import MODEL_REWARDS, weights_problem

    weights = fields.get("reward_weights", {})
    paths = fields.get("reward_model_paths") or {}
    if fields.get("reward_server_url") or not isinstance(weights, dict) \
            or not isinstance(paths, dict) \
            or not all(isinstance(path, str) for path in paths.values()):
        return []
    return [ConfigError("", problem) for name in weights
            if name in MODEL_REWARDS and (problem := weights_problem(name, dict(paths)))]


def _damaged_checkpoint_problem(out: Path) -> ConfigError | None:
    """Why the newest checkpoint a `--resume` of `out` loads is damaged (a file truncated or
    emptied, by a full disk or a partial copy), naming it and the way on; None when whole."""
    from trainer.loop import checkpoint_files_problem, latest_checkpoint
    from trainer.models import TRAINER_STATE

    # the newest iter-N directory, whole or not: a checkpoint is written whole or not at all
    # (saved beside it, then renamed), so one without its trainer state was damaged after;
    # the resume passed over it to the one before without a word, then wrote over it
    newest = latest_checkpoint(out / "checkpoints", whole_only=False)
    if newest is None:
        return None
    problem = (f"{newest / TRAINER_STATE} is missing" if not (newest / TRAINER_STATE).is_file()
               else checkpoint_files_problem(newest))
    if problem is None:
        return None
    return ConfigError("--resume", f"the newest checkpoint, {newest.name}, is damaged: "
                       f"{problem}; delete {newest} to resume from the checkpoint before it "
                       "(or from the start when there is none)")


def _run_file_problems(args: argparse.Namespace, out: Path | None,
                       run_config: TrainConfig) -> list[ConfigError]:
    """What the Trainer would refuse once the model loads, said before the run directory is
    touched: a missing preference model, prompts, the model directory (a resumed run's is its
    saved config's), a damaged newest checkpoint to resume from (`out` None: --out itself is
    refused), the reward models' weights (missing or incomplete, as the reward loader names
    them; a reward server's are its own), naming the files expected as the API's 422 does."""
    from trainer.models import lora_targets_problem, model_dir_problem, uses_model_directory

    problems = _weights_file_problems(run_config.to_dict(), resumed=args.resume)
    if args.resume and out is not None \
            and (problem := _damaged_checkpoint_problem(out)) is not None:
        problems.append(problem)
    if (problem := run_config.prompts_problem()) is not None:
        problems += _prompts_file_named(args, [problem])
    if uses_model_directory(run_config.model) and (
            problem := model_dir_problem(run_config.model, run_config.model_path)) is not None:
        problems.append(ConfigError("model_path", problem))
    elif uses_model_directory(run_config.model) and run_config.finetune == "lora" and (
            problem := lora_targets_problem(run_config.model_path,
                                            list(run_config.lora_target_modules))):
        problems.append(ConfigError("lora_target_modules", problem))
    problems += _reward_weights_problems(run_config.to_dict())
    return problems


def cmd_train(args: argparse.Namespace) -> int:
    from trainer.loop import latest_checkpoint
    from trainer.run_dir import RunDirectory

    # every problem at once, before anything is written: the config's fields (with the files
    # they name), --out and the run there, the device, the reward models' weights; each of
    # these was said only once the ones before it were fixed
    problems: list[ConfigError] = []
    if (world := os.environ.get("WORLD_SIZE", "1")) != "1":
        # every process ran the whole run into the one --out, each renaming the same
        # checkpoint files, without a word
        problems.append(ConfigError("", f"train runs as one process, not under torchrun "
                                    f"(WORLD_SIZE={world}): each process would run "
                                    "the whole run into the same --out. Several GPUs train a "
                                    "studio job, which launches torchrun itself (TRAIN_NPROC=N "
                                    "in the README)"))
    config = _checked(problems, train_config_of, args)
    out = _checked(problems, _out_path, args.out, directory=True)
    # the fields the command line set: a resume takes its budget and device from them, and
    # refuses other changes to the saved run (read once the --set values parse)
    given = _given_fields(args) if config is not None else {}
    run_config = None
    if out is not None and config is not None:
        problems += RunDirectory.run_problems(out, config, args.resume, given)
        run_config = RunDirectory.run_config(out, config, args.resume, given)
    elif out is not None and not args.resume:  # an earlier run there, whatever the config
        problems += RunDirectory.earlier_run_problems(out)
    if run_config is not None:
        # a resume's model directory of another model was said twice: refused as the run's
        # change, then as a directory of the wrong model
        said = {p.field for p in problems}
        problems += [p for p in _run_file_problems(args, out, run_config)
                     if not (p.field == "model_path" and "model_path" in said)]
    elif config is not None:  # --out refused: the files the config names are said beside it
        problems += _run_file_problems(args, None, config)
    # the device asked for (the Trainer resolves it again, once the model is loading)
    device = (run_config.device if run_config is not None else
              {**_config_file_fields(args), **_parse_overrides(args.set, [])}.get("device"))
    if isinstance(device, str) and not any(p.field == "device" for p in problems):
        _checked(problems, available_device, device)
    _raise_problems(problems)
    assert out is not None and config is not None
    if args.resume and args.config in PRESETS:  # taken silently, it looked applied
        print(f"note: --config {args.config} is not applied on --resume: the run goes on with "
              f"its saved {out / 'config.json'} (--set changes what a resume may change)",
              file=sys.stderr)
    from trainer.rewards.remote import RewardServerError

    run = RunDirectory(out, config, resume=args.resume, given=given)  # a server down: exit 2
    try:
        with _first_interrupt_stops() as stop_requested:
            finished = run.train(progress=not args.no_progress, stop_requested=stop_requested)
    except RewardServerError as exc:
        # gone mid-run: a failure of the run (exit 1, as an out-of-memory stop), not of the
        # command line (2), and the run goes on from its newest checkpoint
        newest = latest_checkpoint(run.checkpoints_dir)
        print(f"error: {exc} (at iteration {run.trainer.iteration + 1}; "
              + (f"checkpoint {newest}; " if newest is not None else "no checkpoint yet; ")
              + f"continue with `python -m trainer train --resume --out {out}` once the "
              "server is back, or with --set reward_server_url= to score in this process)",
              file=sys.stderr)
        return 1
    if not finished:
        newest = latest_checkpoint(run.checkpoints_dir)
        if newest is None:  # stopped inside the first iteration: nothing to continue from
            # `train`'s words, a demo's run included: demo has no --resume
            print("interrupted before the first iteration finished: no checkpoint yet; "
                  f"`python -m trainer train --resume --out {out}` starts it again",
                  file=sys.stderr)
        else:
            print(f"interrupted at iteration {run.trainer.iteration}: checkpoint "
                  f"{newest}; continue with `python -m trainer train --resume --out {out}`",
                  file=sys.stderr)
        return 130
    print(f"metrics:      {run.metrics_path}")
    print(f"reward curve: {run.curve_path}")
    print(f"samples:      {run.samples_dir}")
    print(f"checkpoints:  {run.checkpoints_dir}")
    return 0


# what fit-preference reads of each line of a votes file (the studio's vote export,
# GET /api/votes/export?format=jsonl, has these and more)
VOTE_FIELDS = ("prompt", "outcome", "image_0_path", "image_1_path")


def read_votes(path: Path, images: Path, include_excluded: bool = False,
               excluded: list[int] | None = None) -> list:
    """PreferencePairs from a JSONL votes file in the studio's export format: image_0 is the
    left image (outcome "a"), image_1 the right; paths relative to `images`; the vote_id, when
    given, is the pair's key (the votes are then held out by pair, as the studio's are). Votes marked excluded
    are left out, as the studio's fit leaves them out (their line numbers appended to
    `excluded`). ValueError listing every bad line, a
    repeated vote_id's included."""
    import numpy as np
    from PIL import Image

    from trainer.evaluation import listed_problems
    from trainer.rewards.outcomes import OUTCOMES
    from trainer.rewards.preference import PreferencePair
    from trainer.text_files import decode_lines

    if not path.is_file():
        raise FileNotFoundError(f"--votes: {path} is not a file")
    # read as bytes: a line that is not UTF-8 is one more bad line, named with the others
    # (decoding the whole file raised "'utf-8' codec can't decode ..." naming no file)
    data = path.read_bytes()
    if data.startswith(b"PAR1"):  # the studio's other export: one line per byte run, said
        raise ValueError(f"--votes: {path} is a Parquet file; fit-preference reads JSON lines: "
                         "export the votes with format=jsonl (GET /api/votes/export?format=jsonl)")
    lines, bad_encoding = decode_lines(data)
    pairs, problems = [], list(bad_encoding.values())
    decoded: dict[str, np.ndarray] = {}
    vote_lines: dict[str, int] = {}  # vote_id -> the line that first gave it

    def image(rel: str, line: int) -> np.ndarray | None:
        if rel not in decoded:
            try:
                with Image.open(images / rel) as img:
                    decoded[rel] = np.asarray(img.convert("RGB"), dtype=np.uint8)
            except (OSError, ValueError) as exc:
                problems.append(f"line {line}: image {images / rel}: {exc}")
                return None
        return decoded[rel]

    for number, text in enumerate(lines, start=1):
        if not text.strip() or number in bad_encoding:
            continue
        try:
            row = loads_strict(text)
        except json.JSONDecodeError as exc:
            problems.append(f"line {number}: not JSON ({exc.msg})")
            continue
        if not isinstance(row, dict):
            problems.append(f"line {number}: not a JSON object")
            continue
        if missing := [k for k in VOTE_FIELDS if not isinstance(row.get(k), str)]:
            problems.append(f"line {number}: needs string fields {', '.join(missing)}")
            continue
        if row["outcome"] not in OUTCOMES:
            problems.append(f"line {number}: outcome must be one of {list(OUTCOMES)}, "
                            f"got {row['outcome']!r}")
            continue
        # a repeated vote_id (two exports concatenated) counts a vote twice, on one side of
        # the held-out split
        key = row.get("vote_id")
        if key is not None and (isinstance(key, bool) or not isinstance(key, int | str)
                                or (isinstance(key, str) and not key.strip())):
            # 1.5, true, [1] were taken as ids (by str()): the export writes integers
            problems.append(f"line {number}: vote_id must be an integer (or a non-empty "
                            f"string), got {key!r}")
            continue
        if key is not None and (first := vote_lines.setdefault(str(key), number)) != number:
            problems.append(f"line {number}: vote_id {key!r} repeats line {first}'s")
            continue
        marked = row.get("excluded", False)
        if marked is not None and not isinstance(marked, bool):
            # "yes" or "false" (a string) read as true: the export writes true or false
            problems.append(f"line {number}: excluded must be true or false, got {marked!r}")
            continue
        if marked and not include_excluded:
            if excluded is not None:
                excluded.append(number)
            continue
        a, b = image(row["image_0_path"], number), image(row["image_1_path"], number)
        if a is not None and b is not None:
            pairs.append(PreferencePair(a, b, row["prompt"], row["outcome"],
                                        key=None if key is None else str(key)))
    if problems:
        raise ValueError(f"--votes {path}: {listed_problems(problems)}")
    return pairs


def readable_pairs(pairs: list, features: str, votes: Path) -> tuple[list, int]:
    """The pairs a fit with `features` reads and how many labelled votes were left out, as the
    studio's fit_preference job leaves them out (trainer.rewards.preference.readable_votes:
    the shapes features read only the shapes world's prompts and 32x32 images; a vote on
    others was fitted on anyway). Skip and both_bad votes carry no label and stay, for the
    fit to count by outcome, as the job counts them. ValueError when the images left differ in
    size."""
    from trainer.rewards.preference import LABELLED_OUTCOMES, readable_votes

    labelled = [pair for pair in pairs if pair.outcome in LABELLED_OUTCOMES]
    readable, unreadable = readable_votes(labelled, features, lambda pair: pair.prompt,
                                          lambda pair: (pair.image_a.shape, pair.image_b.shape))
    kept = {id(pair) for pair in readable}
    pairs = [pair for pair in pairs if pair.outcome not in LABELLED_OUTCOMES or id(pair) in kept]
    if len({pair.image_a.shape for pair in pairs} | {pair.image_b.shape for pair in pairs}) > 1:
        raise ValueError(f"--votes {votes}: the images differ in size; a fit needs one size")
    return pairs, unreadable


def _warm_start_model(path: Path, device: str) -> PreferenceModel:
    """The preference model at `path` (fit-preference's --warm-start), or a ConfigError saying
    why not: any other file (a checkpoint, a text file) failed in safetensors' words, with a
    traceback (SafetensorError "header too large")."""
    from safetensors import SafetensorError

    from trainer.rewards.preference import PreferenceModel

    if not path.is_file():
        raise ConfigError(f"--warm-start {path}", "is not a file")
    try:
        return PreferenceModel.load(path, device)
    except (SafetensorError, OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"--warm-start {path}", f"not a preference model file ({exc})") from None


def _warm_start_unused(warm: PreferenceModel, config: Any, pairs: list) -> str | None:
    """Why a fit of `pairs` with `config` would not start from `warm` (fit_preference_model
    then fits from scratch without a word), or None when it will."""
    from trainer.rewards.preference import LABELLED_OUTCOMES, warm_start_problem

    if not config.warm_start_epochs:
        return ("warm_start_epochs is 0, which fits from scratch: leave --warm-start out, or "
                "set warm_start_epochs")
    if problem := warm_start_problem(warm, config):
        return f"cannot start from it: {problem}"
    labelled = [pair for pair in pairs if pair.outcome in LABELLED_OUTCOMES]
    if len(labelled) < 10 or any(pair.key is None for pair in labelled):
        return ("a warm start needs the held-out votes chosen by pair, as before, which "
                "needs every vote's vote_id (the studio's export has them) and 10 or more "
                "votes")
    return None


def cmd_fit_preference(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from trainer.rewards.fit_config import fit_config_from
    from trainer.rewards.preference import fit_preference_model

    problems: list[ConfigError] = []
    overrides = _parse_overrides(args.set, problems)
    if "device" in overrides:
        # --device is the one way to say it (it was overwritten by --device's default 'auto',
        # so `--set device=banana` fitted on the CPU): refused, not guessed between the two
        problems.append(ConfigError("device", f"give it with --device (auto, cpu, cuda or "
                                    f"cuda:N), not --set device={overrides.pop('device')}"))
    device = _checked(problems, available_device, args.device, "--device")
    overrides["device"] = str(device) if device is not None else "cpu"
    config = _checked(problems, fit_config_from, overrides)  # before any image loads
    # the files, said with the fields (each was found only once the ones before it passed)
    out = _checked(problems, _out_path, args.out, directory=False)
    if out is not None and out.is_file() and (problem := _not_a_preference_model(out)):
        # a refit replaces its model in place; any other file (`--out notes.txt`) was
        # overwritten without a word
        problems.append(ConfigError("--out", f"{out} exists and {problem}: a fit replaces only "
                                    "a preference model; give a new path"))
    votes = Path(args.votes)
    images = Path(args.images) if args.images else votes.parent
    if not votes.is_file():
        problems.append(ConfigError("--votes", f"{votes} is not a file"))
    if not images.is_dir():  # one line, not one per image of every vote
        problems.append(ConfigError("--images", f"{images} is not a directory (the one the "
                                    "votes' image paths are relative to)"))
    if args.warm_start and not Path(args.warm_start).is_file():
        problems.append(ConfigError(f"--warm-start {args.warm_start}", "is not a file"))
    # the votes' lines, said with the options' problems (a bad --set hid every one of them)
    excluded: list[int] = []  # the lines of the votes the file marks excluded, left out
    voted = (_checked(problems, read_votes, votes, images, args.include_excluded, excluded)
             if votes.is_file() and images.is_dir() else None)
    _raise_problems(problems)
    assert config is not None and out is not None and voted is not None
    pairs, unreadable = readable_pairs(voted, config.features, votes)
    warm = _warm_start_model(Path(args.warm_start), config.device) if args.warm_start else None
    if warm is not None and (problem := _warm_start_unused(warm, config, pairs)):
        # asked for, and silently not done: the fit ran from scratch for every epoch
        raise ConfigError(f"--warm-start {args.warm_start}", problem)
    try:
        model = fit_preference_model(pairs, config, warm_start=warm)
    except ValueError as exc:
        if not unreadable:
            raise
        raise ValueError(f"{exc} ({unreadable} more votes are on images its "
                         f"{config.features!r} features cannot read: other models' samples or "
                         "prompts; features 'clip' reads any)") from None
    if unreadable and model.report is not None:  # counted as the fit_preference job counts them
        model.report.votes_total += unreadable
        model.report.votes_ignored = {**model.report.votes_ignored,
                                      "unreadable_images": unreadable}
    if excluded:
        # not in the report, as the studio's job never reads them; said, so that a file's
        # count and the report's can be reconciled
        print(f"fit-preference: left out {len(excluded)} vote(s) the file marks excluded "
              "(--include-excluded fits on them)", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    model.save(out, metadata={"votes_file": str(votes)})
    print(json.dumps({"out": str(out), **asdict(model.report)}))
    return 0


def _not_a_preference_model(path: Path) -> str | None:
    """Why the file at `path` is not a saved preference model (read from its header), or
    None when it is one."""
    from safetensors import SafetensorError

    from trainer.rewards.preference import saved_fit_fields

    try:
        saved_fit_fields(path)
    except (ValueError, KeyError):
        return "is not a preference model"
    except (SafetensorError, OSError) as exc:
        return f"is not a safetensors file ({exc})"
    return None


def _checkpoint_of(args: argparse.Namespace) -> Path | None:
    """--checkpoint checked: a weights file, or a directory that holds model weights, whose
    safetensors header reads (any other file would fail in the loader's own words)."""
    from trainer.models import (
        checkpoint_weights_file,
        model_directory_as_checkpoint_problem,
        safetensors_header,
    )

    checkpoint = Path(args.checkpoint) if args.checkpoint else None
    if checkpoint is None:
        return None
    if not checkpoint.exists():
        raise ConfigError("--checkpoint", f"{checkpoint} does not exist")
    # a model directory's transformer weights made it pass for a checkpoint, of the shapes
    # model (its run's state missing): the user meant the base model
    if problem := model_directory_as_checkpoint_problem(
            checkpoint, "--model-path (with --model {model}); --checkpoint is a checkpoint of "
            "a run (its checkpoints/iter-N directory) or a LoRA file, left out for the base "
            "model alone"):
        raise ConfigError("--checkpoint", problem)
    weights = checkpoint_weights_file(checkpoint) if checkpoint.is_dir() else checkpoint
    if weights is None:
        raise ConfigError("--checkpoint", f"{checkpoint} holds no model weights")
    try:
        safetensors_header(weights)
    except (OSError, ValueError) as exc:
        raise ConfigError("--checkpoint", f"{weights} is not a readable checkpoint: {exc}") from None
    return checkpoint


def _model_spec(args: argparse.Namespace):
    """What `sample` / `evaluate` load: --model (with --model-path for flux and sd3) and
    --checkpoint on top. A checkpoint of this trainer carries its run's model options, so
    --model and --model-path default to its run's; a bare diffusers LoRA (a checkpoint's
    zip download, another tool's LoRA) carries its rank and targets but not its base, which
    --model and --model-path name. Sets args.model to the model named (the checkpoint's,
    --model's, else shapes) once the checkpoint reads, the options refused or not: the
    command's other checks (rewards, prompts) judge by it beside these problems; it stays
    None when the checkpoint cannot tell (unreadable, and no --model given)."""
    from trainer.models import (
        ModelSpec,
        checkpoint_spec,
        model_names,
        resolution_limit_problem,
        uses_model_directory,
    )

    checkpoint = _checkpoint_of(args)
    try:
        spec = checkpoint_spec(checkpoint) if checkpoint is not None else None
    except ValueError as exc:  # a LoRA file whose layers cannot be read
        raise ConfigError("--checkpoint", str(exc)) from None
    problems: list[ConfigError] = []  # the options' problems at once, not one a run
    bare_lora = spec is not None and not spec.name  # its base is the user's to name
    if bare_lora and not (args.model and uses_model_directory(args.model)):
        raise ConfigError("--model", f"{checkpoint} is a diffusers LoRA without its run's "
                              "state: name its base with --model (flux or sd3) and --model-path")
    if spec is not None and spec.name and args.model and args.model != spec.name:
        # applied anyway, another model's LoRA loaded wherever its layer names matched
        raise ConfigError("--model", f"{checkpoint} is a checkpoint of model {spec.name!r}, "
                          f"not {args.model!r}: leave --model out (the checkpoint's run's is "
                          "taken) or give a checkpoint of that model")
    # no run's options: the base's guidance (sd3 sampled at 3.5 and its runs' checkpoints at
    # sd3-lora's 4.5, so a before-and-after comparison changed two things)
    if spec is None:
        spec = ModelSpec.base(args.model or "shapes")
    elif bare_lora:
        spec.guidance_scale = ModelSpec.base(args.model).guidance_scale
    # the command line names the model and where it lives on this machine; the rest of the
    # options (LoRA rank, resolution, guidance) come from the checkpoint's run
    spec.name = args.model or spec.name
    spec.path = args.model_path or (spec.path if uses_model_directory(spec.name) else "")
    if uses_model_directory(spec.name) and not spec.path:
        problems.append(ConfigError("--model-path", f"--model {spec.name} needs --model-path, "
                                    "its diffusers-format directory"))
    for option in ("resolution", "guidance_scale", "mixed_precision"):
        if getattr(args, option, None) is not None:
            setattr(spec, option, getattr(args, option))
    if spec.mixed_precision == "bf16" and spec.name == "shapes":
        # TrainConfig's rule: the shapes model has no bf16 path (it would be ignored)
        problems.append(ConfigError("--mixed-precision", f"the {spec.name} model samples in "
                                    "fp32; use 'auto' or 'no' ('bf16' is for flux and sd3)"))
    # the rule TrainConfig and the studio's jobs apply to resolution (the shapes model's
    # images are its latents, drawn at the world's one size whatever is asked)
    problem = resolution_problem(spec.name, spec.resolution, default="--resolution left out")
    if problem is None and spec.path:  # what the model directory's transformer can draw
        problem = resolution_limit_problem(spec.name, spec.path, spec.resolution)
    if problem is not None:
        problems.append(ConfigError("--resolution", problem))
    if args.model_path and not uses_model_directory(spec.name):  # was silently ignored
        problems.append(ConfigError("--model-path", f"the {spec.name} model takes no "
                                    "--model-path (its weights are the checkpoint's or built "
                                    "in); it is for --model "
                                    f"{' or '.join(n for n in model_names() if uses_model_directory(n))}"))
    args.model = spec.name
    _raise_problems(problems)
    spec.inference_only = True  # sampled, never trained: no fp32 masters, gradients or compile
    return spec


def sampling_batch_size(args: argparse.Namespace, model: str) -> int:
    """--batch-size checked, or its default for `model` and --checkpoint
    (trainer.config.default_sampling_batch, the studio's rule too). Batching never changes the
    images: each has its own seed's noise."""
    from trainer.models import run_rollout_batch_size, uses_model_directory

    if args.batch_size is not None:  # >= 1: argparse's check (positive_int)
        return args.batch_size
    checkpoint = Path(args.checkpoint) if args.checkpoint else None
    return default_sampling_batch(model, [run_rollout_batch_size(checkpoint)],
                                  uses_directory=uses_model_directory(model))


def _sample_prompts(path: str) -> list[str]:
    """sample's --prompts, read as --prompts-file is (a .jsonl's lines were taken as prompts,
    JSON text and all)."""
    try:
        return _prompt_list(path)
    except ConfigError as exc:
        raise ConfigError("--prompts", exc.message) from None


def _sample_out(path: str) -> Path:
    """sample's --out: a directory that holds no earlier sample (its images would stay
    beside the new ones, listed nowhere)."""
    out = _out_path(path, directory=True)
    if (out / "manifest.jsonl").exists():
        raise ConfigError("--out", f"{out} holds an earlier sample (manifest.jsonl); give a "
                          "new --out, or empty it first")
    return out


def _check_shapes_prompts(problems: list[ConfigError], model: str | None,
                          prompts: list[str] | None, flag: str, path: str | None) -> None:
    """The prompts read from `path` (`flag`'s file) that the shapes model cannot draw, added
    to `problems` when it is the model: each named, with the rest of the command's problems
    (the model refused the first alone, when it loaded, naming neither the flag nor the
    file)."""
    from trainer.shapes.world import shapes_prompt_problem

    if model == "shapes" and prompts and (problem := shapes_prompt_problem(prompts)):
        problems.append(ConfigError(flag, f"{path}: {problem}"))


def _check_model_dir(problems: list[ConfigError], spec: Any, args: argparse.Namespace) -> None:
    """The model directory of the model named (the checkpoint's, else --model's) added to
    `problems` when it is missing or incomplete, with the files it must hold."""
    from trainer.models import model_dir_problem, uses_model_directory

    name, path = (spec.name, spec.path) if spec is not None else (args.model, args.model_path)
    if name and path and uses_model_directory(name) and (
            problem := model_dir_problem(name, path)) is not None:
        problems.append(ConfigError("--model-path", problem))


def _save_png(image: Any, path: Path) -> None:
    """One of sample's PNGs (a function of its own: where a test interrupts the writing)."""
    from PIL import Image

    Image.fromarray(image).save(path)


def _move_into_place(staging: Path, out: Path) -> None:
    """The complete sample in `staging` moved to `out`: renamed to it when --out is not there
    yet (one step), else moved in file by file, manifest.jsonl last, the files moved taken
    back out if the moving stops (an interrupt there left images listed nowhere)."""
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(out)
        return
    moved: list[Path] = []
    try:
        for item in sorted(staging.iterdir(), key=lambda p: p.name == "manifest.jsonl"):
            moved.append(item.replace(out / item.name))
    except BaseException:
        for path in moved:
            path.unlink(missing_ok=True)
        raise
    staging.rmdir()


def _sample_into(staging: Path, model: Any, prompts: list[str], args: argparse.Namespace,
                 batch_size: int, done: list[int]) -> None:
    """sample's PNGs and manifest.jsonl written in `staging`, a batch at a time: memory holds
    one batch's images whatever --seeds is (all of them were held until the end). `done`
    counts the images written, for the interrupt's message."""
    import itertools

    from trainer.evaluation import sample_images

    pairs = itertools.product(prompts, range(args.seeds))  # prompt-major, as before
    with (staging / "manifest.jsonl").open("w") as manifest:
        while chunk := list(itertools.islice(pairs, batch_size)):
            # each image has its own seed's noise: batch by batch, the images are the same
            images = sample_images(model, [p for p, _ in chunk], [s for _, s in chunk],
                                   args.solver, args.steps, batch_size=batch_size)
            for (prompt, seed), image in zip(chunk, images, strict=True):
                name = f"{done[0]:05d}_seed{seed}.png"
                _save_png(image, staging / name)
                manifest.write(json.dumps({"file": name, "prompt": prompt, "seed": seed}) + "\n")
                done[0] += 1


def _staging_prefix(name: str) -> str:
    """The start of the hidden directory a sample into `name` writes in: its host and process
    follow, so a later run can tell a directory whose writer is gone from one being written."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())
    return f".{name}.partial-{host}-"


def _remove_abandoned_staging(base: Path, name: str) -> None:
    """Remove what a sample into `name` killed outright (SIGKILL, a power cut: no handler
    ran) left in `base`: its hidden directories whose process, on this host, is gone. One
    whose process runs, or of another host (a shared disk), is left alone."""
    prefix = _staging_prefix(name)
    removed = 0
    for path in base.glob(f"{glob.escape(prefix)}*"):
        pid = path.name[len(prefix):].split("-", 1)[0]
        if not (path.is_dir() and pid.isdigit()) or _process_alive(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed += 1
    if removed:
        print(f"removed {removed} unfinished sample director{'y' if removed == 1 else 'ies'} "
              f"of an earlier run that was killed ({prefix}*)", file=sys.stderr)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # no signal sent: asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's, alive
        return True
    return True


def cmd_sample(args: argparse.Namespace) -> int:
    import shutil
    import uuid

    from trainer.models import load_flow_model

    problems: list[ConfigError] = []  # every one said at once, before the model loads
    prompts = _checked(problems, _sample_prompts, args.prompts)
    out = _checked(problems, _sample_out, args.out)  # before minutes of sampling, not after
    device = _checked(problems, available_device, args.device, "--device")
    spec = _checked(problems, _model_spec, args)  # sets args.model to the model named
    batch_size = _checked(problems, sampling_batch_size, args, spec.name) if spec else None
    _check_model_dir(problems, spec, args)
    # the model named (args.model, set by _model_spec) even where one of its options is
    # refused: a bad --resolution hid the prompts the shapes model cannot draw
    _check_shapes_prompts(problems, spec.name if spec is not None else args.model, prompts,
                          "--prompts", args.prompts)
    _raise_problems(problems)
    model = load_flow_model(spec, device=device)
    total = len(prompts) * args.seeds
    # written in a hidden directory beside --out (in its nearest existing parent: nothing is
    # made above --out either) and moved into place only when complete: an interrupt or a
    # failure leaves --out as it was, so the same command runs again (a half-written
    # sample's manifest.jsonl refused the re-run, its images kept)
    base = next(p for p in [*out.parents, Path(".")] if p.is_dir())
    _remove_abandoned_staging(base, out.name)
    staging = base / f"{_staging_prefix(out.name)}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()  # the umask's mode, which --out keeps when renamed (mkdtemp's is 0700)
    existed = out.exists()
    done = [0]
    try:
        _sample_into(staging, model, prompts, args, batch_size, done)
        _move_into_place(staging, out)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if not _interrupted(exc):
            raise
        kept = "left as it was" if existed else "not created"
        print(f"interrupted after {done[0]} of {total} images: nothing was kept ({out} "
              f"{kept}); run the command again to sample", file=sys.stderr)
        return 130
    print(f"{total} images (batches of {batch_size}) and manifest.jsonl in {out}")
    return 0


# how evaluate's messages about a reward's weights directory name the flag typed, not the
# config field a job's has
REWARD_PATH_SETTING = "--reward-model-path {name}=..."


def _reward_list(args: argparse.Namespace, model: str | None
                 ) -> tuple[list[str], dict[str, str]]:
    """--rewards as registry names (default: the shapes rewards for the shapes model,
    jpeg_compressibility for flux / sd3, as the studio's evaluate job) and the
    --reward-model-path directories, checked before any sampling with every problem at once
    (an unknown name hid a bad --reward-model-path and the missing weights until the next
    run): the model-backed ones' weights where they are looked for, or the reward server's
    rules. `model`: the model evaluated, None when unknown (a checkpoint that cannot be read
    names it): the checks that follow from it (its default rewards, the shapes-only rewards)
    are left out. Nothing loads here (_reward_scorer)."""
    from trainer.config import default_reward_names, reward_server_problems
    from trainer.rewards import reward_names, shapes_only_problem
    from trainer.rewards.models import MODEL_REWARDS, weights_problem

    problems: list[ConfigError] = []
    names = [n.strip() for n in (args.rewards or "").split(",") if n.strip()]
    # "--rewards ," or "--rewards ''" (an unset shell variable) is a slip, not a wish for the
    # defaults: they are what leaving --rewards out gives (its default is None, not "")
    if args.rewards is not None and not names:
        raise ConfigError("--rewards", f"{args.rewards!r} names no reward; known: "
                          f"{reward_names()}")
    # "preference" is scored by --preference-model's fitted model, not a registry reward
    asked_preference = "preference" in names
    names = [n for n in names if n != "preference"]
    if asked_preference and not args.preference_model:
        problems.append(ConfigError("--rewards", "'preference' is scored by a fitted "
                                    "preference model: give its file with --preference-model "
                                    "(fit-preference's --out, or the studio's "
                                    "STORAGE_DIR/preference/vN.safetensors)"))
    if not names and not asked_preference:  # args.rewards is None: the caller knows `model`
        names = default_reward_names("evaluate", model or "")
    if unknown := [n for n in names if n not in reward_names()]:
        problems.append(ConfigError("--rewards", f"unknown reward(s) {unknown}; known: "
                                    f"{reward_names()}"))
    # the rule train's config applies: the shapes rewards mean nothing on FLUX's or SD3's images
    known = [n for n in names if n not in unknown]
    if model is not None and (problem := shapes_only_problem(known, model)) is not None:
        problems.append(ConfigError("--rewards", problem))
    paths = {}
    for pair in args.reward_model_path:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            problems.append(ConfigError("--reward-model-path",
                                        f"must look like NAME=DIR, got {pair!r}"))
        elif name not in names:  # a typo in either list would otherwise go unnoticed
            problems.append(ConfigError("--reward-model-path", f"{name!r} is not among the "
                                        f"rewards evaluated ({', '.join(names)})"))
        elif name in paths and paths[name] != path:  # the last one won without a word
            problems.append(ConfigError("--reward-model-path", f"{name!r} given twice, "
                                        f"{paths[name]!r} and {path!r}: give it once"))
        else:
            paths[name] = path
    if args.reward_server_url and known:  # a job's reward_server_url rules, the CLI's names
        flags = {"reward_server_url": "--reward-server-url",
                 "reward_model_paths": "--reward-model-path"}
        problems += [ConfigError(flags[p.field], p.message)
                     for p in reward_server_problems(args.reward_server_url, paths)]
    else:
        problems += [ConfigError("", problem) for n in known if n in MODEL_REWARDS
                     and (problem := weights_problem(n, paths,
                                                     paths_setting=REWARD_PATH_SETTING))]
    _raise_problems(problems)
    return names, paths


def _reward_scorer(args: argparse.Namespace, names: list[str], paths: dict[str, str],
                   device: Any) -> Any:
    """What scores the rewards `names` (_reward_list's, checked): the reward server at
    --reward-server-url (up and serving them: RewardServerError names the URL, one line), else
    this process, the model-backed ones loaded from `paths` or REWARD_MODELS_DIR on `device`;
    None for none (--rewards preference: the preference model alone). Called once every
    other problem of the command is ruled out: the reward models load for nothing no more."""
    from trainer.rewards.remote import prepare_scorer

    if args.reward_server_url and names:
        return prepare_scorer(names, args.reward_server_url)
    if not names:
        return None
    # RewardWeightsMissing names the reward and the files; weights that are there but do not
    # load (empty, truncated) are one line naming the reward and its directory, before any
    # sampling rather than after it
    return prepare_scorer(names, "", paths, device, paths_setting=REWARD_PATH_SETTING)


def _preference_fit_problem(path: str, model: Any) -> str | None:
    """Why the whole preference model at `path` cannot score `model`'s images, from its
    header's fit settings: fitted on the shapes world's features for another model (the rule
    the studio's train jobs apply), or on CLIP features whose clip_path is gone (the encoder
    loads only when the first images are scored)."""
    from trainer.rewards.preference import (
        clip_dir_problem,
        model_features_problem,
        model_file_problem,
        saved_fit_fields,
    )

    fields = saved_fit_fields(path)  # weights_problem has read this header whole
    if (problem := model_file_problem(path)) is not None:  # damaged inside: said, not traced
        return problem
    features = fields.get("features", "shapes")
    if isinstance(model, str) and (problem := model_features_problem(features, model)):
        return f"{path} {problem}"
    if features == "clip" and (problem := clip_dir_problem(fields.get("clip_path", ""))):
        return f"{path} scores with the CLIP model at its clip_path: {problem}"
    return None


def _preference_model_problems(path: str, model: str | None) -> list[ConfigError]:
    """Why evaluate's --preference-model cannot score `model`'s images, from the file's header
    alone (before any sampling)."""
    from trainer.models import weights_problem

    if not Path(path).is_file():
        problem = (f"{path} is not a file; give a fitted preference model (fit-preference's "
                   "--out, or the studio's STORAGE_DIR/preference/vN.safetensors)")
    else:
        problem = (weights_problem("preference", path, weight_format="preference-model")
                   or _preference_fit_problem(path, model))
    return [ConfigError("--preference-model", problem)] if problem else []


def _with_preference(scorer: Any, model: PreferenceModel) -> Callable[..., dict[str, Any]]:
    """A scorer (names, images, prompts) -> {name: scores} that scores "preference" with
    `model`, the ensemble's mean score (its Bradley-Terry utility, with no uncertainty
    penalty: that shapes a training reward, not a measurement), and the other names as
    `scorer` does (in this process when None)."""
    from trainer.rewards import compute_rewards
    from trainer.rewards.preference import image_batch

    def score(names: list[str], images: Any, prompts: list[str]) -> dict[str, Any]:
        others = [n for n in names if n != "preference"]
        out = dict((scorer or compute_rewards)(others, images, prompts)) if others else {}
        out["preference"] = model.scores(image_batch(list(images)), prompts)
        return out

    return score


def _prompt_list(path: str | None) -> list[str] | None:
    from trainer.evaluation import read_prompts

    if path is None:
        return None
    if Path(path).is_dir():  # was "does not exist", sending the user to look for a typo
        raise ConfigError("--prompts-file", f"{path} is a directory, not a file: give the "
                          "prompts file in it (.txt, .jsonl or .json)")
    if not Path(path).is_file():
        raise ConfigError("--prompts-file", f"{path} does not exist")
    try:
        prompts = read_prompts(path)
    except ValueError as exc:  # names the file and every bad line
        raise ConfigError("--prompts-file", str(exc)) from None
    except OSError as exc:  # unreadable (permissions): one line, not a traceback
        raise ConfigError("--prompts-file", f"{path} cannot be read ({exc.strerror})") from None
    if not prompts:
        raise ConfigError("--prompts-file", f"{path} holds no prompts")
    return prompts


def _checked(problems: list[ConfigError], check: Callable[..., Any], *args: Any,
             **kwargs: Any) -> Any:
    """check(*args), or None with its problems added to `problems` (a ConfigError's, or the
    message of a FileNotFoundError or ValueError, which names its own subject): a command
    runs its independent checks in turn and says every problem at once."""
    try:
        return check(*args, **kwargs)
    except ConfigErrors as exc:
        problems.extend(exc.errors)
    except ConfigError as exc:
        problems.append(exc)
    except (FileNotFoundError, ValueError) as exc:
        problems.append(ConfigError("", str(exc)))  # printed as it is (_command)
    return None


def _raise_problems(problems: list[ConfigError]) -> None:
    if problems:
        raise ConfigErrors(problems)


def cmd_evaluate(args: argparse.Namespace) -> int:
    import torch

    from trainer.evaluation import EVAL_SEEDS, evaluate
    from trainer.models import load_flow_model, uses_model_directory

    problems: list[ConfigError] = []  # every one said at once, before any work
    # the JSON is written after the whole evaluation: its path is checked before it
    out = _checked(problems, _out_path, args.out, directory=False) if args.out else None
    spec = _checked(problems, _model_spec, args)  # headers only: which model, the rewards
    batch_size = _checked(problems, sampling_batch_size, args, spec.name) if spec else None
    _check_model_dir(problems, spec, args)
    device = _checked(problems, available_device, args.device, "--device")
    # the model the checks below judge by: the one named (args.model, which _model_spec sets
    # even where it refuses an option: a bad --resolution hid every rewards and prompts
    # problem), None only when a checkpoint that cannot be read would name it
    model_name = spec.name if spec is not None else args.model
    # before the model loads: a bad name costs nothing (the default rewards follow the model:
    # with none known, only the rewards given are checked)
    rewards, reward_paths = (_checked(problems, _reward_list, args, model_name)
                             if model_name is not None or args.rewards is not None
                             else None) or (None, None)
    if args.preference_model:
        problems += _preference_model_problems(args.preference_model, model_name)
    prompts = _checked(problems, _prompt_list, args.prompts_file)
    # flux, sd3: the 48 shapes prompts (evaluate's default) are the shapes model's, as train;
    # said with a bad --resolution beside it too
    if model_name and args.prompts_file is None and (
            problem := missing_prompts_problem(model_name, [], evaluate=True)) is not None:
        problems.append(ConfigError("--prompts-file", problem))
    _check_shapes_prompts(problems, model_name, prompts, "--prompts-file", args.prompts_file)
    _raise_problems(problems)
    scorer = _reward_scorer(args, rewards, reward_paths, device)
    if args.preference_model:
        from trainer.rewards.preference import PreferenceModel

        preference = PreferenceModel.load(args.preference_model, str(device))
        scorer, rewards = _with_preference(scorer, preference), [*rewards, "preference"]
    model = load_flow_model(spec, device=device)
    seeds = tuple(range(args.seeds)) if args.seeds else EVAL_SEEDS
    result = evaluate(model, prompts, seeds=seeds, solver=args.solver, steps=args.steps,
                      rewards=rewards, batch_size=batch_size, scorer=scorer)
    # absolute: the JSON is read later, from other directories
    result["checkpoint"] = str(Path(args.checkpoint).absolute()) if args.checkpoint else "base"
    result["batch_size"] = batch_size
    # absolute, as the checkpoint: the JSON is read from other directories
    result["prompts"] = (str(Path(args.prompts_file).absolute()) if args.prompts_file
                         else "the shapes prompts")
    # what the numbers were measured with, so two result files can be told apart
    real = uses_model_directory(spec.name)
    result["setting"] = {"model": spec.name, "model_path": spec.path or None,
                         # the pixels drawn: the model's own default resolved (the words "the
                         # model's default" told two result files' sizes apart by nothing)
                         "resolution": getattr(model, "resolution", None) or spec.resolution,
                         "guidance_scale": spec.guidance_scale if real else None,
                         "mixed_precision": spec.mixed_precision if real else None,
                         # what it came to ('auto' is bf16 on CUDA, fp32 on a CPU), so a CPU
                         # result and a bf16 GPU one are told apart
                         "dtype": str(model.compute_dtype or torch.float32).removeprefix("torch."),
                         "solver": args.solver, "steps": args.steps,
                         "preference_model": (str(Path(args.preference_model).resolve())
                                              if args.preference_model else None)}
    text = json.dumps(result, indent=2)
    print(text)
    for name, entry in result["rewards"].items():  # one line each, for a terminal or a grep
        print(f"mean {name}: {entry['mean']:.6g} (std {entry['std']:.6g})", file=sys.stderr)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    return 0


# what train-base writes into its --out (and base-stepN.safetensors with --save-every)
TRAIN_BASE_FILES = ("base.safetensors", "train_base_log.jsonl")


def _train_base_out(path: str) -> Path:
    """train-base's --out: a directory that holds no earlier train-base run (a second one
    there replaced base.safetensors and the log and left the first run's base-stepN files
    beside the new ones, as if one run had written them all)."""
    out = _out_path(path, directory=True)
    if found := sorted(p.name for p in out.glob("*") if p.name in TRAIN_BASE_FILES
                       or re.fullmatch(r"base-step\d+\.safetensors", p.name)):
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise ConfigError("--out", f"{out} holds an earlier train-base run ({shown}); give a "
                          "new --out, or delete it to train there again")
    return out


def cmd_train_base(args: argparse.Namespace) -> int:
    from trainer.models.shapes_dit import ShapesDiTConfig
    from trainer.shapes.base_training import BaseTrainingConfig, train_base

    def given(**options):  # the options the user set; the dataclasses hold the defaults
        return {k: v for k, v in options.items() if v is not None}

    config = BaseTrainingConfig(bf16=args.bf16, **given(
        steps=args.steps, batch_size=args.batch_size, learning_rate=args.lr, seed=args.seed,
        save_every=args.save_every, ema_decay=args.ema_decay, time_sampling=args.time_sampling,
        pool_size=args.pool_size))
    model_config = ShapesDiTConfig(**given(
        width=args.width, depth=args.depth, patch_size=args.patch_size,
        position_embedding=args.position_embedding, mlp_conv=args.mlp_conv,
        xavier_init=args.xavier_init))
    # every problem at once (the width, --out and the device were each said only once the
    # ones before them were fixed)
    problems: list[ConfigError] = []
    # the attention heads split the width, and the 2D sine-cosine positions quarter it
    multiple = math.lcm(model_config.heads, 4)
    if model_config.width % multiple:
        problems.append(ConfigError("--width", f"must be a multiple of {multiple}, got "
                                    f"{model_config.width}"))
    out = _checked(problems, _train_base_out, args.out)
    device = _checked(problems, available_device, args.device, "--device")
    _raise_problems(problems)
    assert out is not None and device is not None
    # Ctrl-C raises KeyboardInterrupt even where the shell that started the command ignores
    # SIGINT (a background job's does, and Python then leaves it ignored), as train's own
    # handler does: the run stops with its EMA kept rather than running on for hours
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        path = train_base(out, config, model_config, device=str(device))
    except KeyboardInterrupt as exc:
        # said what was kept (the EMA so far) and how to go on: the same command was refused
        # for the directory it had left, and nothing said why
        partial = getattr(exc, "partial", None)
        kept = (f"the EMA of the steps done is in {partial} (a base_checkpoint for train, a "
                "--checkpoint for sample)" if partial else "no step had finished: nothing kept")
        print(f"interrupted: {kept}; base.safetensors was not written. train-base starts "
              f"over in a new --out (or in {out} once emptied)", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGINT, previous)
    print(f"base checkpoint: {path}")
    return 0


def _fresh_run_directory(base: str) -> str:
    """`base`, or `base-2`, `base-3` ... : the first that holds no run, so that a second
    demo starts a new run instead of being refused for the first one's directory."""
    from trainer.run_dir import RUN_FILES

    for n in range(1, 10_000):
        out = base if n == 1 else f"{base}-{n}"
        if not any((Path(out) / name).exists() for name in RUN_FILES):
            return out
    return base  # refused with the usual message


def cmd_demo(args: argparse.Namespace) -> int:
    from trainer.run_dir import RUN_FILES

    args.config, args.method, args.set = "shapes-quick-demo", None, []
    if args.out:
        # train's refusal said "--resume continues it", a flag demo does not have: each demo
        # starts a new run, and a given --out that holds one is refused here in demo's words
        out = _out_path(args.out, directory=True)
        if found := [name for name in RUN_FILES if (out / name).exists()]:
            raise ConfigError("--out", f"{out} holds an earlier run ({', '.join(found)}); "
                              "demo starts a new run each time: give a new --out, or leave "
                              "--out out (runs/demo, then runs/demo-2, -3 ...); `train --out "
                              f"{out} --resume` continues that one")
    args.out = args.out or _fresh_run_directory("runs/demo")
    args.resume, args.no_progress = False, False
    return cmd_train(args)


def _add_sampling_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--solver", choices=["dpm++", "euler"], default="dpm++",
                        help="deterministic ODE solver (default dpm++)")
    parser.add_argument("--steps", type=solver_steps, default=8,
                        help=f"solver steps, 1 to {MAX_SOLVER_STEPS} (default 8)")
    parser.add_argument("--device", type=device_name, default="auto", help="cpu, cuda, "
                        "cuda:N or auto (default: cuda if there is one)")
    from trainer.models import model_names  # the registry, torch-free to import

    parser.add_argument("--model", choices=model_names(),
                        help="model adapter, one of the registry's (trainer.models.model_names()); "
                        "default: the checkpoint's run's, else shapes")
    parser.add_argument("--model-path", default="", help="flux / sd3: the diffusers-format "
                        "model directory (any local path; default: the checkpoint's run's)")
    parser.add_argument("--resolution", type=positive_int, default=None, help="image side in "
                        "pixels (default: the checkpoint's run, else the model's; shapes: 32 "
                        "only)")
    parser.add_argument("--guidance-scale", type=guidance_scale, default=None,
                        help="FLUX.1-dev guidance / SD3 CFG scale (default: the checkpoint's "
                        "run, else the model's preset: 3.5 for flux, 4.5 for sd3)")
    precisions = TrainConfig.__dataclass_fields__["mixed_precision"].metadata["choices"]
    parser.add_argument("--mixed-precision", choices=precisions, default=None,
                        help="weights and compute dtype, as the train config's mixed_precision: "
                        "bf16, no (fp32), or auto (bf16 for flux / sd3 on CUDA, else fp32). "
                        "Default: the checkpoint's run's, else auto")
    # < 1 refused as it is parsed, with the other options' type errors (the command's own
    # check said it only once they were fixed)
    parser.add_argument("--batch-size", type=positive_int, default=None,
                        help="images solved and decoded per batch; the images do not change. "
                        f"Default: {SHAPES_SAMPLE_BATCH} for shapes; for flux / sd3 the "
                        "checkpoint's run's rollout_batch_size, else the model's preset's "
                        f"({REAL_MODEL_SAMPLE_BATCH}). Lower it when a large model runs out of "
                        "memory")


# `--help` of the commands that take `--set KEY=VALUE` lists the fields it can set, from the
# fields' own metadata (help text, default, bounds, choices), so a user needs no source file to
# find a name; the same texts the studio's form shows as tooltips. Wrapped to the terminal as
# argparse wraps the options (its width: COLUMNS, else the terminal's, less 2).
def _help_width() -> int:
    return max(60, min(100, shutil.get_terminal_size().columns - 2))


def _field_line(name: str, default: Any, limits: list[str]) -> str:
    shown = json.dumps(default) if isinstance(default, (dict, list, str)) else repr(default)
    return f"  {name} (default {shown}{'; ' if limits else ''}{'; '.join(limits)})"


def _number_text(value: float) -> str:
    return repr(value)  # as the config's errors write bounds; a seed's in full


def _bounds_text(low: Any, high: Any, low_open: bool = False, high_open: bool = False) -> str:
    if low is not None and high is not None:
        return (f"{'(' if low_open else '['}{_number_text(low)}, {_number_text(high)}"
                f"{')' if high_open else ']'}")
    if low is not None:
        return f"{'>' if low_open else '>='} {_number_text(low)}"
    return f"{'<' if high_open else '<='} {_number_text(high)}"


def _wrapped_help(text: str) -> str:
    # unbroken words: "double-stream" and module names stay whole for copying
    return textwrap.fill(text, _help_width(), initial_indent=" " * 6, subsequent_indent=" " * 6,
                         break_on_hyphens=False, break_long_words=False)


def _wrapped(text: str) -> str:
    """A description, wrapped as argparse would (RawDescriptionHelpFormatter keeps it as is)."""
    return textwrap.fill(text, _help_width())


def train_fields_epilog() -> str:
    """TrainConfig's fields by group, for `train --help`."""
    groups: dict[str, list[str]] = {}
    for row in TrainConfig.describe():
        limits = []
        if row["choices"]:
            limits.append("one of " + ", ".join(map(str, row["choices"])))
        if row["min"] is not None or row["max"] is not None:
            limits.append(_bounds_text(row["min"], row["max"]))
        groups.setdefault(row["group"], []).append(
            _field_line(row["name"], row["default"], limits) + "\n" + _wrapped_help(row["help"]))
    parts = ["config fields (--set KEY=VALUE, or keys of a --config JSON file; the defaults "
             "below are before a preset's values):"]
    for group, lines in groups.items():
        parts.append(f"\n{group}:\n" + "\n".join(lines))
    return "\n".join(parts)


def fit_fields_epilog() -> str:
    """FitConfig's fields, for `fit-preference --help` (device is --device's)."""
    import dataclasses

    from trainer.rewards.fit_config import FitConfig  # torch-free

    lines = []
    for f in dataclasses.fields(FitConfig):
        if f.name == "device":
            continue
        meta = f.metadata
        limits = []
        if "choices" in meta:
            limits.append("one of " + ", ".join(meta["choices"]))
        low = meta.get("ge", meta.get("gt"))
        high = meta.get("le", meta.get("lt"))
        if low is not None or high is not None:
            limits.append(_bounds_text(low, high, "gt" in meta, "lt" in meta))
        lines.append(_field_line(f.name, f.default, limits) + "\n" + _wrapped_help(meta["help"]))
    return "fit fields (--set KEY=VALUE):\n" + "\n".join(lines)


# a value argparse refused: parsing goes on to find the other options' mistakes
_REFUSED = object()


class AllErrorsParser(argparse.ArgumentParser):
    """argparse that says every option it refuses at once: a wrong --steps no longer hides a
    wrong --seeds behind it (each was found only after the one before was fixed). Type and
    choice errors are collected while parsing and said together, one `error:` line each,
    after argparse's usage line, with its exit status 2. Subcommands' parsers are of this
    class too (add_subparsers makes them of the parent's)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refused: list[str] = []

    def _get_value(self, action: argparse.Action, arg_string: str) -> Any:
        try:
            return super()._get_value(action, arg_string)
        except argparse.ArgumentError as exc:
            self.refused.append(str(exc))
            return _REFUSED

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if value is _REFUSED:
            return
        if isinstance(action, argparse._SubParsersAction):
            # an unknown command ends the parse here: collected and let through, the
            # subparsers action refused it again ("unknown parser"), a second line for one typo
            if value not in action.choices:
                import difflib

                close = difflib.get_close_matches(value, list(action.choices), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise argparse.ArgumentError(action, f"invalid choice: {value!r} (choose from "
                                             f"{', '.join(action.choices)}){hint}")
            return
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as exc:
            self.refused.append(str(exc))

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._given = list(sys.argv[1:] if args is None else args)
        parsed, extras = super().parse_known_args(args, namespace)
        if extras and self._subparsers is None:
            # a command's parser (one with no commands under it) says what it does not know
            # itself, beside its other refusals: handed up, the top parser said it in its own
            # usage and name, the values with the options ("python -m trainer: error:
            # unrecognized arguments: --confg tiny"), with no nearest option of the command
            self.refused += self._unknown_options(extras)
        if self.refused:
            self.error(self.refused.pop())
        return parsed, extras

    def _option_like(self, token: str) -> bool:
        """Whether argparse takes `token` for an option, not a value: a dash first, no space
        (`--prompts "--my prompts.txt"` is a value), no negative number."""
        return (token.startswith("-") and token not in ("-", "--") and " " not in token
                and not self._negative_number_matcher.match(token))

    def _unknown_options(self, extras: list[str] | None = None) -> list[str]:
        """The lines saying what this parser does not know, each with the nearest option it
        has. From argparse's `extras` (every argument it left): one line per unknown option
        with the values after it, and one for stray words before any. Without them, from the
        arguments given (a parse that stopped at a missing required option, before argparse
        said what it did not know, so `--rewadrs count` was said as missing alone): one line
        per option that is no option of this parser nor one it abbreviates."""
        import difflib

        known = list(self._option_string_actions)

        def line(words: list[str]) -> str:
            name = words[0].split("=", 1)[0]
            # a close cutoff: --promts finds --prompts, but --bogus no --host
            close = (difflib.get_close_matches(name, known, n=1, cutoff=0.75)
                     if self._option_like(name) else [])
            hint = f"; did you mean {close[0]}?" if close else ""
            return f"unrecognized arguments: {' '.join(words)}{hint}"

        if extras is not None:
            groups: list[list[str]] = []
            for token in map(str, extras):
                if self._option_like(token) or not groups:
                    groups.append([token])
                else:
                    groups[-1].append(token)
            return [line(group) for group in groups]
        return [line([name]) for name in (str(token).split("=", 1)[0]
                                          for token in getattr(self, "_given", []))
                if self._option_like(name) and not any(o.startswith(name) for o in known)]

    def error(self, message: str) -> NoReturn:
        lines, self.refused = [*self.refused, message], []
        if message.startswith("the following arguments are required"):
            lines += self._unknown_options()
        self.print_usage(sys.stderr)
        for line in dict.fromkeys(lines):
            sys.stderr.write(f"{self.prog}: error: {line}\n")
        sys.exit(2)


class _Once(argparse.Action):
    """An option a command takes once (--checkpoint of sample and evaluate): given twice,
    argparse kept the last and dropped the first without a word, so `evaluate --checkpoint
    A --checkpoint B` scored B alone."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        earlier = getattr(namespace, self.dest, None)
        if earlier is not None and isinstance(parser, AllErrorsParser):
            parser.refused.append(
                f"argument {option_string}: given more than once ({earlier}, {values}); "
                f"{parser.prog} takes one: run it once for each")
        setattr(namespace, self.dest, values)


def build_parser() -> argparse.ArgumentParser:
    parser = AllErrorsParser(prog="python -m trainer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    train_help = "Neighbor GRPO or the SDE baseline (model shapes, flux or sd3)"
    train = sub.add_parser("train", help=train_help, description=_wrapped(
                           train_help + ": a preset or JSON config with --set overrides; "
                           "checkpoints and metrics under --out"),
                           epilog=train_fields_epilog(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("--method", choices=["neighbor", "sde"], help="overrides config.method")
    train.add_argument("--config", help=f"a JSON file or a preset: {', '.join(PRESETS)} "
                       "(default: the model's preset, flux-lora or sd3-lora for --set "
                       "model=flux or sd3, else shapes-quick-demo)")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override one config field (repeatable)")
    train.add_argument("--prompts-file", help="training prompts: .txt (one per line), .jsonl "
                       "with a \"prompt\" field, or .json (an array of strings or of such "
                       "objects, as HPDv2's files); needed for flux and sd3 (default for "
                       "shapes: its 48 prompts)")
    train.add_argument("--out", required=True, help="run directory")
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    train.add_argument("--no-progress", action="store_true", help="no progress bar: a plain "
                       "line every 10 iterations instead (logs, CI)")
    train.set_defaults(func=cmd_train)

    sample_help = "deterministic ODE sampling, one PNG per (prompt, seed)"
    sample = sub.add_parser("sample", help=sample_help, description=sample_help)
    sample.add_argument("--checkpoint", action=_Once, help="a checkpoint directory (checkpoints/iter-000050) or a "
                        "shapes model.safetensors; left out: the base model alone")
    # --prompts-file too: train and evaluate spell it so, and a user who learnt it there
    # was told "the following arguments are required: --prompts"
    sample.add_argument("--prompts", "--prompts-file", dest="prompts", required=True,
                        help="prompts file: .txt (one per line), .jsonl with a \"prompt\" "
                        "field, or .json (an array of strings or of such objects)")
    sample.add_argument("--seeds", type=seed_count, default=4,
                        help=f"seeds 0..N-1 per prompt, N at most {MAX_SEEDS} (default 4)")
    sample.add_argument("--out", required=True, help="directory for the PNGs")
    _add_sampling_options(sample)
    sample.set_defaults(func=cmd_sample)

    evaluate_help = ("each reward's mean over prompts x seeds (default: the shapes rewards and "
                     "exact-count accuracy, 48x20)")
    evaluate = sub.add_parser("evaluate", help=evaluate_help, description=evaluate_help)
    evaluate.add_argument("--checkpoint", action=_Once, help="as for sample; left out: the base model")
    evaluate.add_argument("--out", help="also write the JSON here")
    evaluate.add_argument("--rewards", default=None, help="comma-separated reward names, e.g. "
                          "hpsv2,pickscore,clip_score,aesthetic (default: count, exact_count, "
                          "color, shape, combined for shapes; jpeg_compressibility otherwise)")
    evaluate.add_argument("--preference-model", default="", metavar="FILE",
                          help="a fitted preference model (fit-preference's --out, or the "
                          "studio's STORAGE_DIR/preference/vN.safetensors): also score the "
                          "reward 'preference', its ensemble's mean score; --rewards may name "
                          "'preference' to score it alone or beside others")
    evaluate.add_argument("--reward-model-path", action="append", default=[],
                          metavar="NAME=DIR", help="weights directory of a model-backed reward "
                          "(repeatable; default: $REWARD_MODELS_DIR/NAME)")
    evaluate.add_argument("--reward-server-url", default="", metavar="URL",
                          help="score on this reward server (python -m trainer.rewards.serve) "
                          "instead of loading the reward models here, as a job's "
                          "reward_server_url")
    evaluate.add_argument("--prompts-file", help="held-out prompts: .txt (one per line), "
                          ".jsonl with a \"prompt\" field, or .json (an array of strings or of "
                          "such objects, as HPDv2's test.json); needed for flux and sd3 (default for "
                          "shapes: its 48 prompts)")
    evaluate.add_argument("--seeds", type=seed_count, default=None,
                          help=f"seeds 0..N-1 per prompt, N at most {MAX_SEEDS} (default 20)")
    _add_sampling_options(evaluate)
    evaluate.set_defaults(func=cmd_evaluate)

    base_help = "train the shapes base model (flow matching)"
    base = sub.add_parser("train-base", help=base_help, description=base_help)
    base.add_argument("--out", required=True, help="run directory (checkpoints, training log)")
    # defaults left to BaseTrainingConfig / ShapesDiTConfig (the shipped base's recipe), read
    # when the command runs: building the parser must not import torch
    base.add_argument("--steps", type=positive_int, help="optimizer steps (default 8000)")
    base.add_argument("--batch-size", type=positive_int, help="images per step (default 256)")
    base.add_argument("--lr", type=positive_float, help="AdamW learning rate (default 1e-3)")
    base.add_argument("--width", type=positive_int,
                      help="transformer width, a multiple of 4 (default 128)")
    base.add_argument("--depth", type=positive_int, help="transformer blocks (default 6)")
    base.add_argument("--seed", type=non_negative_int,
                      help="seed of the weights, the images and the noise (default 0)")
    base.add_argument("--patch-size", type=int, choices=[2, 4, 8],
                      help="side of the image patches the transformer reads, in pixels "
                           "(default 4)")
    base.add_argument("--ema-decay", type=ema_decay,
                      help="decay of the weights' moving average, the weights saved and "
                           "sampled (default 0.999)")
    base.add_argument("--time-sampling", choices=["uniform", "logit_normal"],
                      help="how the training timesteps are drawn (default uniform)")
    base.add_argument("--save-every", type=non_negative_int,
                      help="keep intermediate checkpoints every N steps (default 0: none)")
    base.add_argument("--bf16", action="store_true", help="bf16 autocast (GPU)")
    base.add_argument("--position-embedding", choices=["learned", "sincos"],
                      help="patch positions: a learned table or fixed 2D sine-cosine "
                           "(default sincos)")
    base.add_argument("--mlp-conv", action=argparse.BooleanOptionalAction,
                      help="a depthwise 3x3 convolution over the patch grid in every MLP "
                           "(default on)")
    base.add_argument("--xavier-init", action=argparse.BooleanOptionalAction,
                      help="DiT's xavier-uniform initialisation of the linear layers "
                           "(default on)")
    base.add_argument("--pool-size", type=non_negative_int,
                      help="render this many images once and draw batches from them on the "
                           "device (default 300,000; 0: render every batch)")
    base.add_argument("--device", type=device_name, default="auto",
                      help="cpu, cuda, cuda:N or auto (default: cuda if there is one)")
    base.set_defaults(func=cmd_train_base)

    demo_help = "a short Neighbor GRPO run of the shapes model (on a GPU where there is one)"
    demo = sub.add_parser("demo", help=demo_help, description=demo_help + " (the "
                          "shapes-quick-demo preset; the same as `train --config "
                          "shapes-quick-demo`)")
    demo.add_argument("--out", default=None, help="run directory (default runs/demo, or "
                      "runs/demo-2, -3 ... when it holds a run)")
    demo.set_defaults(func=cmd_demo)
    fit_help = "fit a human-preference reward model to pairwise votes (Bradley-Terry)"
    fit = sub.add_parser("fit-preference", help=fit_help, description=_wrapped(fit_help + ": from a "
                         "JSONL votes file in the studio's export format (GET /api/votes/"
                         "export): prompt, outcome (a, b, tie, both_bad, skip), image_0_path "
                         "(the left image, 'a'), image_1_path, and vote_id when there is one. "
                         "Train on it with --set preference_model=OUT and a 'preference' "
                         "reward weight."), epilog=fit_fields_epilog(),
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    fit.add_argument("--votes", required=True, help="the JSONL votes file")
    fit.add_argument("--images", default="", help="the directory the image paths are relative "
                     "to (the studio's STORAGE_DIR for its export; default: the votes file's "
                     "directory)")
    fit.add_argument("--out", required=True, help="the model file to write (.safetensors)")
    fit.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="a FitConfig field (trainer/rewards/fit_config.py: epochs, ensemble, "
                     "features, clip_path, warm_start_epochs, seed, ...); repeatable")
    fit.add_argument("--device", type=device_name, default="auto", help="cpu, cuda, cuda:N "
                     "or auto (default: cuda if there is one)")
    fit.add_argument("--warm-start", default="", help="a model fitted before on some of these "
                     "votes: start from it (FitConfig.warm_start_epochs) when its network, seed "
                     "and held-out votes match")
    fit.add_argument("--include-excluded", action="store_true", help="fit on votes the studio "
                     "marked excluded too (left out by default, as the studio leaves them out)")
    fit.set_defaults(func=cmd_fit_preference)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _command(args)
    except Exception as exc:
        # a second Ctrl-C lands wherever the run is: inside an import (matplotlib loading its
        # backend) it came back as an ImportError caused by the KeyboardInterrupt, and the
        # user got a traceback instead of the one line
        if not _interrupted(exc):
            raise
        print("interrupted", file=sys.stderr)
        return 130


def _interrupted(exc: BaseException | None) -> bool:
    """Whether `exc` is, or was caused by, a KeyboardInterrupt."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _command(args: argparse.Namespace) -> int:
    """The command's exit status, its expected errors said in one line each."""
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except ConfigError as exc:
        for err in getattr(exc, "errors", [exc]):  # ConfigErrors lists every bad field
            # a command-line option is named as it was typed, a config field as a field, and
            # a message that names its own subject (a file, a reward's directory) as it is
            if not err.field:
                print(f"error: {err.message}", file=sys.stderr)
                continue
            where = err.field if err.field.startswith("--") else f"config field '{err.field}'"
            print(f"error: {where}: {err.message}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        # a reward server that is down or lacks a reward (checked as the job starts, before
        # --out is written): its message names the URL and what to do; any other
        # RuntimeError is a bug, traced back
        from trainer.loop import TrainingDiverged, TrainingOutOfMemory
        from trainer.rewards.remote import RewardServerError

        if isinstance(exc, (TrainingDiverged, TrainingOutOfMemory)):
            # the run stopped before a bad or impossible iteration; its message names what to
            # change, and `train --resume --set FIELD=VALUE` changes it
            print(f"error: {exc} (train --resume --set FIELD=VALUE goes on from there)",
                  file=sys.stderr)
            return 1
        if not isinstance(exc, RewardServerError):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2


__all__ = ["main", "build_parser", "TrainConfig"]
