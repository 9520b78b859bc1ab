"""The session-23 review's T2 scenarios on a real ``mooncake_master`` (run inside a loopback-only
network namespace: ``tests/test_review23.py``). Written by the reviewer against the old code,
where S1 and S2 served the invalidated page and S3 re-read the bad object on every fetch.
Scenarios:
 S1  un-told peer re-writes a pre-invalidation page: the invalidating server serves it again
 S2  restart (fresh T2Tier) after an invalidation whose removal hit a lease: stale page served
 S3  an object with another header (old FORMAT_VERSION) under a live key: every fetch re-reads it,
     and the correct page can never be written there
"""
import sys, time, tempfile, pathlib, threading, json
import torch
from tests.netns import start_master
from sglang_tiered.tier.host_pool import HostPool, PoolLayout
from sglang_tiered.tier.t2 import T2Tier, HEADER_BYTES
from sglang_tiered.tier.t2_client import MooncakeClient
from sglang_tiered.tier.t2_config import parse_t2_url

PORT = 50093
LAY = PoolLayout(num_pages=4, layers=2, kv_heads=2, page_size=4, head_dim=4, dtype="float32")
SHAPE = (2, LAY.layers, LAY.kv_heads, LAY.page_size, LAY.head_dim)
X = 12345  # tenant hash

def H(i): return bytes([i]) * 16

def data(i): return torch.full(SHAPE, float(i))

STATE = {}
def tier(url, tag="m", state=None):
    cfg = parse_t2_url(url)
    pool = HostPool(LAY)
    t2 = T2Tier(MooncakeClient(cfg), pool, threading.RLock(), cfg=cfg, model_tag=tag, value_of=lambda h: 5, state_path=STATE.get(state))
    t2.start()
    return t2

def put_t1(t2, hashes, tenant):
    with t2.lock:
        pairs = t2.pool.reserve(hashes, evict=True)
        for h, s in pairs:
            t2.pool.data[:, :, :, s] = data(h[0])
        t2.pool.commit(pairs, tenant)
        t2.flush()

def main(out):
    tmp = pathlib.Path(tempfile.mkdtemp())
    rep = {}
    master = start_master(PORT, tmp / "m.log", lease_ms=3000)
    url = f"mooncake://127.0.0.1:{PORT}?segment_mb=16&buffer_mb=16&mode=on&timeout_ms=500&lease_ms=3000&max_run_pages=4&queue_pages=64"
    try:
        STATE["a"] = tmp / "a-gen.json"
        A, B = tier(url, state="a"), tier(url)
        # ---- S1: B holds page 1 of tenant X in T1 (KV from before the invalidation)
        put_t1(B, [H(1)], X)
        A.invalidate(tenant=X)                      # t0: A's floor; A's reads of X paused lease_s
        time.sleep(A.cfg.lease_ms / 1e3 + 1.5)      # A's read pause and its retry removal are over
        put_t1(B, [H(10), H(11), H(12), H(13)], 7)  # B evicts page 1 later (it was never told)
        B.wait_idle(10)
        rep["S1_B_stored"] = B.stats.stored_pages
        A._missed.clear()
        got = A.fetch([H(1)], X)
        rep["S1_A_fetch_after_invalidation"] = got
        rep["S1_A_stale_pages"] = A.stats.stale_pages
        # ---- S2: lease blocks the removal; the invalidating server restarts
        put_t1(B, [H(2)], X); put_t1(B, [H(20), H(21), H(22), H(23)], 7); B.wait_idle(10)
        C = tier(url)
        rep["S2_B_stats"] = dict(stored=B.stats.stored_pages, dropped=B.dropped_pages)
        rep["S2_peer_read"] = C.fetch([H(2)], X)   # a peer reads it: leased for 3 s
        removed = A.invalidate(tenant=X)
        rep["S2_removed_now"] = removed
        A._missed.clear()
        rep["S2_A_refuses_before_restart"] = A.fetch([H(2)], X)
        A.close()
        A2 = tier(url, state="a")  # A restarted, with its generations file
        rep["S2_A2_fetch_after_restart"] = A2.fetch([H(2)], X)
        # ---- S3: an object of another layout/format under a live key
        k = A2.key(H(3), X)
        bad = torch.zeros(A2.obj_bytes, dtype=torch.uint8)
        hdr = A2._headers([H(3)], X, time.time_ns())[0].clone()
        hdr[4] = 1  # FORMAT_VERSION 1 (an older writer)
        bad[-HEADER_BYTES:] = hdr
        bad[:HEADER_BYTES] = hdr
        A2.client.register(bad)
        rep["S3_put_old"] = A2.client.put([k], [bad.data_ptr()], [A2.obj_bytes])
        gets = [0]
        orig = A2.client.get
        def counting_get(*a):
            gets[0] += 1
            return orig(*a)
        A2.client.get = counting_get
        for _ in range(5):
            A2.fetch([H(3)], X)
        rep["S3_gets_for_5_fetches"] = gets[0]
        rep["S3_bad_pages"] = A2.stats.bad_pages
        before = A2.stats.stored_pages
        put_t1(A2, [H(3)], X); put_t1(A2, [H(30), H(31), H(32), H(33)], 7); A2.wait_idle(10)
        rep["S3_rewrite_stored"] = A2.stats.stored_pages - before
        # removed after the lease, once re-read and still bad; that re-read leases it again (session 39)
        time.sleep(2 * (A2.cfg.lease_ms / 1e3 + 0.05) + 0.5); A2.wait_removals(); put_t1(A2, [H(3)], X); put_t1(A2, [H(40), H(41), H(42), H(43)], 7); A2.wait_idle(10)
        rep["S3_after_rewrite_fetch"] = (A2.pool.drop([H(3)]), A2._missed.clear(), A2.fetch([H(3)], X))[2]
        rep["S3_bad_pages_after_rewrite"] = A2.stats.bad_pages
        rep["A2_stats"] = A2.snapshot()
        rep["ok"] = True
    finally:
        master.kill()
        pathlib.Path(out).write_text(json.dumps(rep, indent=1, default=str))

if __name__ == "__main__":
    main(sys.argv[1])
