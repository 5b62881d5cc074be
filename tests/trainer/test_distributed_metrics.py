"""An iteration's metrics across ranks (trainer.distributed._average_metrics), in two real
gloo processes: means average, work counts add up, and reward_std is the spread of every
rank's samples together (it was the mean of each rank's spread, which misses how far apart
the ranks' means lie)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch.multiprocessing as mp

pytestmark = pytest.mark.subprocess  # two spawned processes

REWARDS = [np.array([0.0, 1.0, 1.0, 2.0]), np.array([5.0, 7.0, 6.0, 6.0])]  # one per rank


def _rank(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from trainer.distributed import _average_metrics

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        mine = REWARDS[rank]
        metrics = {"reward_mean": float(mine.mean()), "reward_std": float(mine.std()),
                   "backward_passes": 3, "loss": float(rank), "note": "text"}
        averaged = _average_metrics(metrics, torch.device("cpu"))
        Path(out, f"{rank}.json").write_text(json.dumps(averaged))
        dist.barrier()  # both ranks done before either tears its group down
    finally:
        dist.destroy_process_group()


def test_reward_std_is_pooled_over_ranks_and_the_rest_average_or_add(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_rank, args=(port, str(tmp_path)), nprocs=2, start_method="spawn")
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert results[0] == results[1]  # every rank logs the same numbers
    together = np.concatenate(REWARDS)
    got = results[0]
    assert got["reward_mean"] == pytest.approx(together.mean())
    assert got["reward_std"] == pytest.approx(together.std())  # not the ranks' mean std 0.6
    assert got["backward_passes"] == 6 and got["loss"] == pytest.approx(0.5)
    assert got["note"] == "text"
