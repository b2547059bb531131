"""The README's and Getting started's Python blocks run as written.

Convention: each ```python block of those pages is a whole program, run on its own. A block preceded by
``<!-- continues the block above -->`` is run appended to the program before it (Getting started shows a plain loop,
then only what changes). A block preceded by ``<!-- not run: why -->`` is a fragment and is skipped; none is today.
Each program runs in a fresh interpreter with 8 forced CPU devices (``JAX_PLATFORMS=cpu``), on the test session's Ray
cluster (``RAY_ADDRESS``), and must exit 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/getting-started.md")
_BLOCK = re.compile(r"(?:<!--\s*(?P<mark>[^>]*?)\s*-->\s*\n)?^```python\n(?P<body>.*?)^```", re.S | re.M)
_TIMEOUT_S = 120


def programs(page: str) -> list[tuple[str, str]]:
    """The page's Python programs: (name, source)."""
    out: list[tuple[str, str]] = []
    for n, m in enumerate(_BLOCK.finditer((ROOT / page).read_text()), 1):
        mark, body = (m.group("mark") or "").strip(), m.group("body")
        if mark.startswith("not run"):
            continue
        if mark.startswith("continues"):
            assert out, f"{page}: block {n} continues a block that is not there"
            name, before = out.pop()
            out.append((f"{name}+{n}", before + "\n" + body))
        else:
            out.append((f"{page} block {n}", body))
    return out


CASES = [program for page in PAGES for program in programs(page)]


def _run(
    source: str, tmp_path: Path, *, devices: int | None, ray_address: str | None = None
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "program.py"
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "RAY_ADDRESS")}
    if ray_address is not None:  # the program joins that cluster, as a job submitted to it does
        env["RAY_ADDRESS"] = ray_address
    env["JAX_PLATFORMS"] = "cpu"
    if devices is not None:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
        check=False,
    )


def test_the_pages_have_programs() -> None:
    assert [name for name, _ in CASES if name.startswith("README.md")], "the README's example is found"
    assert len(CASES) >= 2


@pytest.mark.timeout(_TIMEOUT_S + 30)
@pytest.mark.parametrize(("name", "source"), CASES, ids=[name for name, _ in CASES])
def test_block_runs(name: str, source: str, tmp_path: Path, ray_local) -> None:
    """On this process's Ray cluster (RAY_ADDRESS): a program on a cluster of its own is the demo's and the quiet
    test's (test_demo_cli.py, test_quiet.py); here what is checked is the page's code."""
    done = _run(source, tmp_path, devices=8, ray_address=ray_local.get_runtime_context().gcs_address)
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stderr[-3000:]}"


def _config_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("elastic.errors.ConfigError: ")]
    assert lines, f"no ConfigError on stderr:\n{stderr[-3000:]}"
    return lines[-1]


@pytest.mark.timeout(_TIMEOUT_S + 30)
def test_readme_example_on_one_device_says_what_to_change(tmp_path: Path) -> None:
    """Without forced devices jax has one CPU device: the example stops at once with one line naming the
    settings that fit (the slices' shape, or simulating them)."""
    (_, source) = next((name, src) for name, src in CASES if name.startswith("README.md"))
    done = _run(source, tmp_path, devices=None)
    assert done.returncode != 0
    line = _config_error(done.stderr)
    assert ("num_slices" in line and "devices_per_slice" in line) or "simulated" in line, line
    assert "Traceback" not in line
