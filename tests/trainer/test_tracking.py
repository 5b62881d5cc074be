"""Experiment tracking (report_to): a tiny shapes run logs to TensorBoard, W&B (offline) and
MLflow, each read back with the backend's own reader; a resume continues the same curves."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from trainer.config import PRESETS, ConfigErrors, TrainConfig
from trainer.run_dir import RunDirectory
from trainer.tracking import ALLOWED, resolve_report_to

TINY = {**PRESETS["tiny"], "device": "cpu"}  # sample_every 1: a grid every iteration
ALL = "tensorboard,wandb,mlflow"
# the user's settings that would send the logs elsewhere
TRACKING_ENV = ("WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "MLFLOW_TRACKING_URI",
                "MLFLOW_EXPERIMENT_NAME")


def _records(out: Path) -> dict[int, float]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {r["iteration"]: r["reward_mean"] for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """Three iterations to all three trackers; then, as if the run had died after logging
    iteration 3 but before its checkpoint, a resume from iteration 2 to 4 (3 is redone)."""
    out = tmp_path_factory.mktemp("tracking") / "run-a"
    with pytest.MonkeyPatch.context() as mp:
        for name in TRACKING_ENV:
            mp.delenv(name, raising=False)
        RunDirectory(out, TrainConfig.from_dict({**TINY, "iterations": 3, "report_to": ALL})
                     ).train(progress=False)
        shutil.rmtree(out / "checkpoints" / "iter-000003")
        RunDirectory(out, TrainConfig.from_dict({**TINY, "iterations": 4, "report_to": ALL}),
                     resume=True).train(progress=False)
    return out, _records(out)


def _grid_shape() -> tuple[int, int, int]:
    p, g = TINY["prompts_per_iteration"], TINY["group_size"]
    return p * 33 * 2, g * 33 * 2, 3  # run_dir.image_grid: 32 px + 1 px gutter, scaled 2x


def test_tensorboard_has_each_step_once_after_a_resume_and_the_sample_grids(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, records = tracked_run
    acc = EventAccumulator(str(out / "tracking" / "tensorboard" / "run-a"),
                           size_guidance={"scalars": 0, "images": 0}).Reload()
    scalars = acc.Scalars("reward_mean")
    # the redone iteration 3 replaced the first one (purge_step), it is not there twice
    assert [e.step for e in scalars] == [1, 2, 3, 4]
    assert [e.value for e in scalars] == pytest.approx([records[i] for i in (1, 2, 3, 4)])
    assert {"loss", "reward_std", "seconds"} <= set(acc.Tags()["scalars"])
    images = acc.Images("samples")
    assert [e.step for e in images] == [1, 2, 3, 4]
    assert np.asarray(Image.open(io.BytesIO(images[-1].encoded_image_string))).shape == \
        _grid_shape()


def test_mlflow_resume_appends_to_the_same_run(tracked_run):
    from mlflow.tracking import MlflowClient

    out, records = tracked_run
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'tracking' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("neighbor-grpo-studio")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "run-a" and run.info.status == "FINISHED"
    assert run.data.params["group_size"] == str(TINY["group_size"])
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id,
                                                                   "reward_mean")}
    assert history == pytest.approx(records)
    images = [f.path for f in client.list_artifacts(run.info.run_id, "images")]
    assert sum(p.endswith(".png") and "+step+4+" in p for p in images) == 1


def _wandb_history(path: Path) -> list[dict]:
    """The history rows of an offline W&B run file (run-<id>.wandb): protobuf Records of W&B's
    own schema (wandb.proto) in a LevelDB-style log (7-byte file header; 32 KiB blocks of
    chunks, each with a 7-byte header: checksum, little-endian length, type). The SDK no longer
    reads these back in Python, so the test walks the log itself."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, rows = 32 * 1024, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header: padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_wandb_offline_runs_share_one_id_and_hold_the_history_and_images(tracked_run):
    out, records = tracked_run
    runs = sorted((out / "tracking" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2  # the run and its resume, one id: `wandb sync` joins them
    ids = {p.name.rsplit("-", 1)[1] for p in runs}
    assert ids == {json.loads((out / "tracking" / "run-a.ids.json").read_text())["wandb"]}
    steps: dict[int, float] = {}
    for run in runs:
        (log,) = run.glob("run-*.wandb")
        for row in _wandb_history(log):
            if "reward_mean" in row:
                steps[row["_step"]] = row["reward_mean"]
        assert any(run.glob("files/media/images/samples_*.png"))
    assert steps == pytest.approx(records)


def test_none_writes_nothing(tmp_path):
    out = tmp_path / "plain"
    RunDirectory(out, TrainConfig.from_dict({**TINY, "iterations": 1})).train(progress=False)
    assert TrainConfig().report_to == "none"
    assert (out / "metrics.jsonl").exists() and not (out / "tracking").exists()


def test_report_to_names_as_trl_takes_them():
    assert TrainConfig.from_dict({"report_to": ["tensorboard", "mlflow"]}).report_to == \
        "tensorboard,mlflow"
    assert resolve_report_to("MLflow, tensorboard") == ["tensorboard", "mlflow"]
    assert resolve_report_to("none") == resolve_report_to("") == []
    with pytest.raises(ConfigErrors) as err:
        TrainConfig.from_dict({"report_to": "tensorbord"})
    assert err.value.field == "report_to" and str(list(ALLOWED)) in err.value.message
    with pytest.raises(ConfigErrors, match="'none' cannot be combined"):
        TrainConfig.from_dict({"report_to": "none,wandb"})


def test_all_is_the_installed_trackers_and_a_missing_package_is_a_config_error(monkeypatch):
    assert resolve_report_to("all") == ["tensorboard", "wandb", "mlflow"]
    # None in sys.modules is how Python marks a module as not importable
    monkeypatch.setitem(sys.modules, "wandb", None)
    assert resolve_report_to("all") == ["tensorboard", "mlflow"]
    TrainConfig.from_dict({"report_to": "all"})  # 'all' never fails
    with pytest.raises(ConfigErrors) as err:
        TrainConfig.from_dict({"report_to": "tensorboard,wandb"})
    assert err.value.field == "report_to"
    assert "wandb package" in err.value.message
    assert "neighbor-grpo-studio[tracking]" in err.value.message


RANKS_SCRIPT = """
import sys
from trainer.config import PRESETS, TrainConfig
from trainer.distributed import init_from_env, load_distributed_model, make_distributed
from trainer.loop import Trainer

rank, _ = init_from_env()
config = TrainConfig.from_dict({**PRESETS["tiny"], "device": "cpu", "iterations": 1,
                                "report_to": "tensorboard"})
trainer = make_distributed(Trainer(config, model=load_distributed_model(config)))
trainer.track(sys.argv[1], f"rank{rank}")  # every rank is told where; rank 0 alone writes
trainer.run()
"""


@pytest.mark.subprocess
def test_only_rank_zero_logs_in_a_distributed_run(tmp_path):
    import os
    import socket
    import subprocess

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    procs = [subprocess.Popen([sys.executable, "-c", RANKS_SCRIPT, str(tmp_path)], cwd=root,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    for proc in procs:
        output = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0, output
    assert sorted(p.name for p in (tmp_path / "tensorboard").iterdir()) == ["rank0"]


def test_a_loop_over_step_logs_each_iteration_and_run_does_not_log_twice(tmp_path,
                                                                          monkeypatch):
    """The README's notebook loop calls step(), which did not log: report_to did nothing
    there. step() now logs its iteration (track() says where, finish_tracking() ends the
    run), and run(), which logs after its callback, still logs each iteration once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainer.loop import Trainer

    for name in TRACKING_ENV:
        monkeypatch.delenv(name, raising=False)
    trainer = Trainer(TrainConfig.from_dict({**TINY, "iterations": 3,
                                             "report_to": "tensorboard"}))
    trainer.track(tmp_path / "tracking", run_name="notebook")
    means = {}
    for _ in range(2):
        result = trainer.step()
        means[trainer.iteration] = result.metrics["reward_mean"]
    trainer.finish_tracking()
    trainer.run(lambda tr, result: means.update({tr.iteration: result.metrics["reward_mean"]}))
    acc = EventAccumulator(str(tmp_path / "tracking" / "tensorboard" / "notebook"),
                           size_guidance={"scalars": 0, "images": 0}).Reload()
    scalars = acc.Scalars("reward_mean")
    assert [e.step for e in scalars] == [1, 2, 3]  # the run's iteration 3 once, not twice
    assert [e.value for e in scalars] == pytest.approx([means[i] for i in (1, 2, 3)])
    assert [e.step for e in acc.Images("samples")] == [1, 2, 3]
