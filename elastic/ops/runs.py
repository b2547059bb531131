"""What an operator asks of a job, answered from its event stream: where to read it, its status, its report.

A job's run is read from the cluster named by ``RAY_ADDRESS`` (its GCS event stream, :mod:`elastic.supervision.events`),
or, when no cluster is named, from the run records jobs write at close (``record_dir``, by default
``$ELASTIC_HOME/runs``: the CLI's ``elastic demo`` writes there). ``fold_status`` and ``fold_report`` are pure.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic.errors import AccessError, ConfigError

__all__ = ["Source", "elastic_home", "failures", "fold_report", "fold_status", "open_run", "records_dir", "describe"]

RECENT = 12  # events shown by status


def elastic_home() -> Path:
    return Path(os.environ.get("ELASTIC_HOME", "~/.elastic")).expanduser()


def records_dir() -> Path:
    """Where jobs write their run records when asked to, and where offline commands read them."""
    return Path(os.environ.get("ELASTIC_RECORD_DIR") or elastic_home() / "runs")


@dataclass(frozen=True, kw_only=True)
class Source:
    job: str
    run: str
    where: str  # "cluster <address>" or the run record's directory
    records: list[dict[str, Any]]
    report: dict[str, Any] | None = None
    key: str | None = None  # the job's stream key (records read from the cluster verify under it)
    forged: int = 0  # records left out: not signed by the job's writers


def open_run(job: str, *, run: str | None = None, directory: str | None = None, token: str | None = None) -> Source:
    """The records of ``job``'s run (default: its newest): from ``directory`` if given, from the cluster named
    by ``RAY_ADDRESS`` if set, else from the run records under :func:`records_dir`.

    From the cluster only with the job's credential (``token``, else ``$ELASTIC_TOKEN`` or the file its client
    wrote for this user): ``AccessError`` without it or with another job's; records that do not verify under it
    are left out and counted (``forged``)."""
    from elastic.supervision import events

    if directory is not None:
        records, report = events.load(directory)
        return Source(job=job, run=Path(directory).name, where=str(directory), records=records, report=report)
    if os.environ.get("RAY_ADDRESS"):
        from elastic.control.cluster import connect
        from elastic.control.tokens import find_token
        from elastic.supervision.credential import derive

        connect()
        run = run or events.current_run(job)
        if run is None:
            raise ConfigError(
                f"no job {job!r} on the cluster at {os.environ['RAY_ADDRESS']} (no event stream); "
                f"jobs there: {sorted(_jobs_online()) or 'none'}"
            )
        token = find_token(job, token)
        if token is None:
            raise AccessError(
                f"no credential for job {job!r} here: run this as the job's user on its client machine "
                "(its client wrote $ELASTIC_HOME/tokens/<job>), or pass --token-file (or set ELASTIC_TOKEN)"
            )
        from elastic.config import ElasticConfig
        from elastic.supervision.identity import JobActors
        from elastic.supervision.supervisor import SUPERVISOR_NAME

        if JobActors(job, ElasticConfig(job_name=job).namespace, token).is_mine(SUPERVISOR_NAME) is False:
            raise AccessError(  # the name is another's: say so (nothing is sent to it; the stream is read alone)
                f"refused: the actor holding job {job!r}'s supervisor name was not created by the job under this "
                "credential (a squatter's, or another job's): it was not called; check the credential, or remove it"
            )
        key = derive(token, "stream")
        records, forged = events.verify(events.read(job, run), key)
        if not any(r["writer"] == "job" and r["kind"] == "run_started" for r in records) and forged:
            raise AccessError(f"the credential given is not job {job!r}'s (its event stream does not verify under it)")
        return Source(
            job=job, run=run, where=f"cluster {os.environ['RAY_ADDRESS']}", records=records, key=key, forged=len(forged)
        )
    runs = sorted(p for p in (records_dir() / job).glob("*") if (p / "events.jsonl").exists())
    if run is not None:
        runs = [p for p in runs if p.name == run]
    if not runs:
        raise ConfigError(
            f"no record of job {job!r} under {records_dir()} and RAY_ADDRESS is not set: point "
            "RAY_ADDRESS at the job's cluster, or pass --dir to a run record"
        )
    records, report = events.load(runs[-1])
    return Source(job=job, run=runs[-1].name, where=str(runs[-1]), records=records, report=report)


def _jobs_online() -> set[str]:
    from elastic.supervision.events import NAMESPACE
    from elastic.supervision.ray_internals import kv_list

    return {k.decode().split("/")[0] for k in kv_list(b"", namespace=NAMESPACE) if k.endswith(b"/current")}


def describe(record: dict[str, Any]) -> str:
    """One line for a record: what happened and why."""
    kind = record["kind"]
    if kind == "timeline":
        detail = {
            k: v
            for k, v in record.items()
            if k not in ("wall", "writer", "seq", "kind", "t", "event", "mac") and v is not None
        }
        return f"{record['event']} " + " ".join(f"{k}={v}" for k, v in detail.items())
    if kind == "view":
        return f"view epoch {record['epoch']} slices {record['active']} ({record['decision']}): {record['reason']}"
    if kind == "health":
        return f"slice {record['slice']} {'healthy' if record['healthy'] else 'LOST'}: {record['cause']}"
    if kind == "progress":
        rate = f" at {record['steps_per_s']} steps/s" if record.get("steps_per_s") is not None else ""
        snap = (
            f"snapshot {record['snapshot_step']} ({record['snapshot_tier']})"
            if record.get("snapshot_step") is not None
            else "no snapshot yet"
        )
        return f"step {record['step']}{rate} on slices {record['slices']}, {snap}"
    if kind == "inject":
        return f"operator injected {record.get('fault')} into slice {record.get('slice')}"
    detail = {k: v for k, v in record.items() if k not in ("wall", "writer", "seq", "kind", "mac") and v is not None}
    return f"{kind} " + " ".join(f"{k}={v}" for k, v in detail.items())


def _last(records: Iterable[dict[str, Any]], kind: str, event: str | None = None) -> dict[str, Any] | None:
    found = None
    for r in records:
        if r["kind"] == kind and (event is None or r.get("event") == event):
            found = r
    return found


def failures(records: Iterable[dict[str, Any]]) -> int:
    """Slice losses in a run: the supervisor's ``health`` records of a slice lost (an operator's ``inject`` and an
    agent's death included), or the client's ``failure`` events if it saw more (a hang the supervisor missed)."""
    records = list(records)
    lost = sum(r["kind"] == "health" and not r.get("healthy") for r in records)
    seen = sum(r["kind"] == "timeline" and r.get("event") == "failure" for r in records)
    return max(lost, seen)


def fold_status(source: Source) -> dict[str, Any]:
    """Slices, epoch, steps committed (``step``: the last one's index), step rate, the newest snapshot and its tier,
    recent events, the job's state, and when its run ended (``ended_wall``: its last record once it finished)."""
    records = source.records
    view, progress = _last(records, "view"), _last(records, "progress")
    finished, closed = _last(records, "timeline", "finished"), _last(records, "closed")
    state = "running"
    if view is not None and view.get("gave_up"):
        state = "gave_up"
    elif finished is not None:
        state = "finished"
    elif closed is not None:
        state = "closed"
    step = finished["steps"] - 1 if finished is not None else (progress or {}).get("step")
    recent = [r for r in records if r["kind"] != "progress"][-RECENT:]
    return {
        "job": source.job,
        "run": source.run,
        "source": source.where,
        "state": state,
        "epoch": view["epoch"] if view else None,
        "slices": view["active"] if view else [],
        "reason": view["reason"] if view else None,
        "step": step,
        "steps_committed": step + 1 if isinstance(step, int) else 0,
        "steps_per_s": (progress or {}).get("steps_per_s"),
        "snapshot_step": (progress or {}).get("snapshot_step"),
        "snapshot_tier": (progress or {}).get("snapshot_tier"),
        "failures": failures(records),
        "recoveries": sum(r["kind"] == "timeline" and r["event"] == "first_step" for r in records),
        "last_event_wall": records[-1]["wall"] if records else None,
        "ended_wall": records[-1]["wall"] if records and state != "running" else None,
        "recent": [{"wall": r["wall"], "writer": r["writer"], "kind": r["kind"], "what": describe(r)} for r in recent],
    }


def fold_report(source: Source) -> dict[str, Any]:
    """The job's report: the one it wrote at close when there is one, else what its stream tells so far."""
    if source.report is not None:
        return {"job": source.job, "run": source.run, **source.report}
    status = fold_status(source)
    timeline = [
        {k: v for k, v in r.items() if k not in ("writer", "seq", "kind")}
        for r in source.records
        if r["kind"] == "timeline"
    ]
    return {
        "job": source.job,
        "run": source.run,
        "state": status["state"],
        "steps_committed": status["steps_committed"],
        "recoveries": status["recoveries"],
        "failures": status["failures"],
        "slices_final": len(status["slices"]),
        "seconds": round(status["last_event_wall"] - source.records[0]["wall"], 3) if source.records else 0.0,
        "timeline": timeline,
    }
