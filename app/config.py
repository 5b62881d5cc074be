"""Settings: every knob the server (and the worker, through it) reads from the environment.

`DATABASE_URL` unset means a SQLite file under `DATA_DIR`; `STORAGE_DIR` unset means
`DATA_DIR/storage`; `MODELS_DIR` unset means `DATA_DIR/models`; `REWARD_MODELS_DIR` unset means
`DATA_DIR/reward_models`; `BROKER_URL` unset means the worker's embedded broker (kombu's filesystem
transport under `DATA_DIR/broker`).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_file=".env", env_file_encoding="utf-8", extra="ignore")

    data_dir: Path = Path("./data")
    database_url: str | None = None
    storage_dir: Path | None = None
    # local model weights jobs may name by path (base checkpoints, CLIP for preference fits);
    # with STORAGE_DIR the only places a job config's paths may point into
    models_dir: Path | None = None
    # weights of the model-backed rewards (hpsv2, pickscore, clip_score, aesthetic,
    # imagereward), one subdirectory per reward; the trainer reads the same variable from the
    # environment (trainer/rewards/models.py), and the worker hands it the resolved directory
    reward_models_dir: Path | None = None
    broker_url: str | None = None
    # --- workers (worker/celery_app.py, worker/reaper.py) ------------------------------
    # Celery result backend; unset: the broker's Redis, or with the embedded broker a SQLite
    # file `DATA_DIR/broker/results.sqlite`
    result_backend: str | None = None
    # Redis key prefix for every broker and result key (several deployments on one Redis)
    broker_key_prefix: str = ""
    # Redis redelivers an unacknowledged task after this long: longer than the longest job
    broker_visibility_timeout: int = 7 * 24 * 3600
    job_heartbeat_seconds: float = 10.0  # a running job's heartbeat period
    job_stale_seconds: float = 120.0  # no heartbeat for this long: the worker is gone
    job_max_attempts: int = 3  # runs of one job (first + resumes after lost workers)
    reaper_interval_seconds: float = 30.0  # how often each worker looks for stale jobs
    train_nproc: int = 1  # processes (GPUs) per train job; > 1 launches torchrun (DDP)
    # --- train jobs on several hosts (train_nnodes > 1; worker/torchrun.py) ---------------
    # the address other hosts reach this worker at (torchrun's rendezvous when this worker
    # holds the job, and its --local-addr); empty: the host's fully qualified name
    worker_host: str = ""
    # the rendezvous port of the jobs this worker holds; 0: a free one (a fixed one lets a
    # firewall open just it, but then only one GPU worker per host may hold such a job at once)
    rdzv_port: int = 0
    # how long a multi-host job waits for every host to join before it fails
    rdzv_join_timeout: int = 600

    # --- pair selection (app/services/votes.py, issue 6) ----------------------------------
    # once a preference model has scored the samples, this share of GET /api/votes/next pairs
    # stays uniformly random (to check the fit for selection bias); the rest is active
    vote_random_share: float = 0.2
    vote_active: bool = True  # active selection on/off (off: always uniformly random)

    max_prompt_length: int = 2000
    max_upload_bytes: int = 50 * 1024 * 1024
    # how long a browser may cache an image (they never change once written)
    image_cache_seconds: int = 86400

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


@lru_cache
def get_settings() -> Settings:
    return Settings()
