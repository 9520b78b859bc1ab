"""Pure-Python core: cache identity, frequency sketch, policy (no torch, no sglang)."""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_tiered.core.keys import CacheKey, chain_page_hashes
from sglang_tiered.core.policy import AdaptivePolicy, PolicyConfig
from sglang_tiered.core.sketch import MAX_COUNT, FrequencySketch


def test_chain_hash_definition_and_determinism():
    key = CacheKey(tenant="acme", model_id="m", weights_digest="w", kv_dtype="bf16")
    toks = list(range(40))
    hs = chain_page_hashes(key.seed(), toks, 16)
    assert len(hs) == 2  # the partial third page is not hashed
    h0 = hashlib.blake2b(key.seed() + array("q", toks[:16]).tobytes(), digest_size=16).digest()
    h1 = hashlib.blake2b(h0 + array("q", toks[16:32]).tobytes(), digest_size=16).digest()
    assert hs == [h0, h1]
    # incremental: continuing from the last hash equals hashing the whole prefix at once
    assert chain_page_hashes(hs[0], toks[16:32], 16) == [h1]


@pytest.mark.parametrize("field", ["tenant", "model_id", "weights_digest", "kv_dtype", "rope_hash", "attn_impl"])
def test_every_identity_field_changes_the_seed(field):
    base = CacheKey()
    assert CacheKey(**{**base.__dict__, field: "other"}).seed() != base.seed()


def test_tp_degree_is_not_part_of_identity():
    assert not any("tp" in f for f in CacheKey.__dataclass_fields__)


def test_tenants_never_share_page_hashes():
    toks = list(range(64))
    a = chain_page_hashes(CacheKey(tenant="a").seed(), toks)
    b = chain_page_hashes(CacheKey(tenant="b").seed(), toks)
    assert not set(a) & set(b)


keys_st = st.lists(st.integers(min_value=0, max_value=40), min_size=0, max_size=400)


def _k(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


@settings(max_examples=60, deadline=None)
@given(keys_st)
def test_sketch_never_underestimates_before_aging(seq):
    sk = FrequencySketch(capacity=256, sample_factor=1000)
    exact = Counter()
    for i in seq:
        sk.increment(_k(i))
        exact[i] += 1
        assert sk.estimate(_k(i)) >= min(exact[i], MAX_COUNT + 1)
    for i in range(41):
        assert sk.estimate(_k(i)) <= MAX_COUNT + 1
        if exact[i] == 0:
            continue
        assert sk.estimate(_k(i)) >= min(exact[i], MAX_COUNT + 1)


@settings(max_examples=30, deadline=None)
@given(keys_st)
def test_sketch_ages_by_events_and_is_deterministic(seq):
    a, b = FrequencySketch(64, sample_factor=1), FrequencySketch(64, sample_factor=1)
    for i in seq:
        a.increment(_k(i))
        b.increment(_k(i))
    assert a.rows == b.rows and a.door == b.door and a.resets == b.resets
    assert (a.resets > 0) == (len(seq) >= 64)  # sample_size is 64 here
    before = [bytes(r) for r in a.rows]
    a.age()
    assert all(x == y >> 1 for r0, r1 in zip(before, a.rows) for x, y in zip(r1, r0))
    assert not any(a.door)


def test_policy_duel_becomes_scan_resistant():
    """Zipf-popular pages over a catalogue 30x the cache (each request one page): the frequent
    few are worth keeping and the long tail is not, which recency cannot tell apart; the duel
    must switch TinyLFU admission on."""
    import random

    rng = random.Random(0)
    # the adaptive machinery alone (no real cache here to duel against lru)
    pol = AdaptivePolicy(capacity_pages=256, config=PolicyConfig(safety_duel=False))
    weights = [1 / (i + 1) for i in range(8000)]
    for page in rng.choices(range(8000), weights, k=40000):
        pol.begin_request()
        pol.observe([_k(page)], 0)
    assert pol.filtering and str(pol.mode) == "tinylfu+adaptive", pol.snapshot()


def test_policy_stays_unfiltered_on_recency_traffic():
    """A loop over a working set that fits: admitting everything is best; no filtering."""
    pol = AdaptivePolicy(capacity_pages=512, config=PolicyConfig(safety_duel=False))
    for step in range(20000):
        pol.begin_request()
        pol.observe([_k(step % 400)], 0)
    assert not pol.filtering and str(pol.mode) == "all+adaptive", pol.snapshot()


def test_protection_learns_from_ghost_hits():
    """ARC-style: a miss on a remembered protected leaf raises k, one on an unprotected leaf
    lowers it, one on a cold prompt lowers c; unknown pages change nothing; all bounded."""
    from sglang_tiered.core.policy import COLD, PROTECTED, UNPROTECTED

    pol = AdaptivePolicy(capacity_pages=64, config=PolicyConfig(guard_start_lru=False))
    k0, c0 = pol.k, pol.c
    pol.on_evict(4, first_hash=_k(1), kind=PROTECTED, last_tick=0)
    pol.on_evict(4, first_hash=_k(2), kind=UNPROTECTED, last_tick=0)
    pol.on_evict(4, first_hash=_k(3), kind=COLD, last_tick=0)
    pol.on_miss(_k(99))
    assert (pol.k, pol.c) == (k0, c0)
    pol.on_miss(_k(1))
    assert pol.k > k0 and pol.c > c0
    k1 = pol.k
    pol.on_miss(_k(2))
    assert pol.k < k1
    c2 = pol.c
    pol.on_miss(_k(3))
    assert pol.c < c2
    pol.on_miss(_k(1))  # a ghost is consumed by its hit
    assert pol.k < k1
    for i in range(5000):  # bounded, and the ghost list holds at most capacity pages
        pol.on_evict(4, first_hash=_k(1000 + i), kind=PROTECTED, last_tick=0)
        pol.on_miss(_k(1000 + i))
        pol.on_evict(8, first_hash=_k(9000 + i), kind=UNPROTECTED, last_tick=0)
    assert pol.k == 2.0**pol.cfg.protect_log_bound
    assert sum(pol._ghost_pages[:2]) <= 64 and len(pol._ghosts) <= 64


def test_protection_is_fixed_in_forced_modes():
    from sglang_tiered.core.policy import PROTECTED

    lru = AdaptivePolicy(16, PolicyConfig(force_mode="all+lru"))
    lru.on_evict(1, first_hash=_k(1), kind=PROTECTED, last_tick=0)
    lru.on_miss(_k(1))
    assert lru.k == 0.0 and lru.protection_boost() == 0.0
    assert AdaptivePolicy(16, PolicyConfig(force_mode="tinylfu+slru")).k == float("inf")


def test_force_mode_validates():
    with pytest.raises(ValueError, match="force_mode"):
        AdaptivePolicy(16, PolicyConfig(force_mode="bogus"))
    assert AdaptivePolicy(16, PolicyConfig(force_mode="tinylfu+slru")).filtering


def test_weights_digest_changes_with_any_byte(tmp_path, monkeypatch):
    from sglang_tiered.weights_digest import weights_digest

    monkeypatch.setenv("SGLANG_TIERED_CACHE", str(tmp_path / "cache"))
    m = tmp_path / "model"
    m.mkdir()
    (m / "config.json").write_text("{}")
    w = m / "model.safetensors"
    w.write_bytes(bytes(range(256)) * 1000)
    d1 = weights_digest(str(m))
    assert weights_digest(str(m)) == d1  # memoised, same answer
    data = bytearray(w.read_bytes())
    data[123_456] ^= 1
    w.write_bytes(bytes(data))
    assert weights_digest(str(m)) != d1
    assert weights_digest("org/remote-model").startswith("name:")


def test_stats_schema_covers_every_tenant_counter():
    from dataclasses import fields

    from sglang_tiered.core.tenants import TenantCounters
    from sglang_tiered.stats import _COUNTERS

    assert [f.name for f in fields(TenantCounters)] == _COUNTERS


def test_aggregate_sums_ranks_and_filters_tenant():
    from sglang_tiered.stats import aggregate

    rank = {"page_size": 16, "tenants": {"a": {"requests": 2, "prompt_tokens": 100, "cached_tokens": 50},
                                         "b": {"requests": 1, "prompt_tokens": 10}},
            "tiers": [{"name": "device", "enabled": True, "resident_pages": 3}]}  # fmt: skip
    s = aggregate([rank, rank])
    assert s.ranks == 2 and s.totals.requests == 6 and s.totals.token_hit_rate == 100 / 220
    assert s.tiers[0].resident_pages == 6
    assert list(aggregate([rank], tenant="zz").tenants) == ["zz"]


def test_thrash_is_eviction_work_that_buys_no_hits():
    """Evictions ~ stores is what any full cache does; thrash is when that buys (almost) no
    hits. It is entered and left over sustained windows, and makes admission selective at par."""
    pol = AdaptivePolicy(capacity_pages=64, config=PolicyConfig(guard_start_lru=False))
    for i in range(300):  # full, every request stores 4 pages and evicts 4, and half its pages hit
        pol.begin_request()
        pol.observe([_k(i * 8 + j) for j in range(8)], device_hit_pages=4)
        pol.admit_pages([_k(i * 8 + j) for j in range(4, 8)], None)
        pol.on_evict(4)
    assert not pol.thrashing and pol.stats.thrash_windows == 0
    for i in range(300, 600):  # same eviction work, no hits: thrash
        pol.begin_request()
        pol.observe([_k(i * 8 + j) for j in range(8)], device_hit_pages=0)
        pol.admit_pages([_k(i * 8 + j) for j in range(8)], None)
        pol.on_evict(8)
    assert pol.thrashing and pol.stats.thrash_windows > 0
    pol._duel([_k(100_000 + i) for i in range(pol._mini_cap)])  # miniatures full: duel decides
    pol.mode_index = 0
    pol.scores = [10.0, 10.5, 0.0, 0.0]  # TinyLFU ahead, but by less than admit_margin (1.1) ...
    pol._duel([_k(200_000)])
    assert pol.filtering  # ... which is enough while thrashing
    pol.thrashing, pol.mode_index, pol.scores = False, 0, [10.0, 10.5, 0.0, 0.0]
    pol._duel([_k(200_001)])
    assert not pol.filtering  # and not otherwise
    pol.thrashing = True
    for i in range(600, 900):  # hits come back: thrash ends
        pol.begin_request()
        pol.observe([_k(i * 8 + j) for j in range(8)], device_hit_pages=6)
        pol.admit_pages([_k(i * 8 + j) for j in range(6, 8)], None)
        pol.on_evict(2)
    assert not pol.thrashing
