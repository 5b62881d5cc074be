"""TrainConfig: the one description of a training run.

The same dataclass is what `python -m trainer train --config` reads, what the API validates a
job's config against, what the UI's launch form is built from, and what is stored on the job.
Every field carries its help text, allowed range and (for choices) allowed values in its
metadata, so callers can render forms and errors without a second schema.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import re
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.strict_json import loads_strict


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


def unknown_field_message(name: str, known: list[str]) -> str:
    """"unknown field", with the nearest field's name when `name` looks like a typo of one."""
    near = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    return f"unknown field (did you mean {near[0]!r}?)" if near else "unknown field"


# the longest text field (a path, a URL, a name), the same cap the studio's other job configs
# use; longer paths no file system takes, and a config is stored whole on its job
MAX_TEXT = 4096
# the largest image side a config may ask for (FLUX.1 is trained up to about 2 MP: 4096 px is
# far past what any card samples; the cap stops a typo's 40,000 px from reaching the model)
MAX_RESOLUTION = 4096

# the largest reward weight: rewards are normalised per group (about unit scale), so a weight
# scales the advantages; far beyond this the weighted sum overflows to inf and the run fails
# with "rewards contain NaN or inf" after its first rollouts
MAX_REWARD_WEIGHT = 1e6
# Rollouts an iteration holds at once (prompts_per_iteration x group_size): every member's
# latents, decoded image and reward live until the update, so each field's own maximum
# (1,024 x 256) would ask for a quarter of a million images an iteration. 8,192 is
# several times Flow-GRPO's largest per-iteration batch (48 groups of 24 on 32 GPUs).
MAX_ROLLOUTS_PER_ITERATION = 8192

# "preference" is blended in at run time from a fitted model (Trainer.set_preference_model)
RUN_TIME_REWARDS = ("preference",)


def _reward_weight_problems(weights: dict, known: list[str]) -> list[ConfigError]:
    if not weights:
        return [ConfigError("reward_weights", "needs at least one named reward")]
    out = []
    for name, weight in weights.items():
        if (not isinstance(name, str) or isinstance(weight, bool)
                or not isinstance(weight, (int, float))
                or isinstance(weight, float) and not math.isfinite(weight)):
            out.append(ConfigError("reward_weights", f"must map names to finite numbers, got "
                                                     f"{name!r}: {weight!r}"))
        elif abs(weight) > MAX_REWARD_WEIGHT:  # exact for ints of any size (no float())
            out.append(ConfigError("reward_weights", f"{name!r}: the weight must be in "
                                   f"[-{MAX_REWARD_WEIGHT:g}, {MAX_REWARD_WEIGHT:g}], got "
                                   f"{weight!r}"))
        elif name not in known and name not in RUN_TIME_REWARDS:
            out.append(ConfigError("reward_weights", f"unknown reward {name!r}; known: "
                                   f"{', '.join(sorted([*known, *RUN_TIME_REWARDS]))}"))
    if not out and all(weight == 0 for weight in weights.values()):
        # every advantage would be 0: the run would spend its compute and change nothing
        out.append(ConfigError("reward_weights", "at least one reward needs a non-zero "
                                                 "weight (every weight is 0)"))
    return out


def _reward_model_path_problems(paths: dict) -> list[ConfigError]:
    from trainer.rewards.models import MODEL_REWARDS

    out = []
    for name, path in paths.items():
        if name not in MODEL_REWARDS:
            out.append(ConfigError("reward_model_paths", f"{name!r} is not a model-backed "
                                   f"reward; known: {', '.join(sorted(MODEL_REWARDS))}"))
        elif not isinstance(path, str) or not path.strip() or "\x00" in path:
            out.append(ConfigError("reward_model_paths", f"{name!r} must map to a non-empty "
                                   f"path, got {path!r}"))
        elif len(path) > MAX_TEXT:
            out.append(ConfigError("reward_model_paths", f"{name!r}: the path must be at most "
                                   f"{MAX_TEXT} characters, got {len(path)}"))
    return out


def reward_server_problems(url: str, paths: Any) -> list[ConfigError]:
    """Why a (non-empty) reward_server_url cannot be used with these reward_model_paths; the
    studio's sampling job configs say the same through this."""
    from trainer.rewards.remote import url_problem

    out = []
    if (problem := url_problem(url)) is not None:
        out.append(ConfigError("reward_server_url", problem))
    if paths:  # a knob that would do nothing: the server loads the weights, not the job
        out.append(ConfigError("reward_model_paths", "must be empty with reward_server_url "
                               "(the reward server loads the weights: give it "
                               "--reward-model-paths)"))
    return out


# the diffusers models' image side where a config gives 0 (trainer.models.diffusers_flow
# takes it too), and the multiple their VAE (8) and 2x2 patches ask of a side
DIFFUSERS_DEFAULT_RESOLUTION = 512
DIFFUSERS_RESOLUTION_MULTIPLE = 16


def resolution_problem(model: str, resolution: int, default: str = "0") -> str | None:
    """What is wrong with `resolution` (0: the default) for `model`, or None: one rule for a
    train config, a rollout or evaluate job and the CLI. The shapes model draws its world's
    32x32 images only; flux and sd3 take multiples of 16; a model added with register_model
    checks its own. `default`: how the message says "the default" (a config's 0; the CLI,
    which refuses 0, says to leave the option out)."""
    from trainer.shapes.world import IMAGE_SIZE

    if model == "shapes" and resolution not in (0, IMAGE_SIZE):
        return (f"the shapes model draws {IMAGE_SIZE}x{IMAGE_SIZE} images; use {IMAGE_SIZE} (or "
                f"{default}, the same), got {resolution}")
    if model in ("flux", "sd3") and resolution % DIFFUSERS_RESOLUTION_MULTIPLE:
        return (f"must be a multiple of {DIFFUSERS_RESOLUTION_MULTIPLE} for {model} ({default}: "
                f"{DIFFUSERS_DEFAULT_RESOLUTION}, or a checkpoint's own), got {resolution}")
    return None


def model_choices() -> tuple[str, ...]:
    """The models a config may name: the trainer.models registry's, so that one added with
    `register_model` can be configured; the default (shapes) first, the rest by name."""
    from trainer.models import model_names

    return tuple(sorted(model_names(), key=lambda name: (name != "shapes", name)))


Choices = tuple[str, ...] | Callable[[], tuple[str, ...]]  # a callable: read at each check


def _choices(meta: Mapping[str, Any]) -> tuple[str, ...] | None:
    choices = meta["choices"]
    return tuple(choices()) if callable(choices) else choices


def _field(default: Any, help: str, *, min: float | None = None, max: float | None = None,
           choices: Choices | None = None, group: str = "algorithm",
           **kwargs: Any) -> Any:
    meta = {"help": help, "min": min, "max": max, "choices": choices, "group": group}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: json.loads(json.dumps(default)), metadata=meta, **kwargs)
    return field(default=default, metadata=meta, **kwargs)


# the largest seed: int32, so that a seed survives any store or tool that holds it as a
# 32-bit integer (a run's config goes to JSON, databases and trackers)
MAX_SEED = 2**31 - 1

# the fields only one method reads (trainer/neighbor_grpo.py, trainer/sde_grpo.py); the rest
# (group size, anchors, timesteps, p, clipping, rollout_solver for the periodic evaluation)
# both read
METHOD_FIELDS: dict[str, tuple[str, ...]] = {
    "neighbor": ("sigma", "temperature", "old_policy", "kl_coefficient"),
    "sde": ("eta",),
}

# the fields only a LoRA run reads (finetune='lora')
LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_target_modules")

# The usual attention and MLP projections of FLUX's and SD3's transformer blocks (diffusers
# module names; peft matches them as suffixes), as diffusers' DreamBooth LoRA scripts target
# them. FLUX's single-stream blocks get adapters on their attention (to_q/k/v) only: their
# fused MLP (proj_mlp, proj_out) is left out, as in those scripts, and a suffix "proj_out"
# would also catch the transformer's final projection.
DEFAULT_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj",
                        "add_v_proj", "to_add_out", "ff.net.0.proj", "ff.net.2",
                        "ff_context.net.0.proj", "ff_context.net.2"]


# TrainConfig is split the way TRL splits a script's arguments: what model to train and how
# (ModelArguments), the algorithm (AlgorithmArguments), the run's bookkeeping (RunArguments) and
# settings the studio's job runner reads around the trainer (StudioArguments). They combine
# into one flat config, which is what the API, the UI form, the CLI's --set and presets use.
@dataclass
class ModelArguments:
    model: str = _field("shapes", "Model adapter (trainer.models registry): 'shapes' is the "
                        "built-in tiny DiT that trains on a CPU; 'flux' is FLUX.1 (dev with its "
                        "guidance embedding, or schnell) and 'sd3' Stable Diffusion 3 / 3.5 "
                        "(medium, large), both through diffusers from model_path; or a model "
                        "added with trainer.models.register_model.",
                        choices=model_choices, group="model")
    model_path: str = _field("", "flux / sd3: the diffusers-format model directory (the one "
                             "holding model_index.json, transformer/, vae/, text encoders and "
                             "tokenizers); loaded with local_files_only, nothing downloads. Studio "
                             "jobs take only paths under the MODELS_DIR setting. Empty for "
                             "shapes.", group="model")
    base_checkpoint: str = _field("", "Weights to start from. shapes: a model.safetensors "
                                  "(empty: the shipped base). flux / sd3: a checkpoint directory "
                                  "of an earlier run (its LoRA or full transformer; empty: the "
                                  "model at model_path).", group="model")
    finetune: str = _field("full", "What trains: 'full' (every transformer weight) or 'lora' "
                           "(low-rank adapters through peft; the base stays frozen, checkpoints "
                           "hold the adapters alone, the KL reference is the model with its "
                           "adapters disabled). FLUX on one card needs 'lora'. shapes: 'full'.",
                           choices=("full", "lora"), group="model")
    lora_rank: int = _field(32, "LoRA rank r (finetune='lora').", min=1, max=1024,
                            group="model")
    lora_alpha: float = _field(64.0, "LoRA alpha; the adapters' output is scaled by "
                               "alpha / rank.", min=1e-6, max=1e6, group="model")
    lora_target_modules: list = _field(DEFAULT_LORA_TARGETS, "Module names (suffixes) that get "
                                       "LoRA adapters; the default covers the attention and MLP "
                                       "projections of FLUX's double-stream and SD3's blocks "
                                       "and the attention of FLUX's single-stream blocks (add "
                                       "\"proj_mlp\" for their MLP).", group="model")
    resolution: int = _field(0, "Image side in pixels (square). 0: the model's default (shapes "
                             "32, flux / sd3 512). flux / sd3: a multiple of 16.",
                             min=0, max=MAX_RESOLUTION, group="model")
    guidance_scale: float = _field(3.5, "FLUX.1-dev: the value fed to its guidance embedding "
                                   "(schnell has none and ignores it); SD3: the classifier-free "
                                   "guidance scale used in rollouts and training, as Flow-GRPO "
                                   "does (<= 1 turns CFG off and halves the cost). shapes has no "
                                   "guidance.", min=0.0, max=100.0, group="model")
    mixed_precision: str = _field("auto", "Weights and compute dtype: 'bf16' (frozen weights in "
                                  "bf16, trained LoRA weights in fp32, compute under bf16 "
                                  "autocast), 'no' (fp32), or 'auto' (bf16 for flux / sd3 on CUDA, "
                                  "fp32 otherwise).",
                                  choices=("auto", "no", "bf16"), group="model")
    gradient_checkpointing: bool = _field(False, "Recompute the transformer's activations in the "
                                          "backward pass: less memory for more compute (flux / "
                                          "sd3).", group="model")
    gradient_checkpointing_fraction: float = _field(
        1.0, "With gradient_checkpointing: the share of the transformer's blocks that recompute "
        "their activations, evenly spaced over its block lists (1.0 every block, the least "
        "memory; 0.5 every other block: about half the activation memory is kept and half "
        "the recomputation is saved). A knob between memory and speed for the update: the "
        "flux-lora preset's 0.25 is a 512 px choice (FLUX at 1,024 px: 94 GiB with 0.25, "
        "46 GiB with 1.0 on an H200, docs/benchmarks.md).",
        min=0.0, max=1.0, group="model")
    torch_compile: bool = _field(False, "Compile each transformer block with torch.compile "
                                 "(regional compilation: the repeated blocks, not the whole "
                                 "model, so the first iterations spend a minute or two "
                                 "compiling, not ten). Pays on long GPU runs of flux / sd3; "
                                 "the shapes model is launch-bound and does not take it.",
                                 group="model")
    parallelism: str = _field("ddp", "How several processes (TRAIN_NPROC, train_nnodes, "
                              "torchrun) share the model: 'ddp' keeps a whole copy on every "
                              "process and averages gradients (LoRA, and models that fit one "
                              "card); 'fsdp' shards weights, gradients and optimizer state "
                              "over the processes (FSDP2; full fine-tuning of models too big "
                              "for one card). One process trains the same either way.",
                              choices=("ddp", "fsdp"), group="model")


@dataclass
class AlgorithmArguments:
    method: str = _field("neighbor", "Training algorithm: Neighbor GRPO ('neighbor') or the "
                         "SDE-based baseline ('sde', DanceGRPO / Flow-GRPO style).",
                         choices=("neighbor", "sde"), group="algorithm")
    prompts: list = _field([], "Training prompts (the CLI's --prompts-file). Empty means the "
                           "train split of the job's dataset when it names one (the studio), "
                           "else, for the shapes model only, its 48 prompts; flux and sd3 "
                           "need prompts or a dataset.", group="algorithm")
    # --- budget --------------------------------------------------------------------------
    iterations: int = _field(200, "Number of GRPO iterations.", min=1, max=1_000_000,
                             group="algorithm")
    prompts_per_iteration: int = _field(4, "Prompts per iteration; each gets its own group.",
                                        min=1, max=1024, group="algorithm")
    group_size: int = _field(12, "G: group members (perturbed noises / rollouts) per prompt.",
                             min=2, max=256, group="algorithm")
    # --- Neighbor GRPO -------------------------------------------------------------------
    sigma: float = _field(0.3, "Neighborhood radius: eps_i = sqrt(1-sigma^2) eps* + sigma "
                          "delta_i. 0 collapses the group onto one noise, 1 makes it "
                          "independent. Neighbor GRPO only.", min=0.0, max=1.0, group="algorithm")
    num_anchors: int = _field(4, "B: anchors per group per iteration; one optimizer step "
                              "each (symmetric anchor sampling).", min=1, max=256,
                              group="algorithm")
    num_train_timesteps: int = _field(4, "K: timesteps per anchor whose one-step predictions "
                                      "are trained (gradients accumulated over them).",
                                      min=1, max=1000, group="algorithm")
    quasi_norm_p: float = _field(2.0, "p of the group-wise quasi-norm advantage reweighting; "
                                 "2 is the plain z-score, the paper's choice is 0.8.",
                                 min=0.1, max=2.0, group="algorithm")
    temperature: float = _field(0.0, "Temperature of the leaping policy softmax over "
                                "-||x_i - x_theta||^2. 0 means the latent dimension (keeps "
                                "log-ratios O(1) in any resolution); the paper uses 1. Neighbor GRPO only.",
                                min=0.0, max=1e9, group="algorithm")
    old_policy: str = _field("one_step", "How pi_old is computed: 'one_step' = the rollout "
                             "weights' one-step Euler prediction from the anchor, made with the "
                             "velocity the rollout evaluated there (no extra forward; ratio 1 "
                             "at the first update); 'rollout' = the anchor's stored "
                             "next latent (the paper's literal Algorithm 1). Neighbor GRPO only.",
                             choices=("one_step", "rollout"), group="algorithm")
    kl_coefficient: float = _field(0.0, "beta: weight of KL(policy || base model) in the loss, "
                                   "the KL of the two leaping policies' kernels at each anchor "
                                   "(squared distance of their one-step predictions over the "
                                   "temperature). Keeps the policy near the base, where a learned "
                                   "reward can be trusted; costs one more forward pass per "
                                   "anchor step. The base is the weights the run starts from "
                                   "(base_checkpoint's, an earlier LoRA's included; under "
                                   "finetune 'lora' no second copy of the transformer). 0 "
                                   "disables it (the paper's setting). Neighbor GRPO only.",
                                   min=0.0, max=1e6, group="algorithm")
    # --- SDE baseline --------------------------------------------------------------------
    eta: float = _field(0.7, "SDE baseline: noise level eta of the SDE sampler "
                        "(sigma_t = eta * sqrt(t / (1 - t))).", min=0.0, max=5.0,
                        group="algorithm")
    # --- shared optimisation -------------------------------------------------------------
    clip_range: float = _field(0.2, "PPO clip range epsilon on the ratio.", min=1e-8, max=10.0,
                               group="algorithm")
    learning_rate: float = _field(1e-6, "AdamW learning rate. On the shipped shapes base, 3e-6 "
                                  "already drifts it down (docs/benchmarks.md); 1e-6 raises "
                                  "its accuracy.", min=1e-9, max=1e-2, group="algorithm")
    weight_decay: float = _field(0.0, "AdamW weight decay.", min=0.0, max=1.0, group="algorithm")
    max_grad_norm: float = _field(1.0, "Gradient norm clip before each optimizer step "
                                  "(0 disables).", min=0.0, max=1e6, group="algorithm")
    shuffle_advantages: bool = _field(False, "Control run: shuffle advantages within each "
                                      "group so the update carries no reward signal.",
                                      group="algorithm")
    # --- sampling ------------------------------------------------------------------------
    rollout_solver: str = _field("dpm++", "ODE solver for rollouts: DPM-Solver++(2M) or "
                                 "Euler, on the model's own (shifted) schedule. Neighbor GRPO "
                                 "(and sampling, evaluation); the SDE baseline's rollouts are "
                                 "its own stochastic Euler steps.",
                                 choices=("dpm++", "euler"), group="algorithm")
    # at least 2: the SDE baseline's last step (to t=0) has no noise, so its likelihood is
    # undefined (0/0) and a 1-step rollout leaves no step to train; sample and evaluate
    # (trainer/cli.py's --steps) take 1, a deterministic image needing no likelihood
    rollout_steps: int = _field(8, "T: solver steps per rollout.", min=2, max=1000,
                                group="algorithm")
    # --- rewards -------------------------------------------------------------------------
    reward_weights: dict = _field({"count": 1.0}, "Named rewards and their weights; each is "
                                  "normalised per group before weighting. Names come from "
                                  "the reward registry (count, color, shape, combined, "
                                  "jpeg_compressibility, ...).", group="algorithm")
    reward_model_paths: dict = _field({}, "Model-backed rewards (hpsv2, pickscore, clip_score, "
                                      "aesthetic, imagereward): name -> the local directory "
                                      "of its weights, for those not in the default "
                                      "REWARD_MODELS_DIR/<name>/. Nothing downloads; a missing "
                                      "or incomplete directory fails the job at its start, "
                                      "naming the files expected. Studio jobs take only paths "
                                      "under MODELS_DIR or REWARD_MODELS_DIR.",
                                      group="algorithm")
    reward_server_url: str = _field("", "Score rewards on a reward server (`python -m "
                                    "trainer.rewards.serve`) at this http(s) URL instead of "
                                    "loading reward models in the job: several jobs then share "
                                    "one set of models on one GPU. Every reward but 'preference' "
                                    "is scored there; the job checks at its start that the "
                                    "server serves them all (the server holds the weights, so "
                                    "reward_model_paths stays empty). Empty: score in the job's "
                                    "own process.", group="algorithm")
    preference_model: str = _field("", "The human-preference reward model blended in as the "
                                   "reward 'preference' (give it a weight in reward_weights): a "
                                   "path to its safetensors file. A studio job also takes 'latest' "
                                   "or empty (the newest fitted model) or 'vN' (version N): the "
                                   "studio resolves those and attaches the model itself.",
                                   group="algorithm")
    preference_uncertainty_penalty: float = _field(
        1.0, "Reward 'preference' = the preference ensemble's mean score minus this many "
        "standard deviations between its networks, so that images unlike those voted on "
        "(where the networks disagree) earn less and the policy does not over-optimise the "
        "learned reward; 0 uses the mean alone.", min=0.0, max=100.0, group="algorithm")


@dataclass
class RunArguments:
    seed: int = _field(0, "Seed for noises, anchors and timesteps.", min=0, max=MAX_SEED,
                       group="run")
    sample_every: int = _field(10, "Save a sample grid / rollout group every N iterations.",
                               min=1, max=1_000_000, group="run")
    checkpoint_every: int = _field(50, "Save a resumable checkpoint every N iterations "
                                   "(and at the end).", min=1, max=1_000_000, group="run")
    eval_every: int = _field(0, "Evaluate (mean rewards, exact-count accuracy over every "
                             "shapes prompt) every N iterations, logged as eval_* metrics; 0 "
                             "disables.", min=0, max=1_000_000, group="run")
    eval_seeds: int = _field(4, "Fixed seeds per prompt in periodic evaluation (eval_every).",
                             min=1, max=1000, group="run")
    device: str = _field("auto", "Torch device: 'auto' (CUDA if present), 'cpu' or 'cuda' "
                         "(the first visible GPU: choose one with CUDA_VISIBLE_DEVICES).",
                         choices=("auto", "cpu", "cuda"), group="run")
    rollout_batch_size: int = _field(0, "Rollouts solved (and decoded) per batch; 0: all P x G "
                                     "at once. Lower it when a large model runs out of memory; "
                                     "results do not change.", min=0, max=100_000, group="run")
    train_batch_size: int = _field(0, "One-step predictions per forward-backward pass in the "
                                   "update (gradients accumulate over the passes of one "
                                   "optimizer step); 0: all at once. Results do not change.",
                                   min=0, max=100_000, group="run")
    report_to: str = _field("none", "Experiment trackers that get every iteration's metrics "
                            "and sample grids (trainer/tracking.py), named as TRL and "
                            "accelerate name them: 'none', 'tensorboard', 'wandb', 'mlflow', "
                            "several comma-separated (or a list), or 'all' (those installed "
                            "where the run starts). Logs go under the run's directory (the "
                            "CLI's <out>/tracking; studio jobs: STORAGE_DIR/tracking): "
                            "TensorBoard event files, W&B offline unless WANDB_MODE is set, an "
                            "MLflow SQLite store unless MLFLOW_TRACKING_URI is set. The packages "
                            "come with the 'tracking' extra.", group="run")


@dataclass
class StudioArguments:
    """Read by the studio's job runner, which holds the votes and the hosts; a Trainer used as
    a library does not act on them (its config is still checked whole: a train_nnodes that
    does not divide prompts_per_iteration is refused wherever the config is made)."""

    preference_refit_every: int = _field(0, "Studio jobs: refit the preference model every N "
                                         "iterations from the votes that arrived meanwhile "
                                         "(online); 0 never refits.", min=0, max=1_000_000,
                                         group="studio")
    train_nnodes: int = _field(1, "Studio jobs: hosts the job trains on at once (torchrun's "
                               "rendezvous; the README says how). prompts_per_iteration "
                               "must be a multiple of it; each host runs up to its "
                               "TRAIN_NPROC processes, as many as split its share of the "
                               "prompts evenly (a 'fsdp' job all of them: the studio refuses "
                               "one whose prompts no reported TRAIN_NPROC splits, and a "
                               "host whose TRAIN_NPROC does not fit fails it saying so). 1: "
                               "one host alone.", min=1, max=1024, group="studio")


# Explicit text-direction controls (embeddings, overrides, isolates): in a prompt they
# reorder how the text after them is shown, so what a reviewer reads in the UI is not what
# the text encoder gets ("Trojan Source", Unicode TR36). The marks LRM/RLM and the joiners
# emoji need stay allowed.
DIRECTION_CONTROLS = frozenset(chr(c) for c in [*range(0x202A, 0x202F), *range(0x2066, 0x206A)])


def prompt_text_problem(text: str) -> str | None:
    """Why `text` cannot be a prompt, or None: blank, or holding a control character that is
    not whitespace (NUL, which PostgreSQL refuses; ESC, which rewrites a terminal that prints
    the log; DEL) or a text-direction control. One rule for uploads, job configs and the
    CLI's prompt files."""
    if not text.strip():
        return "empty prompt"
    if surrogates := sorted({c for c in text if unicodedata.category(c) == "Cs"}):
        # only a JSON escape ("\\ud800") makes one: no UTF-8 text holds it, so neither can a
        # database or a response
        found = ", ".join(f"U+{ord(c):04X}" for c in surrogates[:5])
        return f"prompt contains lone surrogate escapes ({found}), which are not text"
    bad = sorted({c for c in text if (unicodedata.category(c) == "Cc" and not c.isspace())
                  or c in DIRECTION_CONTROLS})
    if bad:
        found = ", ".join(f"U+{ord(c):04X}" for c in bad[:5])
        kind = "NUL" if bad == ["\x00"] else "control or text-direction characters"
        return f"prompt contains {kind} ({found})"
    return None


# a train config's preference_model beside reward_weights without 'preference': the run would
# never read it (said by the CLI and the studio alike)
PREFERENCE_WITHOUT_WEIGHT = ("names a preference model, but reward_weights has no 'preference' "
                             "weight to blend it with: add one (e.g. \"preference\": 1) or "
                             "leave preference_model empty")


def missing_prompts_problem(model: str, prompts: list, dataset: bool = False,
                            studio: bool = False, evaluate: bool = False) -> str | None:
    """Why a run of `model` cannot train on `prompts`, or None: a real model's (flux, sd3)
    without any. The shapes world's 48 prompts stand in for a shapes run's, but a FLUX run on
    "three blue triangles" is a mistake, not a default. `dataset`: a dataset gives the prompts
    (the studio reads them at the job's start). The message speaks to the library and CLI, or
    (`studio`) to the job API and form. `evaluate`: the same rule for an evaluation (the CLI's
    `evaluate`, an evaluate job), which read the shapes prompts for FLUX without a word."""
    from trainer.models import uses_model_directory

    if prompts or dataset or not uses_model_directory(model):
        return None
    if evaluate:
        verb = "is evaluated"
        given = ("config.prompts or a dataset (config.dataset_id: its split)" if studio else
                 "--prompts-file")
    else:
        verb = "trains"
        given = ("a dataset (dataset_id: its train split) or config.prompts" if studio else
                 "prompts (the CLI's --prompts-file)")
    return (f"model {model!r} {verb} on prompts you give: {given}; the 48 shapes prompts are "
            "the shapes model's")


# what a field of each type takes, said with the form to write it in: a list or an object
# given as plain text (`--set prompts=a,b`) was "must be of type list", with no hint that it
# is written as JSON, in a job's config and on the command line alike
_TYPE_TEXT = {"int": "a whole number", "float": "a number", "str": "a string",
              "bool": "true or false", "list": "a JSON array", "dict": "a JSON object"}


def decimal_point_message(value: float) -> str:
    """What a whole number written with a decimal point (`5.0` for an integer field) is told:
    "must be a whole number, got 5.0" read as a contradiction."""
    return f"must be a whole number written without a decimal point ({int(value)}, not {value!r})"


def _type_text(field: dataclasses.Field) -> str:
    """What `field` takes, with an example of a list or an object in JSON (its default when
    that is not empty)."""
    text = _TYPE_TEXT[str(field.type)]
    if str(field.type) not in ("list", "dict"):
        return text
    default = field.default_factory() if callable(field.default_factory) else field.default
    if isinstance(default, list) and default:
        example = json.dumps(default[:2])
    elif isinstance(default, dict) and default:
        example = json.dumps(dict(list(default.items())[:2]))
    else:
        example = '["one", "two"]' if str(field.type) == "list" else '{"name": 1.0}'
    return f"{text}, e.g. {example}"


@dataclass
class TrainConfig(StudioArguments, RunArguments, AlgorithmArguments, ModelArguments):
    """The one description of a training run (fields in the order of the groups: model,
    algorithm, run, studio)."""

    def __post_init__(self) -> None:
        # report_to as TRL takes it, a list of names too; stored as the one string a form,
        # the CLI's --set and a job's JSON all show alike
        if (isinstance(self.report_to, (list, tuple))
                and all(isinstance(name, str) for name in self.report_to)):
            self.report_to = ",".join(self.report_to)

    # ------------------------------------------------------------------------------------
    def prompts_problem(self, dataset: bool = False) -> ConfigError | None:
        """missing_prompts_problem of this run, as a ConfigError naming `prompts`."""
        problem = missing_prompts_problem(self.model, self.prompts, dataset)
        return None if problem is None else ConfigError("prompts", problem)

    def problems(self) -> list[ConfigError]:
        """Every bad field, each naming the field and what is allowed (empty when valid)."""
        from trainer.rewards import reward_names, shapes_only_problem

        out: list[ConfigError] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            meta = f.metadata
            expected = {"int": int, "float": (int, float), "str": str, "bool": bool,
                        "list": list, "dict": dict}[str(f.type)]
            if isinstance(value, bool) and str(f.type) in ("int", "float"):
                out.append(ConfigError(f.name, f"must be a number, got {value!r}"))
            elif (str(f.type) == "int" and isinstance(value, float) and math.isfinite(value)
                  and value.is_integer()):
                out.append(ConfigError(f.name, decimal_point_message(value)))
            elif not isinstance(value, expected):
                # 'inf' and 'nan' are text to JSON (--set sigma=inf): said as the number
                # they mean, not as "must be a number"
                out.append(ConfigError(f.name, f"must be a finite number, got {value!r}"
                                       if str(f.type) == "float" and _non_finite_text(value)
                                       else f"must be {_type_text(f)}, got {value!r}"))
            elif isinstance(value, float) and not math.isfinite(value):
                out.append(ConfigError(f.name, f"must be a finite number, got {value!r}"))
            elif isinstance(value, str) and len(value) > MAX_TEXT:
                out.append(ConfigError(f.name, f"must be at most {MAX_TEXT} characters, got "
                                               f"{len(value)}"))
            elif (choices := _choices(meta)) and value not in choices:
                # a GPU index is the launcher's to give (torchrun ranks take their own card)
                hint = ("; to run on another GPU, set CUDA_VISIBLE_DEVICES (e.g. "
                        "CUDA_VISIBLE_DEVICES=1 with device 'cuda')"
                        if f.name == "device" and re.fullmatch(r"cuda:\d+", value) else "")
                out.append(ConfigError(f.name, f"must be one of {list(choices)}, "
                                               f"got {value!r}{hint}"))
            elif ((meta["min"] is not None and value < meta["min"])
                  or (meta["max"] is not None and value > meta["max"])):
                out.append(ConfigError(f.name, f"must be in [{meta['min']}, {meta['max']}], "
                                               f"got {value!r}"))
        bad = {e.field for e in out}
        if not bad & {"num_anchors", "group_size"} and self.num_anchors > self.group_size:
            out.append(ConfigError("num_anchors", f"must be <= group_size ({self.group_size}), "
                                                  f"got {self.num_anchors}"))
        if (not bad & {"prompts_per_iteration", "group_size"}
                and self.prompts_per_iteration * self.group_size > MAX_ROLLOUTS_PER_ITERATION):
            out.append(ConfigError("group_size", f"prompts_per_iteration x group_size "
                                   f"({self.prompts_per_iteration} x {self.group_size} = "
                                   f"{self.prompts_per_iteration * self.group_size}) must be "
                                   f"at most {MAX_ROLLOUTS_PER_ITERATION} rollouts an "
                                   "iteration"))
        if (not bad & {"num_train_timesteps", "rollout_steps"}
                and self.num_train_timesteps > self.rollout_steps):
            out.append(ConfigError("num_train_timesteps", f"must be <= rollout_steps "
                                   f"({self.rollout_steps}), got {self.num_train_timesteps}"))
        if "eta" not in bad and self.method == "sde" and self.eta <= 0:
            # sigma_t = 0: the SDE step is deterministic and its log-likelihood undefined
            out.append(ConfigError("eta", "must be above 0 for method 'sde' (0 makes its "
                                   "sampler deterministic, with no likelihood to train), got "
                                   f"{self.eta}"))
        if "sigma" not in bad and self.method == "neighbor" and self.sigma <= 0:
            # every member the same noise, the same image and reward: no advantage to learn from
            out.append(ConfigError("sigma", "must be above 0 for method 'neighbor' (0 gives "
                                   "every group member the same noise, so every advantage is "
                                   f"0), got {self.sigma}"))
        if "method" not in bad:
            out += self._method_field_problems(bad)
        # each host runs at least one process, and every process trains an equal share
        if (not bad & {"train_nnodes", "prompts_per_iteration"}
                and self.prompts_per_iteration % self.train_nnodes):
            out.append(ConfigError("train_nnodes", f"prompts_per_iteration "
                                   f"({self.prompts_per_iteration}) must be a multiple of "
                                   f"train_nnodes ({self.train_nnodes}): every host trains an "
                                   "equal share of each iteration's prompts"))
        if "reward_weights" not in bad:
            out += _reward_weight_problems(self.reward_weights, reward_names())
            if "model" not in bad and (problem := shapes_only_problem(
                    [n for n in self.reward_weights if isinstance(n, str)], self.model)):
                out.append(ConfigError("reward_weights", problem))
        if "reward_model_paths" not in bad:
            out += _reward_model_path_problems(self.reward_model_paths)
            if "reward_weights" not in bad:
                # a path for a reward the run does not score is never read: it looked applied
                # (a reward named in one field and not the other is mostly a slip)
                out += [ConfigError("reward_model_paths", f"{name!r} is not among "
                                    f"reward_weights ({', '.join(map(str, self.reward_weights))}):"
                                    " its weights would never load; add it to reward_weights "
                                    "or take its path out")
                        for name in self.reward_model_paths if name not in self.reward_weights]
        if "reward_server_url" not in bad and self.reward_server_url:
            out += reward_server_problems(self.reward_server_url, self.reward_model_paths)
        if "report_to" not in bad:
            from trainer.tracking import report_to_problems, split_names

            out += [ConfigError("report_to", m) for m in report_to_problems(self.report_to)]
            # "wandb,tensorboard,wandb" opened one W&B run and stored the repeat: refused, as
            # a repeated reward or prompt is (split_names: case and spaces do not count)
            names = split_names(self.report_to) if isinstance(self.report_to, str) else []
            if repeated := [n for n in dict.fromkeys(names) if names.count(n) > 1]:
                out.append(ConfigError("report_to", f"must not repeat a tracker: {repeated}"))
        out += self._model_problems(bad)
        if "prompts" not in bad and not all(isinstance(p, str) for p in self.prompts):
            # numbered from 1, each named with what it is, as a prompt's text problems are
            wrong = [f"prompt {i + 1} is {json.dumps(p, default=repr)[:40]}" for i, p in
                     enumerate(self.prompts) if not isinstance(p, str)]
            more = f" and {len(wrong) - 5} more" if len(wrong) > 5 else ""
            out.append(ConfigError("prompts", "must be a list of strings: "
                                   + "; ".join(wrong[:5]) + more))
        elif "prompts" not in bad:
            texts = {i: prompt_text_problem(p) for i, p in enumerate(self.prompts)}
            # numbered from 1, as an upload's items and a prompts file's lines are
            if problems := [f"prompt {i + 1}: {problem}" for i, problem in texts.items()
                            if problem]:
                out.append(ConfigError("prompts", "; ".join(problems[:5])
                                       + (f"; and {len(problems) - 5} more"
                                          if len(problems) > 5 else "")))
            # the other prompts are judged beside these (a NUL in one hid that another was
            # no shapes prompt): those with a text problem are already named above
            clean = [self.prompts[i] for i, problem in texts.items() if problem is None]
            if self.model == "shapes" and "model" not in bad:
                from trainer.shapes.world import shapes_prompt_problem

                if (problem := shapes_prompt_problem(clean)) is not None:
                    out.append(ConfigError("prompts", problem))
        return out

    def _method_field_problems(self, bad: set[str]) -> list[ConfigError]:
        """A field only the other method reads, set away from its default: the run would
        store it and train as if it were not there (sigma under 'sde' changed nothing). A
        default value says nothing: forms and stored configs carry every field."""
        out = []
        defaults = TrainConfig()
        for method, names in METHOD_FIELDS.items():
            if method == self.method:
                continue
            for name in names:
                default = getattr(defaults, name)
                if name not in bad and getattr(self, name) != default:
                    out.append(ConfigError(name, f"applies only to method {method!r}; this run "
                                           f"has method {self.method!r}, which ignores it: "
                                           f"leave {name} at its default ({default!r}) or set "
                                           f"method to {method!r}"))
        return out

    def _model_problems(self, bad: set[str]) -> list[ConfigError]:
        """The model fields against each other (the model directory itself is checked when
        the model loads, and by the studio at submission: trainer.models.model_dir_problem)."""
        out = []
        if "model" in bad:
            return out
        from trainer.models import uses_model_directory

        # a registered model loads from a directory when it declares the files one holds
        directory = uses_model_directory(self.model)
        if directory and "model_path" not in bad and not self.model_path.strip():
            out.append(ConfigError("model_path", f"model {self.model!r} needs the path of its "
                                   "diffusers-format directory"))
        if not directory and "model_path" not in bad and self.model_path:
            out.append(ConfigError("model_path", f"must be empty for model {self.model!r} "
                                   "(its weights come from base_checkpoint)"))
        if self.model == "shapes":  # the built-in tiny model's limits; a registered one's own
            # (a field whose value is itself wrong is named once, by its own problem)
            if "finetune" not in bad and self.finetune != "full":
                out.append(ConfigError("finetune", f"model {self.model!r} trains in full only; "
                                       "'lora' is for flux and sd3"))
            if "torch_compile" not in bad and self.torch_compile:
                out.append(ConfigError("torch_compile", f"model {self.model!r} is not "
                                       "compiled (too small to gain); it is for flux and sd3"))
            if "gradient_checkpointing" not in bad and self.gradient_checkpointing:
                out.append(ConfigError("gradient_checkpointing", f"model {self.model!r} keeps "
                                       "its activations (a few MB); it is for flux and sd3"))
            if "mixed_precision" not in bad and self.mixed_precision == "bf16":
                out.append(ConfigError("mixed_precision", f"model {self.model!r} trains in "
                                       "fp32; use 'auto' or 'no' ('bf16' is for flux and sd3)"))
        elif "eval_every" not in bad and self.eval_every:
            out.append(ConfigError("eval_every", "the periodic evaluation scores the shapes "
                                   f"world; model {self.model!r} has none (use 0 and an "
                                   "evaluate job)"))
        if "resolution" not in bad and (
                problem := resolution_problem(self.model, self.resolution)) is not None:
            out.append(ConfigError("resolution", problem))
        if not {"gradient_checkpointing_fraction", "gradient_checkpointing"} & bad and (
                self.gradient_checkpointing_fraction < 1.0 and not self.gradient_checkpointing
                or self.gradient_checkpointing_fraction <= 0.0):
            out.append(ConfigError("gradient_checkpointing_fraction", "must be above 0 (no "
                                   "checkpointing is gradient_checkpointing false) and below 1 "
                                   "only with gradient_checkpointing true, got "
                                   f"{self.gradient_checkpointing_fraction}"))
        if not {"parallelism", "finetune"} & bad and self.parallelism == "fsdp" \
                and self.finetune != "full":
            out.append(ConfigError("parallelism", "'fsdp' shards full fine-tuning; LoRA "
                                   "trains with 'ddp' (its adapters are small, and the "
                                   "frozen bf16 base and fp32 adapters cannot share a shard)"))
        if "lora_target_modules" not in bad and not (
                self.lora_target_modules
                and all(isinstance(m, str) and m.strip() for m in self.lora_target_modules)):
            out.append(ConfigError("lora_target_modules", "must be a non-empty list of module "
                                   "names"))
        return out

    def validate(self) -> TrainConfig:
        """Check every field; raise ConfigErrors naming every bad one. A config that passed
        and has not changed since is not checked again (`checked`)."""
        if self.checked:
            return self
        problems = self.problems()
        if problems:
            raise ConfigErrors(problems)
        self._mark_checked()
        return self

    # A config is checked once on its way to training: by from_dict (the CLI, a library
    # caller) or by a job server's submission, whose stored form the job's runner rebuilds
    # with from_stored. The mark is a fingerprint of every field rather than a flag, so that a
    # field changed afterwards, in place too (a list or dict), is checked again by the Trainer.
    def _fingerprint(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, default=str)

    def _mark_checked(self) -> None:
        self._checked_as = self._fingerprint()

    @property
    def checked(self) -> bool:
        """Validated (here or at the studio's submission) and unchanged since."""
        return getattr(self, "_checked_as", None) == self._fingerprint()

    @classmethod
    def _unknown_fields(cls, data: Any) -> list[ConfigError]:
        """An error for each key of `data` that is not a field (a typo must not be ignored)."""
        if not isinstance(data, dict):
            raise ConfigError("config", "must be a JSON object")
        known = [f.name for f in dataclasses.fields(cls)]
        return [ConfigError(str(key), unknown_field_message(str(key), known))
                for key in data if key not in known]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build and validate; unknown fields are errors. Every problem is reported at once
        (ConfigErrors)."""
        unknown = cls._unknown_fields(data)
        # copied: a preset's (or caller's) lists and dicts must not be shared with the config
        given = copy.deepcopy({k: v for k, v in data.items()
                               if k not in {e.field for e in unknown}})
        if "reward_weights" not in given and isinstance(given.get("model"), str):
            # no rewards named: the model's own default (the dataclass's count reward reads
            # only shapes images)
            given["reward_weights"] = default_reward_weights(given["model"])
        config = cls(**given)
        problems = unknown + config.problems()
        if problems:
            raise ConfigErrors(problems)
        config._mark_checked()
        return config

    @classmethod
    def from_layers(cls, base: dict[str, Any], given: dict[str, Any]) -> TrainConfig:
        """`given` (the user's own fields: the API's config, the CLI's --set or JSON file) over
        `base` (a preset's fields, or none), validated as from_dict does, with one more rule
        that needs to know which is which: a LoRA field the user set, to a value neither
        `base` nor the defaults hold, on a run that trains in full is refused, since the run
        would ignore it (a FLUX run meant for LoRA would train all 12B weights instead). A
        default value says nothing: forms and stored configs carry every field. And one that
        follows from which is which: `gradient_checkpointing` false given over a preset's
        `gradient_checkpointing_fraction` takes the fraction's default with it."""
        problems: list[ConfigError] = []
        defaults = cls()
        merged = {**base, **given}
        if (given.get("gradient_checkpointing") is False
                and "gradient_checkpointing_fraction" not in given
                and "gradient_checkpointing_fraction" in base):
            # the preset's share of recomputed blocks (flux-lora's 0.25) belongs to the
            # checkpointing it turns on: turned off by the user, the share goes back to its
            # default, not refused as "below 1 only with gradient_checkpointing true" for a
            # value the user never gave
            merged["gradient_checkpointing_fraction"] = defaults.gradient_checkpointing_fraction
        try:
            config = cls.from_dict(merged)
        except ConfigErrors as exc:
            problems = list(exc.errors)
        model = given.get("model", base.get("model", defaults.model))
        if model == "shapes" and "guidance_scale" in given and given["guidance_scale"] not in (
                base.get("guidance_scale", defaults.guidance_scale), defaults.guidance_scale):
            problems.append(ConfigError("guidance_scale", "applies only to flux and sd3; the "
                                        "shapes model has no guidance, and the run would "
                                        "ignore it: leave guidance_scale out"))
        finetune = given.get("finetune", base.get("finetune", defaults.finetune))
        if finetune == "full":
            for name in LORA_FIELDS:
                if name in given and given[name] not in (base.get(name, getattr(defaults, name)),
                                                         getattr(defaults, name)):
                    problems.append(ConfigError(name, "applies only to finetune='lora'; this "
                                                "run has finetune='full', which ignores it: "
                                                "set finetune to 'lora' (as the flux-lora and "
                                                f"sd3-lora presets do) or leave {name} out"))
        if problems:
            raise ConfigErrors(problems)
        return config

    @classmethod
    def from_stored(cls, data: dict[str, Any]) -> TrainConfig:
        """The typed form a job server's submission validated and stored (a job's config,
        every field given), as the job's runner reads it: rebuilt, not checked again. A field
        this version does not know is still an error (a job stored by another version)."""
        unknown = cls._unknown_fields(data)
        if unknown:
            raise ConfigErrors(unknown)
        config = cls(**copy.deepcopy(data))
        config._mark_checked()
        return config

    def rollout_sampler(self) -> tuple[str, float]:
        """How this run's rollouts are drawn, as the rollouts pages record them: the ODE solver
        and the neighbourhood radius sigma for Neighbor GRPO; "sde" with independent noises
        (sigma 1) for the SDE baseline, whose rollout_solver and sigma are not read."""
        if self.method == "sde":
            return "sde", 1.0
        return self.rollout_solver, self.sigma

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
                        "choices": list(choices) if (choices := _choices(f.metadata)) else None,
                        "group": f.metadata["group"]})
        return out


# What the real-model presets share: the paper's cheapest setting on one 80 GB card (one prompt
# an iteration, G = 12, B = 4, K = 4, DPM++ 8 steps, p = 0.8), micro-batched, with the
# jpeg_compressibility reward (no reward model to configure).
_REAL_MODEL_LORA: dict[str, Any] = {
    "finetune": "lora", "resolution": 512, "mixed_precision": "auto", "iterations": 300,
    "prompts_per_iteration": 1, "group_size": 12, "num_anchors": 4, "num_train_timesteps": 4,
    "rollout_steps": 8, "learning_rate": 1e-5, "quasi_norm_p": 0.8, "sample_every": 10,
    "checkpoint_every": 50, "rollout_batch_size": 12, "train_batch_size": 4,
    "reward_weights": {"jpeg_compressibility": 1.0}}

_FLUX_LORA: dict[str, Any] = {
    **_REAL_MODEL_LORA, "model": "flux", "lora_rank": 64, "lora_alpha": 64.0,
    "guidance_scale": 3.5, "torch_compile": True, "gradient_checkpointing": True,
    "gradient_checkpointing_fraction": 0.25}

PRESETS: dict[str, dict[str, Any]] = {
    # Small enough for a laptop CPU: curves, sample grids and checkpoints within minutes. On
    # the shipped base (exact-count accuracy 0.644) the count reward moves little in 60
    # iterations at the default learning rate: the gains take hundreds (docs/benchmarks.md).
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
    # Humans in the loop on the shapes model: count + the preference model fitted from votes,
    # refitted every 50 iterations on the votes that arrived meanwhile (annotators voting on
    # the job's own samples). With 150 simulated votes a round it reached half-way to the
    # base's best decile for `upper` and `left` on all three vote sets while the count rose
    # (0.83 against 0.81); the count at weight 1 lost up to 0.14 (docs/benchmarks.md,
    # "Longer, faster and guarded runs").
    "shapes-preference": {"iterations": 700, "prompts_per_iteration": 4, "group_size": 12,
                          "num_anchors": 4, "num_train_timesteps": 4, "rollout_steps": 8,
                          "learning_rate": 3e-6, "kl_coefficient": 0.1,
                          "reward_weights": {"count": 1.5, "preference": 1.0},
                          "preference_refit_every": 50, "sample_every": 10,
                          "checkpoint_every": 100},
    # LoRA on a real model from a local diffusers directory (set model_path): the paper's
    # cheapest setting (_REAL_MODEL_LORA). FLUX compiles its blocks and recomputes a quarter
    # of them: 6.3 s an iteration at 48 GiB on an H200, as fast as keeping every activation
    # (6.2 s at 54 GiB) and against 10.3 s at 31 GiB eager with every block checkpointed
    # (docs/benchmarks.md, FLUX scale); the compilation (about a minute) pays back within the
    # first 20 iterations. SD3.5-medium compiled: 2.4 s an iteration at 24 GiB against 4.3 s
    # at 32 GiB eager on an H200; its minute of compilation pays back in about 30 iterations.
    "flux-lora": {**_FLUX_LORA},
    "sd3-lora": {**_REAL_MODEL_LORA, "model": "sd3", "lora_rank": 32, "lora_alpha": 64.0,
                 "guidance_scale": 4.5, "torch_compile": True},
    # The paper's two FLUX.1-dev objectives in flux-lora's setting: HPSv2.1 alone, and HPSv2.1,
    # PickScore and ImageReward at equal weights (each z-scored within its group before the
    # blend). Their weights load from REWARD_MODELS_DIR (or reward_model_paths), or a reward
    # server scores them (reward_server_url); submission says which are missing.
    "flux-hpsv2": {**_FLUX_LORA, "reward_weights": {"hpsv2": 1.0}},
    "flux-multi-reward": {**_FLUX_LORA, "reward_weights": {"hpsv2": 1.0, "pickscore": 1.0,
                                                           "imagereward": 1.0}},
    # Tiny: for tests and smoke runs.
    "tiny": {"iterations": 3, "prompts_per_iteration": 2, "group_size": 4, "num_anchors": 2,
             "num_train_timesteps": 2, "rollout_steps": 4, "sample_every": 1,
             "checkpoint_every": 2},
}


# what is scored when no rewards are named: the shapes world's verifiable rewards for the
# shapes model (they read its 32x32 images); for a real model an image-only reward that needs
# no weights (a first run, a smoke test)
SHAPES_EVAL_REWARDS = ("count", "exact_count", "color", "shape", "combined")
SHAPES_ROLLOUT_REWARDS = ("count", "color", "shape")
IMAGE_REWARD = "jpeg_compressibility"


def default_reward_weights(model: str) -> dict[str, float]:
    """The rewards a train config of `model` that names none trains on: the shapes world's
    count for the shapes model, IMAGE_REWARD for a real model."""
    return {"count": 1.0} if model == "shapes" else {IMAGE_REWARD: 1.0}


def default_reward_names(purpose: str, model: str) -> list[str]:
    """The rewards sampling for `purpose` ("rollout" or "evaluate") scores when none are
    named: the studio's rollout and evaluate jobs and the CLI's `sample` / `evaluate`."""
    if model != "shapes":
        return [IMAGE_REWARD]
    return list(SHAPES_EVAL_REWARDS if purpose == "evaluate" else SHAPES_ROLLOUT_REWARDS)


# images a sampling command or job (rollout, evaluate) solves and decodes at once when it gives
# no batch size: the shapes model's 32 px canvases (a whole evaluation's worth); a real model
# at 512 px holds full-size latents and decodes, so it goes by what its training fitted on its
# card (a run's rollout_batch_size), else its preset's (12 for flux-lora and sd3-lora: one
# 80 GB card), else REAL_MODEL_SAMPLE_BATCH
SHAPES_SAMPLE_BATCH = 256
REAL_MODEL_SAMPLE_BATCH = 12


def default_sampling_batch(model: str, run_batch_sizes: list[int], *,
                           uses_directory: bool) -> int:
    """The sampling batch size of `model` when none is given: SHAPES_SAMPLE_BATCH for a model
    without a directory (the shapes model), else the smallest rollout_batch_size among the
    runs its checkpoints come from, else its preset's, else REAL_MODEL_SAMPLE_BATCH."""
    if not uses_directory:
        return SHAPES_SAMPLE_BATCH
    if sizes := [size for size in run_batch_sizes if size > 0]:
        return min(sizes)
    return int(PRESETS.get(default_preset(model), {}).get("rollout_batch_size")
               or REAL_MODEL_SAMPLE_BATCH)


def default_preset(model: str) -> str:
    """The preset a train run of `model` starts from when it names none (the CLI's --config)."""
    return f"{model}-lora" if f"{model}-lora" in PRESETS else "shapes-quick-demo"


def model_preset(model: str) -> str | None:
    """The preset a train config naming `model` and no preset starts from (load_config, the
    job API, the studio's launch form): the model's LoRA preset (flux-lora, sd3-lora), None
    for the shapes model (the field defaults)."""
    preset = default_preset(model)
    return preset if preset == f"{model}-lora" else None


def load_config(spec: str | None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """A preset name or a JSON file path, then overrides; validated. No preset: the field
    defaults, except that a file or overrides naming flux or sd3 start from that model's
    preset (`default_preset`: LoRA and its batch sizes, not a full fine-tune of 12B weights),
    as the CLI and the job API do."""
    base: dict[str, Any] = {}  # the preset's fields
    data: dict[str, Any] = {}  # the user's own: a JSON file's, then the overrides
    if spec:
        if spec in PRESETS:
            base.update(PRESETS[spec])
        else:
            path = Path(spec)
            if not path.is_file():
                raise ConfigError("config", f"{spec!r} is neither a preset "
                                  f"({', '.join(PRESETS)}) nor a file")
            try:
                loaded = loads_strict(path.read_text())
            except json.JSONDecodeError as exc:
                raise ConfigError("config", f"{spec} is not valid JSON: {exc}") from exc
            except (OSError, UnicodeDecodeError) as exc:  # unreadable, or not text at all
                raise ConfigError("config", f"{spec} cannot be read as JSON: {exc}") from None
            # a list or a number would fail dict.update with a TypeError (a traceback)
            if not isinstance(loaded, dict):
                kind = ("array" if isinstance(loaded, list) else "string"
                        if isinstance(loaded, str) else "null" if loaded is None else "boolean"
                        if isinstance(loaded, bool) else "number")
                raise ConfigError("config", f"{spec} must be a JSON object of config fields, "
                                  f"got a JSON {kind}")
            data.update(loaded)
    data.update(overrides or {})
    # a file naming flux started from the field defaults (a full fine-tune at lr 1e-6, no
    # checkpointing) where --set model=flux started from flux-lora
    if (spec not in PRESETS and isinstance(model := data.get("model"), str)
            and (preset := model_preset(model))):
        base.update(PRESETS[preset])
    return TrainConfig.from_layers(base, data)


# preference_model too: a relative one stored as typed was looked for from the directory a
# --resume ran in, and the absolute path that named the same file was refused as a change
PATH_FIELDS = ("model_path", "base_checkpoint", "preference_model")


def _non_finite_text(value: Any) -> bool:
    """Whether `value` is text naming a non-finite number ('inf', '-Infinity', 'nan')."""
    try:
        return isinstance(value, str) and not math.isfinite(float(value))
    except ValueError:
        return False


def absolute_paths(config: dict) -> dict:
    """`config` (a dict of fields) with its path fields absolute, as the CLI stores them (so
    `evaluate --checkpoint` finds them from any directory); a run saved with a
    relative path (before paths were stored absolute) and resumed by retyping that path from
    the same directory is the same run, not a changed one."""
    out = dict(config)
    for key in PATH_FIELDS:
        if isinstance(out.get(key), str) and out[key].strip():
            out[key] = str(Path(out[key]).expanduser().absolute())
    return out
