"""The training loop around one iteration: model loading, optimizer, RNG, checkpoints, resume.

`Trainer(config).step()` runs one iteration; `run(on_iteration)` runs them all, handing each
result to the callback (which records it wherever its caller keeps results, and may stop the
run). The CLI's run directory (trainer/run_dir.py) is one such caller.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from trainer.config import TrainConfig
from trainer.grpo import IterationResult
from trainer.models import SHAPES_BASE
from trainer.models.base import FlowModel
from trainer.neighbor_grpo import neighbor_grpo_iteration
from trainer.sde_grpo import sde_grpo_iteration
from trainer.shapes.world import all_prompts

SHIPPED_BASE = SHAPES_BASE  # the shapes adapter's default base weights
CHECKPOINT_DIR_RE = re.compile(r"^iter-(\d+)$")

ITERATIONS = {"neighbor": neighbor_grpo_iteration, "sde": sde_grpo_iteration}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but CUDA is not available")
    return torch.device(name)


def load_model(config: TrainConfig, device: torch.device | str = "cpu") -> FlowModel:
    """The config's model adapter with its base weights (`base_checkpoint`; empty: the
    adapter's default base, for shapes the shipped checkpoint)."""
    from trainer.models import load_flow_model

    return load_flow_model(config.model, config.base_checkpoint or None, device)


class Trainer:
    """Holds model, optimizer and RNG; `step()` runs one GRPO iteration.

    `config.preference_model` is a path: when it is a file (and reward_weights has
    "preference") the trainer loads it; otherwise the caller blends a preference model in
    with `set_preference_model` before the first step.
    """

    def __init__(self, config: TrainConfig, model: FlowModel | None = None) -> None:
        self.config = config.validate()
        self.device = resolve_device(config.device)
        self.model = (model or load_model(config)).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.learning_rate,
                                           weight_decay=config.weight_decay)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.iteration = 0
        self.prompt_pool = list(config.prompts) or all_prompts()
        self._iterate = ITERATIONS[config.method]
        # the frozen base model the KL penalty measures against (copied before any update or
        # resume, so a resumed run keeps the same reference)
        self.reference: FlowModel | None = None
        if config.kl_coefficient > 0:
            unwrapped = getattr(self.model, "inner", self.model)  # DDP's module, not DDP
            self.reference = copy.deepcopy(unwrapped).requires_grad_(False).eval()
        self.preference_version: int | None = None
        path = Path(config.preference_model) if config.preference_model else None
        if "preference" in config.reward_weights and path is not None and path.is_file():
            from trainer.rewards.preference import PreferenceModel

            self.set_preference_model(PreferenceModel.load(path, str(self.device)))

    def set_preference_model(self, model, version: int | None = None) -> None:
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

    def step(self) -> IterationResult:
        extra = {"reference": self.reference} if self.reference is not None else {}
        result = self._iterate(self.model, self.optimizer, self.sample_prompts(), self.config,
                               self.generator, **extra)
        self.iteration += 1
        result.metrics["iteration"] = self.iteration
        result.metrics["reward_weights"] = dict(self.config.reward_weights)
        result.metrics["preference_model_version"] = self.preference_version
        if self.config.eval_every and self.iteration % self.config.eval_every == 0:
            result.metrics.update(self.evaluate())
        return result

    def evaluate(self) -> dict[str, float]:
        """Periodic evaluation (`eval_every`): mean rewards and exact-count accuracy over every
        shapes prompt x `eval_seeds` fixed seeds, with the rollout solver, as `eval_*`
        metrics. Its seeds are its own, so training's random stream is untouched."""
        from trainer.evaluation import evaluate

        model = getattr(self.model, "inner", self.model)  # DDP's module, not DDP
        was_training = model.training
        out = evaluate(model, seeds=tuple(range(self.config.eval_seeds)),
                       solver=self.config.rollout_solver, steps=self.config.rollout_steps)
        model.train(was_training)
        return {f"eval_{k}": v for k, v in out.items() if isinstance(v, float)}

    def run(self, on_iteration: Callable[[Trainer, IterationResult], bool | None] | None = None
            ) -> None:
        """Iterate until config.iterations; `on_iteration` returning True stops early."""
        while self.iteration < self.config.iterations:
            result = self.step()
            if on_iteration is not None and on_iteration(self, result):
                break

    # -- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, root: str | Path) -> Path:
        """root/iter-NNNNNN/{model,trainer_state}.safetensors; written atomically."""
        final = Path(root) / f"iter-{self.iteration:06d}"
        tmp = final.with_name(final.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        meta = {"iteration": str(self.iteration), "train_config": json.dumps(self.config.to_dict())}
        self.model.save(tmp / "model.safetensors", extra_metadata=meta)
        tensors, opt_meta = _flatten_optimizer(self.optimizer)
        tensors["rng_state"] = self.generator.get_state()
        save_file(tensors, str(tmp / "trainer_state.safetensors"),
                  metadata={**meta, "optimizer": json.dumps(opt_meta)})
        if final.exists():
            import shutil

            shutil.rmtree(final)
        tmp.rename(final)
        return final

    def load_checkpoint(self, directory: str | Path) -> None:
        directory = Path(directory)
        from safetensors.torch import load_file

        self.model.load_state_dict(load_file(str(directory / "model.safetensors"),
                                             device=str(self.device)))
        state_path = directory / "trainer_state.safetensors"
        with safe_open(str(state_path), framework="pt") as f:
            metadata = f.metadata()
        tensors = load_file(str(state_path))
        self.generator.set_state(tensors.pop("rng_state"))
        _load_optimizer(self.optimizer, tensors, json.loads(metadata["optimizer"]), self.device)
        self.iteration = int(metadata["iteration"])


def latest_checkpoint(root: str | Path) -> Path | None:
    root = Path(root)
    if not root.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := CHECKPOINT_DIR_RE.match(p.name)) and (p / "trainer_state.safetensors").exists()]
    return max(found)[1] if found else None


def _flatten_optimizer(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    state = optimizer.state_dict()
    tensors = {}
    for param_id, param_state in state["state"].items():
        for key, value in param_state.items():
            tensors[f"opt.{param_id}.{key}"] = torch.as_tensor(value).detach().contiguous().cpu()
    return tensors, {"param_groups": state["param_groups"]}


def _load_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                    meta: dict, device: torch.device) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        _, param_id, key = name.split(".", 2)
        # Adam's `step` lives on the CPU; moments live with the parameters.
        state.setdefault(int(param_id), {})[key] = value if key == "step" else value.to(device)
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
