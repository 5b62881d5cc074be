"""JSON request bodies read strictly: a key given twice in one object is refused.

Python's json (which FastAPI reads bodies with) keeps the last of two equal keys without a
word, so `{"iterations": 2, "iterations": "x"}` was judged on "x" alone, and a client whose
serializer merged two dicts by accident never learnt which value the server took
(trainer.strict_json, which the CLI and the reward server read JSON with too). Every
router's routes read their body through `StrictJSONRoute`, so such a body is a 422 naming the
key (`body: malformed JSON (key 'iterations' given twice in one object at character N)`),
after the caller's own 401 or 403, as any malformed body is (app.main).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from types import UnionType
from typing import Any, Union, get_args, get_origin

from fastapi import Request, Response
from fastapi.routing import APIRoute

from app.errors import Invalid
from trainer.strict_json import loads_strict


class StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads_strict(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """An API route whose JSON body is read by loads_strict."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        single = _single_valued_query_params(self)

        async def strict(request: Request) -> Response:
            keys = [key for key, _ in request.query_params.multi_items()]
            if repeated := [k for k in dict.fromkeys(keys) if k in single and keys.count(k) > 1]:
                from app.api.deps import refused_caller

                if (refused := await refused_caller(request)) is not None:
                    raise refused  # the caller's 401 or 403 first, as for a bad body
                # FastAPI keeps the last of `?dataset_id=1&dataset_id=2` without a word
                problems = [{"field": k, "message": f"given {keys.count(k)} times; this "
                             "parameter takes one value"} for k in repeated]
                raise Invalid("; ".join(f"{p['field']}: {p['message']}" for p in problems),
                              field=repeated[0], errors=problems)
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict


def _single_valued_query_params(route: APIRoute) -> set[str]:
    """The route's query parameters that take one value (not a list, as votes/next's
    `exclude` is): a repeated one is refused rather than guessed."""
    def is_list(annotation: Any) -> bool:
        origin = get_origin(annotation)
        if origin in (Union, UnionType):
            return any(is_list(arg) for arg in get_args(annotation))
        return origin in (list, tuple, set, frozenset) or annotation in (list, tuple, set)

    names: set[str] = set()
    stack = [route.dependant]  # the route's own parameters and its dependencies'
    while stack:
        dependant = stack.pop()
        names |= {field.alias for field in dependant.query_params
                  if not is_list(field.field_info.annotation)}
        stack.extend(dependant.dependencies)
    return names
