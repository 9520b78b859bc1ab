"""Hypothesis state machines for the policy's safety-duel structures (sglang_tiered/core/policy.py):
the lru shadow against a plain list model of SGLang's scheduler steps, and the whole policy
(shadows, miniatures, entry gate, ghosts, learned quantities) under random requests, evictions
and ghost misses, checked by ``AdaptivePolicy.check_invariants`` after every step."""

from __future__ import annotations

import hashlib

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from sglang_tiered.core.policy import COLD, PROTECTED, UNPROTECTED, AdaptivePolicy, PolicyConfig
from sglang_tiered.core.shadows import LruShadow

TENANTS, DEPTH = 4, 10


def _page(tenant: int, j: int) -> bytes:
    return hashlib.blake2b(f"{tenant}:{j}".encode(), digest_size=16).digest()


def _chain(tenant: int, depth: int) -> list[bytes]:
    return [_page(tenant, j) for j in range(depth)]


class LruModel:
    """SGLang's lru at page level, as a list (least recent first): the request's cached pages are
    locked and used, room is made by evicting least recent other pages, then the new pages are
    inserted (shallowest kept if the request is bigger than the cache); a request's pages end
    up ordered deepest first, ancestors most recent."""

    def __init__(self, capacity: int):
        self.cap = capacity
        self.pages: list[bytes] = []

    def run(self, req: list[bytes]) -> int:
        hit = [h for h in req if h in self.pages]
        others = [h for h in self.pages if h not in hit]
        room = self.cap - len(hit)
        new = [h for h in req if h not in hit]
        keep_new = new[: max(0, room)]
        others = others[max(0, len(others) - (room - len(keep_new))) :] if room - len(keep_new) > 0 else []
        self.pages = others + list(reversed(keep_new)) + list(reversed(hit))
        return len(hit)


class LruShadowMachine(RuleBasedStateMachine):
    @initialize(capacity=st.integers(1, 24))
    def build(self, capacity):
        self.shadow = LruShadow(capacity)
        self.model = LruModel(capacity)

    @rule(tenant=st.integers(0, TENANTS - 1), depth=st.integers(1, DEPTH))
    def request(self, tenant, depth):
        req = _chain(tenant, depth)
        assert self.shadow.run(req) == self.model.run(req)

    @invariant()
    def same_content_and_order(self):
        assert list(self.shadow.d) == self.model.pages
        assert len(self.shadow.d) <= self.shadow.cap


class PolicyMachine(RuleBasedStateMachine):
    @initialize(capacity=st.integers(4, 64),
                mode=st.sampled_from(["gated", "budget", "open", "leader", "lru-tree", "pages"]))
    def build(self, capacity, mode):
        cfg = {"gated": PolicyConfig(), "budget": PolicyConfig(guard_div_cap=False),
               "open": PolicyConfig(guard_start_lru=False, guard_entry_margin=None),
               "leader": PolicyConfig(guard_leader=0.999),
               # the shadows of caches above tree_shadow_pages, and above lru_tree_pages
               "lru-tree": PolicyConfig(tree_shadow_pages=0, shadow_pages=8, guard_entry_margin=None),
               "pages": PolicyConfig(tree_shadow_pages=0, lru_tree_pages=0, shadow_pages=8)}[mode]  # fmt: skip
        self.pol = AdaptivePolicy(capacity, cfg)

    @rule(tenant=st.integers(0, TENANTS - 1), depth=st.integers(1, DEPTH), hit=st.integers(0, DEPTH))
    def request(self, tenant, depth, hit):
        pages = _chain(tenant, depth)
        self.pol.begin_request()
        self.pol.on_miss(pages[min(hit, depth - 1)])
        self.pol.observe(pages, min(hit, depth))
        self.pol.admit_pages(pages[min(hit, depth) :], victim_freq=self.pol.frequency(pages[0]))

    @rule(tenant=st.integers(0, TENANTS - 1), j=st.integers(0, DEPTH - 1), n=st.integers(1, 6),
          kind=st.sampled_from([UNPROTECTED, PROTECTED, COLD]), age=st.integers(0, 50))  # fmt: skip
    def evict(self, tenant, j, n, kind, age):
        self.pol.on_evict(n, first_hash=_page(tenant, j), kind=kind, last_tick=max(0, self.pol.tick - age))

    @invariant()
    def consistent_and_bounded(self):
        self.pol.check_invariants()
        assert self.pol.following in ("adaptive", "lru", "slru", "lfu")


TestLruShadow = LruShadowMachine.TestCase
TestPolicy = PolicyMachine.TestCase
