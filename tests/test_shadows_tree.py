"""The tree shadows (``core/shadows.py`` ``TreeShadow``) are SGLang's RadixCache: per request, the
same hits as ``RadixCache`` with the same eviction policy, driven in the scheduler's call order
(``dev/simulate.py``), on generated family workloads at small capacities (where eviction is
constant) and in a Hypothesis state machine."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from sglang_tiered.core.keys import chain_page_hashes
from sglang_tiered.core.shadows import TreeShadow

PAGE = 16


def _sglang_hits(reqs, cap_pages: int, policy: str) -> list[int]:
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from sglang_tiered.dev.simulate import CacheDriver, make_params

    params, alloc, pool = make_params(cap_pages * PAGE, PAGE, 1 << 17, eviction_policy=policy)
    drv = CacheDriver(RadixCache(params), alloc, pool)
    return [drv.run(r.tokens, tenant=r.tenant).cached_len // PAGE for r in reqs]


def _tree_hits(reqs, cap_pages: int, policy: str) -> list[int]:
    sh = TreeShadow(cap_pages, policy)
    out = []
    for r in reqs:
        seed = hashlib.blake2b((r.tenant or "").encode(), digest_size=16).digest()
        pages = chain_page_hashes(seed, r.tokens, PAGE)
        hits = sh.run(pages, tail=int(len(r.tokens) % PAGE > 0))
        # a request bigger than the cache: neither the driver nor the shadow serves it or evicts for
        # it (SGLang's PrefillAdder leaves it waiting; session 32)
        out.append(0 if len(pages) + (len(r.tokens) % PAGE > 0) > cap_pages else hits)
        sh.check()
    return out


@pytest.mark.parametrize("policy", ["lru", "slru", "lfu"])
@pytest.mark.parametrize("seed,frac", [(72, 0.005), (105, 0.05), (15, 0.02), (3, 0.1)])
def test_tree_shadow_hits_are_sglangs(policy, seed, frac):
    from sglang_tiered.dev import workload_family as wf

    reqs = wf.generate(wf.draw(seed))[:300]
    pages = {h for r in reqs for h in chain_page_hashes(
        hashlib.blake2b((r.tenant or "").encode(), digest_size=16).digest(), r.tokens, PAGE)}  # fmt: skip
    max_req = max(-(-len(r.tokens) // PAGE) for r in reqs)
    cap = max(int(len(pages) * frac), max_req + 1)
    want = _sglang_hits(reqs, cap, policy)
    got = _tree_hits(reqs, cap, policy)
    assert sum(want) > 0
    first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
    assert first is None, (first, want[first], got[first])


@pytest.mark.parametrize("order", ["slru", "lfu"])
@pytest.mark.parametrize("seed,frac", [(15, 0.05), (60, 0.005)])
def test_fork_is_sglangs_cache_switched_midway(order, seed, frac):
    """``TreeShadow.fork(order)`` of an lru tree is SGLang's lru RadixCache whose eviction strategy
    is switched to ``order`` at that point: the same hits on every later request (what a priced
    switch, ``core/safety.py`` ``_trial_step``, measures before the real cache switches)."""
    from sglang.srt.mem_cache import radix_cache as rc

    from sglang_tiered.dev import workload_family as wf
    from sglang_tiered.dev.simulate import CacheDriver, make_params

    reqs = wf.generate(wf.draw(seed))[:300]
    seeds = {r.tenant: hashlib.blake2b((r.tenant or "").encode(), digest_size=16).digest() for r in reqs}
    paged = [(chain_page_hashes(seeds[r.tenant], r.tokens, PAGE), int(len(r.tokens) % PAGE > 0)) for r in reqs]
    cap = max(int(len({h for p, _ in paged for h in p}) * frac), max(len(p) + t for p, t in paged) + 1)
    params, alloc, pool = make_params(cap * PAGE, PAGE, 1 << 17, eviction_policy="lru")
    drv = CacheDriver(rc.RadixCache(params), alloc, pool)
    sh, mid = TreeShadow(cap, "lru"), len(reqs) // 2
    for r, (pages, tail) in zip(reqs[:mid], paged[:mid]):
        assert sh.run(pages, tail) == drv.run(r.tokens, tenant=r.tenant).cached_len // PAGE
    assert sh.full
    fork = sh.fork(order)
    fork.check()
    drv.cache.eviction_strategy = rc.get_eviction_strategy(order, None)
    differs = 0
    for r, (pages, tail) in zip(reqs[mid:], paged[mid:]):
        want = drv.run(r.tokens, tenant=r.tenant).cached_len // PAGE
        assert fork.run(pages, tail) == want
        differs += sh.run(pages, tail) != want
        fork.check()
    assert differs > 0  # the switch mattered: the fork is not simply the lru tree


class TreeShadowMachine(RuleBasedStateMachine):
    """A ``TreeShadow`` beside SGLang's ``RadixCache`` (same policy, same capacity, driven by
    ``CacheDriver``): every request hits the same pages in both; the shadow's invariants hold."""

    def __init__(self):
        super().__init__()
        self.sh = None

    @initialize(policy=st.sampled_from(["lru", "slru", "lfu"]), cap=st.integers(4, 24))
    def start(self, policy, cap):
        from sglang.srt.mem_cache.radix_cache import RadixCache

        from sglang_tiered.dev.simulate import CacheDriver, make_params

        params, alloc, pool = make_params(cap * PAGE, PAGE, 1 << 12, eviction_policy=policy)
        self.drv = CacheDriver(RadixCache(params), alloc, pool)
        self.sh, self.cap = TreeShadow(cap, policy), cap

    @rule(stem=st.integers(0, 3), body=st.lists(st.integers(0, 2), min_size=1, max_size=4),
          n=st.integers(1, 3 * PAGE + 7), tenant=st.sampled_from([None, "t1"]))  # fmt: skip
    def request(self, stem, body, n, tenant):
        # a shared stem, a branch and a tail of random length over a tiny alphabet: prefixes are
        # shared, split and evicted at every depth
        toks = ([stem] * PAGE + [b for b in body for _ in range(PAGE)]) * 3
        toks = toks[: PAGE + n]
        want = self.drv.run(toks, tenant=tenant).cached_len // PAGE
        seed = hashlib.blake2b((tenant or "").encode(), digest_size=16).digest()
        pages = chain_page_hashes(seed, toks, PAGE)
        tail = int(len(toks) % PAGE > 0)
        got = self.sh.run(pages, tail=tail)
        # a request bigger than the cache: neither the driver nor the shadow serves it or evicts for
        # it (SGLang's PrefillAdder leaves it waiting; session 32)
        assert (0 if len(pages) + tail > self.cap else got) == want

    @invariant()
    def consistent(self):
        if self.sh is not None:
            self.sh.check()


TestTreeShadowMachine = TreeShadowMachine.TestCase
TestTreeShadowMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("seed,frac", [(60, 0.005), (9, 0.1)])
def test_books_are_exact_while_the_real_cache_is_lru(seed, frac):
    """The real tiered cache kept on lru (no room ever earned) and the lru tree shadow hit the same
    pages on every request: the budget's margin and the lru bias stay exactly 0."""
    from sglang_tiered.core.policy import PolicyConfig
    from sglang_tiered.dev import workload_family as wf
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

    reqs = wf.generate(wf.draw(seed))[:400]
    pages = {h for r in reqs for h in chain_page_hashes(
        hashlib.blake2b((r.tenant or "").encode(), digest_size=16).digest(), r.tokens, PAGE)}  # fmt: skip
    cap = max(int(len(pages) * frac), max(-(-len(r.tokens) // PAGE) for r in reqs) + 1)
    cfg = PolicyConfig(guard_entry_room=1e12, guard_order_room=1e12)
    cache = TieredRadixCache.create_simulated(cap * PAGE, PAGE, policy_config=cfg)
    pol = cache.policy
    assert pol._tree
    for r in reqs:
        cache.driver.run(r.tokens, tenant=r.tenant)
    assert pol.following == "lru" and pol._refs > 0
    assert pol._margin == 0.0 and pol._bias["lru"][0] == 0.0, (pol._margin, pol._bias["lru"])
    pol.check_invariants()
