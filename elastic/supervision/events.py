"""One durable event stream per job run, in Ray's GCS key-value store: it outlives any node but the head.

Every writer of a run (the supervisor, each client process) appends records under its own keys,
``<job>/<run>/<writer>/<seq>`` in the KV namespace ``elastic-events``; a reader merges them by wall time.
A record is a flat JSON object with ``wall`` (seconds since the epoch), ``writer``, ``seq`` and ``kind``:
the supervisor's observations (``health``), refusals, decisions (``wait``, ``view`` with its reason), and the
client's timeline (``timeline``: failures, recovery phases, snapshots, restores) and progress (``progress``:
step, step rate, slices, last snapshot and its tier). ``run`` ties the records to one start of the job (a
new client taking a job over keeps its run); the KV key ``<job>/current`` names the newest run.

Bounded: each writer keeps its newest ``keep`` records (``DEFAULT_KEEP``), older ones are deleted as new
ones land (a reader sees the gap in ``seq``), and a job keeps its newest ``KEEP_RUNS`` runs. A supervisor restarted
elsewhere reads its own records back and
continues the sequence. ``delete(job)`` (``elastic cleanup``) removes a job's stream; an embedded cluster's
stream goes with the cluster, so the CLI also writes a finished run's stream to a directory (``dump``).

Signed: a job's writers hold its stream key (:mod:`elastic.supervision.credential`) and each record carries
``mac``, an HMAC of the record; a restarted supervisor replays only its records that verify, and the operator's
commands drop (and say so) records that do not. The store itself is Ray's: any holder of the cluster token can
read it or delete keys from it; what the MAC promises is that nothing written by another is taken as the job's.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from elastic.errors import ConfigError
from elastic.supervision import ray_internals as kv

__all__ = [
    "DEFAULT_KEEP",
    "EventStream",
    "current_run",
    "delete",
    "delete_runs",
    "dump",
    "load",
    "new_run",
    "read",
    "parse",
    "runs",
    "sign",
    "verify",
]

NAMESPACE = "elastic-events"
DEFAULT_KEEP = 50_000  # records per writer (~200 bytes each: ~10 MB per writer at most)
KEEP_RUNS = 5  # runs kept per job name
WRITERS = 4  # threads writing a stream's records at once (append_soon)


def _key(*parts: object) -> bytes:
    return "/".join(str(p) for p in parts).encode()


def sign(record: dict[str, Any], key: str) -> dict[str, Any]:
    """``record`` with ``mac``: HMAC-SHA256 under ``key`` of its canonical JSON (keys sorted, without ``mac``)."""
    body = {k: v for k, v in record.items() if k != "mac"}
    return {**body, "mac": _mac(body, key)}


def _mac(body: dict[str, Any], key: str) -> str:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
    return hmac.new(key.encode(), text.encode(), hashlib.sha256).hexdigest()


def verify(records: Iterable[dict[str, Any]], key: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Split ``records`` into those whose ``mac`` is right under ``key`` and the rest (forged, altered, or
    unsigned); the good ones keep their ``mac``."""
    good: list[dict[str, Any]] = []
    bad: list[dict[str, Any]] = []
    for r in records:
        if not isinstance(r, dict):
            bad.append(r)
            continue
        mac = r.get("mac")
        body = {k: v for k, v in r.items() if k != "mac"}
        ok = isinstance(mac, str) and hmac.compare_digest(mac.encode(), _mac(body, key).encode())  # any text: bytes
        (good if ok else bad).append(r)
    return good, bad


def new_run(job: str, *, keep_runs: int = KEEP_RUNS, key: str | None = None) -> str:
    """A fresh run id for ``job``, recorded as its current run; runs older than the newest ``keep_runs`` go."""
    known = runs(job)
    for old in known[: max(0, len(known) - keep_runs + 1)]:
        kv.kv_del(_key(job, old, ""), del_by_prefix=True, namespace=NAMESPACE)
    now = time.time()  # ids sort by start time, to the microsecond
    run = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(now))}.{int(now % 1 * 1e6):06d}-{uuid.uuid4().hex[:4]}"
    EventStream(job, run, "job", key=key).append("run_started", job=job, run=run)  # the run exists from its start
    kv.kv_put(_key(job, "current"), run.encode(), namespace=NAMESPACE)
    return run


def current_run(job: str) -> str | None:
    value = kv.kv_get(_key(job, "current"), namespace=NAMESPACE)
    return value.decode() if value else None


def runs(job: str) -> list[str]:
    """The runs of ``job`` with records in the store, oldest first (run ids sort by start time)."""
    keys = kv.kv_list(_key(job, ""), namespace=NAMESPACE)
    return sorted({k.decode().split("/")[1] for k in keys if k.count(b"/") >= 3})


class EventStream:
    """Appends records of one writer of one run, each signed under ``key`` (the job's stream key) when given.
    Thread-safe; a failed write is counted, never raised."""

    def __init__(self, job: str, run: str, writer: str, *, keep: int = DEFAULT_KEEP, key: str | None = None) -> None:
        self.job, self.run, self.writer, self.keep = job, run, writer, keep
        self._key = key
        self._lock = threading.Lock()
        prefix = _key(job, run, writer, "")
        seqs = [int(k.rsplit(b"/", 1)[1]) for k in kv.kv_list(prefix, namespace=NAMESPACE)]
        self._next = max(seqs, default=-1) + 1  # a restarted writer continues its sequence
        self.failed = 0
        self._pool: ThreadPoolExecutor | None = None  # append_soon's writers, started on first use
        self._behind: ThreadPoolExecutor | None = None  # append_behind's one writer, started on first use
        self._last: Future[None] | None = None  # append_behind's newest write

    def append(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Write a record (returns once it is stored, or counted as failed) and return it."""
        record, write = self.prepare(kind, **fields)
        write()
        return record

    def append_soon(self, kind: str, **fields: Any) -> tuple[dict[str, Any], Future[None]]:
        """The record, and its write already started on this stream's writer threads: several records written
        at once take one round trip to the GCS, not one each (a round trip grows under load). Each
        has its own ``seq``, so readers order them whatever order they land in."""
        record, write = self.prepare(kind, **fields)
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(WRITERS, thread_name_prefix="event-stream")
            return record, self._pool.submit(write)

    def append_behind(self, kind: str, **fields: Any) -> dict[str, Any]:
        """The record, written in order on one writer thread: the caller does not wait for the GCS (a training
        loop or a recovery must not pay a round trip per record). ``flush`` waits for the writes."""
        record, write = self.prepare(kind, **fields)
        with self._lock:
            if self._behind is None:
                self._behind = ThreadPoolExecutor(1, thread_name_prefix="event-stream-behind")
            self._last = self._behind.submit(write)
        return record

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait (at most ``timeout_s``) until every ``append_behind`` record is written; whether they all were."""
        with self._lock:
            last = self._last
        if last is None:
            return True
        try:
            last.result(timeout=timeout_s)  # one writer, in order: the newest done means all are
        except FutureTimeout:
            return False
        return True

    def prepare(self, kind: str, **fields: Any) -> tuple[dict[str, Any], Callable[[], None]]:
        """The next record (its ``seq`` taken, signed) and the write that stores it."""
        with self._lock:
            seq, self._next = self._next, self._next + 1
        record = {"wall": round(time.time(), 6), "writer": self.writer, "seq": seq, "kind": kind, **fields}
        if self._key is not None:
            record = sign(json.loads(json.dumps(record, default=str)), self._key)  # signed as it is stored
        data = json.dumps(record, default=str).encode()

        def write() -> None:
            try:
                kv.kv_put(_key(self.job, self.run, self.writer, f"{seq:012d}"), data, namespace=NAMESPACE)
                if seq >= self.keep:
                    kv.kv_del(_key(self.job, self.run, self.writer, f"{seq - self.keep:012d}"), namespace=NAMESPACE)
            except Exception:  # noqa: BLE001 - the GCS briefly unreachable: the record is lost, counted
                with self._lock:
                    self.failed += 1

        return record, write

    def mine(self) -> list[dict[str, Any]]:
        """This writer's records in this run, in order (a restarted writer's replay)."""
        return read(self.job, self.run, writers=[self.writer])

    def mine_verified(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """This writer's records, and apart those whose MAC is wrong or missing (all good without a key)."""
        records = self.mine()
        return verify(records, self._key) if self._key is not None else (records, [])


def read(
    job: str,
    run: str | None = None,
    *,
    writers: Iterable[str] | None = None,
    after: tuple[float, str, int] | None = None,
) -> list[dict[str, Any]]:
    """The records of ``run`` (default: the current run), merged by (wall, writer, seq); only those of
    ``writers`` if given, only those sorting after ``after`` if given (``events --follow``)."""
    run = run or current_run(job)
    if run is None:
        return []
    keys = kv.kv_list(_key(job, run, ""), namespace=NAMESPACE)
    if writers is not None:
        wanted = {w.encode() for w in writers}
        keys = [k for k in keys if k.split(b"/")[2] in wanted]
    if not keys:
        return []
    values = kv.kv_multi_get(keys, namespace=NAMESPACE)
    records = [r for r in (parse(v) for v in values.values() if v) if r is not None]
    records.sort(key=_order)
    if after is not None:
        records = [r for r in records if _order(r) > after]
    return records


def parse(value: bytes | str) -> dict[str, Any] | None:
    """A stored record, or None if it is not one (not JSON, not an object, or without a numeric ``wall``, a
    string ``writer`` and ``kind`` and an integer ``seq``): such values were not written by this module."""
    try:
        record = json.loads(value)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(record, dict):
        return None
    wall, seq = record.get("wall"), record.get("seq")
    if (
        not isinstance(wall, (int, float))
        or isinstance(wall, bool)
        or wall != wall
        or not isinstance(seq, int)
        or isinstance(seq, bool)
        or not isinstance(record.get("writer"), str)
        or not isinstance(record.get("kind"), str)
    ):
        return None
    return record


def _order(record: dict[str, Any]) -> tuple[float, str, int]:
    return (record["wall"], record["writer"], record["seq"])


def delete_runs(job: str, which: Iterable[str]) -> list[str]:
    """Remove the records of ``job``'s runs ``which``; the runs left (``<job>/current`` goes with the last)."""
    for run in which:
        kv.kv_del(_key(job, run, ""), del_by_prefix=True, namespace=NAMESPACE)
    left = runs(job)
    if not left:
        kv.kv_del(_key(job, "current"), namespace=NAMESPACE)
    return left


def delete(job: str) -> int:
    """Remove every record of ``job`` (all runs); the number of keys removed."""
    return kv.kv_del(_key(job, ""), del_by_prefix=True, namespace=NAMESPACE)


def dump(records: list[dict[str, Any]], directory: str | os.PathLike, *, report: dict[str, Any] | None = None) -> Path:
    """Write a run's records (``events.jsonl``) and its report (``report.json``) to ``directory``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "events.jsonl", "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, default=str) + "\n")
    if report is not None:
        (out / "report.json").write_text(json.dumps(report, default=str))
    return out


def load(directory: str | os.PathLike) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """A dumped run: its records and report (None if it has none)."""
    path = Path(directory)
    if not (path / "events.jsonl").is_file():
        raise ConfigError(f"{path} is not a run record: it has no events.jsonl")
    records = []
    with open(path / "events.jsonl", encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = parse(line)
            if record is None:
                raise ConfigError(f"{path / 'events.jsonl'} line {number} is not an event record")
            records.append(record)
    records.sort(key=_order)
    report = None
    if (path / "report.json").exists():
        try:
            report = json.loads((path / "report.json").read_text(errors="replace"))
        except ValueError as err:
            raise ConfigError(f"{path / 'report.json'} is not JSON: {err}") from err
        if not isinstance(report, dict):
            raise ConfigError(f"{path / 'report.json'} is not a report (a JSON object)")
    return records, report
