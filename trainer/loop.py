"""The training loop around one iteration: model loading, optimizer, RNG, checkpoints, resume.

`Trainer(config).step()` runs one iteration; `run(on_iteration)` runs them all, handing each
result to the callback (which records it wherever its caller keeps results, and may stop the
run). The CLI's run directory (trainer/run_dir.py) is one such caller. Either way each
iteration goes to the report_to trackers once.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from trainer.config import DIFFUSERS_DEFAULT_RESOLUTION, ConfigError, ConfigErrors, TrainConfig
from trainer.grpo import IterationResult
from trainer.models import TRAINER_STATE, ModelSpec, model_dir_problem, weights_file_problem
from trainer.models.base import FlowModel, WeightsFile, WeightsMismatch
from trainer.neighbor_grpo import neighbor_grpo_iteration
from trainer.rewards.remote import ScoringStopped
from trainer.sde_grpo import sde_grpo_iteration
from trainer.shapes.world import all_prompts
from trainer.tracking import RunTracking
from trainer.write_errors import as_os_error, readable_as_umask_allows

if TYPE_CHECKING:  # imported where used: it pulls in the preference network
    from trainer.rewards.preference import PreferenceModel

CHECKPOINT_DIR_RE = re.compile(r"^iter-(\d+)$")


class _EvaluationStopped(Exception):
    """Raised before a solver step of the periodic evaluation to end it (`stop_requested`)."""

ITERATIONS = {"neighbor": neighbor_grpo_iteration, "sde": sde_grpo_iteration}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but CUDA is not available")
    return torch.device(name)


class TrainingDiverged(RuntimeError):
    """An update whose loss or gradient norm is not a finite number: the optimizer step has
    made the weights NaN or infinite, so the run stops before anything saves them."""


class TrainingOutOfMemory(RuntimeError):
    """An iteration that ran out of accelerator memory. The message names the settings that
    decide how much an iteration holds at once, with the run's values, and what to change;
    the iteration is not counted, so the run resumes from its last checkpoint."""


def _trainer_frames(error: BaseException) -> str:
    """Where in the trainer `error` was raised: its frames in this package, outermost first
    (the iteration, then the phase: rollout, scoring, update), each as function:line, e.g.
    "neighbor_grpo_iteration:88 > rollout:140 > decode:412"; the step that called them is
    left out. The phase tells which setting to turn (a decode: rollout_batch_size)."""
    package = str(Path(__file__).resolve().parent)
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if str(Path(f.filename).resolve()).startswith(package)]
    return " > ".join(f"{f.name}:{f.lineno}" for f in frames if f.name not in ("_step", "step"))


def out_of_memory_message(config: TrainConfig, iteration: int, error: BaseException) -> str:
    """What an out-of-memory error in iteration `iteration` means for `config`: torch's own
    first line (how much was asked and what was free), then the knobs, each with its value,
    in the order that costs least to turn. A FLUX run at 1,024 px with the flux-lora preset's
    quarter of blocks checkpointed needs 94 GiB, for instance (docs/benchmarks.md)."""
    said = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    where = _trainer_frames(error)
    knobs = [f"train_batch_size {config.train_batch_size or '0 (all at once)'} and "
             f"rollout_batch_size {config.rollout_batch_size or '0 (all at once)'} (set them "
             "lower: the results do not change, only how many run at once)"]
    if config.model != "shapes":
        fraction = (f"gradient_checkpointing_fraction {config.gradient_checkpointing_fraction}"
                    if config.gradient_checkpointing else "gradient_checkpointing false")
        knobs.append(f"{fraction} (recomputing every block, gradient_checkpointing true with "
                     "fraction 1.0, holds the fewest activations)")
        if config.resolution:
            knobs.append(f"resolution {config.resolution}")
        knobs.append("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the training process's "
                     "environment where the error says memory is reserved but unallocated")
    return (f"iteration {iteration}: out of memory on {config.device}"
            f"{f' in {where}' if where else ''} ({said}). What an "
            f"iteration holds at once: {'; '.join(knobs)}. Change one and resume from the "
            "last checkpoint.")


def divergence(metrics: Mapping[str, Any]) -> str | None:
    """What is not finite in an iteration's update (`loss`, `grad_norm`), or None. An
    iteration with no optimizer step reports NaN statistics by design and is left alone."""
    if not metrics.get("optimizer_steps"):
        return None
    bad = [f"{name} {value}" for name in ("loss", "grad_norm")
           if isinstance(value := metrics.get(name), float) and not math.isfinite(value)]
    return ", ".join(bad) or None


def _trainable_finite(model: torch.nn.Module) -> bool:
    """Whether every trained parameter is finite (one device sync); a sharded parameter is
    judged by this rank's shard."""
    params = [p.to_local() if hasattr(p, "to_local") else p
              for p in model.parameters() if p.requires_grad]
    if not params:
        return True
    return bool(torch.stack([p.detach().isfinite().all() for p in params]).all())


def load_model(config: TrainConfig, device: torch.device | str = "cpu", *,
               stage_on_cpu: bool = False) -> FlowModel:
    """The config's model adapter (`model`, `model_path`, the finetune mode, dtype ...) with
    its base weights (`base_checkpoint`; empty: the adapter's default base, for shapes the
    shipped checkpoint), set up for `device`. `stage_on_cpu`: its trained weights left in CPU
    memory for FSDP to shard onto `device` (`load_flow_model`)."""
    from trainer.models import load_flow_model

    try:
        return load_flow_model(ModelSpec.from_config(config), device=device,
                               stage_on_cpu=stage_on_cpu)
    except WeightsMismatch as exc:  # the user's file, not a bug: name the field that chose it
        if not config.base_checkpoint:
            raise
        raise ConfigError("base_checkpoint", str(exc)) from None


class Trainer:
    """Holds model, optimizer and RNG; `step()` runs one GRPO iteration.

    `config.preference_model` is a path: when it is a file (and reward_weights has
    "preference") the trainer loads it; otherwise the caller blends a preference model in
    with `set_preference_model` before the first step.

    `model`: one already loaded (`load_model(config, device)` when left out). What is fixed
    when a model loads stays as it was loaded: its LoRA, mixed precision, compiled blocks and
    the blocks it recomputes (`gradient_checkpointing`, `..._fraction`); the config's other
    fields (micro-batches, the algorithm) are read from `config` at each step.
    """

    def __init__(self, config: TrainConfig, model: FlowModel | None = None) -> None:
        if not isinstance(config, TrainConfig):
            raise TypeError(f"Trainer takes a TrainConfig, not {type(config).__name__}: build "
                            "one with load_config(preset, overrides) or TrainConfig.from_dict")
        self.config = config.validate()
        # what the config names that is not there, every problem at once and as ConfigErrors
        # (a library user got the prompts alone, then a FileNotFoundError for the model
        # directory once it loaded, a directory of the other model said as "not found")
        problems = [problem] if (problem := config.prompts_problem()) is not None else []
        if model is None and config.model_path and (
                missing := model_dir_problem(config.model, config.model_path)) is not None:
            problems.append(ConfigError("model_path", missing))
        if problems:
            raise ConfigErrors(problems) if len(problems) > 1 else problems[0]
        self.device = resolve_device(config.device)
        # model-backed rewards (issue 17): their weights directories and device; missing
        # weights fail here, at the job's start, before the model loads. With a reward server
        # the server holds the models: it must be up and serve every reward the job names.
        from trainer.rewards.remote import prepare_scorer
        prepare_scorer(config.reward_weights, config.reward_server_url,
                       config.reward_model_paths, self.device)
        self.model = (model or load_model(config, self.device)).to(self.device)
        # in LoRA mode the adapters alone: the frozen base never reaches the optimizer
        self.optimizer = torch.optim.AdamW(self.model.trainable_parameters(),
                                           lr=config.learning_rate,
                                           weight_decay=config.weight_decay)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.iteration = 0
        self.prompt_pool = list(config.prompts) or all_prompts()
        self._iterate = ITERATIONS[config.method]
        # the frozen base model the KL penalty measures against (taken before any update or
        # resume, so a resumed run keeps the same reference; with LoRA it is the same model
        # with its adapters disabled, or switched to the earlier LoRA it continues, not a copy)
        self.reference: FlowModel | None = None
        if config.kl_coefficient > 0:
            self.reference = self.model.reference_model()
        self.last_metrics: dict = {}
        self.preference_version: int | None = None
        # experiment tracking (report_to): run() logs each iteration there; track() says where
        self.tracking = RunTracking(config)
        path = Path(config.preference_model) if config.preference_model else None
        if "preference" in config.reward_weights and path is not None and path.is_file():
            from trainer.rewards.preference import PreferenceModel

            self.set_preference_model(PreferenceModel.load(path, str(self.device)))

    def set_preference_model(self, model: PreferenceModel, version: int | None = None) -> None:
        """Blend `model` (a `PreferenceModel`) in as the reward named "preference"; its version
        goes on every iteration's metrics. Replaces any earlier one (online refits)."""
        from trainer.rewards import register_reward

        model.uncertainty_penalty = self.config.preference_uncertainty_penalty
        register_reward("preference", model)
        if version is None and getattr(model, "report", None) is not None:
            version = model.report.version
        self.preference_version = version

    def sample_prompts(self) -> list[str]:
        n, pool = self.config.prompts_per_iteration, self.prompt_pool
        if n <= len(pool):
            idx = torch.randperm(len(pool), generator=self.generator)[:n]
        else:
            idx = torch.randint(0, len(pool), (n,), generator=self.generator)
        return [pool[i] for i in idx.tolist()]

    def step(self, stop_requested: Callable[[], bool] | None = None) -> IterationResult:
        """One GRPO iteration, then the periodic evaluation when it is due (`eval_every`),
        logged to the report_to trackers (where `track()` says; `finish_tracking()` ends
        their run). `stop_requested` is asked while the iteration waits for the reward
        server's scores (every STOP_POLL_SECONDS of trainer.rewards.remote) and before each of
        the evaluation's solver steps; neither should a cancel or a shutdown wait for (a
        busy server may take minutes to answer; at eval_seeds 1000 the pass samples 48,000
        images). True while the scores are awaited gives the iteration up: ScoringStopped
        is raised and nothing of the iteration is kept (weights, optimizer, iteration count
        and random stream are as the last whole iteration left them, so a checkpoint saved
        then is that iteration's). True during the evaluation ends the pass there, without
        its `eval_*` metrics; the iteration itself is done."""
        result = self._step(stop_requested)
        self.tracking.log(self.iteration, result)
        return result

    def _step(self, stop_requested: Callable[[], bool] | None) -> IterationResult:
        """step() without the logging: run() logs after its callback (which may add
        metrics)."""
        extra = {"reference": self.reference} if self.reference is not None else {}
        # an iteration given up while it awaits its scores has drawn prompts and noises from
        # the random stream, and nothing else (its update comes after): put back, the
        # trainer is as the last whole iteration left it
        random_state = self.generator.get_state()
        try:
            result = self._iterate(self.model, self.optimizer, self.sample_prompts(),
                                   self.config, self.generator, stop_requested=stop_requested,
                                   **extra)
        except ScoringStopped:
            self.generator.set_state(random_state)
            raise
        except torch.OutOfMemoryError as exc:
            self.generator.set_state(random_state)
            message, result = out_of_memory_message(self.config, self.iteration + 1, exc), None
        if result is None:
            # raised outside the handler: torch's error and its traceback hold the frames of
            # the iteration, and with them the tensors that filled the card
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            raise TrainingOutOfMemory(message)
        if (bad := divergence(result.metrics)) is None and result.metrics.get(
                "optimizer_steps") and not _trainable_finite(self.model):
            # the last step's loss and gradients were finite, the step it took was not
            bad = "the weights after its last optimizer step"
        if bad is not None:
            # before the count moves on: a caller's checkpointing never sees this iteration
            raise TrainingDiverged(
                f"iteration {self.iteration + 1}: the update is not finite ({bad}), so the "
                "weights are no longer numbers; the run stops before saving them. Lower "
                "learning_rate or max_grad_norm, or check the config (e.g. eta above 0 for "
                "method 'sde'), then resume from the last checkpoint.")
        self.iteration += 1
        result.metrics["iteration"] = self.iteration
        result.metrics["reward_weights"] = dict(self.config.reward_weights)
        result.metrics["preference_model_version"] = self.preference_version
        self.last_metrics = result.metrics
        if self.config.eval_every and self.iteration % self.config.eval_every == 0:
            result.metrics.update(self.evaluate(stop_requested))
        return result

    def evaluate(self, stop_requested: Callable[[], bool] | None = None) -> dict[str, float]:
        """Periodic evaluation (`eval_every`): mean rewards and exact-count accuracy over every
        shapes prompt x `eval_seeds` fixed seeds, with the rollout solver, as `eval_*`
        metrics. Its seeds are its own, so training's random stream is untouched.
        `stop_requested` True before a solver step ends the pass there: no metrics ({})."""
        from trainer.evaluation import evaluate

        def before_step() -> None:
            if stop_requested is not None and stop_requested():
                raise _EvaluationStopped

        model = getattr(self.model, "inner", self.model)  # DDP's module, not DDP
        was_training = model.training
        try:
            out = evaluate(model, seeds=tuple(range(self.config.eval_seeds)),
                           solver=self.config.rollout_solver, steps=self.config.rollout_steps,
                           before_step=before_step if stop_requested is not None else None)
        except _EvaluationStopped:
            return {}
        finally:
            model.train(was_training)
        return {f"eval_{k}": v for k, v in out.items() if isinstance(v, float)}

    def track(self, directory: str | Path, run_name: str | None = None) -> None:
        """Where step() and run() log for config.report_to: trackers' files under
        `directory` (default runs/tracking), as run `run_name` (default run-<start time>).
        See trainer/tracking.py."""
        self.tracking.directory, self.tracking.run_name = Path(directory), run_name

    def finish_tracking(self, failed: bool = False) -> None:
        """End the trackers' run after step()s (run() ends its own): TensorBoard's events
        written out, the W&B and MLflow runs finished (`failed`: marked so). A later step()
        or run() continues the same run."""
        self.tracking.close(failed)

    def run(self, on_iteration: Callable[[Trainer, IterationResult], bool | None] | None = None,
            stop_requested: Callable[[], bool] | None = None) -> None:
        """Iterate until config.iterations; `on_iteration` returning True stops early. Each
        iteration goes to the report_to trackers after `on_iteration` (which may add metrics),
        with the iteration as the step. `stop_requested`: as for step(), so that a wait for
        the reward server or a periodic evaluation pass ends early when the caller is about
        to stop. After an evaluation pass `on_iteration` still sees the iteration, and
        decides; an iteration given up while it awaited its scores raises ScoringStopped
        here (the trackers' run ended, not as failed), and the caller ends the run at the
        last whole iteration."""
        try:
            while self.iteration < self.config.iterations:
                result = self._step(stop_requested)
                stop = on_iteration is not None and on_iteration(self, result)
                self.tracking.log(self.iteration, result)
                if stop:
                    break
        except ScoringStopped:  # stopped as the caller asked: no failure
            self.finish_tracking()
            raise
        except BaseException:
            self.finish_tracking(failed=True)
            raise
        self.finish_tracking()

    # -- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, root: str | Path) -> Path:
        """root/iter-NNNNNN/: the model's weights (shapes: model.safetensors; LoRA: the
        diffusers-format pytorch_lora_weights.safetensors; full: transformer/), the optimizer
        and RNG state (trainer_state.safetensors, with the run's config) and a model card
        (README.md). Written into a temporary directory, then renamed: all or nothing."""
        final = Path(root) / f"iter-{self.iteration:06d}"
        tmp = final.with_name(final.name + ".tmp")
        meta = {"iteration": str(self.iteration), "train_config": json.dumps(self.config.to_dict())}
        if not self.model.writes_checkpoints:
            # another process of this run writes the files; a sharded model's weights and
            # optimizer state are gathered from every process (collectives, same order)
            self.model.save_weights(tmp, meta)
            self.model.optimizer_state_dict(self.optimizer)
            return final
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        try:
            self.model.save_weights(tmp, meta)
            tensors, opt_meta = _flatten_optimizer(
                self.model.optimizer_state_dict(self.optimizer))
            tensors["rng_state"] = self.generator.get_state()
            save_file(tensors, str(tmp / TRAINER_STATE),
                      metadata={**meta, "optimizer": json.dumps(opt_meta)})
            (tmp / "README.md").write_text(model_card(self))
            readable_as_umask_allows(tmp)  # safetensors' own files are 0600
        except Exception as exc:
            # a half-written checkpoint is no use to anyone: on a full disk its files would
            # hold the space a retry needs. A write the system refused is raised as an
            # OSError on this checkpoint's path (safetensors says so in a message alone,
            # and a write to an open file names no file): trainer/write_errors.py
            shutil.rmtree(tmp, ignore_errors=True)
            if (os_error := as_os_error(exc, tmp)) is not None:
                raise os_error from exc
            raise
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        return final

    def load_checkpoint(self, directory: str | Path) -> None:
        directory = Path(directory)
        # a truncated or emptied file failed deep in safetensors ("header too small"), a
        # traceback that named neither the file nor the checkpoint
        if (problem := checkpoint_files_problem(directory)) is not None:
            raise ValueError(f"checkpoint {directory} is damaged: {problem}")
        try:
            self.model.load_weights(directory)
        except RuntimeError as exc:
            if not str(exc).startswith("Error(s) in loading state_dict"):
                raise
            # torch's message lists every mismatched tensor, a traceback on a resume: weights
            # of another network (another base's width or depth) put in this run's directory
            shown = "; ".join(line.strip() for line in str(exc).splitlines()[1:3])
            raise ValueError(f"checkpoint {directory} does not fit this run's model (weights "
                             f"of another base or network size: {shown} ...); delete it to "
                             "resume from the checkpoint before it, or resume the run it "
                             "came from") from None
        state_path = directory / TRAINER_STATE
        with safe_open(str(state_path), framework="pt") as f:
            metadata = f.metadata()
        # read a tensor at a time and placed at once (a sharded model keeps its shard): the
        # Adam moments of a full FLUX.1 fine-tune are 95 GB, more than a card or a rank's
        # share of the host should hold whole
        tensors = WeightsFile(state_path)
        self.generator.set_state(tensors["rng_state"])
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.model.load_optimizer_state_dict(self.optimizer, _optimizer_state(
            tensors, json.loads(metadata["optimizer"]),
            lambda tensor, index: self.model.place_optimizer_tensor(tensor, params[index])))
        self.iteration = int(metadata["iteration"])


def model_card(trainer: Trainer) -> str:
    """A checkpoint's README.md: base model, training mode, prompts, rewards, iterations and
    the latest metrics, and how to load it."""
    config = trainer.config
    base = config.model_path or config.base_checkpoint or "the shipped shapes base"
    continued = (f"\n- continued from the checkpoint `{config.base_checkpoint}`"
                 if config.model_path and config.base_checkpoint else "")
    prompts = list(config.prompts) or ["(the 48 shapes prompts)"]
    shown = "\n".join(f"- {p}" for p in prompts[:20])
    more = f"\n- ... ({len(prompts) - 20} more)" if len(prompts) > 20 else ""
    metrics = {k: v for k, v in trainer.last_metrics.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    # counts (iteration, passes) exactly: .4g writes 12345 as 1.234e+04
    rows = "\n".join(f"| {k} | {v if isinstance(v, int) else format(v, '.4g')} |"
                     for k, v in sorted(metrics.items()))
    pipeline = {"flux": "FluxPipeline", "sd3": "StableDiffusion3Pipeline"}.get(
        config.model, "DiffusionPipeline")
    # sampled as it was trained: a pipeline's own defaults differ (SD3's CFG 7.0 against
    # the 4.5 a run may have trained with), and the model learned at this scale and size
    side = config.resolution or DIFFUSERS_DEFAULT_RESOLUTION
    guidance = f", guidance_scale={config.guidance_scale}" if config.model != "shapes" else ""
    # where the card's directory ends up (a download, a copy) is the reader's: one line to set
    here = 'checkpoint = "path/to/this/directory"  # where this README.md is\n'
    sample = (f'image = pipe("a prompt", height={side}, width={side}{guidance}).images[0]\n'
              f"```\n\nTrained with rollouts of {config.rollout_steps} steps; the pipeline's "
              "own step count gives sharper images at more cost.")
    if config.finetune == "lora":
        usage = (f"```python\nfrom diffusers import {pipeline}\n\n{here}pipe = {pipeline}."
                 f"from_pretrained({config.model_path!r})\npipe.load_lora_weights(checkpoint)\n"
                 + sample)
    elif config.model == "shapes":
        usage = "`python -m trainer sample --checkpoint THIS_DIRECTORY --prompts FILE --out DIR`"
    else:
        transformer = {"flux": "FluxTransformer2DModel", "sd3": "SD3Transformer2DModel"}.get(
            config.model, "AutoModel")
        usage = (f"The trained transformer is in `transformer/`, the rest is the base's:\n\n"
                 f"```python\nfrom diffusers import {pipeline}, {transformer}\n\n{here}"
                 f"transformer = {transformer}.from_pretrained(checkpoint, "
                 f"subfolder=\"transformer\")\npipe = {pipeline}.from_pretrained("
                 f"{config.model_path!r}, transformer=transformer)\n" + sample)
    return f"""# {config.model} {config.finetune} fine-tune, Neighbor GRPO studio

- base model: `{config.model}` from `{base}`{continued}
- training: method `{config.method}`, finetune `{config.finetune}`{
        f" (rank {config.lora_rank}, alpha {config.lora_alpha})" if config.finetune == "lora" else ""},
  {trainer.iteration} of {config.iterations} iterations, learning rate {config.learning_rate}
- rewards: {", ".join(f"{n} x {w}" for n, w in config.reward_weights.items())}
- resolution: {config.resolution or "the model's default"}, rollouts: {config.rollout_sampler()[0]}
  {config.rollout_steps} steps, group size {config.group_size}

## Prompts
{shown}{more}

## Metrics at iteration {trainer.iteration}
| metric | value |
|---|---|
{rows}

## Use
{usage}
"""


def checkpoint_files_problem(directory: str | Path) -> str | None:
    """Why a checkpoint directory's files cannot be loaded, or None: the first of its
    safetensors and JSON files (the weights, trainer_state, configs) that is empty or
    truncated (weights_file_problem, from the headers alone: cheap for a full FLUX one)."""
    for path in sorted(Path(directory).rglob("*")):
        if path.suffix in (".safetensors", ".json") and path.is_file() \
                and (problem := weights_file_problem(path)) is not None:
            return problem
    return None


def latest_checkpoint(root: str | Path, whole_only: bool = True) -> Path | None:
    """The newest iter-N directory under `root` holding its trainer state, or with
    `whole_only` False the newest whatever it holds (one damaged since it was written)."""
    root = Path(root)
    if not root.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := CHECKPOINT_DIR_RE.match(p.name)) and p.is_dir()
             and (not whole_only or (p / TRAINER_STATE).exists())]
    return max(found)[1] if found else None


def _flatten_optimizer(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict]:
    """An `Optimizer.state_dict()` as flat tensors and JSON metadata (a safetensors file)."""
    tensors = {}
    for param_id, param_state in state["state"].items():
        for key, value in param_state.items():
            tensors[f"opt.{param_id}.{key}"] = torch.as_tensor(value).detach().contiguous().cpu()
    return tensors, {"param_groups": state["param_groups"]}


def _optimizer_state(tensors: Mapping[str, torch.Tensor], meta: dict,
                     place: Callable[[torch.Tensor, int], torch.Tensor]) -> dict[str, Any]:
    """The `Optimizer.state_dict()` that `_flatten_optimizer` wrote, each tensor read and
    placed (`place(tensor, parameter index)`) before the next is read."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name in tensors:
        if name == "rng_state":
            continue
        _, param_id, key = name.split(".", 2)
        # Adam's `step` lives on the CPU; moments live with the parameters.
        value = tensors[name]
        state.setdefault(int(param_id), {})[key] = value if key == "step" else place(
            value, int(param_id))
        del value
    return {"state": state, "param_groups": meta["param_groups"]}
