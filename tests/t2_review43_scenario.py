"""Session 43's T2 review on a real ``mooncake_master`` (run inside a loopback-only network
namespace by ``tests/test_review43_t2.py``): a server starting while a peer that died without
unmounting its segment is still listed (a crashed server restarting; CI: two servers starting
together). Writes a JSON report:
 dead_peer_codes   the codes a plain batched put got right after the peer died (shows -800)
 probe             "ok" when the start-up probe measured the store, else its error
 probe_seconds     how long it took (its retries wait for the master to drop the dead peer)
"""
import json
import pathlib
import subprocess
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

PORT = 50161
LAY = PoolLayout(num_pages=8, layers=2, kv_heads=2, page_size=4, head_dim=4, dtype="float32")

# A peer that mounts a large segment (most replicas land on it) and dies without its close.
_PEER = """
import sys, time
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 512 << 20, 16 << 20, "tcp", "", sys.argv[1])
print(rc, flush=True)
time.sleep(600)
"""


def main(out):
    tmp = pathlib.Path(tempfile.mkdtemp())
    master = start_master(PORT, tmp / "m.log", lease_ms=1000)
    url = (f"mooncake://127.0.0.1:{PORT}?segment_mb=16&buffer_mb=16&mode=on&timeout_ms=2000&lease_ms=5000"
           "&max_run_pages=16&queue_pages=64")
    cfg = parse_t2_url(url)
    rep = {}
    try:
        watcher = T2Tier(MooncakeClient(cfg), HostPool(LAY), threading.RLock(), cfg=cfg, model_tag="w")
        peer = subprocess.Popen([sys.executable, "-c", _PEER, f"127.0.0.1:{PORT}"], stdout=subprocess.PIPE)
        assert peer.stdout.readline().strip() == b"0", "the peer's setup failed"
        peer.kill()
        peer.wait()
        t2 = T2Tier(MooncakeClient(cfg), HostPool(LAY), threading.RLock(), cfg=cfg, model_tag="m")
        # what the dead peer does to a put (the watcher's own, on its registered staging buffer)
        w, ob = watcher._write, watcher.obj_bytes
        keys = [f"sgt/dead/{i}" for i in range(watcher.run)]
        res = watcher.client.put(keys, [w.ptr + i * ob for i in range(len(keys))], [ob] * len(keys))
        rep["dead_peer_codes"] = sorted(set(res))
        t0 = time.monotonic()
        try:
            measure_t2_gbps(t2)
            rep["probe"] = "ok"
        except Exception as exc:  # noqa: BLE001
            rep["probe"] = repr(exc)
        rep["probe_seconds"] = round(time.monotonic() - t0, 1)
        t2.close()
        watcher.close()
    finally:
        master.kill()
    pathlib.Path(out).write_text(json.dumps(rep))


if __name__ == "__main__":
    main(sys.argv[1])
