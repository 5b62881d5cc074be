"""The leaderboard's "Evaluate these checkpoints" on FLUX LoRA checkpoints (issue 16), in the
default setting (SQLite, the embedded filesystem broker): a real Celery worker trains a tiny
FLUX.1-dev-like LoRA with a checkpoint each iteration, the leaderboard page launches an
evaluate job over both checkpoints as a user's click does, and the worker scores them. The
job samples in batches of the run's rollout_batch_size, not "all at once" (at 512 px, hundreds
of full-size images solved and decoded in one batch), and the leaderboard shows both
checkpoints with their scores. The tiny model is tests/tiny_diffusers.py's."""

from __future__ import annotations

import re
import shutil

import pytest
from worker_helpers import job_row, wait_for

RUN_ROLLOUT_BATCH = 3  # the train run's; the evaluate job takes it as its batch size
PROMPTS = ["a red apple", "a blue car", "a green tree"]
SEEDS = 2
FLUX = {"model": "flux", "model_path": "tiny-flux", "finetune": "lora", "lora_rank": 4,
        "resolution": 32, "reward_weights": {"jpeg_compressibility": 1.0}, "device": "cpu",
        "prompts": PROMPTS[:2], "iterations": 2, "sample_every": 2, "checkpoint_every": 1,
        "rollout_batch_size": RUN_ROLLOUT_BATCH, "learning_rate": 1e-2}


def _done(job_id: int):
    job = job_row(job_id)
    return job if job.status in ("succeeded", "failed", "cancelled") else None


def test_the_leaderboard_evaluates_two_flux_lora_checkpoints(stack, tiny_flux_path):
    from app.config import get_settings
    from app.db import session_scope
    from app.services import auth, checkpoints, datasets, jobs, leaderboard, rollouts
    from app.ui import leaderboard as leaderboard_page

    models = get_settings().resolved_models_dir
    models.mkdir(parents=True, exist_ok=True)
    shutil.copytree(tiny_flux_path, models / "tiny-flux")
    with session_scope() as s:
        _, token = auth.create_user(s, "admin", "admin")
        train = jobs.create_job(s, "train", FLUX, preset="tiny").id
        dataset = datasets.import_dataset(s, filename="held-out.txt",
                                          data=("\n".join(PROMPTS) + "\n").encode()).dataset.id
    stack.start_worker()
    stack.send(train)
    job = wait_for(lambda: _done(train), 120, "the FLUX LoRA train job", stack)
    assert job.status == "succeeded", job.error
    with session_scope() as s:
        ckpt_ids = sorted(c.id for c in checkpoints.list_checkpoints(s, job_id=train)[0])
    assert len(ckpt_ids) == 2

    # what the page's button does: the picked checkpoints, seeds and held-out prompts, no
    # batch size (the form has none)
    page = leaderboard_page.evaluate(lambda job_id, kind: stack.send(job_id, kind),
                                     {"token": token}, ckpt_ids, SEEDS, "", dataset, "all")
    assert 'id="evaluate-launched"' in page, page
    evaluate = int(re.search(r'data-job="(\d+)"', page).group(1))
    config = job_row(evaluate).config
    assert config["model"] == "flux" and config["reward_names"] == ["jpeg_compressibility"]
    assert config["batch_size"] == RUN_ROLLOUT_BATCH  # the run's, not 0: "all at once"

    job = wait_for(lambda: _done(evaluate), 120, "the evaluate job", stack)
    assert job.status == "succeeded", job.error
    images = len(PROMPTS) * SEEDS
    with session_scope() as s:
        groups, total = rollouts.list_groups(s, job_id=evaluate, limit=100)
        assert total == 2 * images  # one image per checkpoint, prompt and seed
        assert {g.checkpoint_id for g in groups} == set(ckpt_ids)
        assert all(g.purpose == "evaluate" and g.prompt_text in PROMPTS for g in groups)
        for cid in ckpt_ids:  # each checkpoint carries its scores, the job's summary means
            scores = checkpoints.get_checkpoint(s, cid).scores
            assert set(scores) == {"jpeg_compressibility"}
            entry = scores["jpeg_compressibility"]
            assert entry["n"] == images and entry["job_id"] == evaluate
            assert entry["mean"] == pytest.approx(
                job.metrics[f"checkpoint/{cid}/jpeg_compressibility"])
        board = leaderboard.compute(s)
    rows = {row["checkpoint_id"]: row for row in board["checkpoints"]}
    assert set(rows) == set(ckpt_ids)
    assert board["rewards"] == ["jpeg_compressibility"]
    for cid in ckpt_ids:
        assert rows[cid]["scores"]["jpeg_compressibility"] == pytest.approx(
            job.metrics[f"checkpoint/{cid}/jpeg_compressibility"])
        assert rows[cid]["rating"] is None and rows[cid]["num_votes"] == 0  # no votes yet
