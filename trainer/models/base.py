"""The interface every model adapter implements (shapes DiT, diffusers FLUX / SD3).

Flow matching convention used throughout: x_t = (1 - t) x_0 + t * noise, t = 1 is pure noise
and t = 0 is data; the network predicts the velocity v = noise - x_0, so an ODE step from t to
s is x_s = x_t + (s - t) v.

The algorithm files (trainer/neighbor_grpo.py, trainer/sde_grpo.py) see a model only through
this interface, so a new model never changes them. What differs between models stays inside
the adapter: how latents are laid out (FLUX packs 2x2 patches into tokens), how prompts are
encoded (and cached), guidance or classifier-free guidance inside the velocity call, the
noise schedule's shift, how latents decode to pixels, which parameters train (LoRA or all),
and what a checkpoint holds.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn


# ---------------------------------------------------------------------------------------
# Weights files read a tensor at a time
# ---------------------------------------------------------------------------------------
class WeightsFile(Mapping[str, torch.Tensor]):
    """A safetensors file's tensors on the CPU, each read from disk when it is asked for (and
    not kept), named `prefix` + the file's key and cast to `dtype` (None: as stored). Loading
    tensor by tensor holds one tensor in memory, not the file: a full FLUX.1 checkpoint is
    48 GB of fp32, and every rank of a sharded run reads it."""

    def __init__(self, path: str | Path, prefix: str = "", dtype: torch.dtype | None = None
                 ) -> None:
        from safetensors import safe_open

        self.path, self.prefix, self.dtype = str(path), prefix, dtype
        with safe_open(self.path, framework="pt") as f:  # the header only
            # (a safe_open handle is not iterable: keys() is its listing)
            self._keys = [prefix + key for key in f.keys()]  # noqa: SIM118
        self._known = set(self._keys)

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self._known:
            raise KeyError(name)
        with safe_open(self.path, framework="pt") as f:
            tensor = f.get_tensor(name[len(self.prefix):])
        return tensor if self.dtype is None else tensor.to(self.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class WeightsMismatch(ValueError):
    """A weights file that does not fit the model it is loaded into (another model's, or a
    LoRA of another rank); the message names the file and what differs. Its own class so that
    a job can name the config field that pointed at the file (base_checkpoint)."""


@torch.no_grad()
def copy_weights(module: nn.Module, weights: Mapping[str, torch.Tensor], source: str,
                 place: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
                 ) -> None:
    """Copy `weights` (keyed as `module.state_dict()`) into `module`'s tensors one at a time,
    cast to each tensor's dtype; `place(full, like)` lays a whole tensor out as `like` is (a
    sharded run: this rank's shard). `source` names the weights in the error when the keys
    differ. Unlike `load_state_dict`, which gathers its argument into one dict first, only
    one tensor of `weights` is in memory at a time."""
    expected = set(module.state_dict())
    if set(weights) != expected:
        raise WeightsMismatch(f"{source} does not fit this model: missing "
                         f"{sorted(expected - set(weights))[:5]}, unexpected "
                         f"{sorted(set(weights) - expected)[:5]}")
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if name in expected:  # not the non-persistent buffers
            full = weights[name]
            # (a DTensor's shape is the whole tensor's, as the file's is); copy_ would fail
            # with a RuntimeError that names neither the file nor the tensor
            if tuple(full.shape) != tuple(tensor.shape):
                raise WeightsMismatch(f"{source} does not fit this model: {name} is "
                                      f"{tuple(full.shape)} there, {tuple(tensor.shape)} here "
                                      "(the weights of another model)")
            value = place(full, tensor) if place else full
            local = value.to_local() if hasattr(value, "to_local") else value
            target = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            target.copy_(local)
            del full, value, local  # before the next read: one tensor of the file at a time


# ---------------------------------------------------------------------------------------
# Conditioning
# ---------------------------------------------------------------------------------------
@dataclass
class Conditioning:
    """A batch of prompt conditioning: `batched` tensors carry one row per sample (dim 0),
    `shared` ones are the same for every sample and have no batch dimension (FLUX's
    `txt_ids` / `img_ids`), so repeating or indexing the batch leaves them alone."""

    batched: dict[str, torch.Tensor]
    shared: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return next(iter(self.batched.values())).shape[0]

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.batched[key] if key in self.batched else self.shared[key]

    def repeat(self, repeats: int) -> Conditioning:
        return Conditioning({k: v.repeat_interleave(repeats, dim=0)
                             for k, v in self.batched.items()}, self.shared)

    def index(self, index: torch.Tensor | slice) -> Conditioning:
        if isinstance(index, torch.Tensor):
            index = index.to(next(iter(self.batched.values())).device)
        return Conditioning({k: v[index] for k, v in self.batched.items()}, self.shared)


def repeat_cond(cond: Any, repeats: int) -> Any:
    """Repeat each conditioning row `repeats` times (prompt p -> its group of G members)."""
    if isinstance(cond, Conditioning):
        return cond.repeat(repeats)
    if isinstance(cond, tuple):
        return tuple(repeat_cond(c, repeats) for c in cond)
    return cond.repeat_interleave(repeats, dim=0)


def index_cond(cond: Any, index: torch.Tensor | slice) -> Any:
    """The conditioning rows `index` (a tensor of row numbers or a slice)."""
    if isinstance(cond, Conditioning):
        return cond.index(index)
    if isinstance(cond, tuple):
        return tuple(index_cond(c, index) for c in cond)
    if isinstance(index, torch.Tensor):
        index = index.to(cond.device)
    return cond[index]


# ---------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------
def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """The flow-matching timestep shift, s' = shift s / (1 + (shift - 1) s): shift > 1 spends
    more of the steps at high noise (SD3: 3; FLUX: exp(mu), resolution-dependent)."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


class FlowModel(nn.Module):
    """A velocity model with its prompt encoder and latent decoder.

    Subclasses implement `latent_shape`, `encode_prompts`, `forward`, `decode`, `save_weights`
    and `load_weights`; the rest has defaults that fit a model trained in full.
    """

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """The shape of one sample's latent at the model's resolution (FLUX: packed tokens)."""
        raise NotImplementedError

    @property
    def flow_shift(self) -> float:
        """The timestep shift of the model's own scheduler at its resolution (1: none)."""
        return 1.0

    def sigmas(self, steps: int) -> torch.Tensor:
        """(steps + 1,) timesteps from 1 (noise) to 0 (data), evenly spaced then shifted by
        the model's `flow_shift`, as diffusers' FlowMatchEulerDiscreteScheduler lays them out."""
        return shift_sigmas(torch.linspace(1.0, 0.0, steps + 1), self.flow_shift)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def encode_prompts(self, prompts: list[str]) -> Any:
        """Conditioning for `forward`, one row per prompt: a tensor, a tuple of tensors or a
        `Conditioning` (see `repeat_cond` / `index_cond`)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: Any) -> torch.Tensor:
        """Velocity v(x_t, t, c) in float32, guidance or CFG included.
        x: (N, *latent_shape), t: (N,) in [0, 1]."""
        raise NotImplementedError

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(N, *latent_shape) -> (N, 3, H, W) float images in [0, 1], on the model's device."""
        raise NotImplementedError

    def trainable_parameters(self) -> list[nn.Parameter]:
        """What the optimizer updates: every parameter that requires a gradient (in LoRA mode
        the adapters' alone)."""
        return [p for p in self.parameters() if p.requires_grad]

    def reference_model(self, *, empty: bool = False) -> FlowModel:
        """The frozen policy the KL penalty measures against: here a copy made now (call it
        before training); a LoRA adapter returns itself with its adapters disabled instead.
        `empty`: the copy's tensors on the meta device, for the caller to fill (a sharded run
        fills each rank's shards from the policy's, so no rank holds a whole second copy);
        a large model's adapter builds it there without allocating."""
        reference = copy.deepcopy(self).requires_grad_(False).eval()
        return reference.to_empty(device="meta") if empty else reference

    def save_weights(self, directory: Path, metadata: dict[str, str],
                     state: dict[str, torch.Tensor] | None = None) -> Path:
        """Write what this model trains into `directory` (created by the caller); returns the
        main weights file (what a checkpoint download serves). `state`, keyed as this module's
        state_dict, is written in place of the module's own tensors: the gathered weights of a
        sharded model (trainer/distributed.py)."""
        raise NotImplementedError

    def load_weights(self, directory: Path) -> None:
        """Load what `save_weights` wrote (resume, or a checkpoint to sample from)."""
        raise NotImplementedError

    def read_weights(self, directory: Path) -> Mapping[str, torch.Tensor]:
        """What `save_weights` wrote, keyed as this module's state dict, on the CPU, without
        loading it (a sharded model loads it shard by shard); a large model's adapter returns
        a `WeightsFile`, which reads each tensor when it is asked for."""
        raise NotImplementedError

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype the forward pass computes in where it differs from the trained weights'
        (bf16 autocast over fp32 master weights); None: the weights' own. A sharded run
        gathers the weights in it, which halves what crosses between the GPUs."""
        return None

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this process writes checkpoint files (of a run over several processes, one
        does; trainer/distributed.py)."""
        return True

    def shard_units(self) -> list[nn.Module]:
        """The submodules a fully sharded run (parallelism='fsdp') shards one by one, so that
        one unit's weights are gathered at a time: the transformer blocks. Empty: the model is
        one unit."""
        return []

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state for a checkpoint, in `Optimizer.state_dict()`'s format (a
        sharded model gathers it)."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer,
                                  state: dict[str, Any]) -> None:
        """`state` as `Optimizer.state_dict()` has it, its tensors placed already
        (`place_optimizer_tensor`)."""
        optimizer.load_state_dict(state)

    def place_optimizer_tensor(self, tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """A checkpoint's whole optimizer tensor for `param` (an Adam moment), laid out as
        this process keeps it: on the parameter's device (a sharded model: its shard)."""
        return tensor.to(param.device)

    def model_card(self) -> dict[str, Any]:
        """What the checkpoint's README names as the base model."""
        return {"model": type(self).__name__}


def micro_batches(rows: int, size: int) -> Iterator[slice]:
    """Slices covering `rows` rows, `size` at a time (0: one slice): how rollouts, updates and
    decoding are split so that a large model fits its card."""
    size = size or rows
    for start in range(0, rows, size):
        yield slice(start, min(start + size, rows))


def micro_batch_count(rows: int, size: int) -> int:
    """How many slices `micro_batches(rows, size)` gives."""
    return len(range(0, rows, size or rows)) if rows else 0


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(N, 3, H, W) float in [0, 1] (any device) -> (N, H, W, 3) uint8 on the CPU, for rewards
    that take pixels and for storage."""
    return (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8) \
        .permute(0, 2, 3, 1).cpu().numpy()
