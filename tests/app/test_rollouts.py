from __future__ import annotations

import pytest


def test_record_group_and_browse(client, admin, annotator, make_group, settings):
    job = client.post("/api/jobs", json={"kind": "train", "preset": "tiny"}, headers=admin).json()
    gid = make_group(job["id"], iteration=2, g=4)
    assert make_group(job["id"], iteration=2, g=4) == gid  # idempotent re-record
    make_group(job["id"], iteration=3, prompt="three green triangles")
    page = client.get("/api/rollouts", params={"job_id": job["id"], "iteration": 2},
                      headers=annotator).json()
    assert page["total"] == 1
    group = client.get(f"/api/rollouts/{gid}", headers=annotator).json()
    assert group["purpose"] == "train" and group["prompt_text"] == "two red circles"
    assert [s["member_index"] for s in group["samples"]] == [0, 1, 2, 3]
    assert [s["advantage"] for s in group["samples"]] == [-1.5, -0.5, 0.5, 1.5]
    assert group["samples"][3]["rewards"] == {"count": 0.75}
    assert group["samples"][0]["is_anchor"] is True
    by_prompt = client.get("/api/rollouts", params={"prompt": "three green triangles"},
                           headers=annotator).json()
    assert by_prompt["total"] == 1 and by_prompt["items"][0]["iteration"] == 3

    img = client.get(group["samples"][1]["image_url"], headers=annotator)
    assert img.status_code == 200 and img.content.startswith(b"\x89PNG")
    assert img.headers["content-type"] == "image/png"
    assert "max-age=86400" in img.headers["cache-control"]
    assert "etag" in img.headers and "last-modified" in img.headers
    path = settings.resolved_storage_dir / group["samples"][1]["image_url"].removeprefix("/api/media/")
    assert path.read_bytes() == img.content
    # a browser revalidating what it holds gets a 304 without the bytes; another tag, the file
    held = client.get(group["samples"][1]["image_url"], headers={
        **annotator, "If-None-Match": img.headers["etag"]})
    assert held.status_code == 304 and held.content == b""
    assert held.headers["etag"] == img.headers["etag"] and "immutable" in held.headers["cache-control"]
    other = client.get(group["samples"][1]["image_url"], headers={
        **annotator, "If-None-Match": '"not-this-one"'})
    assert other.status_code == 200 and other.content == img.content
    # without a token, a held tag changes nothing: still a 401
    assert client.get(group["samples"][1]["image_url"],
                      headers={"If-None-Match": img.headers["etag"]}).status_code == 401
    assert client.get(group["samples"][1]["image_url"]).status_code == 401
    # HEAD: the size and tag without the bytes, and still only with a token
    head = client.head(group["samples"][1]["image_url"], headers=annotator)
    assert head.status_code == 200 and head.content == b""
    assert int(head.headers["content-length"]) == len(img.content)
    assert head.headers["etag"] == img.headers["etag"]
    assert client.head(group["samples"][1]["image_url"]).status_code == 401
    assert client.get("/api/rollouts/99999", headers=annotator).status_code == 404


def test_a_filter_naming_what_does_not_exist_is_a_404_naming_each(client, admin, annotator,
                                                                  make_group):
    """job_id, prompt_id and checkpoint_id filters alike: an unknown one is a 404 naming it
    (checkpoint_id and prompt_id answered an empty page, which reads as "none yet"), every
    unknown one at once; a known one with no groups is still an empty page."""
    job = client.post("/api/jobs", json={"kind": "train", "preset": "tiny"}, headers=admin).json()
    make_group(job["id"], iteration=1, g=2)
    for params, fields in (({"checkpoint_id": 999999}, ["checkpoint_id"]),
                           ({"prompt_id": 999999}, ["prompt_id"]),
                           ({"job_id": 999999, "checkpoint_id": 888888},
                            ["job_id", "checkpoint_id"])):
        r = client.get("/api/rollouts", params=params, headers=annotator)
        assert r.status_code == 404, (params, r.text)
        body = r.json()
        assert [e["field"] for e in body["errors"]] == fields and body["field"] == fields[0]
        for value in params.values():
            assert f"{value} not found" in body["detail"]
    known = client.get("/api/rollouts", params={"job_id": job["id"], "iteration": 7},
                       headers=annotator)
    assert known.status_code == 200 and known.json()["total"] == 0


def test_record_group_rejects_non_png_and_writes_nothing(session, settings):
    from app.errors import Invalid
    from app.services.rollouts import record_rollout_group

    with pytest.raises(Invalid, match="not PNG"):
        record_rollout_group(session, job_id=None, iteration=0, prompt_text="x", solver="euler",
                             steps=4, sigma=0.1, seed=0,
                             samples=[{"png": b"GIF89a", "member_index": 0, "rewards": {}}])
    assert not list(settings.resolved_storage_dir.rglob("*.png"))


@pytest.mark.parametrize("url", [
    "/api/media/..%2F..%2F..%2Fetc%2Fpasswd",
    "/api/media/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
    "/api/media/rollouts/..%2F..%2Fsecret.txt",
    "/api/media/%2Fetc%2Fpasswd",
    "/api/media//etc/passwd",
    "/api/media/link/secret.txt",
    "/api/media/",
])
def test_media_path_traversal_refused(client, annotator, settings, url):
    secret = settings.resolved_storage_dir.parent / "secret.txt"
    secret.write_text("top secret")
    (settings.resolved_storage_dir / "rollouts").mkdir(parents=True, exist_ok=True)
    link = settings.resolved_storage_dir / "link"
    if not link.exists():
        link.symlink_to(settings.resolved_storage_dir.parent)
    r = client.get(url, headers=annotator)
    assert r.status_code == 404, (url, r.status_code)
    assert b"secret" not in r.content and b"root:" not in r.content
