"""Train jobs under torchrun: on one host (TRAIN_NPROC processes) or on several hosts at once
(the job's `train_nnodes`), with one Celery worker per host.

One host: `torchrun --standalone --nproc-per-node P -m worker.distributed_train JOB WORKER`.

Several hosts: the worker that claims the job (the holder) alone holds the job's lease and
heartbeat (`worker.tasks.run_job`; a second worker's claim of the same job fails, so one job
never has two holders). It picks a rendezvous endpoint on itself (`WORKER_HOST`, `RDZV_PORT` or
a free port), starts torchrun with the c10d rendezvous hosted there, and sends
`train_nnodes - 1` `join_train` tasks to the train queue. A worker on another host takes each
and starts the same command pointed at the endpoint, with the holder's `TRAIN_NPROC` (the world
is then known at the start: train_nnodes x TRAIN_NPROC processes). The rendezvous waits
`RDZV_JOIN_TIMEOUT` seconds for every host; past that the holder's torchrun gives up before any
training process starts and the job fails saying how long it waited for how many hosts; a
join taken later finds its deadline passed (the message also expires then) and does nothing.

torchrun numbers the nodes itself (its c10d rendezvous sorts them by address, so the holder is
not always node 0), and the process of global rank 0, which records metrics, checkpoints and
the final status, may run on any host: every host shares the database and the storage, and
every node records under the holder's name. Cancellation and a warm shutdown of any host reach every rank through
the stop flags `worker.distributed_train` exchanges each iteration. A node that fails
mid-run fails the job (the other hosts' ranks would otherwise wait in a collective until its
timeout), and every node stops its torchrun once the job is no longer running under its
holder.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from app.config import get_settings
from app.db import session_scope
from app.models import JobStatus
from app.parent_death import die_with_parent
from app.services import jobs
from trainer.config import TrainConfig
from worker.lease import JobError, TaskOutcome

log = logging.getLogger(__name__)

# once the job has left `running` under its holder (finished, failed, cancelled, reaped), the
# ranks get this long to leave on their own before torchrun is stopped
LOST_GRACE_SECONDS = 30.0
POLL_SECONDS = 1.0
# how long a multi-host job that gave way to another's gathering waits before its message
# comes back to the queue (give_way)
GIVE_WAY_SECONDS = 5.0

# what worker.distributed_train logs when a node's processes have joined the job's process
# group (local rank 0 of each node); the worker copies these lines into its own log
NODE_LINE = re.compile(r"job \d+: node \d+ of \d+ started on \S+ \(global ranks [^)]*\)")


# A rank that fails says why on one line with this prefix (JSON after it: rank, the error's
# type and message, whether its message says it all, the traceback's tail): torchrun's own
# summary of a failed rank holds none of it, and in its output the ranks' tracebacks come
# before the summary's twenty-odd lines, where a tail of the output never reaches.
RANK_ERROR_PREFIX = "ngrpo-rank-error "


def rank_error_line(rank: int, exc: BaseException, *, clean: bool, traceback_tail: str) -> str:
    """The line a failed rank writes (RANK_ERROR_PREFIX)."""
    line = {"rank": rank, "type": type(exc).__name__, "message": str(exc), "clean": clean,
            "traceback": traceback_tail, "at": time.time()}
    if isinstance(exc, OSError) and exc.errno is not None and exc.filename:
        # the worker tells a storage it cannot write from a failed job (worker.tasks)
        line.update(errno=exc.errno, filename=os.fsdecode(exc.filename))
    return RANK_ERROR_PREFIX + json.dumps(line)


def rank_errors(text: str) -> list[dict]:
    """The failed ranks' lines in a torchrun's output, the earliest failure first: the others
    often fail because it did (a collective whose peer has gone)."""
    found = []
    for line in text.splitlines():
        _, marker, payload = line.partition(RANK_ERROR_PREFIX)
        if marker:
            with contextlib.suppress(ValueError):
                found.append(json.loads(payload))
    return sorted(found, key=lambda e: (e.get("at", 0.0), e.get("rank", 0)))


def failure(code: int | None, text: str) -> Exception:
    """Why a node's torchrun failed, as the job's error: the earliest error that says it all
    (a JobError's message: a reward server down, a run that diverged) alone, else the
    earliest failed rank's error and traceback; without any, torchrun's own last lines."""
    errors = rank_errors(text)
    if clean := next((e for e in errors if e.get("clean")), None):
        return JobError(clean["message"])
    if errors:
        first = errors[0]
        error = RuntimeError(f"rank {first['rank']} failed: {first['type']}: "
                             f"{first['message']}\n\n{first['traceback']}")
        if first.get("errno") is not None:  # the rank's OSError, for worker.tasks to read
            error.__cause__ = OSError(first["errno"], os.strerror(first["errno"]),
                                      first.get("filename"))
        return error
    return RuntimeError(f"torchrun exited with code {code} before the job finished:\n"
                        f"{tail(text)}")


def node_started_line(job_id: int, node_rank: int, nnodes: int, host: str, first: int,
                      last: int, world: int) -> str:
    """The line NODE_LINE matches, written by a node's local rank 0."""
    return (f"job {job_id}: node {node_rank} of {nnodes} started on {host} (global ranks "
            f"{first}-{last} of {world})")


@dataclass(frozen=True)
class Rendezvous:
    """Where and how the nodes of one multi-host job meet: also the join task's arguments."""

    job_id: int
    holder: str  # the worker holding the job's lease; rank 0 records under its name
    endpoint: str  # host:port of the c10d store the holder's torchrun hosts
    nnodes: int
    nproc: int  # processes per node (the holder's TRAIN_NPROC)
    deadline: float  # epoch seconds: the rendezvous gives up then

    def join_timeout(self) -> int:
        """Whole seconds left until the deadline (torchrun takes an int), at least 1."""
        return max(1, int(self.deadline - time.time()))

    def as_kwargs(self) -> dict:
        return asdict(self)


def advertised_host() -> str:
    """This worker's address for the other hosts (WORKER_HOST, else its fully qualified name)."""
    return get_settings().worker_host or socket.getfqdn()


def free_port() -> int:
    """A TCP port free on every interface now (torchrun binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def torchrun_command(job_id: int, worker_name: str, nproc: int,
                     rdzv: Rendezvous | None = None, is_host: bool = True) -> list[str]:
    """The torchrun command line of one node: standalone without `rdzv`, else the c10d
    rendezvous at `rdzv.endpoint`, hosted by this node when `is_host` (the holder's)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if rdzv is None:
        cmd.append("--standalone")
    else:
        # is_host said outright: on one machine (tests, or two workers on one host) torchrun's
        # guess from the endpoint's address would make every node try to host the store
        cmd += [f"--nnodes={rdzv.nnodes}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={rdzv.endpoint}", f"--rdzv-id=job-{job_id}",
                f"--rdzv-conf=is_host={int(is_host)},join_timeout={rdzv.join_timeout()}"]
        if get_settings().worker_host:  # the address the other nodes reach this one at
            cmd.append(f"--local-addr={get_settings().worker_host}")
    return [*cmd, "-m", "worker.distributed_train", str(job_id), worker_name]


def processes_per_node(config: TrainConfig, train_nproc: int) -> int:
    """How many processes a node gives the job: this worker's TRAIN_NPROC, or fewer where
    that many would not split each iteration's prompts evenly (3 prompts on 2 processes: 1,
    and the job runs rather than fail). Submission makes prompts_per_iteration a multiple of
    train_nnodes, so one process a node always fits. Not for parallelism 'fsdp'."""
    nnodes = config.train_nnodes
    if config.parallelism == "fsdp":
        # sharding is there for a model one card cannot hold: fewer processes would load it
        # whole, to fail out of memory minutes later; check_world says why at once instead
        return max(1, train_nproc)
    return next(n for n in range(max(1, train_nproc), 0, -1)
                if config.prompts_per_iteration % (nnodes * n) == 0)

def check_world(config: TrainConfig, nnodes: int, nproc: int) -> None:
    """JobError unless every process gets an equal share of each iteration's prompts
    (submission checked train_nnodes alone; TRAIN_NPROC is this worker's)."""
    world = nnodes * nproc
    if config.prompts_per_iteration % world:
        raise JobError(f"prompts_per_iteration ({config.prompts_per_iteration}) must be a "
                       f"multiple of the job's processes: train_nnodes ({nnodes}) x this "
                       f"worker's TRAIN_NPROC ({nproc}) = {world}")


def held(job_id: int, holder: str) -> bool:
    with session_scope() as s:
        return jobs.holds(s, job_id, holder)


def cancel_requested(job_id: int) -> bool:
    with session_scope() as s:
        return jobs.get_job(s, job_id).cancel_requested


def supervise(cmd: list[str], job_id: int, holder: str, shutdown: threading.Event,
              on_started: Callable[[], None] | None = None,
              cancel_while_waiting: bool = False) -> tuple[int, str]:
    """Run one node's torchrun to its end; (exit code, its output). A warm shutdown of this
    worker is passed on to the ranks as SIGTERM (rank 0 saves and requeues, all of them
    leave); once the job is no longer running under `holder` for LOST_GRACE_SECONDS, torchrun
    is stopped. `cancel_while_waiting`: a cancel requested before any node has started (the
    rendezvous still waiting for hosts) stops torchrun at once, since no rank is there yet to
    read the job's stop flag (it would wait out RDZV_JOIN_TIMEOUT)."""
    with tempfile.NamedTemporaryFile("w+b", suffix=".log", delete=False) as out:
        log_path = Path(out.name)
    try:
        with log_path.open("wb") as out, log_path.open("rb") as follow:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    preexec_fn=die_with_parent(os.getpid()))
            if on_started is not None:
                on_started()
            lost_since: float | None = None
            signalled = started = False
            while True:
                try:
                    proc.wait(timeout=POLL_SECONDS)
                    break
                except subprocess.TimeoutExpired:
                    started = _forward_node_lines(follow) or started
                if cancel_while_waiting and not started and cancel_requested(job_id):
                    log.info("job %s cancelled while its rendezvous waited for hosts: "
                             "stopping torchrun", job_id)
                    stop(proc)
                    break
                if shutdown.is_set() and not signalled:
                    signal_ranks(proc)
                    signalled = True
                if held(job_id, holder):
                    lost_since = None
                elif lost_since is None:
                    lost_since = time.monotonic()
                elif time.monotonic() - lost_since > LOST_GRACE_SECONDS:
                    log.warning("job %s is no longer running under %s: stopping torchrun",
                                job_id, holder)
                    stop(proc)
                    break
            _forward_node_lines(follow)
        text = log_path.read_text(errors="replace")
    finally:
        log_path.unlink(missing_ok=True)
    return proc.returncode, text


def rank_pids(proc: subprocess.Popen) -> list[int]:
    """The processes torchrun started (its ranks), from Linux's /proc; [] elsewhere."""
    pids: list[int] = []
    for children in Path(f"/proc/{proc.pid}/task").glob("*/children"):
        try:
            pids += [int(pid) for pid in children.read_text().split()]
        except OSError:  # the thread ended meanwhile
            continue
    return pids


def signal_ranks(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """`sig` to the ranks themselves, not to torchrun: an agent that gets SIGTERM kills its
    ranks 30 s later whatever they are doing, and leaves without the exit barrier the other
    hosts' agents then wait in. Without /proc, to torchrun after all."""
    pids = rank_pids(proc)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.kill(pid, sig)
    if not pids:
        proc.send_signal(sig)


def stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """End torchrun and its ranks: SIGTERM to torchrun, SIGKILL to all of them after `grace`."""
    pids = rank_pids(proc)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        for pid in [*pids, proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def _forward_node_lines(follow) -> bool:
    """Copy the node lines (NODE_LINE) torchrun wrote since the last call into this worker's
    log, as they come: which node of the job this host is, while it runs. Whether there was
    one (this node's ranks have joined the job)."""
    seen = False
    while (line := follow.readline()).endswith(b"\n"):
        if match := NODE_LINE.search(line.decode(errors="replace")):
            log.info("%s", match.group(0))
            seen = True
    if line:  # a partial line: read it again once it is complete
        follow.seek(-len(line), 1)
    return seen


def tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_torchrun(job_id: int, worker_name: str, config: TrainConfig, nproc: int,
                 shutdown: threading.Event) -> str:
    """The holder's node (or the only one): launch, send the joins, wait, explain a failed
    launch. The job is claimed and its heartbeat kept by the caller. Returns its status."""
    nnodes = config.train_nnodes
    check_world(config, nnodes, nproc)
    if nnodes > 1 and (given_way := give_way(job_id, worker_name)) is not None:
        return given_way
    rdzv = None
    if nnodes > 1:
        settings = get_settings()
        port = settings.rdzv_port or free_port()
        rdzv = Rendezvous(job_id=job_id, holder=worker_name,
                          endpoint=endpoint(advertised_host(), port), nnodes=nnodes,
                          nproc=nproc, deadline=time.time() + settings.rdzv_join_timeout)
        log.info("job %s: one of %d hosts, rendezvous at %s; asking %d more host(s) to join",
                 job_id, nnodes, rdzv.endpoint, nnodes - 1)

    def send_joins() -> None:
        from worker.celery_app import send_join

        for _ in range(nnodes - 1):
            send_join(rdzv.as_kwargs(), rdzv.deadline)

    code, text = supervise(torchrun_command(job_id, worker_name, nproc, rdzv), job_id,
                           worker_name, shutdown, send_joins if rdzv is not None else None,
                           cancel_while_waiting=rdzv is not None)
    with session_scope() as s:
        job = jobs.get_job(s, job_id)
        if job.status != JobStatus.RUNNING or job.worker != worker_name:
            return job.status  # finished, cancelled, or requeued by rank 0 on shutdown
        if job.cancel_requested and NODE_LINE.search(text) is None:
            # stopped while the rendezvous waited: no rank ran, so none recorded the cancel
            return jobs.mark_cancelled(s, job_id).status
    if rdzv is not None and "RendezvousTimeoutError" in text:
        raise JobError(f"waited {get_settings().rdzv_join_timeout} s for {nnodes - 1} more "
                       f"host(s) to join the rendezvous at {rdzv.endpoint} (train_nnodes="
                       f"{nnodes}); no training process started. Each host needs a worker "
                       "serving the train queue that is idle and can reach that address "
                       "(README \"Workers\"); relaunch with a smaller train_nnodes, or raise "
                       "RDZV_JOIN_TIMEOUT")
    raise failure(code, text)


def give_way(job_id: int, holder: str) -> str | None:
    """Requeue this multi-host job, claimed but not started, when another one gathers its hosts
    ahead of it (app.services.workers.gathering_ahead), and return the task's outcome; None:
    go on. Two holders waiting for joins at once waited for ever, each host busy holding a job
    (two jobs of train_nnodes 2 on two hosts both failed after RDZV_JOIN_TIMEOUT): this worker
    is then free to take the other job's join, and its own job's message comes back after
    GIVE_WAY_SECONDS (not at once: the joins it waits for may all be taken already)."""
    from app.queue import enqueue
    from app.services import workers

    with session_scope() as s:
        ahead = workers.gathering_ahead(s, job_id)
        if ahead is None:
            return None
        if not jobs.holds(s, job_id, holder):
            return TaskOutcome.LOST
        status = jobs.requeue(s, job_id).status
    if status != JobStatus.QUEUED:  # a cancel asked meanwhile ended it
        return status
    log.info("job %s: job %s gathers its hosts first; requeued for %g s, this worker free to "
             "join it", job_id, ahead.id, GIVE_WAY_SECONDS)
    enqueue(job_id, "train", countdown=GIVE_WAY_SECONDS)
    return TaskOutcome.GAVE_WAY


def run_join(rdzv: Rendezvous, shutdown: threading.Event) -> str:
    """Another node of a multi-host job: join the holder's rendezvous unless the job has moved on
    or the deadline has passed. Writes to the job only when its own processes fail mid-run
    (so that the other hosts stop waiting for them). Returns what happened."""
    if time.time() >= rdzv.deadline or not held(rdzv.job_id, rdzv.holder):
        log.info("job %s: join for %s skipped (the rendezvous is over, or the job is no "
                 "longer running under it)", rdzv.job_id, rdzv.endpoint)
        return TaskOutcome.SKIPPED
    log.info("job %s: joining the rendezvous at %s as one of %d hosts", rdzv.job_id,
             rdzv.endpoint, rdzv.nnodes)
    cmd = torchrun_command(rdzv.job_id, rdzv.holder, rdzv.nproc, rdzv, is_host=False)
    code, text = supervise(cmd, rdzv.job_id, rdzv.holder, shutdown)
    if code == 0:
        return TaskOutcome.DONE
    started = NODE_LINE.search(text) is not None
    log.warning("job %s: this node's torchrun exited with code %s:\n%s", rdzv.job_id, code,
                tail(text))
    if started:  # its ranks were in the job: the others would wait for them in vain
        with session_scope() as s:
            if jobs.holds(s, rdzv.job_id, rdzv.holder):
                jobs.mark_failed(s, rdzv.job_id, f"the node on {advertised_host()} failed: "
                                 f"{failure(code, text)}")
    return JobStatus.FAILED
