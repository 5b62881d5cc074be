"""Experiment tracking: a run's metrics and sample grids sent to TensorBoard, Weights & Biases
or MLflow (`report_to`, the names TRL and accelerate use).

`Trainer.run` logs every iteration after its callback has seen it, so what a callback adds (the
studio's preference refit metrics) is logged too; `Trainer.step` called by itself (a notebook's
loop) logs its iteration as it returns, and `Trainer.finish_tracking` ends that run. The step is
the iteration, so a resumed run continues its curve. Whoever runs the Trainer (the CLI, a
notebook, a studio job) calls `Trainer.track(directory, run_name)` to say where; rank 0 alone
logs in a distributed run.

None of the packages is required: each is imported when its tracker opens. `report_to_problems`
checks the names, and that the packages are installed (`importlib.util.find_spec`, which imports
nothing), when the config is validated, so a missing one fails a job at submission with the
package and the extra to install.

Under a tracking directory R (the CLI: <out>/tracking; studio jobs: STORAGE_DIR/tracking, shared
by every job so that one TensorBoard or MLflow UI compares them), for a run named N:
- tensorboard: event files in R/tensorboard/N;
- mlflow: the SQLite store R/mlflow.db with artifacts in R/mlartifacts, unless
  MLFLOW_TRACKING_URI is set (MLflow 3 refuses its old file store, ./mlruns, by default);
  experiment MLFLOW_EXPERIMENT_NAME or "neighbor-grpo-studio", run N;
- wandb: R/wandb/offline-run-*, offline unless WANDB_MODE is set (`wandb sync` uploads later);
  project WANDB_PROJECT or "neighbor-grpo-studio", run N; WANDB_DIR replaces R if set.
R/N.ids.json keeps the W&B and MLflow run ids, so that a resumed run appends to the same run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from trainer.config import TrainConfig
    from trainer.grpo import IterationResult

# report_to name -> (module imported, PyPI package that provides it)
BACKENDS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow-skinny"),
}
ALLOWED = ("none", "all", *BACKENDS)
EXTRA = "neighbor-grpo-studio[tracking]"
PROJECT = "neighbor-grpo-studio"
DEFAULT_DIRECTORY = Path("runs") / "tracking"  # a Trainer used as a library, without track()

log = logging.getLogger(__name__)


def keeps_samples(config: TrainConfig, iteration: int) -> bool:
    """Whether iteration `iteration`'s rollouts are kept (sample grids, a studio job's stored
    rollout groups, the CLI's samples/): every sample_every iterations, and the last."""
    return iteration % config.sample_every == 0 or iteration >= config.iterations


def split_names(value: str | Sequence[str]) -> list[str]:
    """`report_to` as names: a comma-separated string or a list (as TRL takes it), stripped,
    lower-cased, without empties."""
    items = value.split(",") if isinstance(value, str) else list(value)
    return [item.strip().lower() for item in items if isinstance(item, str) and item.strip()]


def installed(name: str) -> bool:
    """Whether backend `name`'s package can be imported here (nothing is imported)."""
    try:
        return importlib.util.find_spec(BACKENDS[name][0]) is not None
    except ValueError:  # a module in sys.modules without a spec
        return False


def missing_package(name: str) -> str:
    package = BACKENDS[name][1]
    return (f"{name!r} needs the {package} package, which is not installed: pip install "
            f"'{EXTRA}' (or pip install {package})")


def report_to_problems(value: str | Sequence[str]) -> list[str]:
    """What is wrong with a report_to value (empty when fine): unknown names, 'none' mixed
    with trackers, a named tracker whose package is not installed. 'all' never fails: it
    means the installed ones, whichever they are where the run starts."""
    if not isinstance(value, str) and not (
            isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)):
        return [f"must be a tracker name, a comma-separated string or a list of names; "
                f"allowed: {list(ALLOWED)}, got {value!r}"]
    names = split_names(value)
    unknown = [n for n in names if n not in ALLOWED]
    if unknown:
        return [f"unknown tracker(s) {unknown}; allowed: {list(ALLOWED)}"]
    if "none" in names and len(set(names)) > 1:
        return ["'none' cannot be combined with trackers"]
    return [missing_package(n) for n in dict.fromkeys(names) if n in BACKENDS and not installed(n)]


def resolve_report_to(value: str | Sequence[str]) -> list[str]:
    """The backends to open, in BACKENDS order: none for '' or 'none'; for 'all' those
    installed here (as accelerate and transformers read it: nothing fails for a package that
    is absent)."""
    names = set(split_names(value))
    if "all" in names:
        return [n for n in BACKENDS if installed(n)]
    return [n for n in BACKENDS if n in names]


def scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite numeric metrics (what the job page plots); the iteration is the step, and
    dicts, strings, None and booleans are not curves."""
    out = {}
    for key, value in metrics.items():
        if key == "iteration" or isinstance(value, bool):
            continue
        if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # numpy / torch scalars
            value = value.item()
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[key] = float(value)
    return out


# -- the interface and its implementations -------------------------------------------------
class Tracker:
    """One experiment tracker. Steps are training iterations (1, 2, ...)."""

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        raise NotImplementedError

    def log_images(self, step: int, name: str, grid: np.ndarray) -> None:
        """`grid`: one (H, W, 3) uint8 image."""
        raise NotImplementedError

    def close(self, failed: bool = False) -> None:
        """`failed`: the run ended on an error (trackers that keep a status record it)."""
        raise NotImplementedError


@dataclasses.dataclass
class RunInfo:
    """What every backend needs to open: where, the run's name, the run's config, the first
    step it logs (above 1: a resume) and the ids a run before it stored (R/N.ids.json)."""

    directory: Path
    name: str
    config: dict[str, Any]
    first_step: int
    ids: dict[str, str]

    @property
    def resuming(self) -> bool:
        return self.first_step > 1


class TensorBoardTracker(Tracker):
    def __init__(self, run: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard hides events at or after the first step logged now, so a
        # resume that redoes iterations after its checkpoint (or a fresh run in an old
        # directory) shows each step once
        self.writer = SummaryWriter(str(run.directory / "tensorboard" / run.name),
                                    purge_step=run.first_step)
        if not run.resuming:
            self.writer.add_text("config", f"```\n{json.dumps(run.config, indent=2)}\n```", 0)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def log_images(self, step: int, name: str, grid: np.ndarray) -> None:
        self.writer.add_image(name, grid, step, dataformats="HWC")

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    def __init__(self, run: RunInfo) -> None:
        import wandb

        self.wandb = wandb
        run_id = run.ids.get("wandb") if run.resuming else None
        run.ids["wandb"] = run_id = run_id or uuid.uuid4().hex[:12]
        directory = Path(os.environ.get("WANDB_DIR") or run.directory)
        directory.mkdir(parents=True, exist_ok=True)
        # offline unless the user chose a mode: nothing leaves the machine by default. Resume
        # with the same id: `wandb sync` appends the resumed part to the same run.
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or PROJECT, name=run.name, id=run_id,
            resume="allow", dir=str(directory), config=run.config,
            mode=None if os.environ.get("WANDB_MODE") else "offline",
            # no console capture or system-stats thread inside a training job's process
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True))

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def log_images(self, step: int, name: str, grid: np.ndarray) -> None:
        self.run.log({name: self.wandb.Image(grid)}, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MlflowTracker(Tracker):
    def __init__(self, run: RunInfo) -> None:
        from mlflow.entities import Metric, Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.metric = Metric
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        artifacts = None
        if not uri:
            run.directory.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{(run.directory / 'mlflow.db').resolve()}"
            artifacts = (run.directory / "mlartifacts").resolve().as_uri()
        self.client = client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or PROJECT
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            try:
                experiment_id = client.create_experiment(name, artifact_location=artifacts)
            except MlflowException:  # another job created it meanwhile
                experiment_id = client.get_experiment_by_name(name).experiment_id
        else:
            experiment_id = experiment.experiment_id
        self.run_id = self._resumed(run.ids.get("mlflow")) if run.resuming else None
        if self.run_id is None:
            self.run_id = client.create_run(experiment_id, run_name=run.name).info.run_id
            # params are write-once in MLflow: the config goes on a new run only
            # (500 characters: the smallest value limit of MLflow versions still in use)
            params = [Param(k, (v if isinstance(v, str) else json.dumps(v))[:500])
                      for k, v in run.config.items()]
            client.log_batch(self.run_id, params=params)
        run.ids["mlflow"] = self.run_id

    def _resumed(self, run_id: str | None) -> str | None:
        from mlflow.exceptions import MlflowException

        if not run_id:
            return None
        try:
            self.client.update_run(run_id, status="RUNNING")
        except MlflowException:  # not in this store (another MLFLOW_TRACKING_URI)
            return None
        return run_id

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self.metric(k, v, now, step)
                                                    for k, v in metrics.items()])

    def log_images(self, step: int, name: str, grid: np.ndarray) -> None:
        self.client.log_image(self.run_id, grid, key=name, step=step)

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


TRACKERS: dict[str, type[Tracker]] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker,
                                      "mlflow": MlflowTracker}


class Trackers(Tracker):
    """Several trackers as one."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        for tracker in self.trackers:
            tracker.log_metrics(step, metrics)

    def log_images(self, step: int, name: str, grid: np.ndarray) -> None:
        for tracker in self.trackers:
            tracker.log_images(step, name, grid)

    def close(self, failed: bool = False) -> None:
        for tracker in self.trackers:
            tracker.close(failed)


def open_trackers(names: list[str], directory: str | Path, run_name: str,
                  config: dict[str, Any], first_step: int = 1) -> Trackers:
    """The trackers `names` (resolve_report_to's) for run `run_name` under `directory`;
    `first_step` above 1 resumes the run stored there. A missing package: ImportError
    naming it and the extra."""
    for name in names:
        if not installed(name):
            raise ImportError(f"report_to: {missing_package(name)}")
    directory = Path(directory)
    ids_path = directory / f"{run_name}.ids.json"
    ids = json.loads(ids_path.read_text()) if ids_path.is_file() else {}
    run = RunInfo(directory, run_name, config, first_step, ids)
    opened: list[Tracker] = []
    try:
        for name in names:
            opened.append(TRACKERS[name](run))
    except BaseException:
        Trackers(opened).close(failed=True)
        raise
    if run.ids:  # the W&B / MLflow run ids, for a resume
        directory.mkdir(parents=True, exist_ok=True)
        ids_path.write_text(json.dumps(run.ids))
    return Trackers(opened)


def _rank_zero() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class RunTracking:
    """What `Trainer.run` and `Trainer.step` log through: opens the config's trackers at the first iteration it
    logs, then each iteration's scalar metrics and, every `sample_every` iterations and at the
    last, the grid of its rollouts (prompts x group members, as the CLI's samples/ and the job
    page show them); `close()` at the end of the run. Does nothing for report_to 'none', and
    nothing outside rank 0."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.names = resolve_report_to(config.report_to)
        self.directory = DEFAULT_DIRECTORY
        self.run_name: str | None = None
        self.tracker: Tracker | None = None

    def log(self, iteration: int, result: IterationResult) -> None:
        if not self.names:
            return
        if self.tracker is None:
            if not _rank_zero():
                self.names = []
                return
            # a later run() of this trainer continues the same run
            self.run_name = self.run_name or time.strftime("run-%Y%m%d-%H%M%S")
            self.tracker = open_trackers(self.names, self.directory, self.run_name,
                                         self.config.to_dict(), first_step=iteration)
        self.tracker.log_metrics(iteration, scalar_metrics(result.metrics))
        if keeps_samples(self.config, iteration):
            from trainer.run_dir import image_grid

            self.tracker.log_images(iteration, "samples", image_grid(result.images))

    def close(self, failed: bool = False) -> None:
        if self.tracker is None:
            return
        tracker, self.tracker = self.tracker, None
        try:
            tracker.close(failed)
        except Exception:
            if not failed:
                raise
            # the run's own error is the one to report, not a tracker's on the way out
            log.exception("closing the experiment trackers failed")
