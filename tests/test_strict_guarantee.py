"""The strict guarantee (the default since session 15; ``SGLANG_TIERED_GUARANTEE=strict``,
``PolicyConfig.guard_div_cap``): away
from lru, the real cache drops a page of SGLang lru's cache (evicts it, or refuses to admit it)
only while the loss budget covers it at one lost hit per page. Checked here: on workloads built so
that the learned mechanisms are wrong, and where they are right, the loss to SGLang's own lru
stays within ``budget x page references + the counted overshoot``; the cap is what holds it
(the budget mode's per-request price lets a lump through); the option is parsed and reaches the
policy, and is the default; and the stats say what the cap did."""

from __future__ import annotations

import pathlib
import sys

import pytest

from sglang_tiered.config import ConfigError, load_config, policy_config
from sglang_tiered.core.policy import PolicyConfig
from sglang_tiered.core.shadows import Divergence
from tests.test_guarantee import (
    PAGE,
    _dead_protected_context,
    _hot_set_under_scans,
    _returning_scan,
    _run,
    _tinylfu_hostile_loop,
    _tok,
)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))

STRICT = PolicyConfig(guard_div_cap=True)
BUDGET = PolicyConfig(guard_div_cap=False)  # SGLANG_TIERED_GUARANTEE=budget
# the gates alone (no budget room asked before an episode), so that episodes happen on these
# short traces and the cap, not the entry, is what keeps the loss in bound
STRICT_OPEN = PolicyConfig(guard_div_cap=True, guard_entry_room=0.0, guard_order_room=0.0, guard_prepay=False)
# a cache above ``tree_shadow_pages`` (forced here with 0): lru's tree alone is kept exactly, slru
# and lfu are sampled page models (1 page in 4 of these small caches: ``shadow_pages`` 8)
LRU_TREE = PolicyConfig(tree_shadow_pages=0, shadow_pages=8)
LRU_TREE_OPEN = PolicyConfig(tree_shadow_pages=0, shadow_pages=8, guard_entry_room=0.0, guard_order_room=0.0,
                             guard_prepay=False)  # fmt: skip


def assert_within_budget(reqs, per_req, lru_per_req, pol, page: int, what="") -> None:
    """The strict bound at every point of a trace: tokens lost to lru so far <= (the budget per
    page reference so far + the counted overshoot) pages."""
    over = pol.snapshot()["cap_over_kept"]
    lost = seen = 0
    for a, b, (t, _) in zip(per_req, lru_per_req, reqs):
        lost += b - a
        seen += len(t) // page
        assert lost <= (pol.cfg.guard_budget * seen + over) * page + 1e-9, (what, seen, lost)


def _family_cell(seed: int, fraction: float):
    """A generated workload of the family at the capacity bench/workload_family.py gives it."""
    import bookkeeping  # bench/ (tests/test_bookkeeping_digest.py puts it on the path the same way)

    name = f"family-{seed}"
    reqs = [(r.tokens, r.tenant) for r in bookkeeping.load(name)[0]]
    return reqs, bookkeeping.capacity_tokens(name, fraction) // PAGE


WORKLOADS = [_returning_scan, _dead_protected_context, _tinylfu_hostile_loop, _hot_set_under_scans]


@pytest.mark.parametrize("config", [STRICT, STRICT_OPEN, LRU_TREE, LRU_TREE_OPEN],
                         ids=["strict", "strict-open", "lru-tree", "lru-tree-open"])  # fmt: skip
@pytest.mark.parametrize("build", WORKLOADS)
def test_strict_loss_to_lru_is_within_budget_plus_counted_overshoot(build, config):
    reqs, cap_pages = build()
    lru, lru_per_req, _ = _run(reqs, cap_pages, "lru")
    tiered, per_req, cache = _run(reqs, cap_pages, None, config)
    pol = cache.policy
    snap = pol.snapshot()
    assert snap["strict_guarantee"] is True
    total_tokens = sum(len(t) for t, _ in reqs)
    refs = sum(len(t) // PAGE for t, _ in reqs)
    # the bound, in tokens: the budget per page reference over the whole trace, plus the pages
    # of lru's the cap had to let go when nothing else was evictable (counted)
    bound = (pol.cfg.guard_budget * refs + snap["cap_over_kept"]) * PAGE / total_tokens
    assert tiered >= lru - bound - 1e-9, (build.__name__, tiered, lru, bound, snap)
    # ... and at every point of the trace, not only at its end
    assert_within_budget(reqs, per_req, lru_per_req, pol, PAGE, build.__name__)
    pol.check_invariants()


def test_the_cap_keeps_a_lump_within_the_bar_where_the_priced_check_does_not():
    """family-095 at 1 % (bench/results/workload_family_c479b78.csv): lru's hit rate is 4.6 %, so
    the budget mode prices the pages an episode dropped at about 0.05 hits each, and one request
    of 318 pages then hits them all in lru's cache: it ends 0.26 points below lru (the acceptance
    bar is 0.2). The cap prices each dropped page at a whole hit; it is the default.
    The recorded instance keys the tree's pages by their identity hashes (a server with T1 or the
    fleet index): with the policy keys (session 46) the sampled estimates differ and the budget
    mode ends 0.12 points below lru on this trace, within the bar, so the case is kept as found."""
    reqs, cap_pages = _family_cell(95, 0.01)
    lru, _, _ = _run(reqs, cap_pages, "lru")
    budget, _, _ = _run(reqs, cap_pages, None, BUDGET, identity=True)
    default, default_per_req, _ = _run(reqs, cap_pages, None, None, identity=True)
    strict, strict_per_req, cache = _run(reqs, cap_pages, None, STRICT, identity=True)
    snap = cache.policy.snapshot()
    assert budget < lru - 0.002, (budget, lru)
    assert strict >= lru - 0.002, (strict, lru, snap)
    assert default_per_req == strict_per_req
    assert snap["cap_spared"] > 0, snap  # the cap acted


def test_strict_is_exact_lru_where_it_never_leaves_lru():
    """Traffic with no lead for anything (a loop inside the cache): strict and default alike are
    SGLang's lru, request for request (the cap never applies while lru is followed)."""
    reqs = [(_tok(100 + k % 12, 3), None) for k in range(600)]
    lru, lru_per_req, _ = _run(reqs, 40, "lru")
    strict, per_req, cache = _run(reqs, 40, None, STRICT)
    assert per_req == lru_per_req
    snap = cache.policy.snapshot()
    assert snap["cap_spared"] == snap["cap_admitted"] == snap["cap_over_pages"] == 0


def test_guarantee_option_parses_and_reaches_the_policy():
    assert load_config({}).guarantee == "strict"
    assert policy_config(load_config({})) is None and PolicyConfig().guard_div_cap is True
    cfg = load_config({"SGLANG_TIERED_GUARANTEE": " Strict "})
    assert cfg.guarantee == "strict" and policy_config(cfg) is None
    cfg = load_config({"SGLANG_TIERED_GUARANTEE": "budget"})
    assert cfg.guarantee == "budget" and policy_config(cfg).guard_div_cap is False
    with pytest.raises(ConfigError, match="SGLANG_TIERED_GUARANTEE"):
        load_config({"SGLANG_TIERED_GUARANTEE": "always"})


def test_lru_tree_pages_option_parses_and_reaches_the_policy():
    assert load_config({}).lru_tree_pages is None and PolicyConfig().lru_tree_pages == 1 << 21
    pc = policy_config(load_config({"SGLANG_TIERED_LRU_TREE_PAGES": " 4194304 "}))
    assert pc.lru_tree_pages == 1 << 22 and pc.guard_div_cap is True
    pc = policy_config(load_config({"SGLANG_TIERED_LRU_TREE_PAGES": "0", "SGLANG_TIERED_GUARANTEE": "budget"}))
    assert pc.lru_tree_pages == 0 and pc.guard_div_cap is False
    for bad in ("-1", "1e6", "lots", str((1 << 26) + 1)):
        with pytest.raises(ConfigError, match="SGLANG_TIERED_LRU_TREE_PAGES"):
            load_config({"SGLANG_TIERED_LRU_TREE_PAGES": bad})


def test_the_cap_never_holds_a_leaf_lru_does_not_have(monkeypatch):
    """With the room overdrawn (the budget spent while away from lru), a leaf whose pages lru's
    tree does not hold still costs nothing to evict: eviction takes it and holds only leaves of
    lru's pages, so the overshoot counts only what had to go (the bound's ``O``). Before the fix
    every leaf was held once the room was below 0, and the first held one (of lru's pages) was
    evicted as overshoot although a free leaf was there."""
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cache = TieredRadixCache.create_simulated(12 * PAGE, PAGE, policy_config=STRICT)
    for uid in range(3):  # three 4-page leaves, oldest first
        cache.driver.run(_tok(uid, 4))
    leaves = sorted(cache.evictable_leaves, key=lambda x: x.last_access_time)
    assert len(leaves) == 3
    lru_holds = set(leaves[0].tiered_hashes)  # lru's tree holds the oldest leaf only
    pol = cache.policy
    monkeypatch.setattr(pol, "div_room", lambda: -3.0)
    # lru's tree's pages as the cap reads them (``div_spared``, ``div_cost``: ``_div.L``)
    div = Divergence()
    div.L = lru_holds
    monkeypatch.setattr(pol, "_div", div)
    cache.evict(EvictParams(num_tokens=4 * PAGE))
    assert leaves[0] in cache.evictable_leaves and leaves[1] not in cache.evictable_leaves
    assert pol.stats.cap_over_pages == 0 and pol.stats.cap_spared == 1


def test_above_the_tree_size_lru_tree_alone_keeps_the_strict_guarantee():
    """Caches above ``tree_shadow_pages`` keep lru's tree alone (up to ``lru_tree_pages``): the
    cap still has lru's pages to count against, so the strict guarantee holds there (family-095
    at 1 %, where the budget mode ends 0.26 points below lru); only with ``lru_tree_pages`` 0 too
    are all the shadows page models, and the stats say the guarantee is off."""
    reqs, cap_pages = _family_cell(95, 0.01)
    lru, _, _ = _run(reqs, cap_pages, "lru")
    mixed, _, cache = _run(reqs, cap_pages, None, LRU_TREE)
    snap = cache.policy.snapshot()
    assert snap["shadow_kind"] == "lru-tree" and snap["strict_guarantee"] is True, snap
    assert mixed >= lru - 0.002, (mixed, lru, snap)
    pages = PolicyConfig(tree_shadow_pages=0, lru_tree_pages=0, shadow_pages=8)
    _, _, cache = _run(reqs[:50], cap_pages, None, pages)
    snap = cache.policy.snapshot()
    assert snap["shadow_kind"] == "pages" and snap["strict_guarantee"] is False, snap


def _run_page(reqs, cap_tokens: int, page: int, policy: str | None):
    """``_run`` at another page size: (hit rate, per-request hits, the tiered cache or None)."""
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from sglang_tiered.dev.simulate import CacheDriver, make_params
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

    if policy is None:
        cache = TieredRadixCache.create_simulated(cap_tokens, page)
        driver = cache.driver
    else:
        params, alloc, pool = make_params(cap_tokens, page, 1 << 15, eviction_policy=policy)
        cache, driver = None, CacheDriver(RadixCache(params), alloc, pool)
    per_req = [driver.run(toks, tenant=tenant).cached_len for toks, tenant in reqs]
    return sum(per_req) / sum(len(t) for t, _ in reqs), per_req, cache


def test_over_the_cap_the_real_cache_drops_what_lru_drops():
    """family-096 at page size 1, 0.5 % (the cache is one page more than the longest request, so
    a long request leaves nothing evictable but lru's pages): over the cap the real cache evicted
    in the adaptive order, a 618-page leaf lru kept for a 97-page request, and hit nothing of it
    at the switch back: 0.46 points below lru (bench/results/workload_family_page1_rest_f680dd2).
    Now it goes least recently used first, as lru's own tree does for the same request, and the
    overshoot the bound counts (``cap_over_kept``: what lru still held after its own step) is 0."""
    from sglang_tiered.dev import workload_family as wf

    reqs = [(r.tokens, r.tenant) for r in wf.generate(wf.draw(96))]
    unique = set()  # pages (tokens at page size 1) by chained hash, as the bench counts them
    for t, _ in reqs:
        h = 0
        for tok in t:
            h = hash((h, tok))
            unique.add(h)
    unique = len(unique)
    cap = max(int(unique * 0.005), max(len(t) for t, _ in reqs) + 1)
    lru, lru_per_req, _ = _run_page(reqs, cap, 1, "lru")
    tiered, per_req, cache = _run_page(reqs, cap, 1, None)
    snap = cache.policy.snapshot()
    assert snap["fallbacks"] >= 1 and snap["cap_over_pages"] > 0, snap  # an episode, and over the cap
    refs = sum(len(t) for t, _ in reqs)
    lost = sum(lru_per_req) - sum(per_req)
    assert lost <= cache.policy.cfg.guard_budget * refs + snap["cap_over_kept"], (lost, snap)
    assert tiered >= lru - 0.002, (tiered, lru)
    cache.policy.check_invariants()
