"""Downloading a fitted preference model by its version as the list gives it (3) and as job
configs spell it (`preference_model: "v3"`)."""

from __future__ import annotations


def test_a_preference_model_downloads_by_either_spelling_of_its_version(client, annotator,
                                                                        settings):
    from app.db import session_scope
    from app.services.preference import record_model

    stored = settings.resolved_storage_dir / "preference" / "v3.safetensors"
    stored.parent.mkdir(parents=True, exist_ok=True)
    stored.write_bytes(b"weights of v3")
    with session_scope() as s:
        record_model(s, version=3, path="preference/v3.safetensors", report={})
    for spelling in ("3", "v3"):
        r = client.get(f"/api/preference-models/{spelling}/download", headers=annotator)
        assert r.status_code == 200 and r.content == b"weights of v3", (spelling, r.text)
    # however it is spelled, a missing version is named one way
    for spelling, named in (("v4", "v4"), ("4", "v4"), ("v0", "v0"), ("0", "v0"), ("004", "v4")):
        r = client.get(f"/api/preference-models/{spelling}/download", headers=annotator)
        assert r.status_code == 404 and r.json()["detail"] == f"preference model {named} not found"
    r = client.get("/api/preference-models/latest/download", headers=annotator)
    assert r.status_code == 422 and r.json()["field"] == "version"
    assert client.get("/api/preference-models/v3/download").status_code == 401
