"""The job kinds: each declared once, here, with its config, queue, task and who may launch
it. The API (`POST /api/jobs`, its schemas and filters), the UI, the demo
and the worker's Celery routes all read this registry (the database's `jobs.kind` is a plain
string: a kind added here needs no migration); adding a kind is one entry below plus
its task in worker/tasks.py (a test checks that every kind has one).

This module imports no database or worker code, so the models, the services and the worker can
all import it. Train jobs take `trainer.config.TrainConfig` (a dataclass with its own checks);
the other kinds take the pydantic models below.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Self, get_type_hints

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    create_model,
    field_validator,
)
from pydantic_core import PydanticCustomError

from app.limits import EVALUATE_MAX_CHECKPOINTS, MAX_CONFIG_PROMPTS, MAX_ID
from trainer.config import (  # one bound for every seed, one rule for sampling batches
    MAX_RESOLUTION,
    MAX_SEED,
    MAX_TEXT,
    REAL_MODEL_SAMPLE_BATCH,
    SHAPES_SAMPLE_BATCH,
)
from trainer.rewards.fit_config import MIN_FIT_VOTES, FitConfig, fit_fields

# a dataset's splits: each prompt is in one, set at upload (eval_fraction). Named once here:
# the upload, the prompt filter, the sampling configs' `split` and the UI read it
SPLITS: tuple[str, ...] = ("train", "eval")
SplitName = Literal[SPLITS]  # type: ignore[valid-type]
SplitChoice = Literal[(*SPLITS, "all")]  # type: ignore[valid-type]  # a split, or every prompt


class _Cfg(BaseModel):
    # allow_inf_nan=False: NaN or infinity is refused as "not a finite number" (a range check
    # alone would say NaN is "not less than 1")
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    @classmethod
    def from_stored(cls, data: dict[str, Any]) -> Self:
        """The typed form that submission validated and stored (app.services.jobs stores
        model_dump(): every field given), as the worker reads it: rebuilt, not checked again,
        as TrainConfig.from_stored rebuilds a train job's. A key this version does not know is
        still an error (a job stored by another version), naming the key."""
        from trainer.config import ConfigError, ConfigErrors, unknown_field_message

        known = list(cls.model_fields)
        if unknown := [key for key in data if key not in known]:
            raise ConfigErrors([ConfigError(key, unknown_field_message(key, known))
                                for key in unknown])
        return cls.model_construct(**data)


def _registered_model(name: str) -> str:
    """`name` when the trainer's model registry has it (trainer.config.model_choices, which
    TrainConfig.model takes too): a model added with register_model is configurable."""
    from trainer.config import model_choices

    if name not in (known := model_choices()):
        # a custom error: its message reads as TrainConfig's, without "Value error, "
        raise PydanticCustomError("model", "{message}", {
            "message": f"must be one of {list(known)}, got {name!r}"})
    return name


def _model_enum(schema: dict[str, Any]) -> None:
    # the registry as it is when the schema is made (the OpenAPI document, config-schema)
    from trainer.config import model_choices

    schema["enum"] = list(model_choices())


ModelName = Annotated[str, AfterValidator(_registered_model),
                      Field(json_schema_extra=_model_enum)]
"""A model of the trainer's registry (trainer.config.TrainConfig.model's choices)."""

def default_reward_names(kind: str, model: str) -> list[str]:
    """The rewards a `kind` job ("rollout" or "evaluate") of `model` scores by default: the
    trainer's rule (trainer.config.default_reward_names), which the CLI follows too."""
    from trainer.config import default_reward_names as trainer_default

    return trainer_default(kind, model)


def _reward_server_check(field: str, url: str, paths: dict[str, str]) -> None:
    """Refuse `field` for what TrainConfig refuses in a reward_server_url (not http(s)) or
    beside it (reward_model_paths): the same check (trainer.config.reward_server_problems),
    so a train, rollout and evaluate job take one URL alike."""
    from trainer.config import reward_server_problems

    for problem in reward_server_problems(url, paths):
        if problem.field == field:
            # a custom error: its message reads as TrainConfig's, without "Value error, "
            raise PydanticCustomError("reward_server", "{message}", {"message": problem.message})


class SamplingConfig(_Cfg):
    """The model fields of the sampling kinds (rollout, evaluate); submission fills in the
    model and the default rewards (app.services.jobs), so a stored config says what ran."""

    model: ModelName | None = Field(
        None, description="Model adapter. Empty: the checkpoints' own (a checkpoint carries its "
        "run's model); a rollout of the base model (no checkpoint) then samples 'shapes'. Given "
        "with checkpoints, it must be theirs.")
    model_path: str = Field(
        "", max_length=MAX_TEXT, description="flux / sd3: the diffusers-format model directory, "
        "under MODELS_DIR only. Needed to sample the base model; with checkpoints, empty means "
        "the directory they were trained from.")
    resolution: int = Field(0, ge=0, le=MAX_RESOLUTION, description="Image side in pixels. 0: the "
                            "checkpoint's (base model: shapes 32, flux / sd3 512). flux / sd3: a "
                            "multiple of 16; shapes: 0 or 32.")
    guidance_scale: float | None = Field(
        None, ge=0.0, le=100.0, description="FLUX.1-dev's guidance embedding / SD3's "
        "classifier-free guidance scale. Empty: the checkpoint's (base model: 3.5).")
    batch_size: int = Field(0, ge=0, le=100_000, description="Samples solved and decoded per "
                            "batch; 0: for shapes all at once (a rollout's chunk of whole groups, "
                            "~128 samples: 16 prompts at G = 8, one at G >= 128; or "
                            f"{SHAPES_SAMPLE_BATCH} evaluate images), for flux / sd3 the "
                            "rollout_batch_size its checkpoints were trained with, else the "
                            f"model's preset's ({REAL_MODEL_SAMPLE_BATCH}), set at submission. "
                            "Lower it when a large model runs out of memory; the images do not "
                            "change.")
    # before reward_model_paths: its check reads it
    reward_server_url: str = Field(
        "", max_length=MAX_TEXT, description="Score the rewards on a reward server (`python -m "
        "trainer.rewards.serve`) at this http(s) URL instead of loading reward models in the "
        "job: several jobs then share one set of models on one GPU. The job checks at its "
        "start, before sampling, that the server serves every reward it names (the server "
        "holds the weights, so reward_model_paths stays empty). Empty: score in the job's own "
        "process.")

    # both kinds score model-backed rewards (reward_names) in the job: both may place them
    reward_model_paths: dict[str, str] = Field(
        default_factory=dict, max_length=32, description="Weights directory of a model-backed "
        "reward, by name, under REWARD_MODELS_DIR or MODELS_DIR; a reward left out loads from "
        "REWARD_MODELS_DIR/<name>. Empty with reward_server_url.")

    @field_validator("reward_server_url")
    @classmethod
    def _reward_server_url(cls, url: str) -> str:
        if url:
            _reward_server_check("reward_server_url", url, {})
        return url

    @field_validator("reward_model_paths")
    @classmethod
    def _no_paths_with_a_server(cls, paths: dict[str, str], info: ValidationInfo
                                ) -> dict[str, str]:
        # absent from info.data when the URL itself was refused: one error is enough, as
        # TrainConfig reports
        url = info.data.get("reward_server_url")
        if url:
            _reward_server_check("reward_model_paths", url, paths)
        return paths


class RolloutConfig(SamplingConfig):
    """Sample groups for a dataset's prompts from a checkpoint and store them for voting."""

    dataset_id: int = Field(ge=1, le=MAX_ID, description="Dataset whose prompts are sampled.")
    checkpoint_id: int | None = Field(None, ge=1, le=MAX_ID,
                                      description="Checkpoint to sample; none = base model.")
    split: SplitChoice = Field(
        "train", description="The dataset's prompts sampled: its 'train' or 'eval' split (set "
        "at upload) or 'all'.")
    max_prompts: int | None = Field(None, ge=1, le=100_000, description="Sample only the "
                                    "first N prompts of the split, in upload order; empty: "
                                    "every prompt of the split.")
    group_size: int = Field(8, ge=2, le=256, description="Samples per group (G).")
    sigma: float = Field(0.3, ge=0.0, le=1.0, description="Neighbourhood radius of the noises.")
    solver: Literal["dpm++", "euler"] = Field(
        "dpm++", description="ODE solver from noise to image: DPM-Solver++(2M) or Euler, on "
        "the model's own (shifted) schedule.")
    steps: int = Field(8, ge=2, le=1000, description="Solver steps per sample (T).")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Noise seed: each prompt's group "
                      "noises follow from it and the prompt's id (the seed drawn is stored "
                      "with the group), so the same seed samples the same noises again.")
    reward_names: list[str] = Field(default_factory=list, max_length=32,
                                    description="Rewards scored on each sample (registry "
                                    "names); empty: count, color and shape for the shapes "
                                    "model, jpeg_compressibility for flux / sd3.")


class EvaluateConfig(SamplingConfig):
    """Fixed prompts and seeds from checkpoints, scored with any set of rewards; images feed
    cross-checkpoint votes, reward means are stored on each checkpoint (the leaderboard)."""

    checkpoint_ids: list[Annotated[int, Field(ge=1, le=MAX_ID)]] = Field(
        min_length=1, max_length=EVALUATE_MAX_CHECKPOINTS, description="Distinct checkpoints: each is scored with "
        "the rewards; two or more also give cross-checkpoint pairs to vote on.")
    include_base: bool = Field(False, description="Also sample and score the base model the "
                               "checkpoints were fine-tuned from (their model and model "
                               "directory, without their weights), on the same prompts and "
                               "seeds: it joins the leaderboard as a checkpoint named 'base "
                               "<model> (<directory>)', and the arena pairs it with each "
                               "checkpoint. Put first in checkpoint_ids at submission; the "
                               "checkpoints must share one base.")
    dataset_id: int | None = Field(None, ge=1, le=MAX_ID, description="Dataset whose "
                                   "`split` prompts are evaluated when `prompts` is empty; "
                                   "neither given: the shapes world's 48 prompts, for the "
                                   "shapes model only (flux and sd3 need one of them).")
    split: SplitChoice = Field(
        "eval", description="The dataset's split evaluated: 'train', 'eval' or 'all'; read "
        "only with dataset_id and no prompts.")
    prompts: list[str] = Field(default_factory=list, max_length=MAX_CONFIG_PROMPTS,
                               description="Distinct prompts to evaluate, in order (whitespace "
                               "normalised as an upload's); empty: dataset_id's, else the "
                               "shapes world's 48 prompts. Not both prompts and a dataset.")
    max_prompts: int | None = Field(None, ge=1, le=100_000, description="Evaluate only the "
                                    "first N of the prompts chosen (prompts, else the dataset "
                                    "split in upload order, else the 48 shapes prompts); "
                                    "empty: all of them.")
    seeds: list[Annotated[int, Field(ge=0, le=MAX_SEED)]] = Field(
        default_factory=lambda: [0, 1, 2, 3], min_length=1, max_length=1000,
        description="Distinct noise seeds: each checkpoint samples every prompt once per "
        "seed, a seed giving the same starting noise everywhere, so a (prompt, seed) of two "
        "checkpoints is a cross-checkpoint pair.")
    solver: Literal["dpm++", "euler"] = Field(
        "dpm++", description="ODE solver from noise to image: DPM-Solver++(2M) or Euler, on "
        "the model's own (shifted) schedule.")
    steps: int = Field(8, ge=2, le=1000, description="Solver steps per image.")
    reward_names: list[str] = Field(default_factory=list, max_length=32,
                                    description="Rewards scored on each image: any registry "
                                    "names, model-backed ones (hpsv2, pickscore, imagereward, "
                                    "clip_score, aesthetic) included; empty: count, exact_count, color, "
                                    "shape and combined for the shapes model, "
                                    "jpeg_compressibility for flux / sd3. Each one's mean is "
                                    "stored on the checkpoint. 'preference' scores with a "
                                    "fitted preference model (preference_model).")
    preference_model: str = Field(
        "", max_length=MAX_TEXT, description="With 'preference' among reward_names: the fitted "
        "preference model that scores it, its ensemble's mean score: '' or 'latest' (the "
        "newest, as the job starts; a resumed job keeps the version it began with), 'vN', or "
        "a path under STORAGE_DIR. Its version is stored with the checkpoints' scores.")

    @field_validator("seeds")
    @classmethod
    def _no_repeats(cls, values: list) -> list:
        # a repeated (prompt, seed) is the same image again: it counted twice in the reward
        # means stored on the checkpoints (the leaderboard's). A repeated prompt: the rule
        # every kind that takes prompts shares (app.services.jobs.repeated_prompts_problem)
        if repeated := sorted(v for v, n in Counter(values).items() if n > 1):
            raise PydanticCustomError("repeated", "{message}", {
                "message": f"must not repeat a seed: {repeated[:5]}"})
        return values


def _fit_field(f: dataclasses.Field, annotation: Any) -> tuple[Any, Any]:
    """A pydantic field for one of FitConfig's: its default, help text and bounds."""
    bounds = {k: v for k, v in f.metadata.items() if k not in ("help", "choices")}
    if choices := f.metadata.get("choices"):
        annotation = Literal[tuple(choices)]  # type: ignore[valid-type]
    return annotation, Field(f.default, description=f.metadata["help"], **bounds)


# FitConfig's fields as the job takes them (the device is the job's own, below)
_FitFields = create_model("_FitFields", __base__=_Cfg, **{
    f.name: _fit_field(f, get_type_hints(FitConfig)[f.name])
    for f in fit_fields(exclude=("device",))})


class FitPreferenceConfig(_FitFields):
    """Refit the human-preference reward model from clean votes (trainer.rewards.fit_config
    FitConfig's fields, and the job's own below); the file goes to
    STORAGE_DIR/preference/vN.safetensors."""

    min_votes: int = Field(0, ge=0, le=10_000_000,
                           description="Fail unless at least this many clean votes exist "
                           f"(a fit always needs {MIN_FIT_VOTES}, so values below "
                           f"{MIN_FIT_VOTES} act as {MIN_FIT_VOTES}).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where to fit; 'auto' "
                                                   "takes the GPU when there is one.")
    score_samples: bool = Field(True, description="Cache the new model's score on every "
                                "stored sample (active pair selection reads it).")


@dataclass(frozen=True)
class JobKind:
    name: str
    queue: str  # the Celery queue its task goes to: "gpu" (sampling, training) or "cpu"
    summary: str
    config: type[BaseModel] | None  # None: trainer.config.TrainConfig
    launch_role: str = "admin"  # the least trusted role (app.models.ROLES) that may launch it
    # its samples are stored as rollout groups whose `purpose` is the kind's name (the
    # Rollouts page and GET /api/rollouts?purpose= filter by it)
    stores_samples: bool = True

    @property
    def task(self) -> str:
        """The Celery task name the worker registers for it (worker/tasks.py)."""
        return f"worker.tasks.{self.name}"


KINDS: dict[str, JobKind] = {k.name: k for k in (
    JobKind("train", "gpu", "Neighbor GRPO or the SDE baseline (trainer.config.TrainConfig)",
            None),
    JobKind("rollout", "gpu", RolloutConfig.__doc__ or "", RolloutConfig),
    JobKind("evaluate", "gpu", EvaluateConfig.__doc__ or "", EvaluateConfig),
    JobKind("fit_preference", "cpu", FitPreferenceConfig.__doc__ or "", FitPreferenceConfig,
            stores_samples=False),
)}
KIND_NAMES: tuple[str, ...] = tuple(KINDS)
KindName = Literal[KIND_NAMES]  # type: ignore[valid-type]  # the OpenAPI enum of kinds
QUEUE_NAMES: tuple[str, ...] = tuple(dict.fromkeys(k.queue for k in KINDS.values()))
# a rollout group's purposes: the kinds whose jobs store samples
PURPOSES: tuple[str, ...] = tuple(k.name for k in KINDS.values() if k.stores_samples)
PurposeName = Literal[PURPOSES]  # type: ignore[valid-type]
