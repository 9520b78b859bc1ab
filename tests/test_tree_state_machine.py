"""Hypothesis state machine: TieredRadixCache (real SGLang tree code underneath) against a simple
model, through match, insert with admission refusals, lock, unlock and evict."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from sglang_tiered.core.policy import PolicyConfig
from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

PAGE = 4
CAPACITY = 24 * PAGE
TENANTS = [None, "acme", "globex"]

# Prompts built from a few shared "blocks" so prefixes overlap often.
BLOCKS = [[b * 10 + i for i in range(PAGE)] for b in range(1, 7)]
prompt_st = st.tuples(
    st.lists(st.integers(0, len(BLOCKS) - 1), min_size=0, max_size=6),
    st.integers(0, PAGE - 1),  # a partial tail page
)


def tokens_of(spec) -> list[int]:
    blocks, tail = spec
    toks = [t for b in blocks for t in BLOCKS[b]]
    return toks + [900 + i for i in range(tail)]


class TreeMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.mode = None
        self.cache = None
        self.inserted: dict = {t: [] for t in TENANTS}  # model: sequences stored per tenant
        self.held = []  # (lock, node, tenant, tokens, prefix_len, indices)

    @rule(mode=st.sampled_from(["all+lru", "tinylfu+lru", "all+slru", "tinylfu+slru", "all+lfu", "tinylfu+lfu",
                               "tinylfu+adaptive", None]),
          cap=st.booleans(),  # the strict default's divergence cap, or the budget mode (no cap)
          shadows=st.sampled_from(["tree", "lru-tree", "pages"]))  # the shadows of a small, mid, big cache
    @precondition(lambda self: self.cache is None)
    def build(self, mode, cap, shadows):
        sizes = {"tree": {}, "lru-tree": {"tree_shadow_pages": 0, "shadow_pages": 8},
                 "pages": {"tree_shadow_pages": 0, "lru_tree_pages": 0, "shadow_pages": 8}}[shadows]
        self.cache = TieredRadixCache.create_simulated(
            CAPACITY, PAGE,
            PolicyConfig(force_mode=mode, pin_min_freq=3, pin_max_tokens=2 * PAGE, guard_div_cap=cap, **sizes),
            debug_checks=True,
        )  # fmt: skip
        assert self.cache.policy.snapshot()["shadow_kind"] == shadows

    @rule(spec=prompt_st, tenant=st.sampled_from(TENANTS), no_store=st.booleans())
    @precondition(lambda self: self.cache is not None)
    def request(self, spec, tenant, no_store):
        toks = tokens_of(spec)
        out = self.cache.driver.run(toks, tenant=tenant, no_store=no_store)
        if not out.served:
            return
        assert out.cached_len % PAGE == 0 and out.cached_len <= len(toks)
        self._check_prefix_was_inserted(toks, out.cached_len, tenant)
        aligned = len(toks) // PAGE * PAGE
        if aligned and not no_store:
            self.inserted[tenant].append(toks[:aligned])

    @rule(spec=prompt_st, tenant=st.sampled_from(TENANTS))
    @precondition(lambda self: self.cache is not None and len(self.held) < 3)
    def hold(self, spec, tenant):
        toks = tokens_of(spec)
        key = RadixKey(array("q", toks), None, cache_salt=tenant)
        m = self.cache.match_prefix(MatchPrefixParams(key=key))
        self._check_prefix_was_inserted(toks, m.device_prefix_len, tenant)
        lock = self.cache.lock(m.last_device_node)
        idx = self.cache.path_device_indices(m.last_device_node).clone()
        self.held.append((lock, m.last_device_node, tenant, toks, m.device_prefix_len, idx))

    @rule(data=st.data())
    @precondition(lambda self: self.held)
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.held) - 1))
        lock, *_ = self.held.pop(i)
        self.cache.unlock(lock)

    @rule(n=st.integers(1, CAPACITY))
    @precondition(lambda self: self.cache is not None)
    def evict(self, n):
        self.cache.evict(EvictParams(num_tokens=n))

    @rule(tenant=st.sampled_from(TENANTS + ["__all__"]))
    @precondition(lambda self: self.cache is not None)
    def invalidate(self, tenant):
        from sglang_tiered.core.tenants import name_hash, tenant_of

        if tenant == "__all__":
            self.cache.invalidate(everything=True)
            for t in TENANTS:
                self.inserted[t] = []
        else:
            self.cache.invalidate(tenant_hash=name_hash(tenant_of(tenant)))
            self.inserted[tenant] = []
        # After it returns no request may hit an invalidated entry, even one still locked.
        for spec_blocks in ([0, 1, 2], [3], [4, 5]):
            toks = tokens_of((spec_blocks, 0))
            for t in TENANTS if tenant == "__all__" else [tenant]:
                m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", toks), None, cache_salt=t)))
                assert m.device_prefix_len == 0

    def _check_prefix_was_inserted(self, toks, matched, tenant):
        if matched == 0:
            return
        prefix = toks[:matched]
        assert any(seq[:matched] == prefix for seq in self.inserted[tenant]), (
            "matched a prefix never inserted by this tenant"
        )

    @invariant()
    def accounting(self):
        if self.cache is None:
            return
        avail, evictable, protected, total = self.cache.driver.device_accounting()
        assert avail + evictable + protected == total, (avail, evictable, protected, total)
        self.cache.check_invariants()

    @invariant()
    def locked_prefixes_survive(self):
        for _lock, node, _tenant, _toks, plen, idx in self.held:
            assert node is self.cache.root_node or not node.evicted
            assert node.lock_ref > 0 or node is self.cache.root_node
            assert len(self.cache.path_device_indices(node)) == plen
            assert self.cache.path_device_indices(node).equal(idx)

    def teardown(self):
        if self.cache is None:
            return
        for lock, *_ in self.held:
            self.cache.unlock(lock)
        self.held.clear()
        assert self.cache.protected_size() == 0  # every lock count back to 0
        stack = list(self.cache.root_node.children.values())
        while stack:
            n = stack.pop()
            assert n.lock_ref == 0
            stack.extend(n.children.values())
        avail, evictable, protected, total = self.cache.driver.device_accounting()
        assert avail + evictable == total


TreeMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestTree = TreeMachine.TestCase


@pytest.mark.parametrize("fraction", [0.01, 0.05])
def test_replayed_workload_keeps_invariants_and_serves_exact_kv(fraction):
    """Real traffic shapes (system prompts, chats, agents, RAG, one-shot scans, 6 tenants) through
    the adaptive policy with T1 on: invariants (incl. the victim queue) after every cache call,
    and every hit's KV, device or promoted from T1, equal to recomputation."""
    from sglang_tiered.dev.workloads import multi_tenant, unique_pages

    reqs = multi_tenant(n_requests=600, scale=0.25)
    ps = 16
    cap = max(int(unique_pages(reqs, ps) * fraction), max(len(r.tokens) for r in reqs) // ps + 1) * ps
    cache = TieredRadixCache.create_simulated(cap, ps, debug_checks=True, verify_kv=True, host_pages=cap // ps)
    hits = 0
    for r in reqs:
        out = cache.driver.run(r.tokens, tenant=r.tenant)
        hits += out.cached_len
    cache.check_invariants()
    snap, host = cache.policy.snapshot(), cache.host.snapshot()
    assert hits > 0 and snap["evicted_pages"] > 0, snap
    # refused pages went to T1 and came back from there, checked against recomputation
    assert snap["pages_rejected"] > 0 and host["promotions"] > 0, (snap, host)
    assert cache.protected_size_ == 0
