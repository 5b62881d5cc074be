"""Every request body has a size limit that holds before the body is read whole: a real
uvicorn server, a raw socket sending chunked bodies (no Content-Length) that never end.

Before the limit existed, a 200 MB chunked vote without a token was read whole before its 401,
a chunked body to the UI's queue was kept in memory whatever its size, and an admin's chunked
dataset upload was received whole before its 413."""

from __future__ import annotations

import select
import socket
from urllib.parse import urlsplit

import pytest

from trainer.rewards.serve import ServerThread

CHUNK = 64 * 1024
NEVER_ENDING = 200 * 1024 * 1024  # what a client would send if nobody stopped it
# what may be in flight when the server answers: the socket buffers of both ends, the chunk
# being read (far below NEVER_ENDING, far above the limits the tests set)
IN_FLIGHT = 24 * 1024 * 1024


@pytest.fixture
def server(settings, monkeypatch):
    """The studio as served (UI mounted), MAX_REQUEST_BYTES 64 KiB, MAX_UPLOAD_BYTES 2,000."""
    from app.config import get_settings
    from app.main import create_app

    monkeypatch.setenv("MAX_REQUEST_BYTES", str(64 * 1024))
    monkeypatch.setenv("MAX_UPLOAD_BYTES", "2000")
    get_settings.cache_clear()
    app = create_app(get_settings(), enqueuer=lambda job_id, kind: None, mount_ui=True)
    with ServerThread(app) as running:
        yield running.url


def send_chunked(url: str, path: str, headers: dict[str, str], chunk: bytes = b"x" * CHUNK,
                 first: bytes = b"") -> tuple[int, bytes, int]:
    """POST a chunked body that goes on until the server answers (or NEVER_ENDING bytes).
    Returns the status, the response's head and body as far as read, and the bytes sent."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    head = "".join(f"{k}: {v}\r\n" for k, v in {
        "Host": parts.netloc, "Transfer-Encoding": "chunked", **headers}.items())
    sock.sendall(f"POST {path} HTTP/1.1\r\n{head}\r\n".encode())
    sent, answer = 0, b""
    try:
        for piece in [first] * bool(first) + [chunk] * (NEVER_ENDING // len(chunk)):
            if select.select([sock], [], [], 0)[0]:
                break  # the server has answered
            sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            sent += len(piece)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server closed the connection after answering
    sock.settimeout(30)
    try:
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    except (ConnectionResetError, TimeoutError):
        pass
    finally:
        sock.close()
    return int(answer.split(b" ", 2)[1]), answer, sent


def test_a_chunked_body_is_401_without_a_token_and_413_past_the_limit(server, annotator):
    # without a token, the 401 comes before the body is read (app/api/strict_json.py)
    status, answer, sent = send_chunked(server, "/api/votes",
                                        {"Content-Type": "application/json"})
    assert status == 401, answer
    assert sent < IN_FLIGHT, f"the server read {sent} bytes before answering"
    status, answer, sent = send_chunked(server, "/api/votes",
                                        {**annotator, "Content-Type": "application/json"})
    assert status == 413, answer
    assert b"MAX_REQUEST_BYTES" in answer and b'"field":"body"' in answer
    assert sent < IN_FLIGHT, f"the server read {sent} bytes before answering"


def test_the_uis_queue_takes_no_endless_body(server):
    status, answer, sent = send_chunked(server, "/ui/gradio_api/queue/join",
                                        {"Content-Type": "application/json"})
    assert status == 413, answer
    assert sent < IN_FLIGHT


def test_a_chunked_dataset_upload_is_cut_off_at_max_upload_bytes(server, admin):
    boundary = "b0undary"
    first = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
             f"filename=\"p.txt\"\r\nContent-Type: text/plain\r\n\r\n").encode()
    status, answer, sent = send_chunked(
        server, "/api/datasets",
        {"Content-Type": f"multipart/form-data; boundary={boundary}", **admin},
        chunk=b"a red circle\n" * 5000, first=first)
    assert status == 413, answer
    assert b"MAX_UPLOAD_BYTES" in answer
    assert sent < IN_FLIGHT


def test_a_declared_length_over_the_limit_is_refused_before_the_body(server):
    import httpx

    # the header says 100 MB; the 413 comes without one byte of the body sent
    parts = urlsplit(server)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(f"POST /api/votes HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {100 * 1024 * 1024}\r\n\r\n".encode())
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413"), answer
    assert b"104857600 bytes" in answer
    # bodies under the limit are untouched: a malformed vote is still the route's own answer
    r = httpx.post(f"{server}/api/votes", json={"outcome": "a"})
    assert r.status_code == 401


def test_an_annotator_cannot_upload_files_through_the_ui(server, annotator, admin):
    import httpx

    files = {"files": ("p.txt", b"a red circle\n", "text/plain")}
    assert httpx.post(f"{server}/ui/gradio_api/upload", files=files,
                      headers=annotator).status_code == 403
    assert httpx.post(f"{server}/ui/gradio_api/upload", files=files,
                      headers=admin).status_code == 200
