"""What the job runners (worker.training, worker.sampling, worker.preference) share: a
throttled progress write, a job's cancel poll, a PNG of an image, and a job's model and
reward-weights directories resolved the way submission checked them.

It imports no job runner, so each of them may import it (and the worker modules import one
another without a cycle: tests/trainer/test_worker_import_graph.py).
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
from PIL import Image

from app.config import get_settings
from app.db import session_scope
from app.services import jobs, storage
from worker.lease import JobError

# a job's progress inside a long step (a checkpoint's images, a fit's epochs) is written at most
# this often: a batch or an epoch can take milliseconds, a database write each would not
PROGRESS_SECONDS = 1.0


def throttled(write: Callable[[int], None], every: float = PROGRESS_SECONDS
              ) -> Callable[[int], None]:
    """`write(done)` at most once every `every` seconds (the calls between are dropped)."""
    last = time.monotonic()

    def maybe(done: int) -> None:
        nonlocal last
        if time.monotonic() - last >= every:
            last = time.monotonic()
            write(done)

    return maybe


# how often a running fit asks the database whether its job was cancelled (an epoch can be
# milliseconds long: asking each one would load the database for nothing)
CANCEL_POLL_SECONDS = 1.0


def cancel_requested_poll(job_id: int, every: float = CANCEL_POLL_SECONDS
                          ) -> Callable[[], bool]:
    """A `should_stop` for a fit: whether the job's cancel was requested, read from the
    database at most once every `every` seconds."""
    last = -float("inf")

    def should_stop() -> bool:
        nonlocal last
        if time.monotonic() - last < every:
            return False
        last = time.monotonic()
        with session_scope() as s:
            return jobs.is_cancel_requested(s, job_id)

    return should_stop


def png_bytes(image: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.asarray(image, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def model_directory(model: str, value: str) -> Path:
    """A job's model directory (`model_path`) resolved the way submission checked it (under
    MODELS_DIR, `storage.model_dir`) and still complete: JobError naming the directory and the
    files it should hold otherwise, before anything loads."""
    from trainer.models import model_dir_problem

    try:
        path = storage.model_dir(value)
    except ValueError as exc:
        raise JobError(f"model_path: {exc}") from None
    if (problem := model_dir_problem(model, path)) is not None:
        raise JobError(f"model_path: {problem}")
    return path


def reward_model_paths(names: Iterable[str], given: dict[str, str] | None = None
                       ) -> dict[str, str]:
    """The weights directory of each model-backed reward among `names`: its `given`
    (reward_model_paths) entry resolved inside REWARD_MODELS_DIR / MODELS_DIR, else
    REWARD_MODELS_DIR/<name> (the studio's settings, which the trainer does not read). A
    JobError naming reward_model_paths when an entry resolves outside those directories
    (submission checked it, but the settings may have changed since)."""
    from trainer.rewards.models import MODEL_REWARDS

    root = get_settings().resolved_reward_models_dir
    try:
        out = {name: str(storage.reward_model_dir(path)) for name, path in
               (given or {}).items()}
    except ValueError as exc:
        raise JobError(f"reward_model_paths: {exc}") from None
    for name in names:
        if name in MODEL_REWARDS and name not in out:
            out[name] = str(root / name)
    return out
