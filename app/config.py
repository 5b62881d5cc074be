"""Settings: every knob the server (and the worker, through it) reads from the environment.

`DATABASE_URL` unset means a SQLite file under `DATA_DIR`; `STORAGE_DIR` unset means
`DATA_DIR/storage`; `MODELS_DIR` unset means `DATA_DIR/models`; `REWARD_MODELS_DIR` unset means
`DATA_DIR/reward_models`; `BROKER_URL` unset means the worker's embedded broker (kombu's filesystem
transport under `DATA_DIR/broker`).
"""

from __future__ import annotations

import difflib
import logging
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError
from pydantic_settings import BaseSettings, SettingsConfigDict

# where the Gradio UI is mounted: the UI, and the stored-files guard and body limit that
# watch its routes, all read it here (app.ui imports gradio, too heavy for the middleware)
UI_PATH = "/ui"

log = logging.getLogger(__name__)

# the longest period a worker's timing setting (JOB_HEARTBEAT_SECONDS, JOB_STALE_SECONDS,
# REAPER_INTERVAL_SECONDS) may have: a week, as BROKER_VISIBILITY_TIMEOUT's default. An
# infinite or huge one does not mean "never": it overflowed the dates computed from it (every
# job submission a 500 after its job was queued, the reaper a traceback each round) and
# Event.wait (the reaper thread died)
MAX_PERIOD_SECONDS = 7 * 24 * 3600


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_file=".env", env_file_encoding="utf-8", extra="ignore")

    data_dir: Path = Field(
        Path("./data"), description="DATA_DIR: the directory everything local lives under by "
        "default: the SQLite database (studio.db), STORAGE_DIR, MODELS_DIR, REWARD_MODELS_DIR "
        "and the embedded broker (broker/). Default ./data, relative to the working directory.")
    database_url: str | None = Field(
        None, description="DATABASE_URL: the SQLAlchemy URL of the database (e.g. a "
        "PostgreSQL one). Unset: a SQLite file DATA_DIR/studio.db.")
    storage_dir: Path | None = Field(
        None, description="STORAGE_DIR: where the studio writes its files (sample images and "
        "thumbnails, checkpoints, preference models, tracking) and serves them from "
        "(/api/media, never outside it); a job's base_checkpoint and clip_path must lie in it or "
        "in MODELS_DIR. Unset: DATA_DIR/storage.")
    models_dir: Path | None = Field(
        None, description="MODELS_DIR: local model weights an operator installed that jobs may "
        "name by path: flux / sd3 model directories (here only), base checkpoints and CLIP "
        "weights (here or in STORAGE_DIR), reward weights (here or in REWARD_MODELS_DIR). "
        "Unset: DATA_DIR/models.")
    reward_models_dir: Path | None = Field(
        None, description="REWARD_MODELS_DIR: weights of the model-backed rewards (hpsv2, "
        "pickscore, clip_score, aesthetic, imagereward), one subdirectory per reward: a reward "
        "a job names without a path loads from REWARD_MODELS_DIR/<name>. The trainer run alone "
        "reads the same variable from the environment; a job's worker hands it each "
        "reward's resolved directory (so a value in .env counts too). Unset: "
        "DATA_DIR/reward_models.")
    reward_server_timeout: float = Field(
        300.0, gt=0, allow_inf_nan=False, description="REWARD_SERVER_TIMEOUT: seconds a job "
        "whose config names a reward_server_url waits for the server's answer to one request "
        "before it fails (a shared GPU server queues several jobs' batches: generous). The "
        "trainer run alone reads the same variable from the environment; a worker hands its "
        "jobs this setting (so a value in .env counts too). Default 300.")
    broker_url: str | None = Field(
        None, description="BROKER_URL: the Celery broker the API sends jobs to and the workers "
        "take them from (e.g. redis://host:6379/0). Unset: the embedded broker, kombu's "
        "filesystem transport under DATA_DIR/broker, shared by every process with that "
        "DATA_DIR.")
    # --- workers (worker/celery_app.py, worker/reaper.py) ------------------------------
    result_backend: str | None = Field(
        None, description="RESULT_BACKEND: the Celery result backend. Unset: the broker's "
        "Redis when BROKER_URL is a Redis URL (none for another broker), or with the embedded "
        "broker a SQLite file DATA_DIR/broker/results.sqlite.")
    broker_key_prefix: str = Field(
        "", description="BROKER_KEY_PREFIX: a prefix for every Redis broker and result key, so "
        "several deployments (or test runs) share one Redis; read only with a BROKER_URL. "
        "Empty: no prefix.")
    broker_visibility_timeout: int = Field(
        7 * 24 * 3600, ge=1, description="BROKER_VISIBILITY_TIMEOUT: seconds after which Redis "
        "redelivers an unacknowledged task; keep it longer than the longest job, or a running "
        "job's message reaches a second worker. Read only with a BROKER_URL; default a week.")
    job_heartbeat_seconds: float = Field(
        10.0, gt=0, le=MAX_PERIOD_SECONDS, allow_inf_nan=False, description="JOB_HEARTBEAT_SECONDS: "
        "a running job's heartbeat period in seconds (a thread beats, so a long iteration never "
        "looks like a dead worker); at most a week.")
    job_stale_seconds: float = Field(
        120.0, gt=0, le=MAX_PERIOD_SECONDS, allow_inf_nan=False, description="JOB_STALE_SECONDS: a running job with no heartbeat for this many "
        "seconds has lost its worker: the reaper requeues it (or fails it after "
        "JOB_MAX_ATTEMPTS runs) and another worker may claim it. Also the least time an "
        "unseen worker still counts as live. At most a week.")
    job_max_attempts: int = Field(
        3, ge=1, description="JOB_MAX_ATTEMPTS: runs of one job that may lose their worker (the "
        "reaper requeues the job after each) before the reaper marks it failed. A worker's "
        "own shutdown (SIGTERM) does not count, and a resume starts the count again.")
    reaper_interval_seconds: float = Field(
        30.0, gt=0, le=MAX_PERIOD_SECONDS, allow_inf_nan=False, description=(
            "REAPER_INTERVAL_SECONDS: how often each worker looks for stale jobs and reports "
            "itself live; a worker unseen for three intervals (and JOB_STALE_SECONDS) is no "
            "longer counted. At most a week."))
    train_nproc: int = Field(
        1, ge=1, description="TRAIN_NPROC: processes (GPUs) per train job on this worker; above 1 "
        "the job runs under torchrun (DDP). A multi-host job runs train_nnodes x TRAIN_NPROC "
        "processes.")
    # --- train jobs on several hosts (train_nnodes > 1; worker/torchrun.py) ---------------
    worker_host: str = Field(
        "", description="WORKER_HOST: the address other hosts reach this worker at when it "
        "holds a multi-host train job (torchrun's rendezvous endpoint and --local-addr). "
        "Empty: the host's fully qualified name.")
    rdzv_port: int = Field(
        0, ge=0, le=65535, description="RDZV_PORT: the rendezvous port of the multi-host train jobs this "
        "worker holds. 0: a free one each time; a fixed one lets a firewall open just it, but "
        "then only one GPU worker per host may hold such a job at once.")
    rdzv_join_timeout: int = Field(
        600, ge=1, description="RDZV_JOIN_TIMEOUT: seconds a multi-host train job waits for every "
        "host to join before it fails.")

    # --- pair selection (app/services/votes.py, issue 6) ----------------------------------
    vote_random_share: float = Field(
        0.2, ge=0, le=1, description="VOTE_RANDOM_SHARE: once a preference model has scored the samples, "
        "this share of GET /api/votes/next pairs stays uniformly random (to check the fit for "
        "selection bias); the rest is chosen actively.")
    vote_active: bool = Field(
        True, description="VOTE_ACTIVE: active pair selection on or off; off: the random "
        "strategies only, as before any preference model exists.")

    max_prompt_length: int = Field(
        2000, ge=1, description="MAX_PROMPT_LENGTH: the longest prompt, in characters, that a "
        "dataset upload or a job's prompts may hold; longer ones are refused.")
    max_upload_bytes: int = Field(
        50 * 1024 * 1024, ge=1, description="MAX_UPLOAD_BYTES: the largest dataset upload, in bytes, "
        "the API and the UI take (default 50 MiB); a larger one is refused.")
    max_request_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="MAX_REQUEST_BYTES: the largest request body, in "
        "bytes, other than a dataset upload (votes, job configs, the UI's events; default 8 "
        "MiB); a larger one is answered 413 before it is read whole.")
    allowed_origins: str = Field(
        "", description="ALLOWED_ORIGINS: other origins (scheme://host[:port], comma-separated) "
        "whose pages may send requests to the studio, for a studio a proxy serves under another "
        "name than the Host it forwards. Empty: only the studio's own pages (the request's Host "
        "or X-Forwarded-Host); a request from any other page is a 403 (app/same_origin.py).")
    image_cache_seconds: int = Field(
        86400, ge=0, description="IMAGE_CACHE_SECONDS: how long a browser may cache a stored file "
        "from /api/media (Cache-Control max-age); they never change once written.")

    @model_validator(mode="wrap")
    @classmethod
    def _rules_over_the_fields(cls, data: Any, handler: Any) -> Settings:
        # a job whose heartbeat comes later than the reaper's patience looks dead while it runs:
        # every worker would requeue every running job. Wrapped around the fields' own checks
        # so that a conflict is said together with another setting's error, not after its fix.
        try:
            settings, problems = handler(data), []
        except ValidationError as exc:
            settings, problems = None, exc.errors()
        values = (settings.model_dump() if settings is not None
                  else {**{k: f.default for k, f in cls.model_fields.items()},
                        **(data if isinstance(data, dict) else {})})
        try:
            stale = float(values["job_stale_seconds"])
            heartbeat = float(values["job_heartbeat_seconds"])
        except (TypeError, ValueError):  # a number the field's own error names
            stale = heartbeat = None
        if stale is not None and heartbeat is not None and stale <= heartbeat:
            problems.append(InitErrorDetails(type=PydanticCustomError("value_error", (
                f"JOB_STALE_SECONDS ({stale:g}) must be greater than JOB_HEARTBEAT_SECONDS "
                f"({heartbeat:g}), or every running job looks dead to the reaper")),
                loc=(), input=data))
        from app.same_origin import allowed_origins_problem

        if isinstance(allowed := values.get("allowed_origins"), str) and (
                problem := allowed_origins_problem(allowed)) is not None:
            problems.append(InitErrorDetails(type=PydanticCustomError(
                "value_error", f"ALLOWED_ORIGINS: {problem}"), loc=(), input=data))
        if isinstance(broker := values.get("broker_url"), str) and (
                problem := broker_url_problem(broker)) is not None:
            problems.append(InitErrorDetails(type=PydanticCustomError(
                "value_error", f"BROKER_URL: {problem}"), loc=(), input=data))
        if problems:
            raise ValidationError.from_exception_data(cls.__name__, problems)
        return settings

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'studio.db').resolve()}"

    @property
    def resolved_storage_dir(self) -> Path:
        return (self.storage_dir or self.data_dir / "storage").resolve()

    @property
    def resolved_models_dir(self) -> Path:
        return (self.models_dir or self.data_dir / "models").resolve()

    @property
    def resolved_reward_models_dir(self) -> Path:
        return (self.reward_models_dir or self.data_dir / "reward_models").resolve()


def broker_url_problem(url: str) -> str | None:
    """Why `url` cannot be a Celery broker's URL: a scheme no kombu transport has (http://...),
    or none at all. Such a URL failed only at the first job's send, and was then reported as an
    outage ("try again when it is back") at every submission; it is a setting to fix, refused
    at start. `transport+url` (sqla+postgresql://) counts by its transport. Never echoes the
    URL, which may hold a password. Empty: unset (the embedded broker)."""
    if not url:
        return None
    from kombu.transport import TRANSPORT_ALIASES

    scheme = url.partition("://")[0] if "://" in url else ""
    if scheme.partition("+")[0] in TRANSPORT_ALIASES:
        return None
    said = (f"the scheme {scheme!r} is no Celery transport's" if scheme
            else "not a URL (no scheme://)")
    schemes = ", ".join(sorted({alias.lower() for alias in TRANSPORT_ALIASES}))
    return (f"{said}: use e.g. redis://host:6379/0 (the schemes: {schemes}), or leave "
            "BROKER_URL unset for the embedded broker")


# variables a .env may hold for docker compose, which reads the same file for the ${...} in
# docker-compose.yml: not settings of the studio, and not misspelt ones
COMPOSE_FILE = Path(__file__).resolve().parent.parent / "docker-compose.yml"


def _compose_variables() -> set[str]:
    try:
        text = COMPOSE_FILE.read_text(encoding="utf-8")
    except OSError:
        return set()
    return set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", text))


def env_file_unknown_keys(env_file: Path | str | None = None) -> str | None:
    """One line naming the keys of the .env file that no setting reads, each with the nearest
    setting's name: `extra="ignore"` dropped them silently, and a DATABSE_URL there left the
    studio on its SQLite default without a word. A warning, not a refusal: the file is shared
    with docker compose, and an unread key stops nothing. Only the file's keys: the process
    environment holds many variables that are no setting (PATH, HOME, ...). None when every
    key is known or there is no file."""
    from dotenv import dotenv_values

    path = Path(env_file or Settings.model_config.get("env_file") or ".env")
    if not path.is_file():
        return None
    try:
        keys = list(dotenv_values(path, encoding="utf-8"))
    except (OSError, UnicodeError):  # pydantic-settings names an unreadable file itself
        return None
    known = [name.upper() for name in Settings.model_fields]
    ignored = _compose_variables()
    said = []
    for key in keys:
        upper = key.upper()  # the settings are read case-insensitively
        if upper in known or upper in ignored or upper.startswith("COMPOSE_"):
            continue
        near = difflib.get_close_matches(upper, known, n=1)
        said.append(f"{key} (did you mean {near[0]}?)" if near else key)
    if not said:
        return None
    return (f"{path} holds key(s) no setting reads, ignored: {', '.join(said)}")


def settings_problem(exc: ValidationError) -> str:
    """One line naming every setting the environment got wrong: a field's error names its
    variable; a rule over several (a model validator) names them in its own message, pydantic's
    "Value error, " prefix dropped."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']).upper()}: {e['msg']}"
                     if e["loc"] else e["msg"].removeprefix("Value error, ")
                     for e in exc.errors())


@lru_cache
def get_settings() -> Settings:
    # once per process (cached): every start reads the settings here, the server's commands,
    # uvicorn's app and the worker alike
    if (unknown := env_file_unknown_keys()) is not None:
        log.warning("warning: %s", unknown)
    return Settings()
