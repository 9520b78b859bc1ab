"""T1: host pool accounting, tier-state machine with KV checked against recomputation, faults."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from sglang_tiered.core.tenants import name_hash, tenant_of
from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache
from sglang_tiered.tier.host_pool import HostPool, PoolLayout, heads_for_rank

PAGE = 4
BLOCKS = [[b * 10 + i for i in range(PAGE)] for b in range(1, 8)]
TENANTS = [None, "acme"]


def tokens_of(blocks, tail=1):
    return [t for b in blocks for t in BLOCKS[b]] + [900 + i for i in range(tail)]


def test_heads_for_rank_matches_sglang_contiguous_sharding():
    # SGLang 0.5.23 linear.py: shard_id = kv_tp_rank // replicas; start = shard_id * shard_size
    from sglang.srt.layers.linear import QKVParallelLinear  # noqa: F401  (the code we mirror)

    assert [list(heads_for_rank(8, 4, r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [list(heads_for_rank(2, 4, r)) for r in range(4)] == [[0], [0], [1], [1]]  # replicated
    assert list(heads_for_rank(4, 1, 0)) == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        heads_for_rank(6, 4, 0)


def test_page_written_at_tp1_reads_back_at_tp2_and_back():
    """Canonical layout is TP-agnostic: a TP=1 rank's pages load into TP=2 ranks' views and vice versa."""
    from sglang_tiered.kernels.kv_pages import gather_pages, scatter_pages

    L, H, D, ps = 2, 4, 8, 4
    pool = HostPool(PoolLayout(6, L, H, ps, D, "float32"))
    dev1 = [torch.randn(5 * ps, H, D) for _ in range(L)]  # TP=1: all heads
    for layer in range(L):
        scatter_pages(dev1[layer], torch.tensor([2, 3]), pool.data[0, layer], torch.tensor([0, 1]), 0, ps)
    for r in range(2):  # TP=2 ranks read their own contiguous halves
        heads = heads_for_rank(H, 2, r)
        dev2 = torch.zeros(5 * ps, len(heads), D)
        gather_pages(pool.data[0, 1], torch.tensor([0, 1]), dev2, torch.tensor([1, 4]), heads.start, ps)
        assert torch.equal(dev2[ps : 2 * ps], dev1[1][2 * ps : 3 * ps, heads.start : heads.stop])
        assert torch.equal(dev2[4 * ps : 5 * ps], dev1[1][3 * ps : 4 * ps, heads.start : heads.stop])
        # ...and write back from the TP=2 view into another slot; TP=1 then reads the whole page.
        scatter_pages(dev2, torch.tensor([1]), pool.data[1, 0], torch.tensor([5]), heads.start, ps)
    back = torch.zeros(5 * ps, H, D)
    gather_pages(pool.data[1, 0], torch.tensor([5]), back, torch.tensor([0]), 0, ps)
    assert torch.equal(back[:ps], dev1[1][2 * ps : 3 * ps])


def test_shared_memory_pool_survives_reattach(tmp_path, monkeypatch):
    import sglang_tiered.tier.host_pool as hp

    monkeypatch.setattr(hp, "SHM_DIR", tmp_path)
    layout = PoolLayout(8, 1, 2, 4, 4, "float32")
    a = HostPool(layout, name="t")
    pairs = a.reserve([b"x" * 16, b"y" * 16])
    a.data[0, 0, :, pairs[0][1]] = 3.0
    a.commit(pairs)
    b = HostPool(layout, name="t")  # another process / a restart
    assert b.attached and b.leading_hits([b"x" * 16, b"y" * 16, b"z" * 16]) == 2
    assert torch.all(b.data[0, 0, :, b.slot_of[b"x" * 16]] == 3.0)
    b.check_invariants()
    c = HostPool(PoolLayout(8, 1, 2, 4, 8, "float32"), name="t")  # other layout: starts empty
    assert not c.attached and c.resident == 0
    c.close(unlink=True)


class TierMachine(RuleBasedStateMachine):
    """Page tier states (device, host, both, none) against a model of what was ever computed."""

    def __init__(self):
        super().__init__()
        self.cache = TieredRadixCache.create_simulated(12 * PAGE, PAGE, host_pages=10, verify_kv=True,
                                                      debug_checks=True)  # fmt: skip
        self.computed = {t: set() for t in TENANTS}  # page hashes ever stored, per tenant

    def _hashes(self, toks, tenant):
        from sglang_tiered.core.keys import chain_page_hashes

        return chain_page_hashes(self.cache.hashes.seed(None, tenant), toks, PAGE)

    @rule(blocks=st.lists(st.integers(0, len(BLOCKS) - 1), max_size=5), tenant=st.sampled_from(TENANTS))
    def request(self, blocks, tenant):
        toks = tokens_of(blocks)
        out = self.cache.driver.run(toks, tenant=tenant)  # the driver checks KV == recomputation
        if out.served:
            self.computed[tenant].update(self._hashes(toks, tenant))

    @rule(n=st.integers(1, 12 * PAGE))
    def evict(self, n):
        self.cache.evict(EvictParams(num_tokens=n))

    @rule(tenant=st.sampled_from(TENANTS))
    def invalidate(self, tenant):
        self.cache.invalidate(tenant_hash=name_hash(tenant_of(tenant)))
        gone = self.computed[tenant]
        assert not any(self.cache.host.pool.contains(h) for h in gone)
        self.computed[tenant] = set()

    @rule()
    @precondition(lambda self: self.cache.host.pool.resident)
    def fail_next_promotion(self):
        """A failed transfer must be a clean miss: arm a one-shot failure in the page mover."""
        import sglang_tiered.tier.host_tier as ht

        real = ht.move_pages_all

        def boom(*a, **k):
            if k.get("to_host"):  # a demotion: not this failure
                return real(*a, **k)
            ht.move_pages_all = real
            raise RuntimeError("injected transfer failure")

        ht.move_pages_all = boom

    @invariant()
    def tier_states_are_consistent(self):
        host = self.cache.host.pool
        host.check_invariants()
        avail, evictable, protected, total = self.cache.driver.device_accounting()
        assert avail + evictable + protected == total
        every = set().union(*self.computed.values())
        device = set()
        stack = list(self.cache.root_node.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            device.update(n.tiered_hashes or [])
        # Each page is in {device, host, both, none}; a page in any tier was computed before.
        assert device <= every and set(host.slot_of) <= every

    def teardown(self):
        import sglang_tiered.tier.host_tier as ht
        from sglang_tiered.kernels.kv_pages import move_pages_all

        ht.move_pages_all = move_pages_all


TierMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestTiers = TierMachine.TestCase


class TierQueueMachine(TierMachine):
    """The same, with T1 written through the store queue (write-through into free room, write-ahead
    of the eviction order at batch ends, drained between batches as a worker would)."""

    def __init__(self):
        RuleBasedStateMachine.__init__(self)
        self.cache = TieredRadixCache.create_simulated(12 * PAGE, PAGE, host_pages=10, verify_kv=True,
                                                      debug_checks=True, store_queue_pages=8)  # fmt: skip
        self.computed = {t: set() for t in TENANTS}


TierQueueMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)
TestTiersQueue = TierQueueMachine.TestCase


def test_full_t1_gets_victims_written_ahead_not_duplicates_of_admitted_pages():
    """Once T1 is full, admitted pages are not written through (a copy of a page still on the
    device would push a real victim out); the pages the eviction order takes next are written at
    batch ends instead, so only the first eviction copies inline. T1 ends up holding every victim
    the synchronous store gives it, and serves the same hits (KV checked against recomputation)."""
    runs = [[0, 1], [2, 3], [4, 5], [6, 0], [1, 2], [3, 4], [5, 6], [0, 1], [2, 3]]
    got = {}
    for q in (0, 16):
        cache = TieredRadixCache.create_simulated(8 * PAGE, PAGE, host_pages=32, store_queue_pages=q,
                                                  verify_kv=True, debug_checks=True)  # fmt: skip
        pool = cache.host.pool
        old = [bytes([i]) * 16 for i in range(32)]
        pool.commit(pool.reserve(old))  # T1 full of older entries
        cached = [cache.driver.run(tokens_of(b), tenant=None).cached_len for b in runs]
        got[q] = (cached, set(pool.slot_of) - set(old), cache.t1.snapshot())
    (sync_hits, sync_t1, _), (queue_hits, queue_t1, snap) = got[0], got[16]
    assert queue_hits == sync_hits and sum(queue_hits) > 0
    assert sync_t1 == queue_t1
    assert snap["through_offered_pages"] == 0 and snap["ahead_offered_pages"] > 0
    first_batch = 2  # pages the first eviction took: nothing predicted them yet
    assert snap["inline_pages"] == first_batch and snap["stored_pages"] >= snap["demotions"] - first_batch


@pytest.mark.parametrize("seed", range(12))
def test_queue_t1_holds_what_sync_t1_holds_in_the_same_order(seed):
    """The store queue changes when T1 is written, never what it holds: on generated workloads
    (``dev/workload_family.py``: tenants, shared prefixes, documents, conversations, agents,
    scans, phase changes) and device / T1 / queue sizes drawn per seed, after every request the
    queue's T1 (its write-through copies not yet used aside) holds exactly the synchronous
    store's pages in the same LRU order, and every request gets the same hit. Write-through
    copies fill free room only, write-ahead copies go to the staging slots, and an eviction
    adopts either as the synchronous store would copy it (``HostPool.reserve``)."""
    import random

    from sglang_tiered.dev.workload_family import draw, generate

    ps = 16
    rng = random.Random(seed)
    dev = rng.choice([48, 96, 200])
    t1, q = rng.choice([dev // 2, dev, 3 * dev]), rng.choice([16, 64, 256])
    reqs = [r for r in generate(draw(seed, n_requests=(150, 150), token_scale=0.05)) if len(r.tokens) <= dev * ps // 2]
    sync, queue = (TieredRadixCache.create_simulated(dev * ps, ps, host_pages=t1, store_queue_pages=n)
                   for n in (0, q))  # fmt: skip

    def t1_pages(pool):
        return [pool._hashes_np[s].tobytes() for s in pool.lru if s not in pool.cold]

    for i, r in enumerate(reqs):
        a = sync.driver.run(list(r.tokens), tenant=r.tenant).cached_len
        b = queue.driver.run(list(r.tokens), tenant=r.tenant).cached_len
        assert a == b, f"request {i}: hit {b} with the queue, {a} synchronous"
        assert t1_pages(queue.host.pool) == t1_pages(sync.host.pool), f"request {i}: T1 differs"
    snap, base = queue.t1.snapshot(), sync.t1.snapshot()
    assert snap["inline_pages"] <= base["demotions"]  # copies on the request path: never more than sync's
    queue.check_invariants()


def test_full_t1_skips_and_counts_demotions():
    cache = TieredRadixCache.create_simulated(8 * PAGE, PAGE, host_pages=2, verify_kv=True)
    cache.host.replace_when_full = False
    for b in range(6):
        cache.driver.run(tokens_of([b, (b + 1) % 7]), tenant=None)
    cache.evict(EvictParams(num_tokens=8 * PAGE))
    s = cache.host.snapshot()
    assert s["resident_pages"] == 2 and s["demote_skipped_pages"] > 0
    cache.host.pool.check_invariants()


@pytest.mark.parametrize("pressure", [False, True])
def test_queue_victim_not_in_t1_is_copied_like_sync_unless_under_pressure(monkeypatch, pressure):
    """With the store queue, T1 gets every victim the synchronous store would: a one-shot whose
    write-through copy T1 no longer holds is copied when the device evicts it, except while the
    queue is under pressure (then the queue's own rule holds: one-shots take no slot)."""
    from sglang_tiered.core.store_queue import StoreQueue

    cache = TieredRadixCache.create_simulated(8 * PAGE, PAGE, host_pages=32, store_queue_pages=16, verify_kv=True)
    toks = tokens_of([1, 2])
    cache.driver.run(toks, tenant=None)  # a one-shot: written through after the request
    hashes = [h for n in cache.evictable_leaves for h in n.tiered_hashes]
    assert hashes and all(cache.host.pool.contains(h) for h in hashes)
    cache.host.pool.drop(hashes)  # T1 replaced the copy while the pages were still on the device
    monkeypatch.setattr(StoreQueue, "under_pressure", property(lambda q: pressure))
    cache.evict(EvictParams(num_tokens=8 * PAGE))
    held = [cache.host.pool.contains(h) for h in hashes]
    assert held == [not pressure] * len(hashes)
    if not pressure:  # and the copy is served as a hit equal to recomputation
        assert cache.driver.run(toks, tenant=None).cached_len == 2 * PAGE
    cache.check_invariants()


@pytest.mark.parametrize("store_queue_pages", [0, 16])
def test_pages_another_request_promoted_meanwhile_are_used_not_recomputed(store_queue_pages):
    """Two requests of one batch probe the same T1 run; the first promotes it. The second's
    load-back finds the whole run on the device: it uses those pages (a full hit, KV equal to
    recomputation) instead of recomputing them."""
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sglang_tiered.dev.simulate import SimReq, expected_kv

    cache = TieredRadixCache.create_simulated(8 * PAGE, PAGE, host_pages=32, store_queue_pages=store_queue_pages,
                                              verify_kv=True)  # fmt: skip
    toks = tokens_of([1, 2, 3])
    cache.driver.run(toks, tenant="acme")
    cache.evict(EvictParams(num_tokens=8 * PAGE))  # the run now lives in T1 only
    second = SimReq("second", toks, cache_salt="acme")
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(toks, None, cache_salt="acme"), req=second))
    assert m.device_prefix_len == 0 and m.host_hit_length == 3 * PAGE
    assert cache.driver.run(toks, tenant="acme").cached_len == 3 * PAGE  # the first request promotes it
    loaded, last = cache.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node,
                                                           host_hit_length=m.host_hit_length, req=second))  # fmt: skip
    assert loaded == 3 * PAGE and last is not m.best_match_node
    slots = cache.path_device_indices(last)
    kv = cache.driver.allocator.get_kvcache()
    want = expected_kv(toks, ("acme", None), len(kv.k_buffer), kv.head_num, kv.head_dim)
    for layer in range(len(kv.k_buffer)):
        assert torch.equal(kv.k_buffer[layer][slots], want[: 3 * PAGE, layer, 0])
    from sglang_tiered.stats import aggregate

    stats = aggregate([cache.stats_snapshot()])  # what GET /cache/stats answers
    assert next(t for t in stats.tiers if t.name == "host").already_on_device_tokens == 3 * PAGE
    cache.flush_pending_backups()  # the batch ran: the hold on the node is released
    cache.check_invariants()


def test_failed_promotion_is_a_clean_miss(monkeypatch):
    import sglang_tiered.tier.host_tier as ht

    cache = TieredRadixCache.create_simulated(4 * PAGE, PAGE, host_pages=16, verify_kv=True)
    toks = tokens_of([0, 1, 2])
    cache.driver.run(toks)
    cache.evict(EvictParams(num_tokens=4 * PAGE))  # demote everything
    assert cache.host.pool.resident == 3

    import sglang_tiered.kernels.kv_pages as kv

    real, calls = kv.gather_pages, []

    def boom(*a, **k):  # the second plane fails: the first was already written (partial KV)
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return real(*a, **k)

    monkeypatch.setattr(kv, "gather_pages", boom)
    assert ht.move_pages_all.__module__ == kv.__name__
    out = cache.driver.run(toks)  # KV verified inside: recomputed, never partial
    assert out.cached_len == 0 and cache.host.stats.failed_promotions == 1
    monkeypatch.undo()
    cache.evict(EvictParams(num_tokens=4 * PAGE))
    assert cache.driver.run(toks).cached_len == 3 * PAGE  # and T1 still serves later


def test_host_allocation_failure_disables_t1_with_one_warning(caplog):
    from sglang_tiered.config import TieredConfig
    from sglang_tiered.integration.host_setup import build_host_tier

    cache = TieredRadixCache.create_simulated(8 * PAGE, PAGE, verify_kv=True)
    ctx = SimpleNamespace(model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 2), tp_size=1,
                          tp_rank=0, params=SimpleNamespace())  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="sglang_tiered"):
        tier, decision = build_host_tier(cache, ctx, TieredConfig(host_mode="on", host_gb=9e5))  # 900 TB: more than any address space
    assert tier is None and decision.startswith("off:")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "T1 disabled" in warnings[0].getMessage()


@pytest.mark.parametrize("seed", [0, 1])
def test_threaded_store_queue_serves_only_recomputed_kv(seed):
    """The store queue with its worker thread (the CUDA path's structure, here copying on CPU,
    slowed down so that copies overlap the requests): write-through, write-ahead into staging,
    adoption at eviction, fences before device pages are reused. Every hit is checked against
    recomputation (``verify_kv``), and the invariants hold at the end."""
    import time

    from sglang_tiered.dev.workload_family import draw, generate
    from sglang_tiered.integration.t1 import make_store_queue

    ps = 16
    cache = TieredRadixCache.create_simulated(64 * ps, ps, host_pages=96, store_queue_pages=32, verify_kv=True,
                                              debug_checks=True)  # fmt: skip
    cache.t1.store.close()
    store = cache.t1.store = make_store_queue(cache.host, 32, threaded=True)
    write = store._write

    def slow(job):
        time.sleep(0.001)
        write(job)

    store._write = slow
    reqs = [r for r in generate(draw(seed, n_requests=(120, 120), token_scale=0.05)) if len(r.tokens) <= 32 * ps]
    hits = sum(cache.driver.run(list(r.tokens), tenant=r.tenant).cached_len for r in reqs)
    store.close(drain=True)
    snap = cache.t1.snapshot()
    assert hits > 0 and snap["stored_pages"] > 0 and snap["staged_used_pages"] > 0
    cache.check_invariants()


def test_staging_size():
    """Staging slots: none with the synchronous store; with the queue a sixteenth of T1 (at least
    64 pages), at most the queue's bound and a quarter of T1."""
    from sglang_tiered.integration.host_setup import staging_pages

    cfg = lambda store="async", q=None: SimpleNamespace(store=store, store_queue_pages=q)  # noqa: E731
    assert staging_pages(cfg("sync"), 1000, 8000) == 0
    assert staging_pages(cfg(), 1000, 8000) == 500  # T1 / 16
    assert staging_pages(cfg(), 1000, 800) == 64  # at least 64 pages
    assert staging_pages(cfg(q=32), 1000, 8000) == 32  # the queue's bound
    assert staging_pages(cfg(), 1000, 100) == 25  # a quarter of a small T1
