"""The distributed path on two CPU processes (torchrun, gloo): DDP averages the gradients of
the two half batches into exactly the full-batch gradient, the ranks keep identical weights,
and a run gives the same metrics as one process with the same total batch (the same prompts
every iteration, the same work counts, reward means within tolerance: each rank draws its
own noises, so per-iteration values differ by sampling noise). The one-process reference runs
the same code (trainer/distributed.py) on a world of one. Then a real train job with
TRAIN_NPROC=2 through the worker, rank 0 recording."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from reward_server_helpers import ServerThread, held_reward
from worker_helpers import (
    checkpoint_iterations,
    create_train_job,
    job_row,
    metric_iterations,
    resume_with_iterations,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("ddp_check.py")
ITERATIONS = 6


def _run(cmd: list[str]) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def test_two_gloo_processes_match_one_process_with_the_same_total_batch():
    # the reference is the same code on a world of one process: the shared RNG then advances
    # identically, so both runs see the same prompts in every iteration
    single = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", "1", str(SCRIPT), str(ITERATIONS)])
    ddp = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", "2", str(SCRIPT), str(ITERATIONS)])
    one = [r for r in single if "metrics" in r]
    two = [r for r in ddp if "metrics" in r]
    check = next(r for r in ddp if "grad_max_diff" in r)
    assert len(one) == len(two) == ITERATIONS
    # DDP: the reduced half-batch gradients are the full-batch gradient
    assert check["grad_max_diff"] < 1e-5
    # every rank holds the same weights after training
    assert check["checksums"][0] == pytest.approx(check["checksums"][1], abs=1e-9)
    for a, b in zip(one, two, strict=True):
        # the same global prompts: rank 0 holds its half (every other one), and on a
        # sampling iteration (sample_every 3) every rank's groups, in the one-process order,
        # for the stored rollout groups and sample grids to show the whole iteration
        sampled = b["metrics"]["iteration"] % 3 == 0
        assert b["prompts"] == (a["prompts"] if sampled else a["prompts"][0::2])
        assert b["groups"] == len(b["prompts"]) and set(b["rewards"].values()) == {b["groups"]}
        if sampled:  # rank r's i-th group at i * 2 + r
            assert b["noise_seeds"] == [s for pair in zip(*b["noise_seeds_by_rank"],
                                                          strict=True) for s in pair]
        for key in ("forward_passes", "backward_passes", "optimizer_steps", "iteration"):
            assert b["metrics"][key] == a["metrics"][key], key
        assert b["metrics"]["world_size"] == 2
        # each rank draws its own base noises: two prompts per rank, no noise on both ranks
        mine, theirs = b["noise_seeds_by_rank"]
        assert len(mine) == len(theirs) == 2 and not set(mine) & set(theirs)
    every_seed = [s for r in two for rank_seeds in r["noise_seeds_by_rank"] for s in rank_seeds]
    assert len(set(every_seed)) == len(every_seed)  # nor twice over the whole run
    reward_one = np.mean([r["metrics"]["reward_mean"] for r in one])
    reward_two = np.mean([r["metrics"]["reward_mean"] for r in two])
    assert abs(reward_one - reward_two) < 0.1, (reward_one, reward_two)
    for key in ("abs_log_ratio", "clip_fraction"):
        assert np.mean([r["metrics"][key] for r in two]) < 0.05
    assert abs(np.mean([r["metrics"]["advantage_abs_mean"] for r in one])
               - np.mean([r["metrics"]["advantage_abs_mean"] for r in two])) < 0.25


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_a_train_job_with_train_nproc_2_runs_under_torchrun(stack, parallelism):
    stack.start_worker(extra_env={"TRAIN_NPROC": "2", "OMP_NUM_THREADS": "1"})
    job_id = create_train_job(iterations=4, prompts_per_iteration=4, sample_every=2,
                              checkpoint_every=2, parallelism=parallelism)
    stack.send(job_id)
    job = wait_for(lambda: (j := job_row(job_id)).status in ("succeeded", "failed") and j, 180,
                   "the distributed job", stack)
    assert job.status == "succeeded", job.error
    assert metric_iterations(job_id) == [1, 2, 3, 4]
    assert checkpoint_iterations(job_id) == [2, 4]
    assert job.metrics["world_size"] == 2
    # the checkpoints hold the whole model (FSDP: gathered from both ranks) and load as one
    from app.db import session_scope
    from app.services import checkpoints, rollouts, storage
    from trainer.models.shapes_dit import ShapesDiT

    with session_scope() as s:
        rows, _ = checkpoints.list_checkpoints(s, job_id=job_id)
        paths = [storage.resolve(c.path) for c in sorted(rows, key=lambda c: c.iteration)]
        groups, _ = rollouts.list_groups(s, job_id=job_id, limit=100)
        stored = sorted((g.iteration, len(g.samples)) for g in groups)
    # every prompt's group of a sampling iteration, both ranks' (rank 0's alone: 2 of 4)
    assert stored == [(2, 4)] * 4 + [(4, 4)] * 4, stored
    models = [ShapesDiT.load(p) for p in paths]
    assert len(models) == 2
    first, last = (dict(m.state_dict()) for m in models)
    assert first.keys() == last.keys()
    assert any(not torch.equal(first[k], last[k]) for k in first)  # trained between them


@pytest.mark.slow
def test_a_sharded_job_cancels_at_a_collective_checkpoint_and_resumes_on_every_rank(stack):
    """parallelism 'fsdp': a cancel waits for the next checkpoint that every rank writes
    together (at most one iteration later), and the resumed job loads each rank's shard."""
    from app.db import session_scope
    from app.services import jobs

    stack.start_worker(extra_env={"TRAIN_NPROC": "2", "OMP_NUM_THREADS": "1"})
    job_id = create_train_job(iterations=300, prompts_per_iteration=4, sample_every=1000,
                              checkpoint_every=1000, parallelism="fsdp")
    stack.send(job_id)
    wait_for(lambda: job_row(job_id).iteration >= 3, 120, "three iterations", stack)
    with session_scope() as s:
        seen = jobs.request_cancel(s, job_id).iteration
    job = wait_for(lambda: (j := job_row(job_id)).status in ("cancelled", "failed") and j, 60,
                   "the cancel", stack)
    assert job.status == "cancelled", job.error
    stopped = job.iteration
    assert seen <= stopped <= seen + 3 and stopped < 300
    assert checkpoint_iterations(job_id) == [stopped]
    assert metric_iterations(job_id) == list(range(1, stopped + 1))
    resume_with_iterations(job_id, stopped + 2)  # shortened, resumed as the API does
    stack.send(job_id)
    job = wait_for(lambda: (j := job_row(job_id)).status in ("succeeded", "failed") and j, 120,
                   "the resumed job", stack)
    assert job.status == "succeeded", job.error
    assert metric_iterations(job_id) == list(range(1, stopped + 3))
    assert checkpoint_iterations(job_id) == [stopped, stopped + 2]


def _preference_v1_then_new_votes(fit_votes: int = 6, late_votes: int = 2) -> None:
    """Preference model v1 (a tiny net, 2 epochs) fitted on `fit_votes` votes within one stored
    group, then `late_votes` more: an online refit then has something new and records v2."""
    from sqlalchemy import select

    from app.db import session_scope
    from app.models import Sample, User
    from app.services import auth, rollouts, votes
    from trainer.rewards.preference import FitConfig
    from trainer.shapes.world import all_prompts, render
    from worker.job_helpers import png_bytes
    from worker.preference import fit_and_record

    rng = np.random.default_rng(0)
    prompt = all_prompts()[0]
    samples = [{"png": png_bytes(render(prompt, rng)[0]), "member_index": i, "rewards": {},
                "advantage": None} for i in range(6)]
    with session_scope() as s:
        group = rollouts.record_rollout_group(s, job_id=None, iteration=0, solver="euler",
                                              steps=4, sigma=0.0, seed=0, samples=samples,
                                              prompt_text=prompt, purpose="rollout")
        annotator = auth.create_user(s, "ann", "annotator")[0].id
    with session_scope() as s:
        ids = list(s.scalars(select(Sample.id).where(Sample.group_id == group)
                             .order_by(Sample.member_index)))
    pairs = [(a, b) for i, a in enumerate(ids) for b in ids[i + 1:]]

    def vote(k: int) -> None:
        with session_scope() as s:
            votes.record_vote(s, s.get(User, annotator), client_vote_id=f"v{k}",
                              sample_a_id=pairs[k][0], sample_b_id=pairs[k][1],
                              outcome="ab"[k % 2])

    for k in range(fit_votes):
        vote(k)
    _model, row = fit_and_record(FitConfig(width=8, epochs=2, ensemble=2), score_samples=False)
    assert row["version"] == 1
    for k in range(fit_votes, fit_votes + late_votes):
        vote(k)


def test_every_rank_blends_rank_0s_preference_model_and_follows_its_refit(stack):
    # ranks != 0 used to build a bare Trainer: the reward "preference" was unknown there
    from datetime import timedelta

    from app.db import session_scope
    from app.services import jobs

    _preference_v1_then_new_votes()
    # the refit at iteration 2 (votes arrived since v1) records v2; iterations 3, 4 use it
    job_id = create_train_job(iterations=4, prompts_per_iteration=2, sample_every=4,
                              checkpoint_every=4, preference_refit_every=2,
                              reward_weights={"count": 1.0, "preference": 1.0})
    with session_scope() as s:  # what the train task does before launching torchrun
        assert jobs.claim(s, job_id, "w-dist", timedelta(minutes=5)) is not None
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "worker.distributed_train", str(job_id), "w-dist"],
        cwd=ROOT, env=stack.env, capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    job = job_row(job_id)
    assert job.status == "succeeded", (job.error, output)
    with session_scope() as s:
        history = {m.iteration: dict(m.metrics) for m in jobs.metric_history(s, job_id)}
    assert sorted(history) == [1, 2, 3, 4]
    versions = {it: m["preference_model_version"] for it, m in history.items()}
    assert versions == {1: 1, 2: 1, 3: 2, 4: 2}, versions
    assert history[2]["preference_refit"] == 1
    # averaged over both ranks: each scored its shard with the preference model
    assert all(m["reward/preference"] is not None for m in history.values()), history
    assert all(m["world_size"] == 2 for m in history.values())
    # both ranks loaded v1 at the start; rank 1 switched to rank 0's refit before iteration 3
    assert output.count("blending preference model") == 3, output
    assert output.count("v1.safetensors (v1)") == 2, output
    assert "rank 1 follows rank 0 to preference model v2" in output, output
    # the same model on both ranks after the refit (rank 0's in memory, rank 1's from its
    # file): the same weights and the same rewards on a probe batch, and not v1's
    lines = re.findall(r"rank (\d) preference model v(\d): weights (\w+), probe scores "
                       r"([-\d. ]+\d)", output)
    by_version = {}
    for rank, version, weights, scores in lines:
        by_version.setdefault(version, {})[rank] = (weights, scores)
    assert set(by_version) == {"1", "2"}, lines
    for version, ranks in by_version.items():
        assert set(ranks) == {"0", "1"} and ranks["0"] == ranks["1"], (version, ranks)
    assert by_version["1"]["0"] != by_version["2"]["0"]


def test_the_other_ranks_resolve_latest_to_the_version_rank_0_chose(stack):
    # a fit may record a newer model between rank 0's resolution and the others' (v2 here)
    from app.db import session_scope
    from app.services import preference as pref_svc
    from app.services import storage
    from trainer.config import TrainConfig
    from trainer.rewards.preference import FitConfig, PreferenceModel
    from worker.preference import resolve_preference

    for version, last_vote in ((1, 6), (2, 8)):
        path = storage.storage_root() / pref_svc.model_path(version)
        path.parent.mkdir(parents=True, exist_ok=True)
        PreferenceModel(FitConfig(width=8, ensemble=2)).save(path)
        with session_scope() as s:
            pref_svc.record_model(s, version=version, path=pref_svc.model_path(version),
                                  report={}, last_vote_id=last_vote)
    config = TrainConfig.from_dict({"reward_weights": {"count": 1.0, "preference": 1.0},
                                    "preference_model": "latest", "device": "cpu"})
    newest, pinned = resolve_preference(config), resolve_preference(config, latest=1)
    assert newest[0].endswith("v2.safetensors") and newest[1:] == (2, 8)
    assert pinned[0].endswith("v1.safetensors") and pinned[1:] == (1, 6)


def test_a_failed_rank_gives_the_job_its_reason_not_torchruns_summary(stack):
    """A job on two processes whose reward server cannot be reached fails with the message a
    one-process job gives (the ranks say why on a line the worker reads), not with torchrun's
    "worker.distributed_train FAILED" summary."""
    stack.start_worker(extra_env={"TRAIN_NPROC": "2", "OMP_NUM_THREADS": "1"})
    job_id = create_train_job(iterations=1, prompts_per_iteration=2,
                              reward_server_url="http://127.0.0.1:1")
    stack.send(job_id)
    job = wait_for(lambda: (j := job_row(job_id)).status in ("succeeded", "failed") and j, 180,
                   "the distributed job", stack)
    assert job.status == "failed"
    assert job.error.startswith("reward server at http://127.0.0.1:1 cannot be reached"), \
        job.error
    assert "torchrun" not in job.error and "Traceback" not in job.error


@pytest.mark.slow
@pytest.mark.parametrize(("parallelism", "stop"),
                         [("ddp", "cancel"), ("fsdp", "cancel"), ("ddp", "shutdown")])
def test_a_stop_while_one_rank_waits_for_the_reward_server_stops_every_rank(stack, parallelism,
                                                                            stop):
    """Two ranks, iteration 2: rank A has its scores, rank B's request is held by the server.
    A cancel or a warm shutdown was seen only at the end of the iteration, so the job waited
    for B's answer or REWARD_SERVER_TIMEOUT (300 s by default, 60 here). Now B gives the wait
    up within a second or two, A (waiting for B before its update) gives the iteration up with
    it, and the job ends at iteration 1 with its checkpoint, as one process does (FSDP: the
    checkpoint saved by both ranks together): cancelled, or requeued by the shutdown."""
    from app.db import session_scope
    from app.services import jobs
    from trainer.rewards.serve import create_app

    per_rank = 2 * 4  # two prompts of the four, groups of 4 (the tiny preset)
    worker = stack.start_worker(extra_env={"TRAIN_NPROC": "2", "OMP_NUM_THREADS": "1",
                                           "REWARD_SERVER_TIMEOUT": "60"})
    # iteration 1's two requests and iteration 2's first are scored, its second is held;
    # one request a scoring call: the ranks' requests are not batched together
    with (held_reward(3 * per_rank, name="count") as (scored, holding, release),
          ServerThread(create_app(["count"], device="cpu", max_batch=per_rank)) as server):
        job_id = create_train_job(iterations=3, prompts_per_iteration=4,
                                  checkpoint_every=1000, parallelism=parallelism,
                                  reward_weights={"count": 1.0},
                                  reward_server_url=server.url)
        stack.send(job_id)
        assert holding.wait(180), "the held request never reached the server\n" + \
            stack.log_text()
        assert scored == [per_rank] * 3  # one rank has its scores, the other waits
        asked = time.monotonic()
        if stop == "cancel":
            with session_scope() as s:
                jobs.request_cancel(s, job_id)
            ended = ("cancelled", "failed", "succeeded")
        else:
            os.kill(worker.pid, signal.SIGTERM)  # the worker passes it on to the ranks
            ended = ("queued", "failed", "succeeded")
        job = wait_for(lambda: (j := job_row(job_id)).status in ended and j, 30, "the stop",
                       stack)
        took = time.monotonic() - asked
        # both ranks left together: torchrun ended cleanly, and the worker is free again or
        # gone as asked (a rank that went on to its update alone would hang in the gradient
        # all-reduce)
        if stop == "cancel":
            stack.wait_log(stack.logs[0], "succeeded in", worker, timeout=30)
        else:
            assert worker.wait(timeout=30) == 0
        release.set()
    assert took < 20, took  # the reward server's timeout is 60 s
    assert job.status == ("cancelled" if stop == "cancel" else "queued"), job.error
    if stop == "cancel":
        assert job.error is None
    else:
        assert "shut down at iteration 1" in job.error, job.error
    assert job.iteration == 1
    assert checkpoint_iterations(job_id) == [1] and metric_iterations(job_id) == [1]
    assert "Traceback" not in stack.logs[0].read_text(errors="replace"), stack.log_text()


def test_a_torchrun_failure_names_the_first_failed_ranks_error():
    """How the worker reads a failed torchrun's output: a self-explaining error alone (the
    first such rank's), else the first failed rank's error with its traceback, else
    torchrun's last lines."""
    from worker.lease import JobError
    from worker.torchrun import failure, rank_error_line

    def line(rank: int, exc: Exception, clean: bool) -> str:
        return f"[rank{rank}]: " + rank_error_line(rank, exc, clean=clean,
                                                    traceback_tail=f"File x, line {rank}")

    summary = "\n".join(f"torchrun summary line {i}" for i in range(30))
    # rank 1 failed first; rank 0 then failed in a collective with it: the cause is rank 1's,
    # whichever order torchrun printed them in
    first = line(1, ValueError("bad\nvalue"), False)
    time.sleep(0.01)
    text = "\n".join([line(0, RuntimeError("Connection closed by peer"), False), "noise",
                      first, summary])
    error = failure(1, text)
    assert isinstance(error, RuntimeError)
    assert str(error).startswith("rank 1 failed: ValueError: bad\nvalue\n\nFile x, line 1")
    text = "\n".join([line(0, ValueError("v"), False), line(1, RuntimeError("down"), True),
                      summary])
    error = failure(1, text)
    assert isinstance(error, JobError) and str(error) == "down"
    error = failure(-9, summary)
    assert isinstance(error, RuntimeError) and "torchrun exited with code -9" in str(error)
    assert "torchrun summary line 29" in str(error)


def test_a_job_whose_prompts_do_not_split_over_train_nproc_runs_on_fewer_processes(stack):
    """Submission cannot know a worker's TRAIN_NPROC: a job with 3 prompts an iteration on a
    worker of 2 processes runs on one (said in the worker's log) instead of failing."""
    stack.start_worker(extra_env={"TRAIN_NPROC": "2", "OMP_NUM_THREADS": "1"})
    job_id = create_train_job(iterations=1, prompts_per_iteration=3)
    stack.send(job_id)
    job = wait_for(lambda: (j := job_row(job_id)).status in ("succeeded", "failed") and j, 180,
                   "the job", stack)
    assert job.status == "succeeded", job.error
    assert metric_iterations(job_id) == [1]
    assert "runs on 1 process(es) a node, not TRAIN_NPROC=2" in stack.logs[0].read_text(
        errors="replace")


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux's /proc), nearest first."""
    found, todo = [], [pid]
    while todo:
        for children in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            try:
                kids = [int(p) for p in children.read_text().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie (one re-parented to a PID 1 that does not reap stays listed)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux's /proc")
def test_kill9_of_the_worker_takes_its_torchrun_and_ranks_with_it(stack):
    """A worker killed with SIGKILL mid-job must not leave torchrun (re-parented to PID 1)
    and its ranks training on under its lease: the job would go on, even succeed, while the
    restarted worker takes another job onto the same cards."""
    worker = stack.start_worker(extra_env={"TRAIN_NPROC": "2", "OMP_NUM_THREADS": "1"})
    job_id = create_train_job(iterations=300, prompts_per_iteration=4, sample_every=1000,
                              checkpoint_every=2)
    stack.send(job_id)
    wait_for(lambda: job_row(job_id).iteration >= 2, 120, "two iterations", stack)
    tree = _descendants(worker.pid)
    assert len(tree) >= 3, tree  # torchrun and its two ranks
    os.kill(worker.pid, signal.SIGKILL)  # the worker alone, not its process group
    worker.wait()
    deadline = time.monotonic() + 45
    while any(_running(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in tree if _running(p)]
    for pid in left:  # not to leave them training after a failure
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, "torchrun or a rank outlived its worker"
    job = job_row(job_id)
    assert job.status != "succeeded" and job.iteration < 300


def test_rank_0_sees_the_worker_process_holding_its_lease_gone(tmp_path):
    """The second guard, where no death signal came: rank 0 reads the holder's pid from the
    lease (node:pid:nonce) and stops once that process is no longer its ancestor."""
    out = tmp_path / "out.txt"
    child = ("import os, sys, time\n"
             "from worker.distributed_train import HolderWatch\n"
             "watch = HolderWatch(sys.argv[1])\n"
             "print('ancestor', watch.pid is not None, watch.gone(), flush=True)\n"
             "deadline = time.monotonic() + 20\n"
             "while not watch.gone() and time.monotonic() < deadline:\n"
             "    time.sleep(0.1)\n"
             "print('gone', watch.gone(), flush=True)\n")
    parent = ("import os, subprocess, sys, time\n"
              "out = open(sys.argv[1], 'w')\n"
              f"child = subprocess.Popen([sys.executable, '-c', {child!r}, "
              "f'w0@host:{os.getpid()}:abcd1234'], stdout=out)\n"
              "while 'ancestor' not in open(sys.argv[1]).read():\n"
              "    time.sleep(0.05)\n"
              "os._exit(0)\n")  # the parent dies; its child lives on, re-parented
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", parent, str(out)], cwd=ROOT, env=env, timeout=60,
                   check=True)
    deadline = time.monotonic() + 30
    while "gone" not in out.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert out.read_text().splitlines() == ["ancestor True False", "gone True"]
    # a lease whose pid is not an ancestor (another host's holder) is never "gone"
    from worker.distributed_train import HolderWatch

    assert HolderWatch("w0@elsewhere:999999999:abcd1234").gone() is False
    assert HolderWatch("w0@elsewhere").gone() is False
