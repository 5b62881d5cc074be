from __future__ import annotations

import io
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sqlalchemy import func, select


def _parquet(table: dict) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table(table), buf)
    return buf.getvalue()


def upload(client, headers, filename, data, **form):
    return client.post("/api/datasets", files={"file": (filename, data, "application/octet-stream")},
                       data={k: str(v) for k, v in form.items()}, headers=headers)


def counts(session):
    from app.models import Dataset, Prompt

    return (session.scalar(select(func.count()).select_from(Dataset)),
            session.scalar(select(func.count()).select_from(Prompt)))


GOOD = {
    "p.txt": b"one red circle\n  one   red circle \ntwo blue squares\n\n",
    "p.csv": b"prompt,source\none red circle,a\n\"one red  circle\",b\ntwo blue squares,c\n",
    "p.jsonl": b'{"prompt": "one red circle", "k": 1}\n{"prompt": "one red circle"}\n'
               b'{"prompt": "two blue squares"}\n',
    # HPSv2's benchmark files: a JSON array of strings; HPDv2's train.json: objects with more keys
    "p.json": b'["one red circle", "one red  circle", "two blue squares"]',
    "p2.json": json.dumps([{"prompt": "one red circle", "image_path": ["a.jpg", "b.jpg"],
                            "human_preference": [1, 0]},
                           {"prompt": "one red circle"}, {"prompt": "two blue squares"}]).encode(),
    "p.parquet": _parquet({"prompt": ["one red circle", "one red circle ", "two blue squares"],
                           "score": [1, 2, 3]}),
}


@pytest.mark.parametrize("name", list(GOOD))
def test_upload_each_format_dedupes(client, admin, session, name):
    r = upload(client, admin, name, GOOD[name])
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["num_prompts"] == 2 and body["duplicates_dropped"] == 1
    assert body["blank_lines_skipped"] == (1 if name == "p.txt" else 0)  # p.txt's last line
    assert body["format"] == name.split(".")[1]
    prompts = client.get("/api/prompts", params={"dataset_id": body["id"]}, headers=admin).json()
    assert [p["text"] for p in prompts["items"]] == ["one red circle", "two blue squares"]
    if name == "p.csv":
        assert prompts["items"][0]["metadata"] == {"source": "a"}
    if name == "p.parquet":
        assert prompts["items"][1]["metadata"] == {"score": 3}
    if name == "p2.json":
        assert prompts["items"][0]["metadata"] == {"image_path": ["a.jpg", "b.jpg"],
                                                   "human_preference": [1, 0]}


def test_eval_split_and_get_list_export(client, admin):
    data = "\n".join(f"prompt number {i}" for i in range(100)).encode()
    r = upload(client, admin, "many.txt", data, eval_fraction=0.2, name="many")
    assert r.status_code == 201
    ds = r.json()
    assert (ds["num_prompts"], ds["num_eval"], ds["name"]) == (100, 20, "many")
    ev = client.get("/api/prompts", params={"dataset_id": ds["id"], "split": "eval"},
                    headers=admin).json()
    assert ev["total"] == 20
    assert client.get(f"/api/datasets/{ds['id']}", headers=admin).json()["id"] == ds["id"]
    assert client.get("/api/datasets", headers=admin).json()["total"] == 1
    r = upload(client, admin, "zero.txt", b"a cat\n", eval_fraction="-0", name="zero")
    assert r.status_code == 201 and str(r.json()["eval_fraction"]) == "0.0", r.text
    exp = client.get(f"/api/datasets/{ds['id']}/export", headers=admin)
    rows = [json.loads(line) for line in exp.text.splitlines()]
    assert len(rows) == 100 and sum(r["split"] == "eval" for r in rows) == 20
    csv_exp = client.get(f"/api/datasets/{ds['id']}/export?format=csv", headers=admin)
    assert csv_exp.text.splitlines()[0] == "id,prompt,split,metadata"
    assert client.get("/api/datasets/999999", headers=admin).status_code == 404


def test_prompt_pagination_and_search(client, admin):
    data = "\n".join([f"a red circle {i}" for i in range(30)] + ["BLUE 50% square"]).encode()
    ds = upload(client, admin, "s.txt", data).json()["id"]
    page = client.get("/api/prompts", params={"dataset_id": ds, "limit": 10, "offset": 25},
                      headers=admin).json()
    assert page["total"] == 31 and len(page["items"]) == 6
    assert page["items"][0]["text"] == "a red circle 25"
    hit = client.get("/api/prompts", params={"q": "blue 50%"}, headers=admin).json()
    assert [p["text"] for p in hit["items"]] == ["BLUE 50% square"]
    assert client.get("/api/prompts", params={"q": "%"}, headers=admin).json()["total"] == 1


def test_prompt_search_wildcards_are_literal(client, admin):
    upload(client, admin, "w.txt", b"a_b\naxb\n100% red\n1000 red\nback\\slash\nbackslash\n")

    def found(q):
        r = client.get("/api/prompts", params={"q": q}, headers=admin)
        assert r.status_code == 200, r.text
        return [p["text"] for p in r.json()["items"]]

    assert found("a_b") == ["a_b"]
    assert found("_") == ["a_b"]
    assert found("0%") == ["100% red"]
    assert found("%%") == []
    assert found("k\\s") == ["back\\slash"]


def test_prompt_search_refuses_nul(client, admin):
    upload(client, admin, "n.txt", b"one\ntwo\n")
    for q in ("\x00", "one\x00", "%\x00"):
        r = client.get("/api/prompts", params={"q": q}, headers=admin)
        assert r.status_code == 422, r.text
        assert r.json() == {"detail": "q: must not contain NUL characters", "field": "q",
                            "errors": [{"field": "q", "message": "must not contain NUL characters"}]}


def test_prompt_search_folds_accented_capitals(client, admin):
    """On SQLite (the demo's database) lower() folded ASCII letters only: "Éclair au café"
    was found by "café" but not by "Éclair", typed exactly as stored, nor by "éclair"."""
    upload(client, admin, "u.txt", "Éclair au café\nÜber STRASSE\nplain eclair\n".encode())

    def found(q):
        r = client.get("/api/prompts", params={"q": q}, headers=admin)
        assert r.status_code == 200, r.text
        return [p["text"] for p in r.json()["items"]]

    for q in ("Éclair", "éclair", "ÉCLAIR AU CAFÉ"):
        assert found(q) == ["Éclair au café"], q
    assert found("über") == found("ÜBER s") == ["Über STRASSE"]
    assert found("eclair") == ["plain eclair"]  # an accent is a letter of its own


def test_prompt_search_names_a_nul_beside_the_other_parameters(client, admin):
    """A NUL was refused by the service once the parameters had passed: a bad split came
    back alone, and the NUL only on the next try. One 422 names both."""
    r = client.get("/api/prompts", params={"q": "a\x00", "split": "bogus"}, headers=admin)
    assert r.status_code == 422, r.text
    assert {e["field"] for e in r.json()["errors"]} == {"q", "split"}, r.json()


BAD = [
    ("long.txt", b"ok\n" + b"x" * 2001 + b"\n", 422, "long.txt: line 2: prompt too long"),
    ("nocol.csv", b"text,other\nhello,1\n", 422, "nocol.csv: line 1: missing column 'prompt'"),
    ("rag.csv", b"prompt,a\nhello,1\nbad,1,2\n", 422, "rag.csv: line 3 (row 2): malformed row"),
    # a repeated column's values were dropped (metadata by name), a repeated prompt picked one
    ("dup.csv", b"prompt,x, x\nhello,1,2\n", 422, "dup.csv: line 1: repeated column name(s) 'x'"),
    ("dup2.csv", b"prompt,prompt\na,b\n", 422,
     "dup2.csv: line 1: repeated column name(s) 'prompt'"),
    ("dup3.csv", b"prompt,,\nhello,1,2\n", 422, "dup3.csv: line 1: repeated column name(s) ''"),
    ("q.csv", b'prompt\n"unterminated\n', 422,
     "q.csv: line 2 (row 1): malformed row: unexpected end of data"),
    ("enc.txt", b"fine\nbad \xff\xfe byte\n", 422, "enc.txt: line 2: bad encoding"),
    ("m.jsonl", b'{"prompt": "ok"}\n{"prompt": oops}\n', 422, "m.jsonl: line 2: malformed JSON"),
    ("k.jsonl", b'{"prompt": "ok"}\n{"text": "x"}\n', 422, "k.jsonl: line 2: missing key 'prompt'"),
    ("n.jsonl", b'{"prompt": "ok"}\n[1]\n', 422, "n.jsonl: line 2: expected a JSON object"),
    ("e.jsonl", b'{"prompt": "ok"}\n{"prompt": "  "}\n', 422, "e.jsonl: line 2: empty prompt"),
    ("e2.jsonl", b'{"prompt": "ok"}\n\n{"prompt": ""}\n', 422, "e2.jsonl: line 3: empty prompt"),
    ("e.csv", b"prompt,k\nok,1\n  ,2\n", 422, "e.csv: line 3 (row 2): empty prompt"),
    ("big.jsonl", b'{"prompt": "ok", "n": ' + b"9" * 5000 + b"}\n", 422,
     "big.jsonl: line 1: malformed JSON"),
    ("deep.jsonl", b'{"prompt": "ok", "n": ' + b"[" * 100000 + b"]" * 100000 + b"}\n", 422,
     "deep.jsonl: line 1: malformed JSON"),
    ("x.parquet", b"not parquet at all", 422, "x.parquet: not a readable parquet file"),
    ("c.parquet", _parquet({"text": ["a"]}), 422, "c.parquet: missing column 'prompt'"),
    ("r.parquet", _parquet({"prompt": ["a", None]}), 422, "r.parquet: row 2: empty prompt"),
    ("o.json", b'{"prompt": "ok"}', 422, "o.json: expected a JSON array of prompts"),
    ("m.json", b'["ok", {"text": "x"}]', 422, "m.json: item 2: missing key 'prompt'"),
    ("n.json", b'["ok", 3]', 422, "n.json: item 2: expected a string or an object"),
    ("e.json", b'["ok", "  "]', 422, "e.json: item 2: empty prompt"),
    ("bad.json", b'["ok",\n oops]', 422, "bad.json: line 2: malformed JSON"),
    # a key given twice: json keeps the last value without a word ("b" was stored)
    ("twice.jsonl", b'{"prompt": "ok"}\n{"prompt": "a", "prompt": "b"}\n', 422,
     "twice.jsonl: line 2: key(s) 'prompt' given twice in one object"),
    ("twice.json", b'["ok", {"prompt": "a", "prompt": "b"}]', 422,
     "twice.json: item 2: key(s) 'prompt' given twice in one object"),
    ("twice_meta.jsonl", b'{"prompt": "ok", "m": {"k": 1, "k": 2}}\n', 422,
     "twice_meta.jsonl: line 1: metadata: key(s) 'k' given twice in one object"),
    ("p.pdf", b"%PDF", 400, "p.pdf: unsupported file type .pdf"),
    ("empty.txt", b"", 422, "empty.txt: no prompts found"),
    ("blank.txt", b"\n  \n\t\n\n", 422, "blank.txt: no prompts found"),
    ("blank.jsonl", b"\n \n\n", 422, "blank.jsonl: no prompts found"),
]


def test_every_undecodable_line_is_named_beside_the_files_other_problems(client, admin,
                                                                         session):
    """A byte that is not UTF-8 was the whole answer: only its line was named, and a NUL
    or a too-long prompt elsewhere came up only once it was fixed. Each bad line is named
    once (its bad byte, not what the byte became), in file order among the others."""
    from app.models import Dataset

    r = upload(client, admin, "two.txt", b"\xffa\nok\n\xfeb\n")
    assert r.status_code == 422, r.text
    assert [e["where"] for e in r.json()["errors"]] == ["line 1", "line 3"], r.text
    assert "byte 0xfe at offset 6" in r.json()["detail"]
    data = b"ok\nbad\x00one\nok2\n" + b"a" * 3000 + b"\nthen \xff here\n"
    r = upload(client, admin, "mixed.txt", data)
    assert r.status_code == 422, r.text
    errors = r.json()["errors"]
    assert [e["where"] for e in errors] == ["line 2", "line 4", "line 5"], r.text
    assert "bad encoding" in errors[2]["message"] and "too long" in errors[1]["message"]
    # the offset counts the byte-order mark, as a hex editor would
    r = upload(client, admin, "bom.csv", b"\xef\xbb\xbfprompt\nok\nx\x80y\n")
    assert r.status_code == 422 and [e["where"] for e in r.json()["errors"]] == ["line 3"]
    assert "byte 0x80 at offset 14" in r.json()["detail"], r.text
    assert session.scalar(select(func.count()).select_from(Dataset)) == 0


def test_a_csv_row_the_reader_cannot_parse_is_named_as_any_bad_row(client, admin, session):
    """A quote never closed was "line 3: malformed CSV (unexpected end of data)": the end of
    the file rather than the line the row begins on, no row number, and another wording
    than a row with the wrong field count ("line 3 (row 2): malformed row: ..."); the rows
    after a quote error were numbered one short."""
    r = upload(client, admin, "broken.csv", b'prompt,x\n"a red,1\nb,2\n')
    assert r.status_code == 422, r.text
    assert r.json()["detail"] == ("broken.csv: line 2 (row 1): malformed row: unexpected end "
                                  "of data (the row runs from line 2 to line 3)"), r.text
    r = upload(client, admin, "two.csv", b'prompt,x\na,1\n"b"c,2\n\n"d\ne",3,4\n')
    assert r.status_code == 422, r.text
    errors = r.json()["errors"]
    assert [e["where"] for e in errors] == ["line 3 (row 2)", "line 5 (row 3)"], r.text
    assert errors[0]["message"] == "malformed row: ',' expected after '\"'", r.text
    assert errors[1]["message"] == "malformed row: expected 2 fields, got 3", r.text
    assert counts(session) == (0, 0)


@pytest.mark.parametrize("name,data,status,message", BAD, ids=[b[0] for b in BAD])
def test_bad_uploads_name_the_place_and_store_nothing(client, admin, session, name, data,
                                                      status, message):
    r = upload(client, admin, name, data)
    assert r.status_code == status, r.text
    assert r.json()["detail"].startswith(message), r.json()
    # one shape for every answer about the request's content, a 400 included
    assert r.json()["field"] == "file" and r.json()["errors"][0]["field"] == "file", r.json()
    assert counts(session) == (0, 0)


def test_upload_over_size_limit(client, admin, session, monkeypatch):
    from app.config import get_settings

    monkeypatch.setattr(get_settings(), "max_upload_bytes", 1000)
    r = upload(client, admin, "big.txt", b"a prompt\n" * 200)
    assert r.status_code == 413
    assert r.json()["detail"] == ("big.txt: the file is larger than the limit of 1000 bytes "
                                  "(MAX_UPLOAD_BYTES)")
    assert r.json()["field"] == "file" and r.json()["errors"][0]["field"] == "file"
    assert counts(session) == (0, 0)


def _repeated_parquet(rows: int, prompt: str, **columns: list) -> bytes:
    """`rows` rows of one prompt, dictionary- and run-length-encoded and compressed: a few
    bytes on disk whatever the rows hold once read (no Arrow schema stored, so the column
    reads back as plain strings)."""
    column = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), pa.array([prompt]))
    buf = io.BytesIO()
    pq.write_table(pa.table({"prompt": column, **columns}), buf, compression="zstd",
                   store_schema=False)
    return buf.getvalue()


@pytest.mark.parametrize("data,message", [
    # 1 KB on disk, 200,000 rows: more records than a text file of the limit could hold
    (_repeated_parquet(200_000, "one red circle"), "holds 200000 cells"),
    # 13 KB on disk, 80 MB of prompts once read (40,000 times one 2,000-character prompt)
    (_repeated_parquet(40_000, "x" * 2000), "more than 400000 bytes once read"),
    # 1 KB on disk, one 5 MB metadata value once decompressed
    (_repeated_parquet(1, "one red circle", meta=["x" * 5_000_000]),
     "more than 400000 bytes once read"),
], ids=["rows", "repeated-values", "compressed-value"])
def test_a_parquet_bomb_is_refused_before_it_is_read(client, admin, session, monkeypatch,
                                                     data, message):
    """A parquet file under MAX_UPLOAD_BYTES may still decode to gigabytes (compression, and
    encodings that repeat one value any number of times): 2 MB of it read as 20 GB of
    strings. What it holds once read is bounded by the limit too, as a text file's is."""
    from app.config import get_settings

    monkeypatch.setattr(get_settings(), "max_upload_bytes", 100_000)
    assert len(data) < 100_000
    r = upload(client, admin, "bomb.parquet", data)
    assert r.status_code == 413, r.text
    assert r.json()["detail"].startswith("bomb.parquet: ") and message in r.json()["detail"]
    assert "MAX_UPLOAD_BYTES" in r.json()["detail"]
    assert r.json()["field"] == "file" and r.json()["errors"][0]["field"] == "file"
    assert counts(session) == (0, 0)


def test_configurable_prompt_length(client, admin, monkeypatch):
    from app.config import get_settings

    monkeypatch.setattr(get_settings(), "max_prompt_length", 5)
    r = upload(client, admin, "l.txt", b"short\nlonger one\n")
    assert r.status_code == 422 and "line 2: prompt too long (10 characters, the limit is 5)" \
        in r.json()["detail"]


def test_prompt_searches_take_the_configured_prompt_length(client, admin, monkeypatch):
    """The searches were capped at 2000 characters whatever MAX_PROMPT_LENGTH said: an
    uploaded 2,500-character prompt could not be searched for."""
    from app.config import get_settings

    monkeypatch.setattr(get_settings(), "max_prompt_length", 3000)
    long = "one red circle " + "x" * 2485
    assert upload(client, admin, "long.txt", long.encode() + b"\n").status_code == 201
    r = client.get("/api/prompts", params={"q": long}, headers=admin)
    assert r.status_code == 200 and r.json()["total"] == 1, r.text
    r = client.get("/api/rollouts", params={"prompt": long}, headers=admin)
    assert r.status_code == 200 and r.json()["total"] == 0, r.text
    # longer than the setting: refused as before, beside the other parameters' problems
    for path, name in (("/api/prompts", "q"), ("/api/rollouts", "prompt")):
        r = client.get(path, params={name: "x" * 3001, "limit": 0}, headers=admin)
        assert r.status_code == 422, r.text
        errors = {e["field"]: e["message"] for e in r.json()["errors"]}
        assert errors[name] == "String should have at most 3000 characters", r.text
        assert "limit" in errors, r.text


def test_delete_refuses_dataset_of_running_job(client, admin, session):
    ds = upload(client, admin, "d.txt", b"one red circle\ntwo red circles\n").json()["id"]
    job = client.post("/api/jobs", json={"kind": "rollout", "config": {"dataset_id": ds}},
                      headers=admin).json()
    assert job["dataset_id"] == ds
    from app.services import jobs

    jobs.mark_running(session, job["id"], "w1")
    session.commit()
    r = client.delete(f"/api/datasets/{ds}", headers=admin)
    assert r.status_code == 409 and str(job["id"]) in r.json()["detail"]
    assert r.json()["field"] == "dataset_id" and r.json()["jobs"] == [job["id"]]  # not "body"
    assert counts(session) == (1, 2)
    jobs.mark_succeeded(session, job["id"])
    session.commit()
    assert client.delete(f"/api/datasets/{ds}", headers=admin).status_code == 204
    assert counts(session) == (0, 0)
    assert client.get(f"/api/datasets/{ds}", headers=admin).status_code == 404


def test_txt_blank_lines_are_skipped_and_counted(client, admin):
    # leading, separating, whitespace-only and trailing blank lines; CRLF too
    data = b"\n  \none red circle\r\n\r\n\t\ntwo blue squares\n\n\n"
    r = upload(client, admin, "gaps.txt", data)
    assert r.status_code == 201, r.text
    body = r.json()
    assert (body["num_prompts"], body["blank_lines_skipped"], body["duplicates_dropped"]) == \
        (2, 6, 0)
    prompts = client.get("/api/prompts", params={"dataset_id": body["id"]}, headers=admin).json()
    assert [p["text"] for p in prompts["items"]] == ["one red circle", "two blue squares"]
    assert [p["position"] for p in prompts["items"]] == [0, 1]
    # kept on the dataset, as duplicates_dropped is: the dataset and the list report it
    assert client.get(f"/api/datasets/{body['id']}",
                      headers=admin).json()["blank_lines_skipped"] == 6
    listed = client.get("/api/datasets", headers=admin).json()["items"]
    assert {d["id"]: d["blank_lines_skipped"] for d in listed}[body["id"]] == 6
    # errors after blank lines still name the file's own line number
    r = upload(client, admin, "later.txt", b"\n\nok\n" + b"x" * 2001 + b"\n")
    assert r.status_code == 422 and r.json()["detail"].startswith("later.txt: line 4: prompt too long")


def test_jsonl_and_csv_blank_lines_are_skipped_and_counted(client, admin):
    cases = [  # (file, bytes, blank lines skipped); two prompts each
        ("g.jsonl", b'\n{"prompt": "a"}\n   \n\n{"prompt": "b"}\n\n', 4),
        ("h.csv", b"prompt,k\na,1\n\nb,2\n\n", 2),
        # a spreadsheet's export: rows with nothing in any cell (",,"), whitespace alone as in
        # a text file, CRLF; a row with metadata but no prompt is still an error (e.csv above)
        ("s.csv", b"prompt,k\r\na,1\r\n,\r\n  , \r\nb,2\r\n,\r\n,\r\n", 4),
        ("one.csv", b"prompt\nok\n  \n\"\"\nfine\n", 2),
        # a JSON string may hold U+2028 (a line break to str.splitlines, not to JSON lines)
        ("u.jsonl", '{"prompt": "a\u2028b"}\n{"prompt": "c"}\n'.encode(), 0),
    ]
    for name, data, blank in cases:
        r = upload(client, admin, name, data)
        assert r.status_code == 201, (name, r.text)
        assert (r.json()["num_prompts"], r.json()["blank_lines_skipped"]) == (2, blank), name


def test_upload_without_a_filename_names_the_field(client, admin, session):
    for files in ({"file": ("", b"one\n", "text/plain")},
                  {"file": (None, b"one\n", "text/plain")}):
        r = client.post("/api/datasets", files=files, headers=admin)
        assert r.status_code == 422, r.text
        message = "a file with a name is required (.txt, .csv, .jsonl, .json or .parquet)"
        assert r.json() == {"detail": f"file: {message}", "field": "file",
                            "errors": [{"field": "file", "message": message}]}
    assert counts(session) == (0, 0)
    # the docs still describe a file upload
    schema = client.get("/openapi.json").json()
    body = schema["paths"]["/api/datasets"]["post"]["requestBody"]["content"]
    ref = body["multipart/form-data"]["schema"]["$ref"].rsplit("/", 1)[1]
    assert schema["components"]["schemas"][ref]["properties"]["file"]["contentMediaType"] == \
        "application/octet-stream"


def test_duplicate_dataset_name_is_a_conflict(client, admin, session):
    first = upload(client, admin, "a.txt", b"one\n", name="mine").json()["id"]
    r = upload(client, admin, "b.txt", b"two\n", name="  mine ")
    assert r.status_code == 409, r.text
    assert r.json()["detail"] == (f"name: a dataset named 'mine' already exists (dataset {first}); "
                                  "choose another name or delete that dataset")
    assert (r.json()["field"], r.json()["dataset_id"]) == ("name", first)
    # a name taken from the file's stem counts too
    stem = upload(client, admin, "b.txt", b"two\n").json()["id"]
    r = upload(client, admin, "b.txt", b"three\n")
    assert r.status_code == 409 and f"(dataset {stem})" in r.json()["detail"]
    # names differing in case only look like one dataset in the job form's list
    r = upload(client, admin, "b.txt", b"three\n", name="MINE")
    assert r.status_code == 409 and r.json()["dataset_id"] == first, r.text
    assert f"dataset {first} is named 'mine', which differs from 'MINE' in case only" \
        in r.json()["detail"]
    r = upload(client, admin, "b.txt", b"three\n", name="ｍｉｎｅ")
    assert r.status_code == 409 and r.json()["dataset_id"] == first, r.text
    assert "which differs from 'ｍｉｎｅ' in case or character width only" in r.json()["detail"]
    assert counts(session) == (2, 2)
    assert upload(client, admin, "b.txt", b"three\n", name="b2").status_code == 201
    # deleting frees the name
    assert client.delete(f"/api/datasets/{first}", headers=admin).status_code == 204
    assert upload(client, admin, "c.txt", b"four\n", name="mine").status_code == 201
    r = upload(client, admin, "n.txt", b"five\n", name="bad\x00name")
    assert r.status_code == 422 and r.json()["field"] == "name"


def test_two_uploads_racing_for_one_name_give_one_dataset_and_a_conflict(client, admin,
                                                                        session, monkeypatch):
    """The name check runs before parsing; an upload that passed it while another took the
    name is stopped by the unique constraint, with the same 409, and nothing of it stays."""
    from app.services import datasets as svc

    first = upload(client, admin, "a.txt", b"one\n", name="raced").json()["id"]
    checks = []

    def passed_before_the_other_committed(session_, name):
        checks.append(name)
        if len(checks) > 1:  # the second call is the constraint's follow-up: the real check
            return real_check(session_, name)

    real_check = svc.check_name_free
    monkeypatch.setattr(svc, "check_name_free", passed_before_the_other_committed)
    r = upload(client, admin, "b.txt", b"two\nthree\n", name="raced")
    assert r.status_code == 409, r.text
    assert (r.json()["field"], r.json()["dataset_id"]) == ("name", first)
    assert checks == ["raced", "raced"]
    session.expire_all()
    assert counts(session) == (1, 1)  # the loser's dataset row and prompts are gone


def test_serve_bootstrap_seeds_shapes_once(settings, session):
    from app.models import Dataset
    from app.serve import SHAPES_DATASET, bootstrap

    first = bootstrap(demo_job=False)
    second = bootstrap(demo_job=False)  # the second start of `python -m app serve`
    assert second.dataset_id == first.dataset_id
    assert session.scalar(select(func.count()).select_from(Dataset)
                          .where(Dataset.name == SHAPES_DATASET)) == 1


def test_datetimes_carry_utc_on_post_and_in_lists(client, admin):
    posted = upload(client, admin, "t.txt", b"one\n").json()
    listed = client.get("/api/datasets", headers=admin).json()["items"][0]
    got = client.get(f"/api/datasets/{posted['id']}", headers=admin).json()
    for value in (posted["created_at"], listed["created_at"], got["created_at"]):
        # one format, fraction digits included when they are zero: a fixed-format parser
        # read some timestamps of a list and failed on the others
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", value), value
    assert posted["created_at"] == listed["created_at"] == got["created_at"]


def test_listing_by_a_dataset_or_job_that_does_not_exist_is_404_and_paths_are_not_kept(
        client, admin):
    """An empty page read as "no prompts yet" for a mistyped id; a client's path in the
    filename ("../../p.txt") was kept as the dataset's filename."""
    r = client.get("/api/prompts", params={"dataset_id": 999}, headers=admin)
    assert r.status_code == 404 and "dataset 999" in r.text
    r = client.get("/api/rollouts", params={"job_id": 999}, headers=admin)
    assert r.status_code == 404 and "job 999" in r.text
    r = client.get("/api/checkpoints", params={"job_id": 999}, headers=admin)
    assert r.status_code == 404 and "job 999" in r.text, r.text
    for sent, kept in (("../../evil.txt", "evil.txt"), ("C:\\data\\win.txt", "win.txt")):
        r = client.post("/api/datasets", files={"file": (sent, b"one red circle\n",
                                                         "text/plain")}, headers=admin)
        assert r.status_code == 201, r.text
        body = r.json()
        dataset = body.get("dataset", body)
        assert dataset["filename"] == kept


def test_an_upload_with_a_form_field_it_does_not_take_is_422_and_stores_nothing(client, admin,
                                                                             session):
    """A misspelt eval_fraction was dropped without a word: every prompt went to train."""
    r = client.post("/api/datasets", files={"file": ("p.txt", b"one\ntwo\n", "text/plain")},
                    data={"eval_fracton": "0.5", "bogus": "1"}, headers=admin)
    assert r.status_code == 422, r.text
    assert [e["field"] for e in r.json()["errors"]] == ["bogus", "eval_fracton"]
    assert "eval_fraction" in r.json()["errors"][0]["message"]
    assert counts(session) == (0, 0)
    r = client.post("/api/datasets", files={"file": ("p.txt", b"one\ntwo\n", "text/plain")},
                    data={"eval_fraction": "0.5", "name": "ok", "seed": "3"}, headers=admin)
    assert r.status_code == 201 and r.json()["num_eval"] == 1, r.text


def test_an_upload_lists_the_forms_the_names_and_the_contents_problems_at_once(client, admin,
                                                                               session):
    """An eval_fraction out of range hid an empty file, an unknown form field did too, and a
    taken name hid the file's bad lines: each was found only on the next try."""
    r = upload(client, admin, "e.txt", b"", eval_fraction=2)
    assert r.status_code == 422, r.text
    assert [e["field"] for e in r.json()["errors"]] == ["eval_fraction", "file"], r.text
    assert "e.txt: no prompts found" in r.json()["detail"]
    r = upload(client, admin, "e.txt", b"", bogus=1)
    assert [e["field"] for e in r.json()["errors"]] == ["bogus", "file"], r.text
    taken = upload(client, admin, "a.txt", b"one\n", name="mine").json()["id"]
    bad = b'{"prompt": 1}\n{bad\n{"x": 2}\n'
    r = upload(client, admin, "m.jsonl", bad, name="mine")
    assert r.status_code == 422, r.text
    assert [e["field"] for e in r.json()["errors"]] == ["name", "file", "file", "file"]
    assert f"already exists (dataset {taken})" in r.json()["errors"][0]["message"]
    assert "line 3" in r.json()["detail"]
    # ... and with a form problem too, in one answer
    r = upload(client, admin, "m.jsonl", bad, name="mine", eval_fraction=-1)
    assert [e["field"] for e in r.json()["errors"]] == [
        "eval_fraction", "name", "file", "file", "file"], r.text
    assert counts(session) == (1, 1)  # nothing but the first dataset
    # the taken name alone stays the 409
    assert upload(client, admin, "b.txt", b"two\n", name="mine").status_code == 409


def test_a_name_too_long_is_refused_beside_the_files_problems_not_cut(client, admin, session):
    """A 300-character name was cut to 200 without a word (the UI walk, 2026-12-07): the name
    the user chose is refused, naming the limit, with the file's own problems in one answer;
    a file's long stem, the default name, is still cut to fit."""
    from app.limits import NAME_LENGTH

    long = "n" * (NAME_LENGTH + 100)
    r = upload(client, admin, "a.txt", b"one\n", name=long)
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "name", r.text
    assert f"at most {NAME_LENGTH} characters" in r.json()["detail"], r.text
    r = upload(client, admin, "e.txt", b"", name=long)
    assert [e["field"] for e in r.json()["errors"]] == ["name", "file"], r.text
    assert counts(session) == (0, 0)
    fits = upload(client, admin, "a.txt", b"one\n", name="m" * NAME_LENGTH)
    assert fits.status_code == 201 and fits.json()["name"] == "m" * NAME_LENGTH, fits.text
    stem = upload(client, admin, "s" * (NAME_LENGTH + 20) + ".txt", b"one\n")
    assert stem.status_code == 201 and stem.json()["name"] == "s" * NAME_LENGTH, stem.text
    # the UI's Upload calls the service itself, which cut the name: it refuses it too, with
    # the file's problems beside it
    from app.errors import Invalid
    from app.services import datasets as svc

    with pytest.raises(Invalid) as refused:
        svc.import_dataset(session, filename="e.txt", data=b"", name=long)
    assert [e["field"] for e in refused.value.details["errors"]] == ["name", "file"]
    assert f"at most {NAME_LENGTH} characters (got {NAME_LENGTH + 100})" in refused.value.message
    with pytest.raises(Invalid, match="at most"):
        svc.import_dataset(session, filename="a.txt", data=b"one\n", name=long)
    session.rollback()
    assert counts(session) == (2, 2)


def test_reading_a_file_that_is_not_utf8_loads_no_torch(tmp_path):
    """The upload's line-by-line decoding came from trainer.evaluation, which imports torch:
    the server's first upload with a bad byte paid seconds of imports (14 s on a busy box)
    inside the request. It reads such a file now without torch loaded."""
    import os
    import subprocess
    import sys

    code = ("import sys, app.services.datasets as d\n"
            "try:\n"
            "    d.parse_upload('a.txt', b'caf\\xe9\\nok\\n', max_prompt_length=9, max_bytes=99)\n"
            "except Exception as exc:\n"
            "    print(exc)\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "DATA_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "a.txt: line 1: bad encoding (not UTF-8: byte 0xe9 at offset 3)", "False"], out.stdout


def test_invisible_characters_make_no_second_prompt(client, admin):
    """A byte-order mark inside a file (two files joined) or a zero-width space made
    "one red circle" a second prompt that looks the same, which a shapes job then refused
    (the API audit, 2026-12-07): they are dropped as whitespace is normalised."""
    data = ("one red circle\n\ufeffone red circle\n\u200bone red\u2060 circle\n"
            "two blue squares\u200b\n").encode()
    r = upload(client, admin, "joined.txt", data)
    assert r.status_code == 201, r.text
    assert (r.json()["num_prompts"], r.json()["duplicates_dropped"]) == (2, 2), r.text
    items = client.get("/api/prompts", params={"dataset_id": r.json()["id"]},
                       headers=admin).json()["items"]
    assert [p["text"] for p in items] == ["one red circle", "two blue squares"]


def test_txt_with_classic_mac_line_ends_is_one_prompt_a_line(client, admin):
    """A lone "\\r" ends a line, as it does in .jsonl and .csv uploads: "a\\rb\\rc\\r" was one
    prompt, "one red circle two red circles three red circles"."""
    r = upload(client, admin, "mac.txt", b"one red circle\rtwo red circles\r\rthree red circles\r")
    assert r.status_code == 201, r.text
    assert (r.json()["num_prompts"], r.json()["blank_lines_skipped"]) == (3, 1)
    items = client.get("/api/prompts", params={"dataset_id": r.json()["id"]},
                       headers=admin).json()["items"]
    assert [p["text"] for p in items] == ["one red circle", "two red circles",
                                          "three red circles"]
    assert [p["position"] for p in items] == [0, 1, 2]


def test_an_overlong_line_is_refused_by_its_length_before_any_character_scan(client, admin,
                                                                             monkeypatch):
    """A 20 MB line took 20 s of server CPU (a category lookup per character) to be refused
    for its length; the length is now looked at first, and the scan never runs on it."""
    from trainer import config

    scanned: list[int] = []
    real = config.prompt_text_problem
    monkeypatch.setattr("app.services.datasets.prompt_text_problem",
                        lambda text: scanned.append(len(text)) or real(text))
    r = upload(client, admin, "long.txt", b"x" * 100_000 + b"\none red circle\n")
    assert r.status_code == 422 and "prompt too long (100000 characters" in r.text, r.text
    assert scanned == [len("one red circle")]


def test_a_split_column_decides_each_prompts_split(client, admin, session):
    """A csv's `split` column (HPDv2-style files say which prompts are held out) was kept as
    metadata while eval_fraction split the prompts at random: the preview showed a prompt the
    file called eval in the train split. The column decides now ('test' is held out too)."""
    data = (b"prompt,split,notes\none red circle,train,a\ntwo blue squares,eval,b\n"
            b"\"three, green triangles\",TEST,c\nfour yellow squares,train,d\n")
    r = upload(client, admin, "hpd.csv", data)
    assert r.status_code == 201, r.text
    ds = r.json()
    assert (ds["num_prompts"], ds["num_eval"]) == (4, 2) and ds["eval_fraction"] == 0.5
    rows = client.get("/api/prompts", params={"dataset_id": ds["id"]}, headers=admin).json()
    assert {p["text"]: p["split"] for p in rows["items"]} == {
        "one red circle": "train", "two blue squares": "eval",
        "three, green triangles": "eval", "four yellow squares": "train"}
    jsonl = b'{"prompt": "a fox", "split": "test"}\n{"prompt": "an owl", "split": "train"}\n'
    r = upload(client, admin, "hpd-test.jsonl", jsonl)
    assert r.status_code == 201 and r.json()["num_eval"] == 1, r.text


def test_a_split_column_is_checked_with_the_rest(client, admin, session):
    before = counts(session)
    bad = b"prompt,split\none,train\ntwo,bogus\nthree,\n"
    r = upload(client, admin, "bad.csv", bad)
    assert r.status_code == 422, r.text
    messages = [e["message"] for e in r.json()["errors"]]
    assert messages == ["split must be 'train', or 'eval' or 'test' (the held-out split), "
                        "got 'bogus'", "split must be 'train', or 'eval' or 'test' (the "
                        "held-out split), got ''"], messages
    half = b'{"prompt": "a", "split": "eval"}\n{"prompt": "b"}\n'
    r = upload(client, admin, "half.jsonl", half)
    assert r.status_code == 422, r.text
    assert "1 record(s) give a split and 1 do not (first: line 2)" in r.json()["detail"]
    # the file says which prompts are held out: a fraction too would contradict it
    r = upload(client, admin, "both.csv", b"prompt,split\none,train\ntwo,eval\n",
               eval_fraction=0.5)
    assert r.status_code == 422 and r.json()["field"] == "eval_fraction", r.text
    assert counts(session) == before


def test_eval_fraction_is_judged_beside_the_files_and_the_names_problems(client, admin,
                                                                           session):
    """A split column beside an eval_fraction was said only once the file's rows were fixed,
    and a taken name hid it behind a 409."""
    assert upload(client, admin, "taken.txt", b"a cat\n").status_code == 201
    before = counts(session)
    bad = b"prompt,split\nfoo,eval\n,train\n"  # row 2's prompt is empty
    r = upload(client, admin, "s.csv", bad, eval_fraction=0.5)
    assert r.status_code == 422, r.text
    assert [e["field"] for e in r.json()["errors"]] == ["file", "eval_fraction"], r.text
    assert "s.csv gives each prompt's split" in r.json()["errors"][1]["message"]
    r = upload(client, admin, "s.csv", bad, eval_fraction=0.5, name="taken")
    assert r.status_code == 422, r.text
    assert [e["field"] for e in r.json()["errors"]] == ["name", "file", "eval_fraction"], r.text
    assert counts(session) == before


def test_a_cut_off_upload_says_so_and_not_that_the_file_is_missing(client, admin, session):
    """A multipart body cut off mid-part (its Content-Length the cut body's) was parsed as if
    whole, its unfinished file part dropped, and answered "file: Field required"."""
    boundary = "cut-off-boundary"
    whole = (f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\nmine\r\n'
             f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="p.txt"\r\n'
             f'Content-Type: text/plain\r\n\r\none red circle\ntwo blue squares\n\r\n'
             f'--{boundary}\r\nContent-Disposition: form-data; name="seed"\r\n\r\n3\r\n'
             f'--{boundary}--\r\n').encode()
    headers = {**admin, "Content-Type": f"multipart/form-data; boundary={boundary}"}
    in_file = whole.index(b"two blue")  # in the file's part, and in the field after it
    for cut, field in ((in_file, "file"), (len(whole) - 30, "body"), (len(whole) - 3, "body")):
        r = client.post("/api/datasets", content=whole[:cut], headers=headers)
        assert (r.status_code, r.json()["field"]) == (400, field), (cut, r.text)
        assert "cut off" in r.json()["detail"] and "Field required" not in r.json()["detail"]
    assert counts(session) == (0, 0)
    # the media type in any case (the form parser reads `Multipart/Form-Data` too): the cut
    # name after a whole file was stored as an upload named from its file
    mixed = {**admin, "Content-Type": f"Multipart/Form-Data; boundary={boundary}"}
    for cut, field in ((in_file, "file"), (len(whole) - 30, "body")):
        r = client.post("/api/datasets", content=whole[:cut], headers=mixed)
        assert (r.status_code, r.json()["field"]) == (400, field), (cut, r.text)
    assert counts(session) == (0, 0)
    # an empty body was cut off from nothing: no file was sent
    r = client.post("/api/datasets", content=b"", headers=headers)
    assert r.status_code == 422 and "cut off" not in r.text, r.text
    assert [e["field"] for e in r.json()["errors"]] == ["file"], r.text
    # in chunks whose border splits the closing boundary, the whole body is taken
    chunks = (whole[i:i + 7] for i in range(0, len(whole), 7))
    r = client.post("/api/datasets", content=chunks, headers=headers)
    assert r.status_code == 201, r.text
    assert (r.json()["name"], r.json()["num_prompts"]) == ("mine", 2)
