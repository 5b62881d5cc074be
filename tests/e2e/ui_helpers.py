"""Helpers of the browser tests and the UI benchmark: the app served by uvicorn in a
subprocess, a real Celery worker process on the embedded broker (the command `make demo` runs,
`app.serve.worker_command`), a SQLite file shared with this process, seeding, and Playwright
helpers for Debian's chromium."""

from __future__ import annotations

import functools
import io
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("NGRPO_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
FAST = {"JOB_HEARTBEAT_SECONDS": "0.5", "JOB_STALE_SECONDS": "30",
        "REAPER_INTERVAL_SECONDS": "5", "JOB_MAX_ATTEMPTS": "3"}
# where the tests save a screenshot of each page: docs/screenshots with
# NGRPO_SCREENSHOTS=docs/screenshots (how the README's pictures are made), else a temp dir so a
# test run leaves the work tree clean
SCREENSHOTS = Path(os.environ.get("NGRPO_SCREENSHOTS", "")
                   or Path(tempfile.gettempdir()) / "ngrpo-screenshots")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.lru_cache(maxsize=1)
def _shipped_base():
    from trainer.models import SHAPES_BASE
    from trainer.models.shapes_dit import ShapesDiT

    return ShapesDiT.load(SHAPES_BASE)


def base_samples(prompts: list[str], seeds: list[int]) -> tuple[list[bytes], list[float]]:
    """What the shipped base draws for each (prompt, seed), as PNG bytes, with each image's
    count reward: the pages (and the README's screenshots) show real model samples."""
    from PIL import Image

    from trainer.evaluation import sample_images
    from trainer.rewards import compute_rewards

    images = sample_images(_shipped_base(), prompts, seeds)
    pngs = []
    for image in images:
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format="PNG")
        pngs.append(buf.getvalue())
    return pngs, [float(r) for r in compute_rewards(["count"], images, prompts)["count"]]


def seed_groups(n: int, g: int = 4, *, seed: int = 0, job_id: int | None = None,
                iteration: int = 0, purpose: str = "rollout",
                checkpoint_id: int | None = None) -> list[int]:
    """n rollout groups of g members sampled from the shipped base, with their count rewards
    and group advantages (in the test process)."""
    from app.db import session_scope
    from app.services.rollouts import record_rollout_group

    prompts = ["two red circles", "one blue square", "three green circles", "four yellow triangles"]
    group_prompts = [prompts[k % len(prompts)] for k in range(n)]
    # a checkpoint's images drawn from noises of its own (the stored seed stays `seed`'s):
    # two checkpoints' pictures of one seed differ, as trained checkpoints' do, and the
    # arena offers them as a cross-checkpoint pair
    drawn = seed * 100_000 + 1_000 * (checkpoint_id or 0)
    pngs, rewards = base_samples([p for p in group_prompts for _ in range(g)],
                                 [drawn + k * g + i for k in range(n) for i in range(g)])
    ids = []
    with session_scope() as s:
        for k in range(n):
            group_rewards = rewards[k * g:(k + 1) * g]
            mean = sum(group_rewards) / g
            samples = [{"png": pngs[k * g + i], "member_index": i,
                        "rewards": {"count": group_rewards[i]},
                        "advantage": group_rewards[i] - mean, "is_anchor": i < 2}
                       for i in range(g)]
            ids.append(record_rollout_group(
                s, job_id=job_id, iteration=iteration, prompt_text=group_prompts[k],
                solver="dpm++", steps=8, sigma=0.3, seed=seed * 100_000 + k, samples=samples,
                purpose=purpose, checkpoint_id=checkpoint_id))
    return ids


@dataclass
class Server:
    base: str
    env: dict[str, str]
    tmp: Path
    admin_token: str
    annotator_token: str
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    @property
    def ui(self) -> str:
        return f"{self.base}/ui/"

    def log_text(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-5000:]}"
                         for p in self.logs)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _wait_for(predicate, timeout: float, what: str, server: Server) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if any(p.poll() is not None for p in server.procs):
            break
        time.sleep(0.2)
    raise AssertionError(f"{what} did not happen:\n{server.log_text()}")


def start_server(tmp: Path, *, worker: bool = True) -> Server:
    """Migrate a SQLite database under `tmp`, create an admin and an annotator, start a worker
    and uvicorn. The test process's `app.db` is bound to the same database."""
    from app import db
    from app.config import get_settings
    from app.db import session_scope
    from app.migrate import upgrade
    from app.serve import worker_command
    from app.services import auth, votes

    url = f"sqlite:///{tmp / 'studio.db'}"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DATABASE_URL", "BROKER", "RESULT_BACKEND"))}
    env.update(FAST)
    env.update({"DATA_DIR": str(tmp / "data"), "STORAGE_DIR": str(tmp / "storage"),
                "DATABASE_URL": url, "PYTHONPATH": str(ROOT), "TRAIN_NPROC": "1",
                "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1"})
    for key in ("DATA_DIR", "STORAGE_DIR", "DATABASE_URL", *FAST):
        os.environ[key] = env[key]
    os.environ.pop("BROKER_URL", None)
    get_settings.cache_clear()
    upgrade(url)
    db.configure(get_settings())
    auth.token_cache.clear()
    votes._id_range.clear()
    with session_scope() as s:
        _, admin = auth.create_user(s, "alice", "admin")
        _, annotator = auth.create_user(s, "bob", "annotator")
    port = free_port()
    server = Server(f"http://127.0.0.1:{port}", env, tmp, admin, annotator)
    if worker:
        log = tmp / "worker.log"
        server.logs.append(log)
        server.procs.append(subprocess.Popen(
            worker_command("e2e"), cwd=ROOT, env=env, stdout=log.open("wb"),
            stderr=subprocess.STDOUT, start_new_session=True))
    log = tmp / "uvicorn.log"
    server.logs.append(log)
    server.procs.append(subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "app.main:create_app", "--factory", "--host",
         "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
        start_new_session=True))

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"{server.base}/healthz", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        _wait_for(healthy, 90, "uvicorn answering /healthz", server)
        if worker:
            _wait_for(lambda: "ready." in (tmp / "worker.log").read_text(errors="replace"),
                      90, "the worker logging 'ready.'", server)
    except BaseException:
        server.stop()
        raise
    return server




def login(page, server: Server, token: str) -> None:
    page.goto(server.ui)
    page.locator("#login-token input, #login-token textarea").first.fill(token)
    page.locator("#login-button").click()
    page.locator("#whoami").wait_for()


def screenshot(page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)
