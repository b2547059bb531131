"""Release basics: the version, the license, the type marker and the docs' config agree with pyproject."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

import pytest

import elastic

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_comes_from_the_package_metadata():
    assert elastic.__version__ == metadata.version("jax-elastic") == PYPROJECT["project"]["version"]


def test_version_falls_back_when_not_installed(monkeypatch):
    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    import importlib

    try:
        assert importlib.reload(elastic).__version__ == "0+unknown"
    finally:
        monkeypatch.undo()
        importlib.reload(elastic)
    assert elastic.__version__ == PYPROJECT["project"]["version"]


def test_license_is_apache_2_with_an_spdx_string():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text.splitlines()[0] and "Version 2.0, January 2004" in text


@pytest.mark.parametrize("package", ["elastic", "snapshot", "runtime"])
def test_each_package_ships_py_typed(package):
    assert (ROOT / package / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["*"]


def test_changelog_has_an_entry_for_the_version():
    assert f"## [{PYPROJECT['project']['version']}]" in (ROOT / "CHANGELOG.md").read_text()


def test_readme_is_a_first_visit_with_the_two_commands_first():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200
    assert lines[3].startswith("make demo ") and lines[4].startswith("make test ")


def test_every_public_name_has_a_docstring():
    """What the docs' strict build checks (docs/hooks.py), here without building the site."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    assert hooks.missing_docstrings() == []


def test_one_installed_name_elastic_with_snapshot_and_runtime_under_it():
    """The wheel's packages (setuptools' discovery as pyproject configures it): elastic and its subpackages only,
    the repository's snapshot/ and runtime/ as elastic.snapshot and elastic.runtime (the links under elastic/)."""
    from setuptools import find_packages

    found = set(find_packages(str(ROOT), **PYPROJECT["tool"]["setuptools"]["packages"]["find"]))
    assert {"elastic", "elastic.snapshot", "elastic.runtime"} <= found
    assert all(p == "elastic" or p.startswith("elastic.") for p in found), sorted(found)
    for package in ("snapshot", "runtime"):
        link = ROOT / "elastic" / package
        assert link.is_symlink() and link.resolve() == (ROOT / package).resolve()


def test_outside_the_checkout_only_elastic_imports():
    import subprocess
    import sys

    code = (
        "import importlib.util, elastic.snapshot, elastic.runtime\n"
        "print(importlib.util.find_spec('snapshot'), importlib.util.find_spec('runtime'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["None", "None"], out.stdout
