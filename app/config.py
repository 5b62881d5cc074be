"""Settings: every knob the server (and the worker, through it) reads from the environment.

`DATABASE_URL` unset means a SQLite file under `DATA_DIR`; `STORAGE_DIR` unset means
`DATA_DIR/storage`; `BROKER_URL` unset means the worker's embedded broker.
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
    broker_url: str | None = None

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


@lru_cache
def get_settings() -> Settings:
    return Settings()
