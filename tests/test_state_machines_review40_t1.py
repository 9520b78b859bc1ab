"""Hypothesis state machine (review, session 40): T1 with its store queue *not* drained between
batches, so every other operation meets writes still queued, against a model of what each page
hash's KV is (``dev/simulate.py``'s recomputation).

In ``tests/test_tier.py``'s machines the simulated queue drains after every batch, so no rule
ever ran with a write pending: an invalidation, an eviction, a failed copy or a promotion while
a write of the same pages waits was never exercised. Here the worker runs only when a rule says
so (one job, or all), and copies can fail mid-write (garbage in the slots, then an exception).

  Q1 every T1 page, resident or staged, holds exactly the KV of its page hash, in every
     (K|V, layer, head) plane: a failed or cancelled copy never leaves a published entry whose
     bytes differ from its hash (and every hit the driver serves equals recomputation);
  Q2 every pending write is (device page, hash) of a page of the tree, as the tree has it now;
  Q3 after a tenant's invalidation none of its pages computed before it reaches T1, whatever the
     queue held then (until a request computes the page again);
  Q4 the cache's, the host pool's and the queue's own checkers hold (``check_invariants``).
"""

from __future__ import annotations

import os

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from sglang_tiered.core.keys import chain_page_hashes
from sglang_tiered.core.store_queue import StoreQueue
from sglang_tiered.core.tenants import name_hash, tenant_of
from sglang_tiered.dev.simulate import expected_kv
from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

settings.register_profile("review40", max_examples=60, stateful_step_count=40, deadline=None)
settings.register_profile("review40-deep", max_examples=600, stateful_step_count=60, deadline=None)
PROFILE = settings.get_profile(os.environ.get("REVIEW40_PROFILE", "review40"))

PAGE = 2
BLOCKS = [[b * 10 + i for i in range(PAGE)] for b in range(1, 8)]
TENANTS = [None, "acme"]


def tokens_of(blocks):
    return [t for b in blocks for t in BLOCKS[b]] + [900]


class T1PendingMachine(RuleBasedStateMachine):
    HOST_PAGES, QUEUE_PAGES = 8, 6

    def __init__(self):
        super().__init__()
        self.cache = TieredRadixCache.create_simulated(10 * PAGE, PAGE, host_pages=self.HOST_PAGES, verify_kv=True,
                                                      debug_checks=True, store_queue_pages=self.QUEUE_PAGES)  # fmt: skip
        self.store = self.cache.t1.store
        self.store.drain = lambda: None  # batch ends leave the writes queued; the rules run them
        self.kv_of: dict = {}  # page hash -> its KV in T1's layout [2, L, H, ps, D]
        self.gone: set = set()  # hashes invalidated and not computed again since
        self.n = 0
        self.tenant_of_hash: dict = {}  # page hash -> the tier tag of the tenant that computed it
        kv = self.cache.driver.allocator.get_kvcache()
        self.dims = (len(kv.k_buffer), kv.head_num, kv.head_dim)

    def _record(self, toks, tenant):
        hashes = chain_page_hashes(self.cache.hashes.seed(None, tenant), toks, PAGE)
        want = expected_kv(toks, (tenant, None), *self.dims)  # [n, L, 2, H, D]
        for i, h in enumerate(hashes):
            self.kv_of[h] = want[i * PAGE : (i + 1) * PAGE].permute(2, 1, 3, 0, 4)
            self.tenant_of_hash[h] = name_hash(tenant_of(tenant))
            self.gone.discard(h)
        return hashes

    @rule(blocks=st.lists(st.integers(0, len(BLOCKS) - 1), min_size=1, max_size=4), tenant=st.sampled_from(TENANTS))
    def request(self, blocks, tenant):
        toks = tokens_of(blocks)
        out = self.cache.driver.run(toks, tenant=tenant)  # a hit is checked against recomputation
        if out.served:
            self._record(toks, tenant)

    @rule(n=st.integers(1, 10 * PAGE))
    def evict(self, n):
        self.cache.evict(EvictParams(num_tokens=n))

    @rule(blocks=st.lists(st.integers(0, len(BLOCKS) - 1), min_size=1, max_size=4), tenant=st.sampled_from(TENANTS))
    def load_back_whose_batch_never_runs(self, blocks, tenant):
        """The scheduler's match and load-back of a request that is then not run (its promoted
        node stays locked until the next batch end or flush)."""
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        from sglang_tiered.dev.simulate import SimReq

        cache = self.cache
        self.n += 1
        req = SimReq(f"never-{self.n}", tokens_of(blocks), cache_salt=tenant)
        m = cache.match_prefix(MatchPrefixParams(key=RadixKey(req.origin_input_ids, None, cache_salt=tenant), req=req))
        if m.host_hit_length:
            lock = cache.lock(m.last_device_node)
            loaded = cache.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node,
                                                             host_hit_length=m.host_hit_length, req=req))  # fmt: skip
            cache.unlock(lock)
            if loaded and loaded[0]:  # the promoted pages hold their hashes' KV
                kv = cache.driver.allocator.get_kvcache()
                slots = cache.path_device_indices(loaded[1])
                want = expected_kv(req.origin_input_ids, (tenant, None), *self.dims)[: len(slots)]
                for layer in range(self.dims[0]):
                    assert torch.equal(kv.k_buffer[layer][slots], want[:, layer, 0])
                    assert torch.equal(kv.v_buffer[layer][slots], want[:, layer, 1])
        cache.t1.forget(req.rid)

    @rule()
    def flush(self):
        """``/flush_cache``: the tree is emptied (to T1 first), then SGLang clears the allocator."""
        self.cache.reset()
        alloc = self.cache.driver.allocator
        alloc.free_pages = list(range(alloc.num_pages, 0, -1))

    @precondition(lambda self: self.store.pending)
    @rule()
    def worker_runs_one(self):
        with self.store._cv:
            job = self.store._next()
        if job is not None:
            self.store._execute(job)

    @rule()
    def worker_drains(self):
        StoreQueue.drain(self.store)

    @rule(tenant=st.sampled_from(TENANTS))
    def invalidate(self, tenant):
        th = name_hash(tenant_of(tenant))
        self.cache.invalidate(tenant_hash=th)
        pool = self.cache.host.pool
        mine = {h for h, s in list(pool.slot_of.items()) + list(pool.staged.items()) if pool._tenant_of.get(s) == th}
        assert not mine, "T1 keeps pages of an invalidated tenant"
        self.gone |= {h for h in self.kv_of if self.tenant_of_hash[h] == th}

    @rule(when=st.sampled_from(["demotion", "promotion"]))
    def fail_next_copy(self, when):
        """Arm a one-shot failure of the next copy in one direction: the destination slots (T1's
        for a demotion, the device's for a promotion) get garbage first, then it raises."""
        import sglang_tiered.tier.host_tier as ht
        from sglang_tiered.kernels.kv_pages import move_pages_all as real

        def boom(planes, host, pool_pages, host_slots, head_offset, page_size, *, to_host, **k):
            if to_host != (when == "demotion"):
                return real(planes, host, pool_pages, host_slots, head_offset, page_size, to_host=to_host, **k)
            ht.move_pages_all = real
            if to_host:
                host[:, :, :, host_slots] = -1.0
            else:
                for buf in planes.k + planes.v:
                    for p in pool_pages.tolist():
                        buf[p * page_size : (p + 1) * page_size] = -1.0
            raise RuntimeError("injected transfer failure")

        ht.move_pages_all = boom

    @invariant()
    def t1_bytes_match_hashes(self):
        pool = self.cache.host.pool
        for h, s in list(pool.slot_of.items()) + list(pool.staged.items()):
            assert h in self.kv_of, "T1 holds a page no request computed"
            assert torch.equal(pool.data[:, :, :, s], self.kv_of[h]), "a T1 entry's bytes differ from its hash's KV"
            assert h not in self.gone, "an invalidated page reached T1"

    @invariant()
    def pending_writes_are_tree_pages(self):
        want = {}
        stack = list(self.cache.root_node.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            want.update(zip(self.cache.t1._page_ids(n), n.tiered_hashes))
        with self.store._cv:
            jobs = {id(j): j for j in self.store._page_job.values()}.values()
            for j in jobs:
                for p, h in zip(j.pages, j.hashes):
                    assert want.get(p) == h, "a pending write names a page the tree holds no longer (or another)"

    @invariant()
    def checkers(self):
        self.cache.check_invariants()

    def teardown(self):
        import sglang_tiered.tier.host_tier as ht
        from sglang_tiered.kernels.kv_pages import move_pages_all

        ht.move_pages_all = move_pages_all


TestT1PendingMachine = T1PendingMachine.TestCase
TestT1PendingMachine.settings = PROFILE


class T1PendingSmallMachine(T1PendingMachine):
    """The same with T1 smaller than a load-back's victims: the demotions a promotion's
    allocation makes push T1's pages out, the very pages being promoted among them."""

    HOST_PAGES, QUEUE_PAGES = 3, 2


TestT1PendingSmallMachine = T1PendingSmallMachine.TestCase
TestT1PendingSmallMachine.settings = PROFILE


def test_flush_does_the_queued_writes_of_nodes_it_cannot_evict():
    """Review, session 40: ``/flush_cache`` demotes what it can evict, but a node locked by a
    load-back whose batch never ran stays until ``super().reset()`` frees the whole pool. A
    write-through of that node's pages still queued then copied the pages' next contents into T1
    under the old hashes, and T1 served them (the driver checks every hit against recomputation)."""
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sglang_tiered.dev.simulate import SimReq

    cache = TieredRadixCache.create_simulated(12 * PAGE, PAGE, host_pages=16, verify_kv=True, store_queue_pages=8)
    store, pool = cache.t1.store, cache.host.pool
    store.drain = lambda: None  # the worker has not reached the writes yet
    cache.driver.run(tokens_of([1, 2, 3]))
    StoreQueue.drain(store)
    cache.evict(EvictParams(num_tokens=10**6))  # all three pages in T1 only
    hashes = chain_page_hashes(cache.hashes.seed(None, None), tokens_of([1, 2, 3]), PAGE)
    pool.drop(hashes[:2])  # T1 let the first two go
    cache.driver.run(tokens_of([1, 2]))  # computed again: its write-through is queued
    assert store.pending
    req = SimReq("b", tokens_of([1, 2, 3]))
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(req.origin_input_ids, None), req=req))
    assert m.device_prefix_len == 2 * PAGE and m.host_hit_length == PAGE
    lock = cache.lock(m.last_device_node)
    loaded = cache.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node,
                                                     host_hit_length=m.host_hit_length, req=req))  # fmt: skip
    cache.unlock(lock)
    assert loaded[0] == PAGE and cache.t1.load_locks  # loaded back; its batch never runs
    cache.reset()  # /flush_cache ...
    alloc = cache.driver.allocator
    alloc.free_pages = list(range(alloc.num_pages, 0, -1))  # ... and SGLang clears the allocator
    assert not store.pending
    cache.check_invariants()
    cache.driver.run(tokens_of([5, 6]))  # the freed pages hold other KV now
    StoreQueue.drain(store)
    assert all(pool.contains(h) for h in hashes)  # the flush wrote the node's pages to T1
    assert cache.driver.run(tokens_of([1, 2, 3])).cached_len == 3 * PAGE  # and they equal recomputation
    cache.check_invariants()


from tests.test_store_queue import StoreQueueMachine  # noqa: E402


class FailingStoreQueueMachine(StoreQueueMachine):
    """``tests/test_store_queue.py``'s machine with writes that raise (the worker's, and a fence's
    inline one): a failed write leaves the queue like a finished one (its pages no longer pending,
    the depth down by its pages), writes nothing, and counts its pages as failed."""

    def _failing(self, fn):
        real = self.q._write

        def boom(job):
            raise RuntimeError("injected store failure")

        self.q._write = boom
        try:
            return fn()
        finally:
            self.q._write = real

    @precondition(lambda self: self.model)
    @rule()
    def worker_fails_one(self):
        failed = self.q.stats.failed_pages
        job = self.q._next()
        self._failing(lambda: self.q._execute(job))
        top = min(self.model, key=lambda j: (-j[1], j[0]))
        self.model.remove(top)
        assert self.q.stats.failed_pages == failed + len(top[2]) and job.pages == top[2]

    @rule(pages=st.lists(st.integers(0, 30), max_size=6, unique=True))
    def fence_whose_inline_write_fails(self, pages):
        self._failing(lambda: self.q.fence(pages, run=True))
        for j in self.model:
            j[2], j[3] = [p for p in j[2] if p not in pages], [h for p, h in zip(j[2], j[3]) if p not in pages]
        self.model = [j for j in self.model if j[2]]


TestFailingStoreQueueMachine = FailingStoreQueueMachine.TestCase
TestFailingStoreQueueMachine.settings = PROFILE
