"""A failed write named as the OSError it is.

safetensors writes its files in Rust, and a write the operating system refuses (a full disk or
quota, a read-only file system) comes back as a `SafetensorError` whose message ends
"No space left on device (os error 28)", not as an OSError: no errno, no path; and Python's
own write to an open file raises an OSError that names no file. A caller that
tells a storage failure from a bug (a job runner that waits for its storage to be writable
again, and fails a run that is wrong) reads both from `as_os_error`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def as_os_error(exc: BaseException, path: str | Path) -> OSError | None:
    """`exc` as an OSError on `path` (where the write went) when its message carries an
    operating system error number (Rust's "(os error N)"), or when it is an OSError that
    names no file (Python's write to an open file: "[Errno 28] No space left on device");
    None for other errors, and for an OSError that names its file itself."""
    if isinstance(exc, OSError):
        if exc.errno is None or exc.filename is not None:
            return None
        return OSError(exc.errno, exc.strerror, str(path))
    match = _OS_ERROR.search(str(exc))
    if match is None:
        return None
    code = int(match.group(1))
    return OSError(code, os.strerror(code), str(path))


def readable_as_umask_allows(path: str | Path) -> None:
    """Give `path` (a file, or every file under a directory) the permissions open() would
    have given it under this process's umask (0o666 & ~umask): safetensors writes through a
    temporary file created 0600 (safetensors issue #782), so a checkpoint, a LoRA or a
    preference model was readable by its writer alone, and the model card's
    `load_lora_weights` failed for a colleague or another container's user."""
    umask = _umask()
    path = Path(path)
    for file in ([path] if path.is_file() else path.rglob("*")):
        if file.is_file() and not file.is_symlink():
            os.chmod(file, 0o666 & ~umask)


def _umask() -> int:
    """This process's umask, read (Linux: /proc/self/status) rather than set and set back:
    os.umask(0) would, for that moment, give every file another thread of the process
    creates (a server's, a job runner's) the permissions 0o666."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o077)  # elsewhere: set (to the stricter value) and set back
    os.umask(umask)
    return umask
