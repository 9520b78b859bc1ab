"""Session 42's T2 review on a real ``mooncake_master`` (run inside a loopback-only network
namespace by ``tests/test_review42_t2.py``). Writes a JSON report:
 foreign_put       the put of a foreign object (twice a page's object) under a key of ours
 get_code          what the store answers a read of it into one object's room (-600)
 fetched_foreign   pages the tier fetched for the run starting at that key (0: a miss)
 up_after          whether T2 was still up after it (before: the breaker tripped)
 failures          the tier's failed calls
 oversized_pages   its count of such objects
 fetched_other     pages fetched for another run right after
 left_after_lease  whether the foreign object was still there after the read's lease
"""
import json
import pathlib
import sys
import tempfile
import threading
import time

import torch

from sglang_tiered.tier.host_pool import HostPool
from sglang_tiered.tier.t2 import T2Tier
from sglang_tiered.tier.t2_client import MooncakeClient
from sglang_tiered.tier.t2_config import parse_t2_url
from tests.netns import start_master
from tests.test_review41_t2 import _evict_into_t2
from tests.test_t2 import LAYOUT, H

PORT = 50171


def main(out):
    cfg = parse_t2_url(f"mooncake://127.0.0.1:{PORT}?segment_mb=16&buffer_mb=16&mode=on&timeout_ms=300"
                       "&lease_ms=1000&max_run_pages=4&queue_pages=64")  # fmt: skip
    tmp = pathlib.Path(tempfile.mkdtemp())
    master = start_master(PORT, tmp / "m.log", lease_ms=1000)
    rep = {}
    try:
        t2 = T2Tier(MooncakeClient(cfg), HostPool(LAYOUT), threading.RLock(), cfg=cfg, model_tag="m",
                    value_of=lambda h: 5)  # fmt: skip
        t2.start()
        other = MooncakeClient(cfg)  # a foreign writer
        k0 = t2.key(H(0), 7)
        big = torch.full((2 * t2.obj_bytes,), 1, dtype=torch.uint8)
        other.register(big)
        rep["foreign_put"] = other.put([k0], [big.data_ptr()], [big.numel()])[0]
        probe = torch.zeros(t2.obj_bytes, dtype=torch.uint8)
        other.register(probe)
        rep["get_code"] = other.get([k0], [probe.data_ptr()], [t2.obj_bytes])[0]
        _evict_into_t2(t2, [H(0), H(1), H(10), H(11)], 7)  # (ours under k0 is refused: it exists)
        t2.wait_idle(10)
        time.sleep(t2._lease_s())  # (the probe read's lease)
        rep["fetched_foreign"] = t2.fetch([H(0), H(1)], 7)
        rep["up_after"] = t2.up
        rep["fetched_other"] = t2.fetch([H(10), H(11)], 7)
        rep["failures"] = t2.stats.failures
        rep["oversized_pages"] = t2.stats.oversized_pages
        time.sleep(t2._lease_s() + 1.0)
        t2.wait_removals()
        rep["left_after_lease"] = other.exists([k0])[0]
        t2.close()
        other.close()
    finally:
        master.kill()
    pathlib.Path(out).write_text(json.dumps(rep))


if __name__ == "__main__":
    main(sys.argv[1])
