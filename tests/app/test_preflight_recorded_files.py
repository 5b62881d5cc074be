"""A worker's start check compares STORAGE_DIR with the newest files the database records
(worker.preflight.warn_of_foreign_storage), read through app.services: the newest
checkpoints' paths and samples' image paths, newest first, at most `limit` of each."""

from __future__ import annotations

import logging


def _record(png, checkpoints: int, groups: int) -> None:
    from app.db import session_scope
    from app.services import checkpoints as ckpts
    from app.services import rollouts

    with session_scope() as s:
        for i in range(checkpoints):
            ckpts.record_checkpoint(s, None, i, f"checkpoints/c{i}.safetensors")
        for i in range(groups):
            rollouts.record_rollout_group(
                s, job_id=None, iteration=0, solver="euler", steps=4, sigma=0.0, seed=i,
                prompt_text=f"prompt {i}",
                samples=[{"png": png((i * 40 % 256, 0, 0)), "member_index": 0, "rewards": {},
                          "advantage": None}])


def test_the_newest_recorded_paths_come_newest_first(settings, session, png_bytes):
    from app.services import checkpoints, rollouts

    assert checkpoints.newest_paths(session, 4) == []
    assert rollouts.newest_image_paths(session, 4) == []
    _record(png_bytes, checkpoints=6, groups=5)
    assert checkpoints.newest_paths(session, 4) == [f"checkpoints/c{i}.safetensors"
                                                   for i in (5, 4, 3, 2)]
    images = rollouts.newest_image_paths(session, 4)
    assert len(images) == 4
    from app.models import Sample

    newest = sorted(session.query(Sample).all(), key=lambda row: row.id, reverse=True)
    assert images == [row.image_path for row in newest[:4]]


def test_a_storage_holding_none_of_them_is_logged(settings, png_bytes, tmp_path, caplog):
    from worker.preflight import warn_of_foreign_storage

    with caplog.at_level(logging.WARNING, logger="worker.preflight"):
        warn_of_foreign_storage(settings.resolved_storage_dir)  # nothing recorded yet
    assert "holds none of" not in caplog.text
    _record(png_bytes, checkpoints=1, groups=5)
    with caplog.at_level(logging.WARNING, logger="worker.preflight"):
        warn_of_foreign_storage(settings.resolved_storage_dir)  # the images are there
    assert "holds none of" not in caplog.text
    other = tmp_path / "other"
    other.mkdir()
    with caplog.at_level(logging.WARNING, logger="worker.preflight"):
        warn_of_foreign_storage(other)
    assert f"STORAGE_DIR {other} holds none of the 5 newest files" in caplog.text
