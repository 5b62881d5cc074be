"""Text files users hand the project (prompt lists): read line by line, each line that is not
UTF-8 named rather than the whole file refused. Free of torch, so the studio's upload reads
files with it without loading the trainer's tensors (the first bad upload paid a torch import
of seconds)."""

from __future__ import annotations

import codecs
import re


def decode_lines(data: bytes) -> tuple[list[str], dict[int, str]]:
    """A file's lines (a UTF-8 byte-order mark dropped) and, by line number, a problem for each
    line that is not UTF-8, worded as the studio's upload words it ("line N: bad encoding (not
    UTF-8: byte 0xff at offset N)", the offset in the file); such a line comes back with U+FFFD
    in place of its bad bytes, so that the rest of the file is still read and its own problems
    named too."""
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        # split as a file opened in text mode splits (\n, \r\n, \r), not as splitlines:
        # a JSON line may hold a raw U+2028, which splitlines would break the line at
        lines = re.split(r"\r\n|\r|\n", data[bom:].decode("utf-8"))
    except UnicodeDecodeError:
        pass
    else:
        return lines[:-1] if lines and lines[-1] == "" else lines, {}
    lines: list[str] = []
    bad: dict[int, str] = {}
    offset = bom
    for number, raw in enumerate(data[bom:].split(b"\n"), start=1):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            at = offset + exc.start
            bad[number] = (f"line {number}: bad encoding (not UTF-8: byte 0x{data[at]:02x} "
                           f"at offset {at})")
            lines.append(raw.decode("utf-8", errors="replace"))
        offset += len(raw) + 1
    if lines and lines[-1] == "":  # the final newline ends the last line, as splitlines reads it
        lines.pop()
    return [line.rstrip("\r") for line in lines], bad
