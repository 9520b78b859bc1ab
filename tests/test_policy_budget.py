"""The safety duel's whole-trace loss budget (sglang_tiered/core/safety.py, ``_budget``): an
episode away from lru starts only with room in the budget, ends when the budget is spent, and the
cost of each switch back to lru is measured and kept in reserve."""

from __future__ import annotations

from sglang_tiered.core.policy import AdaptivePolicy, PolicyConfig


def _loop_page(i: int, period: int = 64) -> bytes:
    return bytes([0, 0, 0, 0]) + (i % period).to_bytes(12, "little")


def _fill(pol: AdaptivePolicy, n: int, real_hits) -> None:
    """``n`` more requests of a 64-page loop (one page each); the real cache hits ``real_hits(i)``."""
    for _ in range(n):
        i = pol.begin_request() - 1
        pol.observe([_loop_page(i)], real_hits(i))


def test_budget_accrues_per_reference_and_counts_real_minus_lru_shadow():
    pol = AdaptivePolicy(capacity_pages=64)
    _fill(pol, 63, lambda i: 0)
    assert pol._refs == 0.0 and pol._margin == 0.0  # nothing is compared before the shadow is full
    _fill(pol, 1, lambda i: 0)  # the request that fills it (a 64-page loop in a 64-page cache)
    _fill(pol, 999, lambda i: 1)  # lru hits every page; so does the real cache
    assert pol._refs == 1000.0 and abs(pol._margin) < 1e-9
    assert abs(pol._budget() - 1.0) < 1e-9  # 0.1 point of 1,000 references


def test_no_episode_away_from_lru_without_room_in_the_budget():
    pol = AdaptivePolicy(capacity_pages=64, config=PolicyConfig(guard_entry_margin=None, guard_entry_room=0.0))
    pol._refs, pol._margin = 1000.0, -2.0  # lost 2 hits of a 1-hit allowance: spent
    assert not pol._may_leave_lru() and not pol._adaptive_ahead()
    pol._margin = 0.0
    assert pol._may_leave_lru() and pol._adaptive_ahead()
    pol._switch_reserve = 5.0  # a measured switch back cost 5: kept in reserve
    assert not pol._may_leave_lru()
    # the default: an adaptive episode needs room for one CUSUM threshold (16); a fixed order
    # none (its switch is priced by a trial on a fork of the lru tree instead)
    roomy = AdaptivePolicy(capacity_pages=64)
    roomy._refs, roomy._margin = 1000.0, 14.0  # 15 left
    assert not roomy._may_leave_lru() and roomy._may_leave_lru(adaptive=False)
    roomy._margin = 15.0
    assert roomy._may_leave_lru() and roomy._may_leave_lru(adaptive=False)
    ordered = AdaptivePolicy(capacity_pages=64, config=PolicyConfig(guard_order_room=1.0))
    ordered._refs, ordered._margin = 1000.0, 14.0
    assert not ordered._may_leave_lru(adaptive=False)


def test_spent_budget_sends_the_cache_back_to_lru_even_before_the_cusum_threshold():
    pol = AdaptivePolicy(capacity_pages=64, config=PolicyConfig(guard_start_lru=False, guard_threshold=1.0))
    _fill(pol, 64, lambda i: 0)
    pol._margin = 3.0  # three hits of budget left; the CUSUM threshold is 64
    _fill(pol, 2, lambda i: 1)
    assert pol.following == "adaptive"
    _fill(pol, 4, lambda i: 0)  # loses 4 hits to the lru shadow: budget spent, CUSUM far from -64
    assert pol.following == "lru" and pol._credit == 0.0
    pol.check_invariants()


def _mixed_page(i: int) -> bytes:
    """Even requests: a 16-page loop (it stays in a 64-page lru); odd ones: a fresh page each."""
    k = i // 2 % 16 if i % 2 == 0 else 1_000_000 + i
    return bytes([0, 0, 0, 0]) + k.to_bytes(12, "little")


def _mixed(pol: AdaptivePolicy, n: int, real_hits_loop: bool) -> None:
    for _ in range(n):
        i = pol.begin_request() - 1
        h = _mixed_page(i)
        # (one-page requests: the tree shadow holds each as a child of its root, its pages are
        # its root's children's keys; pages() reads them from the C shadow too)
        held = h in pol._shadow.pages() if pol._tree else h in pol._shadow.d
        hit = held and (real_hits_loop or i % 2)  # the real cache as lru, or losing the loop
        pol.observe([h], int(hit))


def test_switch_back_cost_is_measured_over_a_turnover_of_shadow_misses_into_the_reserve():
    pol = AdaptivePolicy(capacity_pages=64)
    _mixed(pol, 400, True)  # the real cache is exact lru: no loss, no bias
    assert abs(pol._margin) < 1e-9 and pol._switch_reserve == 0.0
    pol.following = "adaptive"
    pol._follow("lru")  # a switch back: the loss until a cache's worth of pages came in is its cost
    assert pol._switch_mark == [pol._margin, 64.0]
    _mixed(pol, 100, False)  # 50 misses of the lru shadow so far: still converging
    assert pol._switch_mark is not None
    _mixed(pol, 28, False)  # the 64th shadow miss: 64 loop hits were lost meanwhile
    assert pol._switch_mark is None and pol._switch_reserve == 64.0
    _mixed(pol, 200, True)
    assert pol._switch_reserve == 64.0  # kept (the largest measured)
    pol.check_invariants()


def test_without_a_budget_the_cusum_alone_decides():
    pol = AdaptivePolicy(capacity_pages=64, config=PolicyConfig(guard_budget=None, guard_entry_margin=None))
    _fill(pol, 1000, lambda i: 0)
    assert pol._refs == 0.0 and pol._may_leave_lru()


def test_spent_budget_keeps_the_cache_on_exact_lru_until_it_is_earned_back():
    """After the real cache lost far more than the allowance, matching the lru shadow earns only
    the allowance per reference: no episode away from lru until that covers the loss."""
    pol = AdaptivePolicy(capacity_pages=64, config=PolicyConfig(guard_start_lru=False, guard_entry_margin=None))
    _fill(pol, 3000, lambda i: 0)  # lru hits everything; the "real" cache reports none
    assert pol.following == "lru" and pol._budget() < -2000
    follows = set()
    for _ in range(20000):
        _fill(pol, 1, lambda i: 1)
        follows.add(pol.following)
    assert follows == {"lru"}
    pol.check_invariants()


def test_adversarial_workloads_end_within_the_budget_bound_of_lru():
    """Each learned mechanism wrong (tests/test_guarantee.py's workloads), the default policy:
    the loss to SGLang's lru is within the budget's bound, beta x pages plus the first switch
    back's turnover (at most a cache's worth of pages), and the books say so too."""
    from tests.test_guarantee import (PAGE, _dead_protected_context, _returning_scan, _run,
                                      _tinylfu_hostile_loop)  # fmt: skip

    for build in (_returning_scan, _dead_protected_context, _tinylfu_hostile_loop):
        reqs, cap_pages = build()
        lru, _, _ = _run(reqs, cap_pages, "lru")
        tiered, _, cache = _run(reqs, cap_pages, None)
        pol = cache.policy
        total_pages = sum(len(t) // PAGE for t, _ in reqs)
        assert pol.shard_rate == 1.0  # small caches: every page is sampled
        bound = (pol.cfg.guard_budget * total_pages + cap_pages) / total_pages
        assert tiered >= lru - bound, (build.__name__, tiered, lru, bound)
        assert pol._budget() >= -cap_pages, (build.__name__, pol._budget())
        pol.check_invariants()
