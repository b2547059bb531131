"""Before joining a named Ray cluster: can it be reached, and does it take this process's token?

``ray.init(address=...)`` against a cluster with token authentication and no token here retries for about 20 s,
printing a line per attempt, and ends in a chained traceback; against an address where nothing listens it takes
about 40 s. :func:`probe` asks the cluster's GCS once, within ``timeout_s``, with Ray's native warnings kept off
stderr (unless verbose), and raises a :class:`~elastic.errors.ClusterError` that says what to set.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

from elastic import quiet
from elastic.errors import ClusterError

__all__ = ["PROBE_TIMEOUT_S", "probe"]

PROBE_TIMEOUT_S = float(os.environ.get("ELASTIC_CONNECT_TIMEOUT_S", "3"))

_TOKEN_HINT = (
    "set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH=<the cluster's token file> (or RAY_AUTH_TOKEN), "
    "as for `ray job submit`"
)


@contextlib.contextmanager
def _native_stderr_off() -> Iterator[None]:
    """File descriptor 2 points at /dev/null inside (Ray's C++ client writes there directly)."""
    if quiet.verbose():
        yield
        return
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def probe(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Return if the cluster at ``address`` answers and accepts this process's credentials; else raise
    :class:`ClusterError` (within about ``timeout_s``)."""
    from elastic.supervision.ray_internals import gcs_client

    outcome: list[BaseException | None] = []

    def ask() -> None:
        try:
            gcs_client(_gcs_address(address))
            outcome.append(None)
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            outcome.append(err)

    with _native_stderr_off():
        worker = threading.Thread(target=ask, name="ray-probe", daemon=True)
        worker.start()
        worker.join(timeout_s)
    if not outcome:
        raise ClusterError(
            f"no Ray cluster answered at {address} within {timeout_s:g} s: is it running, and is "
            "RAY_ADDRESS its GCS address (host:port)?"
        )
    err = outcome[0]
    if err is None:
        return
    text = str(err)
    if type(err).__name__ == "AuthenticationError" or "InvalidAuthToken" in text or "authentication token" in text:
        raise ClusterError(f"the Ray cluster at {address} refused this process's token: {_TOKEN_HINT}") from err
    raise ClusterError(f"cannot join the Ray cluster at {address}: {text.splitlines()[0] if text else err!r}") from err


def _gcs_address(address: str) -> str:
    """``ray://`` and ``auto`` are left to ``ray.init``; a plain host:port is asked directly."""
    return address.removeprefix("gcs://")
