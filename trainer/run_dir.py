"""A training run on disk: metrics.jsonl, reward_curve.png, sample grids, checkpoints and the
report_to trackers' logs (tracking/)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from trainer.config import PATH_FIELDS, ConfigError, ConfigErrors, TrainConfig, absolute_paths
from trainer.grpo import IterationResult
from trainer.loop import CHECKPOINT_DIR_RE, Trainer, latest_checkpoint
from trainer.models import TRAINER_STATE
from trainer.rewards.remote import ScoringStopped
from trainer.strict_json import loads_strict
from trainer.tracking import keeps_samples

# Sample grids blow small images up so a 32 px shapes canvas is legible in a viewer; images
# larger than this side (FLUX / SD3 at 512 px) are shown at their own size, since doubling
# them would only make the flux-lora preset's 1 x 12 grid 12.6 megapixels for no detail gained.
GRID_UPSCALE_MAX_SIDE = 64
# what a run writes into its directory: a directory holding any of them holds a run
RUN_FILES = ("config.json", "metrics.jsonl", "reward_curve.png", "samples", "checkpoints",
             "tracking")
# `train --no-progress` prints a line every this many iterations (and the first and last)
LOG_EVERY = 10
# the fields a resumed run takes from the command line; the rest are its saved config's (a
# new learning rate or seed under an old optimizer state would be neither run). These change
# where or how fast the same run goes, not what it computes: its budget, the device, the
# model directory once moved (the same model: `moved_model_problem`), micro-batch sizes
# (batching never changes the results), recomputation and compilation, and where the same
# reward models are (a reward server's address, or their weights' directories).
RESUME_FIELDS = ("iterations", "device", "model_path", "rollout_batch_size",
                 "train_batch_size", "gradient_checkpointing",
                 "gradient_checkpointing_fraction", "torch_compile", "reward_server_url",
                 "reward_model_paths")


def _transformer_config(directory: str | Path) -> dict | None:
    """A diffusers directory's transformer/config.json without diffusers' bookkeeping keys
    ("_class_name", "_diffusers_version", "_name_or_path"); None when it cannot be read."""
    try:
        config = json.loads((Path(directory) / "transformer" / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return ({k: v for k, v in config.items() if not k.startswith("_")}
            if isinstance(config, dict) else None)


def moved_model_problem(model: str, old: str, new: str, checkpoint: Path | None
                        ) -> str | None:
    """Why a resumed run of `model` cannot take its model from `new` instead of `old`, or
    None: the new directory's transformer must be the run's. Compared by transformer
    config.json with the old directory's when it is still there, else with the newest
    checkpoint's (a full fine-tune's); a LoRA run whose old directory has gone checks that
    every adapted layer is in the new transformer (the loader checks the shapes again). A new
    directory that is missing or incomplete is the model directory check's to say."""
    from trainer.models import (
        LORA_WEIGHTS,
        directory_model,
        lora_down_modules,
        safetensors_header,
        transformer_layer_names,
    )

    found, _ = directory_model(new)
    if found is not None and found != model:
        # said as a fresh run says it: the transformer configs' dozen differences were no clue
        return (f"{new} holds a {found!r} model (its model_index.json), not the run's "
                f"{model!r}; a resumed run moves to a directory of the same model only")

    fresh = _transformer_config(new)
    if fresh is None:
        return None
    reference = _transformer_config(old)
    source = old
    if reference is None and checkpoint is not None:
        reference, source = _transformer_config(checkpoint), str(checkpoint)
    if reference is not None:
        differ = sorted(k for k in {*reference, *fresh} if reference.get(k) != fresh.get(k))
        if differ:
            return (f"{new} holds another {model} transformer than the run's ({source}): its "
                    f"config.json differs in {', '.join(differ)}; a resumed run moves to a "
                    "directory of the same model only")
        return None
    lora = checkpoint / LORA_WEIGHTS if checkpoint is not None else None
    layers = transformer_layer_names(new)
    if lora is None or not lora.is_file() or layers is None:
        return None
    try:
        adapted = set(lora_down_modules(safetensors_header(lora)))
    except (OSError, ValueError):
        return None
    if missing := sorted(adapted - layers):
        return (f"{new} holds another {model} transformer than the run's: layer {missing[0]} "
                f"of the run's LoRA ({lora}) is not in it; a resumed run moves to a directory "
                "of the same model only")
    return None


def _same_file(field_name: str, given: Any, saved: Any) -> bool:
    """Whether path field `field_name`'s given and saved values name one existing file or
    directory, spelled two ways (relative from another directory, through a symlink, with
    ..): a resume given the path it was started with is no change to its config."""
    if field_name not in PATH_FIELDS or not (isinstance(given, str) and isinstance(saved, str)
                                              and given.strip() and saved.strip()):
        return False
    try:
        return Path(given).expanduser().samefile(Path(saved).expanduser())
    except OSError:  # either is gone: judged by its text, as the other fields are
        return False


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


def saved_run_config(path: Path) -> TrainConfig:
    """The config.json a run wrote, or a ConfigError of --resume naming the file when it
    cannot be the run's (not JSON, not an object, fields this version has not or values it
    refuses: edited or damaged since). It said "Expecting property name ..." or named a
    field the user never gave, as if the command line were wrong."""
    try:
        return TrainConfig.from_dict(loads_strict(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, ConfigError) as exc:
        why = ("; ".join(f"{e.field}: {e.message}" for e in exc.errors)
               if isinstance(exc, ConfigErrors) else
               f"{exc.field}: {exc.message}" if isinstance(exc, ConfigError) else str(exc))
        raise ConfigError("--resume", f"{path}, the config of the run being resumed, cannot "
                          f"be read ({why}); put the run's config back (each checkpoint's "
                          f"{TRAINER_STATE} holds it as its 'train_config' metadata) or start a "
                          "new run in a new --out") from None


def changed_on_resume(saved: Mapping[str, Any], new: Mapping[str, Any],
                      given: Collection[str] | Mapping[str, str],
                      saved_config: Path) -> list[ConfigError]:
    """A resume's refusals: each field the command line gave (`given`; a Mapping also says
    how, "--set" or "--method") other than RESUME_FIELDS whose value in `new` is not the
    saved run's. `new` may be the command line's values alone (the whole config did not
    parse: a changed method makes the run's own sigma "applies only to method 'neighbor'")."""
    how = given if isinstance(given, Mapping) else {}
    problems = []
    for key in sorted(set(given) - set(RESUME_FIELDS)):
        if key in new and new[key] != saved.get(key) \
                and not _same_file(key, new[key], saved.get(key)):
            by = f" by {how[key]}" if how.get(key) else ""
            problems.append(ConfigError(key, f"is {saved.get(key)!r} in the run being "
                                        f"resumed ({saved_config}), given {new[key]!r}{by}: a "
                                        "resumed run keeps its config; only "
                                        f"{', '.join(RESUME_FIELDS)} can change (or start a "
                                        "new run in a new --out)"))
    return problems


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
            return TrainConfig.from_dict({**saved_run_config(saved_config).to_dict(), **taken})
        return config

    @staticmethod
    def earlier_run_problems(out: Path) -> list[ConfigError]:
        """A new run's refusal when `out` holds an earlier one (its checkpoints would be kept
        and a later --resume would load them), whatever the new run's config."""
        if found := [name for name in RUN_FILES if (out / name).exists()]:
            return [ConfigError("--out", f"{out} holds an earlier run ({', '.join(found)}); "
                                "--resume continues it, or give a new --out")]
        return []

    @staticmethod
    def run_problems(out: Path, config: TrainConfig, resume: bool,
                     given: Collection[str] = ()) -> list[ConfigError]:
        """Why a run cannot start in `out`, every reason at once, before anything is
        written: a new run into a directory that holds an earlier one (its checkpoints would
        be kept and a later --resume would load them); a resume of a directory that holds
        no run (no config.json); a resume that changes fields of the
        saved config other than RESUME_FIELDS, that moves to a model directory of another
        model (`moved_model_problem`), or whose budget its newest checkpoint has
        reached already. `given`: the fields the caller set, the only ones held against the
        saved config (a preset's untouched defaults are not the user's); a Mapping also says
        how each was given ("--set", "--config FILE"), which the refusal names."""
        problems = []
        if not resume:
            return RunDirectory.earlier_run_problems(out)
        saved_config = out / "config.json"
        if not saved_config.is_file():
            # a mistyped --out silently started a new run (exit 0) instead of continuing one
            missing = "it does not exist" if not out.exists() else "no config.json"
            problems.append(ConfigError("--resume", f"{out} holds no run to continue "
                                        f"({missing}); leave --resume out to start one"))
            return problems
        try:
            saved = absolute_paths(saved_run_config(saved_config).to_dict())
        except ConfigError as exc:
            return [exc]
        new = absolute_paths(config.to_dict())
        newest = latest_checkpoint(out / "checkpoints")
        if "model_path" in given and new["model_path"] != saved["model_path"] and (
                problem := moved_model_problem(saved["model"], saved["model_path"],
                                               new["model_path"], newest)) is not None:
            problems.append(ConfigError("model_path", problem))
        problems += changed_on_resume(saved, new, given, saved_config)
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
        if keeps_samples(cfg, it):
            from PIL import Image

            self.samples_dir.mkdir(exist_ok=True)
            Image.fromarray(image_grid(result.images)).save(self.samples_dir / f"iter-{it:06d}.png")
            plot_reward_curve(self.records, self.curve_path)
        if it % cfg.checkpoint_every == 0 or it == cfg.iterations:
            trainer.save_checkpoint(self.checkpoints_dir)
        return False

    def _checkpoint_unless_saved(self) -> None:
        """A checkpoint of the trainer's iteration, unless the newest one is that already."""
        it = self.trainer.iteration
        if latest_checkpoint(self.checkpoints_dir) != self.checkpoints_dir / f"iter-{it:06d}":
            self.trainer.save_checkpoint(self.checkpoints_dir)

    def train(self, progress: bool = True,
              stop_requested: Callable[[], bool] | None = None) -> bool:
        """Train to the config's budget; True when it got there. `stop_requested` (e.g. a
        first Ctrl-C) ends the run at the end of the iteration it is in, with a checkpoint of
        that iteration (as a cancelled studio job keeps one), so --resume continues it. An
        iteration waiting for the reward server's scores is given up instead, and the run
        ends at (and checkpoints) the iteration before."""
        from tqdm import tqdm

        bar = tqdm(total=self.config.iterations, initial=self.trainer.iteration, disable=not progress,
                   desc=f"{self.config.method} GRPO")

        def callback(trainer: Trainer, result: IterationResult) -> bool:
            stop = self.on_iteration(trainer, result)
            m = result.metrics
            bar.set_postfix(reward=f"{m['reward_mean']:.3f}", s_it=f"{m['seconds']:.2f}")
            bar.update(1)
            if not progress and (trainer.iteration % LOG_EVERY == 0 or trainer.iteration == 1
                                 or trainer.iteration == self.config.iterations):
                # without the bar (logs, CI), a line now and then: a long run was silent
                # until its end
                print(f"iteration {trainer.iteration}/{self.config.iterations}: reward "
                      f"{m['reward_mean']:.4f}, loss {m['loss']:.4g}, {m['seconds']:.2f} s",
                      file=sys.stderr, flush=True)
            if stop_requested is not None and stop_requested() \
                    and trainer.iteration < self.config.iterations:
                self._checkpoint_unless_saved()
                return True
            return stop

        # a first Ctrl-C during a periodic evaluation pass ends the pass too, unless the
        # iteration is the last (the run then ends anyway, with its evaluation)
        stop_early = None if stop_requested is None else (
            lambda: stop_requested() and self.trainer.iteration < self.config.iterations)
        try:
            self.trainer.run(callback, stop_requested=stop_early)
        except ScoringStopped:
            # given up while the reward server scored it: the trainer is as the iteration
            # before left it (iteration 0, the base model, is no checkpoint)
            if self.trainer.iteration:
                self._checkpoint_unless_saved()
        bar.close()
        if self.records:
            plot_reward_curve(self.records, self.curve_path)
        return self.trainer.iteration >= self.config.iterations
