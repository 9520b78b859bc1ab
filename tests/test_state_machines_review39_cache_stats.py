"""Hypothesis state machine (review, session 39): the per-tenant counters (``TenantTable``, what
/cache/stats and /metrics report) and the fleet-hint notifications (``IndexHints``: what the
publisher is told this server holds) of a ``TieredRadixCache`` with T1, against models read off
the tree and the host pool after every step.

  C1 each tenant's ``resident_pages`` == the device pages of its nodes in the tree (stats drift);
  C2 counters never negative, ``requests_hit <= requests``, ``cached_tokens <= prompt_tokens``;
  C3 a listener's claims (stores - removes, cleared by a clear) == the device tree's pages plus
     T1's pages (a page claimed and not held: the router sends a tenant to a cold server; a page
     held and not claimed: locality lost), as index_hints.py and fleet/publisher.py promise;
  C4 invalidation.py's V1 (``count`` == the invalidated nodes in the tree; ``check_cache`` checks
     only ``count >= 0``) and V2 (no invalidated node without lock and children stays);
  plus ``check_invariants`` (I1, T1-T3, H1-H2, S4) after every step.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from sglang_tiered.core.tenants import name_hash, tenant_of
from sglang_tiered.dev.simulate import InFlight
from sglang_tiered.integration.index_hints import tree_pages
from sglang_tiered.integration.node_state import node_pages
from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

PAGE = 4
BLOCKS = [[b * 10 + i for i in range(PAGE)] for b in range(1, 8)]
TENANTS = [None, "acme", "globex"]

settings.register_profile("review39", max_examples=60, stateful_step_count=40, deadline=None)
settings.register_profile("review39-deep", max_examples=400, stateful_step_count=50, deadline=None)
PROFILE = settings.get_profile(os.environ.get("REVIEW39_PROFILE", "review39"))


def tokens_of(blocks, tail):
    return [t for b in blocks for t in BLOCKS[b]] + [900 + i for i in range(tail)]


class Claims:
    """A listener that keeps what it was told: the set of page hashes claimed."""

    def __init__(self):
        self.held: set = set()

    def on_store(self, hashes):
        self.held.update(hashes)

    def on_remove(self, hashes):
        self.held.difference_update(hashes)

    def on_clear(self):
        self.held.clear()


class CacheStatsMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = None
        self.claims = Claims()
        self.flight = []

    @rule(host=st.sampled_from([0, 6, 16]), queue=st.sampled_from([0, 4]), listen=st.booleans())
    @precondition(lambda self: self.cache is None)
    def build(self, host, queue, listen):
        self.cache = TieredRadixCache.create_simulated(12 * PAGE, PAGE, host_pages=host, verify_kv=bool(host),
                                                      debug_checks=True, store_queue_pages=queue if host else 0)  # fmt: skip
        self.listen = listen
        if listen:
            self.cache.attach_index(self.claims)

    @rule(blocks=st.lists(st.integers(0, len(BLOCKS) - 1), max_size=5), tail=st.integers(0, PAGE - 1),
          tenant=st.sampled_from(TENANTS), no_store=st.booleans())  # fmt: skip
    @precondition(lambda self: self.cache is not None)
    def request(self, blocks, tail, tenant, no_store):
        self.cache.driver.run(tokens_of(blocks, tail), tenant=tenant, no_store=no_store)

    @rule(blocks=st.lists(st.integers(0, len(BLOCKS) - 1), min_size=1, max_size=4), tenant=st.sampled_from(TENANTS))
    @precondition(lambda self: self.cache is not None and len(self.flight) < 2)
    def begin(self, blocks, tenant):
        f = self.cache.driver.begin(tokens_of(blocks, 1), tenant=tenant)
        if isinstance(f, InFlight):
            self.flight.append(f)

    @rule(data=st.data())
    @precondition(lambda self: self.flight)
    def end(self, data):
        f = self.flight.pop(data.draw(st.integers(0, len(self.flight) - 1)))
        self.cache.driver.end(f)

    @rule(n=st.integers(1, 12 * PAGE))
    @precondition(lambda self: self.cache is not None)
    def evict(self, n):
        self.cache.evict(EvictParams(num_tokens=n))

    @rule(tenant=st.sampled_from(TENANTS + ["__all__"]))
    @precondition(lambda self: self.cache is not None)
    def invalidate(self, tenant):
        if tenant == "__all__":
            self.cache.invalidate(everything=True)
        else:
            self.cache.invalidate(tenant_hash=name_hash(tenant_of(tenant)))

    @rule()
    @precondition(lambda self: self.cache is not None and not self.flight)
    def flush(self):
        self.cache.reset()  # SGLang's /flush_cache (idle: nothing in flight)

    @invariant()
    def stats_match_the_tree(self):
        cache = self.cache
        if cache is None:
            return
        cache.check_invariants()
        want: dict = {}
        stack = list(cache.root_node.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            lab = cache.tenants.label(n.key.cache_salt)
            want[lab] = want.get(lab, 0) + node_pages(n, PAGE)
        invalid = [n for n in self._nodes() if n.tiered_invalid]
        assert cache.invalidation.count == len(invalid), ("C4: V1", cache.invalidation.count, len(invalid))
        assert not [n for n in invalid if n.lock_ref == 0 and not n.children], "C4: V2"
        got = {lab: c.resident_pages for lab, c in cache.tenants.by_name.items() if c.resident_pages}
        assert got == {k: v for k, v in want.items() if v}, ("C1: resident_pages drifted", got, want)
        for lab, c in cache.tenants.by_name.items():
            d = c.as_dict()
            assert all(v >= 0 for v in d.values()), ("C2", lab, d)
            assert c.requests_hit <= c.requests and c.cached_tokens <= c.prompt_tokens, ("C2", lab, d)

    def _nodes(self):
        out, stack = [], list(self.cache.root_node.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            out.append(n)
        return out

    @invariant()
    def claims_match_what_is_held(self):
        cache = self.cache
        if cache is None or not self.listen:
            return
        held = set(tree_pages(cache.root_node))
        if cache.t1 is not None:
            held |= set(cache.host.pool.slot_of)
        stale, missing = self.claims.held - held, held - self.claims.held
        assert not stale, ("C3: claims of pages the server does not hold", len(stale))
        assert not missing, ("C3: pages held and not claimed", len(missing))

    def teardown(self):
        if self.cache is not None:
            for f in self.flight:
                self.cache.driver.end(f)
            self.flight.clear()


CacheStatsMachine.TestCase.settings = PROFILE
TestCacheStats = CacheStatsMachine.TestCase
