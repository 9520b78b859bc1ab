"""A ``mooncake_master`` that stops between T2's start-up probe and the real setup (session 42), on a
real master inside a loopback-only network namespace (run by ``tests/test_review42_t2.py``). The
probe (``t2_client.probe_master``) runs as it does, and the master is stopped (SIGSTOP) right after
it answered. Writes a JSON report:
 master_pid   the master's pid (the caller kills it if this process is cut off)
 error        the error the store client's start ended with
 took_s       how long that start took (before: the setup, holding the GIL, retried the stopped
              master for about 10 minutes; this process is cut off by a faulthandler watchdog,
              which needs no GIL, after ``WATCHDOG_S``)
"""
import json
import os
import pathlib
import signal
import sys
import tempfile

from sglang_tiered.tier import t2_client
from sglang_tiered.tier.t2_config import parse_t2_url
from tests.netns import release_master, start_master, time_client_start

PORT = 50191
WATCHDOG_S = 90


def main(out):
    cfg = parse_t2_url(f"mooncake://127.0.0.1:{PORT}?segment_mb=16&buffer_mb=16&mode=on")
    tmp = pathlib.Path(tempfile.mkdtemp())
    master = start_master(PORT, tmp / "m.log", lease_ms=1000)
    rep = {"master_pid": master.pid}
    out = pathlib.Path(out)
    out.write_text(json.dumps(rep))
    probe = t2_client.probe_master

    def probe_then_stop(cfg, timeout_s):
        why = probe(cfg, timeout_s)
        os.kill(master.pid, signal.SIGSTOP)
        return why

    t2_client.probe_master = probe_then_stop
    try:
        time_client_start(lambda: t2_client.MooncakeClient(cfg).close(), rep, "error", "took_s", WATCHDOG_S)
    finally:
        release_master(master)
    out.write_text(json.dumps(rep))


if __name__ == "__main__":
    main(sys.argv[1])
