"""Files under the storage directory: safe resolution (never outside it) and atomic writes."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from app.config import get_settings
from app.errors import NotFound


def storage_root(root: Path | None = None) -> Path:
    root = (root or get_settings().resolved_storage_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    return root


def unwritable(directory: Path, who: str = "this process") -> str | None:
    """Why `directory` cannot take this process's files (made if missing, a file created in
    it), or None: a path under a file (NotADirectoryError), a read-only or full disk. A start
    that checks it says so in one line naming the setting; found later, it was a traceback
    (the server's lifespan: 70 lines) or a failure in every job."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        lines = str(exc).strip().splitlines()
        return (f"{directory} is not a directory {who} can write "
                f"({type(exc).__name__}: {lines[0] if lines else ''})")
    return None


def resolve(rel_path: str, root: Path | None = None) -> Path:
    """The file `rel_path` names inside the storage root; NotFound for anything outside it
    (absolute paths, `..`, symlinks that leave the root) or missing."""
    base = storage_root(root)
    if not rel_path or "\x00" in rel_path:
        raise NotFound("no such file")
    candidate = Path(rel_path)
    if candidate.is_absolute():
        try:
            candidate = candidate.resolve().relative_to(base)
        except ValueError:
            raise NotFound("no such file") from None
    try:
        full = (base / candidate).resolve(strict=True)
    except (OSError, RuntimeError):
        raise NotFound("no such file") from None
    if not full.is_relative_to(base) or not full.is_file():
        raise NotFound("no such file")
    return full


# Linux's limits (NAME_MAX, PATH_MAX): a longer name part or path makes every file-system call
# on it fail with ENAMETOOLONG, so such a value is refused up front with the limits named
NAME_MAX = 255
PATH_MAX = 4096


def _length_problem(value: str) -> str | None:
    """Why `value` cannot name a file on this system at all (a name part or the whole path
    too long, counted in bytes as the file system counts them), or None."""
    try:
        encoded = os.fsencode(value)
    except UnicodeError:  # a lone surrogate: no file can have that name
        return "must be a path of valid Unicode text"
    if len(encoded) >= PATH_MAX:
        return f"is too long: a path has at most {PATH_MAX - 1} bytes, got {len(encoded)}"
    longest = max((len(part) for part in encoded.split(b"/")), default=0)
    if longest > NAME_MAX:
        return (f"has a name part too long: at most {NAME_MAX} bytes between slashes, got "
                f"{longest}")
    return None


def _refuse_unnamable(value: str, allowed: str) -> None:
    """ValueError saying what is `allowed` when `value` cannot name a file at all: empty, a
    NUL in it, or too long for the file system (`_length_problem`)."""
    if not value.strip() or "\x00" in value:
        raise ValueError(f"must name {allowed}")
    if (problem := _length_problem(value)) is not None:
        raise ValueError(f"{problem}; must name {allowed}")


def _is(full: Path, want: str) -> bool:
    """Whether `full` is a file (`want="file"`) or a directory; False when the file system
    cannot say (a path grown too long after symlinks, no permission)."""
    try:
        return full.is_file() if want == "file" else full.is_dir()
    except OSError:
        return False


def job_path(value: str, *, want: str = "file") -> Path:
    """The file (or directory, `want="dir"`) a job config names by path: absolute, or relative
    to STORAGE_DIR (then MODELS_DIR), and in every case inside one of those two, so that a job
    can never read an arbitrary file on a worker. ValueError says what is allowed."""
    settings = get_settings()
    roots = [settings.resolved_storage_dir, settings.resolved_models_dir]
    allowed = f"a {want} under STORAGE_DIR ({roots[0]}) or MODELS_DIR ({roots[1]})"
    _refuse_unnamable(value, allowed)
    given = Path(value)
    inside: list[Path] = []  # candidates inside the roots, but missing or of the other kind
    for candidate in [given] if given.is_absolute() else [root / given for root in roots]:
        try:
            full = candidate.resolve()  # symlinks followed: one that leaves the roots is out
        except (OSError, RuntimeError):
            continue
        if any(full.is_relative_to(root) for root in roots):
            if _is(full, want):
                return full
            inside.append(full)
    if inside:  # allowed places: say what is wrong there (outside them, nothing is said)
        # the one that exists, of the other kind, says more than one that does not
        there = next((p for p in inside if _is(p, "file") or _is(p, "dir")), inside[0])
        try:
            what = ("does not exist" if not there.exists() else
                    f"is a {'directory' if there.is_dir() else 'file'}, not a {want}")
        except OSError as exc:  # a name grown too long after symlinks, no permission
            what = f"cannot be read ({exc.strerror or exc})"
        raise ValueError(f"{value!r} {what} ({there}); it must name {allowed}")
    raise ValueError(f"{value!r} is not {allowed}")


def model_dir(value: str) -> Path:
    """The model directory a job config names (`model_path`): absolute, or relative to
    MODELS_DIR, and inside MODELS_DIR only (weights an operator installed, never a job's own
    outputs under STORAGE_DIR). Whether it exists and is complete is the model registry's
    question (`trainer.models.model_dir_problem`). ValueError says what is allowed."""
    root = get_settings().resolved_models_dir.resolve()
    allowed = f"a directory under MODELS_DIR ({root})"
    _refuse_unnamable(value, allowed)
    given = Path(value)
    try:
        full = (given if given.is_absolute() else root / given).resolve()  # symlinks followed
    except (OSError, RuntimeError):
        raise ValueError(f"{value!r} is not {allowed}") from None
    if full == root or not full.is_relative_to(root):
        raise ValueError(f"{value!r} is not {allowed}")
    if (problem := _length_problem(str(full))) is not None:  # MODELS_DIR and the value together
        raise ValueError(f"{problem} (as {root}/...); must name {allowed}")
    return full


def reward_model_dir(value: str) -> Path:
    """The weights directory a job config's `reward_model_paths` names: absolute, or relative
    to REWARD_MODELS_DIR (then MODELS_DIR), and inside one of those two only (weights an
    operator installed). Whether it holds the reward's files is the reward's question
    (`trainer.rewards.models.weights_problem`). ValueError says what is allowed."""
    settings = get_settings()
    roots = [settings.resolved_reward_models_dir, settings.resolved_models_dir]
    allowed = f"a directory under REWARD_MODELS_DIR ({roots[0]}) or MODELS_DIR ({roots[1]})"
    _refuse_unnamable(value, allowed)
    given = Path(value)
    candidates = [given] if given.is_absolute() else [root / given for root in roots]
    resolved = []
    for candidate in candidates:
        try:
            full = candidate.resolve()  # symlinks followed: one that leaves the roots is out
        except (OSError, RuntimeError):
            continue
        if _length_problem(str(full)) is not None:  # the root and the value together
            continue
        if any(full != root and full.is_relative_to(root) for root in roots):
            if _is(full, "dir"):
                return full
            resolved.append(full)
    if resolved:  # inside a root but not there (yet): the reward's check names its files
        return resolved[0]
    raise ValueError(f"{value!r} is not {allowed}")


def write_bytes(rel_path: str, data: bytes, root: Path | None = None) -> Path:
    """Write atomically (temp file + rename) to `root/rel_path`; returns the full path."""
    base = storage_root(root)
    full = (base / rel_path).resolve()
    if not full.is_relative_to(base):
        raise ValueError(f"{rel_path!r} leaves the storage directory")
    full.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=full.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, full)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        if exc.filename is None and exc.errno is not None:
            # a write to the open file (a full disk) names no file; the worker tells a
            # storage outage from a bug by the path (worker.tasks.storage_outage)
            raise OSError(exc.errno, exc.strerror, str(full)) from exc
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return full


def relative(path: str | Path, root: Path | None = None) -> str:
    """`path` relative to the storage root if it lies inside it, else unchanged."""
    base = storage_root(root)
    p = Path(path)
    full = p if p.is_absolute() else (base / p)
    try:
        return full.resolve().relative_to(base).as_posix()
    except ValueError:
        return str(path)
