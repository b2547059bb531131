"""The docs agree with the code where a check is cheap: every ``elastic ...`` command line shown in README.md and
docs/ parses with the CLI's parser, every ``elastic.*`` dotted name there resolves, and every repository path
there exists."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
from pathlib import Path

import pytest

from elastic.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
_SHELL = {"", "bash", "sh", "shell", "console"}
# a line that runs `elastic` (also `.venv/bin/elastic`, `python -m elastic.cli`), not one that names elastic/
_RUNS_ELASTIC = re.compile(r"(^|[\s|;&=])(\S*/)?elastic(\s|$)|-m elastic\.cli(\s|$)")
_SEPARATORS = {"|", "||", "&&", ";", "&"}
_WRAPPERS = {"sudo", "time", "exec", "nohup"}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def code_blocks(text: str) -> list[tuple[str, int, str]]:
    """The fenced code blocks of a markdown text: (language, first line number, body)."""
    blocks: list[tuple[str, int, str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(2), m.group(3).lower(), i + 1
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        blocks.append((lang, start + 1, "\n".join(body)))
        i += 1
    return blocks


def _logical_lines(body: str) -> list[tuple[int, str]]:
    """A shell block's commands: continuation lines joined, ``$ `` prompts dropped. (offset, line)."""
    out: list[tuple[int, str]] = []
    pending: list[str] = []
    first = 0
    for n, raw in enumerate(body.splitlines()):
        line = raw.strip()
        if not pending:
            first = n
            if line.startswith("$ "):
                line = line[2:]
        if line.endswith("\\"):
            pending.append(line[:-1])
            continue
        pending.append(line)
        out.append((first, " ".join(pending)))
        pending = []
    if pending:
        out.append((first, " ".join(pending)))
    return out


def _tokens(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def _segments(tokens: list[str]) -> list[list[str]]:
    segments: list[list[str]] = [[]]
    for tok in tokens:
        if tok in _SEPARATORS:
            segments.append([])
        else:
            segments[-1].append(tok)
    return [s for s in segments if s]


def elastic_argv(segment: list[str]) -> list[str] | None:
    """The arguments an ``elastic`` invocation passes to its parser, or None when the segment runs something
    else. Leading ``NAME=value`` settings and wrappers are skipped; ``python -m elastic.cli`` counts, and so does
    the command after ``--`` of ``ray job submit``."""
    toks = list(segment)
    while toks and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", toks[0]) or toks[0] in _WRAPPERS):
        toks.pop(0)
    if not toks:
        return None
    head = toks[0]
    if head == "elastic" or head.endswith("/elastic"):
        return toks[1:]
    if re.match(r"^(\S*/)?python[0-9.]*$", head) and toks[1:3] == ["-m", "elastic.cli"]:
        return toks[3:]
    if head == "ray" and "--" in toks:
        return elastic_argv(toks[toks.index("--") + 1 :])
    return None


def command_lines() -> list[tuple[str, str, bool]]:
    """Every ``elastic`` command line of the docs' shell blocks and inline code: (where, line, whole). An inline
    span in prose may name a command and an option only (`elastic plan`, `elastic submit --dry-run`): it is
    checked for names, not parsed whole."""
    found: list[tuple[str, str, bool]] = []
    for path in DOCS:
        text = path.read_text()
        for lang, start, body in code_blocks(text):
            if lang not in _SHELL:
                continue
            for offset, line in _logical_lines(body):
                if line and not line.startswith("#") and _RUNS_ELASTIC.search(line):
                    found.append((f"{_rel(path)}:{start + offset}", line, True))
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        for n, line in enumerate(prose.splitlines(), 1):
            for span in re.findall(r"`([^`\n]+)`", line):
                # `elastic demo --json`, not a list of names such as `elastic status/events/report`
                if re.match(r"^(\S*/)?elastic [a-z-]+( |$)", span) or span.startswith("python -m elastic.cli "):
                    found.append((f"{_rel(path)} (inline, near line {n})", span, False))
    return found


def _names_exist(argv: list[str]) -> str | None:
    """None when the subcommand (nested ones too: ``slurm start``) and every option named exist (values and
    required arguments not checked)."""
    parser: argparse.ArgumentParser = build_parser()
    command: list[str] = []
    rest = list(argv)
    while rest:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or rest[0] not in subs[0].choices:
            break
        command.append(rest.pop(0))
        parser = subs[0].choices[command[-1]]
    if not command:
        return f"no command {argv[0] if argv else ''!r}" if argv and not argv[0].startswith("-") else None
    options = parser._option_string_actions
    unknown = [t for t in rest if t.startswith("-") and t != "--" and t.split("=")[0] not in options]
    return f"elastic {' '.join(command)} has no option {', '.join(unknown)}" if unknown else None


def _parses(line: str, whole: bool = True) -> str | None:
    """None when every ``elastic`` invocation on the line parses (``whole``), or names only a command and
    options that exist (not ``whole``), else why not."""
    try:
        tokens = _tokens(line)
    except ValueError as err:
        return f"not shell syntax: {err}"
    for segment in _segments(tokens):
        argv = elastic_argv(segment)
        if argv is None:
            continue
        if not whole:
            if why := _names_exist(argv):
                return why
            continue
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
                build_parser().parse_args(argv)
        except SystemExit as exit_:
            if exit_.code not in (0, None):  # --help exits 0
                return said.getvalue().strip() or f"exit {exit_.code}"
    return None


def test_the_docs_show_elastic_commands() -> None:
    lines = command_lines()
    assert len(lines) >= 20, lines  # the extraction finds them
    assert any("elastic demo" in line for _, line, _ in lines)


@pytest.mark.parametrize(
    ("line", "argv"),
    [
        ("$ .venv/bin/elastic demo --json  # a comment", ["demo", "--json"]),
        ("RAY_ADDRESS=auto elastic status --job j | head -1", ["status", "--job", "j"]),
        ("ray job submit --working-dir . -- python -m elastic.cli demo --json", ["demo", "--json"]),
        ("ray start --head", None),
        ("pip install -e '.[flax]'", None),
    ],
)
def test_extraction(line: str, argv: list[str] | None) -> None:
    ((_, joined),) = _logical_lines(line)
    got = [a for s in _segments(_tokens(joined)) if (a := elastic_argv(s)) is not None]
    assert got == ([argv] if argv is not None else [])


def test_a_wrong_flag_is_caught() -> None:
    assert _parses("elastic inject --fault stop --slice 1") is not None
    assert _parses("elastic inject stop --slice 1 --job demo --yes") is None
    assert _parses("elastic inject --fault stop", whole=False) is not None
    assert _parses("elastic plan", whole=False) is None
    assert _parses("elastic plann", whole=False) is not None


def test_every_command_line_parses() -> None:
    bad = [f"{where}: {line}\n    {why}" for where, line, whole in command_lines() if (why := _parses(line, whole))]
    assert not bad, "command lines in the docs that `elastic` refuses:\n" + "\n".join(bad)


_DOTTED = re.compile(r"(?<![\w./-])elastic(?:\.[A-Za-z_]\w*)+")


def _resolves(name: str) -> str | None:
    """None when ``name`` is a module, or an attribute reached from the longest importable module prefix."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        if cut == len(parts):
            return None  # a module: found without running it
        obj = importlib.import_module(module)
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return f"{module} has no {'.'.join(parts[cut:])}"
            obj = getattr(obj, attr)
        return None
    return "no such module"


def dotted_names() -> dict[str, list[str]]:
    names: dict[str, list[str]] = {}
    for path in DOCS:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for name in _DOTTED.findall(line):
                names.setdefault(name, []).append(f"{_rel(path)}:{n}")
    return names


def test_every_dotted_name_resolves() -> None:
    names = dotted_names()
    assert "elastic.ElasticJob" in names
    bad = [f"{name} ({where[0]}): {why}" for name, where in sorted(names.items()) if (why := _resolves(name))]
    assert not bad, "names in the docs that do not exist:\n" + "\n".join(bad)


_PATH = re.compile(r"(?<![\w./<>$-])((?:elastic|runtime|snapshot|benchmarks|tests|docs)/[\w./-]*[\w/])")


def test_every_repository_path_exists() -> None:
    bad: list[str] = []
    seen = 0
    for path in DOCS:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for name in _PATH.findall(line):
                if "/" not in name.rstrip("/") or "*" in name:
                    continue
                seen += 1
                if not (ROOT / name).exists():
                    bad.append(f"{_rel(path)}:{n}: {name}")
    assert seen >= 20
    assert not bad, "paths in the docs that are not in the repository:\n" + "\n".join(bad)
