"""Request and response models of the HTTP API."""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer
from pydantic_core import PydanticCustomError

from app.errors import Invalid
from app.job_kinds import KindName
from app.limits import CLIENT_VOTE_ID_PATTERN, MAX_ID, SELECTION_LENGTH
from app.models import JobStatus
from trainer.config import decimal_point_message
from trainer.rewards.outcomes import OUTCOMES

T = TypeVar("T")


def _as_utc(value: datetime) -> datetime:
    # SQLite hands back naive datetimes (stored as UTC), PostgreSQL aware ones in the session's
    # time zone, a fresh row the aware value it was given: all leave as UTC, written with "Z".
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    try:
        return value.astimezone(UTC)
    except OverflowError:  # 9999-12-31T23:00-05:00 is in year 10000 in UTC: not a datetime
        raise ValueError("must be a date and time between 0001-01-01 and 9999-12-31 in "
                         "UTC") from None


def utc_text(value: datetime) -> str:
    """`value` as every timestamp the API and its exports write: UTC, six fraction digits, Z."""
    # always six fraction digits: pydantic leaves them out when they are zero, so one list
    # held "…:05Z" beside "…:05.120000Z", which a client's fixed-format parser rejects
    return _as_utc(value).replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


UTCDateTime = Annotated[datetime, AfterValidator(_as_utc),
                        PlainSerializer(utc_text, return_type=str, when_used="json")]
"""Every datetime the API returns: timezone-aware UTC, whatever the database gave, written
as YYYY-MM-DDTHH:MM:SS.ffffffZ."""

NUL_MESSAGE = "must not contain NUL characters"

# --- a vote's selection and shown_at: checked by VoteIn (every problem of a request at once)
# and by the votes service (the UI records votes without the API) -----------------------------
SKIPPED_SUFFIX = "_skipped_near_identical"
SKIPPED_NEAR_IDENTICAL = "within_group" + SKIPPED_SUFFIX
# every reason GET /api/votes/next gives for a pair: what a vote may say it was chosen by, so
# that the selection-bias checks the export is for count only what the server did
CROSS_CHECKPOINT = "cross_checkpoint"
CROSS_SELECTIONS = (CROSS_CHECKPOINT, CROSS_CHECKPOINT + SKIPPED_SUFFIX)
SELECTIONS = ("within_group", SKIPPED_NEAR_IDENTICAL, *CROSS_SELECTIONS, "active_uncertain",
              "active_uncertain" + SKIPPED_SUFFIX, "active_disagree",
              "active_disagree" + SKIPPED_SUFFIX)
# how far ahead of the server's clock a client's shown_at may be (clocks drift) before it is
# a time the pair cannot have been shown at; and a time before any studio existed
SHOWN_AT_CLOCK_SKEW = timedelta(minutes=5)
SHOWN_AT_EARLIEST = datetime(2000, 1, 1, tzinfo=UTC)


def selection_problem(value: str | None) -> str | None:
    if value is not None and value not in SELECTIONS:
        return (f"must be one of {list(SELECTIONS)} (the pair's selection from "
                "GET /api/votes/next), or left out")
    return None


def shown_at_problem(value: datetime | None) -> str | None:
    if value is None:
        return None
    shown = value if value.tzinfo else value.replace(tzinfo=UTC)
    if shown > datetime.now(UTC) + SHOWN_AT_CLOCK_SKEW:
        return "must not be in the future (the time the pair was shown)"
    if shown < SHOWN_AT_EARLIEST:
        return "must not be before 2000 (the time the pair was shown)"
    return None


def _checked(rule: Any, kind: str) -> AfterValidator:
    """A pydantic validator from a `*_problem` rule: its message, as the service says it."""
    def check(value: Any) -> Any:
        if (problem := rule(value)) is not None:
            raise PydanticCustomError(kind, problem)
        return value
    return AfterValidator(check)


def refuse_nul(field: str, value: str | None) -> None:
    """Invalid naming `field` when `value` holds a NUL: PostgreSQL refuses it in text (an
    error naming no field), SQLite stores it (a value nobody can type, and a LIKE pattern
    that ends there). Every text a request gives the database passes here or `NoNul`."""
    if value is not None and "\x00" in value:
        raise Invalid(f"{field}: {NUL_MESSAGE}", field=field)


def _no_nul(value: str | None) -> str | None:
    if value is not None and "\x00" in value:
        raise PydanticCustomError("nul", NUL_MESSAGE)
    return value


NoNul = AfterValidator(_no_nul)
"""`refuse_nul` for a request model's text field: `Annotated[str, NoNul]`."""

HIDDEN_MESSAGE = ("must not contain control or invisible characters (a line break, a tab, "
                  "NUL, a zero-width space, a text-direction mark)")


def hidden_characters(value: str) -> list[str]:
    """The characters of `value` nobody sees or types in a name: controls (Cc) and format
    characters (Cf: zero-width spaces, direction overrides), as U+XXXX."""
    return sorted({f"U+{ord(c):04X}" for c in value if unicodedata.category(c) in ("Cc", "Cf")})


def refuse_hidden(field: str, value: str | None) -> None:
    """Invalid naming `field` when a name holds characters nobody sees: "ann1" and "ann1" with a
    zero-width space are two users that look like one, and a line break in a name splits
    the lines it is written into."""
    if value and (hidden := hidden_characters(value)):
        raise Invalid(f"{field}: {HIDDEN_MESSAGE}; found {', '.join(hidden[:5])}", field=field)


def look_alike_key(name: str) -> str:
    """What two names that look alike share: case folded and compatibility forms unified
    (NFKC), so that 'ann1', 'ANN1' and the full-width 'ａｎｎ１' are one name to the eye."""
    return unicodedata.normalize("NFKC", name).casefold()


def look_alike_difference(taken: str, name: str) -> str:
    """How `name` differs from the look-alike `taken` already in use, for a 409's message."""
    return "in case only" if taken.lower() == name.lower() else "in case or character width only"


def _plain_name(value: str) -> str:
    value = value.strip()
    if not value:
        raise PydanticCustomError("blank", "must not be blank")
    if hidden := hidden_characters(value):
        raise PydanticCustomError("hidden", "{message}; found {found}",
                                  {"message": HIDDEN_MESSAGE, "found": ", ".join(hidden[:5])})
    return value


PlainName = AfterValidator(_plain_name)
"""A name as people read it: stripped, not blank, no control or invisible characters."""


class ORM(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class Page(BaseModel, Generic[T]):
    items: list[T]
    total: int
    limit: int
    offset: int


class Error(BaseModel):
    detail: str
    field: str | None = None


class FieldProblem(BaseModel):
    field: str = Field(description="The field: the request's own (preset, dataset_id; 'body' "
                       "for the body as a whole), or a job config's by its name (sigma; "
                       "`detail` writes it config.sigma).")
    message: str = Field(description="What is wrong and what is allowed.")


class Problems(Error):
    """A 422: `detail` says every problem in one line, `field` names the first, `errors`
    lists them all (request validation and a job's config answer alike)."""

    errors: list[FieldProblem] = Field(default_factory=list)


# where FastAPI says a request value came from: not part of the field's name
_REQUEST_PARTS = ("body", "query", "path", "header", "cookie")
_COMPARISONS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal",
                "multiple_of")


def validation_message(err: Mapping[str, Any]) -> str:
    """A pydantic error's message, saying "must be a finite number" for NaN or infinity (a
    range check on NaN would say "less than 1", which NaN is not the trouble with)."""
    value = err.get("input")
    if err.get("type") == "finite_number" or (
            err.get("type") in (*_COMPARISONS, "int_type") and isinstance(value, float)
            and not math.isfinite(value)):
        return "must be a finite number"
    if err.get("type") == "int_type" and isinstance(value, float) and value.is_integer():
        return decimal_point_message(value)
    message = str(err.get("msg", "invalid value"))
    return message.removeprefix("Value error, ")


def validation_problem(err: Mapping[str, Any]) -> tuple[str, str]:
    """(field, message) of one pydantic error of a request (FastAPI's RequestValidationError):
    the field without the part of the request it came from. Never the rejected input itself:
    it may be huge, or NaN, which strict JSON cannot carry."""
    loc = [str(part) for part in err.get("loc", ())]
    if err.get("type") == "json_invalid":
        reason = (err.get("ctx") or {}).get("error", "invalid JSON")
        where = f" at character {loc[1]}" if len(loc) > 1 else ""
        return "body", f"malformed JSON ({reason}{where})"
    if loc and loc[0] in _REQUEST_PARTS:
        loc = loc[1:] or loc[:1]
    return ".".join(loc) or "body", validation_message(err)


class Me(ORM):
    id: int
    name: str
    role: str


class DatasetOut(ORM):
    id: int
    name: str
    filename: str
    format: str
    num_prompts: int
    num_eval: int
    duplicates_dropped: int
    blank_lines_skipped: int = Field(
        0, description="blank lines skipped (.txt, .jsonl and .csv): not prompts, not errors")
    eval_fraction: float
    created_at: UTCDateTime


class DatasetCreated(DatasetOut):
    """The upload's answer: the dataset and what the import skipped (all on the dataset)."""


class PromptOut(ORM):
    id: int
    dataset_id: int
    position: int
    text: str
    meta: dict[str, Any] | None = Field(None, serialization_alias="metadata")
    split: str


class SampleOut(ORM):
    id: int
    member_index: int
    image_url: str
    # a small WebP of a large image (a real model's), for grids; None: the image is small
    thumbnail_url: str | None = None
    rewards: dict[str, Any]
    advantage: float | None
    is_anchor: bool


class GroupOut(ORM):
    id: int
    job_id: int | None
    iteration: int
    purpose: str
    prompt_id: int | None
    prompt_text: str
    checkpoint_id: int | None
    solver: str
    steps: int
    sigma: float
    seed: int
    created_at: UTCDateTime
    samples: list[SampleOut]


class PairSide(BaseModel):
    sample_id: int
    image_url: str


class NextPair(BaseModel):
    prompt: str
    a: PairSide
    b: PairSide
    selection: str
    pixel_difference: float | None = Field(
        None, description="The fraction of the two images' pixels that differ (32x32, a channel "
        "off by more than 24 of 255); within-group pairs under 0.01 are never offered. Null "
        "when an image cannot be read.")


class VoteIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    client_vote_id: str = Field(min_length=1, max_length=64, pattern=CLIENT_VOTE_ID_PATTERN)
    # strict: "107", 105.0 or true is a client's bug, refused as train configs refuse them
    sample_a_id: int = Field(ge=1, le=MAX_ID, strict=True,
                             description="The sample shown on the left.")
    sample_b_id: int = Field(ge=1, le=MAX_ID, strict=True,
                             description="The sample shown on the right.")
    outcome: Literal[OUTCOMES]  # the same enum in OpenAPI as the values spelt out
    session_id: Annotated[str | None, NoNul] = Field(None, max_length=64)
    # naive: taken as UTC; stored as UTC on either database
    shown_at: Annotated[UTCDateTime | None, _checked(shown_at_problem, "shown_at")] = None
    latency_ms: int | None = Field(None, ge=0, le=MAX_ID, strict=True)
    selection: Annotated[str | None, NoNul, _checked(selection_problem, "selection")] = Field(
        None, max_length=SELECTION_LENGTH)


class VoteOut(ORM):
    id: int
    client_vote_id: str
    annotator_id: int
    session_id: str | None
    sample_a_id: int
    sample_b_id: int
    outcome: str
    shown_at: UTCDateTime | None
    latency_ms: int | None
    selection: str
    pixel_difference: float | None
    excluded: bool
    created_at: UTCDateTime
    duplicate: bool = False


class JobIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: KindName
    # null is a config left out (the defaults, or the preset's), as JSON clients write it
    config: Annotated[dict[str, Any], BeforeValidator(lambda v: {} if v is None else v)] = \
        Field(default_factory=dict)
    preset: str | None = Field(None, max_length=100)
    # strict: true, "1" or 1.0 is not a dataset id (a job's config fields are strict alike)
    dataset_id: int | None = Field(None, ge=1, le=MAX_ID, strict=True)


class ResumeIn(BaseModel):
    """A resume's optional body: config fields to change first (a train job's micro-batches,
    gradient checkpointing and where its rewards are scored, app.services.jobs.RESUME_FIELDS)."""
    model_config = ConfigDict(extra="forbid")
    config: dict[str, Any] = Field(default_factory=dict)


class MetricPoint(ORM):
    iteration: int
    metrics: dict[str, Any]


class JobOut(ORM):
    id: int
    kind: str
    status: JobStatus
    config: dict[str, Any]
    dataset_id: int | None
    iteration: int
    total_iterations: int | None
    progress: float | None = None
    metrics: dict[str, Any] | None
    error: str | None
    worker: str | None
    cancel_requested: bool
    attempts: int
    created_at: UTCDateTime
    started_at: UTCDateTime | None
    finished_at: UTCDateTime | None
    heartbeat_at: UTCDateTime | None
    # a queued job no live worker can take says what it waits for (app/services/workers.py)
    waiting_for: str | None = None


class JobDetail(JobOut):
    metric_history: list[MetricPoint] = []


class CheckpointScore(BaseModel):
    """One reward's evaluation of a checkpoint, as the evaluate job that scored it recorded."""

    model_config = ConfigDict(extra="allow")  # older or newer entries may carry more

    mean: float | None = Field(description="Mean score; null when it was not finite.")
    std: float | None = None
    n: int | None = Field(None, description="Images scored (prompts x seeds).")
    job_id: int | None = Field(None, description="The evaluate job that scored it.")
    prompts: str | None = Field(None, description="The prompt set: a dataset split, the "
                                "job's own prompts, or the built-in shapes prompts.")
    seeds: int | None = Field(None, description="Seeds per prompt.")
    at: str | None = Field(None, description="When it was recorded (ISO 8601, UTC).")


def _no_scores_is_empty(value: Any) -> Any:
    return {} if value is None else value


class CheckpointOut(ORM):
    id: int
    job_id: int | None
    iteration: int
    name: str
    format: str
    parent_id: int | None
    created_at: UTCDateTime
    scores: Annotated[dict[str, CheckpointScore], BeforeValidator(_no_scores_is_empty)] = Field(
        default_factory=dict, description="Automatic-reward evaluation by reward name; a "
        "later evaluate job with the same reward replaces its entry.")
    download_url: str = Field("", description="Its weights file; empty for a base model's row "
                              "(format 'base:<model>', from an evaluate job's include_base): "
                              "the model directory itself, no file of its own.")


class Rating(BaseModel):
    """A leaderboard row: the Bradley-Terry rating from cross-checkpoint votes (null for a
    checkpoint evaluated with rewards but not yet voted on) beside its reward means."""

    checkpoint_id: int
    name: str
    rating: float | None
    ci_low: float | None
    ci_high: float | None
    num_votes: int
    win_rate: float | None
    scores: dict[str, float] = Field(default_factory=dict,
                                     description="Mean of each evaluated reward.")
    score_sources: dict[str, str] = Field(
        default_factory=dict, description="What each reward's mean was computed on (prompt "
        "set, seeds, images): two checkpoints' means compare only where these agree.")


class PairStat(BaseModel):
    checkpoint_id: int
    opponent_id: int
    num_votes: int
    win_rate: float


class Leaderboard(BaseModel):
    checkpoints: list[Rating]
    rewards: list[str] = Field(default_factory=list, description="Every reward some "
                               "checkpoint on the board was evaluated with (the score columns).")
    pairs: list[PairStat]
    num_votes: int
    bootstrap: int


# --- humans in the loop (issue 6) --------------------------------------------------------------
class PreferenceModelOut(ORM):
    id: int
    version: int
    path: str
    job_id: int | None
    votes_used: int
    last_vote_id: int
    checkpoint_ids: list[int | None]
    heldout_accuracy: float | None
    heldout_log_loss: float | None
    report: dict[str, Any]
    created_at: UTCDateTime
    download_url: str = ""


class AnnotatorStats(BaseModel):
    user_id: int
    name: str
    role: str
    excluded: bool
    votes: int
    clean_votes: int
    median_latency_ms: float | None
    majority_agreement: float | None
    majority_n: int
    reward_agreement: float | None
    reward_n: int
    agreement_p_value: float | None = Field(
        None, description="one-sided binomial test of majority agreement against 0.5")
    flagged: bool = Field(False, description="votes look random (agreement not significantly "
                          "above chance); flagged for an admin, not dropped")


class UserIn(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt field ("rolle") must not pass
    name: Annotated[str, PlainName] = Field(min_length=1, max_length=100)
    role: Literal["admin", "annotator"] = "annotator"


class UserOut(BaseModel):
    id: int
    name: str
    role: str
    created_at: UTCDateTime
    excluded: bool
    active_tokens: int
    revoked: bool = Field(description="no live token: cannot log in")


class UserRevoked(BaseModel):
    id: int
    tokens_revoked: int


class UserPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt "exclude" must not pass as a no-op
    # strict: "false" or 0 is a client's bug, not a value to guess
    excluded: bool = Field(strict=True, description="Exclude the user's votes (cast and "
                           "future) from preference fitting and the leaderboard, or include "
                           "them again.")


class UserExcluded(BaseModel):
    id: int
    excluded: bool
    votes_changed: int = Field(description="votes whose excluded flag this call changed")


class UserCreated(BaseModel):
    id: int
    name: str
    role: str
    created_at: UTCDateTime  # as GET /api/users gives it
    token: str = Field(description="shown once")


class UserTokenReplaced(UserCreated):
    tokens_revoked: int = Field(description="the user's earlier tokens and UI sessions, "
                                "revoked")
