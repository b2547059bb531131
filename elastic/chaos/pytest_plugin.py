"""A pytest plugin (the ``elastic`` ``pytest11`` entry point of this package): the ``elastic_chaos`` fixture.

    def test_my_loop_survives(elastic_chaos):
        result = elastic_chaos(target=my_target, seed=7, schedules=3)
        assert result.ok, result.violations

``target`` is a function returning ``ElasticJob``'s keyword arguments plus ``loop`` (or its
``"module:function"`` name; None: the demo model). The schedules run in the test's process, on the Ray
it is connected to or on an embedded one started for the session. Simulated slices need forced CPU
devices set before jax starts (``XLA_FLAGS=--xla_force_host_platform_device_count=8`` in conftest.py);
the fixture raises them itself when jax has not started yet. Importing this module imports neither jax
nor Ray: pytest loads it in every session of the environment.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from elastic.chaos.report import ChaosResult

__all__ = ["elastic_chaos"]

Target = Callable[[], Mapping[str, Any]] | str | None


def _cpu_devices(count: int) -> None:
    """Ask jax for ``count`` CPU devices if its backends have not started (otherwise the job says what to set)."""
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", max(count, jax.config.values["jax_num_cpu_devices"] or 1))
    except RuntimeError:  # jax already started: the devices it has are the ones there are
        pass


@pytest.fixture
def elastic_chaos() -> Callable[..., ChaosResult]:
    """``elastic_chaos(target=..., seed=0, schedules=3, steps=None, scenarios=None, timeout_s=120.0, index=None)``
    runs a failure-free reference and ``schedules`` seeded fault schedules on the target and returns the
    :class:`~elastic.chaos.report.ChaosResult` (``.ok``, ``.violations``, ``.to_dict()``)."""

    def run(
        target: Target = None,
        *,
        seed: int = 0,
        schedules: int = 3,
        steps: int | None = None,
        scenarios: Sequence[str] | None = None,
        timeout_s: float = 120.0,
        index: int | None = None,
    ) -> ChaosResult:
        from elastic.chaos.runner import ChaosRunner  # jax and Ray load only when a test asks for chaos

        runner = ChaosRunner(target, seed=seed, steps=steps, timeout_s=timeout_s, scenarios=scenarios)
        _cpu_devices(runner.config.num_slices * runner.config.devices_per_slice)
        return runner.run(schedules, indices=None if index is None else [index])

    return run
