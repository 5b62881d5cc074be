"""The reward server: loads a set of rewards once and scores images over HTTP.

    python -m trainer.rewards.serve --rewards hpsv2,pickscore,imagereward --device cuda \\
        --host 0.0.0.0 --port 8100

A job whose config names `reward_server_url` (train, and the studio's rollout and evaluate
jobs) sends its images here instead of loading reward models itself (trainer/rewards/remote.py
is the client), so several processes share one set of models on one GPU, and models whose
packages conflict with the trainer's run in their own environment.

    GET  /health  {"status": "ok", "rewards": [...], "device": ..., "max_batch", "max_wait_ms",
                   and counters: requests, images, batches, cancelled, largest_batch_requests}
    POST /score   {"rewards": [names], "prompts": [N strings], "images": base64 of the .npy
                   bytes of an (N, H, W, 3) uint8 array} -> {"scores": {name: [N floats]}}
    POST /score_npy  the same without base64 or JSON around the images (what the job's client
                   sends; several times cheaper at 512 px): one line of JSON {"rewards",
                   "prompts"}, a newline, then the .npy bytes -> the same answer

A wrong reward name (unknown, or not loaded by this server), malformed images or a prompt
count that does not match is a 422 whose detail says which; one 422 lists every problem of a
request. A request of more than
`max_images` images (--max-images) is a 413 naming the limit: one scoring thread serves every
client, so one huge request would hold all the others back (the job's client splits its
images into requests of at most the limit /health reports).

Batching across requests: every request goes on one queue; one scoring thread takes the
first waiting request, then gathers more until it holds `max_batch` images or `max_wait_ms`
has passed, and scores each reward once over all gathered images of one size (in chunks of
at most `max_batch`) before splitting the scores back. One thread owns the models, so one copy
of each lives on the device. A request whose client disconnects while it waits is dropped
before it is scored; one that is being scored stops at the next chunk of `max_batch` images
(unless a request batched with it still waits for that reward) and is counted as cancelled.
Neither touches the other requests.

No authentication: run it on a private network (the compose file publishes no port).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import logging
import math
import queue
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import Body, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, ValidationError

from trainer.cli import AllErrorsParser, available_device, device_name, positive_int
from trainer.rewards import get_reward, reward_names, shapes_only_rewards
from trainer.rewards.registry import shapes_image_problem
from trainer.rewards.remote import LOCAL_REWARDS, decode_images, decode_score_request
from trainer.strict_json import loads_strict

log = logging.getLogger(__name__)

DEFAULT_PORT = 8100
DEFAULT_MAX_BATCH = 64
DEFAULT_MAX_WAIT_MS = 20.0
DEFAULT_MAX_REQUEST_MB = 1024
# most images one request may hold: ~1.5 s of scoring on an H100 for the usual models
DEFAULT_MAX_IMAGES = 1024
# how often a waiting request looks whether its client is still there
DISCONNECT_POLL_S = 0.1


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key is an error, not ignored

    rewards: list[str]
    prompts: list[str]
    images: str  # base64 of an (N, H, W, 3) uint8 .npy (trainer.rewards.remote.encode_images)


class _StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads_strict(await self.body())
        return self._json


class _StrictJSONRoute(APIRoute):
    """A route whose JSON body is read by loads_strict (FastAPI turns its RepeatedKeyError,
    a JSONDecodeError, into a json_invalid 422 naming the key)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(_StrictJSONRequest(request.scope, request.receive))

        return strict


@dataclass
class _Pending:
    rewards: list[str]
    images: np.ndarray  # (N, H, W, 3) uint8
    prompts: list[str]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    # set by the route when the client has gone: its scoring stops at the next chunk
    abandoned: threading.Event = field(default_factory=threading.Event)


class _Abandoned(Exception):
    """Every request of a scoring call has lost its client: the rest is not scored."""


class Batcher:
    """One scoring thread over a queue of requests (see the module docstring)."""

    def __init__(self, max_batch: int = DEFAULT_MAX_BATCH,
                 max_wait_ms: float = DEFAULT_MAX_WAIT_MS) -> None:
        # nan passes a `< 0` test and inf overflows queue.get's timeout in the scoring thread
        if max_batch < 1 or not (math.isfinite(max_wait_ms) and max_wait_ms >= 0):
            raise ValueError(f"max_batch must be >= 1 and max_wait_ms a finite number >= 0, "
                             f"got {max_batch}, {max_wait_ms}")
        self.max_batch, self.max_wait = max_batch, max_wait_ms / 1000.0
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.counters = {"requests": 0, "images": 0, "batches": 0, "cancelled": 0,
                         "largest_batch_requests": 0}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="reward-batcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)
            self._thread = None

    def submit(self, rewards: list[str], images: np.ndarray, prompts: list[str],
               abandoned: threading.Event | None = None) -> concurrent.futures.Future:
        """Queue a request; the future's result is {name: (N,) float64}. RuntimeError when the
        scoring thread is not running: nobody would ever answer the request. `abandoned`, set
        once the client has gone, stops its scoring at the next chunk."""
        if not self.alive():
            raise RuntimeError("the reward server's scoring thread is not running")
        pending = _Pending(rewards, images, prompts)
        if abandoned is not None:
            pending.abandoned = abandoned
        self._queue.put(pending)
        return pending.future

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters)

    # -- the scoring thread ---------------------------------------------------------------
    def _gather(self, batch: list[_Pending]) -> bool:
        """Append to `batch` (holding the first request) those arriving within max_wait, up
        to max_batch images; whether the stop sentinel came meanwhile. Appends in place so
        that the loop still holds every request taken off the queue if this raises."""
        count = sum(len(p.prompts) for p in batch)
        deadline = time.monotonic() + self.max_wait
        while count < self.max_batch:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                item = self._queue.get(timeout=remaining)
            except queue.Empty:
                break
            if item is None:
                return True
            batch.append(item)
            count += len(item.prompts)
        return False

    def _loop(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is None:
                break
            gathered = [first]
            try:
                stopping = self._gather(gathered)
                # a request cancelled while it waited (its client left) is dropped here; the
                # others are marked running and can no longer be cancelled
                live = [p for p in gathered if p.future.set_running_or_notify_cancel()]
                with self._lock:
                    self.counters["cancelled"] += len(gathered) - len(live)
                if live:
                    self._score(live)
            except Exception as exc:  # (a bug here must neither hang a client nor the thread)
                log.exception("scoring a batch of %d requests failed", len(gathered))
                for p in gathered:
                    if not p.future.done():
                        p.future.set_exception(exc)

    def _score(self, batch: list[_Pending]) -> None:
        results: dict[int, dict[str, np.ndarray]] = {id(p): {} for p in batch}
        failed: dict[int, BaseException] = {}
        # one call per (reward, image size) over every request that asked for it
        groups: dict[tuple[str, tuple[int, ...]], list[_Pending]] = {}
        for p in batch:
            for name in p.rewards:
                groups.setdefault((name, p.images.shape[1:]), []).append(p)
        for (name, _), members in groups.items():
            try:
                scores = self._score_one(name, [m.images for m in members],
                                         [t for m in members for t in m.prompts],
                                         lambda ms=members: all(m.abandoned.is_set() for m in ms))
            except _Abandoned as exc:  # nobody waits for these scores: the rest is skipped
                for m in members:
                    failed.setdefault(id(m), exc)
                continue
            except Exception as exc:
                if len(members) == 1:
                    log.warning("reward %s failed on a request: %s", name, exc)
                    failed.setdefault(id(members[0]), exc)
                    continue
                # one request's bad input (a prompt the reward cannot read) must not fail the
                # others batched with it: score them one by one, failing only those that fail
                log.warning("reward %s failed on a batch of %d requests (%s); scoring them "
                            "one by one", name, len(members), exc)
                for m in members:
                    try:
                        results[id(m)][name] = self._score_one(name, [m.images], m.prompts)
                    except Exception as alone:  # (handed to its request)
                        failed.setdefault(id(m), alone)
                continue
            start = 0
            for m in members:
                results[id(m)][name] = scores[start:start + len(m.prompts)]
                start += len(m.prompts)
        for p in batch:
            if id(p) in failed:
                p.future.set_exception(failed[id(p)])
            else:
                p.future.set_result(results[id(p)])
        with self._lock:
            c = self.counters
            c["cancelled"] += sum(isinstance(failed.get(id(p)), _Abandoned) for p in batch)
            c["batches"] += 1
            c["requests"] += len(batch)
            c["images"] += sum(len(p.prompts) for p in batch)
            c["largest_batch_requests"] = max(c["largest_batch_requests"], len(batch))

    def _score_one(self, name: str, images: list[np.ndarray], prompts: list[str],
                   abandoned: Callable[[], bool] = lambda: False) -> np.ndarray:
        stacked = np.concatenate(images) if len(images) > 1 else images[0]  # (N, H, W, 3)
        fn = get_reward(name)
        parts = []
        for start in range(0, len(prompts), self.max_batch):
            if abandoned():
                raise _Abandoned(f"reward {name!r}: the client left; stopped after {start} of "
                                 f"{len(prompts)} images")
            rows = slice(start, start + self.max_batch)
            parts.append(np.asarray(fn(stacked[rows], prompts[rows]), dtype=np.float64))
        scores = np.concatenate(parts)
        if scores.shape != (len(prompts),):
            raise ValueError(f"reward {name!r} returned shape {scores.shape}, expected "
                             f"({len(prompts)},)")
        return scores


def reward_names_problems(names: Iterable[str], paths: dict[str, str] | None = None
                          ) -> list[str]:
    """Why the rewards `names` (with weights directories `paths`) cannot be served, from the
    names alone (nothing loads): the names that are no servable reward, in one line, the
    paths of rewards not served (a typo in one of the lists) in another, and the paths of
    served rewards that read no weights in a third. reward_problems adds the weights."""
    names = list(dict.fromkeys(names))
    if not names:
        return ["name at least one reward to serve"]
    known = reward_names()
    problems = []
    wrong = [f"{n!r} is the training job's own model from votes; it is scored in the job"
             if n in LOCAL_REWARDS else f"unknown reward {n!r}"
             for n in names if n not in known or n in LOCAL_REWARDS]
    if wrong:
        problems.append(f"{'; '.join(wrong)}; a server serves: "
                        f"{[n for n in known if n not in LOCAL_REWARDS]}")
    if stray := [n for n in (paths or {}) if n not in names]:
        problems.append(f"--reward-model-paths names {stray}, which --rewards does not "
                        f"serve ({', '.join(names)})")
    from trainer.rewards.models import MODEL_REWARDS

    # a served reward that reads no weights: configure_reward_models refused it only once
    # the names were right, and by the config field's name rather than the flag typed
    if weightless := [n for n in (paths or {}) if n in names and n in known
                      and n not in MODEL_REWARDS and n not in LOCAL_REWARDS]:
        problems.append(f"--reward-model-paths names {weightless}, which read no weights; "
                        f"those that do: {sorted(MODEL_REWARDS)}")
    return problems


def reward_problems(names: Iterable[str], paths: dict[str, str] | None = None) -> list[str]:
    """Every reason the rewards `names` (weights directories `paths`) cannot be served, one
    line each, before anything loads: reward_names_problems, then one line per servable
    model-backed reward whose weights directory is missing, incomplete or damaged (or whose
    package is missing). The weights were checked only once every name was right, so a
    start said one and the next start the other."""
    from trainer.rewards.models import MODEL_REWARDS, weights_problem

    names = list(dict.fromkeys(names))
    problems = reward_names_problems(names, paths)
    known = reward_names()
    for name in names:
        if name in known and name in MODEL_REWARDS and name not in LOCAL_REWARDS and (
                problem := weights_problem(name, paths or {},
                                           paths_setting="--reward-model-paths {name}=...")):
            problems.append(problem)
    return problems


def load_rewards(names: Iterable[str], paths: dict[str, str] | None = None,
                 device: str = "auto") -> list[str]:
    """Check `names` and load each model-backed one now (weights from REWARD_MODELS_DIR or
    `paths`, on `device`), so that a missing file fails the server's start and the first
    request waits for no loading. Returns the names, deduplicated."""
    import torch

    from trainer.rewards.models import (
        MODEL_REWARDS,
        check_reward_models,
        configure_reward_models,
        load_reward_models,
    )

    names = list(dict.fromkeys(names))
    if problems := reward_names_problems(names, paths):
        raise ValueError(problems[0])
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    # messages name the flag the user typed, not the config field a job's path comes from
    configure_reward_models(paths or {}, device, "--reward-model-paths {name}=...")
    check_reward_models(names)
    # loads and caches each model; one that does not load is a ValueError naming it (the
    # command line's one-line refusal)
    load_reward_models(names)
    for name in names:
        if name in MODEL_REWARDS:
            log.info("loaded reward %s on %s", name, device)
    return names


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is a 413 naming the limit, by its
    Content-Length before anything is read, else (chunked) once the bytes read pass it: the
    server holds a whole body in memory to decode it."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def _refuse(self, send: Any) -> None:
        message = (f"the request body is over the server's limit of {self.max_bytes:,} bytes "
                   "(--max-request-mb): send fewer images per request")
        body = json.dumps({"detail": message, "field": "body",
                           "errors": [{"field": "body", "message": message}]}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope.get("headers", []) if k == b"content-length"), None)
        if length is not None:
            if length.isdigit() and int(length) > self.max_bytes:
                await self._refuse(send)
                return
            await self.app(scope, receive, send)  # the server reads no more than it says
            return
        # chunked: read here, up to the limit, and hand the app the body read
        chunks, received = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            received += len(chunks[-1])
            if received > self.max_bytes:
                await self._refuse(send)
                return
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _shapes_prompts_problem(prompts: list[str]) -> str | None:
    """Which prompts (the first three, by index) are not the shapes world's, or None (the
    world's own rule, not_shapes_prompts)."""
    from trainer.shapes.world import not_shapes_prompts

    refused = set(not_shapes_prompts(prompts))
    bad = [f"prompt {i} {prompt[:80]!r}" for i, prompt in enumerate(prompts) if prompt in refused]
    if not bad:
        return None
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    return (f"{', '.join(bad[:3])}{more} are not ('<one..four> <red|green|blue|yellow> "
            "<circle|square|triangle>')")


class ScoreError(Exception):
    """A request the server answers with `status`, naming the `field` at fault."""

    def __init__(self, status: int, field: str, message: str) -> None:
        super().__init__(message)
        self.status, self.field, self.message = status, field, message


def _problem_response(status: int, problems: list[dict[str, str]],
                      headers: dict[str, str] | None = None) -> JSONResponse:
    """{detail, field, errors} for `problems` (field and message each)."""
    detail = "; ".join(p["message"] if p["field"] == "body" else f"{p['field']}: {p['message']}"
                       for p in problems)
    return JSONResponse({"detail": detail, "field": problems[0]["field"], "errors": problems},
                        status_code=status, headers=headers)


def _validation_problems(errors: Iterable[Any]) -> list[dict[str, str]]:
    """pydantic's (or FastAPI's) errors as {field, message}: a key by its path, an unknown
    key as such, malformed JSON as the body's, never the rejected input."""
    problems = []
    for err in errors:
        if err.get("type") == "json_invalid":  # loc is ("body", character offset)
            where = err.get("loc", ())[1:]
            reason = (err.get("ctx") or {}).get("error", "invalid JSON")
            at = f" at character {where[0]}" if where else ""
            problems.append({"field": "body", "message": f"malformed JSON ({reason}{at})"})
            continue
        loc = [str(part) for part in err.get("loc", ()) if part != "body"]
        message = ("unknown field" if err.get("type") == "extra_forbidden"
                   else str(err.get("msg", "invalid value")))
        problems.append({"field": ".".join(loc) or "body", "message": message})
    return problems


def create_app(rewards: Iterable[str], *, device: str = "auto",
               reward_model_paths: dict[str, str] | None = None,
               max_batch: int = DEFAULT_MAX_BATCH,
               max_wait_ms: float = DEFAULT_MAX_WAIT_MS,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_MB * 2**20,
               max_images: int = DEFAULT_MAX_IMAGES) -> FastAPI:
    """The server's app with `rewards` loaded (see load_rewards); the batcher runs while the
    app does (its lifespan); request bodies over `max_request_bytes`, and requests of more
    than `max_images` images, are 413s."""
    if max_images < 1:
        raise ValueError(f"max_images must be >= 1, got {max_images}")
    import torch

    resolved_device = device if device != "auto" else (
        "cuda" if torch.cuda.is_available() else "cpu")
    served = load_rewards(rewards, reward_model_paths, resolved_device)
    batcher = Batcher(max_batch, max_wait_ms)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        batcher.start()
        try:
            yield
        finally:
            batcher.stop()

    app = FastAPI(title="Neighbor GRPO reward server", lifespan=lifespan)
    app.router.route_class = _StrictJSONRoute  # a key given twice is a 422, not the last value
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)

    # one shape for every error, the route's own checks' and the body schema's alike (the
    # studio's API answers so): `detail` a sentence, `field` the first problem's, `errors`
    # every problem; never the rejected input (it may be megabytes of base64)
    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != "application/json":
            # FastAPI then reads the body as text ("Input should be a valid dictionary"): the
            # fix is the header, so say that
            return _problem_response(422, [{"field": "body", "message": (
                "send the body as JSON (Content-Type: application/json), not "
                f"{content_type or 'without a Content-Type'}")}])
        problems = _validation_problems(exc.errors())
        return _problem_response(422, problems or [{"field": "body", "message": "invalid"}])

    @app.exception_handler(ScoreError)
    async def score_error(_request: Request, exc: ScoreError) -> JSONResponse:
        return _problem_response(exc.status, [{"field": exc.field, "message": exc.message}])
    app.state.batcher = batcher
    app.state.rewards = served

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok" if batcher.alive() else "stopped", "rewards": served,
                "device": resolved_device,
                "max_batch": batcher.max_batch, "max_wait_ms": batcher.max_wait * 1000.0,
                "max_images": max_images, **batcher.stats()}

    def within_image_cap(images: np.ndarray) -> np.ndarray:
        # one scoring thread serves every client: a request of 20,000 images held all the
        # others back for half a minute. Its client splits (the limit is in /health)
        if len(images) > max_images:
            raise ScoreError(413, "images", f"{len(images)} images in one request; this "
                             f"server takes at most {max_images} (--max-images): send them in "
                             "several requests")
        return images

    # the body is read as a plain object and checked here, not by FastAPI against
    # ScoreRequest: its first failing key was the whole answer ("extra" hid an unknown reward
    # and a prompt count that did not match). Every part that is well-formed is checked as
    # well, so one 422 lists every problem.
    @app.post("/score", openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": ScoreRequest.model_json_schema()}}}})
    async def score(request: Request, body: dict[str, Any] = Body(...)) -> Any:
        problems = []
        try:
            ScoreRequest.model_validate(body)
        except ValidationError as exc:
            problems += _validation_problems(exc.errors())
        rewards, prompts = (value if isinstance(value := body.get(key), list)
                            and all(isinstance(v, str) for v in value) else None
                            for key in ("rewards", "prompts"))
        images = None
        if isinstance(body.get("images"), str):
            try:
                images = decode_images(body["images"])
            except ValueError as exc:
                problems.append({"field": "images", "message": str(exc)})
        problems += request_problems(rewards, prompts, images)
        if problems:
            return _problem_response(422, problems)
        return await scored(rewards, prompts, within_image_cap(images), request)

    @app.post("/score_npy")
    async def score_npy(request: Request) -> Any:
        try:
            rewards, prompts, images = decode_score_request(await request.body())
        except ValueError as exc:
            raise ScoreError(422, "body", str(exc)) from None
        if problems := request_problems(rewards, prompts, images):
            return _problem_response(422, problems)
        return await scored(rewards, prompts, within_image_cap(images), request)

    def request_problems(rewards: list[str] | None, prompts: list[str] | None,
                         images: np.ndarray | None) -> list[dict[str, str]]:
        """What is wrong with a request's rewards, and its prompts against the images and
        the rewards, every problem at once; None: a part that is malformed itself (said
        already), so the checks that need it are left out."""
        problems = []
        if rewards is not None and not rewards:
            problems.append({"field": "rewards", "message": "name at least one reward"})
        not_served = [n for n in rewards or [] if n not in served]
        if not_served:
            known = set(reward_names())
            parts = []
            if unknown := [n for n in not_served if n not in known | set(LOCAL_REWARDS)]:
                parts.append(f"unknown reward(s) {unknown}")
            if local := [n for n in not_served if n in LOCAL_REWARDS]:
                parts.append(f"{local}: the training job's own model from votes, scored in "
                             "the job, never by a server")
            if unloaded := [n for n in not_served if n in known]:
                parts.append(f"reward(s) {unloaded} not loaded by this server")
            what = "; ".join(parts)
            problems.append({"field": "rewards", "message": f"{what}; this server serves "
                                                            f"{served}"})
        if images is not None and prompts is not None and len(images) != len(prompts):
            problems.append({"field": "prompts", "message": f"{len(images)} images but "
                                                            f"{len(prompts)} prompts"})
        if rewards and images is not None and (problem := shapes_image_problem(rewards, images)):
            problems.append({"field": "images", "message": problem})
        if rewards and prompts is not None and (shapes_only := shapes_only_rewards(rewards)) \
                and (problem := _shapes_prompts_problem(prompts)):
            # the request's fault, said before it is queued (it was the batch's 500)
            problems.append({"field": "prompts", "message": f"{shapes_only} score shapes "
                                                            f"prompts only: {problem}"})
        return problems

    async def scored(rewards: list[str], prompts: list[str], images: np.ndarray,
                     request: Request) -> Any:
        """Both routes' work once the request is checked: queue, wait, answer."""
        if not len(images):
            return {"scores": {name: [] for name in rewards}}
        abandoned = threading.Event()
        try:
            future = asyncio.wrap_future(batcher.submit(list(dict.fromkeys(rewards)),
                                                        images, prompts, abandoned))
        except RuntimeError as exc:  # the scoring thread is gone: /health says "stopped"
            raise ScoreError(503, "server", str(exc)) from None
        while True:
            done, _ = await asyncio.wait({future}, timeout=DISCONNECT_POLL_S)
            if done:
                break
            if await request.is_disconnected():
                # cancels the queued request (the batcher then skips it), or stops the one
                # being scored at its next chunk; nobody reads this
                abandoned.set()
                future.cancel()
                return JSONResponse({"detail": "client disconnected"}, status_code=499)
        try:
            scores = future.result()
        except Exception as exc:  # (a reward failing is the server's 500)
            raise ScoreError(500, "server", f"scoring failed: {type(exc).__name__}: {exc}") from None
        # JSON has no NaN: a non-finite score travels as null
        return {"scores": {name: [float(v) if np.isfinite(v) else None for v in scores[name]]
                           for name in rewards}}

    return app


class ServerThread:
    """uvicorn serving `app` on a free port of 127.0.0.1, in a daemon thread of this process
    (tests and benchmarks: a reward registered in the process is then served). `url` is known
    before start: the port is bound first and handed to uvicorn, so nobody can take it
    between. `with ServerThread(app) as server:` returns once the app has started (its
    lifespan ran: the batcher is up) and stops it on exit."""

    def __init__(self, app: FastAPI, start_timeout: float = 20.0,
                 stop_timeout: float = 20.0) -> None:
        import socket

        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.start_timeout, self.stop_timeout = start_timeout, stop_timeout
        # warning level: no access-log line per request
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="reward-server", daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                self.__exit__()
                raise RuntimeError(f"the reward server at {self.url} did not start within "
                                   f"{self.start_timeout:g} s")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=self.stop_timeout)
        self.sock.close()
        if self.thread.is_alive():
            log.warning("the reward server at %s did not stop within %g s", self.url,
                        self.stop_timeout)


def _parse_paths(text: str) -> dict[str, str]:
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise argparse.ArgumentTypeError(f"expected name=path, got {item!r}")
        out[name.strip()] = path.strip()
    return out


def _wait_ms(text: str) -> float:
    """--max-wait-ms: a finite number >= 0 (nan passes a `< 0` test; inf overflows the
    timeout of the scoring thread's queue.get and kills it, so every request would hang)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _port(text: str) -> int:
    """--port: 0-65535 (a larger number would be taken modulo 65536 by the socket layer, and
    the server would listen on a port nobody asked for)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0-65535, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """`python -m trainer.rewards.serve`'s options (docker-compose.yml's reward-server runs it)."""
    parser = AllErrorsParser(
        prog="python -m trainer.rewards.serve",
        description="Serve rewards over HTTP to the jobs that name this server's URL "
                    "(their reward_server_url: train, rollout, evaluate).")
    parser.add_argument("--rewards", required=True,
                        help="comma-separated reward names to load and serve, e.g. "
                             "hpsv2,pickscore,imagereward")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (0.0.0.0 for other hosts; default %(default)s)")
    parser.add_argument("--port", type=_port, default=DEFAULT_PORT,
                        help="TCP port, 0-65535 (0: any free one; default %(default)s)")
    parser.add_argument("--max-request-mb", type=positive_int, default=DEFAULT_MAX_REQUEST_MB,
                        help="largest request body taken, in MiB: a bigger one is a 413 before "
                             "it is read (default %(default)s; 64 images of 1024x1024 are "
                             "192 MiB as .npy)")
    parser.add_argument("--max-images", type=positive_int, default=DEFAULT_MAX_IMAGES,
                        help="most images one request may hold: more is a 413 naming the "
                             "limit, so that one request cannot hold every other client back "
                             "(the jobs split theirs to fit; default %(default)s)")
    parser.add_argument("--device", type=device_name, default="auto",
                        help="torch device of the reward models: auto, cpu, cuda, cuda:1 ... "
                             "(default %(default)s)")
    parser.add_argument("--max-batch", type=positive_int, default=DEFAULT_MAX_BATCH,
                        help="most images gathered across requests into one scoring call "
                             "(default %(default)s)")
    parser.add_argument("--max-wait-ms", type=_wait_ms, default=DEFAULT_MAX_WAIT_MS,
                        help="how long the first waiting request waits for others to join its "
                             "batch (default %(default)s)")
    parser.add_argument("--reward-model-paths", type=_parse_paths, default={},
                        help="name=path,... weights directories for rewards not under "
                             "REWARD_MODELS_DIR/<name>/")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"],
                        help="logging level of the server and uvicorn (default %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)  # every malformed option at once (AllErrorsParser)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from trainer.config import ConfigError

    # what the options ask that this machine or the reward list cannot give, every problem
    # at once (each was said only once the one before it was fixed), before any reward model
    # loads. The port first: one taken by another process was uvicorn's error and exit code
    # 3, and only after every reward model had loaded (minutes for HPSv2's ViT-H)
    problems, listening = [], None
    try:
        listening = listening_socket(args.host, args.port)
    except OSError as exc:
        problems.append(f"cannot listen on {args.host}:{args.port} (--host/--port): "
                        f"{exc.strerror or exc}; is another server on it? Choose another "
                        "--port, or 0 for any free one")
    try:
        # a device this machine lacks, said as the trainer's CLI says it
        available_device(args.device, "--device")
    except ConfigError as exc:
        problems.append(f"{exc.field}: {exc.message}")
    names = [n.strip() for n in args.rewards.split(",") if n.strip()]
    problems += reward_problems(names, args.reward_model_paths)
    if problems:
        if listening is not None:
            listening.close()
        parser.exit(2, "".join(f"reward server: {problem}\n" for problem in problems))
    try:
        app = create_app(names,
                         device=args.device, reward_model_paths=args.reward_model_paths,
                         max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
                         max_request_bytes=args.max_request_mb * 2**20,
                         max_images=args.max_images)
    except (ValueError, FileNotFoundError) as exc:  # RewardWeightsMissing is one
        listening.close()
        parser.exit(2, f"reward server: {exc}\n")
    uvicorn.Server(uvicorn.Config(app, log_level=args.log_level)).run(sockets=[listening])


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) and listening, as uvicorn would bind it (address
    reuse on, so a restart does not wait out TIME_WAIT); OSError when the port is taken or
    the address is not this machine's."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


if __name__ == "__main__":
    main()
