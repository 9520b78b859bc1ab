"""Less-travelled paths in flight together (a helper's live soak, session 40): a request retracted
at decode (released unfinished, without a checkpoint, and admitted again as the same ``Req``), one
aborted while it waited (matched, then ``release_aborted_request``), T1 persisted under load
(``sglang_tiered_persist_to_host``), the idle flush, a match capped by prompt logprobs, under the
budget and leader guarantees (the adaptive order under concurrency), with invalidations between.
Every hit is checked against recomputation (``verify_kv``) and every invariant after each step."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from sglang_tiered.core.policy import PolicyConfig
from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

PAGE = 4
TENANTS = [None, "acme", "globex"]
BLOCKS = [[b * 10 + i for i in range(PAGE)] for b in range(1, 7)]
prompt_st = st.tuples(st.lists(st.integers(0, len(BLOCKS) - 1), min_size=1, max_size=6), st.integers(0, PAGE - 1))


def tokens_of(spec) -> list[int]:
    blocks, tail = spec
    return [t for b in blocks for t in BLOCKS[b]] + [900 + i for i in range(tail)]


def admit(driver, req, max_prefix_len=None):
    """``CacheDriver.begin`` for a given ``Req`` (a retracted one admitted again keeps its rid and
    its flags, as SGLang's ``reset_for_retract`` keeps the object): None when it cannot fit."""
    import torch
    from sglang.srt.managers.schedule_batch import ReqKvInfo
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams

    from sglang_tiered.dev.simulate import InFlight

    cache, alloc = driver.cache, driver.allocator
    req.kv, req.last_node, req.lock = ReqKvInfo(), None, None
    n = len(req.origin_input_ids)
    key = RadixKey(req.origin_input_ids, req.extra_key, cache_salt=req.cache_salt, limit=max_prefix_len)
    m = cache.match_prefix(MatchPrefixParams(key=key, req=req))
    prefix_len, req.last_node = m.device_prefix_len, m.last_device_node
    if m.host_hit_length > 0:
        loaded = cache.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node,
                                                         host_hit_length=m.host_hit_length, req=req))  # fmt: skip
        if loaded is not None and loaded[0]:
            assert loaded[0] == m.host_hit_length, "partial load-back"
            prefix_len += loaded[0]
            req.last_node = loaded[1]
    req.lock = cache.lock(req.last_node)
    prefix_idx = cache.path_device_indices(req.last_node) if prefix_len else None
    need = n - prefix_len
    if need > alloc.available_size() + cache.evictable_size():
        cache.unlock(req.lock)
        req.lock = None
        return None
    if need > alloc.available_size():
        cache.evict(EvictParams(num_tokens=need - alloc.available_size()))
    new_idx = alloc.alloc(need) if need else torch.empty(0, dtype=torch.int64)
    row = driver.req_pool.alloc_row()
    req.kv.req_pool_idx = row
    rt = driver.req_pool.req_to_token
    if prefix_len:
        rt[row, :prefix_len] = prefix_idx
    rt[row, prefix_len:n] = new_idx
    req.kv.cache_protected_len = prefix_len
    req.kv.kv_allocated_len = n
    if driver.verify_kv:
        driver._forward(req, rt[row, :n], prefix_len)
    return InFlight(req, row, n, prefix_len, 0.0)


class SoakPathsMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = None
        self.flying: list = []  # [InFlight, tokens done]
        self.retracted: list = []  # Reqs released unfinished, waiting to be admitted again
        self._n = 0

    @rule(guarantee=st.sampled_from(["budget", "leader", "strict"]), host=st.sampled_from([0, 6, 16, 64]),
          queue=st.booleans(), batch=st.sampled_from([1, 4]), pages=st.sampled_from([12, 40]))  # fmt: skip
    @precondition(lambda self: self.cache is None)
    def build(self, guarantee, host, queue, batch, pages):
        guard = {"budget": {"guard_div_cap": False}, "leader": {"guard_leader": 0.999, "guard_div_cap": False},
                 "strict": {}}[guarantee]  # (config.policy_config)
        self.cache = TieredRadixCache.create_simulated(
            pages * PAGE, PAGE, PolicyConfig(pin_min_freq=3, pin_max_tokens=2 * PAGE, **guard),
            debug_checks=True, verify_kv=True, host_pages=host, store_queue_pages=16 if host and queue else 0,
            max_in_flight=batch,
        )  # fmt: skip

    def _rid(self) -> str:
        self._n += 1
        return f"soak-{self._n}"

    @rule(spec=prompt_st, tenant=st.sampled_from(TENANTS), cap=st.sampled_from([None, None, 0, 1, 5]))
    @precondition(lambda self: self.cache is not None and len(self.flying) < 4)
    def begin(self, spec, tenant, cap):
        from sglang_tiered.dev.simulate import SimReq

        toks = tokens_of(spec)
        limit = None if cap is None else min(cap * PAGE, len(toks))  # prompt logprobs cap the match
        req = SimReq(self._rid(), toks, cache_salt=tenant)
        f = admit(self.cache.driver, req, limit)
        if f is None:
            self.cache.release_aborted_request(CacheRequestHandle(rid=req.rid, attempt_id=0))
            return
        assert f.prefix_len % PAGE == 0 and f.prefix_len <= len(toks)
        assert limit is None or f.prefix_len <= max(limit, 0) or f.prefix_len == 0, (f.prefix_len, limit)
        self.flying.append([f, f.prefix_len])

    @rule(data=st.data())
    @precondition(lambda self: self.cache is not None and self.retracted and len(self.flying) < 4)
    def readmit(self, data):
        req = self.retracted.pop(data.draw(st.integers(0, len(self.retracted) - 1)))
        f = admit(self.cache.driver, req)
        if f is None:
            self.retracted.append(req)
            return
        self.flying.append([f, f.prefix_len])

    @rule(spec=prompt_st, tenant=st.sampled_from(TENANTS))
    @precondition(lambda self: self.cache is not None)
    def abort_waiting(self, spec, tenant):
        """Matched (and probed in T1) while waiting, then aborted: never released."""
        from sglang_tiered.dev.simulate import SimReq

        req = SimReq(self._rid(), tokens_of(spec), cache_salt=tenant)
        self.cache.match_prefix(MatchPrefixParams(key=RadixKey(req.origin_input_ids, None, cache_salt=tenant), req=req))
        self.cache.release_aborted_request(CacheRequestHandle(rid=req.rid, attempt_id=0))

    @rule(data=st.data(), chunk=st.integers(1, 3 * PAGE))
    @precondition(lambda self: any(d < f.n for f, d in self.flying))
    def chunk(self, data, chunk):
        todo = [x for x in self.flying if x[1] < x[0].n]
        x = todo[data.draw(st.integers(0, len(todo) - 1))]
        x[1] = min(x[1] + chunk, x[0].n)
        if x[1] < x[0].n:
            self.cache.driver.checkpoint_chunk(x[0], x[1])

    @rule(data=st.data())
    @precondition(lambda self: self.flying)
    def end(self, data):
        f, _ = self.flying.pop(data.draw(st.integers(0, len(self.flying) - 1)))
        out = self.cache.driver.end(f)
        assert out.served

    @rule(data=st.data())
    @precondition(lambda self: self.flying)
    def retract(self, data):
        """``release_req`` at decode: ``release_kv_cache(checkpoint=False)``, then the batch ends."""
        f, _ = self.flying.pop(data.draw(st.integers(0, len(self.flying) - 1)))
        cache, req, driver = self.cache, f.req, self.cache.driver
        cpl = req.kv.cache_protected_len
        row = driver.req_pool.req_to_token[f.row]
        if cpl < f.n:
            driver.allocator.free_segment(row[cpl:f.n], start_pos=cpl)
        cache.unlock(req.lock)
        req.lock = None
        cache.on_release(req, checkpointed=False)
        driver.req_pool.free_row(f.row)
        cache.flush_pending_backups()
        self.retracted.append(req)

    @rule()
    @precondition(lambda self: self.cache is not None)
    def persist(self):
        self.cache.persist_to_host()

    @rule()
    @precondition(lambda self: self.cache is not None and not self.flying)
    def flush(self):
        """``Scheduler.flush_cache``: the tree's reset, then the pool cleared."""
        self.cache.reset()
        alloc = self.cache.driver.allocator
        alloc.free_pages = list(range(alloc.num_pages, 0, -1))

    @rule(tenant=st.sampled_from(TENANTS + ["__all__"]))
    @precondition(lambda self: self.cache is not None)
    def invalidate(self, tenant):
        from sglang_tiered.core.tenants import name_hash, tenant_of

        if tenant == "__all__":
            self.cache.invalidate(everything=True)
        else:
            self.cache.invalidate(tenant_hash=name_hash(tenant_of(tenant)))

    @rule()
    @precondition(lambda self: self.cache is not None)
    def batch_end(self):
        self.cache.flush_pending_backups()

    @invariant()
    def accounting(self):
        if self.cache is None:
            return
        avail, evictable, protected, total = self.cache.driver.device_accounting()
        owned = sum(-(-(f.n - f.req.kv.cache_protected_len) // PAGE) * PAGE for f, _ in self.flying)
        assert avail + evictable + protected + owned == total, (avail, evictable, protected, owned, total)
        for f, _ in self.flying:
            assert f.req.last_node is self.cache.root_node or f.req.last_node.lock_ref > 0
        self.cache.check_invariants()

    def teardown(self):
        if self.cache is None:
            return
        while self.flying:
            f, _ = self.flying.pop()
            self.cache.driver.end(f)
        self.cache.flush_pending_backups()
        self.cache.check_invariants()
        assert self.cache.protected_size() == 0
        avail, evictable, protected, total = self.cache.driver.device_accounting()
        assert avail + evictable == total


SoakPathsMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestSoakPaths = SoakPathsMachine.TestCase
