"""JSON request bodies read strictly: a key given twice in one object is refused.

Python's json (which FastAPI reads bodies with) keeps the last of two equal keys without a
word, so `{"iterations": 2, "iterations": "x"}` was judged on "x" alone, and a client whose
serializer merged two dicts by accident never learnt which value the server took
(trainer.strict_json, which the CLI and the reward server read JSON with too). Every
router's routes read their body through `StrictJSONRoute`, so such a body is a 422 naming the
key (`body: malformed JSON (key 'iterations' given twice in one object at character N)`),
after the caller's own 401 or 403, as any malformed body is (app.main). The query string is
held to the same rule: a parameter the route does not declare (`?jobid=1` for `job_id`) or
a one-valued parameter given twice is a 422 naming it, in the same answer as the request's
other problems (its parameters' and body's), and the route's work is never done. So is a
body sent to a route that takes none (`unexpected_body`), which FastAPI would never read.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Coroutine
from contextvars import ContextVar
from types import UnionType
from typing import Any, Union, get_args, get_origin
from urllib.parse import unquote_to_bytes

from fastapi import Request, Response
from fastapi.routing import APIRoute

from app.errors import Invalid
from trainer.strict_json import loads_strict

# where a request's query-string problems wait for the rest of its validation: app.main's
# handler of RequestValidationError adds its own to them (scope key), and the endpoint, when
# the rest was valid, is replaced by a 422 of them alone (context variable: the endpoint sees
# no request; FastAPI runs a sync endpoint in a thread with this context)
QUERY_PROBLEMS = "ngs.query_problems"
_pending_query_problems: ContextVar[list[dict[str, str]] | None] = ContextVar(
    "pending_query_problems", default=None)


class StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads_strict(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """An API route whose JSON body is read by loads_strict and whose query string is
    checked by query_checker."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        # the endpoint every copy of the route calls (an included router's too)
        super().__init__(path, _unless_query_problems(endpoint), **kwargs)

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        from app.api.deps import refused_caller, route_checks

        check_query = query_checker(self)
        takes_body = self.body_field is not None
        # FastAPI reads and parses a body before it solves the dependencies that check the
        # token, so an anonymous client could make the server take in (up to the body limit)
        # and parse what it sent before its 401: the caller is judged here, before a byte of
        # the body is read
        checks = route_checks(self.dependant)  # once: every request of the route asks

        async def strict(request: Request) -> Response:
            if checks and (refused := await refused_caller(request, checks)) is not None:
                raise refused
            problems = await check_query(request)
            if not takes_body and (unread := await unexpected_body(request)) is not None:
                problems = [*problems, unread]
            if problems:
                request.scope[QUERY_PROBLEMS] = problems
            token = _pending_query_problems.set(problems or None)
            try:
                return await handler(StrictJSONRequest(request.scope, request.receive))
            finally:
                _pending_query_problems.reset(token)

        return strict


# what a client may send to a route that takes no body, meaning none: some send an empty
# JSON object or null with every POST
NOTHING_SENT = (b"", b"{}", b"null")


async def unexpected_body(request: Request) -> dict[str, str] | None:
    """The problem of a body sent to a route that takes none (`POST /jobs/1/cancel` with
    `{"force": true}` was answered as if the option had been taken), or None. The body is
    read only when one is announced, and RequestBodyLimit bounds it."""
    headers = request.headers
    if headers.get("content-length", "0") == "0" and "transfer-encoding" not in headers:
        return None
    body = await request.body()
    if body.strip() in NOTHING_SENT:
        return None
    return {"field": "body", "message": f"this route takes no body ({len(body)} bytes sent); "
            "its options, where it has any, are query parameters"}


def query_invalid(problems: list[dict[str, str]]) -> Invalid:
    """The 422 of a query string's problems alone."""
    return Invalid("; ".join(f"{p['field']}: {p['message']}" for p in problems),
                   field=problems[0]["field"], errors=problems)


def _unless_query_problems(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    """`endpoint`, refused with the query string's 422 when it had problems: FastAPI calls
    it only once the parameters and the body were valid, so those problems are the whole
    answer, and the route's work (a vote stored, a job queued) is not done."""
    if getattr(endpoint, "_checks_query", False):
        return endpoint
    if inspect.iscoroutinefunction(endpoint):
        @functools.wraps(endpoint)
        async def guarded(*args: Any, **kwargs: Any) -> Any:
            if problems := _pending_query_problems.get():
                raise query_invalid(problems)
            return await endpoint(*args, **kwargs)
    else:
        @functools.wraps(endpoint)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if problems := _pending_query_problems.get():
                raise query_invalid(problems)
            return endpoint(*args, **kwargs)
    guarded._checks_query = True  # type: ignore[attr-defined]
    return guarded


def query_checker(
        route: APIRoute) -> Callable[[Request], Coroutine[Any, Any, list[dict[str, str]]]]:
    """The check of a request's query string against `route`'s declared parameters: every
    name the route does not take, and every one-valued parameter given twice, as problems for
    the request's 422; the caller's own 401 or 403 is raised first (as for a bad body)."""
    declared = _query_params(route)
    single = {name for name, listed in declared.items() if not listed}
    takes = (f"this route takes {', '.join(sorted(declared))}" if declared
             else "this route takes none")

    async def check(request: Request) -> list[dict[str, str]]:
        keys = [key for key, _ in request.query_params.multi_items()]
        distinct = list(dict.fromkeys(keys))
        # FastAPI ignores a name the route does not declare, so `?jobid=1` (job_id misspelt)
        # answered as if no filter were given; a body's unknown key is refused too
        unknown = [k for k in distinct if k not in declared]
        # FastAPI keeps the last of `?dataset_id=1&dataset_id=2` without a word
        repeated = [k for k in distinct if k in single and keys.count(k) > 1]
        not_text = _not_utf8(request.scope.get("query_string", b""))
        if not unknown and not repeated and not not_text:
            return []
        from app.api.deps import refused_caller

        if (refused := await refused_caller(request)) is not None:
            raise refused
        problems = [{"field": k[:100], "message": f"unknown query parameter; {takes}"}
                    for k in unknown]
        problems += [{"field": k, "message": f"given {keys.count(k)} times; this "
                      "parameter takes one value"} for k in repeated]
        problems += [{"field": k[:100], "message": "must be UTF-8 text: its percent-encoded "
                      "bytes are not (e.g. %E9 for é is Latin-1; UTF-8 writes it %C3%A9)"}
                     for k in not_text if k not in unknown]
        return problems

    return check


def _not_utf8(query_string: bytes) -> list[str]:
    """The names of the query parameters whose name or value, percent-decoded, is not UTF-8.
    Starlette decodes such bytes to U+FFFD without a word, so `?q=caf%E9` searched for
    'caf\ufffd' and matched a prompt holding that character (a NUL is refused likewise,
    by the parameter's own check)."""
    bad = []
    for pair in query_string.split(b"&"):
        name, value = (unquote_to_bytes(part.replace(b"+", b" "))
                       for part in pair.partition(b"=")[::2])
        try:
            name.decode("utf-8"), value.decode("utf-8")
        except UnicodeDecodeError:
            bad.append(name.decode("utf-8", "replace"))  # named as Starlette reads it
    return list(dict.fromkeys(bad))


def _query_params(route: APIRoute) -> dict[str, bool]:
    """The route's query parameters (its own and its dependencies'), each with whether it
    takes a list (as votes/next's `exclude` does): any other name is refused, and a repeated
    one-valued parameter too, rather than guessed."""
    def is_list(annotation: Any) -> bool:
        origin = get_origin(annotation)
        if origin in (Union, UnionType):
            return any(is_list(arg) for arg in get_args(annotation))
        return origin in (list, tuple, set, frozenset) or annotation in (list, tuple, set)

    names: dict[str, bool] = {}
    stack = [route.dependant]  # the route's own parameters and its dependencies'
    while stack:
        dependant = stack.pop()
        names |= {field.alias: is_list(field.field_info.annotation)
                  for field in dependant.query_params}
        stack.extend(dependant.dependencies)
    return names
