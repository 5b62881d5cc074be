"""A training run on disk: metrics.jsonl, reward_curve.png, sample grids, checkpoints and the
report_to trackers' logs (tracking/)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from trainer.config import TrainConfig
from trainer.grpo import IterationResult
from trainer.loop import Trainer, latest_checkpoint

# Sample grids blow small images up so a 32 px shapes canvas is legible in a viewer; images
# larger than this side (FLUX / SD3 at 512 px) are shown at their own size, since doubling
# them would only make the flux-lora preset's 1 x 12 grid 12.6 megapixels for no detail gained.
GRID_UPSCALE_MAX_SIDE = 64


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
    def __init__(self, out: Path, config: TrainConfig, resume: bool = False) -> None:
        self.out = out
        self.metrics_path = out / "metrics.jsonl"
        self.curve_path = out / "reward_curve.png"
        self.samples_dir = out / "samples"
        self.checkpoints_dir = out / "checkpoints"
        saved_config = out / "config.json"
        config = self.run_config(out, config, resume)
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
    def run_config(out: Path, config: TrainConfig, resume: bool) -> TrainConfig:
        """The config a run in `out` trains with: a resumed run keeps the one it started
        with (its config.json), taking only the new iteration budget from `config`."""
        saved_config = out / "config.json"
        if resume and saved_config.exists():
            return TrainConfig.from_dict({**json.loads(saved_config.read_text()),
                                          "iterations": config.iterations})
        return config

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

    def train(self, progress: bool = True) -> None:
        from tqdm import tqdm

        bar = tqdm(total=self.config.iterations, initial=self.trainer.iteration, disable=not progress,
                   desc=f"{self.config.method} GRPO")

        def callback(trainer: Trainer, result: IterationResult) -> bool:
            stop = self.on_iteration(trainer, result)
            m = result.metrics
            bar.set_postfix(reward=f"{m['reward_mean']:.3f}", s_it=f"{m['seconds']:.2f}")
            bar.update(1)
            return stop

        self.trainer.run(callback)
        bar.close()
        if self.records:
            plot_reward_curve(self.records, self.curve_path)
