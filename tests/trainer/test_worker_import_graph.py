"""The worker modules import one another without a cycle: every `import worker.x`,
`from worker.x import ...` and `from worker import x` counts, at module top or inside a
function (a function-level import hides a cycle from Python's import machinery, not from the
design). Read with `ast`, nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

WORKER = Path(__file__).resolve().parents[2] / "worker"
PACKAGE = "worker"


def worker_imports(source: str, modules: set[str]) -> set[str]:
    """The worker modules (names in `modules`, without the package) that `source` imports,
    at any depth (a relative import counts: worker/*.py sits in the package)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == PACKAGE and len(parts) > 1:
                    found.add(parts[1])
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: worker/*.py sits in the package itself
                base = [PACKAGE] if node.level == 1 else []
                parts = base + (node.module.split(".") if node.module else [])
            else:
                parts = (node.module or "").split(".")
            if parts[:1] != [PACKAGE]:
                continue
            if len(parts) > 1:
                found.add(parts[1])
            else:  # from worker import x, y: those that are modules
                found.update(alias.name for alias in node.names if alias.name in modules)
    return {name for name in found if name in modules}


def import_graph() -> dict[str, set[str]]:
    files = {path.stem: path for path in sorted(WORKER.glob("*.py"))}
    modules = set(files) - {"__init__"}
    return {name: worker_imports(files[name].read_text(encoding="utf-8"), modules)
            for name in sorted(modules)}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as the modules along it (the first repeated at the end), or None."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_path:
                return path[path.index(nxt):] + [nxt]
            if nxt not in done and (cycle := visit(nxt)) is not None:
                return cycle
        on_path.discard(path.pop())
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done and (cycle := visit(start)) is not None:
            return cycle
    return None


def test_the_collector_sees_imports_at_any_depth_in_every_form():
    source = (
        "import worker.a\n"
        "import worker.b as bee\n"
        "from worker.c import thing\n"
        "from worker import d, not_a_module\n"
        "from . import e\n"
        "from .f import other\n"
        "import app.worker_like\n"
        "def run():\n"
        "    from worker.g import helper\n"
        "    class Inner:\n"
        "        def method(self):\n"
        "            import worker.h\n"
        "if True:\n"
        "    from worker.i import x\n")
    modules = set("abcdefghi")
    assert worker_imports(source, modules) == modules


def test_find_cycle_names_the_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"y"}, "y": {"y"}}) == ["y", "y"]


def test_the_worker_modules_import_one_another_without_a_cycle():
    graph = import_graph()
    assert "tasks" in graph and graph["tasks"], "no worker module found to check"
    cycle = find_cycle(graph)
    assert cycle is None, "worker modules import one another in a cycle: " + " -> ".join(
        f"worker.{name}" for name in cycle)
