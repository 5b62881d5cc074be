"""Prompt datasets: parse an upload (txt, csv, jsonl, json, parquet), normalise, dedupe, split.

Every problem in an upload is an `Invalid` (or `PayloadTooLarge`) whose message names the file,
the line or row, and the reason; parsing finishes before anything is written, so a bad upload
stores nothing. Blank lines (of a .txt, .jsonl or .csv) are skipped and counted, not errors: they
separate records, they are not records. An empty prompt in a record is an error.

Metadata is stored and exported as strict JSON: non-finite numbers (NaN, 1e400) become null.
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
import re
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from sqlalchemy import delete, func, insert, select
from sqlalchemy.orm import Session

from app.errors import BadRequest, Conflict, Invalid, NotFound, PayloadTooLarge
from app.limits import NAME_LENGTH
from app.models import Dataset, Job, Prompt

FORMATS = ("txt", "csv", "jsonl", "json", "parquet")
ACTIVE_JOB_STATUSES = ("queued", "running")


@dataclass
class ParsedPrompt:
    text: str
    meta: dict[str, Any] | None
    where: str  # "line 3" / "row 2": for error messages


@dataclass
class ParsedUpload:
    format: str
    prompts: list[ParsedPrompt]  # unique, normalised
    duplicates_dropped: int
    blank_lines_skipped: int


@dataclass
class ImportResult:
    dataset: Dataset
    duplicates_dropped: int
    blank_lines_skipped: int = 0


def normalise(text: str) -> str:
    """Collapse runs of whitespace to one space and strip the ends."""
    return " ".join(text.split())


def detect_format(filename: str) -> str:
    suffix = PurePath(filename or "").suffix.lower().lstrip(".")
    if suffix not in FORMATS:
        raise BadRequest(
            f"{filename or '(no name)'}: unsupported file type {('.' + suffix) if suffix else '(none)'}; "
            f"use one of {', '.join('.' + f for f in FORMATS)}"
        )
    return suffix


def _decode(filename: str, data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise Invalid(
            f"{filename}: line {line}: bad encoding (not UTF-8: byte 0x{data[exc.start]:02x} "
            f"at offset {exc.start})",
            file=filename,
            line=line,
        ) from None


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float (NaN, inf: what 1e400 parses to) replaced by None,
    in nested dicts and lists too: json.dumps would write them as the non-JSON tokens NaN and
    Infinity, and PostgreSQL's json type refuses them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def _meta_value(value: Any) -> Any:
    # parquet values made JSON-safe (dates, bytes, decimals: their text)
    value = json_safe(value)
    try:
        json.dumps(value, allow_nan=False)
        return value
    except (TypeError, ValueError):
        return str(value)


def _parse_txt(filename: str, text: str) -> tuple[list[ParsedPrompt], int]:
    out: list[ParsedPrompt] = []
    blank = 0
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            out.append(ParsedPrompt(line, None, f"line {i}"))
        else:
            blank += 1
    return out, blank


def _parse_csv(filename: str, text: str) -> tuple[list[ParsedPrompt], int]:
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    try:
        header = next(reader)
    except StopIteration:
        return [], 0
    except csv.Error as exc:
        raise Invalid(f"{filename}: line 1: malformed CSV header ({exc})", file=filename, line=1) from None
    header = [h.strip() for h in header]
    if "prompt" not in header:
        raise Invalid(
            f"{filename}: line 1: missing column 'prompt' (columns: {', '.join(header) or 'none'})",
            file=filename,
            line=1,
        )
    col = header.index("prompt")
    out: list[ParsedPrompt] = []
    row_no = blank = 0
    while True:
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:
            raise Invalid(
                f"{filename}: line {reader.line_num}: malformed CSV ({exc})",
                file=filename,
                line=reader.line_num,
            ) from None
        if not row:  # an empty line: the csv module gives no fields at all
            blank += 1
            continue
        row_no += 1
        if len(row) != len(header):
            raise Invalid(
                f"{filename}: line {reader.line_num} (row {row_no}): malformed row: expected "
                f"{len(header)} fields, got {len(row)}",
                file=filename,
                line=reader.line_num,
                row=row_no,
            )
        meta = {k: v for i, (k, v) in enumerate(zip(header, row, strict=True)) if i != col}
        out.append(ParsedPrompt(row[col], meta or None, f"line {reader.line_num} (row {row_no})"))
    return out, blank


# JSON text holds no raw CR or LF, but may hold U+2028 and friends, which str.splitlines()
# would also split at.
_JSONL_LINE = re.compile(r"\r\n|\r|\n")


def _parse_jsonl(filename: str, text: str) -> tuple[list[ParsedPrompt], int]:
    out: list[ParsedPrompt] = []
    blank = 0
    lines = _JSONL_LINE.split(text)
    if lines and lines[-1] == "":
        lines.pop()  # the last line's terminator, not a blank line
    for i, line in enumerate(lines, 1):
        if not line.strip():
            blank += 1
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise Invalid(
                f"{filename}: line {i}: malformed JSON ({exc.msg} at column {exc.colno})",
                file=filename,
                line=i,
            ) from None
        except (ValueError, RecursionError) as exc:  # an int of > 4300 digits; deep nesting
            raise Invalid(f"{filename}: line {i}: malformed JSON ({exc})", file=filename,
                          line=i) from None
        if not isinstance(obj, dict):
            raise Invalid(f"{filename}: line {i}: expected a JSON object", file=filename, line=i)
        if "prompt" not in obj:
            raise Invalid(f"{filename}: line {i}: missing key 'prompt'", file=filename, line=i)
        prompt = obj.pop("prompt")
        if not isinstance(prompt, str):
            raise Invalid(f"{filename}: line {i}: 'prompt' must be a string", file=filename, line=i)
        out.append(ParsedPrompt(prompt, json_safe(obj) or None, f"line {i}"))
    return out, blank


def _parse_json(filename: str, text: str) -> tuple[list[ParsedPrompt], int]:
    """One JSON array, as HPDv2 and HPSv2's benchmark publish their prompt sets: strings
    (the benchmark's per-style test files) or objects with a "prompt" key (HPDv2's
    train.json / test.json, whose other keys - image paths, preference ranks - are kept as
    metadata)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise Invalid(f"{filename}: line {exc.lineno}: malformed JSON ({exc.msg} at column "
                      f"{exc.colno})", file=filename, line=exc.lineno) from None
    except (ValueError, RecursionError) as exc:
        raise Invalid(f"{filename}: malformed JSON ({exc})", file=filename) from None
    if not isinstance(items, list):
        raise Invalid(f"{filename}: expected a JSON array of prompts (strings or objects with "
                      f"a 'prompt' key), got a {type(items).__name__}", file=filename)
    out: list[ParsedPrompt] = []
    for i, item in enumerate(items, 1):
        where = f"item {i}"
        if isinstance(item, str):
            out.append(ParsedPrompt(item, None, where))
            continue
        if not isinstance(item, dict):
            raise Invalid(f"{filename}: {where}: expected a string or an object with a "
                          f"'prompt' key", file=filename, where=where)
        if "prompt" not in item:
            raise Invalid(f"{filename}: {where}: missing key 'prompt'", file=filename,
                          where=where)
        prompt = item.pop("prompt")
        if not isinstance(prompt, str):
            raise Invalid(f"{filename}: {where}: 'prompt' must be a string", file=filename,
                          where=where)
        out.append(ParsedPrompt(prompt, json_safe(item) or None, where))
    return out, 0


def _parse_parquet(filename: str, data: bytes) -> tuple[list[ParsedPrompt], int]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(io.BytesIO(data))
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise Invalid(f"{filename}: not a readable parquet file ({exc})", file=filename) from None
    if "prompt" not in table.column_names:
        raise Invalid(
            f"{filename}: missing column 'prompt' (columns: {', '.join(table.column_names) or 'none'})",
            file=filename,
        )
    if not (pa.types.is_string(table.schema.field("prompt").type)
            or pa.types.is_large_string(table.schema.field("prompt").type)):
        raise Invalid(
            f"{filename}: column 'prompt' must hold strings, not {table.schema.field('prompt').type}",
            file=filename,
        )
    out: list[ParsedPrompt] = []
    for i, rec in enumerate(table.to_pylist(), 1):
        prompt = rec.pop("prompt")
        meta = {k: _meta_value(v) for k, v in rec.items()}
        out.append(ParsedPrompt(prompt if prompt is not None else "", meta or None, f"row {i}"))
    return out, 0


def parse_upload(filename: str, data: bytes, *, max_prompt_length: int,
                 max_bytes: int) -> ParsedUpload:
    """Parse and check an upload: its unique prompts, duplicates dropped, blank lines skipped."""
    fmt = detect_format(filename)
    if len(data) > max_bytes:
        raise PayloadTooLarge(
            f"{filename}: file is larger than the limit of {max_bytes} bytes", file=filename
        )
    if fmt == "parquet":
        parsed, blank = _parse_parquet(filename, data)
    else:
        text = _decode(filename, data)
        parsed, blank = {"txt": _parse_txt, "csv": _parse_csv,
                         "jsonl": _parse_jsonl,
                         "json": _parse_json}[fmt](filename, text)
    unique: list[ParsedPrompt] = []
    seen: set[str] = set()
    for p in parsed:
        norm = normalise(p.text)
        if not norm:
            raise Invalid(f"{filename}: {p.where}: empty prompt", file=filename, where=p.where)
        if "\x00" in norm:
            raise Invalid(f"{filename}: {p.where}: prompt contains a NUL character", file=filename,
                          where=p.where)
        if len(norm) > max_prompt_length:
            raise Invalid(
                f"{filename}: {p.where}: prompt too long ({len(norm)} characters, the limit is "
                f"{max_prompt_length})",
                file=filename,
                where=p.where,
            )
        if norm in seen:
            continue
        seen.add(norm)
        p.text = norm
        unique.append(p)
    if not unique:
        raise Invalid(f"{filename}: no prompts found", file=filename)
    return ParsedUpload(fmt, unique, len(parsed) - len(unique), blank)


def dataset_name(filename: str, name: str | None) -> str:
    """The name a dataset gets: the given one, else the file's stem."""
    name = (name or "").strip() or PurePath(filename).stem or "dataset"
    if "\x00" in name:  # PostgreSQL refuses it; SQLite would store a name nobody can type
        raise Invalid("name: must not contain NUL characters", field="name")
    return name[:NAME_LENGTH]


def check_name_free(session: Session, name: str) -> None:
    """Conflict if a dataset already has this name (names pick datasets in the UI and the
    demo). A check, not a unique index: two uploads racing with one name can both pass."""
    taken = session.scalar(select(Dataset.id).where(Dataset.name == name)
                           .order_by(Dataset.id).limit(1))
    if taken is not None:
        raise Conflict(f"name: a dataset named '{name}' already exists (dataset {taken}); "
                       "choose another name or delete that dataset", field="name",
                       dataset_id=taken)


def import_dataset(session: Session, *, filename: str, data: bytes, name: str | None = None,
                   eval_fraction: float = 0.0, seed: int = 0, max_prompt_length: int = 2000,
                   max_bytes: int = 50 * 1024 * 1024) -> ImportResult:
    """Parse, then write the dataset and its prompts (flush, no commit). A name (given, or the
    file's stem) that another dataset has is a Conflict."""
    if not 0.0 <= eval_fraction < 1.0:
        raise Invalid("eval_fraction must be in [0, 1)", field="eval_fraction")
    name = dataset_name(filename, name)
    check_name_free(session, name)
    parsed = parse_upload(filename, data, max_prompt_length=max_prompt_length,
                          max_bytes=max_bytes)
    prompts, dropped = parsed.prompts, parsed.duplicates_dropped
    n_eval = round(len(prompts) * eval_fraction)
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    eval_idx = set(order[:n_eval])
    ds = Dataset(name=name, filename=filename[:300], format=parsed.format, num_prompts=len(prompts),
                 num_eval=n_eval, duplicates_dropped=dropped, eval_fraction=eval_fraction)
    session.add(ds)
    session.flush()
    rows = [
        {"dataset_id": ds.id, "position": i, "text": p.text, "meta": p.meta,
         "split": "eval" if i in eval_idx else "train"}
        for i, p in enumerate(prompts)
    ]
    for start in range(0, len(rows), 5000):
        session.execute(insert(Prompt), rows[start:start + 5000])
    return ImportResult(ds, dropped, parsed.blank_lines_skipped)


def list_datasets(session: Session, *, limit: int = 100, offset: int = 0) -> tuple[list[Dataset], int]:
    total = session.scalar(select(func.count()).select_from(Dataset)) or 0
    rows = session.scalars(select(Dataset).order_by(Dataset.id.desc()).limit(limit).offset(offset))
    return list(rows), total


def get_dataset(session: Session, dataset_id: int) -> Dataset:
    ds = session.get(Dataset, dataset_id)
    if ds is None:
        raise NotFound(f"dataset {dataset_id} not found")
    return ds


def export_rows(session: Session, dataset_id: int) -> list[dict[str, Any]]:
    get_dataset(session, dataset_id)
    rows = session.execute(
        select(Prompt.id, Prompt.text, Prompt.split, Prompt.meta)
        .where(Prompt.dataset_id == dataset_id)
        .order_by(Prompt.position)
    )
    # json_safe: rows stored before metadata was cleaned on import may hold NaN/inf (SQLite)
    return [{"id": r.id, "prompt": r.text, "split": r.split, "metadata": json_safe(r.meta)}
            for r in rows]


def delete_dataset(session: Session, dataset_id: int) -> None:
    """Delete a dataset and its prompts, unless a queued or running job uses it (Conflict)."""
    get_dataset(session, dataset_id)
    busy = session.scalars(
        select(Job.id).where(Job.dataset_id == dataset_id, Job.status.in_(ACTIVE_JOB_STATUSES))
    ).all()
    if busy:
        raise Conflict(
            f"dataset {dataset_id} is used by active job(s) {', '.join(map(str, busy))}; "
            "cancel them first",
            jobs=list(busy),
        )
    session.execute(delete(Prompt).where(Prompt.dataset_id == dataset_id))
    session.execute(delete(Dataset).where(Dataset.id == dataset_id))


def list_prompts(session: Session, *, dataset_id: int | None = None, split: str | None = None,
                 q: str | None = None, limit: int = 50, offset: int = 0) -> tuple[list[Prompt], int]:
    stmt = select(Prompt)
    if dataset_id is not None:
        stmt = stmt.where(Prompt.dataset_id == dataset_id)
    if split is not None:
        stmt = stmt.where(Prompt.split == split)
    if q and "\x00" in q:
        # SQLite ends the pattern at the NUL (so it matched everything), PostgreSQL refuses it
        raise Invalid("q: must not contain NUL characters", field="q")
    if q:
        # LIKE wildcards in q are text to find, not patterns
        escaped = q.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        stmt = stmt.where(func.lower(Prompt.text).like(f"%{escaped.lower()}%", escape="\\"))
    total = session.scalar(select(func.count()).select_from(stmt.subquery())) or 0
    rows = session.scalars(stmt.order_by(Prompt.dataset_id, Prompt.position).limit(limit).offset(offset))
    return list(rows), total
