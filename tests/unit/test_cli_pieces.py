"""Pieces of the CLI that need no cluster."""

from __future__ import annotations

import subprocess
import sys


def test_too_few_devices_after_jax_started_is_a_clear_config_error():
    """A chaos target whose module touched jax on import: the CLI says what to set, not jax's raw RuntimeError."""
    code = (
        "import jax; jax.devices()\n"
        "from elastic.cli_commands import force_cpu_devices as _force_cpu_devices\n"
        "from elastic.errors import ConfigError\n"
        "_force_cpu_devices(1)\n"  # enough: fine
        "try:\n"
        "    _force_cpu_devices(64, what='the chaos target t:f')\n"
        "except ConfigError as err:\n"
        "    print(err)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "the chaos target t:f needs 64 CPU devices" in out.stdout
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=64" in out.stdout
