"""JSON read strictly: a key given twice in one object is an error, not the last one's value.

Python's json keeps the last of two equal keys without a word, so `{"count": 1, "count": 0}`
was judged on 0 alone and its writer never learnt which value was taken. Every JSON a user
hands the project (the studio's request bodies, the CLI's --config file and --set values, the
reward server's requests, prompt and vote files) is read with `loads_strict`.
"""

from __future__ import annotations

import json
import re
from typing import Any


class RepeatedKeyError(json.JSONDecodeError):
    """A key given twice in one JSON object (the text is otherwise JSON)."""


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


def loads_strict(text: str | bytes) -> Any:
    """json.loads, refusing a key repeated in one object: a RepeatedKeyError (a
    json.JSONDecodeError) that names it, at the key's second occurrence in the text as near
    as a search can tell."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _Repeated as exc:
        doc = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        spelled = re.escape(json.dumps(exc.key))
        found = list(re.finditer(spelled + r"\s*:", doc))
        position = found[1].start() if len(found) > 1 else 0
        raise RepeatedKeyError(f"key {exc.key!r} given twice in one object", doc,
                               position) from None
