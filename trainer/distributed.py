"""Data-parallel training over several processes (torchrun; DDP or FSDP2 on NCCL or gloo).

Each iteration every rank draws the same global prompt list from the shared trainer RNG
(identical on all ranks), takes its slice (rank r gets prompts r, r + W, ...), and runs the
ordinary iteration function on it with its own RNG stream for noises and anchors. The model is
wrapped in DistributedDataParallel, so every backward averages gradients across ranks before
gradient clipping and the optimizer step: all ranks keep identical weights, and a step is the
step of the whole batch. Scalar metrics are averaged over ranks (with equal shards the reward
mean is exactly the global one). On the iterations whose rollouts are kept (`sample_every`, and
the last) rank 0's result holds every rank's prompt groups, in the global prompt order
(`gather_groups`), so what it records and logs shows the whole iteration. Checkpoints hold
the unwrapped weights and the shared RNG, so a resume works with any number of processes.

With parallelism="fsdp" the model is fully sharded instead (FSDP2's `fully_shard`, unit by unit:
`FlowModel.shard_units`, then the rest): each process holds 1/W of the weights, gradients and
optimizer state, gathers one unit's weights for its forward and backward, and reduce-scatters
the gradients, which averages them as DDP does. Saving a checkpoint then gathers the full
weights and optimizer state onto rank 0's CPU, a collective: every rank calls
`Trainer.save_checkpoint` at the same iteration, and rank 0 alone writes
(`DistributedFlowModel.writes_checkpoints`). The files are the same as a single process writes.

A `stop_requested` (Trainer.run) is asked on every rank while it waits for the reward server,
and a wait that any rank gives up, every rank gives up: once their scoring ends the ranks
agree (score_groups' `agree_stop`), so none goes on to an update the others will not join, and
Trainer.run raises ScoringStopped on all of them. The periodic evaluation runs whole on every
rank.

    rank, world = init_from_env()
    trainer = make_distributed(Trainer(config, model=load_distributed_model(config)))

Nothing in the trainer's other files knows about this module.
"""

from __future__ import annotations

import atexit
import functools
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainer.grpo import SEED_LIMIT, IterationResult
from trainer.models.base import FlowModel, copy_weights
from trainer.tracking import keeps_samples

if TYPE_CHECKING:
    from torch.nn.modules.module import _IncompatibleKeys

    from trainer.config import TrainConfig
    from trainer.loop import Trainer


def init_from_env() -> tuple[int, int]:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, ...); (rank, world). The
    group it opens is left at the process's exit when the script has not left it itself."""
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        # a script that ends without destroy_process_group (the two lines above this
        # module's docstring) could die at exit, its collectives all done: gloo's threads,
        # still running as the interpreter tore down, aborted the process ("terminate called
        # without an active exception", exit -6)
        atexit.register(_leave_process_group)
    return dist.get_rank(), dist.get_world_size()


def _leave_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def local_device() -> str:
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return "cpu"


def load_distributed_model(config: TrainConfig) -> DistributedFlowModel:
    """This rank's model for `config`, as `config.parallelism` holds it: set up for this
    rank's card (`local_device`); under FSDP its weights wait in CPU memory and reach the card
    a unit at a time as they are sharded, with the KL reference sharded beside them when
    `kl_coefficient` > 0. Every rank calls it at the same point."""
    from dataclasses import replace

    from trainer.models import ModelSpec, load_flow_model

    device = local_device()
    sharded = config.parallelism == "fsdp"
    spec, start_from = ModelSpec.from_config(config), None
    if sharded and spec.weights:
        # the base_checkpoint goes into each rank's shards, a tensor at a time, after
        # sharding: a full fine-tune's fp32 masters never sit whole in host memory
        spec, start_from = replace(spec, weights=""), Path(spec.weights)
    return DistributedFlowModel(load_flow_model(spec, device=device, stage_on_cpu=sharded),
                                device, parallelism=config.parallelism,
                                with_reference=config.kl_coefficient > 0, start_from=start_from)


class DistributedFlowModel(FlowModel):
    """A FlowModel whose forward runs through DDP, or which is fully sharded (FSDP2);
    everything else is the wrapped model's."""

    def __init__(self, model: FlowModel, device: str | torch.device | None = None,
                 parallelism: str = "ddp", with_reference: bool = False,
                 start_from: Path | None = None) -> None:
        """`with_reference`: the run has a KL penalty (kl_coefficient > 0). Under FSDP its
        frozen reference policy is built empty and sharded like the policy, and each rank
        copies its shards from the policy's, so that no rank ever holds a whole second model;
        DDP takes it from the wrapped model when the trainer asks (`reference_model`).

        Under FSDP the model's weights may come in CPU memory (`load_model(config, device,
        stage_on_cpu=True)`), in the dtype of their files: each unit moves to `device` as it
        is sharded, and the trained weights become fp32 masters there, each rank its shard.
        So a rank's card holds its shards and one unit at a time, never the whole model, and
        its host memory never a whole fp32 copy (FLUX: 48 GB). `start_from`: a checkpoint
        directory whose weights replace the loaded ones (the job's base_checkpoint), read
        into the shards a tensor at a time; the KL reference is copied from them."""
        super().__init__()
        device = torch.device(device or local_device())
        self.parallelism = parallelism
        # outside the module tree: its parameters are not the policy's (optimizer, state dict)
        self.__dict__["_reference"] = None
        if parallelism not in ("ddp", "fsdp"):
            raise ValueError(f"parallelism must be 'ddp' or 'fsdp', got {parallelism!r}")
        if parallelism == "ddp":
            if start_from is not None:
                model.load_weights(start_from)
            ids = [device.index] if device.type == "cuda" else None
            self.ddp = DistributedDataParallel(model.to(device), device_ids=ids)
            self.sharded: FlowModel | None = None
            return
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if device.type == "cuda":  # the card fully_shard moves each unit to
            torch.cuda.set_device(device)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        # gather the weights in the dtype the forward computes in (bf16 under mixed
        # precision: half the traffic of the fp32 masters, which stay sharded for the
        # optimizer) and average the gradients in fp32. Inputs are left as they come
        # (autocast casts them for the matmuls): FSDP casts a unit's inputs in its forward
        # but not in gradient checkpointing's recomputation, whose saved tensors would
        # then differ in dtype ("Recomputed values ... have different metadata")
        policy = MixedPrecisionPolicy(param_dtype=model.compute_dtype,
                                      reduce_dtype=torch.float32, cast_forward_inputs=False)

        def shard(flow_model: FlowModel) -> None:
            for unit in flow_model.shard_units():
                fully_shard(unit, mesh=mesh, mp_policy=policy)
            fully_shard(flow_model, mesh=mesh, mp_policy=policy)  # the rest: embeddings, ...

        # built before the policy is sharded (it copies the policy's structure), on the meta
        # device: no memory until each rank has its shards
        reference = model.reference_model(empty=True) if with_reference else None
        shard(model)
        trained = model.trainable_parameters()
        if any(p.dtype != torch.float32 for p in trained):
            # staged in the files' dtype: the optimizer's fp32 masters, made shard by shard
            # (FSDP takes the new dtype at its first forward; the gathers stay in bf16)
            model.to(torch.float32)
        self.sharded = model
        self.ddp = None
        if start_from is not None:
            self.load_weights(start_from)
        if reference is not None:
            # the reference's root unit (embeddings, final layers: small beside the blocks)
            # stays gathered after its forward, which FSDP does for a root without backward
            shard(reference)
            reference.to_empty(device=device)
            copy_shards(model, reference)
            self.__dict__["_reference"] = reference

    @property
    def inner(self) -> FlowModel:
        return self.sharded if self.ddp is None else self.ddp.module

    @contextmanager
    def no_gradient_sync(self) -> Iterator[None]:
        """Under DDP, forwards and backwards inside add this process's gradients to its own
        without averaging them over the processes; the next forward and backward outside
        averages the whole sum at once. `optimizer_step` runs every micro-batch of a step but
        the last inside, so a step costs one all-reduce of the gradients, not one per
        micro-batch, and the gradients are the same (the average of the sums is the sum of
        the averages). DDP decides in the forward whether the backward reduces (the forward
        arms its reducer), so the forward runs inside too.
        Under FSDP nothing changes: each micro-batch's backward still reduce-scatters. Skipped,
        every unit would keep its whole unsharded gradient until the last micro-batch (a
        whole model's gradients on each card: 48 GB for FLUX in fp32), and sharding is there
        for full fine-tuning of models that only fit sharded."""
        if self.ddp is None:
            yield
            return
        with self.ddp.no_sync():
            yield

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this process writes the checkpoint files (rank 0; the others only take
        part in gathering sharded state)."""
        return dist.get_rank() == 0

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return self.inner.latent_shape

    @property
    def flow_shift(self) -> float:
        return self.inner.flow_shift

    def sigmas(self, steps: int) -> torch.Tensor:
        return self.inner.sigmas(steps)

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return self.inner.compute_dtype

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: Any) -> torch.Tensor:
        return self.inner(x, t, cond) if self.ddp is None else self.ddp(x, t, cond)

    def encode_prompts(self, prompts: list[str]) -> Any:
        return self.inner.encode_prompts(prompts)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.inner.decode(latents)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return self.inner.trainable_parameters()

    def save_weights(self, directory: Path, metadata: dict[str, str],
                     state: dict[str, torch.Tensor] | None = None) -> Path:
        """DDP: rank 0's copy is the model. FSDP: every rank gathers (a collective), rank 0
        writes the full weights; the others write nothing and return where they would be."""
        if self.ddp is not None:
            return self.inner.save_weights(directory, metadata, state)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.inner, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))  # on rank 0's CPU; empty elsewhere
        if not self.writes_checkpoints:
            return Path(directory)
        return self.inner.save_weights(directory, metadata, full)

    def load_weights(self, directory: Path) -> None:
        if self.ddp is not None:
            self.inner.load_weights(directory)
            return
        # every rank reads the file (shared storage) and keeps its own shard: no collective,
        # so the ranks may load at different moments (a job runner may resume rank 0 first);
        # a tensor at a time, so a rank's host memory holds one tensor of the file, not all
        copy_weights(self.inner, self.inner.read_weights(directory), str(directory),
                     place=distribute_like)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """FSDP: the full state gathered onto rank 0's CPU (a collective), in the plain
        `Optimizer.state_dict()` format, so any number of processes can resume from it."""
        if self.ddp is not None:
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        full = get_optimizer_state_dict(self.inner, optimizer, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))  # keyed by parameter names
        order = [name for group in full.get("param_groups", []) for name in group["params"]]
        index = {name: i for i, name in enumerate(order)}
        return {"state": {index[name]: value for name, value in full.get("state", {}).items()},
                "param_groups": [{**group, "params": [index[n] for n in group["params"]]}
                                 for group in full.get("param_groups", [])]}

    def place_optimizer_tensor(self, tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        # FSDP: the moments are sharded like their parameters (sliced locally, as the weights)
        if self.ddp is None and tensor.shape == param.shape:
            return distribute_like(tensor, param)
        return tensor.to(tensor_local(param).device)

    def reference_model(self, *, empty: bool = False) -> FlowModel:
        """The KL penalty's frozen policy: DDP, the wrapped model's (taken now, before any
        update); FSDP, the sharded copy made at construction (`with_reference`)."""
        if self.ddp is not None:
            return self.inner.reference_model(empty=empty)
        if self._reference is None:
            raise ValueError("a sharded model's KL reference is copied before sharding: "
                             "construct DistributedFlowModel with with_reference=True")
        return self._reference

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # the unwrapped names
        return self.inner.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> _IncompatibleKeys:
        return self.inner.load_state_dict(state_dict, strict=strict, assign=assign)


@torch.no_grad()
def copy_shards(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Fill `target`, a copy of `source`'s structure sharded the same way, with this rank's
    shards of `source`'s parameters and its buffers, in `target`'s dtypes (no communication).
    The two are paired in registration order: a reference built from the policy's class
    registers its tensors as the policy does (checked by shape)."""
    pairs = [(list(source.named_parameters()), list(target.named_parameters())),
             (list(source.named_buffers()), list(target.named_buffers()))]
    for sources, targets in pairs:
        if len(sources) != len(targets):
            raise ValueError(f"the copy has {len(targets)} tensors where its source has "
                             f"{len(sources)}")
        for (source_name, s), (target_name, t) in zip(sources, targets, strict=True):
            s, t = tensor_local(s), tensor_local(t)
            if s.shape != t.shape:
                raise ValueError(f"{target_name} {tuple(t.shape)} is not a copy of "
                                 f"{source_name} {tuple(s.shape)}")
            t.copy_(s)


def distribute_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` laid out as `like` is (a DTensor: this rank's shard of it, cut locally without
    communication, since every rank holds the full tensor); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor):
        return full.to(like.device)
    return distribute_tensor(full.to(like.device, like.dtype), like.device_mesh, like.placements,
                             src_data_rank=None)


def tensor_local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores for `tensor` (a DTensor's local shard)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


SUMMED = ("forward_passes", "backward_passes")  # work counts add up over ranks


# a spread over all ranks' samples is not the mean of each rank's: (std, the mean it is
# around), pooled from each rank's second moment
POOLED_STD = {"reward_std": "reward_mean"}


def _average_metrics(metrics: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Every numeric metric averaged over ranks, except SUMMED, which are totals, and
    POOLED_STD, the population std of every rank's samples together (each rank holds as many:
    prompts_per_iteration / world prompts x group_size)."""
    keys = sorted(k for k, v in metrics.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool))
    pooled = [k for k in POOLED_STD if k in keys and POOLED_STD[k] in keys]
    second_moments = [float(metrics[k]) ** 2 + float(metrics[POOLED_STD[k]]) ** 2
                      for k in pooled]
    values = torch.tensor([float(metrics[k]) for k in keys] + second_moments,
                          dtype=torch.float64, device=device)
    dist.all_reduce(values)
    world = dist.get_world_size()
    totals = values.tolist()
    out = dict(metrics)
    for key, total in zip(keys, totals[:len(keys)], strict=True):
        out[key] = total if key in SUMMED else total / world
    for key, second in zip(pooled, totals[len(keys):], strict=True):
        out[key] = max(second / world - out[POOLED_STD[key]] ** 2, 0.0) ** 0.5
    return out


def make_distributed(trainer: Trainer) -> Trainer:
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

    def sharded_iteration(model: FlowModel, optimizer: torch.optim.Optimizer,
                          prompts: list[str], config: TrainConfig, generator: torch.Generator,
                          **extra: Any) -> IterationResult:
        # one draw from the shared RNG keeps ranks in step; each rank gets its own stream
        base = int(torch.randint(0, SEED_LIMIT, (1,), generator=generator))
        local = torch.Generator().manual_seed(base + rank)
        if config.reward_server_url and extra.get("stop_requested") is not None:
            # a wait for the reward server that one rank gives up, all give up
            extra["agree_stop"] = functools.partial(any_rank, device=comm_device)
        result = iterate(model, optimizer, prompts, config, local, **extra)
        result.metrics = _average_metrics(result.metrics, comm_device)
        result.metrics["world_size"] = world
        if keeps_samples(config, trainer.iteration + 1):  # this one, counted once it returns
            # what is kept of it (stored rollout groups, sample grids) shows every prompt
            result = gather_groups(result, rank, world)
        return result

    evaluate = trainer.evaluate

    def whole_evaluation(stop_requested: Callable[[], bool] | None = None) -> dict[str, float]:
        # every rank runs the periodic evaluation to its end: one that ended it early would
        # leave the others' sharded forwards (FSDP) waiting for its part of the gathers
        return evaluate()

    trainer.sample_prompts = sample_prompts
    trainer._iterate = sharded_iteration
    trainer.evaluate = whole_evaluation
    return trainer


def gather_groups(result: IterationResult, rank: int, world: int) -> IterationResult:
    """Every rank's prompt groups (images, rewards, advantages, anchors, noise seeds) gathered
    into rank 0's result, in the order of the global prompt list (rank r holds prompts r,
    r + W, ...): rank 0 then records and logs the whole iteration, not 1/W of it. A
    collective; the other ranks keep their own share. The metrics are rank 0's (averaged
    already)."""
    share = (result.prompts, result.noise_seeds, result.images, result.rewards,
             result.advantages, result.anchors)
    shares: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(share, shares, dst=0)
    if shares is None:
        return result

    def interleave(parts: list[np.ndarray]) -> np.ndarray:
        # (P/W, ...) from each rank -> (P, ...) with rank r's i-th prompt at i * W + r
        stacked = np.stack([np.asarray(part) for part in parts], axis=1)
        return stacked.reshape(-1, *stacked.shape[2:])

    prompts, seeds, images, rewards, advantages, anchors = zip(*shares, strict=True)
    return IterationResult(
        prompts=[p for group in zip(*prompts, strict=True) for p in group],
        noise_seeds=[int(x) for group in zip(*seeds, strict=True) for x in group],
        images=interleave(list(images)),
        rewards={name: interleave([r[name] for r in rewards]) for name in rewards[0]},
        advantages=interleave(list(advantages)), anchors=interleave(list(anchors)),
        metrics=result.metrics)


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
