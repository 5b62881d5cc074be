"""docker-compose.yml is valid (`docker compose config`; no Docker engine is needed for that)
and has what production needs: PostgreSQL, Redis, the API running migrations, a GPU worker
with an NVIDIA reservation, a CPU worker, one shared volume, health checks."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _compose() -> list[str]:
    if shutil.which("docker") is None:
        pytest.skip("the docker CLI is not installed")
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):  # Compose v1 (Debian's docker-compose package)
        return ["docker-compose"]
    pytest.fail("the docker CLI has no compose plugin and docker-compose is not installed "
                "(apt-get install docker-compose, or the docker-compose-plugin)")


def test_compose_config_is_valid_and_complete():
    result = subprocess.run([*_compose(), "-f", "docker-compose.yml", "config"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    services = config["services"]
    assert {"postgres", "redis", "api", "worker-gpu", "worker-cpu", "beat"} <= set(services)
    for name, service in services.items():
        assert "healthcheck" in service, f"{name} has no health check"
    assert "migrate" in " ".join(services["api"]["command"])
    devices = services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert "-Q" in services["worker-gpu"]["command"] and "gpu" in services["worker-gpu"]["command"]
    assert "cpu" in services["worker-cpu"]["command"]
    for name in ("api", "worker-gpu", "worker-cpu"):
        env = services[name]["environment"]
        assert env["BROKER_URL"].startswith("redis://")
        assert env["DATABASE_URL"].startswith("postgresql+psycopg://")
        assert any(str(v).startswith("studio-data:/data") or
                   (isinstance(v, dict) and v.get("source") == "studio-data")
                   for v in services[name]["volumes"]), f"{name} lacks the shared volume"
    assert "studio-data" in config["volumes"]


def test_dockerfile_runs_from_the_source_tree():
    text = (ROOT / "Dockerfile").read_text()
    assert "PYTHONPATH=/app" in text and "COPY migrations" in text and "alembic.ini" in text


def test_the_multihost_profile_adds_a_worker_for_another_host():
    result = subprocess.run([*_compose(), "-f", "docker-compose.yml", "--profile", "multihost",
                             "config"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "STUDIO_HOST": "10.0.0.5",
                                 "WORKER_HOST": "10.0.0.6"})
    assert result.returncode == 0, result.stderr
    worker = yaml.safe_load(result.stdout)["services"]["worker-gpu-host"]
    # host networking: the rendezvous, gloo and NCCL ports are the host's own
    assert worker["network_mode"] == "host"
    assert "gpu" in worker["command"] and "solo" in worker["command"]
    env = worker["environment"]
    assert env["WORKER_HOST"] == "10.0.0.6"
    assert "@10.0.0.5:5432/" in env["DATABASE_URL"] and env["BROKER_URL"].startswith(
        "redis://10.0.0.5:6379")
    assert {"RDZV_PORT", "RDZV_JOIN_TIMEOUT", "TRAIN_NPROC"} <= set(env)
    assert "depends_on" not in worker  # PostgreSQL and Redis run on the main host


def test_the_rewards_profile_serves_known_rewards_to_the_workers():
    """`--profile rewards` adds the reward server: its command is one the server's own CLI
    takes, with rewards the registry knows, on the port its health check and the README's
    reward_server_url use; it reads the studio's weights read-only and is off by default."""
    from trainer.rewards import reward_names
    from trainer.rewards.serve import build_parser

    result = subprocess.run([*_compose(), "-f", "docker-compose.yml", "--profile", "rewards",
                             "config"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "REWARD_SERVER_REWARDS": "hpsv2,imagereward"})
    assert result.returncode == 0, result.stderr
    server = yaml.safe_load(result.stdout)["services"]["reward-server"]
    assert server["profiles"] == ["rewards"]  # off unless asked for (it needs the weights)
    command = server["command"]
    assert command[:3] == ["python", "-m", "trainer.rewards.serve"]
    args = build_parser().parse_args(command[3:])
    assert args.rewards.split(",") == ["hpsv2", "imagereward"]
    assert set(args.rewards.split(",")) <= set(reward_names())
    assert args.host == "0.0.0.0" and args.device == "cuda"
    assert f"127.0.0.1:{args.port}/health" in " ".join(server["healthcheck"]["test"])
    assert server["environment"]["REWARD_MODELS_DIR"] == "/data/reward_models"
    assert any(str(v).endswith(":ro") or (isinstance(v, dict) and v.get("read_only"))
               for v in server["volumes"]), server["volumes"]
    assert "ports" not in server  # no authentication: never published
    assert f"http://reward-server:{args.port}" in (ROOT / "docker-compose.yml").read_text()


def test_an_image_with_the_rewards_extra_installs_torchvision_beside_its_torch():
    """open-clip-torch (the `rewards` extra: the reward server's image) imports torchvision,
    which imports only beside the torch it was built for; pip took one from PyPI that replaced
    the image's torch. The Dockerfile's install step, run here with `pip` echoed: torchvision
    of the pair's release, from torch's own index, exactly when the extras hold `rewards`."""
    text = (ROOT / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    torch_minor = int(args["TORCH_VERSION"].split(".")[1])
    assert int(args["TORCHVISION_VERSION"].split(".")[1]) == torch_minor + 15, args
    step = re.search(r"^RUN (case .*?--index-url \"\$\{TORCH_INDEX_URL\}\")$", text,
                     re.M | re.S).group(1).replace("\\\n", " ")
    for extras, wanted in (("server,clip,tracking", False), ("server,clip,rewards", True),
                           ("rewards", True), ("server,rewardsx", False)):
        out = subprocess.run(["sh", "-c", step.replace("pip install", "echo pip install")],
                             env={**args, "EXTRAS": extras, "PATH": os.environ["PATH"]},
                             capture_output=True, text=True, timeout=10)
        assert out.returncode == 0, out.stderr
        words = out.stdout.split()
        assert f"torch=={args['TORCH_VERSION']}" in words, out.stdout
        assert (f"torchvision=={args['TORCHVISION_VERSION']}" in words) is wanted, (extras,
                                                                                  out.stdout)
        assert words[-2:] == ["--index-url", args["TORCH_INDEX_URL"]], out.stdout
