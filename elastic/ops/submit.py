"""Your own script on your own cluster: ship this package to a Ray cluster with the job.

``elastic wheel`` packs the ``elastic`` package this process imports (a checkout or an installed copy) into a
wheel of its own files: ``elastic/snapshot`` and ``elastic/runtime`` as real files (in a checkout they are links
to the top-level ``snapshot/`` and ``runtime/``), no ``__pycache__``, and **no declared dependencies**. Ray's
``py_modules`` installs a wheel on every node with ``pip install WHEEL --target=DIR`` (Ray 2.60,
``ray/_private/runtime_env/packaging.py``), which installs every declared dependency into that directory too,
jax and ray included, from the index: the wheel leaves them to the cluster's own Python, where Ray (and so the
job's dependencies) is installed already. Its version carries a hash of its contents (``0.1.0+sha.<12 hex>``):
Ray names an uploaded wheel by its file name and skips the upload when a wheel of that name is already in the
cluster, so a changed package must never reuse the name of an older one.

``elastic submit SCRIPT [ARGS...]`` builds that wheel (or takes ``--wheel``) and runs::

    ray job submit --working-dir DIR --runtime-env-json '{"py_modules": [WHEEL]}' -- python SCRIPT ARGS...

with ``DIR`` the script's directory (``--working-dir``), so that the job's driver and every process it starts
(the workers of multi-process mode included) import ``elastic`` from the shipped wheel.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from elastic.errors import ConfigError

__all__ = ["DIST_NAME", "build_wheel", "package_files", "register", "submit_command"]

DIST_NAME = "jax_elastic"  # the distribution's name as a wheel's file name spells it (jax-elastic)
_EPOCH = (1980, 1, 1, 0, 0, 0)  # every entry's timestamp: the same files give the same wheel, byte for byte
_SKIP_DIRS = {"__pycache__"}
_SKIP_SUFFIXES = (".pyc", ".pyo")


def package_dir() -> Path:
    """The directory of the ``elastic`` package this process imports."""
    import elastic

    return Path(elastic.__file__).resolve().parent


def package_files(root: Path | None = None) -> Iterator[tuple[str, Path]]:
    """``(name in the wheel, file)`` for every file of the package under ``root`` (default: :func:`package_dir`),
    following the links to ``snapshot/`` and ``runtime/``, in a stable order; caches left out."""
    root = (root or package_dir()).resolve()
    seen: set[Path] = set()
    for current, dirs, files in os.walk(root, followlinks=True):
        real = Path(current).resolve()
        if real in seen:  # a link back into the tree: walk each directory once
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        rel = Path(current).relative_to(root)
        for name in sorted(files):
            path = Path(current) / name
            if name.endswith(_SKIP_SUFFIXES) or not path.is_file():
                continue
            yield (Path(root.name) / rel / name).as_posix(), path


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _base_version() -> str:
    import elastic

    return elastic.__version__.split("+", 1)[0]  # "0" for a checkout not installed ("0+unknown")


def build_wheel(out_dir: str | os.PathLike[str], *, source: Path | None = None) -> Path:
    """Write the package's wheel (see the module's doc) into ``out_dir``; its path. The same files give the same
    file, of the same name."""
    contents = [(name, path.read_bytes()) for name, path in package_files(source)]
    if not any(name.endswith("/__init__.py") for name, _ in contents):
        raise ConfigError(f"no Python package under {source or package_dir()}")
    digest = hashlib.sha256()
    for name, data in contents:
        digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    version = f"{_base_version()}+sha.{digest.hexdigest()[:12]}"
    info = f"{DIST_NAME}-{version}.dist-info"
    metadata = (
        "Metadata-Version: 2.1\n"
        "Name: jax-elastic\n"
        f"Version: {version}\n"
        "Summary: Elastic, fault-tolerant training for JAX (shipped to a Ray cluster; its dependencies are the "
        "cluster's own)\n"
    )
    wheel = "Wheel-Version: 1.0\nGenerator: elastic.ops.submit\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    contents += [
        (f"{info}/METADATA", metadata.encode()),
        (f"{info}/WHEEL", wheel.encode()),
        (f"{info}/top_level.txt", b"elastic\n"),
    ]
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for name, data in contents:
        writer.writerow([name, _record_hash(data), len(data)])
    writer.writerow([f"{info}/RECORD", "", ""])
    contents.append((f"{info}/RECORD", record.getvalue().encode()))

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"{DIST_NAME}-{version}-py3-none-any.whl"
    partial = target.with_name(target.name + ".partial")
    with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in contents:
            entry = zipfile.ZipInfo(name, date_time=_EPOCH)
            entry.external_attr = 0o644 << 16
            entry.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(entry, data)
    partial.replace(target)
    return target


def _ray_cli() -> str:
    """The ``ray`` command next to this Python (its venv's), else the one on PATH."""
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else "ray"


def submit_command(
    script: str,
    args: Sequence[str],
    *,
    wheel: Path,
    working_dir: Path | None = None,
    address: str | None = None,
    submission_id: str | None = None,
    no_wait: bool = False,
    python: str = "python",
    ray: str = "ray",
) -> list[str]:
    """The ``ray job submit`` command line that runs ``python SCRIPT ARGS`` with the package shipped as ``wheel``
    (``py_modules``) and ``working_dir`` (default: the script's directory) uploaded as the job's working dir."""
    path = Path(script)
    directory = (working_dir or path.resolve().parent).resolve()
    try:
        entry = path.resolve().relative_to(directory).as_posix()
    except ValueError as err:
        raise ConfigError(f"the script {script} is not inside the working dir {directory}") from err
    cmd = [ray, "job", "submit"]
    if address:
        cmd += ["--address", address]
    if submission_id:
        cmd += ["--submission-id", submission_id]
    if no_wait:
        cmd.append("--no-wait")
    runtime_env = {"py_modules": [str(Path(wheel).resolve())]}
    cmd += ["--working-dir", str(directory), "--runtime-env-json", json.dumps(runtime_env), "--", python, entry]
    return cmd + list(args)


def _wheel(args: argparse.Namespace) -> int:
    path = build_wheel(args.out)
    print(json.dumps({"wheel": str(path.resolve())}) if args.json else path.resolve())
    return 0


def _submit(args: argparse.Namespace) -> int:
    built: str | None = None
    try:
        if args.wheel:
            wheel = Path(args.wheel)
            if not wheel.is_file() or wheel.suffix != ".whl":
                raise ConfigError(f"--wheel must name a .whl file, got {args.wheel}")
        else:
            built = tempfile.mkdtemp(prefix="elastic-wheel-")
            wheel = build_wheel(built)
        cmd = submit_command(
            args.script,
            args.args,
            wheel=wheel,
            working_dir=Path(args.working_dir) if args.working_dir else None,
            address=args.address,
            submission_id=args.submission_id,
            no_wait=args.no_wait,
            python=args.python,
            ray=_ray_cli(),
        )
        if args.dry_run:
            print(json.dumps(cmd))
            return 0
        sys.stdout.flush()
        return subprocess.call(cmd)  # the upload is done when it returns (also with --no-wait)
    finally:
        if built is not None and not args.dry_run:
            shutil.rmtree(built, ignore_errors=True)


def register(sub: Any) -> None:
    """Add ``wheel`` and ``submit`` to the ``elastic`` command's subparsers."""
    wheel = sub.add_parser("wheel", help="pack this elastic package into a wheel for Ray's py_modules (no deps)")
    wheel.add_argument("--out", default=".", help="directory to write the wheel into (default: .)")
    wheel.add_argument("--json", action="store_true", help='print {"wheel": PATH} instead of the path')
    wheel.set_defaults(func=_wheel)

    submit = sub.add_parser(
        "submit",
        help="ray job submit of your own script, with this elastic package shipped to the job (py_modules)",
        description="Runs `ray job submit --working-dir DIR --runtime-env-json '{\"py_modules\": [WHEEL]}' -- "
        "python SCRIPT ARGS...`; the cluster's address and token come from Ray's environment variables "
        "(RAY_API_SERVER_ADDRESS or RAY_ADDRESS, RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH).",
    )
    submit.add_argument("--address", help="the cluster's dashboard address (default: Ray's environment)")
    submit.add_argument("--wheel", help="ship this wheel (from `elastic wheel`) instead of building one")
    submit.add_argument("--working-dir", help="directory uploaded as the job's working dir (default: the script's)")
    submit.add_argument("--submission-id", help="the job's submission id (default: Ray picks one)")
    submit.add_argument("--no-wait", action="store_true", help="return once submitted, without following the logs")
    submit.add_argument("--python", default="python", help="the job's Python on the head (default: python on PATH)")
    submit.add_argument("--dry-run", action="store_true", help="print the ray command (JSON) instead of running it")
    submit.add_argument("script", help="your training script, run as the job's entry point")
    submit.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    submit.set_defaults(func=_submit)
