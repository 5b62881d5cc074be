"""Checkpoint rows with their weights file in storage, as a train job leaves them: submission,
resume and download check that the file is there (a row whose files went is refused)."""

from __future__ import annotations

import shutil
from typing import Any


def stored_checkpoint(session: Any, job_id: int | None, iteration: int, rel: str,
                      **kwargs: Any) -> int:
    """record_checkpoint's id, after writing the shapes base at `rel` under the storage
    directory (kept if a file is there already)."""
    from app.services import storage
    from app.services.checkpoints import record_checkpoint
    from trainer.models import SHAPES_BASE

    path = storage.storage_root() / rel
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(SHAPES_BASE, path)
    return record_checkpoint(session, job_id, iteration, rel, **kwargs)
