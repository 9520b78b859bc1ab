"""Session 25: fixed compute per server for the live fleet benchmark (``cpu_quota_group``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sglang_tiered.dev.server import cpu_quota_group, remove_cgroup

BUSY = ("import resource, time\n"
        "t = time.time()\n"
        "while time.time() - t < 1.0: pass\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_utime + resource.getrusage(resource.RUSAGE_SELF).ru_stime)")


def test_cpu_quota_rejects_nonpositive_cores():
    with pytest.raises(ValueError, match="cores must be > 0"):
        cpu_quota_group("sglang-tiered-test-bad", 0)


def test_cpu_quota_caps_a_busy_child():
    """A busy process put in a group of 0.3 CPU gets at most about 0.3 s of CPU per second of
    wall time (where this machine lets us make groups; elsewhere the error says why)."""
    try:
        group = cpu_quota_group(f"sglang-tiered-test-{os.getpid()}", 0.3)
    except RuntimeError as exc:
        assert "cgroup" in str(exc)
        pytest.skip(f"no writable cgroup here: {exc}")
    try:
        procs = os.path.join(group, "cgroup.procs")

        def join() -> None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        out = subprocess.run([sys.executable, "-c", BUSY], preexec_fn=join, capture_output=True, text=True,
                             timeout=60, check=True)  # fmt: skip
        cpu = float(out.stdout.strip())
        assert cpu < 0.5, f"busy child got {cpu:.2f} s of CPU in 1 s under a 0.3 CPU quota"
    finally:
        remove_cgroup(group)
    assert not os.path.exists(group)
