"""A picture of a job over time, from its event stream: ``elastic report --out timeline.png``.

``render_timeline(records, out)`` writes a PNG (about 1400x700 px) with the seconds since the first record
across. The top panel has one lane per slice, a bar while the supervisor's ``view`` holds it active (the
client's ``progress`` slices when the stream has no view), failure markers (a supervisor ``health`` record
saying a slice is lost, an injected kill), recoveries shaded with their length (a client's ``failure`` up to
its ``first_step``; a client restart from the old client's last record to the new one's first progress),
and snapshot ticks on a lane of their own (a change of ``snapshot_step`` in ``progress``, marked by tier and drawn
when its step ran); an operator's ``inject`` is a fault, a revive a heal.
The bottom panel has the committed step (``progress``, ``restored``, ``first_step``: a rollback shows as a
drop) per client writer, and steps per second on a twin axis. A give-up, the job's end and view changes
are vertical lines. Drawn on a ``Figure`` with the Agg canvas: pyplot and its backend are left alone.
"""

from __future__ import annotations

import bisect
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

__all__ = ["render_timeline"]

SIZE_IN, DPI = (14.0, 7.0), 100  # 1400x700 px
ACTIVE = "#4c72b0"
FAILURE = "#d62728"  # a slice lost (supervisor health)
KILL = "#7f0000"  # a kill injected by the chaos tools
HEALED = "#2ca02c"  # a lost slice healthy again
REFUSED = "#7f7f7f"
RECOVERY = "#fdd49e"  # opaque, under everything else
SNAPSHOT: dict[str | None, tuple[str, str]] = {
    "memory": ("#17becf", "|"),
    "keeper": ("#9467bd", "D"),
    "persistent": ("#8c564b", "s"),
}
STEP, RATE, SNAP_STEP = "#1f77b4", "#9e9e9e", "#17becf"


def render_timeline(
    records: list[dict[str, Any]],
    out: str | os.PathLike[str],
    *,
    title: str | None = None,
    num_slices: int | None = None,
) -> Path:
    """Draw ``records`` (one run's event stream, sorted by ``wall``) to the PNG ``out``; returns its path."""
    out = Path(out)
    records = sorted((r for r in records if isinstance(r.get("wall"), (int, float))), key=lambda r: r["wall"])
    fig = Figure(figsize=SIZE_IN, dpi=DPI)
    FigureCanvasAgg(fig)
    if not records:
        fig.suptitle(title or "job timeline", fontsize=14)
        fig.text(0.5, 0.5, "no events", ha="center", va="center", fontsize=24, color=REFUSED)
        fig.savefig(out, format="png", dpi=DPI)
        return out
    t0 = records[0]["wall"]
    span = records[-1]["wall"] - t0
    end = max(span, 1.0)
    lanes = num_slices if num_slices is not None else max(_slices_seen(records), default=-1) + 1
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2], "hspace": 0.08})
    fig.subplots_adjust(left=0.07, right=0.80, top=0.90, bottom=0.08)
    recoveries = _recoveries(records, t0, end)
    for ax in (top, bottom):
        for start, stop, _ in recoveries:
            ax.axvspan(start, stop, color=RECOVERY, lw=0, zorder=0.5)
    for start, stop, label in recoveries:
        top.text(
            (start + stop) / 2,
            1.01,
            label,
            transform=top.get_xaxis_transform(),
            ha="center",
            va="bottom",
            fontsize=8,
            color="#a0522d",
        )
    legend: dict[str, Any] = {}  # label -> proxy artist, for what was drawn, in drawing order
    if recoveries:
        legend["recovery / client restart"] = Patch(color=RECOVERY)
    top.set_xlim(-0.01 * end, end * 1.01)
    _draw_lanes(top, records, t0, end, lanes, legend)
    _draw_marks(top, bottom, records, t0, lanes, legend)
    _draw_steps(bottom, records, t0, legend)
    bottom.set_xlabel("seconds since the first record")
    fig.suptitle(title or "job timeline", fontsize=14, y=0.985)
    fig.text(0.5, 0.935, _summary(records, recoveries, span), ha="center", fontsize=9, color="#444444")
    if legend:
        fig.legend(
            handles=list(legend.values()),
            labels=list(legend),
            loc="center left",
            bbox_to_anchor=(0.805, 0.5),
            fontsize=8,
            frameon=False,
        )
    else:
        top.text(
            0.5,
            0.5,
            f"no slice or step events in {len(records)} record(s)",
            transform=top.transAxes,
            ha="center",
            va="center",
            fontsize=16,
            color=REFUSED,
        )
    fig.savefig(out, format="png", dpi=DPI)
    return out


def _mark(marker: str, colour: str, ms: float = 8) -> Line2D:
    return Line2D([], [], marker=marker, color=colour, ls="none", ms=ms, mew=2)


def _slices_seen(records: Iterable[dict[str, Any]]) -> Iterable[int]:
    for r in records:
        for key in ("active", "slices"):
            if isinstance(r.get(key), list):
                yield from (s for s in r[key] if isinstance(s, int))
        if isinstance(r.get("slice"), int):
            yield r["slice"]


def _timeline(r: dict[str, Any], *events: str) -> bool:
    return r.get("kind") == "timeline" and r.get("event") in events


def _recoveries(records: list[dict[str, Any]], t0: float, end: float) -> list[tuple[float, float, str]]:
    """(start, stop, label) of each recovery: a failure up to the next first step, and a client restart from
    the old client's last record up to the new client's first progress."""
    spans: list[tuple[float, float, str]] = []
    open_at, why, new_writer = None, "", None
    last_of: dict[str, float] = {}  # client writer -> its last record
    for r in records:
        x, writer = r["wall"] - t0, str(r.get("writer", ""))
        client = writer.startswith("client")
        if client and writer not in last_of and last_of:
            new_writer = writer  # a new client takes the job over
            if open_at is None:
                open_at, why = max(last_of.values()), "client restart"
            else:
                why = "recovery + client restart"
        if _timeline(r, "failure") and open_at is None:
            open_at, why = x, "recovery"
        elif open_at is not None and (
            _timeline(r, "first_step") or (r.get("kind") == "progress" and writer == new_writer)
        ):
            spans.append((open_at, x, f"{why} {x - open_at:.1f} s"))
            open_at, new_writer = None, None
        if client:
            last_of[writer] = x
    if open_at is not None:
        spans.append((open_at, end, f"{why}: not recovered"))
    return spans


def _draw_lanes(
    ax: Any, records: list[dict[str, Any]], t0: float, end: float, lanes: int, legend: dict[str, Any]
) -> None:
    """A bar per slice while active: from the views, or the client's progress when there is no view."""
    source = [r for r in records if r.get("kind") == "view"] or [r for r in records if r.get("kind") == "progress"]
    key = "active" if source and source[0].get("kind") == "view" else "slices"
    since: dict[int, float] = {}
    bars: dict[int, list[tuple[float, float]]] = {}
    for r in source:
        x, now = r["wall"] - t0, set(r.get(key) or [])
        for s in [s for s in since if s not in now]:
            bars.setdefault(s, []).append((since[s], x - since.pop(s)))
        for s in now - set(since):
            since[s] = x
    for s, start in since.items():
        bars.setdefault(s, []).append((start, end - start))
    for s, spans in bars.items():
        ax.broken_barh(spans, (s - 0.3, 0.6), color=ACTIVE, zorder=2)
        legend["slice active" if key == "active" else "slice active (client's view)"] = Patch(color=ACTIVE)
    ax.set_ylim(-0.7, lanes + 0.7)
    ax.set_yticks(list(range(lanes)) + [lanes], [f"slice {s}" for s in range(lanes)] + ["snapshots"])
    ax.axhline(lanes - 0.5, color="#dddddd", lw=0.8, zorder=1)
    ax.tick_params(axis="y", length=0)


def _draw_marks(
    top: Any, bottom: Any, records: list[dict[str, Any]], t0: float, lanes: int, legend: dict[str, Any]
) -> None:
    """Failures, heals, refusals, faults and snapshots on the lanes; view changes and the end as lines."""
    end = top.get_xlim()[1]
    lost: set[int] = set()
    last_snapshot = None
    snap_xy: list[tuple[float, int]] = []
    samples = _step_samples(records, t0)

    points: dict[tuple[str, str, float], list[tuple[float, float]]] = {}  # one artist per kind of mark

    def point(x: float, y: float, marker: str, colour: str, label: str, ms: float = 10) -> None:
        points.setdefault((marker, colour, ms), []).append((x, y))
        legend.setdefault(label, _mark(marker, colour, min(ms, 8)))

    def line(x: float, colour: str, label: str, **style: Any) -> None:
        top.axvline(x, color=colour, zorder=1, **style)
        legend.setdefault(label, Line2D([], [], color=colour, **style))

    for r in records:
        x, kind = r["wall"] - t0, r.get("kind")
        s = r.get("slice")
        if kind == "health" and isinstance(s, int):  # above the lane's centre: an injected fault sits on it
            if not r.get("healthy"):
                lost.add(s)
                point(x, s + 0.3, "v", FAILURE, "slice lost (supervisor)", 11)
            elif s in lost:
                lost.discard(s)
                point(x, s + 0.3, "^", HEALED, "slice healthy again")
        elif kind == "refused" and isinstance(s, int):
            point(x, s - 0.3, "s", REFUSED, "slice refused", 6)
        elif kind == "view" and r.get("gave_up"):
            for ax in (top, bottom):
                ax.axvline(x, color="black", lw=2.5, zorder=6)
            legend.setdefault("gave up", Line2D([], [], color="black", lw=2.5))
            top.text(
                x,
                lanes,
                f" gave up: {str(r['gave_up'])[:60]} ",
                fontsize=9,
                va="center",
                zorder=7,
                ha="right" if x > 0.6 * end else "left",
                bbox={"color": "white", "alpha": 0.8, "lw": 0},
            )
        elif kind == "view" and r.get("decision") in ("Shrink", "Grow", "Leave"):
            line(x, "#888888", "view change (shrink/grow/leave)", lw=0.8, ls=":")
        elif kind == "notice":  # a slice will go: warned, not failed
            for s in r.get("slices") or []:
                point(x, s + 0.3, "D", REFUSED, "notice (slice leaving)", 7)
        elif _timeline(r, "inject_revive"):  # a slice brought back: not a fault
            point(x, s if isinstance(s, int) else lanes - 0.5, "P", HEALED, "slice revived")
        elif (kind == "timeline" and str(r.get("event", "")).startswith("inject_")) or kind == "inject":
            point(x, s if isinstance(s, int) else lanes - 0.5, "X", KILL, "injected fault")
        elif _timeline(r, "finished", "saved_final") or kind == "closed":
            line(x, HEALED, "finished / closed", lw=1.2)
        elif _timeline(r, "stalled"):
            line(x, "#ff7f0e", "stalled", lw=1.0, ls="--")
        elif kind == "progress" and r.get("snapshot_step") is not None and r["snapshot_step"] != last_snapshot:
            last_snapshot = r["snapshot_step"]
            tier = r.get("snapshot_tier")
            colour, marker = SNAPSHOT.get(tier, (REFUSED, "o"))
            taken = _time_of_step(samples, last_snapshot, x)  # when its step ran, not when it was seen
            point(taken, lanes, marker, colour, f"snapshot ({tier})", 9 if marker == "|" else 6)
            snap_xy.append((x, last_snapshot))
    for (marker, colour, ms), xy in points.items():
        xs, ys = zip(*xy, strict=True)
        top.plot(xs, ys, marker=marker, ms=ms, mew=2, color=colour, ls="none", zorder=6 if marker == "X" else 5)
    if snap_xy:
        xs, ys = zip(*snap_xy, strict=True)
        bottom.plot(xs, ys, drawstyle="steps-post", color=SNAP_STEP, lw=1, alpha=0.8, zorder=3)
        legend["newest snapshot step"] = Line2D([], [], color=SNAP_STEP)


def _step_samples(records: list[dict[str, Any]], t0: float) -> list[tuple[float, int]]:
    """(seconds, committed step) of every step sample: progress records, restores and first steps."""
    return [
        (r["wall"] - t0, r["step"])
        for r in records
        if isinstance(r.get("step"), int) and (r.get("kind") == "progress" or _timeline(r, "restored", "first_step"))
    ]


def _time_of_step(samples: list[tuple[float, int]], step: int, before: float) -> float:
    """When ``step`` was committed, interpolated between the step samples seen up to ``before`` (seconds): the
    newest pair that brackets it (a rollback starts a new climb)."""
    seen = samples[: bisect.bisect_right(samples, (before, math.inf))]
    for (x0, s0), (x1, s1) in zip(reversed(seen[:-1]), reversed(seen[1:]), strict=True):
        if s0 <= step <= s1:
            return x0 if s1 == s0 else x0 + (x1 - x0) * (step - s0) / (s1 - s0)
    return seen[0][0] if seen else before


def _draw_steps(ax: Any, records: list[dict[str, Any]], t0: float, legend: dict[str, Any]) -> None:
    """The committed step per client writer (a drop is a rollback) and the step rate on a twin axis."""
    per_writer: dict[str, list[tuple[float, int]]] = {}
    rate: list[tuple[float, float]] = []
    for r in records:
        x = r["wall"] - t0
        if (r.get("kind") == "progress" or _timeline(r, "restored", "first_step")) and isinstance(r.get("step"), int):
            per_writer.setdefault(str(r.get("writer", "client")), []).append((x, r["step"]))
        if r.get("kind") == "progress" and isinstance(r.get("steps_per_s"), (int, float)):
            rate.append((x, r["steps_per_s"]))
    styles = ["-", "--", "-.", ":"]
    for i, (writer, points) in enumerate(per_writer.items()):
        xs, ys = zip(*points, strict=True)
        style: dict[str, Any] = {"color": STEP, "lw": 1.8, "ls": styles[i % 4]}
        ax.plot(xs, ys, marker="." if len(xs) < 200 else None, zorder=4, **style)
        legend["committed step" + (f" ({writer})" if len(per_writer) > 1 else "")] = Line2D([], [], **style)
    ax.set_ylabel("committed step")
    ax.grid(axis="y", color="#eeeeee", zorder=1)
    if rate:
        twin = ax.twinx()
        xs, ys = zip(*rate, strict=True)
        twin.plot(xs, ys, color=RATE, lw=1, ls="--", zorder=3)
        twin.set_ylabel("steps/s", color=RATE)
        twin.set_ylim(bottom=0, top=max(ys) * 1.15 or 1.0)
        twin.tick_params(axis="y", colors=RATE)
        legend["steps/s (right axis)"] = Line2D([], [], color=RATE, ls="--")


def _summary(records: list[dict[str, Any]], recoveries: list[tuple[float, float, str]], end: float) -> str:
    writers = sorted({r.get("writer", "") for r in records if str(r.get("writer", "")).startswith("client")})
    from elastic.ops.runs import failures as count_failures

    steps = [r["step"] for r in records if r.get("kind") == "progress" and isinstance(r.get("step"), int)]
    steps += [r["steps"] - 1 for r in records if _timeline(r, "finished") and isinstance(r.get("steps"), int)]
    failures = count_failures(r for r in records if "kind" in r)
    gave_up = next((r["gave_up"] for r in records if r.get("kind") == "view" and r.get("gave_up")), None)
    parts = [
        f"{end:.1f} s",
        f"{len(records)} records",
        f"{len(writers)} client(s)",
        f"{failures} failure(s)",
        f"{len(recoveries)} recovery span(s)",
        f"last step {steps[-1] if steps else '-'}",
    ]
    return " | ".join(parts + ([f"GAVE UP: {str(gave_up)[:60]}"] if gave_up else []))
