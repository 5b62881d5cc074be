"""A train job on several processes: `torchrun --nproc_per_node N -m worker.distributed_train
JOB_ID WORKER_NAME` (the train task launches it when TRAIN_NPROC > 1 or the job's
train_nnodes > 1, one torchrun per host: worker/torchrun.py; the task has claimed the job and
keeps its heartbeat; WORKER_NAME is its name on every host). Every rank trains its shard
(trainer/distributed.py, by global rank); rank 0 alone records metrics, rollout groups and
checkpoints, and its stop decision (cancel, finished, shutdown) is broadcast so all ranks leave
the loop together. SIGTERM to any rank (its host's worker shuts down): rank 0 saves and
requeues, every rank exits. With parallelism 'fsdp' the weights are sharded, so a checkpoint
is written by all ranks together: rank 0 decides whether this iteration ends with one
(`TrainRecorder.checkpoint_due`), broadcasts it, every rank gathers, rank 0 writes and records
it (a cancel request that arrives after the decision is acted on one iteration later).
A cancel or a shutdown while the ranks wait for the reward server's scores does not wait for
them: every rank asks while it waits, the ranks give the iteration up together
(trainer/distributed.py), and rank 0 ends the job at the last whole iteration, as one process
does (`TrainRecorder.stop_mid_iteration`).

The preference reward (reward_weights has "preference") is rank 0's choice too: the version it
resolved at the start (a fit may record a newer "latest" while the ranks start), and after an
online refit there the new version, broadcast with the stop flag so that every rank scores the
next iteration with the same model.
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
from trainer.distributed import (
    any_rank,
    broadcast_ints,
    init_from_env,
    load_distributed_model,
    local_device,
    make_distributed,
)
from trainer.loop import Trainer
from trainer.models import checkpoint_directory
from trainer.rewards.remote import ScoringStopped
from worker.torchrun import advertised_host, node_started_line, rank_error_line
from worker.training import (
    SELF_EXPLAINING_ERRORS,
    TrainRecorder,
    attach_preference,
    attach_preference_version,
    checkpoint_root,
    prepare_trainer,
    stop_poll,
    train_config_of,
)

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO)
    args = argv if argv is not None else sys.argv[1:]
    job_id, worker_name = int(args[0]), args[1]
    shutdown = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: shutdown.set())
    rank, world = init_from_env()
    comm = local_device() if dist.get_backend() == "nccl" else "cpu"
    log_node(job_id, rank, world)
    with session_scope() as s:
        config = train_config_of(s, jobs.get_job(s, job_id))
    model = load_distributed_model(config)  # every rank, same time
    sharded = config.parallelism == "fsdp"
    if rank == 0:  # resumes and truncates the metric history past the checkpoint
        trainer, config, ckpt_id, last_vote = prepare_trainer(job_id, model=model)
    # the model rank 0 blends ("latest" may be newer by now); this also waits for its prepare
    (version,) = broadcast_ints([preference_version(trainer) if rank == 0 else 0], comm)
    if rank != 0:
        trainer, ckpt_id, last_vote = Trainer(config, model=model), None, 0
        attach_preference(trainer, config, latest=version)
        # rank 0 may have resumed with a version other than the config's (its checkpoint's)
        follow_preference(trainer, version)
        if (directory := recorded_checkpoint_dir(job_id)) is not None:
            trainer.load_checkpoint(directory)
    make_distributed(trainer)
    fingerprinted = log_preference_fingerprint(trainer, rank, 0)
    recorder = (TrainRecorder(job_id, worker_name, config, ckpt_id, shutdown, last_vote)
                if rank == 0 else None)
    holder = HolderWatch(worker_name) if rank == 0 else None
    orphaned = False
    if recorder is not None:
        recorder.collective_checkpoints = sharded
    error: Exception | None = None

    def on_iteration(tr: Trainer, result) -> bool:
        nonlocal error, fingerprinted, orphaned
        stop = 0
        # a warm shutdown of any host's worker (SIGTERM to its ranks): rank 0 saves, requeues
        if any_rank(shutdown.is_set(), comm):
            shutdown.set()
        if sharded:  # rank 0 plans the checkpoint, every rank gathers it, rank 0 writes
            (due,) = broadcast_ints([int(recorder.checkpoint_due(tr)) if recorder else 0], comm)
            if due:
                saved = tr.save_checkpoint(checkpoint_root(job_id))
                if recorder is not None:
                    recorder.presaved = saved
        if holder is not None and holder.gone():
            # the worker died without torchrun noticing (its death signal missed): its lease
            # still holds, so nothing else would stop this run. Leave the job running with a
            # heartbeat going stale: a reaper requeues it from its newest checkpoint
            log.warning("job %s: the worker process %s holding it is gone; stopping at "
                        "iteration %d", job_id, holder.pid, tr.iteration)
            orphaned, stop = True, 1
        elif recorder is not None:  # may refit the preference model (a new version)
            try:
                stop = int(recorder(tr, result))
            except Exception as exc:  # tell the other ranks to stop, then fail
                error, stop = exc, 1
        stop, version = broadcast_ints([stop, preference_version(tr)], comm)
        if not stop and follow_preference(tr, version):
            log.info("rank %d follows rank 0 to preference model v%d", rank, version)
        fingerprinted = log_preference_fingerprint(tr, rank, fingerprinted)
        return bool(stop)

    # asked while this rank waits for the reward server (every rank polls the cancel flag: a
    # rank whose scores came waits for the others in the agreement, not here)
    will_stop = recorder.stop_requested if recorder is not None else stop_poll(
        job_id, config, shutdown)
    if trainer.iteration < config.iterations:
        try:
            trainer.run(on_iteration, stop_requested=lambda: will_stop(trainer.iteration))
        except ScoringStopped:  # on every rank at once (trainer.distributed): a cancel or
            error = stop_mid_iteration(trainer, job_id, recorder, comm)  # a shutdown, mid-wait
    dist.barrier()
    dist.destroy_process_group()
    if recorder is None or orphaned:
        return 0
    if error is not None:
        raise error
    if recorder.requeued:
        from worker.reaper import send_requeued

        send_requeued(job_id, "train", worker_name)
    elif not recorder.cancelled:
        with session_scope() as s:
            if jobs.holds(s, job_id, worker_name):
                jobs.mark_succeeded(s, job_id)
    return 0


def stop_mid_iteration(trainer: Trainer, job_id: int, recorder: TrainRecorder | None,
                       comm: str) -> Exception | None:
    """End the job on every rank after an iteration all ranks gave up while the reward server
    scored it (TrainRecorder.stop_mid_iteration, on rank 0). Sharded weights: the checkpoint
    of the last whole iteration, where one is due, is saved by every rank together first.
    Returns rank 0's error in recording the end (raised once the ranks have left)."""
    if trainer.config.parallelism == "fsdp":
        (due,) = broadcast_ints(
            [int(recorder.checkpoint_due_mid_iteration(trainer)) if recorder else 0], comm)
        if due:
            saved = trainer.save_checkpoint(checkpoint_root(job_id))
            if recorder is not None:
                recorder.presaved = saved
    if recorder is None:
        return None
    try:
        recorder.stop_mid_iteration(trainer)
    except Exception as exc:  # the other ranks wait at the barrier: leave with them first
        return exc
    return None


def ancestors() -> list[int]:
    """This process's ancestors' pids, its parent first, from Linux's /proc ([] elsewhere)."""
    found: list[int] = []
    pid = os.getppid()
    while pid > 1 and pid not in found:
        found.append(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:  # gone meanwhile, or no /proc
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after "(comm) state"
    return found


class HolderWatch:
    """Whether the worker process named in the job's lease (node:pid:nonce,
    app.services.workers.lease_name) is gone: it was an ancestor of this rank when the rank
    started (the worker, its torchrun, this rank) and is no longer one (torchrun re-parented
    once the worker died; a pid reused since is no ancestor). On another host's node, where
    the holder is no ancestor, it never says gone (that node's own worker is its guard)."""

    def __init__(self, lease: str) -> None:
        try:
            pid: int | None = int(lease.rsplit(":", 2)[1])
        except (IndexError, ValueError):
            pid = None
        self.pid = pid if pid in ancestors() else None

    def gone(self) -> bool:
        return self.pid is not None and self.pid not in ancestors()


def log_node(job_id: int, rank: int, world: int) -> None:
    """Local rank 0 of each node says which node it is (torchrun's GROUP_RANK; several
    only with train_nnodes > 1): the worker copies the line into its log."""
    if int(os.environ.get("LOCAL_RANK", 0)) != 0:
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    line = node_started_line(job_id, int(os.environ.get("GROUP_RANK", 0)),
                             int(os.environ.get("GROUP_WORLD_SIZE", world // local)),
                             advertised_host(), rank, rank + local - 1, world)
    log.info("%s", line)


def preference_version(trainer: Trainer) -> int:
    """The version of the preference model in use, 0 without a recorded one (int to broadcast)."""
    return trainer.preference_version or 0


def log_preference_fingerprint(trainer: Trainer, rank: int, logged: int) -> int:
    """When the preference model in use is a version this rank has not described yet, log
    what it is: a digest of its weights and its scores on a fixed probe batch, the same on
    every rank when every rank blends the same model (rank 0's refit in memory, the others
    the file it recorded). Returns the version described (`logged` when nothing changed)."""
    version = preference_version(trainer)
    if not version or version == logged:
        return logged
    import hashlib

    import numpy as np

    from trainer.rewards import get_reward

    model = get_reward("preference")
    digest = hashlib.sha256()
    for name, tensor in sorted(model.net.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().numpy().tobytes())
    probe = np.random.default_rng(0).integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
    scores = model(probe, ["one red circle", "two blue squares", "three green triangles",
                           "four red squares"])
    log.info("rank %d preference model v%d: weights %s, probe scores %s", rank, version,
             digest.hexdigest()[:16], " ".join(f"{s:.6f}" for s in scores))
    return version


def follow_preference(trainer: Trainer, version: int) -> bool:
    """Swap in rank 0's preference model `version` if it is not the one in use (rank 0 refitted;
    on rank 0 itself it always is). 0: no recorded model, nothing to follow. Returns whether
    it swapped."""
    if not version or version == trainer.preference_version:
        return False
    attach_preference_version(trainer, version)
    return True


def recorded_checkpoint_dir(job_id: int) -> Path | None:
    with session_scope() as s:
        ckpt = checkpoints.latest_checkpoint(s, job_id)
        return checkpoint_directory(storage.resolve(ckpt.path)) if ckpt is not None else None


def report_failure(exc: BaseException) -> None:
    """Say on one line why this rank failed, for the worker to make the job's error of it
    (worker.torchrun.failure): torchrun's summary of a failed rank does not say."""
    from worker.tasks import traceback_tail

    line = rank_error_line(int(os.environ.get("RANK", 0)), exc,
                           clean=isinstance(exc, SELF_EXPLAINING_ERRORS),
                           traceback_tail=traceback_tail(exc))
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    try:
        code = main()
    except Exception as exc:
        report_failure(exc)
        raise
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # gloo's threads can abort a normal interpreter exit ("terminate called ...")
