"""A real (diffusers) model end to end through the product (issue 16): a LoRA train job on a
tiny FLUX.1-dev-like model under MODELS_DIR, submitted through the real HTTP API (uvicorn) and
run by a real Celery worker; its rollout groups reach the arena (`GET /api/votes/next`) and take
a vote; its checkpoint downloads as a diffusers-format LoRA; a rollout job samples that
checkpoint; a model directory that breaks after submission fails its job with the reason
(the directory and the files it lacks), not a traceback; and a LoRA job cancelled, then resumed
through the API, goes on from its newest checkpoint. The tiny model is
tests/tiny_diffusers.py's (`tiny_flux_path`, tests/conftest.py)."""

from __future__ import annotations

import io
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
from worker_helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]
FLUX = {"model": "flux", "model_path": "tiny-flux", "finetune": "lora", "lora_rank": 4,
        "resolution": 32, "reward_weights": {"jpeg_compressibility": 1.0}, "device": "cpu",
        "prompts": ["a red apple", "a blue car"], "iterations": 2, "sample_every": 1,
        "checkpoint_every": 1, "rollout_batch_size": 4, "train_batch_size": 4}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(stack) -> httpx.Client:
    """The API under uvicorn on this test's database, storage and broker."""
    port = _free_port()
    log = stack.tmp / "uvicorn.log"
    stack.logs.append(log)
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "app.main:create_app", "--factory", "--host",
         "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        cwd=ROOT, env={**stack.env, "GRADIO_ANALYTICS_ENABLED": "False"},
        stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    stack.workers.append(server)  # stopped with the workers
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30.0)

    def up():
        try:
            return client.get("/healthz").status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, 90, "uvicorn", stack)
    return client


def _finished(client: httpx.Client, headers: dict, job_id: int, timeout: float, stack) -> dict:
    def done():
        job = client.get(f"/api/jobs/{job_id}", headers=headers).json()
        return job if job["status"] in ("succeeded", "failed", "cancelled") else None

    return wait_for(done, timeout, f"job {job_id}", stack)


# as deployed, and the default setting (SQLite, the embedded broker) a first install runs
@pytest.mark.parametrize("stack", ["sqlite-fs", "postgres-redis"], indirect=True)
def test_a_lora_job_on_a_tiny_flux_through_the_api_worker_and_arena(stack, tiny_flux_path):
    import numpy as np
    from PIL import Image
    from safetensors.numpy import load

    from app.config import get_settings
    from app.db import session_scope
    from app.services import auth

    models = get_settings().resolved_models_dir
    models.mkdir(parents=True, exist_ok=True)
    shutil.copytree(tiny_flux_path, models / "tiny-flux")
    shutil.copytree(tiny_flux_path, models / "breaks-later")
    with session_scope() as s:
        _, admin_token = auth.create_user(s, "admin", "admin")
        _, annotator_token = auth.create_user(s, "ann", "annotator")
    admin = {"Authorization": f"Bearer {admin_token}"}
    annotator = {"Authorization": f"Bearer {annotator_token}"}
    client = _serve(stack)

    # a model directory that passes submission, then loses a file before the worker runs it
    # (the worker starts after the loss: started before, it took the job at once and could
    # check the directory while the file went)
    r = client.post("/api/jobs", headers=admin, json={
        "kind": "train", "preset": "tiny", "config": {**FLUX, "model_path": "breaks-later"}})
    assert r.status_code == 201, r.text
    broken = r.json()["id"]
    (models / "breaks-later" / "vae" / "config.json").unlink()
    r = client.post("/api/jobs", headers=admin,
                    json={"kind": "train", "preset": "tiny", "config": FLUX})
    assert r.status_code == 201, r.text
    train = r.json()["id"]
    stack.start_worker()

    job = _finished(client, admin, broken, 60, stack)
    assert job["status"] == "failed"
    assert job["error"].startswith(f"model_path: model directory {models / 'breaks-later'} "
                                   "is incomplete for 'flux': missing vae/config.json")
    assert "model_index.json" in job["error"]  # what the directory should hold
    assert "Traceback" not in job["error"] and job["iteration"] == 0

    job = _finished(client, admin, train, 90, stack)
    assert job["status"] == "succeeded", job["error"]
    assert job["iteration"] == 2 and "reward_mean" in job["metrics"]

    # the rollout groups: one per prompt and iteration, 32 px images scored by the image reward
    groups = client.get(f"/api/rollouts?job_id={train}", headers=admin).json()
    assert groups["total"] == 4
    sample_ids = set()
    for group in groups["items"]:
        assert len(group["samples"]) == 4 and group["prompt_text"] in FLUX["prompts"]
        for sample in group["samples"]:
            assert set(sample["rewards"]) == {"jpeg_compressibility"}
            assert sample["thumbnail_url"] is None  # 32 px: its own thumbnail
            sample_ids.add(sample["id"])
    image = client.get(groups["items"][0]["samples"][0]["image_url"], headers=annotator)
    assert image.status_code == 200
    with Image.open(io.BytesIO(image.content)) as im:
        assert im.format == "PNG" and im.size == (32, 32)

    # the arena serves them, and takes a vote
    r = client.get("/api/votes/next", headers=annotator)
    assert r.status_code == 200, r.text
    pair = r.json()
    assert pair["selection"].startswith("within_group")
    assert {pair["a"]["sample_id"], pair["b"]["sample_id"]} <= sample_ids
    assert pair["prompt"] in FLUX["prompts"]
    r = client.post("/api/votes", headers=annotator, json={
        "client_vote_id": uuid.uuid4().hex, "sample_a_id": pair["a"]["sample_id"],
        "sample_b_id": pair["b"]["sample_id"], "outcome": "a"})
    assert r.status_code == 201, r.text

    # checkpoints: a diffusers-format LoRA each (what load_lora_weights reads)
    ckpts = client.get(f"/api/checkpoints?job_id={train}", headers=admin).json()["items"]
    assert sorted(c["iteration"] for c in ckpts) == [1, 2]
    newest = max(ckpts, key=lambda c: c["iteration"])
    with session_scope() as s:  # the row names the real weights file
        from app.services import checkpoints

        path = checkpoints.get_checkpoint(s, newest["id"]).path
    assert path == f"checkpoints/job-{train}/iter-000002/pytorch_lora_weights.safetensors"
    r = client.get(newest["download_url"], headers=annotator)
    assert r.status_code == 200
    tensors = load(r.content)
    assert tensors and all(k.startswith("transformer.") for k in tensors)
    assert any("lora_A" in k for k in tensors) and any("lora_B" in k for k in tensors)
    assert all(np.isfinite(v).all() for v in tensors.values())
    # the whole directory to take away: the same LoRA and its model card, no optimizer state
    import zipfile

    r = client.get(newest["download_url"], params={"format": "zip"}, headers=annotator)
    assert r.status_code == 200
    with zipfile.ZipFile(io.BytesIO(r.content)) as zf:
        members = {n.split("/", 1)[1]: n for n in zf.namelist()}
        assert set(members) == {"pytorch_lora_weights.safetensors", "README.md"}, members
        assert load(zf.read(members["pytorch_lora_weights.safetensors"])).keys() == tensors.keys()
        assert "FluxPipeline" in zf.read(members["README.md"]).decode()

    # a rollout job from that checkpoint: its model (flux) and rewards filled in at submission
    r = client.post("/api/datasets", headers=admin, files={
        "file": ("p.txt", b"a green tree\na yellow sun\na red apple\n", "text/plain")})
    assert r.status_code == 201, r.text
    r = client.post("/api/jobs", headers=admin, json={"kind": "rollout", "config": {
        "dataset_id": r.json()["id"], "checkpoint_id": newest["id"], "split": "all",
        "group_size": 3, "steps": 3, "max_prompts": 2, "batch_size": 2}})
    assert r.status_code == 201, r.text
    rollout = r.json()
    assert rollout["config"]["model"] == "flux"
    assert rollout["config"]["reward_names"] == ["jpeg_compressibility"]
    job = _finished(client, admin, rollout["id"], 60, stack)
    assert job["status"] == "succeeded", job["error"]
    groups = client.get(f"/api/rollouts?job_id={rollout['id']}", headers=admin).json()
    assert groups["total"] == 2
    for group in groups["items"]:
        assert group["checkpoint_id"] == newest["id"] and group["purpose"] == "rollout"
        assert len(group["samples"]) == 3
        assert all("jpeg_compressibility" in s["rewards"] for s in group["samples"])


@pytest.mark.parametrize("stack", ["sqlite-fs"], indirect=True)
def test_a_cancelled_lora_job_resumes_through_the_api_from_its_newest_checkpoint(
        stack, tiny_flux_path):
    """Cancelled at a checkpoint, resumed through the API: the run goes on from that checkpoint
    (its LoRA loaded, iterations before it not redone) to a diffusers LoRA of the last one."""
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import load, load_file, save_file

    from app.config import get_settings
    from app.db import session_scope
    from app.services import auth, checkpoints

    models = get_settings().resolved_models_dir
    models.mkdir(parents=True, exist_ok=True)
    shutil.copytree(tiny_flux_path, models / "tiny-flux")
    with session_scope() as s:
        _, token = auth.create_user(s, "admin", "admin")
    admin = {"Authorization": f"Bearer {token}"}
    client = _serve(stack)
    stack.start_worker()
    total = 3
    r = client.post("/api/jobs", headers=admin, json={
        "kind": "train", "preset": "tiny", "config": {**FLUX, "iterations": total}})
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]

    # cancelled while it loads the model (seconds; an iteration takes a fraction of one): the
    # iteration under way finishes with a checkpoint, then the job stops
    wait_for(lambda: client.get(f"/api/jobs/{job_id}", headers=admin).json()["status"]
             == "running", 60, "the job to start", stack)
    r = client.post(f"/api/jobs/{job_id}/cancel", headers=admin)
    assert r.status_code == 200, r.text
    job = _finished(client, admin, job_id, 60, stack)
    assert job["status"] == "cancelled", job["error"]
    stopped = job["iteration"]
    assert 1 <= stopped < total, stopped
    before = job["metric_history"]
    assert [m["iteration"] for m in before] == list(range(1, stopped + 1))
    ckpts = client.get(f"/api/checkpoints?job_id={job_id}", headers=admin).json()["items"]
    assert sorted(c["iteration"] for c in ckpts) == list(range(1, stopped + 1))
    resumed_from = max(ckpts, key=lambda c: c["iteration"])
    groups = client.get(f"/api/rollouts?job_id={job_id}", headers=admin).json()["items"]
    kept_groups = {g["id"] for g in groups}

    # a probe of the LoRA the resume loads: the newest checkpoint's lora_B moved by OFFSET, far
    # more than the few updates left move them (the lr is 1e-6). A run that started again from
    # the base model would end near the unmoved weights (it replays them: same seeds)
    offset = 1e-4
    with session_scope() as s:
        path = checkpoints.checkpoint_file(s, resumed_from["id"])
    with safe_open(str(path), framework="np") as f:
        metadata = f.metadata()
    probe = {k: v + offset if "lora_B" in k else v for k, v in load_file(path).items()}
    save_file(probe, path, metadata=metadata)

    r = client.post(f"/api/jobs/{job_id}/resume", headers=admin)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "queued"
    job = _finished(client, admin, job_id, 60, stack)
    assert job["status"] == "succeeded", job["error"]
    assert job["iteration"] == total and job["attempts"] == 1
    assert (f"job {job_id} resumes from {path.parent} (iteration {stopped})"
            in stack.logs[-1].read_text())

    # (a) the metric history goes on from the checkpoint: the iterations before it were not
    # run again (a rerun would re-record them with its own timings), each recorded once
    after = job["metric_history"]
    assert [m["iteration"] for m in after] == list(range(1, total + 1))
    assert after[:stopped] == before
    ckpts = client.get(f"/api/checkpoints?job_id={job_id}", headers=admin).json()["items"]
    assert sorted(c["iteration"] for c in ckpts) == list(range(1, total + 1))
    first_new = next(c for c in ckpts if c["iteration"] == stopped + 1)
    assert first_new["parent_id"] == resumed_from["id"]  # its lineage runs through the resume
    groups = client.get(f"/api/rollouts?job_id={job_id}", headers=admin).json()["items"]
    assert len(groups) == 2 * total and kept_groups <= {g["id"] for g in groups}

    # (b, c) the last checkpoint: a diffusers LoRA that went on from the probed one, changed
    newest = max(ckpts, key=lambda c: c["iteration"])
    r = client.get(newest["download_url"], headers=admin)
    assert r.status_code == 200
    final = load(r.content)
    assert final.keys() == probe.keys() and any("lora_B" in k for k in final)
    assert all(k.startswith("transformer.") for k in final)
    assert any(not np.array_equal(final[k], probe[k]) for k in final)
    drift = max(float(np.abs(final[k] - probe[k]).max()) for k in final)
    assert drift < offset / 4, drift  # one or two updates from the probe, not from the base
