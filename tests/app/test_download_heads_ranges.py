"""Download routes as download managers and players use them: HEAD first (the size and name
before the bytes), then ranges. HEAD answers what GET answers, headers without the body, with
the same auth; a Range header that is not a bytes range (or not one at all) is ignored (RFC
9110 §14.2: 200, the whole file), a valid one still gets its 206 and one past the end its 416.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

WEIGHTS = b"0123456789abcdef"  # 16 bytes: the ranges below are easy to read
PREFERENCE = b"preference weights v1"
MEDIA = b"\x89PNG, or its first bytes"


@dataclass
class Stored:
    media: str
    checkpoint: str
    preference: str
    dataset_export: str
    votes_export: str


@pytest.fixture
def stored(client, admin, session, vote_seeder) -> Stored:
    """One download of each kind: a stored file, a checkpoint (its weights and its directory),
    a preference model, a dataset and some votes."""
    from app.services import checkpoints, jobs, storage
    from app.services.preference import record_model

    storage.write_bytes("media-test/picture.png", MEDIA)
    job = jobs.create_job(session, "train", {"iterations": 2}, preset="tiny")
    session.commit()
    rel = f"checkpoints/job-{job.id}/iter-000001/model.safetensors"
    storage.write_bytes(rel, WEIGHTS)
    storage.write_bytes(f"checkpoints/job-{job.id}/iter-000001/README.md", b"# card\n")
    ckpt_id = checkpoints.record_checkpoint(session, job.id, 1, rel)
    storage.write_bytes("preference/v1.safetensors", PREFERENCE)
    record_model(session, version=1, path="preference/v1.safetensors", report={})
    session.commit()
    r = client.post("/api/datasets", headers=admin,
                    files={"file": ("p.txt", b"two red circles\none blue square\n",
                                    "text/plain")})
    assert r.status_code == 201, r.text
    vote_seeder(3)
    return Stored(media="/api/media/media-test/picture.png",
                  checkpoint=f"/api/checkpoints/{ckpt_id}/download",
                  preference="/api/preference-models/v1/download",
                  dataset_export=f"/api/datasets/{r.json()['id']}/export",
                  votes_export="/api/votes/export")


# (which download, query): every download route, each of its formats
DOWNLOADS = [
    ("media", ""),
    ("checkpoint", ""),
    ("checkpoint", "?format=zip"),
    ("preference", ""),
    ("dataset_export", ""),
    ("dataset_export", "?format=csv"),
    ("votes_export", ""),
    ("votes_export", "?format=parquet"),
]


@pytest.mark.parametrize(("which", "query"), DOWNLOADS)
def test_head_answers_what_get_answers_without_the_body(client, admin, annotator, stored,
                                                        which, query):
    url = getattr(stored, which) + query
    for who, headers in (("admin", admin), ("annotator", annotator)):
        got = client.get(url, headers=headers)
        head = client.head(url, headers=headers)
        assert head.status_code == got.status_code, (who, head.status_code, got.text)
        assert head.content == b"", who
        assert dict(head.headers) == dict(got.headers), who
        if "content-length" in got.headers:  # a streamed export has none, on either
            assert int(head.headers["content-length"]) == len(got.content), who
        # a download, not an error (an annotator's votes export is their own votes: none)
        assert got.status_code == 200 and (got.content or who == "annotator"), who
    assert client.get(url).status_code == 401
    assert client.head(url).status_code == 401
    assert client.head(url, headers={"Authorization": "Bearer nope"}).status_code == 401


@pytest.mark.parametrize("which", ["media", "checkpoint", "preference"])
def test_a_range_header_that_is_not_a_bytes_range_is_ignored(client, annotator, stored, which):
    url = getattr(stored, which)
    content = {"media": MEDIA, "checkpoint": WEIGHTS, "preference": PREFERENCE}[which]
    whole = client.get(url, headers=annotator)
    assert whole.status_code == 200 and whole.content == content
    for value in ("bytes=abc", "items=0-1", "bytes", "bytes=", "bytes=5-3", "bytes=-"):
        for method in ("GET", "HEAD"):
            r = client.request(method, url, headers={**annotator, "Range": value})
            assert r.status_code == 200, (value, method, r.status_code, r.text)
            assert dict(r.headers) == dict(whole.headers), (value, method)
            assert r.content == (content if method == "GET" else b""), (value, method)

    # a valid range still gets its part, and one past the end its 416 (Starlette's answers)
    part = client.get(url, headers={**annotator, "Range": "bytes=0-3"})
    assert part.status_code == 206 and part.content == content[:4]
    assert part.headers["content-range"] == f"bytes 0-3/{len(content)}"
    assert part.headers["content-length"] == "4"
    head = client.head(url, headers={**annotator, "Range": "bytes=0-3"})
    assert head.status_code == 206 and head.content == b""
    assert head.headers["content-length"] == "4"
    tail = client.get(url, headers={**annotator, "Range": "bytes=-2"})
    assert tail.status_code == 206 and tail.content == content[-2:]
    past = client.get(url, headers={**annotator, "Range": f"bytes={len(content)}-"})
    assert past.status_code == 416
    assert past.headers["content-range"] == f"bytes */{len(content)}"
    # still a file route: a Range buys nothing without a token
    assert client.get(url, headers={"Range": "bytes=abc"}).status_code == 401
    assert client.get(url, headers={"Range": "bytes=0-3"}).status_code == 401


@pytest.mark.parametrize(("which", "query"), [d for d in DOWNLOADS if d[0] in (
    "dataset_export", "votes_export") or d[1] == "?format=zip"])
def test_a_generated_download_says_it_takes_no_ranges(client, admin, stored, which, query):
    """An export or a zip is made whole for each request: a Range gets the whole body with a
    200 (never a 206 of a body that is not the part), and every answer says
    `Accept-Ranges: none`, so a download manager does not ask for parts."""
    url = getattr(stored, which) + query
    whole = client.get(url, headers=admin)
    assert whole.status_code == 200 and whole.headers["accept-ranges"] == "none"
    for value in ("bytes=0-3", "bytes=999999999-"):
        for method in ("GET", "HEAD"):
            r = client.request(method, url, headers={**admin, "Range": value})
            assert r.status_code == 200 and r.headers["accept-ranges"] == "none", (value, method)
            assert "content-range" not in r.headers
    # a stored file takes them, as before
    assert client.get(stored.checkpoint, headers=admin).headers["accept-ranges"] == "bytes"


def test_each_head_route_has_its_own_operation_id(client):
    """One route of two methods would give GET and HEAD one id in the schema."""
    spec = client.get("/openapi.json").json()
    ids = [op["operationId"] for item in spec["paths"].values() for op in item.values()
           if isinstance(op, dict) and "operationId" in op]
    assert len(ids) == len(set(ids))
    for path in ("/api/media/{path}", "/api/checkpoints/{checkpoint_id}/download",
                 "/api/preference-models/{version}/download",
                 "/api/datasets/{dataset_id}/export", "/api/votes/export"):
        assert {"get", "head"} <= set(spec["paths"][path]), path
