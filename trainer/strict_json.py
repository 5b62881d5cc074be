"""JSON read strictly: a key given twice in one object is an error, not the last one's value.

Python's json keeps the last of two equal keys without a word, so `{"count": 1, "count": 0}`
was judged on 0 alone and its writer never learnt which value was taken. Every JSON a user
hands the project (the studio's request bodies, the CLI's --config file and --set values, the
reward server's requests, prompt and vote files) is read with `loads_strict`.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any


class RepeatedKeyError(json.JSONDecodeError):
    """A key given twice in one JSON object (the text is otherwise JSON)."""


class NumberTooLargeError(json.JSONDecodeError):
    """An integer with more digits than Python converts (sys.get_int_max_str_digits, 4300 by
    default), which json.loads reports as a bare ValueError naming no place in the text."""


class _Repeated(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _Repeated(key)
        seen[key] = value
    return seen


def _too_long_integer_at(doc: str, limit: int) -> int:
    """Where the first integer of more than `limit` digits starts in `doc`, a JSON text that
    reads well up to it; 0 when no search finds it. Strings are stepped over whole, so digits
    inside one do not count, nor do the digits of a number with a fraction or an exponent (a
    float: it has no such limit). Possessive, so a long run of digits is read once."""
    token = re.compile(r'"(?:[^"\\]++|\\.)*+"'  # a string, escapes and all
                       r"|(?<![\w.+-])-?+\d{" + str(limit + 1) + r",}+(?![.eE])")
    for match in token.finditer(doc):
        if not match.group().startswith('"'):
            return match.start()
    return 0


def loads_strict(text: str | bytes) -> Any:
    """json.loads, refusing a key repeated in one object: a RepeatedKeyError (a
    json.JSONDecodeError) that names it, at the key's second occurrence in the text as near
    as a search can tell. An integer too long to convert is a NumberTooLargeError (also a
    json.JSONDecodeError) at its first character, not json's bare ValueError, which callers
    (the API's body reader) could only call unreadable."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _Repeated as exc:
        doc = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        spelled = re.escape(json.dumps(exc.key))
        found = list(re.finditer(spelled + r"\s*:", doc))
        position = found[1].start() if len(found) > 1 else 0
        raise RepeatedKeyError(f"key {exc.key!r} given twice in one object", doc,
                               position) from None
    except json.JSONDecodeError:
        raise
    except ValueError as exc:
        limit = sys.get_int_max_str_digits()
        if not limit or "integer string conversion" not in str(exc):
            raise
        # decoded as json.loads decodes bytes, so the position counts its characters
        doc = text.decode(json.detect_encoding(text), "replace") if isinstance(text, bytes) \
            else text
        raise NumberTooLargeError(f"number with more than {limit} digits", doc,
                                  _too_long_integer_at(doc, limit)) from None
