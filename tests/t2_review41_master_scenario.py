"""A stopped ``mooncake_master`` at T2 start-up (session 41), on a real master inside a loopback-only
network namespace (run by ``tests/test_review41_t2_master.py``). Writes a JSON report:
 master_pid      the master's pid (the caller kills it if this process is cut off)
 healthy_s       a store client's start (its master probe included) with the master up
 stopped_s       the same with the master stopped (SIGSTOP): before, ``setup`` held the GIL and
                 retried for about 10 minutes (this process is then cut off by a faulthandler
                 watchdog, which needs no GIL, after ``WATCHDOG_S``)
 stopped_error   the error the start ended with
"""
import json
import os
import pathlib
import signal
import sys
import tempfile
import time

from sglang_tiered.tier.t2_client import MooncakeClient
from sglang_tiered.tier.t2_config import parse_t2_url
from tests.netns import release_master, start_master, time_client_start

PORT = 50151
WATCHDOG_S = 60


def main(out):
    tmp = pathlib.Path(tempfile.mkdtemp())
    master = start_master(PORT, tmp / "m.log", lease_ms=1000)
    cfg = parse_t2_url(f"mooncake://127.0.0.1:{PORT}?segment_mb=16&buffer_mb=16&mode=on")
    rep = {"master_pid": master.pid}
    out = pathlib.Path(out)
    out.write_text(json.dumps(rep))
    try:
        t0 = time.monotonic()
        MooncakeClient(cfg).close()
        rep["healthy_s"] = round(time.monotonic() - t0, 2)
        os.kill(master.pid, signal.SIGSTOP)
        out.write_text(json.dumps(rep))
        time_client_start(lambda: MooncakeClient(cfg).close(), rep, "stopped_error", "stopped_s", WATCHDOG_S)
    finally:
        release_master(master)
    out.write_text(json.dumps(rep))


if __name__ == "__main__":
    main(sys.argv[1])
