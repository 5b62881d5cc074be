"""FitConfig: how a human-preference model is fitted to votes, described once.

The trainer's fit (`trainer.rewards.preference.fit_preference_model`) reads it, and a caller
that takes fit settings from users (a job API, a form) builds its schema from its fields
(`fit_fields`): the same names, defaults, help texts and allowed values. Each field's
metadata carries its help text and its bounds in pydantic's words (`ge`, `gt`, `le`, `lt`,
`max_length`, `pattern`, `choices`), so a schema or a form needs no second copy.

This module imports no torch, so a schema can be built from it where torch is never loaded.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

# one bound for every seed, one for every text (trainer.config imports no torch)
from trainer.config import MAX_SEED, MAX_TEXT

FEATURES = ("shapes", "clip")

# the fewest labelled votes a fit accepts: a held-out split and a training split both need some
MIN_FIT_VOTES = 4


def _help(default: Any, help: str, **bounds: Any) -> Any:
    """A FitConfig field with its help text and bounds in the field's metadata."""
    return field(default=default, metadata={"help": help, **bounds})


@dataclass
class FitConfig:
    features: str = _help("shapes", "'shapes': a small convolutional network on the pixels "
                          "and the prompt's tokens; 'clip': a frozen CLIP image-text embedding "
                          "from clip_path with a small head.", choices=FEATURES)
    clip_path: str = _help("", "Local CLIP weights (a transformers save_pretrained directory) "
                           "for features='clip'; never downloaded.", max_length=MAX_TEXT)
    width: int = _help(32, "Channels of the shapes network (features='shapes'): more fit "
                       "subtler preferences from more votes, at a cost per vote.", ge=4, le=512)
    holdout_fraction: float = _help(0.2, "Share of the votes kept out of the fit to report "
                                    "held-out pair accuracy and log-loss (none held out under "
                                    "10 usable votes).", ge=0.0, lt=1.0)
    epochs: int = _help(10, "Passes over the training votes.", ge=1, le=10_000)
    batch_size: int = _help(64, "Votes per optimizer step.", ge=1, le=65_536)
    learning_rate: float = _help(2e-3, "Peak AdamW learning rate (one-cycle schedule).",
                                 gt=0.0, le=1.0)
    weight_decay: float = _help(1e-3, "AdamW weight decay.", ge=0.0, le=1.0)
    ensemble: int = _help(5, "Scorers averaged; their disagreement marks images unlike the "
                          "voted ones (a training reward may subtract it). See "
                          "shared_features.", ge=1, le=32)
    shared_features: bool = _help(True, "Members after the first are heads on the first "
                                  "network's frozen features, each fitted to a bootstrap "
                                  "resample of the votes (shapes features only): an ensemble "
                                  "costs about one network's fit. False: whole networks, each "
                                  "on all the votes.")
    label_smoothing: float = _help(0.05, "Pull the Bradley-Terry targets this far towards 1/2 "
                                   "(a vote for a becomes 1 - s): people flip some votes, and "
                                   "a fit that believes every vote overfits the flips.",
                                   ge=0.0, lt=1.0)
    spread_pooling: bool = _help(True, "Pool, beside each attended feature's mean over the "
                                 "image, how far it spreads (features='shapes'): relations "
                                 "between objects, such as how far apart they lie, become as "
                                 "easy to read as where they are (docs/benchmarks.md: better "
                                 "log-loss on every simulated preference, and accuracy on "
                                 "`larger` and `apart`). False: the mean alone (models "
                                 "saved before this field existed load with False).")
    mirror_augment: bool = _help(False, "Train on random left-right mirrors of the shapes "
                                 "images. Off by default: it assumes nobody prefers one side, "
                                 "and a campaign for \"subject on the left\" then learns "
                                 "nothing (docs/benchmarks.md).")
    warm_start_epochs: int = _help(3, "A refit that can start from the model in use (the same "
                                   "features, width, ensemble and seed, its held-out votes "
                                   "chosen by vote id) starts from its weights and trains this "
                                   "many epochs on all the votes instead of `epochs` from "
                                   "scratch: 2.5x faster refits at the same held-out accuracy "
                                   "(docs/benchmarks.md); 0: every fit starts from scratch.",
                                   ge=0, le=10_000)
    seed: int = _help(0, "Seed of the held-out split, the initialisations, the batch order "
                      "and the bootstrap resamples.", ge=0, le=MAX_SEED)
    device: str = _help("cpu", "Torch device the fit and the model run on: 'cpu', 'cuda' or "
                        "'cuda:N' (a resolved device: the CLI's --device and the studio's job "
                        "resolve 'auto').", pattern=r"cpu|cuda(:\d+)?")


def fit_config_problems(values: dict[str, Any]) -> list[tuple[str, str]]:
    """Every (field, message) wrong in `values`, FitConfig's fields by name, checked against
    their metadata (type, choices, bounds) as the studio's job schema checks them."""
    fields = {f.name: f for f in dataclasses.fields(FitConfig)}
    problems = []
    for name, value in values.items():
        f = fields.get(name)
        if f is None:
            from trainer.config import unknown_field_message  # torch-free, as this module

            # device is no field anyone sets by name: fit-preference's --device and the
            # studio's jobs give it
            named = [n for n in fields if n != "device"]
            problems.append((name, f"{unknown_field_message(name, named)}; "
                                   f"the fields are {', '.join(named)}"))
            continue
        kind = type(f.default)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not kind:
            problems.append((name, f"must be {kind.__name__}, got {value!r}"))
            continue
        meta = f.metadata
        if "choices" in meta and value not in meta["choices"]:
            problems.append((name, f"must be one of {list(meta['choices'])}, got {value!r}"))
        for key, holds, words in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                                  ("le", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<")):
            if key in meta and not holds(value, meta[key]):
                problems.append((name, f"must be {words} {meta[key]}, got {value!r}"))
        if "pattern" in meta and not re.fullmatch(meta["pattern"], value):
            # a device torch would refuse only when the fit starts (TrainConfig.device's
            # choices say the same of a training run's)
            problems.append((name, f"must match {meta['pattern']} (a regular expression: "
                                   f"see the field's help), got {value!r}"))
        if "max_length" in meta and len(value) > meta["max_length"]:
            problems.append((name, f"at most {meta['max_length']} characters"))
    return problems


def fit_config_from(values: dict[str, Any]) -> FitConfig:
    """A FitConfig from `values` (field: value); ConfigErrors naming every bad field at once."""
    if problems := fit_config_problems(values):
        from trainer.config import ConfigError, ConfigErrors  # torch-free, as this module

        raise ConfigErrors([ConfigError(name, message) for name, message in problems])
    floats = {f.name for f in dataclasses.fields(FitConfig) if type(f.default) is float}
    return FitConfig(**{k: float(v) if k in floats else v for k, v in values.items()})


def fit_fields(exclude: tuple[str, ...] = ()) -> list[dataclasses.Field]:
    """FitConfig's fields, in order, less `exclude`."""
    return [f for f in dataclasses.fields(FitConfig) if f.name not in exclude]


__all__ = ["FEATURES", "MAX_SEED", "MIN_FIT_VOTES", "FitConfig", "fit_config_from",
           "fit_config_problems", "fit_fields"]
