"""JSON values the database and the API can hold: one cleaning for uploads' metadata, job
metrics and checkpoint scores alike."""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.responses import JSONResponse


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float (NaN, inf: what 1e400 parses to) replaced by None,
    in nested dicts and lists too: json.dumps would write them as the non-JSON tokens NaN and
    Infinity, and PostgreSQL's json type refuses them. Numpy scalars (a trainer's metrics) become Python numbers. Iterative, so that no
    nesting depth can exhaust Python's recursion (an upload's is bounded anyway)."""
    def leaf(v: Any) -> Any:
        if type(v).__module__ == "numpy" and hasattr(v, "item"):  # a numpy scalar (metrics)
            v = v.item()
        return v if not isinstance(v, float) or math.isfinite(v) else None

    if not isinstance(value, dict | list | tuple):
        return leaf(value)
    root: dict[Any, Any] | list[Any] = {} if isinstance(value, dict) else []
    stack: list[tuple[Any, dict[Any, Any] | list[Any]]] = [(value, root)]
    while stack:
        source, target = stack.pop()
        items = source.items() if isinstance(source, dict) else enumerate(source)
        for key, item in items:
            if isinstance(item, dict | list | tuple):
                child: dict[Any, Any] | list[Any] = {} if isinstance(item, dict) else []
                stack.append((item, child))
            else:
                child = leaf(item)
            if isinstance(target, dict):
                target[key] = child
            else:
                target.append(child)
    return root


def lone_surrogate(value: Any) -> str | None:
    """The first half-character (U+D800-U+DFFF) in `value`'s strings, dict keys included, or
    None. Only a JSON escape ("\\ud800") makes one: no UTF-8 text holds it, so a value holding
    one can be neither stored (PostgreSQL refuses it, SQLite's driver cannot encode it) nor
    answered; it is refused at the door instead."""
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, list | tuple):
            stack += item
        elif isinstance(item, str) and (
                half := next((c for c in item if 0xD800 <= ord(c) <= 0xDFFF), None)) is not None:
            return half
    return None


class EscapingJSONResponse(JSONResponse):
    """Starlette's JSONResponse, except that text UTF-8 cannot hold (a lone surrogate, which a
    JSON body may carry as "\\ud800" and an error then names) is written as a JSON escape
    instead of failing the response with a 500. Other text stays as it is."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, indent=None,
                              separators=(",", ":")).encode("ascii")
