"""Scoring rewards through a reward server (`python -m trainer.rewards.serve`) instead of in
this process: many training processes share one set of reward models on one GPU, and reward
models whose packages conflict with the trainer's live in their own environment.

`reward_scorer(url)` is the one place that picks where rewards are computed: in process
(`compute_rewards`) when `url` is empty, else a `RewardClient`, which has the same signature
`(names, images, prompts) -> {name: (N,) float64}`; `prepare_scorer` makes the same choice at
a job's start and checks that the rewards can be scored there. The run-time reward
"preference" (the job's own model fitted to votes, registered in the trainer's process) is
always scored here; every other name goes to the server.

A caller may stop the wait for scores (`stop_requested`: a cancelled job): the request then
runs on a thread of its own while the caller asks every STOP_POLL_SECONDS, and True cuts its
connection (the server drops a request whose client left) and raises ScoringStopped, rather
than waiting for the answer or the timeout (minutes on a GPU server shared by several jobs).

Images travel as the bytes of a `.npy` file (base64 in the JSON body): lossless and exact,
so a server scores the very array the trainer decoded, and in process and served scores are
the same numbers. Scores come back as JSON floats, whose repr round-trips float64 exactly.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import io
import json
import math
import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future, wait
from tokenize import TokenError
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import numpy as np

from trainer.config import RUN_TIME_REWARDS
from trainer.rewards.registry import compute_rewards
from trainer.strict_json import loads_strict

if TYPE_CHECKING:  # the server extra: imported where used, so in-process scoring never needs it
    import httpx

ENV_TIMEOUT = "REWARD_SERVER_TIMEOUT"
# a GPU server shared by several training processes queues their batches behind each other: generous
DEFAULT_TIMEOUT = 300.0
# how often a request that its caller may stop asks whether to (a job's cancel is read from
# the database at most once a second anyway)
STOP_POLL_SECONDS = 0.5
# rewards that live in the trainer's process, never on a server: the job's own model fitted
# to votes
LOCAL_REWARDS = RUN_TIME_REWARDS

Scorer = Callable[[list[str], np.ndarray, list[str]], dict[str, np.ndarray]]


class RewardServerError(RuntimeError):
    """The reward server cannot be reached, timed out, refused a request or lacks a reward.
    The message names the server's URL and says what went wrong in full."""


class ScoringStopped(Exception):
    """Scoring on the reward server given up part-way because the caller's `stop_requested`
    said so (a cancelled job): the scores are lost, the request's connection is cut."""


def url_problem(url: str) -> str | None:
    """Why `url` cannot be a reward server's address (http(s)://host[:port][/prefix]), or None."""
    # urlsplit keeps a space or a newline inside the path, where the HTTP client refuses it
    # only when the job first calls the server
    if bad := [(i, ch) for i, ch in enumerate(url) if ch.isspace() or not ch.isprintable()]:
        i, ch = bad[0]
        return (f"must not contain spaces or control characters; found {ch!r} at position {i} "
                f"of {url!r}")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises ValueError on a bad port)
    except ValueError as exc:
        return f"is not a valid URL ({exc}): {url!r}"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"must be an http:// or https:// URL with a host, got {url!r}"
    if parts.query or parts.fragment:
        return f"must not carry a query or fragment, got {url!r}"
    return None


def encode_images(images: np.ndarray) -> str:
    """(N, H, W, 3) uint8 as base64 of its .npy bytes (what POST /score takes)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(images, dtype=np.uint8), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


# what a client might send instead of .npy bytes: named, rather than numpy's message
_IMAGE_FILES = {b"\x89PNG": "a PNG file", b"\xff\xd8\xff": "a JPEG file",
                b"RIFF": "a WebP file", b"GIF8": "a GIF file"}


def _load_npy(raw: bytes, what: str) -> np.ndarray:
    """The array in the .npy bytes `raw`, its header checked against the bytes there before
    anything is allocated (a header may claim terabytes); ValueError names `what` was sent."""
    from numpy.lib import format as npy

    kind = next((name for magic, name in _IMAGE_FILES.items() if raw.startswith(magic)), None)
    if kind is not None:
        raise ValueError(f"{what} must be the .npy bytes of an (N, H, W, 3) uint8 array, not "
                         f"{kind} (encode_images / encode_score_request in "
                         "trainer.rewards.remote write them)")
    buf = io.BytesIO(raw)
    try:
        version = npy.read_magic(buf)
        read_header = (npy.read_array_header_1_0 if version == (1, 0)
                       else npy.read_array_header_2_0)
        shape, _, dtype = read_header(buf, max_header_size=10_000)
    except (ValueError, OSError, EOFError, SyntaxError, TokenError, RecursionError) as exc:
        # numpy reads the header's dict with the tokenizer and ast: a garbled one raises any
        # of these (TokenError for an unclosed bracket), all the sender's fault
        raise ValueError(f"{what} must be a .npy file: {exc}") from None
    if dtype.hasobject:
        raise ValueError(f"{what} must be a .npy file of numbers, not of objects")
    needed = math.prod(shape) * dtype.itemsize
    if needed != len(raw) - buf.tell():
        # fewer bytes: a cut-off request; more: something else appended, never scored
        raise ValueError(f"{what}: the .npy header describes a {dtype} array of shape "
                         f"{tuple(shape)} ({needed:,} bytes), the request holds "
                         f"{len(raw) - buf.tell():,}")
    try:
        return np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise ValueError(f"{what} must be a .npy file: {exc}") from None


def decode_images(data: str) -> np.ndarray:
    """The inverse of encode_images; ValueError says what is wrong with `data`."""
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError as exc:
        raise ValueError(f"images must be base64 of a .npy file: {exc}") from None
    return _checked_images(_load_npy(raw, "images (after base64)"))


# POST /score_npy's body: one line of JSON {"rewards": [...], "prompts": [...]} (compact JSON
# holds no raw newline), then the .npy bytes of the (N, H, W, 3) uint8 images. Raw bytes, not
# base64 inside JSON: at 512 px the JSON route's encoding, parsing and decoding cost about a
# second per 48 images, several times the scoring itself (docs/benchmarks.md, reward server).
NPY_MEDIA_TYPE = "application/x-score-npy"


def encode_score_request(rewards: list[str], prompts: list[str], images: np.ndarray) -> bytes:
    """The body of POST /score_npy."""
    head = json.dumps({"rewards": list(rewards), "prompts": list(prompts)},
                      separators=(",", ":")).encode()
    buf = io.BytesIO()
    buf.write(head + b"\n")
    np.save(buf, np.ascontiguousarray(images, dtype=np.uint8), allow_pickle=False)
    return buf.getvalue()


def decode_score_request(body: bytes) -> tuple[list[str], list[str], np.ndarray]:
    """(rewards, prompts, images) from a POST /score_npy body; ValueError says what is wrong."""
    head, newline, rest = body.partition(b"\n")
    if not newline:
        raise ValueError("the body must start with one line of JSON {\"rewards\": [...], "
                         "\"prompts\": [...]}, then the .npy bytes of the images")
    try:
        meta = loads_strict(head)
    except ValueError as exc:
        raise ValueError(f"the first line of the body is not JSON: {exc}") from None
    if isinstance(meta, dict) and (unknown := sorted(set(meta) - {"rewards", "prompts"})):
        raise ValueError(f"unknown key(s) {unknown} in the first line; it takes 'rewards' and "
                         "'prompts'")
    rewards, prompts = (meta.get(k) if isinstance(meta, dict) else None
                        for k in ("rewards", "prompts"))
    for name, value in (("rewards", rewards), ("prompts", prompts)):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"'{name}' in the first line must be a list of strings")
    return rewards, prompts, _checked_images(_load_npy(rest, "the images after the first line"))


def _checked_images(images: np.ndarray) -> np.ndarray:
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"images must be an (N, H, W, 3) uint8 array, got {images.dtype} "
                         f"{tuple(images.shape)}")
    if images.shape[1] < 1 or images.shape[2] < 1:  # no reward can score an empty image
        raise ValueError(f"images must be at least 1x1, got {tuple(images.shape)}")
    return images


def _timeout_from_env() -> float:
    value = os.environ.get(ENV_TIMEOUT, "")
    try:
        timeout = float(value) if value.strip() else DEFAULT_TIMEOUT
    except ValueError:
        raise RewardServerError(f"{ENV_TIMEOUT} must be a number of seconds, got "
                                f"{value!r}") from None
    if not timeout > 0:
        raise RewardServerError(f"{ENV_TIMEOUT} must be positive, got {value!r}")
    return timeout


class _CuttableConnection:
    """The connection of one request, as httpcore's trace hook reports it opening, so that
    another thread can cut it: shutting its socket down wakes the thread blocked reading the
    answer (closing the socket would not) and tells the server that its client left."""

    _OPENED = ("connection.connect_tcp.complete", "connection.start_tls.complete")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None
        self._cut = False

    def trace(self, event: str, info: dict[str, Any]) -> None:
        """httpcore's `trace` request extension: keeps the socket once it is open (over TLS
        the TLS socket, which takes over the TCP one's descriptor)."""
        if event not in self._OPENED:
            return
        with self._lock:
            self._socket = sock = info["return_value"].get_extra_info("socket")
            cut = self._cut
        if cut:  # cut while it was still connecting
            _shut_down(sock)

    def cut(self) -> None:
        with self._lock:
            self._cut, sock = True, self._socket
        if sock is not None:
            _shut_down(sock)


def _shut_down(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # closed already: the request ended meanwhile
        sock.shutdown(socket.SHUT_RDWR)


class RewardClient:
    """Scores rewards on the server at `url`: `client(names, images, prompts)` returns what
    `compute_rewards` would. `timeout` (seconds; default REWARD_SERVER_TIMEOUT, else 300)
    bounds each request."""

    def __init__(self, url: str, timeout: float | None = None) -> None:
        import httpx  # the server extra; imported here so in-process scoring never needs it

        if (problem := url_problem(url)) is not None:
            raise RewardServerError(f"reward server URL {problem}")
        self.url = url.rstrip("/")
        self.timeout = float(timeout) if timeout is not None else _timeout_from_env()
        self._max_images: int | None = None  # the server's, asked once (max_images())
        # connecting should be quick even when scoring is not: a dead host fails fast. No
        # connection is kept alive: each request opens its own, which the trace hook reports,
        # so that a stop cuts that request's connection (a pooled one's is out of reach)
        self._http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(
            self.timeout, connect=min(self.timeout, 10.0)),
            limits=httpx.Limits(max_keepalive_connections=0))

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str,
                 stop_requested: Callable[[], bool] | None = None,
                 **kwargs: Any) -> dict[str, Any]:
        """The JSON object the server answers; RewardServerError says what went wrong.
        `stop_requested`: see `_stoppable_request`."""
        import httpx

        try:
            if stop_requested is None:
                response = self._http.request(method, path, **kwargs)
            else:
                response = self._stoppable_request(method, path, stop_requested, **kwargs)
        except httpx.ConnectTimeout:
            raise RewardServerError(f"reward server at {self.url} cannot be reached (no "
                                    f"connection within {min(self.timeout, 10.0):g} s); is "
                                    "`python -m trainer.rewards.serve` running there?") from None
        except httpx.TimeoutException:
            raise RewardServerError(f"reward server at {self.url} did not answer within "
                                    f"{self.timeout:g} s ({ENV_TIMEOUT} sets the limit)") from None
        except httpx.TransportError as exc:
            raise RewardServerError(f"reward server at {self.url} cannot be reached ({exc}); "
                                    "is `python -m trainer.rewards.serve` running there?"
                                    ) from None
        if response.status_code >= 400:
            try:
                body = response.json()
            except ValueError:
                body = response.text
            detail = body.get("detail", body) if isinstance(body, dict) else body
            raise RewardServerError(f"reward server at {self.url} answered "
                                    f"{response.status_code} to {method} {path}: {detail}")
        try:
            body = response.json()
        except ValueError:
            body = None
        if isinstance(body, dict):
            return body
        # something else answers there (a proxy's page, another service)
        raise RewardServerError(f"reward server at {self.url} answered {method} {path} "
                                f"with something other than a JSON object: "
                                f"{response.text[:200]!r}")

    def _stoppable_request(self, method: str, path: str, stop_requested: Callable[[], bool],
                           **kwargs: Any) -> httpx.Response:
        """The request sent from a thread of its own while this one asks `stop_requested`
        every STOP_POLL_SECONDS: True cuts its connection and raises ScoringStopped. Returns
        the response, or raises what sending the request raised."""
        connection = _CuttableConnection()
        answer: Future[httpx.Response] = Future()

        def send() -> None:
            try:
                answer.set_result(self._http.request(
                    method, path, extensions={"trace": connection.trace}, **kwargs))
            except BaseException as exc:  # raised in the waiting thread (answer.result())
                answer.set_exception(exc)

        threading.Thread(target=send, name=f"reward-server {method} {path}",
                         daemon=True).start()
        try:
            while not wait([answer], timeout=STOP_POLL_SECONDS).done:
                if stop_requested():
                    raise ScoringStopped(f"scoring on the reward server at {self.url} "
                                         "stopped on request")
        finally:
            if not answer.done():  # stopped, or stop_requested failed: nobody will read it
                connection.cut()
        return answer.result()

    def health(self) -> dict[str, Any]:
        """GET /health: {"status", "rewards", "device", and the batching counters}."""
        return self._request("GET", "/health")

    def check(self, names: list[str] | dict[str, Any]) -> None:
        """Raise RewardServerError unless the server is up and serves every reward among
        `names` that it has to (all but the run-time ones); the message names those missing."""
        wanted = [n for n in names if n not in LOCAL_REWARDS]
        health = self.health()
        limit = health.get("max_images")  # what max_images() would ask for, kept
        self._max_images = limit if isinstance(limit, int) and limit >= 1 else 0
        if health.get("status") != "ok":
            raise RewardServerError(f"reward server at {self.url} is not ready: {health}")
        served = health.get("rewards", [])
        missing = [n for n in wanted if n not in served]
        if missing:
            raise RewardServerError(
                f"reward server at {self.url} does not serve {missing}; it serves {served}. "
                f"Start it with --rewards naming them, or score them in process (empty "
                f"reward_server_url)")

    def max_images(self) -> int | None:
        """The most images the server takes in one request (its /health's max_images, asked
        once), or None for a server that sets no limit."""
        if self._max_images is None:
            limit = self.health().get("max_images")
            self._max_images = limit if isinstance(limit, int) and limit >= 1 else 0
        return self._max_images or None

    def _score_npy(self, names: list[str], images: np.ndarray, prompts: list[str],
                   stop_requested: Callable[[], bool] | None = None) -> dict[str, np.ndarray]:
        """One POST /score_npy: {name: (N,) float64}, a null score as nan."""
        body = encode_score_request(names, prompts, images)
        scores = self._request("POST", "/score_npy", stop_requested, content=body,
                               headers={"Content-Type": NPY_MEDIA_TYPE}).get("scores", {})
        out = {}
        for name in names:
            # a non-finite score travels as null (JSON has no NaN)
            values = np.array([np.nan if v is None else v for v in scores.get(name, [])],
                              dtype=np.float64)
            if values.shape != (len(prompts),):
                raise RewardServerError(f"reward server at {self.url} returned "
                                        f"{values.shape} scores for {name!r}, expected "
                                        f"({len(prompts)},)")
            out[name] = values
        return out

    def __call__(self, names: list[str], images: np.ndarray, prompts: list[str], *,
                 stop_requested: Callable[[], bool] | None = None) -> dict[str, np.ndarray]:
        """{name: (N,) float64}, as compute_rewards. `stop_requested`, asked every
        STOP_POLL_SECONDS while a request waits for the server: True gives the scoring up
        (ScoringStopped). The run-time rewards, scored here, are not interrupted."""
        names = list(names)
        remote = [n for n in names if n not in LOCAL_REWARDS]
        local = [n for n in names if n in LOCAL_REWARDS]
        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
        out = compute_rewards(local, images, prompts) if local else {}
        if remote:
            # the server refuses a request of more than its max_images (a 413): split
            step = self.max_images() or max(len(prompts), 1)
            parts: dict[str, list[np.ndarray]] = {name: [] for name in remote}
            for start in range(0, max(len(prompts), 1), step):
                rows = slice(start, start + step)
                chunk = self._score_npy(remote, images[rows], list(prompts[rows]),
                                        stop_requested)
                for name in remote:
                    parts[name].append(chunk[name])
            for name in remote:
                out[name] = np.concatenate(parts[name])
        return {name: out[name] for name in names}  # in the order asked, as compute_rewards


@functools.lru_cache(maxsize=8)
def reward_client(url: str) -> RewardClient:
    """The RewardClient of the server at `url`, one per process (its timeout read once, its
    server's max_images asked once)."""
    return RewardClient(url)


def reward_scorer(server_url: str = "",
                  stop_requested: Callable[[], bool] | None = None) -> Scorer:
    """Where rewards are computed: in this process (`compute_rewards`) for an empty URL, else
    on the reward server at `server_url` (a RewardClient, reused across calls), whose wait
    for scores `stop_requested` may end (ScoringStopped; see RewardClient.__call__). Scoring
    in process is this process's own work, not a wait: it is not interrupted."""
    if not server_url:
        return compute_rewards
    client = reward_client(server_url)
    return client if stop_requested is None else functools.partial(
        client, stop_requested=stop_requested)


def prepare_scorer(names: list[str] | dict[str, Any], server_url: str = "",
                   model_paths: dict[str, str] | None = None,
                   device: Any = None, paths_setting: str | None = None,
                   stop_requested: Callable[[], bool] | None = None) -> Scorer:
    """Ready the rewards `names` for a job, at its start, before any model loads, and return
    `reward_scorer(server_url, stop_requested)`. With a server: it must be up and serve every
    name but the run-time ones (RewardServerError names the URL and what is missing), and
    `stop_requested` may end a wait for its scores. In process: the model-backed rewards among
    `names` point at `model_paths` (the rest at REWARD_MODELS_DIR) on `device`: weights that
    are missing raise RewardWeightsMissing, weights that are there but do not load a
    ValueError naming the reward and its files (they are loaded here, not at the first
    scoring after minutes of sampling). Train, rollout and evaluate jobs all start through
    here, so a job that scores checks its rewards one way. `paths_setting`: how messages name
    where `model_paths` came from (configure_reward_models; default the config field, a
    job's)."""
    if server_url:
        reward_client(server_url).check(names)
        return reward_scorer(server_url, stop_requested)
    # imported here: torch and the model adapters, which a process scoring on a server never
    # needs to load
    from trainer.rewards.models import (
        PATHS_SETTING,
        check_reward_models,
        configure_reward_models,
        load_reward_models,
    )

    configure_reward_models(model_paths, device, paths_setting or PATHS_SETTING)
    check_reward_models(names)
    load_reward_models(names)
    return compute_rewards
