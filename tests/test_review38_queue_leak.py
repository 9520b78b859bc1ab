"""T2's store queue holds at most ``queue_pages`` pages copied out of T1 (README "T2": host memory
beside T1). Runs the full queue value-drops stay in the worker's heap with their page data until
the worker pops its way down to them, which a queue that never empties (a store slower than T1's
victims, the case value-drop is for) never does: the copied-out pages pile up without bound."""
import threading
import time

import torch

from sglang_tiered.core.store_queue import QUEUED, StoreQueue
from sglang_tiered.tier.host_pool import HostPool, PoolLayout
from sglang_tiered.tier.t2 import T2Tier
from sglang_tiered.tier.t2_config import T2Config
from tests.test_t2 import ByteStore


def _retained(q) -> tuple[int, int]:
    """(entries in the worker's heap, pages of finished/dropped jobs whose data is still held)."""
    with q._cv:
        dead = [j for _, _, j in q._hi if j.state != QUEUED and j.ctx is not None]
        return len(q._hi), sum(len(j.ctx) for j in dead if isinstance(j.ctx, list))


def test_store_queue_heap_is_bounded_under_sustained_pressure():
    q = StoreQueue(8, lambda job: None, threaded=False)
    for i in range(4000):  # two runs of 2 pages offered per run written, each worth more than the last
        for k in range(2):
            n = 2 * i + k
            q.offer([2 * n, 2 * n + 1], [b"x", b"y"], value=n + 1, ctx=[0, 0])
        with q._cv:
            job = q._next()
        q._execute(job)
        q.check_invariants()
    heap, _ = _retained(q)
    assert heap <= 2 * 8 + 64, f"the worker's heap holds {heap} entries for a queue of 8 pages"


class SlowStore(ByteStore):
    def put(self, keys, ptrs, sizes):
        time.sleep(0.004)  # a store slower than T1's victims
        return super().put(keys, ptrs, sizes)


def test_t2_copied_out_pages_stay_within_queue_pages():
    lay = PoolLayout(num_pages=8, layers=2, kv_heads=2, page_size=4, head_dim=64, dtype="float32")
    pool = HostPool(lay)
    freq = {"n": 1}
    cfg = T2Config(master="127.0.0.1:1", queue_pages=16, max_run_pages=4, timeout_ms=1000, min_gbps=1.0, lease_ms=0)
    t2 = T2Tier(SlowStore(), pool, threading.RLock(), cfg=cfg, model_tag="m",
                value_of=lambda h: freq["n"])  # pages ever more popular (later victims worth more)
    t2.start()
    try:
        peak = 0
        for i in range(3000):  # T1 takes a page, evicting its least recent one into T2's queue
            freq["n"] = 2 + i // 4
            h = i.to_bytes(4, "little") * 4
            with t2.lock:
                pairs = pool.reserve([h], evict=True)
                pool.commit(pairs, 7)
                t2.flush()
            if i % 100 == 0:
                peak = max(peak, _retained(t2.queue)[1])
        peak = max(peak, _retained(t2.queue)[1])
        held = peak + t2.queue.stats.queued_pages
        print(f"pages copied out and still held: {held} (queue_pages {cfg.queue_pages}); "
              f"value-dropped {t2.queue.stats.value_dropped_pages}, stored {t2.stats.stored_pages}")
        assert held <= cfg.queue_pages, f"{held} copied-out pages held for a queue of {cfg.queue_pages}"
    finally:
        t2.close()
