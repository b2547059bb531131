"""Ray's own output, routed through this package's log: quiet unless the user asks (``-v``, ``ELASTIC_VERBOSE=1``).

What a normal run used to print that nobody asked for, and what happens to it now:

- JAX's ``RuntimeWarning: os.fork() was called`` (twice): ``ray.init`` starts the cluster's processes with
  ``subprocess.Popen(preexec_fn=...)``, which runs Python's at-fork hooks, and JAX warns from its hook once its
  backends run threads. The child execs a Ray binary at once and runs no JAX code, so the warning does not
  apply: it is ignored for the duration of :func:`starting_ray` only (any other fork still warns).
- Ray's token-authentication notice and other ``ray`` logger records below ERROR: the ``ray`` logger's level is
  raised to ERROR, left at Ray's INFO when verbose (:func:`route_ray_loggers`).
- ``(raylet) Task X failed. There are infinite retries remaining...``: Ray's error listener prints the
  cluster's error messages on the driver's *stdout*, which holds a command's JSON result. They go to stderr,
  and only when verbose (:func:`route_ray_errors`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

__all__ = ["quiet_native", "route_ray_errors", "route_ray_loggers", "set_verbose", "starting_ray", "verbose"]

_VERBOSE: list[bool] = []  # set by set_verbose (the CLI's -v); else ELASTIC_VERBOSE decides


def set_verbose(on: bool) -> None:
    """Show Ray's own messages (``-v``); call before the job connects to Ray."""
    _VERBOSE[:] = [on]
    route_ray_loggers()


def verbose() -> bool:
    if _VERBOSE:
        return _VERBOSE[0]
    return os.environ.get("ELASTIC_VERBOSE", "").lower() in ("1", "true", "yes")


def quiet_native(level: int = 3) -> None:
    """jax's native log below ``level`` stays quiet (3: all but FATAL). It is read once, as jaxlib loads: call this
    before jax is imported. In multi-process mode the coordination service the driver hosts logs a warning at each
    group it forms (recoverable tasks are experimental) and an error for each group that does not form (a worker
    lost meanwhile): the job's own events and errors say the same in its words. A level the environment asks for
    is kept, but for jax's own default (1), which any parent process that imported jax passes on."""
    if os.environ.get("TF_CPP_MIN_LOG_LEVEL") in (None, "1"):
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = str(level)


_RAY_DEFAULT_LEVEL = logging.INFO  # what Ray's import gives its logger (unless RAY_LOGGING_LEVEL says otherwise)


def route_ray_loggers() -> None:
    """Ray's ``ray`` logger shows ERROR and above unless verbose; a level the application or
    ``RAY_LOGGING_LEVEL`` set is left alone."""
    logger = logging.getLogger("ray")
    if "RAY_LOGGING_LEVEL" in os.environ:
        return
    if not verbose() and logger.level == _RAY_DEFAULT_LEVEL:
        logger.setLevel(logging.ERROR)
    elif verbose() and logger.level == logging.ERROR:
        logger.setLevel(_RAY_DEFAULT_LEVEL)


@contextlib.contextmanager
def starting_ray() -> Iterator[None]:
    """Around ``ray.init``: JAX's fork warning is not raised for the fork-and-exec of Ray's processes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        yield


_ROUTED: set[Any] = set()  # the routing functions installed (so a second call does not wrap the first)


def route_ray_errors() -> None:
    """Send the lines of Ray's driver-side error listener (``pid`` "raylet") to stderr when verbose, nowhere
    otherwise; every other line is printed as Ray prints it. Idempotent."""
    try:
        from ray._private import worker as ray_worker
    except ImportError:  # another Ray layout: its output is left as it is
        return
    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None or original in _ROUTED:
        return

    def routed(data: dict[str, Any], ignore_prefix: bool) -> None:
        if data.get("pid") != "raylet":
            original(data, ignore_prefix)
        elif verbose():
            for line in data.get("lines", ()):
                print(f"(raylet) {line}", file=sys.stderr)

    _ROUTED.add(routed)
    ray_worker.print_to_stdstream = routed
