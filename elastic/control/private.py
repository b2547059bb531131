"""Private places on disk: per-user directories (mode 0700, owned by this user) and files (0600).

- ``$ELASTIC_HOME`` (default ``~/.elastic``): ``tokens/<job>``, each job's credential, written by its client for
  the operator's commands of the same user; ``runs/<job>/<run>/``, the run records.
- ``<tmp>/elastic-<uid>/jax-cache/<job>``: JAX's persistent compilation cache of a job (fast local disk; the
  workers of a multi-process job on this machine share it).

A directory that exists already must be a real directory owned by this user; it is made 0700. One that is not
(a link, another user's: a planted path) is refused with a :class:`~elastic.errors.ConfigError`, or, for the
temporary base, replaced by a fresh private one.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from elastic.errors import ConfigError

__all__ = ["elastic_home", "private_dir", "private_temp", "write_private"]


def elastic_home() -> Path:
    return Path(os.environ.get("ELASTIC_HOME", "~/.elastic")).expanduser()


def private_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` and its missing parents made; ``path`` itself 0700 and owned by this user (else ``ConfigError``)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise ConfigError(
            f"{path} is not a directory of this user (uid {os.getuid()}): remove it or point ELASTIC_HOME elsewhere"
        )
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def private_temp(*parts: str) -> Path:
    """``<tmp>/elastic-<uid>/<parts...>``, each level private; a base planted by someone else is not used."""
    base = Path(tempfile.gettempdir()) / f"elastic-{os.getuid()}"
    try:
        private_dir(base)
    except (ConfigError, OSError):
        base = Path(tempfile.mkdtemp(prefix=f"elastic-{os.getuid()}-"))  # 0700, ours
    path = base
    for part in parts:
        path = private_dir(path / part)
    return path


def write_private(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` (mode 0600, in a private directory), replacing it atomically."""
    path = Path(path)
    private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return path
