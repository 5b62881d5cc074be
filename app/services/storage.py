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


def _under_roots(value: str, roots: dict[str, Path], want: str | None) -> Path:
    """The path `value` names inside one of `roots` (name -> directory): absolute, or relative
    to each root in turn, symlinks followed, so that a job can never read an arbitrary file on
    a worker. `want` "file" / "dir": the first candidate that is one; None: a directory strictly
    inside a root, existing or not yet (its own check then names the files it lacks), an
    existing one preferred. ValueError says what is allowed."""
    allowed = (f"a {want or 'directory'} under "
               + " or ".join(f"{name} ({root})" for name, root in roots.items()))
    if not value.strip() or "\x00" in value:
        raise ValueError(f"must name {allowed}")
    given = Path(value)
    candidates = [given] if given.is_absolute() else [root / given for root in roots.values()]
    not_yet = []
    for candidate in candidates:
        try:
            full = candidate.resolve()  # symlinks followed: one that leaves the roots is out
        except (OSError, RuntimeError):
            continue
        if not any(full.is_relative_to(root) and (want or full != root)
                   for root in roots.values()):
            continue
        if want is None:
            if full.is_dir():
                return full
            not_yet.append(full)
        elif full.is_file() if want == "file" else full.is_dir():
            return full
    if not_yet:
        return not_yet[0]
    raise ValueError(f"{value!r} is not {allowed}")


def job_path(value: str, *, want: str = "file") -> Path:
    """The file (or directory, `want="dir"`) a job config names by path: absolute, or relative
    to STORAGE_DIR (then MODELS_DIR), and in every case inside one of those two."""
    settings = get_settings()
    return _under_roots(value, {"STORAGE_DIR": settings.resolved_storage_dir,
                                "MODELS_DIR": settings.resolved_models_dir}, want)


def model_dir(value: str) -> Path:
    """The model directory a job config names (`model_path`): absolute, or relative to
    MODELS_DIR, and inside MODELS_DIR only (weights an operator installed, never a job's own
    outputs under STORAGE_DIR). Whether it exists and is complete is the model registry's
    question (`trainer.models.model_dir_problem`)."""
    return _under_roots(value, {"MODELS_DIR": get_settings().resolved_models_dir.resolve()},
                        None)


def reward_model_dir(value: str) -> Path:
    """The weights directory a job config's `reward_model_paths` names: absolute, or relative
    to REWARD_MODELS_DIR (then MODELS_DIR), and inside one of those two only (weights an
    operator installed). Whether it holds the reward's files is the reward's question
    (`trainer.rewards.models.weights_problem`)."""
    settings = get_settings()
    return _under_roots(value, {"REWARD_MODELS_DIR": settings.resolved_reward_models_dir,
                                "MODELS_DIR": settings.resolved_models_dir}, None)


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
