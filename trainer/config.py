"""TrainConfig: the one description of a training run.

The same dataclass is what `python -m trainer train --config` reads, what the API validates a
job's config against, what the UI's launch form is built from, and what is stored on the job.
Every field carries its help text, allowed range and (for choices) allowed values in its
metadata, so callers can render forms and errors without a second schema.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config value is wrong. `field` names it; the message says what is allowed."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


class ConfigErrors(ConfigError):
    """Several bad fields at once; `errors` lists them (`field`/`message` are the first's)."""

    def __init__(self, errors: list[ConfigError]) -> None:
        super().__init__(errors[0].field, errors[0].message)
        self.errors = errors
        self.args = ("; ".join(str(e) for e in errors),)

    def __str__(self) -> str:
        return self.args[0]


# "preference" is blended in at run time from a fitted model (Trainer.set_preference_model)
RUN_TIME_REWARDS = ("preference",)


def _reward_weight_problems(weights: dict, known: list[str]) -> list[ConfigError]:
    if not weights:
        return [ConfigError("reward_weights", "needs at least one named reward")]
    out = []
    for name, weight in weights.items():
        if (not isinstance(name, str) or isinstance(weight, bool)
                or not isinstance(weight, (int, float)) or not math.isfinite(weight)):
            out.append(ConfigError("reward_weights", f"must map names to finite numbers, got "
                                                     f"{name!r}: {weight!r}"))
        elif name not in known and name not in RUN_TIME_REWARDS:
            out.append(ConfigError("reward_weights", f"unknown reward {name!r}; known: "
                                   f"{sorted([*known, *RUN_TIME_REWARDS])}"))
    return out


def _field(default: Any, help: str, *, min: float | None = None, max: float | None = None,
           choices: tuple[str, ...] | None = None, **kwargs: Any) -> Any:
    meta = {"help": help, "min": min, "max": max, "choices": choices}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: json.loads(json.dumps(default)), metadata=meta, **kwargs)
    return field(default=default, metadata=meta, **kwargs)


@dataclass
class TrainConfig:
    # --- what to train -------------------------------------------------------------------
    method: str = _field("neighbor", "Training algorithm: Neighbor GRPO ('neighbor') or the "
                         "SDE-based baseline ('sde', DanceGRPO / Flow-GRPO style).",
                         choices=("neighbor", "sde"))
    model: str = _field("shapes", "Model adapter (trainer.models registry). 'shapes' is the "
                        "built-in tiny DiT that trains on a CPU.", choices=("shapes",))
    base_checkpoint: str = _field("", "Path to the base model weights (safetensors). Empty "
                                  "means the shipped shapes base checkpoint.")
    prompts: list = _field([], "Training prompts. Empty means all 48 shapes prompts.")
    # --- budget --------------------------------------------------------------------------
    iterations: int = _field(200, "Number of GRPO iterations.", min=1, max=1_000_000)
    prompts_per_iteration: int = _field(4, "Prompts per iteration; each gets its own group.",
                                        min=1, max=1024)
    group_size: int = _field(12, "G: group members (perturbed noises / rollouts) per prompt.",
                             min=2, max=256)
    # --- Neighbor GRPO -------------------------------------------------------------------
    sigma: float = _field(0.3, "Neighborhood radius: eps_i = sqrt(1-sigma^2) eps* + sigma "
                          "delta_i. 0 collapses the group onto one noise, 1 makes it "
                          "independent.", min=0.0, max=1.0)
    num_anchors: int = _field(4, "B: anchors per group per iteration; one optimizer step "
                              "each (symmetric anchor sampling).", min=1, max=256)
    num_train_timesteps: int = _field(4, "K: timesteps per anchor whose one-step predictions "
                                      "are trained (gradients accumulated over them).",
                                      min=1, max=1000)
    quasi_norm_p: float = _field(2.0, "p of the group-wise quasi-norm advantage reweighting; "
                                 "2 is the plain z-score, the paper's choice is 0.8.",
                                 min=0.1, max=2.0)
    temperature: float = _field(0.0, "Temperature of the leaping policy softmax over "
                                "-||x_i - x_theta||^2. 0 means the latent dimension (keeps "
                                "log-ratios O(1) in any resolution); the paper uses 1.",
                                min=0.0, max=1e9)
    old_policy: str = _field("one_step", "How pi_old is computed: 'one_step' = the rollout "
                             "weights' one-step Euler prediction from the anchor (ratio is "
                             "exactly 1 at the first update); 'rollout' = the anchor's stored "
                             "next latent (the paper's literal Algorithm 1).",
                             choices=("one_step", "rollout"))
    kl_coefficient: float = _field(0.0, "beta: weight of KL(policy || base model) in the loss, "
                                   "the KL of the two leaping policies' kernels at each anchor "
                                   "(squared distance of their one-step predictions over the "
                                   "temperature). Keeps the policy near the base, where a learned "
                                   "reward can be trusted; costs one more forward pass per "
                                   "anchor step. 0 disables it (the paper's setting). Neighbor "
                                   "GRPO only.", min=0.0, max=1e6)
    # --- SDE baseline --------------------------------------------------------------------
    eta: float = _field(0.7, "SDE baseline: noise level eta of the SDE sampler "
                        "(sigma_t = eta * sqrt(t / (1 - t))).", min=0.0, max=5.0)
    # --- shared optimisation -------------------------------------------------------------
    clip_range: float = _field(0.2, "PPO clip range epsilon on the ratio.", min=1e-8, max=10.0)
    learning_rate: float = _field(3e-6, "AdamW learning rate. Above ~3e-5 the shapes model "
                                  "drifts and collapses.", min=1e-9, max=1e-2)
    weight_decay: float = _field(0.0, "AdamW weight decay.", min=0.0, max=1.0)
    max_grad_norm: float = _field(1.0, "Gradient norm clip before each optimizer step "
                                  "(0 disables).", min=0.0, max=1e6)
    shuffle_advantages: bool = _field(False, "Control run: shuffle advantages within each "
                                      "group so the update carries no reward signal.")
    # --- sampling ------------------------------------------------------------------------
    rollout_solver: str = _field("dpm++", "ODE solver for rollouts: DPM-Solver++(2M) or "
                                 "Euler.", choices=("dpm++", "euler"))
    rollout_steps: int = _field(8, "T: solver steps per rollout.", min=2, max=1000)
    # --- rewards -------------------------------------------------------------------------
    reward_weights: dict = _field({"count": 1.0}, "Named rewards and their weights; each is "
                                  "normalised per group before weighting. Names come from "
                                  "the reward registry (count, color, shape, combined, ...).")
    preference_model: str = _field("", "The human-preference reward model blended in as the "
                                   "reward 'preference' (give it a weight in reward_weights): a "
                                   "path to its safetensors file. A studio job also takes 'latest' "
                                   "or empty (the newest fitted model) or 'vN' (version N): the "
                                   "studio resolves those and attaches the model itself.")
    preference_uncertainty_penalty: float = _field(
        1.0, "Reward 'preference' = the preference ensemble's mean score minus this many "
        "standard deviations between its networks, so that images unlike those voted on "
        "(where the networks disagree) earn less and the policy does not over-optimise the "
        "learned reward; 0 uses the mean alone.", min=0.0, max=100.0)
    # read by the studio's job runner (it holds the votes), not by the Trainer
    preference_refit_every: int = _field(0, "Studio jobs: refit the preference model every N "
                                         "iterations from the votes that arrived meanwhile "
                                         "(online); 0 never refits.", min=0, max=1_000_000)
    # --- bookkeeping ---------------------------------------------------------------------
    seed: int = _field(0, "Seed for noises, anchors and timesteps.", min=0, max=2**31 - 1)
    sample_every: int = _field(10, "Save a sample grid / rollout group every N iterations.",
                               min=1, max=1_000_000)
    checkpoint_every: int = _field(50, "Save a resumable checkpoint every N iterations "
                                   "(and at the end).", min=1, max=1_000_000)
    eval_every: int = _field(0, "Evaluate (mean rewards, exact-count accuracy over every "
                             "shapes prompt) every N iterations, logged as eval_* metrics; 0 "
                             "disables.", min=0, max=1_000_000)
    eval_seeds: int = _field(4, "Fixed seeds per prompt in periodic evaluation (eval_every).",
                             min=1, max=1000)
    device: str = _field("auto", "Torch device: 'auto' (CUDA if present), 'cpu' or 'cuda'.",
                         choices=("auto", "cpu", "cuda"))

    # ------------------------------------------------------------------------------------
    def problems(self) -> list[ConfigError]:
        """Every bad field, each naming the field and what is allowed (empty when valid)."""
        from trainer.rewards import reward_names

        out: list[ConfigError] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            meta = f.metadata
            expected = {"int": int, "float": (int, float), "str": str, "bool": bool,
                        "list": list, "dict": dict}[str(f.type)]
            if isinstance(value, bool) and str(f.type) in ("int", "float"):
                out.append(ConfigError(f.name, f"must be a number, got {value!r}"))
            elif not isinstance(value, expected):
                out.append(ConfigError(f.name, f"must be of type {f.type}, got {value!r}"))
            elif isinstance(value, float) and not math.isfinite(value):
                out.append(ConfigError(f.name, f"must be a finite number, got {value!r}"))
            elif meta["choices"] and value not in meta["choices"]:
                out.append(ConfigError(f.name, f"must be one of {list(meta['choices'])}, "
                                               f"got {value!r}"))
            elif ((meta["min"] is not None and value < meta["min"])
                  or (meta["max"] is not None and value > meta["max"])):
                out.append(ConfigError(f.name, f"must be in [{meta['min']}, {meta['max']}], "
                                               f"got {value!r}"))
        bad = {e.field for e in out}
        if not bad & {"num_anchors", "group_size"} and self.num_anchors > self.group_size:
            out.append(ConfigError("num_anchors", f"must be <= group_size ({self.group_size}), "
                                                  f"got {self.num_anchors}"))
        if (not bad & {"num_train_timesteps", "rollout_steps"}
                and self.num_train_timesteps > self.rollout_steps):
            out.append(ConfigError("num_train_timesteps", f"must be <= rollout_steps "
                                   f"({self.rollout_steps}), got {self.num_train_timesteps}"))
        if "kl_coefficient" not in bad and self.kl_coefficient > 0 and self.method != "neighbor":
            out.append(ConfigError("kl_coefficient", "is implemented for method 'neighbor' only"))
        if "reward_weights" not in bad:
            out += _reward_weight_problems(self.reward_weights, reward_names())
        if "prompts" not in bad and not all(isinstance(p, str) and p.strip() and "\x00" not in p
                                            for p in self.prompts):
            out.append(ConfigError("prompts", "must be a list of non-empty strings without NUL "
                                              "characters"))
        return out

    def validate(self) -> TrainConfig:
        """Check every field; raise ConfigErrors naming every bad one."""
        problems = self.problems()
        if problems:
            raise ConfigErrors(problems)
        return self

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build and validate; unknown fields are errors (a typo must not be ignored). Every
        problem is reported at once (ConfigErrors)."""
        if not isinstance(data, dict):
            raise ConfigError("config", "must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = [ConfigError(str(key), "unknown field") for key in data if key not in known]
        config = cls(**{k: v for k, v in data.items() if k in known})
        problems = unknown + config.problems()
        if problems:
            raise ConfigErrors(problems)
        return config

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def describe(cls) -> list[dict[str, Any]]:
        """Field name, type, default, help, range, choices: for forms and docs."""
        out = []
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out.append({"name": f.name, "type": str(f.type), "default": default,
                        "help": f.metadata["help"], "min": f.metadata["min"],
                        "max": f.metadata["max"],
                        "choices": list(f.metadata["choices"]) if f.metadata["choices"] else None})
        return out


PRESETS: dict[str, dict[str, Any]] = {
    # Small enough to show a rising curve on a laptop CPU within minutes.
    "shapes-quick-demo": {"iterations": 60, "prompts_per_iteration": 4, "group_size": 12,
                          "num_anchors": 4, "num_train_timesteps": 4, "rollout_steps": 8,
                          "sample_every": 10, "checkpoint_every": 20},
    # The benchmark setting of issue 2 (DPM++ 8-step, G=12, B=4, K=4).
    "shapes-benchmark": {"iterations": 1000, "prompts_per_iteration": 4, "group_size": 12,
                         "num_anchors": 4, "num_train_timesteps": 4, "rollout_steps": 8,
                         "sample_every": 50, "checkpoint_every": 100, "eval_every": 100},
    # The SDE-based baseline at the same budget.
    "sde-baseline": {"method": "sde", "iterations": 1000, "prompts_per_iteration": 4,
                     "group_size": 12, "num_train_timesteps": 4, "rollout_solver": "euler",
                     "rollout_steps": 8, "clip_range": 1e-4, "sample_every": 50,
                     "checkpoint_every": 100, "eval_every": 100},
    # Tiny: for tests and smoke runs.
    "tiny": {"iterations": 3, "prompts_per_iteration": 2, "group_size": 4, "num_anchors": 2,
             "num_train_timesteps": 2, "rollout_steps": 4, "sample_every": 1,
             "checkpoint_every": 2},
}


def load_config(spec: str | None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """A preset name or a JSON file path, then overrides; validated."""
    data: dict[str, Any] = {}
    if spec:
        if spec in PRESETS:
            data.update(PRESETS[spec])
        else:
            path = Path(spec)
            if not path.is_file():
                raise ConfigError("config", f"{spec!r} is neither a preset "
                                  f"({', '.join(PRESETS)}) nor a file")
            try:
                data.update(json.loads(path.read_text()))
            except json.JSONDecodeError as exc:
                raise ConfigError("config", f"{spec} is not valid JSON: {exc}") from exc
    data.update(overrides or {})
    return TrainConfig.from_dict(data)
