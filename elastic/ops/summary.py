"""The demo's human summary on stdout: what happened to the slices, the failures, each recovery and its seconds,
and the check against the failure-free reference (the whole report is behind ``elastic demo --json``)."""

from __future__ import annotations

from typing import Any

__all__ = ["summary_lines"]


def summary_lines(out: dict[str, Any]) -> list[str]:
    """A short table of a demo's report ``out`` (``Report.to_dict()`` plus the reference figures)."""
    rows: list[tuple[str, str]] = [
        (
            "slices",
            f"{out.get('slices_initial', '-')} at start, {out.get('min_slices_seen', '-')} at least, "
            f"{out.get('slices_final', '-')} at the end",
        ),
        (
            "steps committed",
            f"{out.get('steps_committed', 0)} in {out.get('wall_seconds', 0.0):.1f} s "
            f"({out.get('steps_recomputed', 0)} recomputed, {out.get('duplicate_steps', 0)} duplicate, "
            f"{out.get('skipped_steps', 0)} skipped)",
        ),
        (
            "failures",
            f"{out.get('failures_injected', 0)} injected"
            + (f", {out['client_restarts']} client restart(s)" if out.get("client_restarts") else ""),
        ),
    ]
    seconds = out.get("recovery_seconds") or []
    recoveries = out.get("recoveries", 0)
    rows.append(("recoveries", f"{recoveries}" + (": " + ", ".join(f"{s:.2f} s" for s in seconds) if seconds else "")))
    for r in out.get("restores") or []:
        rows.append(("restored", f"step {r.get('step')} from the {r.get('tier')} tier"))
    if out.get("grows"):
        rows.append(("grew back", f"{out['grows']} time(s)"))
    rows.append(
        (
            "snapshots",
            f"{out.get('snapshots_taken', 0)} taken, training held "
            f"{out.get('snapshot_blocking_seconds', 0.0):.3f} s in all",
        )
    )
    if out.get("final_loss") is not None:
        rows.append(("final loss", f"{out['final_loss']:.6f}"))
    if "max_abs_param_diff_vs_reference" in out:
        diff = out["max_abs_param_diff_vs_reference"]
        rows.append(("vs reference", f"max |param diff| {diff:.3g} (a run with no failure, same seed and data)"))
    else:
        rows.append(("vs reference", "not checked (add --verify)"))
    width = max(len(name) for name, _ in rows)
    return [f"{name:<{width}}  {value}" for name, value in rows]
