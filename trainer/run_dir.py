"""A training run on disk: metrics.jsonl, reward_curve.png, sample grids, checkpoints and the
report_to trackers' logs (tracking/)."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

import numpy as np

from trainer.config import ConfigError, ConfigErrors, TrainConfig, absolute_paths
from trainer.grpo import IterationResult
from trainer.loop import CHECKPOINT_DIR_RE, Trainer, latest_checkpoint

# Sample grids blow small images up so a 32 px shapes canvas is legible in a viewer; images
# larger than this side (FLUX / SD3 at 512 px) are shown at their own size, since doubling
# them would only make the flux-lora preset's 1 x 12 grid 12.6 megapixels for no detail gained.
GRID_UPSCALE_MAX_SIDE = 64
# what a run writes into its directory: a directory holding any of them holds a run
RUN_FILES = ("config.json", "metrics.jsonl", "reward_curve.png", "samples", "checkpoints",
             "tracking")
# the fields a resumed run takes from the command line; the rest are its saved config's (a
# new learning rate or seed under an old optimizer state would be neither run)
RESUME_FIELDS = ("iterations", "device")


def image_grid(images: np.ndarray, scale: int | None = None) -> np.ndarray:
    """(R, C, H, W, 3) -> one (R*(H+1)*scale, C*(W+1)*scale, 3) uint8 image with 1 px gutters.
    `scale` None: 2 for images of side at most GRID_UPSCALE_MAX_SIDE, else 1."""
    rows, cols, h, w, _ = images.shape
    if scale is None:
        scale = 2 if max(h, w) <= GRID_UPSCALE_MAX_SIDE else 1
    grid = np.full((rows * (h + 1), cols * (w + 1), 3), 255, dtype=np.uint8)
    for r in range(rows):
        for c in range(cols):
            grid[r * (h + 1):r * (h + 1) + h, c * (w + 1):c * (w + 1) + w] = images[r, c]
    return grid.repeat(scale, 0).repeat(scale, 1)


def plot_reward_curve(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    iters = [r["iteration"] for r in records]
    mean = np.array([r["reward_mean"] for r in records])
    std = np.array([r["reward_std"] for r in records])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(iters, mean, label="reward mean")
    ax.fill_between(iters, mean - std, mean + std, alpha=0.2, label="+/- std")
    if len(mean) >= 10:
        window = max(len(mean) // 10, 5)
        smooth = np.convolve(mean, np.ones(window) / window, mode="valid")
        ax.plot(iters[window - 1:], smooth, label=f"moving mean ({window})")
    ax.set_xlabel("iteration")
    ax.set_ylabel("training reward")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class RunDirectory:
    """A run's directory: a new run (`resume` False) writes into a directory that holds no
    run (`run_problems`); a resumed one continues from its newest checkpoint with its saved
    config.json, taking only RESUME_FIELDS from `config`."""

    def __init__(self, out: Path, config: TrainConfig, resume: bool = False,
                 given: Collection[str] = RESUME_FIELDS) -> None:
        self.out = out
        self.metrics_path = out / "metrics.jsonl"
        self.curve_path = out / "reward_curve.png"
        self.samples_dir = out / "samples"
        self.checkpoints_dir = out / "checkpoints"
        saved_config = out / "config.json"
        config = self.run_config(out, config, resume, given)
        self.trainer = Trainer(config)
        # report_to's logs live with the run: <out>/tracking, the run named as its directory
        self.tracking_dir = out / "tracking"
        self.trainer.track(self.tracking_dir, run_name=out.resolve().name)
        self.config = config
        self.records: list[dict] = []
        out.mkdir(parents=True, exist_ok=True)
        if resume and (ckpt := latest_checkpoint(self.checkpoints_dir)) is not None:
            self.trainer.load_checkpoint(ckpt)
            self.records = [r for r in self._read_records() if r["iteration"] <= self.trainer.iteration]
            self._write_records()  # drop iterations after the checkpoint: they are redone
        else:
            self.metrics_path.write_text("")
        saved_config.write_text(json.dumps(config.to_dict(), indent=2))

    @staticmethod
    def run_config(out: Path, config: TrainConfig, resume: bool,
                   given: Collection[str] = RESUME_FIELDS) -> TrainConfig:
        """The config a run in `out` trains with: a resumed run keeps the one it started
        with (its config.json), taking from `config` only the RESUME_FIELDS the caller
        `given` (a budget left out stays the saved one)."""
        saved_config = out / "config.json"
        if resume and saved_config.exists():
            taken = {k: getattr(config, k) for k in RESUME_FIELDS if k in given}
            return TrainConfig.from_dict({**json.loads(saved_config.read_text()), **taken})
        return config

    @staticmethod
    def run_problems(out: Path, config: TrainConfig, resume: bool,
                     given: Collection[str] = ()) -> list[ConfigError]:
        """Why a run cannot start in `out`, every reason at once, before anything is
        written: a new run into a directory that holds an earlier one (its checkpoints would
        be kept and a later --resume would load them); a resume that changes fields of the
        saved config other than RESUME_FIELDS, or whose budget its newest checkpoint has
        reached already. `given`: the fields the caller set, the only ones held against the
        saved config (a preset's untouched defaults are not the user's); a Mapping also says
        how each was given ("--set", "--config FILE"), which the refusal names."""
        problems = []
        if not resume:
            if found := [name for name in RUN_FILES if (out / name).exists()]:
                problems.append(ConfigError("out", f"{out} holds an earlier run "
                                            f"({', '.join(found)}); --resume continues it, or "
                                            "give a new --out"))
            return problems
        saved_config = out / "config.json"
        if not saved_config.is_file():
            return problems  # nothing to resume yet: the run starts
        saved = absolute_paths(TrainConfig.from_dict(json.loads(saved_config.read_text()))
                                .to_dict())
        new = absolute_paths(config.to_dict())
        how = given if isinstance(given, Mapping) else {}
        for key in sorted(set(given) - set(RESUME_FIELDS)):
            if key in new and new[key] != saved.get(key):
                by = f" by {how[key]}" if how.get(key) else ""
                problems.append(ConfigError(key, f"is {saved.get(key)!r} in the run being "
                                            f"resumed ({saved_config}), given {new[key]!r}{by}: a "
                                            "resumed run keeps its config; only "
                                            f"{', '.join(RESUME_FIELDS)} can change (or start a "
                                            "new run in a new --out)"))
        newest = latest_checkpoint(out / "checkpoints")
        budget = config.iterations if "iterations" in given else saved["iterations"]
        if newest is not None and (m := CHECKPOINT_DIR_RE.match(newest.name)) \
                and int(m.group(1)) >= budget:
            problems.append(ConfigError("iterations", f"the run in {out} is at iteration "
                                        f"{int(m.group(1))} already ({newest.name}); --set "
                                        f"iterations=N with N > {int(m.group(1))} trains it "
                                        "further"))
        return problems

    @classmethod
    def check(cls, out: Path, config: TrainConfig, resume: bool,
              given: Collection[str] = ()) -> None:
        """ConfigErrors listing run_problems, if any."""
        if problems := cls.run_problems(out, config, resume, given):
            raise ConfigErrors(problems)

    def _read_records(self) -> list[dict]:
        if not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line]

    def _write_records(self) -> None:
        self.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in self.records))

    def on_iteration(self, trainer: Trainer, result: IterationResult) -> bool:
        self.records.append(result.metrics)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(result.metrics) + "\n")
        it, cfg = trainer.iteration, self.config
        if it % cfg.sample_every == 0 or it == cfg.iterations:
            from PIL import Image

            self.samples_dir.mkdir(exist_ok=True)
            Image.fromarray(image_grid(result.images)).save(self.samples_dir / f"iter-{it:06d}.png")
            plot_reward_curve(self.records, self.curve_path)
        if it % cfg.checkpoint_every == 0 or it == cfg.iterations:
            trainer.save_checkpoint(self.checkpoints_dir)
        return False

    def train(self, progress: bool = True,
              stop_requested: Callable[[], bool] | None = None) -> bool:
        """Train to the config's budget; True when it got there. `stop_requested` (e.g. a
        first Ctrl-C) ends the run at the end of the iteration it is in, with a checkpoint of
        that iteration (as a cancelled studio job keeps one), so --resume continues it."""
        from tqdm import tqdm

        bar = tqdm(total=self.config.iterations, initial=self.trainer.iteration, disable=not progress,
                   desc=f"{self.config.method} GRPO")

        def callback(trainer: Trainer, result: IterationResult) -> bool:
            stop = self.on_iteration(trainer, result)
            m = result.metrics
            bar.set_postfix(reward=f"{m['reward_mean']:.3f}", s_it=f"{m['seconds']:.2f}")
            bar.update(1)
            if stop_requested is not None and stop_requested() \
                    and trainer.iteration < self.config.iterations:
                if latest_checkpoint(self.checkpoints_dir) != \
                        self.checkpoints_dir / f"iter-{trainer.iteration:06d}":
                    trainer.save_checkpoint(self.checkpoints_dir)
                return True
            return stop

        # a first Ctrl-C during a periodic evaluation pass ends the pass too, unless the
        # iteration is the last (the run then ends anyway, with its evaluation)
        stop_early = None if stop_requested is None else (
            lambda: stop_requested() and self.trainer.iteration < self.config.iterations)
        self.trainer.run(callback, stop_requested=stop_early)
        bar.close()
        if self.records:
            plot_reward_curve(self.records, self.curve_path)
        return self.trainer.iteration >= self.config.iterations
