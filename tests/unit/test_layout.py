"""The package's layout keeps its promises: a short top level, sides that import one way, no import circles."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ELASTIC = ROOT / "elastic"
# What each side of elastic/ may import of elastic's other sides (the top-level modules are shared by all).
SIDES = {  # one way, top to bottom: api -> placements -> control -> loop -> supervision (and ops, chaos beside)
    "supervision": set(),  # runs in Ray actors: nothing of the client's
    "pool": {"supervision"},  # the pool of slices many jobs share: a Ray actor beside the jobs' supervisors
    "loop": {"supervision"},  # the pass runtime: the user's loop, in the client or a worker
    "control": {"supervision", "loop"},
    "placements": {"control", "supervision", "loop"},
    "api": {"control", "supervision", "placements", "loop", "pool"},  # the composition root: what the user imports
    "chaos": {"api", "control", "supervision", "placements", "loop"},
    "ops": {"control", "supervision", "api", "pool"},
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


# --- Every file of elastic/ (the repository's snapshot/ and runtime/ are elastic.snapshot and elastic.runtime) ---

PACKAGES = {"elastic": "elastic", "snapshot": "elastic.snapshot", "runtime": "elastic.runtime"}


def _product_files() -> dict[str, Path]:
    """Dotted module name -> file, for elastic/ (less its links to snapshot/ and runtime/), snapshot/, runtime/."""
    files: dict[str, Path] = {}
    for folder, dotted in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("").parts
            if folder == "elastic" and rel[0] in ("snapshot", "runtime"):
                continue  # the links: the same files, listed under their own folders
            parts = rel[:-1] if rel[-1] == "__init__" else rel
            files[".".join((dotted, *parts))] = path
    return files


def _all_imports(name: str, path: Path, modules: set[str]) -> dict[str, int]:
    """Every module of ``modules`` that ``path`` imports, anywhere in it (lazy imports inside functions and
    ``TYPE_CHECKING`` blocks included), with the first line that does: ``from x import y`` imports the module
    ``x.y`` where that is one, else ``x``; relative imports are resolved against the file's package."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: dict[str, int] = {}

    def add(candidate: str, line: int) -> None:
        bits = candidate.split(".")
        while bits and ".".join(bits) not in modules:  # `import a.b.c` of a name inside a.b: the module a.b
            bits.pop()
        if bits and ".".join(bits) != name:
            found.setdefault(".".join(bits), line)

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                add(sub if sub in modules else base, node.lineno)
    return found


def _cycles() -> dict[tuple[str, ...], str]:
    """The groups of modules that import each other (strongly connected components, Tarjan), each with the
    imports that tie it: ``a -> b (file:line)``."""
    files = _product_files()
    edges = {name: _all_imports(name, path, set(files)) for name, path in files.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[tuple[str, ...]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(tuple(sorted(group)))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return {
        group: "; ".join(
            f"{a} -> {b} ({files[a].relative_to(ROOT)}:{edges[a][b]})" for a in group for b in group if b in edges[a]
        )
        for group in groups
    }


def test_no_import_cycle_between_files_lazy_imports_included() -> None:
    cycles = _cycles()
    assert not cycles, "files of elastic/ that import each other (lazy imports included):\n" + "\n".join(
        cycles.values()
    )


MAX_LINES = 400
LONG_FILES: set[str] = set()  # a file that is mostly one declarative table may be longer: name it here and in
# docs/architecture.md (none today)


def test_no_module_over_400_lines_beyond_the_allow_list() -> None:
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _product_files().values()}
    long = {name: n for name, n in lines.items() if n > MAX_LINES}
    assert set(long) <= LONG_FILES, f"modules over {MAX_LINES} lines: { {n: long[n] for n in set(long) - LONG_FILES} }"
    short = sorted(LONG_FILES - set(long))
    assert not short, f"now at most {MAX_LINES} lines, take them off LONG_FILES: {short}"


def _jax_runtime_errors_built(paths: list[Path] | None = None, root: Path = ROOT) -> list[str]:
    """Every ``JaxRuntimeError(...)`` constructed in ``paths`` (default: elastic/, snapshot/, runtime/): the product
    classifies jax's errors, it does not make them (a fault it injects or simulates is its own error type)."""
    found = []
    for path in paths if paths is not None else list(_product_files().values()):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
                if called == "JaxRuntimeError":
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    return sorted(found)


def test_no_jax_runtime_error_constructed_in_the_product() -> None:
    built = _jax_runtime_errors_built()
    assert not built, f"JaxRuntimeError( constructed at {built}"


def test_the_jax_runtime_error_check_finds_one(tmp_path: Path) -> None:
    """The check above can fail: a file that builds one is found."""
    bad = tmp_path / "bad.py"
    bad.write_text("import jax\n\n\ndef f():\n    raise jax.errors.JaxRuntimeError('UNAVAILABLE: x')\n")
    assert _jax_runtime_errors_built([bad], tmp_path) == ["bad.py:5"]
