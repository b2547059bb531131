"""The package's layout keeps its promises: a short top level, sides that import one way, no import circles."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ELASTIC = ROOT / "elastic"
# What each side of elastic/ may import of elastic's other sides (the top-level modules are shared by all).
SIDES = {  # one way, top to bottom: api -> placements -> control -> loop -> supervision (and ops, chaos beside)
    "supervision": set(),  # runs in Ray actors: nothing of the client's
    "loop": {"supervision"},  # the pass runtime: the user's loop, in the client or a worker
    "control": {"supervision", "loop"},
    "placements": {"control", "supervision", "loop"},
    "api": {"control", "supervision", "placements", "loop"},  # the composition root: what the user imports
    "chaos": {"api", "control", "supervision", "placements", "loop"},
    "ops": {"control", "supervision", "api"},
    "demos": {"api", "chaos", "control", "ops", "placements", "supervision", "loop"},
    "examples": {"api", "demos", "ops", "chaos", "control", "loop"},
}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """elastic modules imported at module level (``TYPE_CHECKING`` blocks included: a circle in types is one too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    body = list(tree.body)
    while body:
        node = body.pop()
        if isinstance(node, ast.If):  # if TYPE_CHECKING: ... and version switches
            body.extend(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            body.extend(node.body)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "elastic")
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and node.module.split(".")[0] == "elastic"
        ):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module(p): p for p in ELASTIC.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def test_the_top_level_holds_at_most_15_modules() -> None:
    top = sorted(p.name for p in ELASTIC.glob("*.py"))
    assert len(top) <= 15, top


def test_no_import_circles() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                raise AssertionError(f"import circle: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_sides_import_one_way() -> None:
    bad = []
    for name, deps in _graph().items():
        parts = name.split(".")
        if len(parts) < 3:
            continue
        side = parts[1]
        for dep in deps:
            dep_parts = dep.split(".")
            if len(dep_parts) >= 3 and dep_parts[1] != side and dep_parts[1] not in SIDES.get(side, set()):
                bad.append(f"{name} imports {dep}")
    assert not bad, bad
