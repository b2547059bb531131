"""``elastic.ops.picture.render_timeline`` on synthetic event streams: a valid PNG of the intended size that shows
the failure markers and the recovery shading where the stream has them (and not where it has none)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.image
import numpy as np
import pytest

from elastic.ops.picture import FAILURE, KILL, RECOVERY, render_timeline

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
T0 = 1_700_000_000.0


class Stream:
    """Records as the supervisor and the clients write them, at seconds ``t`` after ``T0``."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self._seq: dict[str, int] = {}
        self._start: dict[str, float] = {}  # writer -> its first record

    def add(self, at: float, writer: str, kind: str, **fields: Any) -> None:
        seq = self._seq.get(writer, 0)
        self._seq[writer] = seq + 1
        self._start.setdefault(writer, at)
        self.records.append({"wall": T0 + at, "writer": writer, "seq": seq, "kind": kind, **fields})

    def view(self, t: float, epoch: int, active: list[int], decision: str, gave_up: str | None = None) -> None:
        self.add(
            t,
            "supervisor",
            "view",
            epoch=epoch,
            active=active,
            gave_up=gave_up,
            reason=f"{decision} test",
            decision=decision,
        )

    def health(self, t: float, slice_: int, healthy: bool, epoch: int) -> None:
        self.add(t, "supervisor", "health", slice=slice_, healthy=healthy, cause="probe", incarnation=1, epoch=epoch)

    def event(self, t: float, name: str, writer: str = "client-100", **detail: Any) -> None:
        since_start = t - self._start.setdefault(writer, t)  # a client's timeline counts from its own start
        self.add(t, writer, "timeline", event=name, t=round(since_start, 3), **detail)

    def progress(
        self,
        t: float,
        step: int,
        slices: list[int],
        epoch: int,
        snap: int | None,
        tier: str | None,
        writer: str = "client-100",
    ) -> None:
        self.add(
            t,
            writer,
            "progress",
            step=step,
            steps_per_s=5.0,
            slices=slices,
            epoch=epoch,
            snapshot_step=snap,
            snapshot_tier=tier,
        )

    def sorted(self) -> list[dict[str, Any]]:
        return sorted(self.records, key=lambda r: r["wall"])


def run_steps(
    s: Stream, start: float, stop: float, step0: int, slices: list[int], epoch: int, writer: str = "client-100"
) -> int:
    """Progress every second at 5 steps/s, a snapshot every 10 steps (every third one also on a keeper)."""
    step = step0
    for t in np.arange(start, stop, 1.0):
        step = step0 + int(5 * (t - start))
        snap = step // 10 * 10
        s.progress(float(t), step, slices, epoch, snap, "keeper" if snap % 30 == 0 else "memory", writer)
    return step


def slice_loss_stream() -> list[dict[str, Any]]:
    """4 slices; slice 1 is killed at t=10, shrink, restore, first step; slice 1 is back at t=20, grow."""
    s = Stream()
    s.view(0.0, 0, [0, 1, 2, 3], "Stay")
    s.event(0.5, "started", slices=4, epoch=0)
    last = run_steps(s, 1.0, 10.0, 0, [0, 1, 2, 3], 0)
    s.event(9.9, "inject_kill", step=last, slice=1)
    s.health(10.0, 1, False, 0)
    s.event(10.1, "failure", error="slice 1 lost")
    s.view(10.5, 1, [0, 2, 3], "Shrink")
    s.add(10.55, "supervisor", "refused", slice=1, incarnation=1, cause="dead")
    s.event(10.6, "detected", epoch=1, slices=3, reason="slice 1 lost")
    s.event(10.7, "shrink", epoch=1, slices=3, reason="slice 1 lost")
    s.event(11.5, "restored", step=30, tier="keeper", generation=30, slices=3, epoch=1)
    s.event(12.0, "first_step", step=31, slices=3, epoch=1)
    last = run_steps(s, 12.5, 20.0, 31, [0, 2, 3], 1)
    s.health(20.0, 1, True, 1)
    s.view(20.2, 2, [0, 1, 2, 3], "Grow")
    s.event(20.3, "grow", epoch=2, slices=4, reason="slice 1 healthy")
    s.event(20.5, "resharded", step=last + 1, slices=4, epoch=2)
    last = run_steps(s, 21.0, 31.0, last + 1, [0, 1, 2, 3], 2)
    s.event(31.0, "finished", steps=last + 1, slices=4)
    s.add(31.5, "supervisor", "closed")
    return s.sorted()


def quiet_stream() -> list[dict[str, Any]]:
    s = Stream()
    s.view(0.0, 0, [0, 1, 2, 3], "Stay")
    s.event(0.5, "started", slices=4, epoch=0)
    run_steps(s, 1.0, 20.0, 0, [0, 1, 2, 3], 0)
    return s.sorted()


def pixels_near(image: np.ndarray, colour: str, tol: float = 1.5 / 255) -> int:
    target = np.array(matplotlib.colors.to_rgb(colour))
    return int(np.all(np.abs(image[..., :3] - target) <= tol, axis=-1).sum())


def read_png(path: Path) -> np.ndarray:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    return matplotlib.image.imread(path)


def test_slice_loss_shows_failure_and_recovery(tmp_path: Path) -> None:
    out = render_timeline(slice_loss_stream(), tmp_path / "timeline.png", title="demo job, run 1")
    assert out == tmp_path / "timeline.png"
    image = read_png(out)
    height, width = image.shape[:2]
    assert abs(width - 1400) <= 20 and abs(height - 700) <= 20, image.shape
    assert pixels_near(image, FAILURE) > 30  # the lost-slice marker (and its legend entry)
    assert pixels_near(image, KILL) > 30  # the injected kill
    assert pixels_near(image, RECOVERY) > 2000  # the shaded failure -> first step span, in both panels


def test_no_failure_no_failure_marks(tmp_path: Path) -> None:
    image = read_png(render_timeline(quiet_stream(), tmp_path / "quiet.png"))
    assert pixels_near(image, FAILURE) == 0
    assert pixels_near(image, RECOVERY) == 0


def test_a_revive_is_a_heal_and_an_operator_inject_is_a_fault(tmp_path: Path) -> None:
    s = Stream()
    s.view(0.0, 0, [0, 1, 2, 3], "Stay")
    run_steps(s, 1.0, 10.0, 0, [0, 1, 2, 3], 0)
    s.event(5.0, "inject_revive", step=25, slice=1)
    image = read_png(render_timeline(s.sorted(), tmp_path / "revive.png"))
    assert pixels_near(image, KILL) == 0  # a revive is not drawn as a fault
    s.add(6.0, "supervisor", "inject", fault="kill", slice=2, incarnation=0, epoch=0)
    image = read_png(render_timeline(s.sorted(), tmp_path / "inject.png"))
    assert pixels_near(image, KILL) > 30


@pytest.mark.parametrize(
    "records",
    [
        [],
        [{"wall": T0, "writer": "supervisor", "seq": 0, "kind": "closed"}],
        [{"wall": T0, "writer": "x", "seq": 0, "kind": "unknown-kind", "junk": [1]}],
    ],
)
def test_empty_and_tiny_streams_render(tmp_path: Path, records: list[dict[str, Any]]) -> None:
    image = read_png(render_timeline(records, str(tmp_path / "tiny.png")))
    assert image.shape[0] > 600 and image.shape[1] > 1300


def test_client_restart_and_give_up(tmp_path: Path) -> None:
    s = Stream()
    s.view(0.0, 0, [0, 1], "Stay")
    s.event(0.5, "started", slices=2, epoch=0)
    run_steps(s, 1.0, 8.0, 0, [0, 1], 0)
    # client-100 dies without a word; client-200 takes over and restores from a keeper
    s.event(12.0, "started", writer="client-200", slices=2, epoch=0)
    s.event(13.0, "restored", writer="client-200", step=30, tier="keeper", generation=30, slices=2, epoch=0)
    run_steps(s, 14.0, 18.0, 31, [0, 1], 0, writer="client-200")
    s.health(18.0, 0, False, 0)
    s.health(18.1, 1, False, 0)
    s.event(18.2, "failure", writer="client-200", error="all slices lost")
    s.view(25.0, 1, [], "GiveUp", gave_up="no healthy slice for 6.8 s")
    image = read_png(render_timeline(s.sorted(), tmp_path / "restart.png", num_slices=3))
    assert pixels_near(image, RECOVERY) > 2000  # the client restart, and the failure never recovered from
    assert pixels_near(image, FAILURE) > 30


def test_leaves_pyplot_and_backend_alone(tmp_path: Path) -> None:
    """In a fresh interpreter: rendering neither imports pyplot nor changes the backend."""
    code = f"""
import sys, matplotlib
before = matplotlib.rcParams._get_backend_or_none()
from tests.unit.test_picture import slice_loss_stream
from elastic.ops.picture import render_timeline
render_timeline(slice_loss_stream(), {str(tmp_path / "sub.png")!r})
assert "matplotlib.pyplot" not in sys.modules, "pyplot imported"
assert matplotlib.rcParams._get_backend_or_none() == before, (before, matplotlib.rcParams._get_backend_or_none())
"""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]


def test_in_process_backend_and_figures_unchanged(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    backend, figures = matplotlib.get_backend(), plt.get_fignums()
    render_timeline(slice_loss_stream(), tmp_path / "inproc.png")
    assert matplotlib.get_backend() == backend
    assert plt.get_fignums() == figures
