"""One gradient average per optimizer step over several processes (trainer.grpo.optimizer_step
with DistributedFlowModel.no_gradient_sync), in two real gloo processes: under DDP a step of
several micro-batches all-reduces the gradients once, as a step of one micro-batch does, not
once per micro-batch; under FSDP each micro-batch still reduce-scatters (the gradients stay
sharded); either way its weights are those of one process training on both processes' rows."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.subprocess  # two spawned processes

ROWS, MICRO, FEATURES = 6, 2, 4  # per process: 3 micro-batches of 2 rows


def _tiny_flow_model() -> torch.nn.Module:
    from trainer.models.base import FlowModel

    class Tiny(FlowModel):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(),
                                           torch.nn.Linear(8, FEATURES))

        def forward(self, x: torch.Tensor, t: torch.Tensor, cond: object) -> torch.Tensor:
            return self.net(x) * t[:, None]

    torch.manual_seed(0)
    return Tiny()


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(2 * ROWS, FEATURES, generator=g), torch.rand(2 * ROWS, generator=g),
            torch.randn(2 * ROWS, FEATURES, generator=g))


def _parts(model: torch.nn.Module, x: torch.Tensor, t: torch.Tensor, target: torch.Tensor):
    """The loss (mean squared error over the rows) in micro-batches, each weighted by its
    share, its forward run as it is drawn: as the trainer's update loops yield theirs."""
    for start in range(0, len(x), MICRO):
        rows = slice(start, start + MICRO)
        share = MICRO / len(x)
        yield share * (model(x[rows], t[rows], None) - target[rows]).pow(2).mean()


def _rank(rank: int, port: int, out: str, parallelism: str) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from trainer.distributed import DistributedFlowModel
    from trainer.grpo import optimizer_step

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        model = DistributedFlowModel(_tiny_flow_model(), "cpu", parallelism=parallelism)
        reductions = [0]
        if parallelism == "ddp":
            def counting_hook(state, bucket):  # one call per bucket all-reduce
                reductions[0] += 1
                return allreduce_hook(state, bucket)

            model.ddp.register_comm_hook(None, counting_hook)
        else:
            reduce_scatter = dist.reduce_scatter_single

            def counting_reduce_scatter(*args, **kwargs):
                reductions[0] += 1
                return reduce_scatter(*args, **kwargs)

            dist.reduce_scatter_single = counting_reduce_scatter
        optimizer = torch.optim.SGD(model.trainable_parameters(), lr=0.5)
        x, t, target = (tensor[rank * ROWS:(rank + 1) * ROWS] for tensor in _data())

        optimizer_step(model, optimizer, _parts(model, x, t, target), max_grad_norm=0.0,
                       parts=ROWS // MICRO)
        micro_batched = reductions[0]
        # a sharded parameter gathered whole (a collective: every rank, the same order)
        weights = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().tolist()
                   for name, p in model.inner.named_parameters()}

        reductions[0] = 0  # one round: a step whose loss is one tensor
        optimizer_step(model, optimizer, sum(_parts(model, x, t, target)), max_grad_norm=0.0)
        Path(out, f"{rank}.json").write_text(json.dumps(
            {"micro_batched": micro_batched, "one_round": reductions[0], "weights": weights}))
        # both ranks past their last collective before either leaves: a rank that tore its
        # group down while the other's reduce-scatter was still in flight died in gloo's
        # threads ("terminate called without an active exception", SIGABRT) in one CI run
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_a_micro_batched_step_averages_the_gradients_once_and_trains_as_one_process(
        tmp_path, parallelism):
    from trainer.grpo import optimizer_step

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_rank, args=(port, str(tmp_path), parallelism), nprocs=2,
                       start_method="spawn")
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    for result in results:
        assert result["one_round"] >= 1
        if parallelism == "ddp":  # 3 micro-batches, yet as many all-reduces as a step of one
            assert result["micro_batched"] == result["one_round"]
        else:  # each micro-batch's gradients reduce-scattered: never held whole
            assert result["micro_batched"] == (ROWS // MICRO) * result["one_round"]

    # one process, every row of both: the mean over all rows is the average of the processes'
    single = _tiny_flow_model()
    x, t, target = _data()
    optimizer_step(single, torch.optim.SGD(single.parameters(), lr=0.5),
                   (single(x, t, None) - target).pow(2).mean(), max_grad_norm=0.0)
    for result in results:
        for name, p in single.named_parameters():
            torch.testing.assert_close(torch.tensor(result["weights"][name]), p.detach(),
                                       rtol=0, atol=1e-6, msg=name)
    assert results[0]["weights"] == results[1]["weights"]
