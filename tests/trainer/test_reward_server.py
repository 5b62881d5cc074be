"""The reward server (trainer/rewards/serve.py) and its client (trainer/rewards/remote.py),
issue 17: a real uvicorn server on a free port (in a thread, so a test can register a slow
reward it serves) and a real httpx client. The same images score the same through the server
as in process; eight concurrent clients are batched together and each gets its own scores; a
client that disconnects mid-request harms nobody; a wrong name, a timeout, a server that is
down are errors naming what and where; a training job scores through the server."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from reward_server_helpers import ServerThread, held_reward
from test_reward_models import (
    needs_open_clip,
    save_tiny_aesthetic,
    save_tiny_hpsv2,
    save_tiny_imagereward,
)

from trainer.config import PRESETS, ConfigErrors, TrainConfig
from trainer.loop import Trainer
from trainer.rewards import compute_rewards, get_reward, register_reward, registry
from trainer.rewards import models as reward_models
from trainer.rewards.remote import (
    NPY_MEDIA_TYPE,
    STOP_POLL_SECONDS,
    RewardClient,
    RewardServerError,
    ScoringStopped,
    decode_images,
    decode_score_request,
    encode_images,
    encode_score_request,
    reward_scorer,
)
from trainer.rewards.serve import create_app

ROOT = Path(__file__).resolve().parents[2]
SLOW_SECONDS = 2.0  # how long the test reward "test_slow" holds the scoring thread
SERVED = ["count", "color", "jpeg_compressibility", "test_slow", "test_failing", "pickscore"]


def _slow_count(images: np.ndarray, prompts: list[str]) -> np.ndarray:
    time.sleep(SLOW_SECONDS)
    return get_reward("count")(images, prompts)


def _failing(images: np.ndarray, prompts: list[str]) -> np.ndarray:
    raise RuntimeError("this reward fails on purpose")


@pytest.fixture(scope="module")
def reward_models_root(tiny_clip_path, tmp_path_factory):
    """The REWARD_MODELS_DIR of this module's servers and of its in-process scoring: one
    setting, as they share the process (a reward reads it each time it scores). pickscore's
    tiny CLIP is there from the start; model_server adds the other rewards' models."""
    root = tmp_path_factory.mktemp("reward_models")
    shutil.copytree(tiny_clip_path, root / "pickscore")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REWARD_MODELS_DIR", str(root))
        yield root


@pytest.fixture(scope="module")
def server(reward_models_root):
    register_reward("test_slow", _slow_count)
    register_reward("test_failing", _failing)
    # a short wait keeps solo requests quick; the concurrency test queues its clients
    # behind a slow request, so they are all waiting when the batch is gathered
    app = create_app(SERVED, device="cpu", max_batch=64, max_wait_ms=30)
    try:
        with ServerThread(app) as running:
            yield running
    finally:
        registry._REWARDS.pop("test_slow", None)
        registry._REWARDS.pop("test_failing", None)
        reward_models.configure_reward_models({}, "cpu")
        reward_models.clear_cache()


# every model-backed reward the registry has (trainer/rewards/models.py)
MODEL_REWARDS = sorted(reward_models.MODEL_REWARDS)


def _save_tiny_clip_score(directory: Path) -> Path:
    """clip_score's directory: a copy of pickscore's tiny CLIP whose two towers share their
    projection and a common offset before it, so that image and text embeddings point one way
    and every cosine is positive (56-68 as clip_score), as a trained CLIP's are. The random
    CLIP's cosines of PROMPTS with the test's images are about 0 or negative, and clip_score,
    100 * max(cos, 0), was 0 for most of them: equal scores that another reward's or other
    images' zeros would have matched."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(directory.parent / "pickscore", directory)
    weights = directory / "model.safetensors"
    state = load_file(weights)
    state["text_projection.weight"] = state["visual_projection.weight"].clone()
    for norm in ("vision_model.post_layernorm.bias", "text_model.final_layer_norm.bias"):
        state[norm] = state[norm] + 1.0
    save_file(state, str(weights), metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def model_server(reward_models_root):
    """A reward server of every model-backed reward, each a tiny random model saved in code in
    its published layout under reward_models_root (tests/trainer/test_reward_models.py's
    builders; nothing downloaded): about 2 s with open_clip's import. Its own server, not
    `server`: the tests of `server` need hpsv2 to be a reward it does not serve."""
    builders = {"hpsv2": save_tiny_hpsv2, "aesthetic": save_tiny_aesthetic,
                "imagereward": save_tiny_imagereward, "clip_score": _save_tiny_clip_score,
                "pickscore": lambda directory: directory}  # reward_models_root's own
    assert sorted(builders) == MODEL_REWARDS, "a model-backed reward without a tiny model here"
    for name, save in builders.items():
        save(reward_models_root / name)
    app = create_app(MODEL_REWARDS, device="cpu", max_wait_ms=0)
    try:
        with ServerThread(app) as running:
            yield running
    finally:
        reward_models.configure_reward_models({}, "cpu")
        reward_models.clear_cache()


def _images(n: int, seed: int, size: int = 32) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


PROMPTS = ["three red squares", "one blue circle", "two green triangles", "one red circle"]


def _health(server) -> dict:
    return RewardClient(server.url, timeout=10).health()


def test_images_travel_exactly():
    images = _images(3, seed=0, size=20)
    back = decode_images(encode_images(images))
    assert back.dtype == np.uint8 and np.array_equal(back, images)
    for bad in ("not base64!", encode_images(images[..., :2])):
        with pytest.raises(ValueError, match="images must be"):
            decode_images(bad)


def test_score_requests_travel_exactly_without_base64():
    images = _images(3, seed=0, size=20)
    body = encode_score_request(["count", "color"], PROMPTS[:3], images)
    assert len(body) < images.nbytes + 400  # raw bytes: no base64, no JSON around them
    rewards, prompts, back = decode_score_request(body)
    assert (rewards, prompts) == (["count", "color"], PROMPTS[:3])
    assert back.dtype == np.uint8 and np.array_equal(back, images)
    npy = body.partition(b"\n")[2]
    for bad, message in ((b"no line at all", "must start with one line of JSON"),
                         (npy, "first line of the body is not JSON"),
                         (b"{oops\n" + npy, "first line of the body is not JSON"),
                         (b'{"rewards": "count", "prompts": []}\n' + npy, "'rewards'"),
                         (b'{"rewards": [], "prompts": [1]}\n' + npy, "'prompts'"),
                         (b'{"rewards": [], "prompts": []}\nnot npy', "must be a .npy file"),
                         (encode_score_request([], [], images[..., :2]), "(N, H, W, 3) uint8")):
        with pytest.raises(ValueError, match=re.escape(message)):
            decode_score_request(bad)


def test_both_routes_score_alike_and_a_bad_body_is_422(server):
    """The job's client sends raw .npy bytes (POST /score_npy); POST /score takes the same
    images as base64 inside JSON (for curl and other clients). Same scores either way."""
    client = RewardClient(server.url, timeout=30)
    images = _images(3, seed=5)
    served = client(["count", "jpeg_compressibility"], images, PROMPTS[:3])
    as_json = client._request("POST", "/score", json={
        "rewards": ["count", "jpeg_compressibility"], "prompts": PROMPTS[:3],
        "images": encode_images(images)})["scores"]
    for name, values in served.items():
        np.testing.assert_array_equal(values, np.array(as_json[name], dtype=np.float64))
    with pytest.raises(RewardServerError, match="422.*first line of the body is not JSON"):
        client._request("POST", "/score_npy", content=b"nonsense\n",
                        headers={"Content-Type": NPY_MEDIA_TYPE})
    with pytest.raises(RewardServerError, match="422.*3 images but 2 prompts"):
        client._request("POST", "/score_npy", content=encode_score_request(
            ["count"], PROMPTS[:2], images), headers={"Content-Type": NPY_MEDIA_TYPE})


def test_every_error_has_one_shape_and_nothing_extra_is_taken(server):
    """The routes' own checks answered {"detail": "..."} and the body schema's FastAPI's list
    of dicts, so a client handled two shapes; unknown keys and bytes after the images were
    ignored. Now: {detail, field, errors} always, and both refused."""
    import httpx

    images = _images(2, seed=1)
    npy = encode_score_request(["count"], PROMPTS[:2], images)
    cases = [
        ("/score", {"json": {"rewards": "count", "prompts": [1], "images": "x"}},
         {"rewards", "prompts.0", "images"}),
        ("/score", {"json": {"rewards": ["count"], "prompts": PROMPTS[:2],
                             "images": encode_images(images), "extra": 1}}, {"extra"}),
        ("/score", {"content": b"not json", "headers": {"Content-Type": "application/json"}},
         None),
        ("/score_npy", {"content": npy + b"trailing", "headers": {
            "Content-Type": NPY_MEDIA_TYPE}}, {"body"}),
        ("/score_npy", {"content": b'{"rewards":["count"],"prompts":["a","b"],"x":1}\n'
                        + npy.partition(b"\n")[2]}, {"body"}),
        ("/score_npy", {"content": encode_score_request(["count"], PROMPTS[:1], images)},
         {"prompts"}),
        ("/score_npy", {"content": encode_score_request(["nope"], PROMPTS[:2], images)},
         {"rewards"}),
    ]
    for path, kwargs, fields in cases:
        r = httpx.post(server.url + path, timeout=30, **kwargs)
        body = r.json()
        assert r.status_code == 422 and isinstance(body["detail"], str), (path, r.text)
        assert body["field"] == body["errors"][0]["field"], r.text
        if fields is not None:
            assert {e["field"] for e in body["errors"]} == fields, r.text
    assert "the request holds" in httpx.post(server.url + "/score_npy", timeout=30,
                                             content=npy + b"trailing").json()["detail"]


def test_one_422_lists_every_problem_of_a_request(server):
    """The server answered with its first problem alone: an unknown key hid an unknown reward
    and a prompt count that did not match, the rewards hid the count, bad images hid the
    rewards. One 422 now lists the key, reward, image and prompt-count problems together."""
    import httpx

    two = encode_images(_images(2, seed=3))
    cases = [
        ({"rewards": ["jpeg_compressibility", "nope"], "prompts": ["x"], "images": two,
          "extra": 1}, ["extra", "rewards", "prompts"]),
        ({"rewards": ["jpeg_compressibility", "nope"], "prompts": ["x"], "images": two},
         ["rewards", "prompts"]),
        ({"rewards": ["nope"], "images": "!!notb64"}, ["prompts", "images", "rewards"]),
    ]
    for body, fields in cases:
        r = httpx.post(server.url + "/score", json=body, timeout=30)
        assert r.status_code == 422, r.text
        answer = r.json()
        assert [e["field"] for e in answer["errors"]] == fields, r.text
        assert answer["field"] == fields[0] and isinstance(answer["detail"], str), r.text
        messages = {e["field"]: e["message"] for e in answer["errors"]}
        assert "unknown reward(s) ['nope']" in messages["rewards"], r.text
        assert messages["prompts"] == ("2 images but 1 prompts" if "images" not in messages
                                       else "Field required"), r.text
    # the raw route lists its rewards and count problems together too
    r = httpx.post(server.url + "/score_npy", timeout=30, content=encode_score_request(
        ["nope"], PROMPTS[:1], _images(2, seed=3)))
    assert [e["field"] for e in r.json()["errors"]] == ["rewards", "prompts"], r.text


def test_a_body_that_is_not_what_its_header_says_is_422_before_any_allocation(server):
    """A .npy header claiming terabytes (the body has a hundred bytes) is answered from the
    header, not by trying to allocate it (a 500 from numpy's MemoryError); image files sent
    instead of .npy bytes are named as such."""
    import base64
    import io

    client = RewardClient(server.url, timeout=30)
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": "|u1", "fortran_order": False,
                                                "shape": (1, 1_000_000, 1_000_000, 3)})
    body = b'{"rewards":["count"],"prompts":["one red circle"]}\n' + head.getvalue() + bytes(100)
    with pytest.raises(RewardServerError, match=r"422.*describes a uint8 array of shape "
                                                r"\(1, 1000000, 1000000, 3\) \(3,000,000,000,000 "
                                                r"bytes\), the request holds 100"):
        client._request("POST", "/score_npy", content=body,
                        headers={"Content-Type": NPY_MEDIA_TYPE})
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(64)).decode()
    with pytest.raises(RewardServerError, match="422.*not a PNG file"):
        client._request("POST", "/score", json={"rewards": ["count"],
                                                "prompts": ["one red circle"], "images": png})


def test_a_garbled_npy_header_and_a_prompt_a_reward_cannot_read_are_422(server):
    """A header whose dict the tokenizer cannot read (an unclosed bracket: TokenError) was a
    plain-text 500; a shapes reward given a prompt of no shapes scene failed in the batch, a
    500 blaming the server for the request."""
    import base64

    client = RewardClient(server.url, timeout=30)
    garbled = b"\x93NUMPY\x01\x00\x10\x00{'descr': (((((\n"
    body = b'{"rewards":["count"],"prompts":["one red circle"]}\n' + garbled
    with pytest.raises(RewardServerError, match="422.*must be a .npy file"):
        client._request("POST", "/score_npy", content=body,
                        headers={"Content-Type": NPY_MEDIA_TYPE})
    with pytest.raises(RewardServerError, match="422.*must be a .npy file"):
        client._request("POST", "/score", json={"rewards": ["count"],
                                                "prompts": ["one red circle"],
                                                "images": base64.b64encode(garbled).decode()})
    images = _images(2, seed=0)
    body = encode_score_request(["count", "jpeg_compressibility"], ["one red circle", "a cat"],
                                images)
    with pytest.raises(RewardServerError, match=r"422.*\['count'\] score shapes prompts only: "
                                                r"prompt 1 'a cat' are not"):
        client._request("POST", "/score_npy", content=body,
                        headers={"Content-Type": NPY_MEDIA_TYPE})
    # an image reward reads any prompt
    scores = client(["jpeg_compressibility"], images, ["a cat", "a dog"])
    assert scores["jpeg_compressibility"].shape == (2,)


def test_a_body_over_the_limit_is_413_chunked_or_not():
    import httpx

    app = create_app(["count", "jpeg_compressibility"], device="cpu", max_request_bytes=1000)
    with ServerThread(app) as running:
        body = encode_score_request(["count"], ["one red circle"], _images(1, seed=1))
        assert len(body) > 1000
        r = httpx.post(f"{running.url}/score_npy", content=body,
                       headers={"Content-Type": NPY_MEDIA_TYPE})
        assert r.status_code == 413 and "--max-request-mb" in r.json()["detail"]
        r = httpx.post(f"{running.url}/score_npy", content=iter([body[:600], body[600:]]),
                       headers={"Content-Type": NPY_MEDIA_TYPE})  # no Content-Length
        assert r.status_code == 413, r.text
        # (an image reward: the shapes ones take only 32x32 images, more than 1000 bytes)
        small = encode_score_request(["jpeg_compressibility"], ["one red circle"],
                                     np.zeros((1, 8, 8, 3), np.uint8))
        r = httpx.post(f"{running.url}/score_npy", content=iter([small[:50], small[50:]]),
                       headers={"Content-Type": NPY_MEDIA_TYPE})
        assert r.status_code == 200, r.text
        assert len(r.json()["scores"]["jpeg_compressibility"]) == 1, r.text


def test_health_names_the_rewards_and_device(server):
    health = _health(server)
    assert health["status"] == "ok" and health["rewards"] == SERVED
    assert health["device"] == "cpu"


@pytest.mark.parametrize("served_by, names, size", [
    pytest.param("server", ["count", "color", "jpeg_compressibility"], (32, 32), id="shapes"),
    # (not the models' 32x32: each resizes and crops or pads as its reference does)
    pytest.param("model_server", MODEL_REWARDS, (40, 48), id="models", marks=needs_open_clip),
])
def test_same_images_score_the_same_as_in_process(served_by, names, size, request):
    """Exact, not close: the server scores a lone request's images in one call of the reward,
    as compute_rewards does, on the same CPU with the same weights. In process the models are
    loaded again from their files first (as a job's own process would), not the server's."""
    server = request.getfixturevalue(served_by)
    images = np.random.default_rng(1).integers(0, 256, (len(PROMPTS), *size, 3), dtype=np.uint8)
    served = RewardClient(server.url, timeout=30)(names, images, PROMPTS)
    reward_models.clear_cache()
    local = compute_rewards(names, images, PROMPTS)
    assert list(served) == names
    for name in names:
        assert served[name].dtype == np.float64
        np.testing.assert_array_equal(served[name], local[name], err_msg=name)
    # the scores are not one constant (each model's are four different numbers; of the
    # shapes rewards on noise, color gives two images one score) and no two rewards score
    # alike: a server that scored other images, in another order or with another reward
    # would not match
    for name in names:
        different = len(np.unique(local[name]))
        assert (different == len(PROMPTS) if served_by == "model_server" else different > 1), \
            (name, local[name])
        for other in names:
            assert other == name or not np.allclose(served[name], local[other]), (name, other)


def test_eight_concurrent_clients_are_batched_and_get_their_own_scores(server):
    """A slow request holds the scoring thread while eight clients send theirs: the batcher
    then gathers them into one batch and splits the scores back, each to its own client."""
    before = _health(server)
    requests = []
    for i in range(8):  # each client its own images, count, size and rewards
        n, size = i + 1, (32 if i % 2 else 24)
        names = (["pickscore", "count"] if i % 4 == 3  # a model reward, batched across clients
                 else ["count", "color"] if i % 3 else ["jpeg_compressibility", "count"])
        if size != 32:  # the shapes rewards take only the shapes world's 32x32 images
            names = [n for n in names if n not in ("count", "color")] or ["jpeg_compressibility"]
        requests.append((names, _images(n, seed=100 + i, size=size),
                         [PROMPTS[(i + k) % len(PROMPTS)] for k in range(n)]))

    def send(request):
        names, images, prompts = request
        return RewardClient(server.url, timeout=60)(names, images, prompts)

    start = time.monotonic()
    with ThreadPoolExecutor(10) as pool:
        slow = pool.submit(send, (["test_slow"], _images(1, seed=7), PROMPTS[:1]))
        time.sleep(0.3)  # the slow one is being scored now
        # and one more client whose reward fails in the batch: its error is its own
        bad = pool.submit(send, (["test_failing"], _images(2, seed=8), PROMPTS[:2]))
        answers = list(pool.map(send, requests))
        slow.result()
        with pytest.raises(RewardServerError, match="500.*this reward fails on purpose"):
            bad.result()
    elapsed = time.monotonic() - start
    assert elapsed < SLOW_SECONDS + 15, f"8 clients took {elapsed:.1f} s"
    for (names, images, prompts), answer in zip(requests, answers, strict=True):
        local = compute_rewards(names, images, prompts)
        assert list(answer) == names
        for name in names:
            if name == "pickscore":  # scored in a batch with other clients' images: the
                # network's float rounding may differ with the batch, nothing else
                np.testing.assert_allclose(answer[name], local[name], rtol=1e-5, atol=1e-4)
            else:
                np.testing.assert_array_equal(answer[name], local[name])
    assert any("pickscore" in names for names, _, _ in requests)
    after = _health(server)
    assert after["requests"] - before["requests"] == 10
    assert after["images"] - before["images"] == 1 + 2 + sum(range(1, 9))
    # the nine queued behind the slow one are scored in fewer batches than requests
    assert after["batches"] - before["batches"] < 10
    assert after["largest_batch_requests"] >= 2


def test_a_client_that_disconnects_mid_request_harms_nobody(server):
    before = _health(server)
    images = _images(2, seed=3)
    started = time.monotonic()
    # A: its reward takes SLOW_SECONDS; it gives up after 0.3 s, while being scored
    with pytest.raises(RewardServerError) as error:
        RewardClient(server.url, timeout=0.3)(["test_slow"], images, PROMPTS[:2])
    assert f"reward server at {server.url} did not answer within 0.3 s" in str(error.value)
    # B: queued behind A, it leaves before its turn: dropped, never scored
    with pytest.raises(RewardServerError, match="did not answer within 0.2 s"):
        RewardClient(server.url, timeout=0.2)(["count"], images, PROMPTS[:2])
    # C: sends half a request and hangs up
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) as raw:
        raw.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 5000\r\n\r\n{\"rewards\": [\"count\"], \"ima")
    assert time.monotonic() - started < SLOW_SECONDS  # all three left while A was scored
    # D: served as usual, with the right scores, once A is done
    answer = RewardClient(server.url, timeout=30)(["count", "color"], images, PROMPTS[:2])
    local = compute_rewards(["count", "color"], images, PROMPTS[:2])
    for name in ("count", "color"):
        np.testing.assert_array_equal(answer[name], local[name])
    after = _health(server)
    assert after["cancelled"] - before["cancelled"] == 1  # B
    assert after["requests"] - before["requests"] == 2  # A (answer discarded) and D


def test_a_request_whose_client_left_stops_at_its_next_chunk():
    """A request being scored when its client leaves is not scored to its end: the scoring
    thread stops at its next chunk of max_batch images, free for the others."""
    calls = []

    def counted(images: np.ndarray, prompts: list[str]) -> np.ndarray:
        calls.append(len(images))
        time.sleep(0.3)
        return get_reward("count")(images, prompts)

    register_reward("test_chunk_calls", counted)
    try:
        app = create_app(["test_chunk_calls"], device="cpu", max_batch=1)
        images, prompts = _images(8, seed=4), [PROMPTS[i % 4] for i in range(8)]
        with ServerThread(app) as running:
            with pytest.raises(RewardServerError, match="did not answer within 0.5 s"):
                RewardClient(running.url, timeout=0.5)(["test_chunk_calls"], images, prompts)
            time.sleep(8 * 0.3)  # past the time all eight chunks would take
            assert 1 <= len(calls) < 5, calls  # ~0.1 s to notice, then the chunk in hand
            assert _health(running)["cancelled"] == 1
            # the thread is free and answers the next client in full
            answer = RewardClient(running.url, timeout=30)(["test_chunk_calls"], images[:2],
                                                           prompts[:2])
            assert answer["test_chunk_calls"].shape == (2,)
    finally:
        registry._REWARDS.pop("test_chunk_calls", None)


def test_a_caller_may_stop_the_wait_for_scores(server):
    """`stop_requested` is asked every STOP_POLL_SECONDS while a request waits for its
    scores: True gives the wait up at once (ScoringStopped), not when the timeout comes, and
    cuts the request's connection. The client serves the next request as usual."""
    client = RewardClient(server.url, timeout=30)
    images = _images(2, seed=6)
    asked: list[float] = []

    def second_time_asked() -> bool:
        asked.append(time.monotonic())
        return len(asked) >= 2

    started = time.monotonic()
    with pytest.raises(ScoringStopped):  # test_slow takes SLOW_SECONDS
        client(["count", "test_slow"], images, PROMPTS[:2], stop_requested=second_time_asked)
    stopped = time.monotonic() - started
    assert len(asked) == 2 and 2 * STOP_POLL_SECONDS <= stopped < SLOW_SECONDS, stopped
    # queued behind the request left behind (test_slow still sleeps), then answered in full;
    # a job's scorer asks the same way (reward_scorer)
    score = reward_scorer(server.url, stop_requested=lambda: False)
    answer = score(["count", "color"], images, PROMPTS[:2])
    local = compute_rewards(["count", "color"], images, PROMPTS[:2])
    for name in ("count", "color"):
        np.testing.assert_array_equal(answer[name], local[name])


class HeldServer:
    """A reward server whose reward "test_held" (held_reward) scores `count` at once for its
    first `at_once` images, then holds each request until `release` is set (on exit): a
    server that takes long to answer a training run's second iteration. `holding` is set
    once it does."""

    def __init__(self, at_once: int) -> None:
        self.at_once = at_once

    def __enter__(self) -> HeldServer:
        self.stack = contextlib.ExitStack()
        _, self.holding, self.release = self.stack.enter_context(held_reward(self.at_once))
        running = self.stack.enter_context(ServerThread(create_app(["test_held"], device="cpu")))
        # on exit, before the server stops: it waits for the held request
        self.stack.callback(self.release.set)
        self.url = running.url
        return self

    def __exit__(self, *exc) -> None:
        self.stack.__exit__(*exc)


HELD_TINY = {**PRESETS["tiny"], "device": "cpu", "iterations": 3, "checkpoint_every": 1000,
             "reward_weights": {"test_held": 1.0}}
PER_ITERATION = HELD_TINY["prompts_per_iteration"] * HELD_TINY["group_size"]


def test_a_stop_while_the_server_scores_gives_the_iteration_up_keeping_nothing_of_it():
    """Trainer.run's `stop_requested` ended an evaluation pass, but an iteration waiting for
    the reward server waited for its answer (or REWARD_SERVER_TIMEOUT, 300 s by default).
    Now True gives that iteration up: ScoringStopped, with the weights, optimizer, iteration
    count and random stream as the iteration before left them (its checkpoint is that one's);
    the trackers' run ends without a failure."""
    with HeldServer(at_once=PER_ITERATION) as server:
        trainer = Trainer(TrainConfig.from_dict({**HELD_TINY, "reward_server_url": server.url}))
        after: list[tuple[torch.Tensor, torch.Tensor]] = []

        def on_iteration(tr: Trainer, result) -> bool:
            after.append((_params(tr.model).clone(), tr.generator.get_state().clone()))
            return False

        finished: list[bool] = []
        trainer.finish_tracking = lambda failed=False: finished.append(failed)
        started = time.monotonic()
        with pytest.raises(ScoringStopped):
            trainer.run(on_iteration, stop_requested=server.holding.is_set)
        assert time.monotonic() - started < 60  # not the held request's release
    assert server.holding.is_set() and trainer.iteration == 1 and len(after) == 1
    params, random_state = after[0]
    assert torch.equal(_params(trainer.model), params)
    assert torch.equal(trainer.generator.get_state(), random_state)
    assert finished == [False]


def test_a_scoring_that_another_process_gave_up_is_given_up_here_too():
    """A run over several processes (trainer.distributed): a rank whose scores came went on
    to its update while another rank, stopped mid-wait, left; it then waited in the gradient
    all-reduce for ever. score_groups' `agree_stop` is asked once the scoring ends, with
    whether this process's was stopped: when any process's was, this one gives the
    iteration up too (ScoringStopped); when none was, the scores are used as ever."""
    from trainer.grpo import score_groups

    config = TrainConfig.from_dict({**PRESETS["tiny"], "device": "cpu"})
    model = Trainer(config).model
    final = torch.randn(2, config.group_size, *model.latent_shape,
                        generator=torch.Generator().manual_seed(0))
    asked: list[bool] = []

    def another_rank_stopped(stopped: bool) -> bool:
        asked.append(stopped)
        return True

    with pytest.raises(ScoringStopped, match="another process"):
        score_groups(model, final, PROMPTS[:2], config, torch.Generator().manual_seed(1),
                     agree_stop=another_rank_stopped)
    assert asked == [False]  # its own scoring finished
    images, raw, advantages = score_groups(model, final, PROMPTS[:2], config,
                                           torch.Generator().manual_seed(1),
                                           agree_stop=lambda stopped: stopped)
    assert advantages.shape == (2, config.group_size) and images.shape[:2] == (2, 4)
    assert set(raw) == set(config.reward_weights)


def test_a_first_ctrl_c_while_the_server_scores_ends_the_run_at_the_iteration_before(tmp_path):
    """`python -m trainer train`: a first Ctrl-C waited for the reward server's answer to end
    the iteration. Now the iteration is given up; the run ends at the one before, with a
    checkpoint of it that --resume continues from."""
    from trainer.loop import latest_checkpoint
    from trainer.run_dir import RunDirectory

    with HeldServer(at_once=PER_ITERATION) as server:
        run = RunDirectory(tmp_path / "run", TrainConfig.from_dict(
            {**HELD_TINY, "reward_server_url": server.url}))
        assert run.train(progress=False, stop_requested=server.holding.is_set) is False
    assert run.trainer.iteration == 1
    assert latest_checkpoint(run.checkpoints_dir).name == "iter-000001"
    assert [r["iteration"] for r in run.records] == [1]


def test_wrong_reward_names_are_422_naming_them(server):
    client = RewardClient(server.url, timeout=10)
    images = _images(2, seed=4)
    with pytest.raises(RewardServerError) as error:
        client(["count", "no_such_reward"], images, PROMPTS[:2])
    message = str(error.value)
    assert "422" in message and "'no_such_reward'" in message and server.url in message
    with pytest.raises(RewardServerError, match=r"\['shape'\] not loaded by this server"):
        client(["shape"], images, PROMPTS[:2])  # known, but this server does not serve it
    with pytest.raises(RewardServerError, match="2 images but 1 prompts"):
        client._request("POST", "/score", json={"rewards": ["count"], "prompts": PROMPTS[:1],
                                                "images": encode_images(images)})
    with pytest.raises(RewardServerError) as error:
        client.check({"count": 1.0, "hpsv2": 1.0, "preference": 1.0})
    message = str(error.value)
    assert "does not serve ['hpsv2']" in message and server.url in message


def test_a_server_that_is_down_is_named(server):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(RewardServerError, match=f"reward server at {url} cannot be reached"):
        RewardClient(url, timeout=5).health()
    with pytest.raises(RewardServerError, match="must be an http"):
        RewardClient("ftp://example.org")


def test_config_takes_an_http_url_and_no_local_weight_paths():
    assert TrainConfig.from_dict({"reward_server_url": "http://rewards:8100"}).reward_server_url
    for bad in ("rewards:8100", "http://", "http://host:99999", "http://h/?q=1"):
        with pytest.raises(ConfigErrors) as error:
            TrainConfig.from_dict({"reward_server_url": bad})
        assert [e.field for e in error.value.errors] == ["reward_server_url"], bad
    with pytest.raises(ConfigErrors) as error:
        TrainConfig.from_dict({"reward_server_url": "http://rewards:8100",
                               "reward_weights": {"hpsv2": 1.0},
                               "reward_model_paths": {"hpsv2": "/weights/hps"}})
    assert [e.field for e in error.value.errors] == ["reward_model_paths"]
    assert reward_scorer("") is compute_rewards


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_training_through_the_server_equals_training_in_process(server):
    tiny = {**PRESETS["tiny"], "device": "cpu", "learning_rate": 1e-4,
            "reward_weights": {"count": 1.0, "color": 0.5}}
    local = Trainer(TrainConfig.from_dict(tiny))
    remote = Trainer(TrainConfig.from_dict({**tiny, "reward_server_url": server.url}))
    before = _health(server)["requests"]
    for _ in range(2):
        a, b = local.step(), remote.step()
        assert a.metrics["reward_mean"] == b.metrics["reward_mean"]
        for name in ("count", "color"):
            np.testing.assert_array_equal(a.rewards[name], b.rewards[name])
    assert torch.equal(_params(local.model), _params(remote.model))
    assert _health(server)["requests"] - before == 2  # one request per iteration

    # a reward the server does not serve fails the job at its start, naming it and the URL
    with pytest.raises(RewardServerError, match=r"does not serve \['shape'\]"):
        Trainer(TrainConfig.from_dict({**tiny, "reward_server_url": server.url,
                                       "reward_weights": {"count": 1.0, "shape": 1.0}}))


def test_the_command_line_serves_and_refuses_unknown_rewards(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    bad = subprocess.run([sys.executable, "-m", "trainer.rewards.serve", "--rewards",
                          "count,nope", "--port", "0"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert bad.returncode == 2 and "unknown reward 'nope'" in bad.stderr
    proc = subprocess.Popen([sys.executable, "-m", "trainer.rewards.serve", "--rewards",
                             "count,jpeg_compressibility", "--port", str(port), "--device",
                             "cpu", "--log-level", "warning"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 90
        while True:
            try:
                health = RewardClient(url, timeout=5).health()
                break
            except RewardServerError:
                assert proc.poll() is None, proc.stderr.read()
                assert time.monotonic() < deadline, "the server did not come up in 90 s"
                time.sleep(0.3)
        assert health["rewards"] == ["count", "jpeg_compressibility"]
        images = _images(2, seed=5)
        answer = RewardClient(url, timeout=30)(["jpeg_compressibility"], images, PROMPTS[:2])
        np.testing.assert_array_equal(
            answer["jpeg_compressibility"],
            compute_rewards(["jpeg_compressibility"], images, PROMPTS[:2])["jpeg_compressibility"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_port_another_process_holds_is_one_line_before_any_reward_loads(capsys,
                                                                         monkeypatch,
                                                                         tmp_path):
    """uvicorn's own error and exit code 3 came only once every reward model had loaded
    (minutes for HPSv2): the port is bound first. hpsv2 has no weights here: that is said
    beside it, from the directory alone, and no model is loaded."""
    import trainer.rewards.models as models
    from trainer.rewards.serve import main

    def no_loading(names: object) -> None:
        raise AssertionError(f"loaded {names} before the start was refused")

    monkeypatch.setattr(models, "load_reward_models", no_loading)
    # (this module's servers' directory holds a tiny hpsv2: one without it)
    monkeypatch.setenv("REWARD_MODELS_DIR", str(tmp_path))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        with pytest.raises(SystemExit) as stopped:
            main(["--rewards", "hpsv2", "--port", str(port), "--device", "cpu"])
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    assert f"cannot listen on 127.0.0.1:{port} (--host/--port)" in lines[0]
    assert "Choose another --port" in lines[0]
    assert lines[1].startswith("reward server: reward 'hpsv2': weights directory "), lines


def test_shapes_rewards_refuse_images_of_another_size_in_process_and_on_the_server(server):
    """count scored 64x64 images 0.5 and exact_count 0 without a word: numbers of a 32x32
    world read off a canvas it does not have. Refused, naming the rewards and the size; an
    image reward still scores any size."""
    big = _images(2, seed=3, size=64)
    with pytest.raises(ValueError, match=r"\['count', 'exact_count'\] score the shapes "
                                         r"world's 32x32 images; these are 64x64"):
        compute_rewards(["count", "exact_count", "jpeg_compressibility"], big, PROMPTS[:2])
    assert compute_rewards(["jpeg_compressibility"], big, PROMPTS[:2])[
        "jpeg_compressibility"].shape == (2,)
    client = RewardClient(server.url, timeout=10)
    with pytest.raises(RewardServerError, match=r"422.*images: \['count'\] score the shapes"):
        client(["count"], big, PROMPTS[:2])
    assert client(["count"], _images(2, seed=3), PROMPTS[:2])["count"].shape == (2,)


def test_zero_size_images_are_422_not_500(server):
    """An (N, 0, 0, 3) array is a well-formed .npy no reward can score: refused as it decodes."""
    client = RewardClient(server.url, timeout=10)
    empty = np.zeros((1, 0, 0, 3), dtype=np.uint8)
    with pytest.raises(RewardServerError, match=r"422.*images must be at least 1x1"):
        client._request("POST", "/score", json={"rewards": ["count"], "prompts": PROMPTS[:1],
                                                "images": encode_images(empty)})
    with pytest.raises(RewardServerError, match=r"422.*images must be at least 1x1"):
        client(["count"], np.zeros((1, 4, 0, 3), dtype=np.uint8), PROMPTS[:1])


def test_a_request_over_max_images_is_413_and_the_client_splits_to_fit():
    """One scoring thread serves every client: a request of more images than --max-images
    held all the others back (20,000 images: ~27 s). It is refused, naming the limit, on both
    routes; the job's client reads the limit from /health and sends requests that fit."""
    import httpx

    app = create_app(["count"], device="cpu", max_images=3)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(7)]
    images = _images(7, seed=2)
    with ServerThread(app) as running:
        body = encode_score_request(["count"], prompts[:4], images[:4])
        r = httpx.post(f"{running.url}/score_npy", content=body,
                       headers={"Content-Type": NPY_MEDIA_TYPE})
        assert r.status_code == 413, r.text
        assert r.json()["detail"] == ("images: 4 images in one request; this server takes at "
                                      "most 3 (--max-images): send them in several requests")
        r = httpx.post(f"{running.url}/score", json={"rewards": ["count"], "prompts": prompts[:4],
                                                     "images": encode_images(images[:4])})
        assert r.status_code == 413 and "at most 3 (--max-images)" in r.json()["detail"]
        client = RewardClient(running.url, timeout=10)
        assert client.health()["max_images"] == 3
        before = client.health()["requests"]
        scores = client(["count"], images, prompts)
        assert client.health()["requests"] - before == 3  # 3 + 3 + 1 images
        np.testing.assert_array_equal(scores["count"],
                                      compute_rewards(["count"], images, prompts)["count"])


@pytest.mark.parametrize("argv, message", [
    (["--max-wait-ms", "inf"], "argument --max-wait-ms: must be a finite number >= 0, got 'inf'"),
    (["--max-wait-ms", "nan"], "argument --max-wait-ms: must be a finite number >= 0, got 'nan'"),
    (["--max-wait-ms", "-1"], "argument --max-wait-ms: must be a finite number >= 0"),
    (["--max-batch", "0"], "argument --max-batch: must be an integer >= 1"),
    (["--device", "gpu"], "argument --device: must be one of auto, cpu, cuda or cuda:N"),
    (["--device", "cuda"], "--device: device 'cuda' requested but CUDA is not available"),
    (["--port", "99999"], "argument --port: must be a port number 0-65535, got '99999'"),
    (["--port", "-1"], "argument --port: must be a port number 0-65535, got '-1'"),
    (["--max-request-mb", "0"], "argument --max-request-mb: must be an integer >= 1"),
    (["--max-images", "0"], "argument --max-images: must be an integer >= 1"),
])
def test_the_servers_bad_options_are_one_line_and_exit_2(argv, message, capsys, monkeypatch):
    """Refused before any reward model loads (hpsv2 has no weights here: not reached)."""
    from trainer.rewards.serve import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(SystemExit) as exited:
        main(["--rewards", "hpsv2", *argv])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err
    # one line of its own (hpsv2's missing weights may be said on another)
    assert any(message in line for line in err.strip().splitlines()), err


def test_the_servers_bad_options_are_said_all_at_once(capsys, monkeypatch, tmp_path):
    """Several bad options were said one a start: only the first, the next once it was
    fixed. Malformed ones are said together (argparse's lines), and so are a port that is
    taken, a device this machine lacks, unknown rewards, weights paths of rewards not
    served and the missing weights of hpsv2 (none here); nothing loads."""
    from trainer.rewards.serve import main

    # (this module's servers' directory holds a tiny hpsv2: one without it)
    monkeypatch.setenv("REWARD_MODELS_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(SystemExit) as exited:
        main(["--rewards", "hpsv2", "--port", "99999", "--max-batch", "0", "--max-wait-ms",
              "nan"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err
    said = [line.split(": error: ")[1] for line in err.splitlines() if ": error: " in line]
    assert said == ["argument --port: must be a port number 0-65535, got '99999'",
                    "argument --max-batch: must be an integer >= 1, got '0'",
                    "argument --max-wait-ms: must be a finite number >= 0, got 'nan'"], err
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        with pytest.raises(SystemExit) as exited:
            main(["--rewards", "hpsv2,nope", "--port", str(port), "--device", "cuda",
                  "--reward-model-paths", "aesthetic=/nowhere"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 5 and all(line.startswith("reward server: ") for line in lines), err
    assert f"cannot listen on 127.0.0.1:{port} (--host/--port)" in lines[0]
    assert "--device: device 'cuda' requested but CUDA is not available" in lines[1]
    assert "unknown reward 'nope'; a server serves: [" in lines[2]
    assert "--reward-model-paths names ['aesthetic'], which --rewards does not serve" in lines[3]
    assert lines[4].startswith("reward server: reward 'hpsv2': weights directory ")


def test_names_paths_and_weights_problems_are_said_in_one_start(capsys, monkeypatch, tmp_path):
    """An unknown name and a path of a reward not served were said first; hpsv2's missing
    weights only on the next start, once those were fixed; a path given to a reward that
    reads no weights only once the names were right (by the config field's name). Every one
    is said at the first start, one line each, before any model loads (the port, 0 here, is
    bound only to see that it is free, and let go)."""
    import trainer.rewards.models as models
    import trainer.rewards.serve as serve

    def refused(*args: object) -> None:
        raise AssertionError("the start went past its checks")

    monkeypatch.setattr(models, "load_reward_models", refused)
    monkeypatch.setenv("REWARD_MODELS_DIR", str(tmp_path / "models"))
    partial = tmp_path / "pick"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as exited:
        serve.main(["--rewards", "count,foo,hpsv2,pickscore", "--device", "cpu", "--port", "0",
                    "--reward-model-paths", f"aesthetic=/x,count=/y,pickscore={partial}"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 5 and all(line.startswith("reward server: ") for line in lines), err
    assert lines[0].startswith("reward server: unknown reward 'foo'; a server serves: [")
    assert lines[1] == ("reward server: --reward-model-paths names ['aesthetic'], which "
                        "--rewards does not serve (count, foo, hpsv2, pickscore)")
    assert lines[2].startswith("reward server: --reward-model-paths names ['count'], which "
                               "read no weights; those that do: ['aesthetic', ")
    hpsv2_dir = str(tmp_path / "models" / "hpsv2")
    assert f"reward 'hpsv2': weights directory {hpsv2_dir!r} (from REWARD_MODELS_DIR) does " \
           "not exist" in lines[3]
    assert f"reward 'pickscore': weights directory {str(partial)!r} (from " \
           "--reward-model-paths pickscore=...) lacks " in lines[4]


def test_serving_preference_is_refused_with_one_reason_and_the_servable_names():
    from trainer.rewards.serve import load_rewards

    with pytest.raises(ValueError) as info:
        load_rewards(["preference", "beauty"], {}, "cpu")
    message = str(info.value)
    assert message.startswith("'preference' is the training job's own model from votes; it "
                              "is scored in the job; unknown reward 'beauty'; a server "
                              "serves: ["), message
    assert "unknown reward 'preference'" not in message and "'count'" in message


def test_the_batcher_refuses_a_wait_that_is_not_finite():
    from trainer.rewards.serve import Batcher

    for wait in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match="max_wait_ms a finite number >= 0"):
            Batcher(4, wait)


def test_a_failure_outside_scoring_fails_its_requests_and_a_dead_thread_takes_none(monkeypatch):
    """A bug while gathering a batch answers the requests taken with its error and leaves the
    thread serving; once the thread is gone, new requests are refused instead of hanging."""
    from trainer.rewards.serve import Batcher

    batcher = Batcher(4, 0)
    batcher.start()
    try:
        def broken(batch):
            raise OverflowError("timeout value is too large")

        monkeypatch.setattr(batcher, "_gather", broken)
        future = batcher.submit(["count"], _images(1, seed=1), PROMPTS[:1])
        with pytest.raises(OverflowError, match="too large"):
            future.result(timeout=10)
        monkeypatch.undo()
        assert batcher.alive()
        answer = batcher.submit(["count"], _images(1, seed=1), PROMPTS[:1]).result(timeout=30)
        assert answer["count"].shape == (1,)
    finally:
        batcher.stop()
    assert not batcher.alive()
    with pytest.raises(RuntimeError, match="scoring thread is not running"):
        batcher.submit(["count"], _images(1, seed=1), PROMPTS[:1])


def _cli_error(argv: list[str], capsys) -> str:
    from trainer.cli import main

    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_train_against_a_server_that_is_down_or_lacks_a_reward_is_one_line(server, tmp_path,
                                                                           capsys):
    """Checked as the Trainer starts, before the run directory is made."""
    from reward_server_helpers import free_port_url

    down = free_port_url()
    out = tmp_path / "run"
    train = ["train", "--config", "tiny", "--set", "device=cpu", "--out", str(out),
             "--no-progress"]
    line = _cli_error([*train, "--set", f"reward_server_url={down}"], capsys)
    assert line.startswith(f"error: reward server at {down} cannot be reached")
    assert not out.exists()
    line = _cli_error([*train, "--set", f"reward_server_url={server.url}", "--set",
                       'reward_weights={"hpsv2": 1.0}'], capsys)
    assert f"reward server at {server.url} does not serve ['hpsv2']" in line
    assert not out.exists()


def test_a_key_given_twice_or_a_body_that_is_not_json_is_422_naming_it(server):
    """Python's json keeps the last of two equal keys: {"rewards": ["nope"], "rewards":
    ["count"]} was scored with count. Refused on both routes, as the studio's API does; a
    malformed body names the body (not "0") and a body sent as text names the header."""
    import httpx

    images = _images(2, seed=2)
    twice = ('{"rewards": ["nope"], "rewards": ["count"], "prompts": '
             + json.dumps(PROMPTS[:2]) + f', "images": "{encode_images(images)}"}}')
    r = httpx.post(server.url + "/score", content=twice, timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["field"] == "body", r.text
    assert "key 'rewards' given twice" in r.json()["detail"], r.text
    npy = encode_score_request(["count"], PROMPTS[:2], images).partition(b"\n")[2]
    r = httpx.post(server.url + "/score_npy", timeout=30, headers={
        "Content-Type": NPY_MEDIA_TYPE}, content=b'{"rewards": ["nope"], "rewards": ["count"], '
        b'"prompts": ["a", "b"]}\n' + npy)
    assert r.status_code == 422 and "key 'rewards' given twice" in r.json()["detail"], r.text
    r = httpx.post(server.url + "/score", content=b"garbage", timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["field"] == "body", r.text
    assert r.json()["detail"].startswith("malformed JSON ("), r.text
    r = httpx.post(server.url + "/score", content=twice.replace('["nope"], "rewards": ', ""),
                   timeout=30, headers={"Content-Type": "text/plain"})
    assert r.status_code == 422 and "Content-Type: application/json" in r.json()["detail"]


def test_asking_a_server_for_preference_says_it_is_the_jobs_own(server):
    client = RewardClient(server.url, timeout=10)
    with pytest.raises(RewardServerError) as error:
        client._request("POST", "/score", json={"rewards": ["preference", "beauty"],
                                                "prompts": PROMPTS[:1],
                                                "images": encode_images(_images(1, seed=0))})
    message = str(error.value)
    assert "unknown reward(s) ['beauty']" in message, message
    assert "['preference']: the training job's own model from votes" in message, message


def test_incomplete_weights_are_named_by_the_servers_flag(tmp_path):
    """`python -m trainer.rewards.serve --reward-model-paths pickscore=DIR`: the message named
    the config field (reward_model_paths['pickscore']), not the flag typed."""
    from trainer.rewards.serve import load_rewards

    partial = tmp_path / "pick"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError) as error:  # RewardWeightsMissing
        load_rewards(["pickscore"], {"pickscore": str(partial)}, "cpu")
    message = str(error.value)
    assert f"{str(partial)!r} (from --reward-model-paths pickscore=...) lacks " in message
    assert "reward_model_paths[" not in message


def test_a_weights_path_for_a_reward_not_served_is_refused():
    from trainer.rewards.serve import load_rewards

    with pytest.raises(ValueError, match=r"--reward-model-paths names \['pickscore'\], which "
                                         r"--rewards does not serve \(count\)"):
        load_rewards(["count"], {"pickscore": "/nowhere"}, "cpu")


def test_evaluate_scores_through_a_reward_server_as_in_process(server, tmp_path, capsys):
    """`python -m trainer evaluate --reward-server-url` scores there what a job's
    reward_server_url would; the numbers equal the in-process evaluation's."""
    from trainer.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:2]) + "\n")
    common = ["evaluate", "--device", "cpu", "--seeds", "1", "--steps", "2", "--prompts-file",
              str(prompts), "--rewards", "count,jpeg_compressibility"]
    assert main([*common, "--reward-server-url", server.url,
                 "--out", str(tmp_path / "served.json")]) == 0
    before = _health(server)["requests"]
    assert main([*common, "--out", str(tmp_path / "local.json")]) == 0
    assert _health(server)["requests"] == before  # the second ran in process
    served, local = (json.loads((tmp_path / f"{n}.json").read_text())["rewards"]
                     for n in ("served", "local"))
    assert served == local and set(served) == {"count", "jpeg_compressibility"}
    capsys.readouterr()
    assert main([*common, "--reward-server-url", "ftp://x"]) == 2
    assert "--reward-server-url" in capsys.readouterr().err
    assert main([*common[:-1], "count,hpsv2", "--reward-server-url", server.url]) == 2
    assert "does not serve ['hpsv2']" in capsys.readouterr().err


def test_a_server_that_fails_mid_run_stops_train_with_exit_1_and_the_resume(tmp_path, capsys):
    """A server lost mid-run was exit 2 (a command-line mistake's) with no word of the run's
    checkpoint: the run failed, and `--resume` goes on from where it stopped."""
    from trainer.cli import main

    calls = []

    def fails_after_the_first_iteration(images: np.ndarray, prompts: list[str]) -> np.ndarray:
        calls.append(len(images))
        if len(calls) > 1:
            raise RuntimeError("the scoring card went away")
        return np.zeros(len(images), dtype=np.float32)

    register_reward("test_fails_later", fails_after_the_first_iteration)
    try:
        with ServerThread(create_app(["count", "test_fails_later"], device="cpu",
                                     max_wait_ms=0)) as running:
            out = tmp_path / "run"
            code = main(["train", "--config", "tiny", "--set", "device=cpu", "--set",
                         "iterations=3", "--set", "checkpoint_every=1", "--set",
                         f"reward_server_url={running.url}", "--set",
                         'reward_weights={"count": 1.0, "test_fails_later": 1.0}',
                         "--out", str(out), "--no-progress"])
    finally:
        registry._REWARDS.pop("test_fails_later", None)
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    assert "(at iteration 2; checkpoint " in err and "iter-000001" in err, err
    assert f"continue with `python -m trainer train --resume --out {out}`" in err
