"""Every export is strict JSON (issue 14): NaN and Infinity are not JSON, so non-finite metadata
numbers (NaN, 1e400, a parquet NaN) leave as null, in the jsonl and in the csv's metadata
column, as GET /api/prompts shows them."""

from __future__ import annotations

import csv
import io
import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy import insert


def raise_on_constant(name: str) -> None:
    raise ValueError(f"not JSON: {name}")


def strict(text: str) -> object:
    return json.loads(text, parse_constant=raise_on_constant)


def upload(client, headers, filename: str, data: bytes):
    r = client.post("/api/datasets", files={"file": (filename, data, "application/octet-stream")},
                    headers=headers)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def exports(client, headers, dataset_id: int) -> tuple[list, list]:
    """(jsonl rows, csv rows with their metadata parsed), both strictly."""
    jl = client.get(f"/api/datasets/{dataset_id}/export?format=jsonl", headers=headers)
    assert jl.status_code == 200
    rows = [strict(line) for line in jl.text.splitlines()]
    cs = client.get(f"/api/datasets/{dataset_id}/export?format=csv", headers=headers)
    assert cs.status_code == 200
    table = list(csv.DictReader(io.StringIO(cs.text, newline="")))
    for r in table:
        r["metadata"] = strict(r["metadata"]) if r["metadata"] else None
    return rows, table


def listed(client, headers, dataset_id: int) -> list:
    r = client.get("/api/prompts", params={"dataset_id": dataset_id}, headers=headers)
    return [p["metadata"] for p in strict(r.text)["items"]]


def test_jsonl_upload_with_non_finite_numbers_exports_null(client, admin):
    data = (b'{"prompt": "a", "nan": NaN, "inf": Infinity, "ninf": -Infinity, "big": 1e400, '
            b'"ok": 1.5, "nested": {"l": [1e400, -1e400, 2], "n": NaN}}\n'
            b'{"prompt": "b", "big": -1e400}\n')
    ds = upload(client, admin, "m.jsonl", data)
    want = [{"nan": None, "inf": None, "ninf": None, "big": None, "ok": 1.5,
             "nested": {"l": [None, None, 2], "n": None}}, {"big": None}]
    rows, table = exports(client, admin, ds)
    assert [r["metadata"] for r in rows] == want
    assert [r["metadata"] for r in table] == want
    assert listed(client, admin, ds) == want


def test_csv_upload_keeps_nan_text_as_text(client, admin):
    # csv values are text: "nan" and "1e400" stay strings, which JSON holds fine
    ds = upload(client, admin, "m.csv", b"prompt,x,y\na,nan,1e400\nb,-inf,Infinity\n")
    want = [{"x": "nan", "y": "1e400"}, {"x": "-inf", "y": "Infinity"}]
    rows, table = exports(client, admin, ds)
    assert [r["metadata"] for r in rows] == want
    assert [r["metadata"] for r in table] == want
    assert listed(client, admin, ds) == want


def test_parquet_upload_with_nan_and_inf_exports_null(client, admin):
    buf = io.BytesIO()
    pq.write_table(pa.table({"prompt": ["a", "b", "c"],
                             "score": [math.nan, math.inf, 0.25],
                             "v": [[1.0, math.nan], [-math.inf], []]}), buf)
    ds = upload(client, admin, "m.parquet", buf.getvalue())
    want = [{"score": None, "v": [1.0, None]}, {"score": None, "v": [None]},
            {"score": 0.25, "v": []}]
    rows, table = exports(client, admin, ds)
    assert [r["metadata"] for r in rows] == want
    assert [r["metadata"] for r in table] == want
    assert listed(client, admin, ds) == want


def test_rows_stored_with_nan_before_the_fix_export_null(client, admin, session):
    from app.models import Prompt

    ds = upload(client, admin, "old.txt", b"a\n")
    if session.get_bind().dialect.name != "sqlite":
        return  # PostgreSQL's json type never accepted NaN: no such rows there
    session.execute(insert(Prompt), [{"dataset_id": ds, "position": 1, "text": "b",
                                      "split": "train", "meta": {"x": math.nan, "y": [math.inf]}}])
    session.commit()
    rows, table = exports(client, admin, ds)
    assert [r["metadata"] for r in rows] == [None, {"x": None, "y": [None]}]
    assert [r["metadata"] for r in table] == [None, {"x": None, "y": [None]}]


def test_vote_export_is_strict_json(client, admin, annotator, make_group):
    make_group(g=3)
    outcomes = ["a", "b", "tie"]
    for i, outcome in enumerate(outcomes):
        pair = client.get("/api/votes/next", headers=annotator).json()
        r = client.post("/api/votes", headers=annotator, json={
            "client_vote_id": f"v{i}", "sample_a_id": pair["a"]["sample_id"],
            "sample_b_id": pair["b"]["sample_id"], "outcome": outcome})
        assert r.status_code == 201, r.text
    jl = client.get("/api/votes/export?format=jsonl", headers=admin)
    assert jl.status_code == 200
    rows = [strict(line) for line in jl.text.splitlines()]
    assert [r["outcome"] for r in rows] == outcomes
    assert all(r["created_at"].endswith("Z") and r["shown_at"] is None for r in rows)
