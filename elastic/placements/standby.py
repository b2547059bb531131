"""Standby compiles in multi-process mode: the step compiled for the group one slice smaller, before it is needed.

A group's compiled executables live in its processes' backends, which are torn down when the group re-forms, and
the mesh one slice smaller does not exist until it forms. So the compile is rehearsed: a *standby group* of
short-lived helper processes, as many as that smaller group has and set up like the workers (the same devices per
process, the same XLA flags, the same mesh layout), forms its own ``jax.distributed`` group and compiles each jitted
call the workers recorded (the function, pickled; its arguments' shapes, dtypes and specs) for its mesh. They write
JAX's persistent compilation cache, which the workers read: the survivors' first step after a loss finds its
executable there instead of compiling. Every group size also compiles its own steps into that cache as it runs, so
the grow-back group finds them too.

On CPU the cache keys differ by process index (see :func:`runtime.distributed.reform`): helper process ``p``
writes the entry that worker ``p`` of the real group reads. On GPU the helpers need spare GPU hosts (turn
``Processes.standby`` off where there are none: the cache an earlier run wrote still serves).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

from elastic import priority
from elastic.log import get_logger
from elastic.runtime import distributed
from elastic.snapshot.calls import CallCheck, Signed, call_key
from elastic.snapshot.gated import gated_actor
from elastic.supervision import credential
from elastic.supervision.agent import check_control

__all__ = ["StandbyGroup", "StandbyProcess"]

Call = tuple[bytes, Any]  # (the jitted function, cloudpickled; its runtime.standby.Signature)


@gated_actor  # unnamed, but gated all the same: its one method runs what it is given
class StandbyProcess:
    """One helper process of a standby group (a Ray actor, wrapped by :class:`StandbyGroup`). ``control``: the
    call key of the credential its group signs its calls with."""

    def __init__(self, cache_dir: str, env: dict[str, str], control: str | None = None) -> None:
        import jax

        self._control = CallCheck(control)
        self._log = get_logger("elastic.standby.process")
        priority.background()  # it only saves a later recovery a compile: the job's workers come first
        distributed.setup_process(env)
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

    def compile(
        self,
        address: str,
        size: int,
        index: int,
        mesh_fn: Any,
        calls: Sequence[Call],
        rendezvous_timeout_s: int,
        token: str | None = None,
    ) -> dict[str, Any]:
        """Join the standby group, compile every call for its mesh, leave; what was compiled, and how long."""
        check_control(self._control, token, "compile", self._log)
        import cloudpickle
        import jax

        from elastic import runtime

        start = time.monotonic()
        distributed.reform(address, size, index, timeout_s=rendezvous_timeout_s)
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        slices = [
            runtime.Slice(index=p, devices=tuple(d for d in devices if d.process_index == p)) for p in range(size)
        ]
        mesh = runtime.build_mesh(slices, mesh_fn)
        compiled, skipped = 0, 0
        errors = []
        for pickled, signature in calls:
            try:
                fn = runtime.standby.rebuild(*cloudpickle.loads(pickled))
                fn.lower(*signature.abstract(mesh)).compile()  # type: ignore[attr-defined]  # a jax.jit function
                compiled += 1
            except Exception as err:  # noqa: BLE001 - a call that does not fit this mesh compiles on recovery
                skipped += 1
                errors.append(f"{type(err).__name__}: {str(err)[:200]}")
        seconds = time.monotonic() - start
        distributed.leave()
        return {"compiled": compiled, "skipped": skipped, "seconds": seconds, "errors": errors[:3]}


class StandbyGroup:
    """The driver's side: compiles the recorded calls for a group size in the background, one size at a time (one
    standby group at most exists: its processes share the host with the workers)."""

    def __init__(
        self,
        *,
        cache_dir: str,
        actor_options: Callable[[], dict[str, Any]],
        env: dict[str, str],
        mesh_fn: Any,
        rendezvous_timeout_s: int,
        job: str,
        timeout_s: float = 300.0,
    ) -> None:
        self._cache_dir = cache_dir
        self._env = env
        self._options = actor_options
        self._mesh_fn = mesh_fn
        self._rendezvous_s = rendezvous_timeout_s
        self._timeout_s = timeout_s
        self._cond = threading.Condition()
        self._queue: list[tuple[int, list[Call]]] = []
        self._busy = False
        self._done: set[int] = set()  # group sizes whose calls are compiled (or that ran)
        self._asked: set[int] = set()
        self._actors: list[Any] = []
        self._closed = False
        self._thread: threading.Thread | None = None
        self.compiled = self.skipped = 0
        self.seconds = 0.0
        self._log = get_logger("elastic.standby", job=job)
        self._secret = credential.new_token()  # its helpers' credential: made here, known to this process only

    def ran(self, size: int) -> None:
        """A group of ``size`` ran its steps: the cache holds them (the grow-back size needs no rehearsal)."""
        with self._cond:
            self._done.add(size)

    def ready(self, size: int) -> bool:
        with self._cond:
            return size in self._done

    def prepare(self, size: int, calls: Sequence[Call]) -> None:
        """Compile ``calls`` for a group of ``size`` processes in the background (once per size)."""
        with self._cond:
            if self._closed or size < 1 or not calls or size in self._asked or size in self._done:
                return
            self._asked.add(size)
            self._queue.append((size, list(calls)))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="standby-group", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                size, calls = self._queue.pop(0)
                self._busy = True
            try:
                self._compile(size, calls)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _compile(self, size: int, calls: list[Call]) -> None:
        service = None
        actors: list[Any] = []
        try:
            remote = ray.remote(StandbyProcess)
            with self._cond:
                if self._closed:
                    return
                control = call_key(self._secret)
                actors = [
                    remote.options(**self._options()).remote(self._cache_dir, self._env, control) for _ in range(size)
                ]
                self._actors = actors
            service = distributed.CoordinationService(size, host=ray.util.get_node_ip_address())
            refs = [
                Signed(a, self._secret).compile.remote(
                    service.address, size, i, self._mesh_fn, calls, self._rendezvous_s
                )
                for i, a in enumerate(actors)
            ]
            results = ray.get(refs, timeout=self._timeout_s)
            with self._cond:
                self.compiled += results[0]["compiled"]
                self.skipped += results[0]["skipped"]
                self.seconds += max(r["seconds"] for r in results)
                self._done.add(size)
            self._log.info(
                "standby_compiled",
                size=size,
                compiled=results[0]["compiled"],
                seconds=round(max(r["seconds"] for r in results), 2),
                errors=results[0]["errors"],
            )
        except Exception as err:  # noqa: BLE001 - an optimisation: a recovery onto this size compiles instead
            if self._closed:  # the job ended first: its helpers were stopped
                self._log.info("standby_stopped", size=size)
            else:
                self._log.warning("standby_failed", size=size, error=repr(err)[:300])
        finally:
            for actor in actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
            if service is not None:
                service.stop()
            with self._cond:
                self._actors = []

    def wait(self, timeout: float) -> bool:
        """Until no standby group is queued or compiling (False past ``timeout``)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._queue.clear()
            actors, self._actors = self._actors, []
            self._cond.notify_all()
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
