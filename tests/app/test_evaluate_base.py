"""An evaluate job's `include_base`: the checkpoints' base model is sampled and scored on the
same prompts and seeds, as a checkpoint row of its own (format 'base:<model>', no files), so
that the leaderboard ranks it beside them and the arena pairs it with each of them."""

from __future__ import annotations

PROMPTS = ["one red circle", "two blue squares"]


def _tuned_checkpoint(session, rel: str) -> int:
    """A shapes checkpoint whose weights are the shipped base's, nudged: it draws other
    pictures from the same noises."""
    import torch

    from app.services import storage
    from app.services.checkpoints import record_checkpoint
    from trainer.models import SHAPES_BASE
    from trainer.models.shapes_dit import ShapesDiT

    model = ShapesDiT.load(SHAPES_BASE)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * p.abs().mean() * torch.randn_like(p))
    path = storage.storage_root() / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    model.save(path)
    ckpt = record_checkpoint(session, None, 7, rel, name="tuned")
    session.commit()
    return ckpt


def _evaluate(client, headers, **config):
    body = {"prompts": PROMPTS, "seeds": [0, 1], "steps": 2, "reward_names": ["count"], **config}
    return client.post("/api/jobs", json={"kind": "evaluate", "config": body}, headers=headers)


def test_include_base_scores_the_base_beside_the_checkpoint_and_pairs_them(client, admin,
                                                                           session):
    from app.db import session_scope
    from app.models import Checkpoint
    from app.services import rollouts
    from worker.sampling import run_evaluate
    from worker.tasks import run_job

    tuned = _tuned_checkpoint(session, "checkpoints/tuned/model.safetensors")
    r = _evaluate(client, admin, checkpoint_ids=[tuned], include_base=True)
    assert r.status_code == 201, r.text
    job_id, ids = r.json()["id"], r.json()["config"]["checkpoint_ids"]
    assert len(ids) == 2 and ids[1] == tuned  # the base's row first, made for this job
    base = client.get(f"/api/checkpoints/{ids[0]}", headers=admin).json()
    assert (base["format"], base["name"], base["job_id"]) == ("base:shapes",
                                                              "base shapes (shipped)", None)
    assert base["download_url"] == ""
    r = client.get(f"/api/checkpoints/{ids[0]}/download", headers=admin)
    assert r.status_code == 404 and "base model 'shapes'" in r.text, r.text
    # a second job finds the same row, even when it names it itself
    again = _evaluate(client, admin, checkpoint_ids=[tuned, ids[0]], include_base=True)
    assert again.status_code == 201 and again.json()["config"]["checkpoint_ids"] == ids

    assert run_job(job_id, run_evaluate) == "succeeded"
    with session_scope() as s:
        assert s.get(Checkpoint, ids[0]).scores["count"]["n"] == 4
        groups, _ = rollouts.list_groups(s, job_id=job_id)
        drawn = {(g.checkpoint_id, g.prompt_text, g.seed) for g in groups}
    # every (prompt, seed) from both: cross pairs of one starting noise
    assert drawn == {(c, p, seed) for c in ids for p in PROMPTS for seed in (0, 1)}
    board = client.get("/api/leaderboard", headers=admin).json()
    listed = {row["checkpoint_id"]: row for row in board["checkpoints"]}
    assert listed.keys() == set(ids) and "count" in listed[ids[0]]["scores"]

    # the arena offers base-vs-checkpoint pairs, and a vote on one rates the base
    r = client.get("/api/votes/next", headers=admin)
    assert r.status_code == 200, r.text
    pair = r.json()
    assert pair["selection"].startswith("cross_checkpoint"), pair
    a, b = pair["a"], pair["b"]
    r = client.post("/api/votes", headers=admin, json={
        "client_vote_id": "base-1", "sample_a_id": a["sample_id"], "sample_b_id": b["sample_id"],
        "outcome": "a", "selection": pair["selection"]})
    assert r.status_code == 201, r.text
    board = client.get("/api/leaderboard?bootstrap=0", headers=admin).json()
    rated = {row["checkpoint_id"]: row["rating"] for row in board["checkpoints"]}
    assert rated[ids[0]] is not None and rated[tuned] is not None
    assert rated[ids[0]] != rated[tuned]
    # the reveal after the vote names the base as such
    from app.services.rollouts import sample_details

    with session_scope() as s:
        sources = {d["source"] for d in sample_details(
            s, [a["sample_id"], b["sample_id"]]).values()}
    assert sources == {f"base model: shapes (shipped) (#{ids[0]})",
                       f"checkpoint tuned (#{tuned})"}, sources


def test_the_base_samples_what_the_checkpoint_samples_from_the_same_noise(client, admin,
                                                                          session):
    """A checkpoint of the shipped weights themselves draws exactly the base's images."""
    from stored_checkpoints import stored_checkpoint

    from app.db import session_scope
    from app.services import rollouts, storage
    from worker.sampling import run_evaluate
    from worker.tasks import run_job

    same = stored_checkpoint(session, None, 0, "checkpoints/same/model.safetensors",
                             name="same")
    session.commit()
    r = _evaluate(client, admin, checkpoint_ids=[same], include_base=True)
    assert r.status_code == 201, r.text
    job_id, (base, _) = r.json()["id"], r.json()["config"]["checkpoint_ids"]
    assert run_job(job_id, run_evaluate) == "succeeded"
    with session_scope() as s:
        groups, _ = rollouts.list_groups(s, job_id=job_id)
        images = {(g.checkpoint_id, g.prompt_text, g.seed):
                  storage.resolve(g.samples[0].image_path).read_bytes() for g in groups}
    assert len(images) == 8
    for (ckpt, prompt, seed), data in images.items():
        if ckpt == base:
            assert data == images[(same, prompt, seed)]


def test_include_base_problems_are_422_beside_the_others(client, admin, session):
    from stored_checkpoints import stored_checkpoint

    from app.limits import EVALUATE_MAX_CHECKPOINTS

    ids = [stored_checkpoint(session, None, i, f"checkpoints/c{i}/model.safetensors",
                             name=f"c{i}") for i in range(EVALUATE_MAX_CHECKPOINTS)]
    session.commit()
    r = _evaluate(client, admin, checkpoint_ids=ids, include_base=True, steps=1)
    assert r.status_code == 422, r.text
    fields = {e["field"]: e["message"] for e in r.json()["errors"]}
    assert set(fields) == {"include_base", "steps"}
    assert str(EVALUATE_MAX_CHECKPOINTS) in fields["include_base"]
    r = _evaluate(client, admin, checkpoint_ids=ids[:1], include_base="yes")
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "include_base"
    # nothing was recorded for the refused jobs
    assert all(c["format"] != "base:shapes" for c in client.get(
        "/api/checkpoints?limit=1000", headers=admin).json()["items"])


def test_a_base_row_samples_as_a_rollout_job_s_checkpoint(client, admin, session):
    """Picked from GET /api/checkpoints like any row, the base's row samples the base."""
    from app.db import session_scope
    from app.services import checkpoints, datasets, rollouts
    from worker.sampling import run_rollout
    from worker.tasks import run_job

    with session_scope() as s:
        base = checkpoints.base_checkpoint(s, "shapes", "").id
    dataset = datasets.import_dataset(session, filename="p.txt",
                                      data=("\n".join(PROMPTS) + "\n").encode()).dataset.id
    session.commit()
    r = client.post("/api/jobs", headers=admin, json={"kind": "rollout", "config": {
        "checkpoint_id": base, "dataset_id": dataset, "group_size": 2, "steps": 2}})
    assert r.status_code == 201, r.text
    assert run_job(r.json()["id"], run_rollout) == "succeeded"
    with session_scope() as s:
        groups, _ = rollouts.list_groups(s, job_id=r.json()["id"])
        assert {g.checkpoint_id for g in groups} == {base} and len(groups) == len(PROMPTS)


FLUX = {"model": "flux", "model_path": "tiny-flux", "prompts": ["a red apple", "a blue car"],
        "finetune": "lora", "lora_rank": 4, "resolution": 32,
        "reward_weights": {"jpeg_compressibility": 1.0}, "device": "cpu"}


def test_a_flux_base_is_its_model_directory_at_the_checkpoints_resolution(client, admin,
                                                                          models, session):
    """FLUX LoRA checkpoints' base is the model directory they were trained from (relative
    to MODELS_DIR), sampled at their resolution; checkpoints of two directories have no one
    base unless model_path names it."""
    import shutil

    import numpy as np
    from PIL import Image

    from app.db import session_scope
    from app.models import Checkpoint
    from app.services import rollouts, storage
    from app.services.checkpoints import record_checkpoint
    from trainer import PRESETS, TrainConfig, Trainer
    from trainer.models import checkpoint_weights_file
    from worker.sampling import run_evaluate
    from worker.tasks import run_job

    shutil.copytree(models / "tiny-flux", models / "tiny-flux-copy")
    ids = []
    for name, directory in (("a", "tiny-flux"), ("b", "tiny-flux-copy")):
        trained = TrainConfig.from_dict({**PRESETS["tiny"], **FLUX,
                                         "model_path": str(models / directory)})
        saved = Trainer(trained).save_checkpoint(storage.storage_root() / "checkpoints" / name)
        ids.append(record_checkpoint(session, None, 0, str(checkpoint_weights_file(saved)),
                                     name=f"flux-{name}"))
    session.commit()
    config = {"prompts": ["a red apple"], "seeds": [0], "steps": 2, "include_base": True,
              "reward_names": ["jpeg_compressibility"]}
    r = _evaluate(client, admin, checkpoint_ids=ids, **config)
    assert r.status_code == 422 and [e["field"] for e in r.json()["errors"]] == [
        "include_base"], r.text
    message = r.json()["errors"][0]["message"]
    assert f"'tiny-flux': checkpoint(s) [{ids[0]}]" in message and "'tiny-flux-copy'" in message
    r = _evaluate(client, admin, checkpoint_ids=ids, model_path="tiny-flux", **config)
    assert r.status_code == 201, r.text

    r = _evaluate(client, admin, checkpoint_ids=ids[:1], **config)
    assert r.status_code == 201, r.text
    base = r.json()["config"]["checkpoint_ids"][0]
    assert run_job(r.json()["id"], run_evaluate) == "succeeded"
    with session_scope() as s:
        row = s.get(Checkpoint, base)
        assert (row.format, row.path, row.name) == ("base:flux", "tiny-flux",
                                                    "base flux (tiny-flux)")
        assert row.scores["jpeg_compressibility"]["n"] == 1
        groups, _ = rollouts.list_groups(s, job_id=r.json()["id"])
        drawn = {g.checkpoint_id: np.asarray(Image.open(storage.resolve(
            g.samples[0].image_path)).convert("RGB"), dtype=float) for g in groups}
    # a LoRA that never trained adds nothing: the base draws the checkpoint's picture, at
    # the checkpoint's 32 px (the base's row knows no resolution of its own)
    assert drawn[base].shape == drawn[ids[0]].shape == (32, 32, 3)
    assert np.abs(drawn[base] - drawn[ids[0]]).max() <= 1.0
