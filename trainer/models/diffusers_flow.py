"""FLUX.1 and Stable Diffusion 3 / 3.5 as `FlowModel`s, through diffusers, from local weights.

One base class holds what both share: the pipeline loaded from a diffusers-format directory
with `local_files_only` (nothing downloads), prompt embeddings computed once per prompt and
cached on the CPU (the text encoders visit the GPU only to encode new prompts), the flow shift
from the model's own scheduler config, VAE decoding with its scaling and shift, LoRA through
peft (frozen bf16 base, fp32 adapters) or full fine-tuning (fp32 master weights under bf16
autocast), gradient checkpointing, the KL reference as the same transformer with its adapters
disabled (as TRL does), and checkpoints a stock pipeline loads (`load_lora_weights`).

The two subclasses hold what differs:
- FLUX packs 2x2 latent patches into tokens, so a latent is (tokens, 4 C); its image and text
  position ids have no batch dimension (shared conditioning); FLUX.1-dev takes its guidance as
  an embedding (one forward pass), FLUX.1-schnell has none; the shift is resolution-dependent
  (mu from the image's token count, as FluxPipeline computes it).
- SD3 works on (C, H, W) latents and uses classifier-free guidance: the velocity is
  v_u + g (v_c - v_u) from a doubled batch, in rollouts and in training, as the SDE peers
  (Flow-GRPO) do it; the unconditional embedding is that of the empty prompt, as
  StableDiffusion3Pipeline computes it.

Velocities and decoded images leave the adapter in float32; what dtype runs inside is the
adapter's business (`mixed_precision`).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import logging
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.utils.checkpoint
from torch import nn

from trainer.config import DIFFUSERS_DEFAULT_RESOLUTION
from trainer.models import FULL_TRANSFORMER, LORA_WEIGHTS, ModelSpec
from trainer.models.base import (
    Conditioning,
    FlowModel,
    WeightsFile,
    WeightsMismatch,
    copy_weights,
)
from trainer.models.host_resident import HostResident

DEFAULT_RESOLUTION = DIFFUSERS_DEFAULT_RESOLUTION  # a config's resolution 0
# Host memory the prompt-embedding cache may hold, per process: about 1,000 FLUX prompts
# (512 T5 tokens x 4,096 x bf16 = 4 MB each), so a run that keeps to a set of that size
# encodes each prompt once, and one on a 100k-prompt set (HPDv2's train split) stays bounded.
PROMPT_CACHE_BYTES = 4 * 2**30
# the frozen adapter a LoRA run continued from an earlier LoRA keeps as its KL reference
REFERENCE_ADAPTER = "reference"


# how diffusers, transformers and torch word a weights file whose tensors are not the shapes
# its config.json builds
_SHAPE_MISMATCH = ("expected shape", "ignore_mismatched_sizes", "size mismatch",
                   "Error(s) in loading state_dict")


def _weights_config_mismatch(path: str | Path, exc: BaseException) -> ValueError | None:
    """The one-line error for a model directory whose weights do not fit its config.json (an
    edited config, another model's weights), naming the directory, the model folder that
    failed and the loader's own words without its advice to drop the weights; None for any
    other error (a bug, traced back). The loaders' own errors named neither the directory nor
    the folder (diffusers: "Cannot load  because ..."), or only pointed at a report logged
    above a traceback (transformers)."""
    message = " ".join(str(exc).split())
    if not any(marker in message for marker in _SHAPE_MISMATCH):
        return None
    # the pipeline loads folder by folder in diffusers' load_sub_model, whose `name` is the
    # folder; read from the traceback, as no error carries it
    folder, tb = None, exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "load_sub_model":
            folder = tb.tb_frame.f_locals.get("name", folder)
        tb = tb.tb_next
    gist = message.split(" If you want to instead")[0].replace("Cannot load because ", "")
    if "ignore_mismatched_sizes" in gist:  # transformers': the tensors are in the log above
        gist = "tensors of other shapes than the config's; the loader's report is above"
    config = f"{folder}/config.json" if isinstance(folder, str) else "its config.json"
    where = f"{folder}/" if isinstance(folder, str) else "a model folder"
    return ValueError(f"model directory {path}: the weights in {where} do not match "
                      f"{config} ({gist.rstrip('.')}); restore the folder's config.json and "
                      "weights as saved together (an edited config.json, or another model's "
                      "weights)")


_LOADING = threading.Lock()


class _KeysOutsideConfig(logging.Handler):
    """Collects what diffusers only logs while a pipeline loads: tensors a model folder's
    config.json builds that its weights lack (diffusers starts them random: "newly
    initialized") and tensors in its weights the config has no place for ("were not used"),
    as after a config.json edited to another layer count. Diffusers' own lists are read,
    after its renames and ignore lists, so a folder it loads whole is never named."""

    _LOGGER = "diffusers.models.modeling_utils"
    _UNUSED = re.compile(r"model checkpoint at (.+) were not used when initializing \S+: "
                         r"\n (\[.*\])$", re.S)
    _MISSING = re.compile(r"from the model checkpoint at (.+) and are newly initialized: "
                          r"(\[.*?\])\nYou should", re.S)

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.problems: list[tuple[str, str, list[str]]] = []  # (folder path, which, keys)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if (found := self._UNUSED.search(message)):
            # one string of comma-joined names in a list
            keys = [k for k in ast.literal_eval(found[2])[0].split(", ") if k]
            self.problems.append((found[1], "unused", keys))
        elif (found := self._MISSING.search(message)):
            self.problems.append((found[1], "missing", list(ast.literal_eval(found[2]))))

    @contextlib.contextmanager
    def watching(self) -> Iterator[_KeysOutsideConfig]:
        """Listening while a pipeline loads; one load at a time in a process, so that what is
        heard is this load's (diffusers' loads from two threads at once fail anyway)."""
        logger = logging.getLogger(self._LOGGER)
        with _LOADING:
            level, propagate = logger.level, logger.propagate
            if not logger.isEnabledFor(logging.WARNING):
                # DIFFUSERS_VERBOSITY=error: the warnings are made for this handler alone,
                # kept from the user's terminal, as they asked
                logger.setLevel(logging.WARNING)
                logger.propagate = False
            logger.addHandler(self)
            try:
                yield self
            finally:
                logger.removeHandler(self)
                logger.setLevel(level)
                logger.propagate = propagate

    def error(self, path: str | Path) -> ValueError | None:
        """The one-line error naming every such folder, or None where there is none."""
        if not self.problems:
            return None
        parts = []
        for where, which, keys in self.problems:
            folder = Path(where).name
            what = (f"{len(keys)} tensors it builds are not in the weights and would start "
                    "random" if which == "missing" else
                    f"the weights hold {len(keys)} tensors it has no place for")
            parts.append(f"the weights in {folder}/ do not match {folder}/config.json "
                         f"({what}, e.g. {keys[0] if keys else '?'})")
        return ValueError(f"model directory {path}: {'; '.join(parts)}; restore the folder's "
                          "config.json and weights as saved together (an edited config.json, "
                          "or another model's weights)")


def _weight_dtype(spec: ModelSpec, device: torch.device) -> torch.dtype:
    if spec.mixed_precision == "bf16" or (spec.mixed_precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


class DiffusersFlowModel(FlowModel):
    """What FLUX and SD3 share; subclasses name their pipeline class (`_pipeline`) and hold
    the model-specific parts."""

    # the batched parts of the cached prompt embeddings
    embedding_keys: ClassVar[tuple[str, ...]]
    # the latent side must be a multiple of this (FLUX packs 2x2 patches)
    patch_multiple: ClassVar[int] = 2

    @classmethod
    def _pipeline(cls) -> type:
        """The diffusers pipeline class (imported late: diffusers is slow to import)."""
        raise NotImplementedError

    def __init__(self, pipeline: Any, spec: ModelSpec, device: torch.device, *,
                 staged: bool = False) -> None:
        """`staged`: the transformer stays in CPU memory in the dtype it came in, for a sharded
        run to place (see `load`)."""
        super().__init__()
        self.spec = spec
        self.weight_dtype = _weight_dtype(spec, device)
        # the transformer is the only submodule: .parameters(), .to() and state_dict() see it
        # alone; VAE and text encoders are held outside the module tree, frozen
        self.transformer = pipeline.transformer
        self.pipeline = pipeline
        self.resolution = spec.resolution or DEFAULT_RESOLUTION
        self.vae_scale_factor = 2 ** (len(pipeline.vae.config.block_out_channels) - 1)
        multiple = self.vae_scale_factor * self.patch_multiple
        if self.resolution % multiple:
            raise ValueError(f"resolution {self.resolution} must be a multiple of {multiple} "
                             f"for this {spec.name} model")
        # least recently used first; at most `prompt_cache_bytes` of embeddings (a FLUX
        # prompt's T5 rows are 4 MB: a 100k-prompt set would not fit in host memory)
        self._prompt_cache: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self.prompt_cache_bytes = PROMPT_CACHE_BYTES
        self._shared: dict[str, torch.Tensor] = {}
        self.encoder_batches = 0  # text-encoder passes so far (each over the new prompts only)
        for module in self._frozen_modules():
            module.requires_grad_(False).eval()
        # the text encoders live in (pinned) host memory and visit the GPU for new prompts
        self.text_encoders = [HostResident(m, pin=device.type == "cuda")
                              for m in self._frozen_modules() if m is not pipeline.vae]
        pipeline.vae.to(device)
        if device.type == "cuda":
            # PyTorch's cuDNN attention backend fails in FLUX's backward pass with "an illegal
            # memory access" (torch 2.11, H200; the flash / memory-efficient kernels work:
            # benchmarks/real_models.py --attention). Turned off process-wide, not around the
            # forward pass, because gradient checkpointing recomputes attention in backward.
            torch.backends.cuda.enable_cudnn_sdp(False)
        self._setup_training(staged)

    # -- loading -------------------------------------------------------------------------------
    @classmethod
    def load(cls, spec: ModelSpec, device: torch.device | str, *,
             stage_on_cpu: bool = False) -> DiffusersFlowModel:
        """From `spec.path` (a diffusers-format directory, read with local_files_only), with
        `spec.weights` (a checkpoint directory) loaded on top when given. `stage_on_cpu`: set
        up for `device` but the transformer left in CPU memory, in the dtype it was loaded in
        (FSDP moves it as it shards, and the sharded run upcasts its share of full
        fine-tuning's master weights there: trainer/distributed.py)."""
        from trainer.config import ConfigError
        from trainer.models import resolution_limit_problem

        # before the weights load: diffusers would say it in the first forward pass
        if (problem := resolution_limit_problem(spec.name, spec.path, spec.resolution)):
            raise ConfigError("resolution", problem)
        device = torch.device(device)
        dtype = _weight_dtype(spec, device)
        try:
            with _KeysOutsideConfig().watching() as outside_config:
                pipeline = cls._pipeline().from_pretrained(spec.path, torch_dtype=dtype,
                                                              local_files_only=True)
        except (ValueError, RuntimeError) as exc:
            if (mismatch := _weights_config_mismatch(spec.path, exc)) is None:
                raise
            raise mismatch from None
        if (mismatch := outside_config.error(spec.path)) is not None:
            raise mismatch
        model = cls(pipeline, spec, device, staged=stage_on_cpu)
        if spec.weights:
            if stage_on_cpu and spec.finetune == "full":
                # a checkpoint holds fp32 masters: upcast first so that they load exactly
                # (a whole fp32 copy in host memory; the file itself is read a tensor at a time)
                model.transformer.to(torch.float32)
            model.load_weights(Path(spec.weights))
        return model if stage_on_cpu else model.to(device)

    def _frozen_modules(self) -> list[nn.Module]:
        return [m for m in (getattr(self.pipeline, name, None) for name in
                            ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"))
                if m is not None]

    def _setup_training(self, staged: bool) -> None:
        spec = self.spec
        if spec.inference_only:
            # sampling: the transformer stays in the dtype it loaded in (bf16 on a GPU), with
            # no gradients, checkpointing or compilation (compiling pays back only over a
            # run's many iterations); a LoRA's adapters are there to load its checkpoint into
            if spec.finetune == "lora":
                self._add_lora_adapters()
            self.transformer.requires_grad_(False)
            return
        if spec.finetune == "lora":
            self.transformer.requires_grad_(False)
            self._add_lora_adapters()
        else:
            # full fine-tuning keeps fp32 master weights; bf16 is the compute dtype (autocast).
            # Staged, they stay in the loaded dtype: a 12B fp32 copy is 48 GB of host memory
            # per rank, and the sharded run upcasts each rank's shard on its card instead
            if not staged:
                self.transformer.to(torch.float32)
            self.transformer.requires_grad_(True)
        self.set_gradient_checkpointing(spec.gradient_checkpointing)
        if spec.torch_compile:
            compile_blocks(self.transformer)

    def _add_lora_adapters(self) -> None:
        """peft's LoRA adapters on the spec's target modules, in fp32 beside the base."""
        from peft import LoraConfig

        spec = self.spec
        # lora_A starts random: drawn from the run's seed (not the global RNG), so that the
        # same config trains the same adapters; the caller's RNG is left alone
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            self.transformer.add_adapter(LoraConfig(
                r=spec.lora_rank, lora_alpha=spec.lora_alpha, init_lora_weights="gaussian",
                target_modules=list(spec.lora_target_modules) or _default_targets()))
        for name, param in self.transformer.named_parameters():
            if "lora_" in name:  # the adapters train (and sample) in fp32 beside the bf16 base
                param.data = param.data.float()

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """Recompute the spec's share of the blocks in the backward pass (on), or none (off:
        what a FLOP count of the model's own work needs)."""
        if not enabled:
            self.transformer.disable_gradient_checkpointing()
            return
        chosen = checkpointed_blocks(self.transformer, self.spec.gradient_checkpointing_fraction)
        self.transformer.enable_gradient_checkpointing(
            functools.partial(_checkpoint_chosen, {id(block) for block in chosen}))

    # -- geometry and schedule -------------------------------------------------------------------
    @property
    def latent_size(self) -> int:
        """The VAE latent's side."""
        return self.resolution // self.vae_scale_factor

    @property
    def latent_channels(self) -> int:
        return self.pipeline.vae.config.latent_channels

    def image_tokens(self) -> int:
        """How many image tokens the transformer sees (what a dynamic shift depends on)."""
        return (self.latent_size // self.patch_multiple) ** 2

    def _mu(self) -> float:
        """The dynamic shift's mu, interpolated from the image token count as the pipelines
        compute it (diffusers' calculate_shift)."""
        config = self.pipeline.scheduler.config
        base_len, max_len = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
        base_shift, max_shift = config.get("base_shift", 0.5), config.get("max_shift", 1.15)
        slope = (max_shift - base_shift) / (max_len - base_len)
        return base_shift + slope * (self.image_tokens() - base_len)

    @property
    def flow_shift(self) -> float:
        """The scheduler's shift: static (`shift`), or with dynamic shifting exp(mu) (what
        DPM-Solver++ lays its grid out with)."""
        config = self.pipeline.scheduler.config
        if not config.get("use_dynamic_shifting"):
            return float(config.get("shift", 1.0))
        if config.get("time_shift_type", "exponential") == "linear":
            return float(self._mu())
        return math.exp(self._mu())

    def _pipeline_sigmas(self, steps: int) -> np.ndarray | None:
        """The sigmas the model's pipeline passes to its scheduler's set_timesteps (None: it
        lets the scheduler lay them out)."""
        return None

    def sigmas(self, steps: int) -> torch.Tensor:
        """The Euler grid the model's own pipeline samples with, (steps + 1,) ending at 0: a
        copy of its FlowMatchEulerDiscreteScheduler after set_timesteps, called as the
        pipeline calls it (FLUX: sigmas from 1 to 1/steps; SD3: the scheduler's own layout,
        from 1 to its shifted sigma_min, as Flow-GRPO's SD3 rollouts use it)."""
        scheduler = type(self.pipeline.scheduler).from_config(self.pipeline.scheduler.config)
        mu = self._mu() if scheduler.config.get("use_dynamic_shifting") else None
        scheduler.set_timesteps(steps, sigmas=self._pipeline_sigmas(steps), mu=mu)
        return scheduler.sigmas.detach().to("cpu", torch.float32)

    # -- prompts -------------------------------------------------------------------------------
    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """Each prompt's embeddings, computed once (new prompts in one text-encoder batch, the
        encoders visiting the GPU for it: HostResident), then served from the CPU cache, which
        keeps the most recently used prompts up to `prompt_cache_bytes`."""
        new = [p for p in dict.fromkeys(prompts) if p not in self._prompt_cache]
        device = self.device
        if new:
            with contextlib.ExitStack() as stack:
                for encoder in self.text_encoders:
                    stack.enter_context(encoder.visit(device))
                with torch.no_grad():
                    rows, shared = self._encode(new, device)
            self.encoder_batches += 1
            for i, prompt in enumerate(new):
                self._prompt_cache[prompt] = {k: v[i].cpu() for k, v in rows.items()}
            self._shared.update({k: v.cpu() for k, v in shared.items()})
        for prompt in prompts:
            self._prompt_cache.move_to_end(prompt)
        batched = {k: torch.stack([self._prompt_cache[p][k] for p in prompts]).to(device)
                   for k in self.embedding_keys}
        self._trim_prompt_cache(keep=len(set(prompts)))
        shared = {k: v.to(device) for k, v in self._shared.items()}
        shared.update(self._geometry_conditioning(device))
        return Conditioning(batched, shared)

    def _trim_prompt_cache(self, keep: int) -> None:
        """Drop the least recently used prompts beyond `prompt_cache_bytes`, never the `keep`
        most recent (this call's)."""
        def size(rows: dict[str, torch.Tensor]) -> int:
            return sum(t.numel() * t.element_size() for t in rows.values())

        total = sum(size(rows) for rows in self._prompt_cache.values())
        while total > self.prompt_cache_bytes and len(self._prompt_cache) > keep:
            _, rows = self._prompt_cache.popitem(last=False)
            total -= size(rows)

    def _encode(self, prompts: list[str], device: torch.device
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Batched embeddings {key: (N, ...)} and shared ones for `prompts`."""
        raise NotImplementedError

    def _geometry_conditioning(self, device: torch.device) -> dict[str, torch.Tensor]:
        return {}

    # -- velocity --------------------------------------------------------------------------------
    @property
    def compute_dtype(self) -> torch.dtype | None:
        return None if self.weight_dtype == torch.float32 else self.weight_dtype

    def _autocast(self) -> contextlib.AbstractContextManager:
        """bf16 compute under mixed precision (whatever dtype the trained weights keep)."""
        if self.weight_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        with self._autocast():
            return self._velocity(self.transformer, x, t, cond).float()

    def _velocity(self, transformer: nn.Module, x: torch.Tensor, t: torch.Tensor,
                  cond: Conditioning) -> torch.Tensor:
        raise NotImplementedError

    # -- decoding --------------------------------------------------------------------------------
    def _to_vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return latents

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipeline.vae
        z = self._to_vae_latents(latents.to(self.device))
        z = z / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        images = vae.decode(z.to(vae.dtype), return_dict=False)[0]  # (N, 3, H, W) in [-1, 1]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    # -- training --------------------------------------------------------------------------------
    def reference_model(self, *, empty: bool = False) -> FlowModel:
        """LoRA: this very transformer with its adapters disabled, or switched to a frozen
        copy of the earlier LoRA the run continues (no second copy of the weights); full
        fine-tuning: a frozen copy of the transformer alone, in the compute
        dtype (bf16 under mixed precision: autocast casts the fp32 masters to it for every
        matrix product anyway, and a frozen model needs no masters). `empty`: the copy's
        tensors on the meta device, for the caller to fill."""
        if self.spec.finetune == "lora":
            if self.spec.weights and REFERENCE_ADAPTER not in self.transformer.peft_config:
                self._add_reference_adapter(Path(self.spec.weights))
            return _ReferencePolicy(self, None)
        return _ReferencePolicy(self, frozen_copy(self.transformer, self.compute_dtype,
                                                  empty=empty))

    def _add_reference_adapter(self, weights: Path) -> None:
        """A LoRA run continued from an earlier LoRA (base_checkpoint): the KL reference is
        where the run starts, that LoRA on the base, as a full fine-tune's frozen copy of its
        base_checkpoint is, not the base alone (the adapters switched off). A second adapter,
        frozen, holds the earlier LoRA read again from its file (a resume has loaded its own
        checkpoint into the trained one by then); the reference's forward switches to it."""
        from copy import deepcopy

        self.transformer.add_adapter(deepcopy(self.transformer.peft_config["default"]),
                                     adapter_name=REFERENCE_ADAPTER)
        self._load_lora(weights, REFERENCE_ADAPTER)
        # active and trainable again (peft's set_adapter freezes every other adapter)
        self.transformer.set_adapter("default")

    def save_weights(self, directory: Path, metadata: dict[str, str],
                     state: dict[str, torch.Tensor] | None = None) -> Path:
        directory = Path(directory)
        if state is not None:  # a sharded full fine-tune's gathered weights
            if self.spec.finetune == "lora":
                raise ValueError("a LoRA run's adapters are not sharded (parallelism 'ddp')")
            from safetensors.torch import save_file

            (directory / FULL_TRANSFORMER).parent.mkdir(parents=True, exist_ok=True)
            self.transformer.save_config(directory / FULL_TRANSFORMER.parent)
            save_file({k.removeprefix("transformer."): v.detach().contiguous().cpu()
                       for k, v in state.items()}, str(directory / FULL_TRANSFORMER),
                      metadata={"format": "pt"})
            return directory / FULL_TRANSFORMER
        if self.spec.finetune == "lora":
            from peft.utils import get_peft_model_state_dict

            layers = {k: v.detach().to(torch.float32).cpu().contiguous()
                      for k, v in get_peft_model_state_dict(self.transformer).items()}
            # the adapter's config (rank, lora_alpha, targets) goes into the file's metadata:
            # without it load_lora_weights takes alpha = rank, scaling the LoRA by 1 instead
            # of lora_alpha / rank
            self._pipeline().save_lora_weights(
                directory, transformer_lora_layers=layers, safe_serialization=True,
                transformer_lora_adapter_metadata=self.transformer.peft_config["default"].to_dict())
            return directory / LORA_WEIGHTS
        self.transformer.save_pretrained(directory / "transformer", safe_serialization=True,
                                         max_shard_size="1000GB")
        return directory / FULL_TRANSFORMER

    def _load_lora(self, directory: Path, adapter: str) -> None:
        """The LoRA of checkpoint `directory` (or a LoRA's file itself) into `adapter`,
        checked against this model's adapters first."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        from trainer.models import (
            bare_lora_spec,
            lora_alpha_problem,
            lora_weights_path,
            peft_lora_key,
        )

        lora = lora_weights_path(directory)
        if not lora.is_file():
            raise FileNotFoundError(f"{directory} holds no {LORA_WEIGHTS} (a LoRA run's "
                                    "checkpoint); this run has finetune='lora'")
        state = {peft_lora_key(k).removeprefix("transformer."): v
                 for k, v in load_file(str(lora)).items() if k.startswith("transformer.")}
        # checked here: set_peft_model_state_dict's load_state_dict would fail on a shape
        # with a RuntimeError listing hundreds of tensors, which says neither why nor which
        # file
        if (problem := self._lora_problem(state)) is not None:
            raise WeightsMismatch(f"{lora} {problem}")
        if (problem := lora_alpha_problem(bare_lora_spec(directory).lora_alpha,
                                          self.spec.lora_alpha)) is not None:
            raise WeightsMismatch(f"{lora} {problem}")
        result = set_peft_model_state_dict(self.transformer, state, adapter_name=adapter)
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"{lora} does not fit this model's adapters: unexpected keys "
                             f"{result.unexpected_keys[:5]}")

    def load_weights(self, directory: Path) -> None:
        directory = Path(directory)
        # `directory` is a checkpoint directory, or a LoRA's file itself (checkpoint_spec)
        full = directory / FULL_TRANSFORMER
        if self.spec.finetune == "lora":
            self._load_lora(directory, "default")
            for param in self.transformer.parameters():
                if param.requires_grad:
                    param.data = param.data.float()
            return
        if not full.is_file():
            raise FileNotFoundError(f"{directory} holds no {FULL_TRANSFORMER} (a full "
                                    "fine-tune's checkpoint); this run has finetune='full'")
        # a tensor at a time into the fp32 masters: never a second whole copy in memory
        copy_weights(self.transformer, WeightsFile(full), str(full))

    def _lora_problem(self, state: dict[str, torch.Tensor]) -> str | None:
        """Why the LoRA tensors `state` (keyed as get_peft_model_state_dict keys them) cannot
        load into this model's adapters, or None: another rank, or another model's layers."""
        from peft import get_peft_model_state_dict

        expected = get_peft_model_state_dict(self.transformer, adapter_name="default")
        ranks = {int(v.shape[0]) for k, v in state.items()
                 if k.endswith("lora_A.weight") and v.ndim == 2}
        if ranks and ranks != {self.spec.lora_rank} and all(
                k in expected for k in state):
            return (f"holds a LoRA of rank {', '.join(map(str, sorted(ranks)))}; this run's "
                    f"adapters have rank {self.spec.lora_rank} (lora_rank)")
        foreign = sorted(k for k in state if k not in expected)
        shapes = [k for k in state if k in expected and expected[k].shape != state[k].shape]
        if not foreign and not shapes:
            return None
        modules = dict(self.transformer.named_modules())
        untrained = [k for k in foreign if k.rsplit(".lora_", 1)[0] in modules]
        if untrained and len(untrained) == len(foreign) and not shapes:
            # this model's layers, which the run's lora_target_modules leave without adapters
            return (f"holds adapters on layers this run's lora_target_modules do not train "
                    f"(e.g. {untrained[0].rsplit('.lora_', 1)[0]}); this run targets "
                    f"{self.spec.lora_target_modules or 'the default modules'}")
        key = foreign[0] if foreign else shapes[0]
        detail = (f"layer {key} is not in this model" if foreign else
                  f"layer {key} is {tuple(state[key].shape)} there, "
                  f"{tuple(expected[key].shape)} here")
        return (f"holds the LoRA weights of another model, not of this {self.spec.name!r} "
                f"model at {self.spec.path} ({detail}; {len(foreign) + len(shapes)} layers "
                "do not fit)")

    def read_weights(self, directory: Path) -> WeightsFile:
        full = Path(directory) / FULL_TRANSFORMER
        if self.spec.finetune != "full" or not full.is_file():
            raise FileNotFoundError(f"{directory} holds no {FULL_TRANSFORMER} (a full "
                                    "fine-tune's checkpoint)")
        return WeightsFile(full, prefix="transformer.")

    def shard_units(self) -> list[nn.Module]:
        return repeated_blocks(self.transformer)

    def model_card(self) -> dict[str, Any]:
        return {"model": self.spec.name, "model_path": self.spec.path,
                "finetune": self.spec.finetune}


# the transformers' lists of repeated blocks (FLUX: double- and single-stream; SD3: joint)
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")


def repeated_blocks(transformer: nn.Module) -> list[nn.Module]:
    """The transformer's blocks, in order (the units compiled and sharded one by one)."""
    return [block for name in BLOCK_LISTS for block in getattr(transformer, name, ())]


@torch.no_grad()
def frozen_copy(transformer: nn.Module, dtype: torch.dtype | None, *,
                empty: bool = False) -> nn.Module:
    """A copy of `transformer` without gradients, built empty and filled tensor by tensor in
    `dtype` (None: as it is), beside it on its device: a 12B model in bf16 never passes
    through a whole fp32 second copy on the way, as `deepcopy` then a cast would. `empty`:
    left on the meta device, unfilled."""
    device = next(transformer.parameters()).device
    with torch.device("meta"):
        frozen = type(transformer).from_config(transformer.config)
        # the weights alone take the dtype; buffers (position tables and the like) keep theirs
        for module in frozen.modules():
            for name, param in module._parameters.items():
                if dtype is not None and param is not None and param.is_floating_point():
                    module._parameters[name] = nn.Parameter(param.to(dtype))
    if empty:
        return frozen.requires_grad_(False).eval()
    frozen.to_empty(device=device)
    sources = dict(transformer.named_parameters())
    sources.update(transformer.named_buffers())
    targets = dict(frozen.named_parameters())
    targets.update(frozen.named_buffers())
    if sources.keys() != targets.keys():
        raise ValueError(f"{type(transformer).__name__} rebuilt from its config differs: "
                         f"{sorted(sources.keys() ^ targets.keys())[:5]}")
    for name, target in targets.items():
        source = sources[name]
        if target.dtype != source.dtype and not source.is_floating_point():
            raise ValueError(f"{name}: {source.dtype} cannot become {target.dtype}")
        target.copy_(source)  # cast to the target's dtype as it copies
    return frozen.requires_grad_(False).eval()


def checkpointed_blocks(transformer: nn.Module, fraction: float) -> list[nn.Module]:
    """The blocks that recompute their activations in the backward pass: round(fraction x N)
    of the N repeated blocks, evenly spaced (block i where floor((i + 1) f) > floor(i f)), so
    that the kept activations spread over the double- and single-stream lists alike."""
    blocks = repeated_blocks(transformer)
    return [block for i, block in enumerate(blocks)
            if math.floor((i + 1) * fraction + 1e-9) > math.floor(i * fraction + 1e-9)]


def _checkpoint_chosen(chosen: set[int], block: nn.Module, *args: Any) -> Any:
    """diffusers' checkpointing hook (it calls this for every block in training): recompute
    the chosen blocks in the backward pass, run the others normally."""
    if id(block) not in chosen:
        return block(*args)
    return torch.utils.checkpoint.checkpoint(block.__call__, *args, use_reentrant=False)


def compile_blocks(transformer: nn.Module) -> int:
    """Regional compilation: torch.compile each repeated block in place (`Module.compile`, so
    parameter names, state dicts and peft's adapters are untouched). The blocks of a list share
    one code object, so one compiled graph per input shape and grad mode serves all of them;
    compiling the whole model would trace every block separately. Compilation is lazy (first
    call). Returns how many blocks were wrapped."""
    blocks = repeated_blocks(transformer)
    if not blocks:
        raise ValueError(f"{type(transformer).__name__} has none of {BLOCK_LISTS} to compile")
    for block in blocks:
        # static shapes: the few batch sizes a run uses (rollout, micro-batch) each get their
        # own tuned graph, well under dynamo's recompile limit
        block.compile(dynamic=False)
    return len(blocks)


def _activate_adapter(transformer: nn.Module, name: str) -> None:
    """The LoRA layers of `transformer` compute with adapter `name` from now on. Set on each
    layer directly: peft's set_adapter also flips requires_grad (the active adapter
    trainable, the others not), which a switch for one no-grad forward must not do to the
    trained adapter's parameters (the optimizer's, and DDP's gradient hooks')."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in transformer.modules():
        if isinstance(module, BaseTunerLayer):
            module._active_adapter = [name]


class _ReferencePolicy(FlowModel):
    """The frozen base policy for the KL penalty: the adapter's velocity with its LoRA
    disabled (or switched to the frozen LoRA the run started from), or with a frozen copy of
    its transformer. Holds the adapter outside the module
    tree, so its parameters are not counted twice."""

    def __init__(self, model: DiffusersFlowModel, transformer: nn.Module | None) -> None:
        super().__init__()
        self.__dict__["model"] = model
        self.frozen = transformer

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return self.model.latent_shape

    @property
    def device(self) -> torch.device:
        return self.model.device

    def shard_units(self) -> list[nn.Module]:
        # a sharded run (FSDP with a KL penalty) gathers the frozen copy a block at a time
        return repeated_blocks(self.frozen) if self.frozen is not None else []

    @torch.no_grad()
    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        model = self.model
        with model._autocast():
            if self.frozen is not None:
                if next(self.frozen.parameters()).device != x.device:  # made on the CPU
                    self.frozen.to(x.device)
                return model._velocity(self.frozen, x, t, cond).float()
            transformer = model.transformer
            if REFERENCE_ADAPTER in transformer.peft_config:  # the LoRA the run started from
                _activate_adapter(transformer, REFERENCE_ADAPTER)
                try:
                    return model._velocity(transformer, x, t, cond).float()
                finally:
                    _activate_adapter(transformer, "default")
            transformer.disable_adapters()
            try:
                return model._velocity(transformer, x, t, cond).float()
            finally:
                transformer.enable_adapters()


def _default_targets() -> list[str]:
    from trainer.config import DEFAULT_LORA_TARGETS

    return list(DEFAULT_LORA_TARGETS)


# ---------------------------------------------------------------------------------------
# FLUX.1
# ---------------------------------------------------------------------------------------
class FluxFlowModel(DiffusersFlowModel):
    """FLUX.1-dev (guidance embedding) and FLUX.1-schnell. Latents are packed: (L, 4 C) with
    L = (latent side / 2)^2 tokens."""

    embedding_keys = ("prompt_embeds", "pooled_prompt_embeds")

    @classmethod
    def _pipeline(cls) -> type:
        from diffusers import FluxPipeline

        return FluxPipeline

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return (self.image_tokens(), self.latent_channels * 4)

    def _pipeline_sigmas(self, steps: int) -> np.ndarray | None:
        return np.linspace(1.0, 1 / steps, steps)  # as FluxPipeline.__call__ passes them

    def _encode(self, prompts: list[str], device: torch.device):
        embeds, pooled, text_ids = self.pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, device=device, num_images_per_prompt=1)
        return ({"prompt_embeds": embeds, "pooled_prompt_embeds": pooled},
                {"txt_ids": text_ids})  # txt_ids: (T, 3), no batch dimension

    def _geometry_conditioning(self, device: torch.device) -> dict[str, torch.Tensor]:
        side = self.latent_size // 2
        img_ids = self.pipeline._prepare_latent_image_ids(1, side, side, device, self.weight_dtype)
        return {"img_ids": img_ids}  # (L, 3), no batch dimension

    def _velocity(self, transformer: nn.Module, x: torch.Tensor, t: torch.Tensor,
                  cond: Conditioning) -> torch.Tensor:
        dtype = self.weight_dtype
        guidance = None
        if transformer.config.guidance_embeds:  # FLUX.1-dev: guidance is an input, not CFG
            guidance = torch.full((x.shape[0],), self.spec.guidance_scale, device=x.device,
                                  dtype=torch.float32)
        return transformer(
            hidden_states=x.to(dtype), timestep=t.to(dtype), guidance=guidance,
            pooled_projections=cond["pooled_prompt_embeds"].to(dtype),
            encoder_hidden_states=cond["prompt_embeds"].to(dtype),
            txt_ids=cond["txt_ids"], img_ids=cond["img_ids"], return_dict=False)[0]

    def _to_vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return self.pipeline._unpack_latents(latents, self.resolution, self.resolution,
                                             self.vae_scale_factor)


# ---------------------------------------------------------------------------------------
# Stable Diffusion 3 / 3.5
# ---------------------------------------------------------------------------------------
class SD3FlowModel(DiffusersFlowModel):
    """SD3 / SD3.5 medium and large; classifier-free guidance inside the velocity."""

    embedding_keys = ("prompt_embeds", "pooled_prompt_embeds")

    @classmethod
    def _pipeline(cls) -> type:
        from diffusers import StableDiffusion3Pipeline

        return StableDiffusion3Pipeline

    @property
    def patch_multiple(self) -> int:  # type: ignore[override]
        return self.transformer.config.patch_size

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return (self.latent_channels, self.latent_size, self.latent_size)

    @property
    def uses_cfg(self) -> bool:
        return self.spec.guidance_scale > 1.0

    def _encode(self, prompts: list[str], device: torch.device):
        embeds, negative, pooled, negative_pooled = self.pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=device,
            num_images_per_prompt=1, do_classifier_free_guidance=True, negative_prompt="")
        # the empty prompt's embedding is the same for every prompt: kept once, shared
        return ({"prompt_embeds": embeds, "pooled_prompt_embeds": pooled},
                {"negative_prompt_embeds": negative[0], "negative_pooled_prompt_embeds":
                 negative_pooled[0]})

    def _velocity(self, transformer: nn.Module, x: torch.Tensor, t: torch.Tensor,
                  cond: Conditioning) -> torch.Tensor:
        dtype, n = self.weight_dtype, x.shape[0]
        embeds, pooled = cond["prompt_embeds"], cond["pooled_prompt_embeds"]
        if self.uses_cfg:  # one doubled batch: [unconditional, conditional]
            negative = cond["negative_prompt_embeds"].expand(n, *embeds.shape[1:])
            negative_pooled = cond["negative_pooled_prompt_embeds"].expand(n, -1)
            x, t = torch.cat([x, x]), torch.cat([t, t])
            embeds, pooled = torch.cat([negative, embeds]), torch.cat([negative_pooled, pooled])
        out = transformer(hidden_states=x.to(dtype), timestep=(t * 1000).to(dtype),
                          encoder_hidden_states=embeds.to(dtype),
                          pooled_projections=pooled.to(dtype), return_dict=False)[0]
        if not self.uses_cfg:
            return out
        unconditional, conditional = out.float().chunk(2)
        return unconditional + self.spec.guidance_scale * (conditional - unconditional)
