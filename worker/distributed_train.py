"""A train job on several processes: `torchrun --nproc_per_node N -m worker.distributed_train
JOB_ID WORKER_NAME` (the train task launches it when TRAIN_NPROC > 1; the task has claimed the
job and keeps its heartbeat). Every rank trains its shard (trainer/distributed.py); rank 0
alone records metrics, rollout groups and checkpoints, and its stop decision (cancel, finished,
shutdown) is broadcast so all ranks leave the loop together. SIGTERM: save, requeue, exit.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path

import torch.distributed as dist

from app.db import session_scope
from app.services import checkpoints, jobs, storage
from trainer.config import TrainConfig
from trainer.distributed import (
    DistributedFlowModel,
    broadcast_flag,
    init_from_env,
    local_device,
    make_distributed,
)
from trainer.loop import Trainer, load_model
from worker.training import TrainRecorder, prepare_trainer


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO)
    args = argv if argv is not None else sys.argv[1:]
    job_id, worker_name = int(args[0]), args[1]
    shutdown = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: shutdown.set())
    rank, _world = init_from_env()
    comm = local_device() if dist.get_backend() == "nccl" else "cpu"
    with session_scope() as s:
        config = TrainConfig.from_dict(dict(jobs.get_job(s, job_id).config))
    model = DistributedFlowModel(load_model(config))  # collective: every rank, same time
    if rank == 0:  # resumes and truncates the metric history past the checkpoint
        trainer, config, ckpt_id, last_vote = prepare_trainer(job_id, model=model)
    dist.barrier()
    if rank != 0:
        trainer, ckpt_id, last_vote = Trainer(config, model=model), None, 0
        if (directory := recorded_checkpoint_dir(job_id)) is not None:
            trainer.load_checkpoint(directory)
    make_distributed(trainer)
    recorder = (TrainRecorder(job_id, worker_name, config, ckpt_id, shutdown, last_vote)
                if rank == 0 else None)
    error: Exception | None = None

    def on_iteration(tr: Trainer, result) -> bool:
        nonlocal error
        stop = 0
        if recorder is not None:
            try:
                stop = int(recorder(tr, result))
            except Exception as exc:  # tell the other ranks to stop, then fail
                error, stop = exc, 1
        return bool(broadcast_flag(stop, comm))

    if trainer.iteration < config.iterations:
        trainer.run(on_iteration)
    dist.barrier()
    dist.destroy_process_group()
    if recorder is None:
        return 0
    if error is not None:
        raise error
    if recorder.requeued:
        jobs.celery_enqueue(job_id, "train")
    elif not recorder.cancelled:
        with session_scope() as s:
            if jobs.holds(s, job_id, worker_name):
                jobs.mark_succeeded(s, job_id)
    return 0


def recorded_checkpoint_dir(job_id: int) -> Path | None:
    with session_scope() as s:
        ckpt = checkpoints.latest_checkpoint(s, job_id)
        return storage.resolve(ckpt.path).parent if ckpt is not None else None


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # gloo's threads can abort a normal interpreter exit ("terminate called ...")
