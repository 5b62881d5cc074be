"""Data-parallel training over several processes (torchrun; DDP on NCCL or gloo).

Each iteration every rank draws the same global prompt list from the shared trainer RNG
(identical on all ranks), takes its slice (rank r gets prompts r, r + W, ...), and runs the
ordinary iteration function on it with its own RNG stream for noises and anchors. The model is
wrapped in DistributedDataParallel, so every backward averages gradients across ranks before
gradient clipping and the optimizer step: all ranks keep identical weights, and a step is the
step of the whole batch. Scalar metrics are averaged over ranks (with equal shards the reward
mean is exactly the global one). Checkpoints hold the unwrapped weights and the shared RNG, so
a resume works with any number of processes.

    rank, world = init_from_env()
    trainer = make_distributed(Trainer(config, model=DistributedFlowModel(load_model(config))))

Nothing in the trainer's other files knows about this module.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainer.grpo import SEED_LIMIT
from trainer.models.base import FlowModel


def init_from_env() -> tuple[int, int]:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, ...); (rank, world)."""
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def local_device() -> str:
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return "cpu"


class DistributedFlowModel(FlowModel):
    """A FlowModel whose forward runs through DDP; everything else is the wrapped model's."""

    def __init__(self, model: FlowModel, device: str | torch.device | None = None) -> None:
        super().__init__()
        device = torch.device(device or local_device())
        model = model.to(device)
        ids = [device.index] if device.type == "cuda" else None
        self.ddp = DistributedDataParallel(model, device_ids=ids)

    @property
    def inner(self) -> FlowModel:
        return self.ddp.module

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return self.inner.latent_shape

    @property
    def flow_shift(self) -> float:
        return self.inner.flow_shift

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: Any) -> torch.Tensor:
        return self.ddp(x, t, cond)

    def encode_prompts(self, prompts: list[str]) -> Any:
        return self.inner.encode_prompts(prompts)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.inner.decode(latents)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return self.inner.trainable_parameters()

    def save_weights(self, directory: Path, metadata: dict[str, str]) -> Path:
        return self.inner.save_weights(directory, metadata)

    def load_weights(self, directory: Path) -> None:
        self.inner.load_weights(directory)

    def state_dict(self, *args: Any, **kwargs: Any):  # the unwrapped names
        return self.inner.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.inner.load_state_dict(state_dict, strict=strict, assign=assign)


SUMMED = ("forward_passes", "backward_passes")  # work counts add up over ranks


def _average_metrics(metrics: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Every numeric metric averaged over ranks, except SUMMED, which are totals."""
    keys = sorted(k for k, v in metrics.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool))
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(values)
    out = dict(metrics)
    for key, total in zip(keys, values.tolist(), strict=True):
        out[key] = total if key in SUMMED else total / dist.get_world_size()
    return out


def make_distributed(trainer):
    """Shard the trainer's prompts and RNG by rank, average metrics (see the module doc).
    `trainer.model` must be a DistributedFlowModel. Returns the trainer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank, rest = divmod(trainer.config.prompts_per_iteration, world)
    if rest or per_rank == 0:
        raise ValueError(f"prompts_per_iteration ({trainer.config.prompts_per_iteration}) must "
                         f"be a positive multiple of the number of processes ({world})")
    global_sample = trainer.sample_prompts
    iterate = trainer._iterate
    device = next(trainer.model.parameters()).device
    comm_device = device if dist.get_backend() == "nccl" else torch.device("cpu")

    def sample_prompts() -> list[str]:
        return global_sample()[rank::world]

    def sharded_iteration(model, optimizer, prompts, config, generator, **extra):
        # one draw from the shared RNG keeps ranks in step; each rank gets its own stream
        base = int(torch.randint(0, SEED_LIMIT, (1,), generator=generator))
        local = torch.Generator().manual_seed(base + rank)
        result = iterate(model, optimizer, prompts, config, local, **extra)
        result.metrics = _average_metrics(result.metrics, comm_device)
        result.metrics["world_size"] = world
        return result

    trainer.sample_prompts = sample_prompts
    trainer._iterate = sharded_iteration
    return trainer


def broadcast_ints(values: list[int], device: torch.device | str = "cpu") -> list[int]:
    """Rank 0's `values` on every rank (the others pass placeholders of the same length):
    decisions only rank 0 makes, such as stopping or which preference model to use."""
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.broadcast(t, src=0)
    return [int(v) for v in t.tolist()]


def any_rank(flag: bool, device: torch.device | str = "cpu") -> bool:
    """Whether `flag` is set on any rank (every rank calls it): a decision any rank may start,
    such as its host shutting down."""
    t = torch.tensor([int(flag)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
