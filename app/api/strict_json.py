"""JSON request bodies read strictly: a key given twice in one object is refused.

Python's json (which FastAPI reads bodies with) keeps the last of two equal keys without a
word, so `{"iterations": 2, "iterations": "x"}` was judged on "x" alone, and a client whose
serializer merged two dicts by accident never learnt which value the server took. Every
router's routes read their body through `StrictJSONRoute`, so such a body is a 422 naming the
key (`body: malformed JSON (key 'iterations' given twice in one object at character N)`),
after the caller's own 401 or 403, as any malformed body is (app.main).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute


class _RepeatedKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _RepeatedKey(key)
        seen[key] = value
    return seen


def loads_strict(text: str | bytes) -> Any:
    """json.loads, refusing a key repeated in one object (a json.JSONDecodeError that names
    it, at the key's second occurrence in the text as near as a search can tell)."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _RepeatedKey as exc:
        doc = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        spelled = re.escape(json.dumps(exc.key))
        found = list(re.finditer(spelled + r"\s*:", doc))
        position = found[1].start() if len(found) > 1 else 0
        raise json.JSONDecodeError(f"key {exc.key!r} given twice in one object", doc,
                                   position) from None


class StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads_strict(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """An API route whose JSON body is read by loads_strict."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict
