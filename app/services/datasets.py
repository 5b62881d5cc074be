"""Prompt datasets: parse an upload (txt, csv, jsonl, json, parquet), normalise, dedupe, split.

Every problem in an upload is an `Invalid` (or `PayloadTooLarge`) whose message names the file,
the line or row, and the reason; parsing finishes before anything is written, so a bad upload
stores nothing. A problem with the file as a whole (its type, encoding, header, a JSON or parquet
file that cannot be read) stops there; bad records do not: every one is reported at once (the
first `MAX_REPORTED` in full, then how many more), so that one upload fixes them all. Blank
lines (of a .txt, .jsonl or .csv) are skipped and counted, not errors: they separate records,
they are not records. An empty prompt in a record is an error.

A record's own `split` (a csv column, a jsonl / json key, a parquet column: 'train', or 'eval'
or 'test' for the held-out split) decides its prompt's split, as HPDv2-style files give it;
then it is on every record, and the upload's `eval_fraction` stays 0.

Metadata is stored and exported as strict JSON: non-finite numbers (NaN, 1e400) become null.
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
import re
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import PurePath, PurePosixPath
from typing import Any

from sqlalchemy import delete, func, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.db import write_lock
from app.errors import BadRequest, Conflict, Invalid, NotFound, PayloadTooLarge, ServiceError
from app.json_values import json_safe, lone_surrogate
from app.limits import FILENAME_LENGTH, NAME_LENGTH, SQL_BATCH
from app.models import ACTIVE_JOB_STATUSES, Dataset, Job, Prompt
from app.schemas import look_alike_difference, look_alike_key, refuse_hidden, refuse_nul
from trainer.config import prompt_text_problem
from trainer.text_files import decode_lines

FORMATS = ("txt", "csv", "jsonl", "json", "parquet")
# bad records reported in full; the rest are counted (an answer of 100,000 problems helps
# nobody, and costs memory to build)
MAX_REPORTED = 20
# how deeply a record's metadata may nest (HPDv2's is 2 levels): deeper would exhaust the
# recursion of JSON encoding and of PostgreSQL's parser, and is no prompt set's metadata
MAX_META_DEPTH = 64


@dataclass
class ParsedPrompt:
    text: str
    meta: dict[str, Any] | None
    where: str  # "line 3" / "row 2": for error messages
    loc: dict[str, Any] = field(default_factory=dict)  # {"line": 3} / {"row": 2}: for clients


@dataclass
class BadRecord:
    """One record of an upload that cannot be imported, and why."""

    where: str
    message: str
    loc: dict[str, Any] = field(default_factory=dict)


# a record's `split` value -> the prompt's split: 'test' is HPDv2's name for the held-out set
GIVEN_SPLITS = {"train": "train", "eval": "eval", "test": "eval"}
SPLIT_KEY = "split"


@dataclass
class ParsedUpload:
    format: str
    prompts: list[ParsedPrompt]  # unique, normalised
    duplicates_dropped: int
    blank_lines_skipped: int
    # each prompt's split as its record gives it ('train' / 'eval'), None when none does
    splits: list[str] | None = None


@dataclass
class ImportResult:
    dataset: Dataset
    duplicates_dropped: int
    blank_lines_skipped: int = 0


@dataclass
class _Counts:
    blank: int = 0


Records = Iterator[ParsedPrompt | BadRecord]


class _Report:
    """The bad records of one upload, in file order: the first MAX_REPORTED kept, the rest
    counted; `check()` raises one Invalid naming them all."""

    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.kept: list[BadRecord] = []
        self.count = 0

    def add(self, bad: BadRecord) -> None:
        self.count += 1
        if len(self.kept) < MAX_REPORTED:
            self.kept.append(bad)

    def check(self) -> None:
        if not self.count:
            return
        lines = [f"{self.filename}: {b.where}: {b.message}" for b in self.kept]
        more = self.count - len(self.kept)
        if more:
            lines.append(f"and {more} more bad record(s)")
        first = self.kept[0]
        # the first problem's place at the top (as a single problem always had it), every
        # one in `errors`
        raise Invalid("; ".join(lines), file=self.filename, field="file", **first.loc,
                      errors=[{"field": "file", "where": b.where, "message": b.message,
                               **b.loc} for b in self.kept],
                      error_count=self.count)


# characters that show nothing and mean nothing in a prompt: a byte-order mark left inside a
# file (two files joined), a zero-width space, a word joiner. Kept, "\ufeffone red circle"
# was a second prompt beside "one red circle", which looks the same, and not a shapes prompt.
# (Zero-width joiners and non-joiners stay: emoji sequences and some scripts need them.)
INVISIBLE = dict.fromkeys(map(ord, "\ufeff\u200b\u2060"))


def normalise(text: str) -> str:
    """Drop the INVISIBLE characters, collapse runs of whitespace to one space and strip the
    ends."""
    return " ".join(text.translate(INVISIBLE).split())


def detect_format(filename: str) -> str:
    suffix = PurePath(filename or "").suffix.lower().lstrip(".")
    if suffix not in FORMATS:
        given = f".{suffix}" if suffix else "(none)"
        raise BadRequest(f"{filename or '(no name)'}: unsupported file type {given}; use one of "
                         f"{', '.join('.' + f for f in FORMATS)}", field="file")
    return suffix


def _decode(data: bytes) -> tuple[str, list[BadRecord]]:
    """The file's text and a BadRecord for each line that is not UTF-8 (its first bad byte),
    that line's bad bytes replaced by U+FFFD so that the rest of the file is still read and
    its own problems named in the same answer (a bad byte hid a NUL two lines down); the
    trainer's prompt-file reader decodes and words them alike (trainer.text_files)."""
    try:
        return data.decode("utf-8-sig"), []
    except UnicodeDecodeError:
        pass
    lines, bad = decode_lines(data)
    return "\n".join(lines), [BadRecord(f"line {number}",
                                        message.removeprefix(f"line {number}: "),
                                        {"line": number})
                              for number, message in bad.items()]


def nesting_depth(value: Any, limit: int = MAX_META_DEPTH) -> int:
    """How deeply `value`'s dicts and lists nest (a scalar: 0, `{"a": [1]}`: 2), counted
    without recursion; stops counting past `limit` (returns limit + 1)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, dict | list | tuple):
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return limit + 1
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children)
    return deepest


class _RepeatedKeys(dict):
    """A JSON object of an upload in which a key was given twice: Python's json keeps the last
    value without a word (`{"prompt": "a", "prompt": "b"}` stored "b"), so the record is
    refused naming the key, as a repeated key of a request body or a CSV column name is."""

    repeated: list[str]


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json.loads' object_pairs_hook for uploads: a dict, marked when a key repeats."""
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    # counted once: keys.count(key) for each key took a minute on a 40,000-key object
    seen = Counter(key for key, _ in pairs)
    marked = _RepeatedKeys(obj)
    marked.repeated = [key for key in obj if seen[key] > 1]
    return marked


def _repeated_key_problem(value: Any) -> str | None:
    """The first object (in `value`, nested ones included) that repeats a key, said."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, _RepeatedKeys):
            return (f"key(s) {', '.join(repr(k) for k in item.repeated)} given twice in one "
                    "object (which value is meant?)")
        stack.extend(item.values() if isinstance(item, dict) else
                     item if isinstance(item, list) else ())
    return None


def _meta_problem(meta: dict[str, Any]) -> str | None:
    # the record's own object is a level: its metadata may nest MAX_META_DEPTH - 1 more
    if nesting_depth(meta) > MAX_META_DEPTH:
        return f"metadata nested deeper than {MAX_META_DEPTH} levels"
    if (problem := _repeated_key_problem(meta)) is not None:
        return f"metadata: {problem}"
    if (half := lone_surrogate(meta)) is not None:
        return f"metadata holds a lone surrogate escape (U+{ord(half):04X}), which is not text"
    return None


def _meta_value(value: Any) -> Any:
    # parquet values made JSON-safe (dates, bytes, decimals: their text)
    value = json_safe(value)
    try:
        json.dumps(value, allow_nan=False)
        return value
    except (TypeError, ValueError):
        return str(value)


LINE_END = re.compile(r"\r\n|\r|\n")


def _parse_txt(filename: str, text: str, counts: _Counts) -> Records:
    # "\n", "\r\n" or a lone "\r" (classic Mac files; the .jsonl and .csv readers take it too)
    # end a line: str.splitlines() would also split at U+2028, form feeds and the \x1c-\x1e
    # separators, making one line two prompts and every later line number wrong
    lines = LINE_END.split(text)
    if lines[-1] == "":
        lines.pop()  # the last line's terminator, not a blank line
    for i, line in enumerate(lines, 1):
        if line.strip():
            yield ParsedPrompt(line, None, f"line {i}", {"line": i})
        else:
            counts.blank += 1


def _parse_csv(filename: str, text: str, counts: _Counts) -> Records:
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    try:
        header = next(reader)
    except StopIteration:
        return
    except csv.Error as exc:
        raise Invalid(f"{filename}: line 1: malformed CSV header ({exc})", file=filename, line=1) from None
    header = [h.strip() for h in header]
    if "prompt" not in header:
        raise Invalid(
            f"{filename}: line 1: missing column 'prompt' (columns: {', '.join(header) or 'none'})",
            file=filename,
            line=1,
        )
    # a repeated name ("prompt,x,x") would keep one column's values and drop the other's
    # without a word (the metadata is a dict by column name), or pick one of two prompts
    columns = Counter(header)  # once: header.count per column took minutes on 100,000 columns
    repeated = [name for name in dict.fromkeys(header) if columns[name] > 1]
    if repeated:
        raise Invalid(
            f"{filename}: line 1: repeated column name(s) "
            f"{', '.join(repr(name) for name in repeated)}: every column needs a name of its "
            "own (a repeated one's values would be lost)",
            file=filename,
            line=1,
        )
    col = header.index("prompt")
    row_no, last_line = 0, reader.line_num
    while True:
        # a row is named by the line it begins on: reader.line_num is the last line read,
        # which for a quoted field spanning lines (or a quote never closed, read to the end
        # of the file) is not where the row is
        start = last_line + 1
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:  # the reader goes on at the next line
            # a row all the same, named as a row with the wrong field count is (it was
            # "line N: malformed CSV (...)" with N the end of the file for an open quote, and
            # no row number, and the rows after it were numbered one short)
            row_no, last_line = row_no + 1, reader.line_num
            span = f" (the row runs from line {start} to line {last_line})" \
                if last_line > start else ""
            yield BadRecord(f"line {start} (row {row_no})", f"malformed row: {exc}{span}",
                            {"line": start, "row": row_no})
            continue
        last_line = reader.line_num
        if not any(cell.strip() for cell in row):
            # a blank line (no fields, or whitespace, as in a text file), or a spreadsheet's
            # ",," row: nothing in any cell
            counts.blank += 1
            continue
        row_no += 1
        where, loc = f"line {start} (row {row_no})", {"line": start, "row": row_no}
        if len(row) != len(header):
            yield BadRecord(where, f"malformed row: expected {len(header)} fields, got "
                                   f"{len(row)}", loc)
            continue
        meta = {k: v for i, (k, v) in enumerate(zip(header, row, strict=True)) if i != col}
        yield ParsedPrompt(row[col], meta or None, where, loc)


def _record(obj: Any, where: str, loc: dict[str, Any], *, strings: bool = False
            ) -> ParsedPrompt | BadRecord:
    """One JSON record: an object with a string "prompt" (other keys: its metadata), or, with
    `strings`, a bare string."""
    if strings and isinstance(obj, str):
        return ParsedPrompt(obj, None, where, loc)
    if not isinstance(obj, dict):
        return BadRecord(where, "expected a string or an object with a 'prompt' key" if strings
                         else "expected a JSON object", loc)
    if "prompt" not in obj:
        return BadRecord(where, "missing key 'prompt'", loc)
    if isinstance(obj, _RepeatedKeys):
        return BadRecord(where, _repeated_key_problem(obj) or "", loc)
    prompt = obj.pop("prompt")
    if not isinstance(prompt, str):
        return BadRecord(where, "'prompt' must be a string", loc)
    if (problem := _meta_problem(obj)) is not None:
        return BadRecord(where, problem, loc)
    return ParsedPrompt(prompt, json_safe(obj) or None, where, loc)


# JSON text holds no raw CR or LF, but may hold U+2028 and friends, which str.splitlines()
# would also split at.
_JSONL_LINE = re.compile(r"\r\n|\r|\n")


def _parse_jsonl(filename: str, text: str, counts: _Counts) -> Records:
    lines = _JSONL_LINE.split(text)
    if lines and lines[-1] == "":
        lines.pop()  # the last line's terminator, not a blank line
    for i, line in enumerate(lines, 1):
        where, loc = f"line {i}", {"line": i}
        if not line.strip():
            counts.blank += 1
            continue
        try:
            obj = json.loads(line, object_pairs_hook=_json_object)
        except json.JSONDecodeError as exc:
            yield BadRecord(where, f"malformed JSON ({exc.msg} at column {exc.colno})", loc)
            continue
        except (ValueError, RecursionError) as exc:  # an int of > 4300 digits; deep nesting
            yield BadRecord(where, f"malformed JSON ({exc})", loc)
            continue
        yield _record(obj, where, loc)


def _parse_json(filename: str, text: str, counts: _Counts) -> Records:
    """One JSON array, as HPDv2 and HPSv2's benchmark publish their prompt sets: strings
    (the benchmark's per-style test files) or objects with a "prompt" key (HPDv2's
    train.json / test.json, whose other keys - image paths, preference ranks - are kept as
    metadata)."""
    try:
        items = json.loads(text, object_pairs_hook=_json_object)
    except json.JSONDecodeError as exc:
        raise Invalid(f"{filename}: line {exc.lineno}: malformed JSON ({exc.msg} at column "
                      f"{exc.colno})", file=filename, line=exc.lineno) from None
    except RecursionError:
        raise Invalid(f"{filename}: malformed JSON (nested too deeply)", file=filename) from None
    except ValueError as exc:
        raise Invalid(f"{filename}: malformed JSON ({exc})", file=filename) from None
    if not isinstance(items, list):
        raise Invalid(f"{filename}: expected a JSON array of prompts (strings or objects with "
                      f"a 'prompt' key), got a {type(items).__name__}", file=filename)
    for i, item in enumerate(items, 1):
        where = f"item {i}"
        yield _record(item, where, {"where": where}, strings=True)


# A parquet file is compressed, and its dictionary and run-length encodings repeat one value
# any number of times at no cost: 2 MB of parquet read as 20 GB of strings (ten million rows
# of one 2,000-character prompt), and a metadata column of one 1 GB value compresses to
# kilobytes. So what it holds once read is bounded by MAX_UPLOAD_BYTES as a text file's is: at
# most as many cells (rows x columns) as a CSV of that size could hold (a byte each, its comma
# or line end), and columns of at most PARQUET_EXPANSION times that many bytes (real prompts
# compress some 3 to 4 times), read in batches of PARQUET_BATCH_ROWS rows and counted as read.
PARQUET_EXPANSION = 4
PARQUET_BATCH_ROWS = 1024


def _read_parquet(filename: str, data: bytes, max_bytes: int) -> Any:
    """The parquet file `data` as a pyarrow Table, or PayloadTooLarge as soon as its cells or
    its bytes once read pass their bounds (see PARQUET_EXPANSION); the Arrow and OS errors of
    an unreadable file pass through."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    budget = PARQUET_EXPANSION * max_bytes

    def too_large(what: str) -> PayloadTooLarge:
        return PayloadTooLarge(
            f"{filename}: the file {what}, more than a file of the upload limit may hold once "
            f"read: at most {max_bytes} cells and {budget} bytes ({PARQUET_EXPANSION} x "
            f"MAX_UPLOAD_BYTES, {max_bytes})", field="file")

    parquet = pq.ParquetFile(io.BytesIO(data))
    meta = parquet.metadata
    if (cells := meta.num_rows * max(meta.num_columns, 1)) > max_bytes:
        raise too_large(f"holds {cells} cells ({meta.num_rows} rows x {meta.num_columns} "
                        "columns)")
    # what the pages say they hold decompressed, before one is decompressed
    declared = sum(meta.row_group(g).column(c).total_uncompressed_size
                   for g in range(meta.num_row_groups) for c in range(meta.num_columns))
    if declared > budget:
        raise too_large(f"holds more than {budget} bytes once read ({declared})")
    batches, size = [], 0
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS):
        # (a repeated value is counted each time: it is read as that many strings)
        size += batch.nbytes
        if size > budget:
            raise too_large(f"holds more than {budget} bytes once read")
        batches.append(batch)
    return pa.Table.from_batches(batches, schema=parquet.schema_arrow)


def _parse_parquet(filename: str, data: bytes, counts: _Counts, max_bytes: int) -> Records:
    import pyarrow as pa

    try:
        table = _read_parquet(filename, data, max_bytes)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise Invalid(f"{filename}: not a readable parquet file ({exc})", file=filename) from None
    names = table.column_names
    if "prompt" not in names:
        raise Invalid(
            f"{filename}: missing column 'prompt' (columns: {', '.join(names) or 'none'})",
            file=filename,
        )
    if (repeats := names.count("prompt")) > 1:  # which one holds the prompts is not guessed
        raise Invalid(f"{filename}: column 'prompt' given {repeats} times; the file takes one",
                      file=filename, column="prompt")
    prompt_type = table.schema.field("prompt").type
    if not (pa.types.is_string(prompt_type) or pa.types.is_large_string(prompt_type)):
        raise Invalid(f"{filename}: column 'prompt' must hold strings, not {prompt_type}",
                      file=filename, column="prompt")
    columns: dict[str, list[Any]] = {}
    for index, name in enumerate(names):  # by index: a repeated metadata name is no error
        try:
            columns[name] = table.column(index).to_pylist()
        except (pa.ArrowException, ValueError, OverflowError, LookupError) as exc:
            # a date or timestamp outside Python's years 1-9999, say, or an unknown time zone
            raise Invalid(f"{filename}: column {name!r} holds values that cannot be read "
                          f"({type(exc).__name__}: {exc}); drop the column or cast it to "
                          "strings", file=filename, column=name) from None
    prompts = columns.pop("prompt")
    for i, prompt in enumerate(prompts):
        where = f"row {i + 1}"
        meta = {k: _meta_value(v[i]) for k, v in columns.items()}
        if (problem := _meta_problem(meta)) is not None:
            yield BadRecord(where, problem, {"row": i + 1})
            continue
        yield ParsedPrompt(prompt if prompt is not None else "", meta or None, where,
                           {"row": i + 1})


_PARSERS: dict[str, Callable[[str, str, _Counts], Records]] = {
    "txt": _parse_txt, "csv": _parse_csv, "jsonl": _parse_jsonl, "json": _parse_json}


def _prompt_problem(norm: str, max_prompt_length: int) -> str | None:
    # the length first: it costs nothing, while the character scan of a 20 MB line took
    # 20 s of the server's CPU to say what the length says
    if len(norm) > max_prompt_length:
        return (f"prompt too long ({len(norm)} characters, the limit is "
                f"{max_prompt_length})")
    return prompt_text_problem(norm)


def parse_upload(filename: str, data: bytes, *, max_prompt_length: int,
                 max_bytes: int) -> ParsedUpload:
    """Parse and check an upload: its unique prompts, duplicates dropped, blank lines skipped.
    Every bad record is reported at once (Invalid, `errors` listing them)."""
    fmt = detect_format(filename)
    if len(data) > max_bytes:
        # (the route stops reading one byte past the limit: the file's size is not known)
        raise PayloadTooLarge(f"{filename}: the file is larger than the limit of {max_bytes} "
                              "bytes (MAX_UPLOAD_BYTES)", field="file")
    counts = _Counts()
    decoded: list[BadRecord] = []
    if fmt == "parquet":
        records = _parse_parquet(filename, data, counts, max_bytes)
    else:
        text, decoded = _decode(data)
        records = _PARSERS[fmt](filename, text, counts)
    undecodable = {bad.loc["line"] for bad in decoded}
    encoding = deque(decoded)  # taken from the front: list.pop(0) made 2M bad lines quadratic
    report = _Report(filename)
    unique: list[ParsedPrompt] = []
    seen: set[str] = set()
    total = 0

    def report_encoding_up_to(line: float) -> None:
        # the encoding problems in file order among the others
        while encoding and encoding[0].loc["line"] <= line:
            report.add(encoding.popleft())

    splits: list[str] = []
    with_split: list[str] = []  # where records give a split, and where they do not
    without_split: list[str] = []
    for record in records:
        line = record.loc.get("line")
        if line is not None:
            report_encoding_up_to(line)
            if line in undecodable:  # said once: its bad bytes, not what they became
                continue
        if isinstance(record, BadRecord):
            report.add(record)
            continue
        total += 1
        norm = normalise(record.text)
        if (problem := _prompt_problem(norm, max_prompt_length)) is not None:
            report.add(BadRecord(record.where, problem, record.loc))
            continue
        given = (record.meta or {}).get(SPLIT_KEY)
        (with_split if given is not None else without_split).append(record.where)
        split = GIVEN_SPLITS.get(given.strip().lower()) if isinstance(given, str) else None
        if given is not None and split is None:
            report.add(BadRecord(record.where, f"{SPLIT_KEY} must be 'train', or 'eval' or "
                                 f"'test' (the held-out split), got {given!r}", record.loc))
            continue
        if report.count or norm in seen:  # nothing will be imported: keep no more prompts
            continue
        seen.add(norm)
        record.text = norm
        unique.append(record)
        splits.append(split or "train")
    report_encoding_up_to(math.inf)
    try:
        report.check()
    except Invalid as exc:
        # whether the file gives splits, for an eval_fraction beside it (not part of the answer)
        exc.splits_given = bool(with_split)  # type: ignore[attr-defined]
        raise
    if with_split and without_split:
        # half a file's splits is a file cut or pasted together: which split the rest is
        # meant for is not ours to guess
        raise Invalid(f"{filename}: {len(with_split)} record(s) give a {SPLIT_KEY} and "
                      f"{len(without_split)} do not (first: {without_split[0]}); give it on "
                      "every record or on none", file=filename, field="file")
    if not unique:
        raise Invalid(f"{filename}: no prompts found", file=filename)
    return ParsedUpload(fmt, unique, total - len(unique), counts.blank,
                        splits if with_split else None)


def dataset_name(filename: str, name: str | None) -> str:
    """The name a dataset gets: the given one (at most NAME_LENGTH characters: a longer one is
    refused, not cut, since the user chose it), else the file's stem (cut to fit)."""
    given = (name or "").strip()
    if len(given) > NAME_LENGTH:
        raise Invalid(f"name: at most {NAME_LENGTH} characters (got {len(given)})", field="name")
    name = given or PurePath(filename).stem or "dataset"
    refuse_hidden("name", name)
    return name[:NAME_LENGTH]


def check_name_free(session: Session, name: str) -> None:
    """Conflict if a dataset already has this name (names pick datasets in the UI and the
    demo). Checked before parsing, for the clear message; the unique constraint catches two
    uploads racing with one name (import_dataset)."""
    # case-insensitive, as user names are: "HPDv2" and "hpdv2" side by side in the job form's
    # dataset list are one set to the eye, as are full-width letters (compared in Python:
    # NFKC is beyond the database's lower())
    key = look_alike_key(name)
    row = next((r for r in session.execute(select(Dataset.id, Dataset.name).order_by(Dataset.id))
                if look_alike_key(r[1]) == key), None)
    if row is not None:
        taken, existing = row
        clash = (f"a dataset named '{name}' already exists (dataset {taken})" if existing == name
                 else f"dataset {taken} is named '{existing}', which differs from '{name}' "
                      f"{look_alike_difference(existing, name)}")
        raise Conflict(f"name: {clash}; choose another name or delete that dataset",
                       field="name", dataset_id=taken)


def _problems(exc: ServiceError, field: str) -> list[dict[str, Any]]:
    """An error's problems as the answer lists them ({field, message, ...})."""
    if errors := exc.details.get("errors"):
        return [dict(e) for e in errors]  # type: ignore[union-attr]
    named = str(exc.details.get("field") or field)
    return [{"field": named, "message": exc.message.removeprefix(f"{named}: ")}]


def _own_filename(filename: str) -> str:
    # the file's own name: a client's path ("../../p.txt", "C:\\x\\p.txt") is not ours to keep
    return PurePosixPath(filename.replace("\\", "/")).name or filename


def name_problems(session: Session, *, filename: str, name: str | None,
                  check_name: bool = True) -> list[dict[str, Any]]:
    """The problems of an upload's file name and of the dataset name it gives (or its file's
    stem gives): hidden characters, a name another dataset has. Raised for none."""
    filename = _own_filename(filename)
    try:
        refuse_hidden("file", filename)
        if check_name:
            check_name_free(session, dataset_name(filename, name))
    except ServiceError as exc:
        return _problems(exc, "name")
    return []


def upload_content_problems(session: Session, *, filename: str, data: bytes,
                            name: str | None, max_prompt_length: int, max_bytes: int,
                            check_name: bool = True) -> list[dict[str, Any]]:
    """Every problem of an upload's file name, dataset name and content, raised for none and
    writing nothing: for an answer about the form's own fields (an eval_fraction out of range)
    that lists these beside them (app.main's 422)."""
    problems = name_problems(session, filename=filename, name=name, check_name=check_name)
    try:
        parse_upload(filename, data, max_prompt_length=max_prompt_length, max_bytes=max_bytes)
    except ServiceError as exc:
        problems += _problems(exc, "file")
    return problems


def eval_fraction_problem(filename: str, eval_fraction: float, splits_given: bool) -> str | None:
    """Why an upload's `eval_fraction` cannot split its file, or None: the file gives each
    prompt's split itself. (A share that puts every prompt in eval is taken: such a dataset
    evaluates; a train job on it is refused at submission, and the UI's upload says so.)"""
    if eval_fraction and splits_given:
        return (f"{filename} gives each prompt's {SPLIT_KEY}; leave eval_fraction at 0 (got "
                f"{eval_fraction:g}) or remove the {SPLIT_KEY} column")
    return None


def import_dataset(session: Session, *, filename: str, data: bytes, name: str | None = None,
                   eval_fraction: float = 0.0, seed: int = 0, max_prompt_length: int = 2000,
                   max_bytes: int = 50 * 1024 * 1024) -> ImportResult:
    """Parse, then write the dataset and its prompts (flush, no commit). A name (given, or the
    file's stem) that another dataset has is a Conflict."""
    if not 0.0 <= eval_fraction < 1.0:
        raise Invalid("eval_fraction must be in [0, 1)", field="eval_fraction")
    filename = _own_filename(filename)
    refuse_hidden("file", filename)  # stored and shown beside the dataset; NUL fails PostgreSQL
    # every problem at once: the name's, the content's and eval_fraction's against the file
    name_problem: Conflict | Invalid | None = None  # a name taken, or too long
    try:
        name = dataset_name(filename, name)
        check_name_free(session, name)
    except (Conflict, Invalid) as exc:
        name_problem = exc
    parsed: ParsedUpload | None = None
    problems: list[dict[str, Any]] = []
    said: list[str] = []  # the answer's detail: each error's own message, places and all
    try:
        parsed = parse_upload(filename, data, max_prompt_length=max_prompt_length,
                              max_bytes=max_bytes)
    except Invalid as exc:  # whatever is wrong with the content, the field to fix is the file
        exc.details.setdefault("field", "file")
        if name_problem is None and not eval_fraction:
            raise
        problems += _problems(exc, "file")
        said.append(exc.message)
        splits_given = getattr(exc, "splits_given", False)
    else:
        splits_given = parsed.splits is not None
    if (problem := eval_fraction_problem(filename, eval_fraction, splits_given)) is not None:
        problems.append({"field": "eval_fraction", "message": problem})
        said.append(f"eval_fraction: {problem}")
    if name_problem is not None:
        if not problems:
            raise name_problem  # a taken name alone is the 409 (a name too long, the 422)
        # with the other problems beside it, one 422 that lists them all, so the second try
        # is not refused for the file
        problems = _problems(name_problem, "name") + problems
        said = [name_problem.message, *said]
    if problems:
        raise Invalid("; ".join(said), field=problems[0]["field"], errors=problems)
    assert parsed is not None
    prompts, dropped = parsed.prompts, parsed.duplicates_dropped
    if parsed.splits is not None:
        eval_idx = {i for i, split in enumerate(parsed.splits) if split == "eval"}
        n_eval = len(eval_idx)
        eval_fraction = n_eval / len(prompts)  # what the file gave, as the dataset shows it
    else:
        n_eval = round(len(prompts) * eval_fraction)
        order = list(range(len(prompts)))
        random.Random(seed).shuffle(order)
        eval_idx = set(order[:n_eval])
    ds = Dataset(name=name, filename=filename[:FILENAME_LENGTH], format=parsed.format, num_prompts=len(prompts),
                 num_eval=n_eval, duplicates_dropped=dropped,
                 blank_lines_skipped=parsed.blank_lines_skipped, eval_fraction=eval_fraction)
    # checked again under the lock that every upload takes here, until its commit: two
    # uploads of look-alike names ('HPDv2', 'hpdv2'), which the unique constraint cannot tell
    # apart, would both have passed the first check
    write_lock(session, Dataset)
    check_name_free(session, name)
    try:
        with session.begin_nested():  # only this insert is undone if the name was taken
            session.add(ds)
            session.flush()
    except IntegrityError:  # another upload took the name since check_name_free
        check_name_free(session, name)
        raise
    rows = [
        {"dataset_id": ds.id, "position": i, "text": p.text, "meta": p.meta,
         "split": "eval" if i in eval_idx else "train"}
        for i, p in enumerate(prompts)
    ]
    for start in range(0, len(rows), SQL_BATCH):
        session.execute(insert(Prompt), rows[start:start + SQL_BATCH])
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
    # locked before the check: a job submitted on it meanwhile (jobs.create_job holds the row
    # FOR SHARE) either committed first and is found busy here, or waits and finds it gone
    write_lock(session, Dataset, dataset_id)
    busy = session.scalars(
        select(Job.id).where(Job.dataset_id == dataset_id, Job.status.in_(ACTIVE_JOB_STATUSES))
    ).all()
    if busy:
        raise Conflict(
            f"dataset {dataset_id} is used by active job(s) {', '.join(map(str, busy))}; "
            "cancel them first",
            field="dataset_id", jobs=list(busy),
        )
    session.execute(delete(Prompt).where(Prompt.dataset_id == dataset_id))
    session.execute(delete(Dataset).where(Dataset.id == dataset_id))


def prompt_rows(session: Session, dataset_id: int, split: str = "all",
                limit: int | None = None) -> list[tuple[int, str]]:
    """(id, text) of a dataset's prompts in upload order: one split's ('train', 'eval') or
    'all', the first `limit` of them when given."""
    stmt = select(Prompt.id, Prompt.text).where(Prompt.dataset_id == dataset_id)
    if split != "all":
        stmt = stmt.where(Prompt.split == split)
    stmt = stmt.order_by(Prompt.position, Prompt.id)
    if limit:
        stmt = stmt.limit(limit)
    return [(pid, text) for pid, text in session.execute(stmt)]


def prompt_texts(session: Session, dataset_id: int, split: str = "all") -> list[str]:
    """The texts of `prompt_rows`."""
    return [text for _, text in prompt_rows(session, dataset_id, split)]


def list_prompts(session: Session, *, dataset_id: int | None = None, split: str | None = None,
                 q: str | None = None, limit: int = 50, offset: int = 0) -> tuple[list[Prompt], int]:
    stmt = select(Prompt)
    if dataset_id is not None:
        get_dataset(session, dataset_id)  # 404, as GET /api/datasets/{id}, not an empty page
        stmt = stmt.where(Prompt.dataset_id == dataset_id)
    if split is not None:
        stmt = stmt.where(Prompt.split == split)
    # SQLite ends the pattern at the NUL (so it matched everything), PostgreSQL refuses it
    refuse_nul("q", q)
    if q:
        # LIKE wildcards in q are text to find, not patterns
        escaped = q.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        stmt = stmt.where(func.lower(Prompt.text).like(f"%{escaped.lower()}%", escape="\\"))
    total = session.scalar(select(func.count()).select_from(stmt.subquery())) or 0
    rows = session.scalars(stmt.order_by(Prompt.dataset_id, Prompt.position).limit(limit).offset(offset))
    return list(rows), total
