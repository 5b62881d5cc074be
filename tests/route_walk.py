"""Every route an app mounts, the mounted Gradio UI's included: what the route-access tests
walk (tests/app/test_route_access.py, tests/app/test_ui_security.py)."""

from __future__ import annotations

from typing import Any

from fastapi.routing import iter_route_contexts
from starlette.routing import Mount


def mounted_routes(routes: Any, prefix: str = "") -> list[tuple[str, str]]:
    """(method, path) of every route, recursing into mounted apps (the Gradio UI)."""
    found = []
    for ctx in iter_route_contexts(routes):
        route = ctx._effective_route
        if isinstance(route, Mount):
            found += mounted_routes(route.routes or getattr(route.app, "routes", []),
                                    prefix + route.path)
            continue
        found += [(method, prefix + ctx.path) for method in sorted(ctx.methods or {"GET"})]
    return found
