"""Fleet routing (pure), the simulator core, the index hook in TieredRadixCache, the publisher's
failure behaviour and its configuration."""

from __future__ import annotations

import time

import pytest

from sglang_tiered.config import ConfigError, load_config
from sglang_tiered.fleet.routing import (POLICIES, AffinityCachePolicy, FleetView, RouteRequest,
                                         longest_match, rendezvous_top_k)  # fmt: skip


def test_rendezvous_moves_about_one_nth_of_tenants():
    tenants = [f"t{i}" for i in range(4000)]
    for n in (4, 8, 16):
        ws = [f"http://127.0.0.1:{9000 + i}" for i in range(n)]
        before = {t: rendezvous_top_k(t, ws, 1)[0] for t in tenants}
        # a worker leaves: only its tenants move, each to one of the others
        gone = ws[3]
        after = {t: rendezvous_top_k(t, [w for w in ws if w != gone], 1)[0] for t in tenants}
        moved = [t for t in tenants if before[t] != after[t]]
        assert all(before[t] == gone for t in moved)
        assert abs(len(moved) / len(tenants) - 1 / n) < 0.5 / n
        # a worker joins: about 1/(n+1) move, all onto the newcomer
        new = "http://127.0.0.1:9999"
        joined = {t: rendezvous_top_k(t, ws + [new], 1)[0] for t in tenants}
        moved = [t for t in tenants if before[t] != joined[t]]
        assert all(joined[t] == new for t in moved)
        assert abs(len(moved) / len(tenants) - 1 / (n + 1)) < 0.5 / (n + 1)
        # top-k homes: a membership change touches about k/n of the home sets
        k3 = {t: set(rendezvous_top_k(t, ws, 3)) for t in tenants}
        k3b = {t: set(rendezvous_top_k(t, [w for w in ws if w != gone], 3)) for t in tenants}
        changed = sum(k3[t] != k3b[t] for t in tenants) / len(tenants)
        assert changed < 3 / n + 0.1


def _view(ws, load=None, queue=None, matched=None):
    return FleetView(ws, load or {w: 0.0 for w in ws}, queue or {w: 0.0 for w in ws}, matched)


def test_policy_affinity_hatch_and_time_rule():
    ws = [f"w{i}" for i in range(6)]
    pol = AffinityCachePolicy(k=3, c_tok_s=1e-3, followers=0.0, per_prefix=False, cold_frac=0.0)
    req = RouteRequest(1000, [b"x" * 16] * 10, tenant="acme")
    homes = rendezvous_top_k(b"t:acme", ws, 3)
    d = pol.route(req, _view(ws))
    assert d.worker == homes[0] and d.home and not d.spill
    # first home over the hatch -> the second home (overflow, not a spill)
    load = {w: 1.0 for w in ws}
    load[homes[0]] = 50.0
    assert pol.route(req, _view(ws, load)).worker == homes[1]
    # all homes over -> spill to the least loaded
    for h in homes:
        load[h] = 50.0
    d = pol.route(req, _view(ws, load))
    assert d.spill and d.worker not in homes
    # a warmer non-home wins exactly when matched x c_tok > extra queue delay
    other = next(w for w in ws if w not in homes)
    m = {other: 160}  # 160 tokens x 1 ms = 160 ms of recompute saved
    assert pol.route(req, _view(ws, matched=m)).worker == other
    q = {w: 0.0 for w in ws}
    q[other] = 0.2  # 200 ms of extra queue: not worth it
    assert pol.route(req, _view(ws, queue=q, matched=m)).worker == homes[0]
    # no index (Redis down): affinity + load only
    assert pol.route(req, _view(ws, matched=None)).worker == homes[0]
    # cold requests (nobody holds a quarter of the prompt) leave a home above the mean load
    cold = AffinityCachePolicy(k=1, per_prefix=False, cold_frac=0.25, cold_over=1.15)
    load = {w: 1.0 for w in ws}
    load[homes[0]] = 3.5
    d = cold.route(req, _view(ws, load, matched={}))
    assert d.worker != homes[0] and d.reason == "cold"
    # ... but a warm one stays (its home holds half of it), as long as the hatch allows
    d = cold.route(req, _view(ws, load, matched={homes[0]: 500}))
    assert d.worker == homes[0]
    # per-prefix affinity: a tenant's prompt families may have different homes, deterministically
    fam = AffinityCachePolicy(k=1, per_prefix=True, cold_frac=0.0)
    a = fam.route(RouteRequest(64, [b"a" * 16] * 4, tenant="acme"), _view(ws)).worker
    assert a == fam.route(RouteRequest(64, [b"a" * 16] * 4, tenant="acme"), _view(ws)).worker


def test_longest_match():
    hs = [{"a", "b"}, {"a", "b"}, {"a"}, {"a", "c"}]
    assert longest_match([b""] * 4, hs, 16, ["a", "b", "c"]) == {"a": 64, "b": 32}


def test_all_policies_route_somewhere():
    ws = ["a", "b", "c"]
    for name, make in POLICIES.items():
        pol = make()
        for i in range(20):
            d = pol.route(RouteRequest(64, [bytes([i % 4]) * 16] * 4, tenant=f"t{i % 5}"), _view(ws))
            assert d.worker in ws, name


def test_simulated_cache_notifies_the_index_and_sim_runs():
    from sglang_tiered.core.keys import CacheKey, chain_page_hashes
    from sglang_tiered.fleet.sim import SimIndex, simulate
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

    cache = TieredRadixCache.create_simulated(256, page_size=16, host_pages=8)
    idx = SimIndex()
    cache.attach_index(idx.listener("s0"))
    seed = CacheKey().namespace_seed("t", None)
    toks = list(range(16, 16 + 160))
    for _ in range(3):
        cache.driver.run(toks, tenant="t")
    hs = chain_page_hashes(seed, toks, 16)
    assert idx.matched(hs, 16, ["s0"]).get("s0", 0) > 0
    # flood the small device pool + T1: dropped pages leave the index
    for j in range(40):
        cache.driver.run(list(range(100 + 7 * j, 100 + 7 * j + 160)), tenant="u")
    held = set(idx.holders)
    assert len(held) <= 256 // 16 + 8 + 10  # device + T1 (+ pages of the request in flight)

    class S:
        def __init__(self):
            self.c = TieredRadixCache.create_simulated(512, page_size=16)

        def attach_index(self, listener):
            self.c.attach_index(listener)

        def run(self, tokens, tenant):
            o = self.c.driver.run(tokens, tenant=tenant)
            return o.prompt_len, o.cached_len

    reqs = [(list(range(20, 20 + 64 + 16 * (i % 3))), f"t{i % 4}") for i in range(40)]
    res = simulate(reqs, {"a": S(), "b": S()}, AffinityCachePolicy(k=1),
                   lambda t, ten: chain_page_hashes(CacheKey().namespace_seed(ten, None), t, 16))
    assert res.requests == 40 and res.hit_rate > 0.5


def test_publisher_survives_redis_down():
    from sglang_tiered.fleet.publisher import IndexPublisher

    pub = IndexPublisher("redis://127.0.0.1:1/0", "s0", ttl_s=5, socket_timeout_s=0.05)
    try:
        t0 = time.perf_counter()
        for i in range(2000):
            pub.on_store([bytes([i % 256]) * 16])
        assert time.perf_counter() - t0 < 0.5  # never blocks the scheduler
        deadline = time.time() + 5
        while pub.stats["errors"] == 0 and time.time() < deadline:
            time.sleep(0.05)
        snap = pub.snapshot()
        assert snap["errors"] >= 1 and not snap["connected"]
    finally:
        pub.close()


def test_index_config_validation():
    cfg = load_config({"SGLANG_TIERED_INDEX_URL": "redis://127.0.0.1:6390/0",
                       "SGLANG_TIERED_SERVER_ID": "http://127.0.0.1:30001"})  # fmt: skip
    assert cfg.index_url and cfg.server_id == "http://127.0.0.1:30001" and cfg.index_ttl_s == 30.0
    assert load_config({}).index_url is None
    for bad in ({"SGLANG_TIERED_INDEX_URL": "redis://127.0.0.1:6390"},  # no server id
                {"SGLANG_TIERED_INDEX_URL": "http://x", "SGLANG_TIERED_SERVER_ID": "a"},
                {"SGLANG_TIERED_INDEX_URL": "redis://h:1", "SGLANG_TIERED_SERVER_ID": "a b"},
                {"SGLANG_TIERED_INDEX_TTL_S": "0.5"}, {"SGLANG_TIERED_INDEX_TTL_S": "inf"}):  # fmt: skip
        with pytest.raises(ConfigError):
            load_config(bad)
