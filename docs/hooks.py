"""mkdocs hooks: a public name without a docstring fails ``mkdocs build --strict``; Sphinx roles are dropped.

Public: each name in the ``__all__`` of ``elastic``, ``elastic.snapshot`` and ``elastic.runtime`` (classes, functions,
modules),
and the public methods and properties each such class defines itself. The reference pages render the same names.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.docstrings")  # a warning under the "mkdocs" logger fails a strict build

PACKAGES = ("elastic", "elastic.snapshot", "elastic.runtime")
_ROLE = re.compile(r":(?:class|func|meth|mod|attr|exc|data|obj):(?=<code>)")  # a Sphinx role before a code span


def _own_doc(obj: Any) -> str | None:
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    if not isinstance(doc, str) or not doc.strip():
        return None
    if inspect.isclass(obj) and doc.startswith(f"{obj.__name__}("):
        return None  # the signature a dataclass writes when its class has no docstring
    return doc.strip()


def missing_docstrings() -> list[str]:
    """Dotted names of the public API that have no docstring of their own."""
    missing = []
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj)):
                continue  # constants and type aliases carry no docstring of their own
            if _own_doc(obj) is None:
                missing.append(f"{package}.{name}")
            if not inspect.isclass(obj):
                continue
            for attr, member in vars(obj).items():
                if attr.startswith("_"):
                    continue
                func = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
                if inspect.isfunction(func) and _own_doc(func) is None:
                    missing.append(f"{package}.{name}.{attr}")
    return missing


def on_pre_build(config: Any) -> None:
    root = str(Path(config["config_file_path"]).resolve().parent)
    if root not in sys.path:
        sys.path.insert(0, root)  # check this checkout's packages, whichever one is installed
    for name in missing_docstrings():
        log.warning("public name without a docstring: %s", name)


def on_page_content(html: str, **_: Any) -> str:
    """The docstrings' Sphinx roles (``:class:`X```) read as plain code spans."""
    return _ROLE.sub("", html)
