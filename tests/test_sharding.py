"""Runs tests/multidevice/sharding_checks.py on 8 simulated CPU devices, in a process of its own.

XLA fixes the CPU device count when JAX starts, and the rest of the suite runs on one device, so
the multi-device checks get their own interpreter (and this suite's conftest flags, as it is the
same tests/ tree).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHECKS = "tests/multidevice/sharding_checks.py"


def test_sharding_on_eight_devices():
    flags = [
        f for f in os.environ.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f
    ]
    env = dict(os.environ, XLA_FLAGS=" ".join([*flags, "--xla_force_host_platform_device_count=8"]))
    env.pop("PYTEST_XDIST_WORKER", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", CHECKS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert (
        result.returncode == 0
    ), f"{CHECKS} failed on 8 devices:\n{result.stdout[-20000:]}\n{result.stderr[-5000:]}"
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
