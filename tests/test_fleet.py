"""Fleet routing (pure), the simulator core, the index hook in TieredRadixCache, the publisher's
failure behaviour and its configuration."""

from __future__ import annotations

import contextlib
import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

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
    req = RouteRequest(1000, [b"x" * 16] * 10, tenant="acme")
    homes = rendezvous_top_k(b"t:acme", ws, 3)

    def pol(**kw):
        p = AffinityCachePolicy(**{"k": 3, "c_tok_s": 1e-3, "followers": 0.0, "per_prefix": False, **kw})
        for i in range(40):  # the key has history (1 request in 40: a small share): its k homes apply
            p._record(b"t:acme" if i == 0 else b"other%d" % i, len(ws))
        return p

    d = pol().route(req, _view(ws))
    assert d.worker == homes[0] and d.home and not d.spill
    # the least loaded home takes it (all homes share the key's load)
    load = {w: 1.0 for w in ws}
    load[homes[0]] = 2.0
    assert pol().route(req, _view(ws, load)).worker == homes[1]
    # all homes over the hatch -> spill to the least loaded
    for h in homes:
        load[h] = 50.0
    d = pol().route(req, _view(ws, load))
    assert d.spill and d.worker not in homes and d.reason == "spill"
    # a warmer non-home wins exactly when matched x c_tok > extra queue delay
    other = next(w for w in ws if w not in homes)
    m = {other: 160}  # 160 tokens x 1 ms = 160 ms of recompute saved
    assert pol().route(req, _view(ws, matched=m)).worker == other
    q = {w: 0.0 for w in ws}
    q[other] = 0.2  # 200 ms of extra queue: not worth it
    assert pol().route(req, _view(ws, queue=q, matched=m)).worker == homes[0]
    # ... a match below warm_frac of the prompt is ignored, and so is a worker over the hatch
    assert pol(warm_frac=0.2).route(req, _view(ws, matched=m)).worker == homes[0]
    load = {w: 1.0 for w in ws}
    load[other] = 50.0
    assert pol().route(req, _view(ws, load, matched=m)).worker == homes[0]
    # no index (Redis down): affinity + load only
    assert pol().route(req, _view(ws, matched=None)).worker == homes[0]
    # a cold request leaves a home above cold_over x the mean load (not a spill)
    load = {w: 1.0 for w in ws}
    for h in homes:
        load[h] = 2.5
    d = pol(cold_over=1.15).route(req, _view(ws, load))
    assert d.worker not in homes and d.reason == "cold" and not d.spill


def test_policy_new_keys_two_choices_hot_keys_more_homes():
    ws = [f"w{i}" for i in range(8)]
    pol = AffinityCachePolicy(k=1, per_prefix=False, horizon=4)
    key = b"t:hot"
    top2 = rendezvous_top_k(key, ws, 2)
    load = {w: 1.0 for w in ws}
    load[top2[0]] = 2.0
    req = RouteRequest(64, [b"h" * 16] * 4, tenant="hot")
    # a key never seen: the less loaded of its first two homes
    assert pol.homes(key, ws) == top2
    assert pol.route(req, _view(ws, load)).worker == top2[1]
    # seen once in a window of 32: one home (share x N / home_share = 1/32 x 8 / 0.8 < 1)
    assert pol.homes(key, ws) == top2[:1]
    # a key with half of the window's requests: 0.5 x 8 / 0.8 = 5 homes
    for i in range(31):
        pol.route(RouteRequest(64, [bytes([i]) * 16] * 4, tenant="hot" if i % 2 else f"c{i}"), _view(ws))
    assert pol._count[key] == 16 and len(pol._window) == 32
    assert pol.homes(key, ws) == rendezvous_top_k(key, ws, 5)
    # membership: a key's homes are a rendezvous prefix, so a leaving worker moves only its keys
    assert set(pol.homes(key, ws[:-1])) - set(pol.homes(key, ws)) <= {rendezvous_top_k(key, ws[:-1], 5)[-1]}


class KeyWindowMachine(RuleBasedStateMachine):
    """The policy's key window (bounded memory for per-key load shares) against a plain list."""

    def __init__(self):
        super().__init__()
        self.n = 3
        self.pol = AffinityCachePolicy(horizon=2, memory_pages=3, inflow_horizon=2)
        self.model: list = []
        self.routed: list = []  # workers routed to, the inflow window's model
        self.sent: dict = {}  # page hash -> last worker (the memory's model, unbounded)
        self.order: list = []  # page hashes, least recently sent first

    @rule(key=st.sampled_from([b"a", b"b", b"c", b"d"]), n=st.integers(1, 4))
    def route(self, key, n):
        self.n = n
        ws = [f"w{i}" for i in range(n)]
        pages = [key * 16, key * 8 + b"x" * 8]
        d = self.pol.route(RouteRequest(32, pages, key=key), _view(ws, matched={}))
        assert d.worker in ws
        self.model = (self.model + [key])[-2 * n :]
        self.routed = (self.routed + [d.worker])[-2 * n :]
        for h in pages:
            self.sent[h] = d.worker
            self.order = [x for x in self.order if x != h] + [h]

    @invariant()
    def window_matches_model(self):
        assert list(self.pol._window) == self.model
        assert self.pol._count == {k: self.model.count(k) for k in set(self.model)}
        assert len(self.pol._window) <= self.pol.horizon * 4

    @invariant()
    def memory_is_the_last_sends_bounded(self):
        keep = self.order[-3:]
        assert list(self.pol._sent) == keep
        assert all(self.pol._sent[h] == self.sent[h] for h in keep)


    @invariant()
    def inflow_is_the_window_sum_bounded(self):
        win = list(self.pol._inflows.window)
        assert [w for w, _ in win] == self.routed
        assert all(0 <= t <= 32 for _, t in win)
        for w, total in self.pol._inflows.by_worker.items():
            assert total == sum(t for x, t in win if x == w)


TestKeyWindow = KeyWindowMachine.TestCase
TestKeyWindow.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)


def test_routing_memory_returns_a_family_where_it_was_sent():
    ws = [f"w{i}" for i in range(6)]
    pages = [bytes([i]) * 16 for i in range(8)]
    req = RouteRequest(128, pages, tenant="acme")
    pol = AffinityCachePolicy(per_prefix=False)
    for w in ws:  # a fleet that has been busy, evenly: the load bound is not what moves requests here
        pol._long.add(w, 10_000.0, 1 << 20)
    other = next(w for w in ws if w not in rendezvous_top_k(b"t:acme", ws, 2))
    assert pol.route(req, _view(ws, matched={other: 128})).worker == other  # the index: warm there
    # evicted there (the index forgets): the memory still sends the family back
    d = pol.route(req, _view(ws, matched={}))
    assert d.worker == other and d.reason == "warm"
    # Redis down: the memory is the router's own, the family stays where it was sent
    assert pol.route(req, _view(ws, matched=None)).worker == other
    # ... and a prompt it never sent goes by affinity + load (no fresh placement without the index)
    new = RouteRequest(128, [bytes([100 + i]) * 16 for i in range(8)], tenant="acme")
    d = pol.route(new, _view(ws, matched=None))
    assert d.worker in rendezvous_top_k(b"t:acme", ws, 2) and d.reason != "fresh"
    # off: the cold rule decides
    off = AffinityCachePolicy(per_prefix=False, memory_pages=0)
    off.route(req, _view(ws, matched={other: 128}))
    assert off.route(req, _view(ws, matched={})).worker != other


def test_fresh_content_goes_to_the_least_inflow_worker():
    ws = [f"w{i}" for i in range(4)]
    pol = AffinityCachePolicy(per_prefix=False, memory_pages=0, hatch_load="view")
    pol._inflows.by_worker.update({"w0": 500, "w1": 100, "w2": 300, "w3": 900})
    fresh = RouteRequest(160, [bytes([i]) * 16 for i in range(10)], tenant="acme")
    # nobody holds warm_frac (10 %) of it: new content -> least inflow (w1), whatever the homes
    d = pol.route(fresh, _view(ws, matched={"w0": 8}))
    assert d.worker == "w1" and d.reason == "fresh"
    assert pol._inflows.by_worker["w1"] == 100 + 160  # it now holds the prompt: counted as inflow
    # ... unless that worker is over the hatch
    pol._inflows.by_worker.update({"w0": 500, "w1": 100, "w2": 300, "w3": 900})
    load = {w: 1.0 for w in ws}
    load["w1"] = 50.0
    assert pol.route(fresh, _view(ws, load, matched={})).worker == "w2"
    # a match of at least warm_frac: locality, not placement
    assert pol.route(fresh, _view(ws, matched={"w3": 32})).reason != "fresh"
    # Redis down, or no page hashes yet (CacheKey unknown): affinity + load, the homes keep the tenant
    homes = rendezvous_top_k(b"t:acme", ws, 2)
    other = RouteRequest(160, [bytes([50 + i]) * 16 for i in range(10)], tenant="acme")
    assert pol.route(other, _view(ws, matched=None)).worker in homes
    assert pol.route(RouteRequest(160, [], tenant="acme"), _view(ws, matched={})).worker in homes
    # off: the cold rule (homes)
    off = AffinityCachePolicy(per_prefix=False, memory_pages=0, fresh=False)
    off._inflows.by_worker.update({"w0": 500, "w1": 100, "w2": 300, "w3": 900})
    assert off.route(fresh, _view(ws, matched={})).worker in homes


def test_fresh_content_by_queue_goes_where_it_starts_soonest():
    """``fresh_by="queue"``: new content goes to the worker with the least work queued ahead
    (FleetView.queue_s), ties by inflow; never to a worker over the hatch."""
    ws = [f"w{i}" for i in range(4)]
    pol = AffinityCachePolicy(per_prefix=False, memory_pages=0, hatch_load="view", fresh_by="queue")
    pol._inflows.by_worker.update({"w0": 500, "w1": 100, "w2": 300, "w3": 900})
    fresh = RouteRequest(160, [bytes([i]) * 16 for i in range(10)], tenant="acme")
    queue = {"w0": 0.2, "w1": 0.5, "w2": 0.0, "w3": 0.0}
    d = pol.route(fresh, _view(ws, queue=queue, matched={}))
    assert d.worker == "w2" and d.reason == "fresh"  # w2 and w3 have nothing queued: w2 took less inflow
    load = {w: 1.0 for w in ws}
    load["w2"] = 50.0  # over the hatch
    assert pol.route(fresh, _view(ws, load, queue, matched={})).worker == "w3"


def test_sim_p90_is_the_nearest_rank_quantile():
    from sglang_tiered.fleet.sim import _quantile

    assert _quantile([], 0.9) == 0.0
    assert _quantile([3.0], 0.9) == 3.0
    assert _quantile([float(i) for i in range(1, 11)], 0.9) == 9.0
    assert _quantile([float(i) for i in range(10, 0, -1)], 0.5) == 5.0


def test_hatch_reads_the_sustained_work_share_not_in_flight_counts():
    """The hatch (spill) reads the policy's own routed work over the last horizon x N requests: a
    transient pile-up of requests in flight on the warm worker does not spill its family (live, 6
    clients on 3 servers, 5 of 6 in flight on one worker is common and is gone a request later);
    a worker that took a sustained excess of the work is over it whatever it has in flight."""
    ws = ["w0", "w1", "w2"]
    fam = [bytes([7, i]) * 8 for i in range(10)]
    req = RouteRequest(160, fam, tenant="acme")
    pol = AffinityCachePolicy(per_prefix=False, memory_pages=0, horizon=4)
    for i in range(12):  # even work: 4 requests each
        pol._count_share(ws[i % 3], 100, 160, len(ws))
    spike = {"w0": 5.0, "w1": 1.0, "w2": 0.0}  # 5 of 6 in flight on w0 right now
    d = pol.route(req, _view(ws, spike, matched={"w0": 160}))
    assert d.worker == "w0" and d.reason in ("warm", "home") and not d.spill
    view_pol = AffinityCachePolicy(per_prefix=False, memory_pages=0, hatch_load="view")
    assert view_pol.route(req, _view(ws, spike, matched={"w0": 160})).worker != "w0"  # the old reading spilled
    # sustained: w0 took most of the window's work -> over the hatch ("share" alone; the default
    # "both" also needs the in-flight count over it), its warm match is not taken
    for mode, load in (("share", {w: 1.0 for w in ws}), ("both", spike)):
        pol = AffinityCachePolicy(per_prefix=False, memory_pages=0, horizon=4, hatch_load=mode)
        for i in range(12):
            pol._count_share("w0" if i % 2 else ws[i % 3], 400 if i % 2 else 50, 400, len(ws))
        assert pol.over(_view(ws, load), "w0") and not pol.over(_view(ws, load), "w1")
        d = pol.route(req, _view(ws, load, matched={"w0": 160}))
        assert d.worker != "w0"
    assert not pol.over(_view(ws), "w0")  # "both": a sustained share with nothing in flight is not over
    shares = pol._shares
    assert len(shares.window) == 12 and abs(sum(shares.by_worker.values()) - sum(x for _, x, _ in shares.window)) < 1e-6
    assert abs(shares.full - sum(f for _, _, f in shares.window)) < 1e-6


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
        slowest = 0.0
        for i in range(2000):
            t0 = time.perf_counter()
            pub.on_store([bytes([i % 256]) * 16])
            slowest = max(slowest, time.perf_counter() - t0)
        # never blocks the scheduler: each call is a queue put (the slowest call, not the total: on
        # 2 busy cores the 2,000 calls took up to 4 s of wall time, all of it waiting for a CPU)
        assert slowest < 0.25
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


def test_token_affinity_key_is_stable_and_groups_families():
    from sglang_tiered.fleet.routing import token_affinity_key

    a = list(range(100, 140))  # 2.5 pages
    assert token_affinity_key("acme", a, 16) == token_affinity_key("acme", a[:16] + [7] * 30, 16)  # same first page
    assert token_affinity_key("acme", a, 16) != token_affinity_key("other", a, 16)  # tenants never share
    assert token_affinity_key("acme", a[:10], 16) == b"t:acme"  # under a page: the tenant
    assert token_affinity_key("acme", a, 16, per_prefix=False) == b"t:acme"
    assert token_affinity_key(None, a, 16) == token_affinity_key(None, a[:32] + [1], 16)  # first 2 pages
    assert token_affinity_key(None, a, 16) != token_affinity_key(None, a[:16] + [1] * 16, 16)
    assert token_affinity_key(None, a[:5], 16) == b"p:"


def test_router_load_is_own_counts_raised_to_polled_v1_loads():
    """The router's load view: its in-flight counts, raised to what each worker reports at /v1/loads
    (traffic that bypasses this router); a failing or stale report is ignored."""
    import asyncio

    from aiohttp import web

    from sglang_tiered.fleet.router import Router

    async def main():
        reports = {"busy": {"loads": [{"num_running_reqs": 3, "num_waiting_reqs": 4, "num_waiting_uncached_tokens": 900},
                                      {"num_running_reqs": 1, "num_waiting_reqs": 0, "num_waiting_uncached_tokens": 100}]},
                   "broken": None}  # fmt: skip
        runners, urls = [], {}
        for name, doc in reports.items():
            app = web.Application()

            async def loads(_, doc=doc):
                return web.json_response(doc) if doc is not None else web.Response(status=500)

            app.router.add_get("/v1/loads", loads)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            urls[name] = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        r = Router(list(urls.values()), load_poll_s=2.0)  # poll timeout 4 s: a loaded CI machine
        import aiohttp

        r._session = aiohttp.ClientSession()
        try:
            busy, broken = r.workers[urls["busy"]], r.workers[urls["broken"]]
            busy.inflight, busy.inflight_tokens = 2, 50
            broken.inflight, broken.inflight_tokens = 5, 70
            assert busy.load(8.0) == (2.0, 50.0)  # nothing polled yet: own counts
            await r.poll_loads()
            assert busy.load(8.0) == (8.0, 1000.0)  # summed over DP ranks, above own counts
            assert broken.load(8.0) == (5.0, 70.0)
            assert r.stats.load_polls == 1 and r.stats.load_poll_errors == 1
            busy.inflight = 11
            assert busy.load(8.0) == (11.0, 1000.0)  # own count when higher
            busy.polled_at -= 10.0  # stale: own counts only
            assert busy.load(8.0) == (11.0, 50.0)
            d = await r.choose([1] * 64, "acme")
            assert d.worker in urls.values()
        finally:
            await r._session.close()
            for runner in runners:
                await runner.cleanup()

    asyncio.run(main())
    with pytest.raises(ValueError):
        Router(["http://127.0.0.1:1"], load_poll_s=-1)


def test_router_load_takes_finished_requests_off_the_last_report():
    """A /v1/loads report counts this router's requests in flight when it was asked for; those that
    finished since are taken off it (a sequential client saw the worker that served its previous
    request as busy for up to 1 s, and the cold rule moved the next request off its home)."""
    import time

    from sglang_tiered.fleet.router import WorkerState

    ws = WorkerState("http://w")
    ws.inflight, ws.inflight_tokens = 1, 100  # one request of ours, sent before the poll
    started = time.monotonic()
    ws.polled(2, 300, sent_at=started + 0.01)  # it, and one from elsewhere (200 uncached tokens)
    assert ws.load(1.0) == (2.0, 300.0)
    ws.inflight += 1
    ws.inflight_tokens += 50
    ws.finished(started + 0.02, 50)  # sent after the poll: the report did not count it
    assert ws.load(1.0) == (2.0, 300.0) and ws.done_since_poll == 0
    ws.finished(started, 100)  # ours, counted by the report, has finished
    assert (ws.inflight, ws.inflight_tokens) == (0, 0)
    assert ws.load(1.0) == (1.0, 200.0)  # the other one is still there
    ws.polled(0, 0, sent_at=time.monotonic())  # a new report starts over
    assert ws.load(1.0) == (0.0, 0.0) and ws.done_since_poll == 0


def test_router_memory_keeps_families_without_the_index():
    """The routing memory needs no CacheKey from the index: a router with Redis down from the start
    keeps a family where its first request went (the less loaded of its two new-key homes), not on
    its one home from the second request on (memory keyed by the servers' page hashes, which need
    the CacheKey, remembered nothing)."""
    import asyncio

    from sglang_tiered.fleet.router import Router
    from sglang_tiered.fleet.routing import token_affinity_key

    async def main():
        urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
        r = Router(urls, redis_url=None, page_size=16)
        tokens = list(range(1000, 1160))  # 10 pages
        top = rendezvous_top_k(token_affinity_key("acme", tokens, 16), urls, 2)
        r.workers[top[0]].inflight = 1  # the first home busy: the new key goes to its second
        d = await r.choose(tokens, "acme")
        assert d.worker == top[1] and r.cache_key is None
        r.workers[top[0]].inflight = 0
        r.workers[top[1]].inflight = 1
        d = await r.choose(tokens[:150] + [7] * 10, "acme")  # its next request, the home now idle
        assert d.worker == top[1] and d.reason == "warm", d
        assert r.memory_hashes_of(tokens, "other")[0] != r.memory_hashes_of(tokens, "acme")[0]  # tenants apart

    asyncio.run(main())


def test_publisher_batch_last_event_wins():
    """Events folded into one batch: a page's last event decides whether it is sent as stored or as
    removed (removals go out before stores, so a page stored then evicted in one batch was left in
    the index as held)."""
    from sglang_tiered.fleet.publisher import IndexPublisher

    pub = IndexPublisher("redis://127.0.0.1:1/0", "s0", start=False)
    a, b, c, d = (bytes([i]) * 16 for i in range(4))
    stored, removed = pub._apply_local([("s", [a, b]), ("r", [a]), ("r", [c]), ("s", [c])])
    assert stored == [b, c] and removed == [a]
    assert list(pub._held) == [b, c]
    stored, removed = pub._apply_local([("s", [d]), ("c", None), ("s", [a])])
    # (a clear's pages go to the withdrawals, sent before these, minus those held again: session 41)
    assert stored == [a] and not removed and sorted(pub._take_unsent(8)) == sorted([b, c, d])
    assert list(pub._held) == [a] and not pub._unsent


@contextlib.contextmanager
def _redis_server():
    """A throwaway redis-server on 127.0.0.1 (skips the test when none is installed), accepting
    connections: yields (process, port); killed at exit."""
    from sglang_tiered.dev.server import RedisMissing, free_port, start_redis

    pytest.importorskip("redis")
    port = free_port()
    try:
        p = start_redis(port)
    except RedisMissing as exc:
        pytest.skip(str(exc))
    try:
        yield p, port
    finally:
        p.kill()
        p.wait(timeout=10)


def test_index_lookup_script_matches_the_python_rule():
    """LOOKUP_LUA (one EVALSHA per routed request) against holders_from_replies + longest_match on a
    real redis-server: random holders, stale entries, a worker whose heartbeat expired, odd values."""
    import random

    redis = pytest.importorskip("redis")
    from sglang_tiered.fleet.index import (LOOKUP_LUA, alive_key, holders_from_replies, matched_from_lookup,
                                           page_key)  # fmt: skip

    with _redis_server() as (_, port):
        r = redis.Redis(port=port)
        lookup = r.register_script(LOOKUP_LUA)
        rng = random.Random(0)
        workers = ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3", "w4"]
        ttl, now = 30.0, time.time()
        deep = 0
        for case in range(60):
            r.flushall()
            alive = {w: rng.random() < 0.85 for w in workers}
            for w, a in alive.items():
                if a:
                    r.set(alive_key(w), "1")
            hashes = [bytes([case, i]) * 8 for i in range(rng.randint(0, 12))]
            for i, h in enumerate(hashes):
                for w in workers:
                    x = rng.random()
                    if x < 0.6 - 0.03 * i:
                        r.hset(page_key(h), w, str(int(now) - rng.choice([0, 1, 5])))
                    elif x < 0.7:
                        r.hset(page_key(h), w, str(int(now - ttl - 5)))  # stale
                    elif x < 0.72:
                        r.hset(page_key(h), w, "junk")
            replies = [r.hgetall(page_key(h)) for h in hashes]
            want = longest_match(hashes, holders_from_replies(replies, alive, ttl, now), 16, workers)
            got = matched_from_lookup(lookup(keys=[alive_key(w) for w in workers] + [page_key(h) for h in hashes],
                                             args=[len(workers), now, ttl, *workers]), 16)  # fmt: skip
            assert got == want, (case, got, want)
            deep += any(m >= 48 for m in want.values())
        assert deep >= 10  # the cases reach past the first pages


# ---------------------------------------------------------------------------- decision replay
# Digests of the decisions below, recorded from the policy and router before the CPU work of issue
# #13 (git fd05ab0): the router's per-request CPU may change, its decisions may not.
REPLAY_DIGESTS = {
    # since the hatch's share counts the index's match, not the memory's (share_by_index): changed
    # on purpose for every configuration whose hatch reads the share with an index
    "policy:default": "32b0f73e628af567",
    "policy:view": "668f1294adc66413",
    "policy:share": "adceb8e052227b15",
    "policy:nofresh": "bf877c2e497de694",
    "policy:tenant": "5664cfed0b604487",
    "policy:warm_over_hatch": "b92bea2690cc3414",
    "router:index": "a75e2d9fb31eb176",
    "router:noindex": "7ed9b2f3373be67d",
}
# Before share_by_index (git dae6791): with share_by_index=False the policy still decides exactly so.
REPLAY_DIGESTS_MEMSHARE = {
    "policy:default": "a6ffab4ac4f33356",
    "policy:view": "668f1294adc66413",
    "policy:share": "563d08258f8738b4",
    "policy:nofresh": "af3d53e7ebc8ad25",
    "policy:tenant": "301748c0c5828a04",
    "policy:warm_over_hatch": "b92bea2690cc3414",
    "router:index": "9621cf153ec719cf",
    "router:noindex": "7ed9b2f3373be67d",
}


# With the warm cap (session 22, ``warm_cap``, on by default): the configurations whose replay
# reaches a warm worker over the hatch decide differently on purpose; with ``warm_cap=0`` every
# configuration still decides exactly as recorded above (so the cap is all that changed).
REPLAY_DIGESTS_CAP = {**REPLAY_DIGESTS, "policy:view": "87a1082dc6917830", "policy:share": "e7e325915b5e146f",
                      "policy:nofresh": "4862ee0576f04fbf", "policy:tenant": "a91e01bc66d19111",
                      "router:index": "5c9d031cb045720f"}  # fmt: skip
REPLAY_DIGESTS_MEMSHARE_CAP = {**REPLAY_DIGESTS_MEMSHARE, "policy:view": "a13fa41b08ad3926",
                               "policy:share": "06fb6a873a0363fe", "policy:tenant": "f5049f92108bc08b",
                               "router:index": "973d1498d33e973e"}  # fmt: skip
# With the load bound (session 31, ``cap_all``, on by default): every configuration decides
# differently on purpose (the replay's random loads and memberships reach the bound); with
# ``cap_all=False`` every one decides exactly as REPLAY_DIGESTS_CAP / _MEMSHARE_CAP, and with
# ``warm_cap=0`` (the bound's yardstick off) as REPLAY_DIGESTS: the bound is all that changed.
REPLAY_DIGESTS_BOUND = {
    "policy:default": "8051676e865335c4", "policy:view": "3015e640e090debb", "policy:share": "18c2e56c0b0eee28",
    "policy:nofresh": "6196b5c765cdd70c", "policy:tenant": "aeb6193422769281",
    "policy:warm_over_hatch": "c72d7585b548a872", "router:index": "d943d8dd13c77b57",
    "router:noindex": "c6e1f6f6fe8a1737"}  # fmt: skip
REPLAY_DIGESTS_MEMSHARE_BOUND = {
    "policy:default": "aabcb638b7780187", "policy:view": "db214c942d79eaa0", "policy:share": "4d571382734ba84c",
    "policy:nofresh": "b8d7a706cfb6e2a9", "policy:tenant": "35f1e55f23f4eb44",
    "policy:warm_over_hatch": "faa4347369d46630", "router:index": "1ecac81ea975d53c",
    "router:noindex": "c6e1f6f6fe8a1737"}  # fmt: skip


def _replay_requests(seed: int, n: int):
    """A seeded request sequence: tenants (and none) with prompt families that share prefixes,
    the workers (membership changes), their loads and queues, and what each holds of the prompt."""
    import random

    rng = random.Random(seed)
    fams = [[rng.randrange(50_000) for _ in range(rng.randrange(16, 400))] for _ in range(24)]
    pool = [f"http://127.0.0.1:{6000 + i}" for i in range(9)]
    out = []
    for i in range(n):
        ws = pool[: 3 + (i // 100) % 6] if i % 37 else pool[1 : 4 + (i // 100) % 6]
        tenant = rng.choice(["acme", "beta", "gamma", "delta", None, ""])
        fam = fams[rng.randrange(len(fams))]
        tokens = fam[: rng.randrange(1, len(fam) + 1)] + [rng.randrange(50_000) for _ in range(rng.randrange(0, 60))]
        load = {w: float(rng.choice([0, 0, 1, 2, 3, 5, 9])) for w in ws}
        queue = {w: rng.random() * 0.05 for w in ws}
        held = {w: 16 * rng.randrange(0, len(tokens) // 16 + 1) for w in ws if rng.random() < 0.4}
        out.append((ws, tenant, tokens, load, queue, held, rng.random() < 0.15))
    return out


def _digest(rows) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]


def _policy_replay(kw: dict) -> str:
    from sglang_tiered.core.keys import chain_page_hashes
    from sglang_tiered.fleet.routing import token_affinity_key

    pol = AffinityCachePolicy(**kw)
    rows = []
    for ws, tenant, tokens, load, queue, held, no_index in _replay_requests(1, 600):
        hashes = chain_page_hashes((tenant or "-").encode(), tokens, 16)
        key = token_affinity_key(tenant, tokens, 16, pol.affinity_pages, pol.per_prefix) if len(rows) % 2 else None
        req = RouteRequest(len(tokens), hashes, tenant or None, 16, key=key)
        d = pol.route(req, FleetView(ws, load, queue, None if no_index else held))
        rows.append([d.worker, d.reason, d.spill, d.home, d.matched])
    return _digest(rows)


@pytest.mark.parametrize("name,kw", [
    ("policy:default", {}), ("policy:view", {"hatch_load": "view"}), ("policy:share", {"hatch_load": "share"}),
    ("policy:nofresh", {"fresh": False}), ("policy:tenant", {"per_prefix": False}),
    ("policy:warm_over_hatch", {"warm_over_hatch": True, "memory_pages": 64})])  # fmt: skip
def test_policy_replay_decisions_unchanged(name, kw):
    """600 seeded requests (tenants, families, membership changes, loads, index matches, index down)
    through the policy: the same decisions, in order, as recorded (and, with share_by_index off, as
    before it; with the load bound off, as before the bound; with warm_cap off, as before the cap)."""
    assert _policy_replay(kw) == REPLAY_DIGESTS_BOUND[name], name
    assert _policy_replay({**kw, "share_by_index": False}) == REPLAY_DIGESTS_MEMSHARE_BOUND[name], name
    assert _policy_replay({**kw, "cap_all": False}) == REPLAY_DIGESTS_CAP[name], name
    assert _policy_replay({**kw, "share_by_index": False, "cap_all": False}) == REPLAY_DIGESTS_MEMSHARE_CAP[name], name
    assert _policy_replay({**kw, "warm_cap": 0.0}) == REPLAY_DIGESTS[name], name
    assert _policy_replay({**kw, "share_by_index": False, "warm_cap": 0.0}) == REPLAY_DIGESTS_MEMSHARE[name], name


def _router_replay(with_index: bool, policy_kw: dict | None = None) -> str:
    import asyncio
    from array import array

    from sglang_tiered.core.keys import CacheKey
    from sglang_tiered.fleet.router import Router

    reqs = _replay_requests(2, 400)
    pool = sorted({w for r in reqs for w in r[0]})
    router = Router(pool, redis_url=None, load_poll_s=0, policy_kw=policy_kw)
    router.cache_key = CacheKey(model_id="replay")
    rows = []

    async def run():
        for ws, tenant, tokens, load, _, held, no_index in reqs:
            for w, s in router.workers.items():
                s.healthy = w in ws
                s.inflight = int(load.get(w, 0))
                s.inflight_tokens = int(100 * load.get(w, 0))

            async def matched(hashes, workers, *_, held=held, no_index=no_index):
                if not with_index or no_index:
                    return None
                assert len(hashes) == min(len(tokens), 512 * 16) // 16
                return {w: m for w, m in held.items() if w in workers}

            router.matched = matched
            explain: dict = {}
            ids = array("q", tokens) if len(rows) % 2 else tokens  # handle() passes an array
            d = await router.choose(ids, tenant or None, explain=explain)
            rows.append([d.worker, d.reason, d.spill, d.home, d.matched, explain["memory"], explain["index"]])

    asyncio.run(run())
    return _digest(rows)


@pytest.mark.parametrize("with_index", [True, False])
def test_router_replay_decisions_unchanged(with_index):
    """400 seeded requests through Router.choose (token ids -> page hashes, routing memory, affinity
    key, load): the same decisions and explanations as recorded (and, with share_by_index off, as
    before it)."""
    name = "router:index" if with_index else "router:noindex"
    assert _router_replay(with_index) == REPLAY_DIGESTS_BOUND[name], name
    assert _router_replay(with_index, {"share_by_index": False}) == REPLAY_DIGESTS_MEMSHARE_BOUND[name], name
    assert _router_replay(with_index, {"cap_all": False}) == REPLAY_DIGESTS_CAP[name], name
    assert _router_replay(with_index, {"share_by_index": False, "cap_all": False}) == REPLAY_DIGESTS_MEMSHARE_CAP[name], name
    assert _router_replay(with_index, {"warm_cap": 0.0}) == REPLAY_DIGESTS[name], name
    assert _router_replay(with_index, {"share_by_index": False, "warm_cap": 0.0}) == REPLAY_DIGESTS_MEMSHARE[name], name


def test_lookup_connection_matches_redis_py_and_survives_cancel_reset_and_redis_down():
    """The router's pipelined EVALSHA connection: the same replies as redis-py's registered script,
    under 50 concurrent lookups, a cancelled one (its late reply is dropped, the next still gets its
    own, I1), a flushed script cache (NOSCRIPT: loaded again), a reset, and Redis gone (I2)."""
    import asyncio

    redis = pytest.importorskip("redis")
    pytest.importorskip("hiredis")
    from sglang_tiered.fleet.index import LOOKUP_LUA, LookupConnection, alive_key, page_key

    with _redis_server() as (p, port):
        r = redis.Redis(port=port, db=2)
        ref = r.register_script(LOOKUP_LUA)
        now = time.time()
        r.set(alive_key("a"), 1)
        r.set(alive_key("b"), 1)
        hashes = [bytes([i]) * 16 for i in range(5)]
        for i, h in enumerate(hashes):
            r.hset(page_key(h), "a", int(now))
            if i < 2:
                r.hset(page_key(h), "b", int(now))
        keys = [alive_key("a"), alive_key("b")] + [page_key(h) for h in hashes]

        async def run():
            conn = LookupConnection(f"redis://127.0.0.1:{port}/2", LOOKUP_LUA)
            args = [2, time.time(), 30.0, "a", "b"]
            want = ref(keys=keys, args=args)
            assert await conn.evalsha(keys, args) == want == [b"a", 5, b"b", 2]
            assert await asyncio.gather(*(conn.evalsha(keys, args) for _ in range(50))) == [want] * 50
            late = asyncio.ensure_future(conn.evalsha(keys[:3], args))
            await asyncio.sleep(0)
            late.cancel()
            assert await conn.evalsha(keys, args) == want
            r.script_flush()
            assert await conn.evalsha(keys, args) == want
            conn.reset()
            assert await conn.evalsha(keys, args) == want
            p.kill()
            p.wait()
            for _ in range(2):  # the connection lost, then refused
                with pytest.raises(OSError):
                    await conn.evalsha(keys, args)
            conn.close()

        asyncio.run(run())


class WindowSumsMachine(RuleBasedStateMachine):
    """WindowSums (the hatch's work share and the cache inflow) against a plain list of entries."""

    def __init__(self):
        super().__init__()
        from sglang_tiered.fleet.routing import WindowSums

        self.with_full = None
        self.sums = WindowSums(0)
        self.model: list = []  # (worker, value, full) in order, the last `limit` of them

    @rule(w=st.sampled_from(["w0", "w1", "w2"]), value=st.integers(0, 500), full=st.integers(0, 500),
          limit=st.integers(1, 6), with_full=st.booleans())  # fmt: skip
    def add(self, w, value, full, limit, with_full):
        if self.with_full is None:
            self.with_full = with_full  # a window sums full values for all its entries or none
        self.sums.add(w, value, limit, full if self.with_full else None)
        self.model = (self.model + [(w, value, full if self.with_full else 0)])[-limit:]

    @invariant()
    def sums_are_the_window_sums(self):
        check_window_sums(self.sums)
        assert [e[0] for e in self.sums.window] == [w for w, _, _ in self.model]
        for w in ("w0", "w1", "w2"):
            assert self.sums.by_worker.get(w, 0) == sum(v for x, v, _ in self.model if x == w)
        assert self.sums.full == sum(f for _, _, f in self.model)


def check_window_sums(sums) -> None:
    """WindowSums' I1 from its own window."""
    by: dict = {}
    for e in sums.window:
        by[e[0]] = by.get(e[0], 0) + e[1]
    assert all(sums.by_worker.get(w, 0) == v for w, v in by.items()), f"I1 violated: {sums.by_worker=} {by=}"
    assert all(v == 0 for w, v in sums.by_worker.items() if w not in by), f"I1 violated: {sums.by_worker=}"
    assert sums.full == sum(e[2] for e in sums.window if len(e) > 2), f"I1 violated: {sums.full=}"


TestWindowSums = WindowSumsMachine.TestCase
TestWindowSums.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)


def test_warm_cap_admits_a_warm_worker_over_the_hatch_only_within_its_long_run_share():
    """A warm worker over the hatch: taken while the work routed to it over the long window (this
    request's included) stays within warm_cap x the fleet mean, refused beyond it."""
    ws = ["a", "b", "c", "d"]
    hashes = [bytes([i]) * 16 for i in range(64)]

    def route(pol, share_a):
        pol._long = WindowSums(0.0)
        for w, v in (("a", share_a), ("b", 1000.0), ("c", 1000.0), ("d", 1000.0)):
            pol._long.add(w, v, 10_000)
        pol._shares = WindowSums(0.0)
        for w, v in (("a", 4000.0), ("b", 100.0), ("c", 100.0), ("d", 100.0)):
            pol._shares.add(w, v, 10_000, 1000.0)
        load = {"a": 20.0, "b": 0.0, "c": 0.0, "d": 0.0}  # a is over the hatch by both measures
        view = FleetView(ws, load, {w: 0.0 for w in ws}, {"a": 1024})
        return pol.route(RouteRequest(1024, hashes, "t", 16), view)

    from sglang_tiered.fleet.routing import WindowSums

    d = route(AffinityCachePolicy(memory_pages=0), 1000.0)  # a's long-run share: the mean
    assert d.worker == "a" and d.reason == "warm"
    d = route(AffinityCachePolicy(memory_pages=0), 2000.0)  # 2000 + 32 > 1.25 x (5000 + 32) / 4
    assert d.worker != "a"
    d = route(AffinityCachePolicy(memory_pages=0, warm_cap=0.0), 1000.0)  # no cap: the hatch rules
    assert d.worker != "a"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_load_bound_holds_on_every_decision(seed):
    """The load bound (cap_all): whatever the request, the loads and what the index says, the
    chosen worker's long-window work with this request's stays within warm_cap x the fleet mean +
    slack mean requests' work, whenever any worker does; without the bound (cap_all=False) the
    same stream breaks it (the hatch alone let one tenant's families pile up)."""
    import random

    from sglang_tiered.core.keys import chain_page_hashes

    def run(cap_all: bool) -> tuple[int, int]:
        rng = random.Random(seed)
        ws = [f"w{i}" for i in range(12)]
        fams = [[rng.randrange(50_000) for _ in range(rng.randrange(64, 600))] for _ in range(6)]
        pol = AffinityCachePolicy(cap_all=cap_all, inflow_horizon=8)
        checked = broken = 0
        for i in range(1500):
            tenant = "big" if rng.random() < 0.9 else f"t{rng.randrange(8)}"  # one tenant carries the traffic
            fam = fams[rng.randrange(len(fams))]
            tokens = fam[: rng.randrange(16, len(fam) + 1)] + [rng.randrange(50_000) for _ in range(rng.randrange(0, 80))]
            hashes = chain_page_hashes(tenant.encode(), tokens, 16)
            held = {w: 16 * rng.randrange(0, len(hashes) + 1) for w in ws if rng.random() < 0.3}
            load = {w: float(rng.choice([0, 1, 2, 3])) for w in ws}
            view = FleetView(ws, load, {w: 0.001 * load[w] for w in ws}, held if i % 7 else None)
            req = RouteRequest(len(tokens), hashes, tenant, 16)
            mview = pol._with_memory(req, view)
            fits = {}  # judged before the route (the route adds its work to the window)
            if pol._long.window:
                under = pol._cap_tests(req, mview, mview.matched or {})[1]
                fits = {w: under(w) for w in ws}
            d = pol.route(req, view)
            if any(fits.values()):
                checked += 1
                broken += not fits[d.worker]
        return checked, broken

    checked, broken = run(True)
    assert checked > 1000 and broken == 0
    assert run(False)[1] > 0
