"""T2 review (session 41): wrong KV, isolation holes and lost work in the fleet tier.

1. An invalidation (the scheduler thread) waited for T2's put in flight for the tenant (for every
   tenant with ``all``): ``StoreQueue.cancel_where`` waits for a running job, which T1 needs (its
   jobs read device pages the invalidation frees) and T2 does not (its jobs hold copies, written
   under the generation they were taken at). With the store slow, every request waited for the
   put's whole deadline (``timeout_ms`` + the run's bytes at ``min_gbps``: 5.6 s for a run of 256
   2-MiB pages at the defaults).
2. Memory beyond the bound: a written store job kept its payload (T2: the run's page copies) in
   the queue's drop heap until it was compacted (up to 64 runs beyond ``queue_pages``), and
   ``t2_host_bytes`` did not count the run of victims copied out and not yet queued.
3. The start-up probe (``measure_t2_gbps``) removed its objects right after reading them, which
   Mooncake refuses for the read's lease: each server start left a run of objects in the store
   (real Mooncake, loopback namespace: ``tests/t2_review41_scenario.py``). And it called the store
   directly, without the tier's deadlines: with the master stopped (SIGSTOP) each call held the
   launch 30 s on a real master.
"""

from __future__ import annotations

import threading
import time

from sglang_tiered.tier.host_pool import HostPool
from sglang_tiered.tier.t2 import T2Tier
from sglang_tiered.tier.t2_config import T2Config
from tests.test_t2 import LAYOUT, ByteStore, H, page_data


def _tier(store=None, *, lease_ms=0, timeout_ms=2000, **kw):
    cfg = T2Config(master="127.0.0.1:1", queue_pages=8, max_run_pages=4, timeout_ms=timeout_ms, lease_ms=lease_ms, **kw)
    t2 = T2Tier(store or ByteStore(), HostPool(LAYOUT), threading.RLock(), cfg=cfg, model_tag="m", value_of=lambda h: 5)
    t2.start()
    return t2


def _evict_into_t2(t2, hashes, tenant):
    """Write ``hashes`` into T1 for ``tenant``, then push them out (T1's victims go to T2)."""
    pool = t2.pool
    with t2.lock:
        pairs = pool.reserve(hashes, evict=True)
        for h, slot in pairs:
            pool.data[:, :, :, slot] = page_data(h, tenant)
        pool.commit(pairs, tenant)
        filler = [H(1000 + i) for i in range(LAYOUT.num_pages)]
        pairs = pool.reserve(filler, evict=True)
        pool.commit(pairs, 99)
        t2.flush()


# ---------------------------------------------------------------------- 1. invalidation waits for a put
class SlowPutStore(ByteStore):
    """Puts take ``delay`` s (a slow store, within the put's deadline); ``started`` is set when one begins."""

    def __init__(self, delay: float):
        super().__init__()
        self.delay = delay
        self.started = threading.Event()

    def put(self, keys, ptrs, sizes):
        self.started.set()
        time.sleep(self.delay)
        return super().put(keys, ptrs, sizes)


def _invalidation_during_a_put(everything: bool) -> tuple[float, T2Tier, SlowPutStore]:
    store = SlowPutStore(1.5)
    t2 = _tier(store, timeout_ms=4000)
    _evict_into_t2(t2, [H(i) for i in range(4)], 7)
    assert store.started.wait(5), "the put never started"
    t0 = time.perf_counter()
    t2.invalidate(tenant=None if everything else 7, everything=everything)
    return time.perf_counter() - t0, t2, store


def test_an_invalidation_does_not_wait_for_the_tenants_put_in_flight():
    for everything in (False, True):
        took, t2, store = _invalidation_during_a_put(everything)
        try:
            # before: ~1.5 s (the put's remaining time), every request waiting behind it
            assert took < 0.3, f"invalidation (all={everything}) waited {took:.2f} s for a T2 put"
            assert t2.wait_idle(10)
            # the put landed under the old generation (never read again), and went once it had
            assert t2.wait_removals()
            assert not [k for k in store.objects if k.split("/")[4] == "0"], "invalidated objects left"
            t2._missed.clear()
            assert t2.fetch([H(0), H(1)], 7) == 0
            t2.queue.check_invariants()
        finally:
            t2.close()


# ---------------------------------------------------------------------- 2. memory beyond the bound
def _pages_held(t2) -> int:
    """Page copies the tier holds outside its staging buffers: queued or finished store jobs'
    payloads (reachable from the queue's heaps) and the victims not yet offered."""
    q = t2.queue
    jobs = {id(e[2]): e[2] for e in q._hi + q._lo}
    jobs.update({id(j): j for j in q._page_job.values()})
    return sum(len(j.ctx) for j in jobs.values() if j.ctx is not None) + len(t2._victims)


def test_written_runs_do_not_keep_their_page_copies():
    """A written job stayed in the queue's drop heap (``_lo``, compacted past 64 entries) with its
    payload: for T2 the run's page copies. 40 runs of 4 pages written one after the other held
    160 pages with ``queue_pages`` = 8; at the defaults (runs of up to 256 pages) that is up to
    16,384 pages (32 GiB of 2-MiB pages) where ``t2_host_bytes`` counted 1,024."""
    from sglang_tiered.tier.t2 import t2_host_bytes

    t2 = _tier()
    try:
        most = 0
        for r in range(40):
            _evict_into_t2(t2, [H(10 * r + i) for i in range(4)], 7)
            assert t2.wait_idle(10)
            most = max(most, _pages_held(t2))
        assert t2.stats.stored_pages >= 100
        assert most <= t2.cfg.queue_pages + t2.cfg.max_run_pages, f"{most} page copies held"
        staging = (3 * t2.cfg.max_run_pages + 1) * t2.obj_bytes
        assert most * LAYOUT.page_bytes <= t2_host_bytes(LAYOUT, t2.cfg) - staging
    finally:
        t2.close()


class GatedStore(ByteStore):
    """Puts wait for ``gate`` (a slow store, within the deadline)."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()

    def put(self, keys, ptrs, sizes):
        self.gate.wait(20)
        return super().put(keys, ptrs, sizes)


def test_host_bytes_count_the_victims_beside_a_full_queue():
    """``t2_host_bytes`` counted ``queue_pages`` copied pages; the victims copied out of T1 and not
    yet offered (up to a run, ``max_run_pages``) come on top of a full queue."""
    from sglang_tiered.tier.t2 import t2_host_bytes

    store = GatedStore()
    t2 = _tier(store, timeout_ms=30000)
    try:
        _evict_into_t2(t2, [H(i) for i in range(4)], 7)  # written (blocked in the store)
        _evict_into_t2(t2, [H(10 + i) for i in range(4)], 7)  # queued: the queue is full
        assert t2.queue.stats.queued_pages == t2.cfg.queue_pages
        assert not t2._victims
        with t2.lock:  # three more victims, not a run yet: held until the next flush
            for i in range(3):
                t2.on_victim(H(20 + i), i, 7)
        held = _pages_held(t2)
        assert held == t2.cfg.queue_pages + 3
        staging = (3 * t2.cfg.max_run_pages + 1) * t2.obj_bytes
        assert held * LAYOUT.page_bytes <= t2_host_bytes(LAYOUT, t2.cfg) - staging, f"{held} pages held"
    finally:
        store.gate.set()
        t2.close()


# ---------------------------------------------------------------------- 3. the start-up probe's objects
def test_the_start_up_probe_leaves_no_objects_in_the_store(tmp_path):
    """``measure_t2_gbps`` removed its probe objects right after reading them, which Mooncake
    refuses for the lease that read took: every server start left a run of objects (``max_run_pages``
    of this model's size: 256 x 2 MiB for an 8B model at the defaults) in the fleet's store."""
    import json
    import sys

    from tests.netns import run_in_netns
    from tests.test_t2 import _need_netns

    _need_netns()
    out = tmp_path / "r.json"
    r = run_in_netns([sys.executable, "-m", "tests.t2_review41_scenario", str(out)], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep == {"probe_left": 0, "refused_left": 0}, rep


def test_the_start_up_probe_has_a_deadline():
    """``measure_t2_gbps`` called the store directly: a master that accepts and does not answer
    (SIGSTOP) held the launch for as long as Mooncake's own RPCs wait. Now its put and get run
    with the tier's deadlines, and a missed one is a failed probe (T2 off, the launch goes on)."""
    import pytest

    from sglang_tiered.integration.t2_setup import measure_t2_gbps
    from tests.test_review39_t2 import HungStore

    store = HungStore()
    t2 = _tier(store, timeout_ms=50)
    box: dict = {}

    def probe():
        try:
            box["r"] = measure_t2_gbps(t2)
        except Exception as exc:  # noqa: BLE001
            box["e"] = exc

    th = threading.Thread(target=probe, daemon=True)
    t0 = time.monotonic()
    th.start()
    th.join(5)
    try:
        assert not th.is_alive(), "the start-up probe waited on a store that does not answer"
        assert time.monotonic() - t0 < 2 and isinstance(box.get("e"), RuntimeError), box
        with pytest.raises(RuntimeError):
            raise box["e"]
    finally:
        store.gate.set()
        th.join(5)
        t2.close()
