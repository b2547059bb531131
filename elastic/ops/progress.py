"""A terminal progress bar and the end-of-run timeline, on stderr (stdout is kept for results)."""

from __future__ import annotations

from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress
from rich.table import Table

__all__ = ["Progress", "print_timeline"]


class Progress:
    def __init__(self, total: int, *, enabled: bool, stream: TextIO, label: str = "training") -> None:
        self._enabled = enabled
        self._console = Console(file=stream)
        self._bar = RichProgress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=self._console,
            disable=not enabled,
        )
        self._task = self._bar.add_task(label, total=total, info="")

    def __enter__(self) -> Progress:
        self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.stop()

    def on_step(self, step: int, metrics: dict[str, Any], run: Any) -> None:
        loss = float(metrics["loss"]) if "loss" in metrics else float("nan")
        self._bar.update(
            self._task, completed=step + 1, info=f"loss {loss:.4f} | {len(run.slices)} slices | epoch {run.epoch}"
        )


def print_timeline(events: list[dict[str, Any]], stream: TextIO) -> None:
    table = Table(title="event timeline")
    table.add_column("t (s)", justify="right")
    table.add_column("event")
    table.add_column("detail")
    for e in events:
        detail = ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("t", "event"))
        table.add_row(f"{e['t']:.2f}", e["event"], detail)
    Console(file=stream).print(table)
