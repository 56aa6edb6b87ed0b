"""Generation on a device mesh: tests/mesh_check.py, run by pytest in a subprocess with 4 host CPU devices.

The device count is fixed when jax starts (XLA_FLAGS), and this process runs the rest of the suite on
one device; so the mesh checks run in their own process, and a failure shows that pytest's report.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # ~2 min: a second process compiling every check on 4 devices

HERE = os.path.dirname(os.path.abspath(__file__))


def test_mesh_checks_pass_on_4_host_devices():
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    env = dict(os.environ, XLA_FLAGS=flags, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs",
                           os.path.join(HERE, "mesh_check.py")],
                          cwd=os.path.dirname(HERE), env=env, capture_output=True, text=True, timeout=900)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"tests/mesh_check.py failed in its 4-device subprocess:\n{report[-12000:]}"
    assert " passed" in report and "skipped" not in report, report[-3000:]
