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
import faulthandler
import json
import os
import pathlib
import signal
import sys
import tempfile
import time

from sglang_tiered.tier import t2_client
from sglang_tiered.tier.t2_config import parse_t2_url
from tests.netns import start_master

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
        faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
        t0 = time.monotonic()
        try:
            t2_client.MooncakeClient(cfg).close()
            rep["error"] = None
        except Exception as exc:  # noqa: BLE001
            rep["error"] = f"{type(exc).__name__}: {exc}"
        rep["took_s"] = round(time.monotonic() - t0, 2)
        faulthandler.cancel_dump_traceback_later()
    finally:
        os.kill(master.pid, signal.SIGCONT)
        master.kill()
        master.wait(10)
    out.write_text(json.dumps(rep))


if __name__ == "__main__":
    main(sys.argv[1])
