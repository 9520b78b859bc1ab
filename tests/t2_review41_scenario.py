"""Session 41's T2 review on a real ``mooncake_master`` (run inside a loopback-only network
namespace by ``tests/test_review41_t2.py``). Writes a JSON report:
 probe_left     the start-up probe's objects still in the store after its lease (before: a run)
 refused_left   the same for a tier refused at start-up (closed once they are removed)
"""
import json
import pathlib
import sys
import tempfile
import threading
import time

from sglang_tiered.integration.t2_setup import measure_t2_gbps
from sglang_tiered.tier.host_pool import HostPool, PoolLayout
from sglang_tiered.tier.t2 import T2Tier
from sglang_tiered.tier.t2_client import MooncakeClient
from sglang_tiered.tier.t2_config import parse_t2_url
from tests.netns import start_master

PORT = 50141
LAY = PoolLayout(num_pages=8, layers=2, kv_heads=2, page_size=4, head_dim=4, dtype="float32")


def main(out):
    tmp = pathlib.Path(tempfile.mkdtemp())
    master = start_master(PORT, tmp / "m.log", lease_ms=1000)
    url = (f"mooncake://127.0.0.1:{PORT}?segment_mb=16&buffer_mb=16&mode=on&timeout_ms=300&lease_ms=1000"
           "&max_run_pages=4&queue_pages=64")
    cfg = parse_t2_url(url)
    rep = {}
    try:
        def tier():
            return T2Tier(MooncakeClient(cfg), HostPool(LAY), threading.RLock(), cfg=cfg, model_tag="m")

        a, b, watcher = tier(), tier(), tier()
        measure_t2_gbps(a)
        a.start()
        time.sleep(a._lease_s() + 1.0)
        a.wait_removals()
        rep["probe_left"] = watcher.client.remove_regex("^sgt/probe/")
        measure_t2_gbps(b)
        try:
            b.close(after_s=b._lease_s())  # as build_t2 closes a tier it refused
        except TypeError:  # (the code before session 41: closed at once)
            b.close()
        time.sleep(b._lease_s() + 1.0)
        rep["refused_left"] = watcher.client.remove_regex("^sgt/probe/")
        a.close()
        watcher.close()
    finally:
        master.kill()
    pathlib.Path(out).write_text(json.dumps(rep))


if __name__ == "__main__":
    main(sys.argv[1])
