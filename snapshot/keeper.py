"""The keeper tier: copies of recent host images in detached Ray actors that outlive the training client.

Each :class:`Keeper` holds the newest ``keep`` images of one job in its own memory (private copies, so
the images survive the process that sent them). :class:`KeeperTier` is the client: it places keepers on
other nodes than its own, pushes images to all of them from a background thread (coalescing to the
newest), and reads back the newest intact image from whichever keepers are still alive.

A job's keepers answer only calls carrying its keeper credential (they keep its SHA-256 digest, given at
creation), and the images the client pushes are sealed under its image key (:mod:`snapshot.seal`), which no
keeper holds: an image that fails the seal is refused on restore (``on_refused`` is told) and the next keeper's,
or the next tier, is used. Both are optional (``None``: an open keeper, unsealed images; for tests and tools).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import ray
import structlog

from .calls import Signed, call_key
from .image import HostImage, Index
from .keeper_actor import Keeper
from .keeper_place import create_keeper, keepers_for, placements
from .seal import seal, sealed

__all__ = ["Keeper", "KeeperTier", "keepers_for"]  # Keeper: from .keeper_actor; keepers_for: from .keeper_place

log = structlog.get_logger("snapshot.keeper")

PREFIX = "keeper-"


class KeeperTier:
    """The client side of a job's keepers (detached actors ``keeper-0..N-1`` in ``namespace``).

    ``push`` holds the caller only to seal the image and put it into the object store, never for a keeper's
    answer; every Ray wait is bounded by ``timeout_s`` (or the caller's).
    ``every``: one image in ``every`` pushed is sent (a rollback, a step at or below the last sent, always is).
    """

    def __init__(
        self,
        namespace: str,
        *,
        num_keepers: int = 2,
        keep: int = 1,
        every: int = 1,
        avoid_node: str | None = None,
        timeout_s: float = 60.0,
        credential: str | None = None,
        image_key: str | None = None,
        on_refused: Callable[[str, int, str], None] | None = None,
        adopt: Callable[[str], Any | None] | None = None,
        created: Callable[[str, Any], None] | None = None,
    ) -> None:
        if num_keepers < 1 or keep < 1 or every < 1:
            raise ValueError(f"num_keepers, keep and every must be at least 1, got {num_keepers}, {keep}, {every}")
        self.namespace, self._num, self._keep, self._every = namespace, num_keepers, keep, every
        self._avoid_node, self._timeout_s = avoid_node, timeout_s
        self._credential, self._image_key, self._on_refused = credential, image_key, on_refused
        self._call_key = None if credential is None else call_key(credential)
        # Never a keeper found by its name alone: ``adopt(name)`` returns the job's own keeper of that name (its
        # identity checked by the caller, before any call on it) or None; ``created(name, handle)`` records one
        # created here. Without ``adopt``, a name held already is refused.
        self._adopt, self._created = adopt, created
        self._keepers: dict[str, Any] = {}  # name -> handle; a keeper that died is removed
        self._asked: list[str] = []  # the nodes start() placed keepers on (ready() reports against them)
        self._cond = threading.Condition()
        self._pending: tuple[int, Any] | None = None  # (step, object ref) of the sealed image waiting to be sent
        self._pushing = threading.Lock()
        self._busy = self._closing = self._none_left = False
        self._thread: threading.Thread | None = None
        self._offered, self._last_sent = 0, cast("int | None", None)
        self._stats: dict[str, int] = {
            "keeper_pushes": 0,
            "keeper_coalesced": 0,
            "keeper_push_failures": 0,
            "keeper_skipped": 0,
        }

    def _signed(self, keeper: Any) -> Any:
        """``keeper`` with each call signed under the job's keeper credential (as it is, without one)."""
        return keeper if self._call_key is None else Signed.under(keeper, self._call_key)

    def start(self, *, wait: bool = True) -> KeeperTier:
        """Create the keepers (or adopt the job's own, through ``adopt``), on other nodes than ``avoid_node`` where
        the cluster has any.

        Keepers adopted are reused as they are (their ``keep`` included). A keeper name held by an actor that is
        not the job's is refused (:class:`~snapshot.errors.KeeperAccessError`): that actor is never called.
        ``wait=False`` returns once they are asked for, so that their processes start while the caller does other
        work; then :meth:`ready` must be called before any other method.

        Placement is a hard node affinity: Ray 2.60's soft affinity was seen to ignore the node it was
        given (two keepers on one node) even with both nodes alive. Raises if no keeper comes up.
        """
        avoid = self._avoid_node or ray.get_runtime_context().get_node_id()
        nodes = placements(self._num, avoid)
        access = self._call_key
        for i, node in enumerate(nodes):
            name = f"{PREFIX}{i}"
            handle = self._adopt(name) if self._adopt is not None else None
            if handle is None:  # a name taken meanwhile is refused: nothing of the actor holding it is called
                handle = create_keeper(name, self.namespace, node, self._keep, access)
                if self._created is not None:
                    self._created(name, handle)
            self._keepers[name] = handle
        self._asked = nodes
        return self.ready() if wait else self

    def ready(self) -> KeeperTier:
        """Wait until the keepers asked for by ``start`` answer; raises if none does within the start timeout.
        A tier already running (waited for, or attached) returns at once."""
        if self._thread is not None:
            return self
        nodes = self._asked
        where = self.nodes(self._timeout_s)  # waits until placed; a keeper whose node died is forgotten
        log.info("keepers_started", namespace=self.namespace, nodes=where)
        if len(where) < len(nodes):
            log.warning("keepers_missing", namespace=self.namespace, wanted=nodes, got=where)
        if not where:
            raise RuntimeError(f"no keeper of {self.namespace!r} started within {self._timeout_s} s on nodes {nodes}")
        return self._run()

    @classmethod
    def attach(
        cls,
        namespace: str,
        *,
        adopt: Callable[[str], Any | None],
        every: int = 1,
        timeout_s: float = 60.0,
        credential: str | None = None,
        image_key: str | None = None,
        on_refused: Callable[[str, int, str], None] | None = None,
    ) -> KeeperTier | None:
        """A client of the job's keepers already running in ``namespace`` (e.g. left by a crashed client), or None.

        Creates no actor; pushes from it go to the keepers found. Each ``keeper-*`` name is resolved by ``adopt``
        (the job's own keeper, or None; it raises for an actor the job did not create): never by its name alone.
        """
        names = sorted(
            e["name"]
            for e in ray.util.list_named_actors(all_namespaces=True)
            if e["namespace"] == namespace and e["name"].startswith(PREFIX)
        )
        tier = cls(
            namespace,
            num_keepers=max(1, len(names)),
            every=every,
            timeout_s=timeout_s,
            credential=credential,
            image_key=image_key,
            on_refused=on_refused,
            adopt=adopt,
        )
        for name in names:
            handle = adopt(name)
            if handle is not None:  # None: died meanwhile
                tier._keepers[name] = handle
        return tier._run() if tier._keepers else None

    def _run(self) -> KeeperTier:
        self._thread = threading.Thread(target=self._loop, name=f"keeper-push-{self.namespace}", daemon=True)
        self._thread.start()
        return self

    def handles(self) -> dict[str, Any]:
        """The keepers believed alive, by name."""
        return dict(self._keepers)

    def push_part(self, image: HostImage, part: int) -> None:
        """Send ``image`` to every keeper as part ``part`` of its step (multi-process mode: the pieces one worker
        holds), from the calling thread, bounded by ``timeout_s``; failures are counted, never raised."""
        calls = dict(self._keepers)
        if not calls:
            self._count("keeper_push_failures")
            return
        ref = ray.put(image)
        for name, result in self._collect(
            {n: self._signed(k).put_part.remote(ref, part) for n, k in calls.items()}, self._timeout_s
        ).items():
            if isinstance(result, Exception):
                self._count("keeper_push_failures")
                log.warning("keeper_push_failed", keeper=name, step=image.step, part=part, error=repr(result))
        self._count("keeper_pushes")

    def whole_steps(self, timeout: float = 60.0) -> dict[int, str]:
        """The newest whole step (all parts present, intact) each live keeper holds: step -> a keeper's name,
        newest step first."""
        got = self._ask_all("whole_steps", timeout)
        found: dict[int, str] = {}
        for name, steps in got.items():
            for step in steps if isinstance(steps, list) else []:
                found.setdefault(step, name)
        return dict(sorted(found.items(), reverse=True))

    def holds(self, step: int, timeout: float = 60.0) -> bool:
        """Whether a live keeper holds the image of ``step`` (one sent by :meth:`push`)."""
        return any(isinstance(s, list) and step in s for s in self._ask_all("steps", timeout).values())

    def region(self, name: str, step: int, leaf: int, index: Index, timeout: float = 60.0) -> np.ndarray | None:
        keeper = self._keepers.get(name)
        if keeper is None:
            return None
        got = self._collect({name: self._signed(keeper).region.remote(step, leaf, index)}, timeout)[name]
        return got if isinstance(got, np.ndarray) else None

    def part_meta(self, name: str, step: int, timeout: float = 60.0) -> dict[str, Any] | None:
        keeper = self._keepers.get(name)
        if keeper is None:
            return None
        got = self._collect({name: self._signed(keeper).part_meta.remote(step)}, timeout)[name]
        return got if isinstance(got, dict) else None

    def push(self, image: HostImage) -> bool:
        """Queue ``image`` for every keeper; True if it will be sent (see ``every``).

        The image is sealed and copied into Ray's object store before this returns (on one thread: tenths of a
        second for hundreds of MiB), so the caller may reuse the buffers its pieces view as soon as it does; the
        calls to the keepers go out on the push thread. A queued image not yet sent is replaced by a newer push
        (counted as ``keeper_coalesced``).
        """
        if self._thread is None:
            raise RuntimeError("KeeperTier.push before start() or attach()")
        with self._pushing:  # one push at a time: images queue in the order they were offered
            with self._cond:
                rollback = self._last_sent is not None and image.step <= self._last_sent
                self._offered += 1
                if not rollback and self._last_sent is not None and self._offered < self._every:
                    self._stats["keeper_skipped"] += 1
                    return False
                self._offered, self._last_sent = 0, image.step
            try:
                if self._image_key is not None:
                    image = seal(image, self._image_key)
                ref = ray.put(image)  # once, for all keepers
            except Exception as err:  # noqa: BLE001 - a full object store: counted, the next push tries again
                self._count("keeper_push_failures", max(1, len(self._keepers)))
                log.warning("keeper_push_failed", step=image.step, error=repr(err))
                return False
            with self._cond:
                if self._pending is not None:
                    self._stats["keeper_coalesced"] += 1
                    log.info("keeper_push_coalesced", replaced=self._pending[0], step=image.step)
                self._pending = (image.step, ref)
                self._cond.notify_all()
        return True

    def wait(self, timeout: float) -> bool:
        """Wait until no push is queued or in flight; False if ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None and not self._busy, timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closing)
                if self._closing:
                    return
                pending, self._pending, self._busy = self._pending, None, True
            assert pending is not None  # woken with an image pending
            step, ref = pending
            try:
                self._send(step, ref)
            except Exception as err:  # noqa: BLE001 - the thread must survive; the failure is counted
                self._count("keeper_push_failures", len(self._keepers))
                log.warning("keeper_push_failed", step=step, error=repr(err))
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _send(self, step: int, ref: Any) -> None:
        calls = dict(self._keepers)
        if not calls:  # keepers are never restarted: this lasts, so say it once
            self._count("keeper_push_failures")
            if not self._none_left:
                log.warning("keeper_none_left", namespace=self.namespace, step=step)
            self._none_left = True
            return
        calls = {name: self._signed(k).put.remote(ref) for name, k in calls.items()}
        for name, result in self._collect(calls, self._timeout_s).items():
            if isinstance(result, Exception):
                self._count("keeper_push_failures")
                log.warning("keeper_push_failed", keeper=name, step=step, error=repr(result))
        self._count("keeper_pushes")

    def _count(self, key: str, n: int = 1) -> None:
        with self._cond:
            self._stats[key] += n

    def _ask_all(self, method: str, timeout: float) -> dict[str, Any]:
        """Every live keeper's answer to ``method`` (no arguments but the credential), as :meth:`_collect` gives it."""
        calls = {n: getattr(self._signed(k), method).remote() for n, k in dict(self._keepers).items()}
        return self._collect(calls, timeout)

    def _collect(self, calls: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Each call's result or exception, waiting ``timeout`` in all; forgets keepers that died."""
        deadline = time.monotonic() + timeout
        out: dict[str, Any] = {}
        for name, ref in calls.items():
            try:
                out[name] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.ActorUnavailableError as err:  # may come back: keep it
                out[name] = err
            except ray.exceptions.RayActorError as err:  # died; max_restarts=0, so for good
                self._keepers.pop(name, None)
                log.warning("keeper_gone", keeper=name, error=type(err).__name__)
                out[name] = err
            except ray.exceptions.RayError as err:  # timed out, or the call raised
                out[name] = err
        return out

    def latest(self, timeout: float = 60.0) -> HostImage | None:
        """The newest intact image any live keeper holds (None if none does); its pieces are read-only.

        Asks every keeper for its steps, then fetches from the one with the newest, falling back to the next.
        """
        deadline = time.monotonic() + timeout
        held = self._ask_all("steps", timeout)
        tops = sorted(((max(s), n) for n, s in held.items() if isinstance(s, list) and s), reverse=True)
        best: HostImage | None = None
        for top, name in tops:
            if (best is not None and best.step >= top) or name not in self._keepers:
                continue
            got = self._collect(
                {name: self._signed(self._keepers[name]).latest.remote()}, max(0.0, deadline - time.monotonic())
            )
            image = got[name]
            if isinstance(image, HostImage) and self._image_key is not None and not sealed(image, self._image_key):
                log.warning("keeper_image_refused", keeper=name, step=image.step)
                if self._on_refused is not None:
                    self._on_refused(name, image.step, "its seal does not verify under the job's image key")
                continue  # the next keeper's image, or the next tier
            if isinstance(image, HostImage) and (best is None or image.step > best.step):
                best = image
        return None if best is None else dataclasses.replace(best, meta=copy.deepcopy(best.meta))  # see _private_copy

    def nodes(self, timeout: float = 10.0) -> dict[str, str]:
        """The node id of each keeper that answers, by name."""
        got = self._ask_all("node_id", timeout)
        return {n: node for n, node in got.items() if isinstance(node, str)}

    def stats(self, timeout: float = 10.0) -> dict[str, int]:
        """Counters plus ``keeper_bytes`` (summed over the keepers answering) and ``keepers_alive``."""
        held = self._ask_all("held_bytes", timeout)
        alive = [b for b in held.values() if isinstance(b, int)]
        with self._cond:
            counters = dict(self._stats)
        return {**counters, "keeper_bytes": sum(alive), "keepers_alive": len(alive)}

    def close(self, *, kill: bool, timeout: float = 10.0) -> None:
        """Stop pushing; ``kill`` ends the keepers (normal end of job), otherwise they stay for a new client."""
        with self._cond:
            if self._pending is not None:  # the caller did not wait(): say what is lost
                log.warning("keeper_push_abandoned", step=self._pending[0])
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        if kill:
            for handle in dict(self._keepers).values():
                ray.kill(handle, no_restart=True)
            log.info("keepers_killed", namespace=self.namespace, keepers=sorted(self._keepers))
            self._keepers.clear()
