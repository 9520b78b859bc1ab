"""Two findings left open in session 22, fixed in session 23, each with the test that failed
before its fix: a client's ``cache_salt`` was printed by /cache/stats and /metrics, and the cache
identity held no software versions."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sglang_tiered.config import ConfigError, TieredConfig, hashed_tenant_labels, load_config
from sglang_tiered.core.tenants import DEFAULT, OTHER, SALT_PREFIX, TenantTable, name_hash, salt_label


@given(salt=st.text(min_size=1))
def test_a_hashed_label_never_shows_the_salt(salt):
    table = TenantTable(hashed=True)
    label = table.label(salt)
    assert label.startswith(SALT_PREFIX) and len(label) == len(SALT_PREFIX) + 16
    assert salt not in label[len(SALT_PREFIX):] or len(salt) <= 2  # (a short salt may occur in hex by chance)
    table.for_salt(salt).requests += 1
    assert list(table.by_name) == [label] and table.by_hash == {name_hash(salt): label}


def test_hashed_labels_keep_tenants_apart_and_untagged_as_default():
    table = TenantTable(hashed=True)
    table.for_salt(None).requests += 1
    table.for_salt("default").requests += 1  # a client's salt "default" is not the untagged tenant
    table.for_salt("acme").requests += 2
    assert table.by_name[DEFAULT].requests == 1
    assert table.by_name[salt_label("default")].requests == 1
    assert table.by_name[salt_label("acme")].requests == 2
    assert "acme" not in table.by_name
    raw = TenantTable()  # the simulator's and the benchmarks' table: names as they are
    raw.for_salt("acme").requests += 1
    assert list(raw.by_name) == ["acme"]


def test_the_label_memo_and_the_hash_map_stay_bounded():
    table = TenantTable(max_tenants=8, hashed=True)
    for i in range(10_000):
        table.for_salt(f"salt-{i}").requests += 1
    assert len(table.by_name) == 9 and len(table.by_hash) == 8 and len(table._labels) <= 4 * 8 + 4
    assert table.by_name[OTHER].requests == 10_000 - 8


def test_tenant_labels_config():
    assert hashed_tenant_labels(load_config({}))  # no header: a salt is a client's secret
    assert not hashed_tenant_labels(load_config({"SGLANG_TIERED_TENANT_HEADER": "x-tenant-id"}))
    assert hashed_tenant_labels(load_config({"SGLANG_TIERED_TENANT_HEADER": "x-tenant-id",
                                             "SGLANG_TIERED_TENANT_LABELS": "hashed"}))  # fmt: skip
    assert not hashed_tenant_labels(load_config({"SGLANG_TIERED_TENANT_LABELS": "RAW"}))
    with pytest.raises(ConfigError, match="SGLANG_TIERED_TENANT_LABELS"):
        load_config({"SGLANG_TIERED_TENANT_LABELS": "md5"})
    with pytest.raises(ConfigError, match="SGLANG_TIERED_TENANT_LABELS"):
        TieredConfig(tenant_labels="plain")
    assert load_config({}).identity_versions
    assert not load_config({"SGLANG_TIERED_IDENTITY_VERSIONS": "off"}).identity_versions
    with pytest.raises(ConfigError, match="SGLANG_TIERED_IDENTITY_VERSIONS"):
        load_config({"SGLANG_TIERED_IDENTITY_VERSIONS": "yes"})


def _sim(page, hashed):
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

    cache = TieredRadixCache.create_simulated(24 * page, page, host_pages=64, debug_checks=True)
    cache.tenants.hashed = hashed
    return cache


@pytest.mark.parametrize("hashed", [False, True])
def test_t1_invalidation_counts_land_on_the_hashed_row(hashed):
    """T1 reports dropped pages by tenant hash. They were matched to the stats row by hashing the
    row's label, which is not the tenant's name once labels are hashed (or names are long): a
    tenant's T1 pages were then missing from its ``invalidated_pages``."""
    page = 16
    cache = _sim(page, hashed)
    for i in range(40):
        for t in ("acme", "globex"):
            cache.driver.run([1000 * (i % 20) + j for j in range(6 * page)], tenant=t)
    host = cache.host.tenant_pages()
    assert host.get(name_hash("acme"), 0) > 0
    assert ("acme" in cache.tenants.by_name) != hashed
    before = cache.tenant("acme").invalidated_pages
    res = cache.invalidate(tenant_hash=name_hash("acme"))
    got = cache.tenant("acme").invalidated_pages - before
    assert got * page == res["dropped_tokens"] and got > host[name_hash("acme")] > 0


def test_stats_and_metrics_never_print_a_salt():
    from sglang_tiered.integration.snapshot import stats_snapshot as rank_snapshot
    from sglang_tiered.stats import aggregate

    page = 16
    cache = _sim(page, True)
    for i in range(6):
        cache.driver.run([7 + j for j in range(4 * page)] + [i], tenant="s3cret-salt")
    snap = rank_snapshot(cache)
    assert "s3cret-salt" not in repr(snap)
    stats = aggregate([snap], hashed=True)
    assert list(stats.tenants) == [salt_label("s3cret-salt")] and stats.tenants[salt_label("s3cret-salt")].requests == 6
    # the operator asks by the salt they know, or by the label the stats show
    assert aggregate([snap], "s3cret-salt", hashed=True).tenants["s3cret-salt"].requests == 6
    label = salt_label("s3cret-salt")
    assert aggregate([snap], label, hashed=True).tenants[label].requests == 6
    assert aggregate([snap], "other", hashed=True).tenants["other"].requests == 0

    from prometheus_client import CollectorRegistry, generate_latest

    from sglang_tiered.integration import metrics as m

    reg = CollectorRegistry()
    pm = m.TieredMetrics(registry=reg)
    pm.publish(cache)
    text = generate_latest(reg).decode()
    assert label in text and "s3cret-salt" not in text


def _ctx(model_dir):
    sa = NS(model_path=str(model_dir), served_model_name=None, kv_cache_dtype="auto", attention_backend="fa3",
            quantization=None, dtype="auto", revision=None, modelopt_quant=None, quantization_param_path=None)  # fmt: skip
    hf = NS(rope_theta=10000.0, rope_scaling=None, max_position_embeddings=4096)
    return NS(server_args=sa, model_config=NS(hf_text_config=hf, dtype="torch.bfloat16", quantization=None))


def test_the_identity_holds_the_software_versions(tmp_path, monkeypatch):
    """A named T1 kept across an sglang upgrade, or T2 during a rolling upgrade, served KV the
    old code computed as the new code's: the identity held no versions."""
    import sglang

    from sglang_tiered.integration import identity

    monkeypatch.setenv("SGLANG_TIERED_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"w" * 64)
    sw = identity.software_of()
    assert f"sglang={sglang.__version__}" in sw and "torch=" in sw and "sglang-tiered=" in sw
    key = identity.cache_key_from_context(_ctx(model))
    assert key.software == sw
    off = identity.cache_key_from_context(_ctx(model), versions=False)
    assert off.software is None and off.seed() != key.seed()
    monkeypatch.setattr(identity, "software_of", lambda: sw.replace("sglang=", "sglang=9.9.9+"))
    upgraded = identity.cache_key_from_context(_ctx(model))
    assert upgraded.seed() != key.seed()
    assert upgraded.namespace_seed("acme", None) != key.namespace_seed("acme", None)


def test_router_metrics_are_prometheus_text():
    """An operator scrapes the router as they scrape smg: ``GET /router/metrics`` holds the same
    counters as ``/router/stats``, per worker and per reason, in Prometheus' text format."""
    from prometheus_client.parser import text_string_to_metric_families

    from sglang_tiered.fleet.router import Router

    odd = 'http://127.0.0.1:1/"x"\\n'
    router = Router(["http://127.0.0.1:9", odd], None, load_poll_s=0, model_path="")
    router.stats.requests, router.stats.spills, router.stats.route_ms_total = 7, 2, 12.5
    router.stats.reasons.update(warm=4, fresh=3)
    router.workers["http://127.0.0.1:9"].routed = 5
    router.workers[odd.rstrip("/")].healthy = False
    fams = {f.name: f for f in text_string_to_metric_families(router.metrics_text())}
    one = lambda name: [s.value for s in fams[name].samples]  # noqa: E731
    assert one("sglang_tiered_router_requests") == [7.0] and one("sglang_tiered_router_spills") == [2.0]
    assert one("sglang_tiered_router_route_seconds") == [0.0125]
    reasons = {s.labels["reason"]: s.value for s in fams["sglang_tiered_router_decisions"].samples}
    assert reasons == {"warm": 4.0, "fresh": 3.0}
    routed = {s.labels["worker"]: s.value for s in fams["sglang_tiered_router_worker_routed"].samples}
    assert routed == {"http://127.0.0.1:9": 5.0, odd.rstrip("/"): 0.0}  # a quote, a backslash: escaped
    healthy = {s.labels["worker"]: s.value for s in fams["sglang_tiered_router_worker_healthy"].samples}
    assert healthy == {"http://127.0.0.1:9": 1.0, odd.rstrip("/"): 0.0}
    assert one("sglang_tiered_router_index_connected") == [0.0]  # no index configured


# ---------------------------------------------------------------------- T2 (review, session 23)
def _t2_cache(tmp_path=None):

    from sglang_tiered.core.store_queue import StoreQueue
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache
    from sglang_tiered.tier.t2 import T2Tier
    from sglang_tiered.tier.t2_config import T2Config
    from tests.test_t2 import ByteStore

    cache = TieredRadixCache.create_simulated(8 * 16, 16, host_pages=8, debug_checks=True)
    cfg = T2Config(master="127.0.0.1:1", queue_pages=64, max_run_pages=8, timeout_ms=30_000, lease_ms=0)
    t2 = T2Tier(ByteStore(), cache.host.pool, cache.host.lock, cfg=cfg, model_tag="m",
                state_path=None if tmp_path is None else tmp_path / "gen.json")  # fmt: skip
    t2.start()
    t2.queue.close()
    t2.queue = StoreQueue(cfg.queue_pages, t2._put_job, threaded=False)
    cache.host.t2 = t2
    return cache, t2


def test_an_invalidation_carries_its_generation_to_t2(tmp_path):
    """The HTTP body's ``generation`` reaches T2 through set_internal_state's numbers, for the
    keys after it in the same request only; without one, the server's clock."""
    import time

    from sglang_tiered.integration.protocol import invalidation_args

    cache, t2 = _t2_cache(tmp_path)
    acme = name_hash("acme")
    try:
        for k, v in invalidation_args(1, tenant="acme", generation=123456789).items():
            cache.apply_invalidation_key(k, v)
        assert t2.generation(acme) == 123456789 and t2.generation(name_hash("globex")) == 0
        before = time.time_ns()
        for k, v in invalidation_args(2, tenant="acme").items():
            cache.apply_invalidation_key(k, v)
        assert t2.generation(acme) >= before
        g = t2.generation(acme)
        for k, v in invalidation_args(3, tenant="acme", generation=5).items():  # lower: still moves
            cache.apply_invalidation_key(k, v)
        assert t2.generation(acme) == g + 1
        for k, v in invalidation_args(4, everything=True, generation=g + 10).items():
            cache.apply_invalidation_key(k, v)
        assert t2.generation(name_hash("globex")) == g + 10 == t2.generation(acme)
    finally:
        t2.close()
    from sglang_tiered.integration.http import parse_invalidate

    assert parse_invalidate(b'{"tenant": "a", "generation": 7}').generation == 7
    for bad in (b'{"tenant": "a", "generation": 0}', b'{"tenant": "a", "generation": -1}',
                b'{"tenant": "a", "generation": true}', b'{"tenant": "a", "generation": 4611686018427387904}',
                b'{"tenant": "a", "generation": "7"}'):  # fmt: skip
        with pytest.raises(ValueError):
            parse_invalidate(bad)


def test_a_bad_object_is_read_once_and_removed():
    """An object that fails the checks (another format, a torn read) was read again by every
    fetch, and a correct put could not replace it (Mooncake keeps the first): now it is
    remembered as a miss and removed, and the next store of the page lands."""
    import threading

    from sglang_tiered.tier.host_pool import HostPool
    from sglang_tiered.tier.t2 import T2Tier
    from sglang_tiered.tier.t2_config import T2Config
    from tests.test_t2 import LAYOUT, ByteStore, H

    store = ByteStore()
    cfg = T2Config(master="127.0.0.1:1", queue_pages=8, max_run_pages=4, timeout_ms=2000, lease_ms=0)
    pool = HostPool(LAYOUT)
    t2 = T2Tier(store, pool, threading.RLock(), cfg=cfg, model_tag="m")
    try:
        store.objects[t2.key(H(1), 7)] = b"SGT2" + bytes(t2.obj_bytes - 4)  # wrong header
        assert t2.fetch([H(1)], 7) == 0 and t2.stats.bad_pages == 1
        assert t2.fetch([H(1)], 7) == 0 and t2.stats.bad_pages == 1  # not read again (a miss, remembered)
        assert t2.wait_removals() and t2.key(H(1), 7) not in store.objects and t2.stats.removed_bad == 1
    finally:
        t2.close()


def test_router_broadcasts_an_invalidation_with_one_generation():
    """``POST /cache/invalidate`` through the router went to one worker; the others kept serving
    what was invalidated. It now goes to every worker, with one T2 generation."""
    import asyncio
    import json

    import aiohttp
    from aiohttp import web

    from sglang_tiered.fleet.router import Router
    from tests.test_fleet_hardening import _serve

    async def main():
        seen = []

        def worker():
            app = web.Application()

            async def inv(req):
                seen.append(await req.json())
                return web.json_response({"dropped_tokens": 0}, status=202)

            app.router.add_post("/cache/invalidate", inv)
            app.router.add_get("/health", lambda _: web.json_response({}))
            return app

        runners = [await _serve(worker()) for _ in range(3)]
        router = Router([u for _, u in runners], None, load_poll_s=0, model_path="")
        r_runner, url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/cache/invalidate", json={"tenant": "acme"}) as resp:
                    assert resp.status == 202, await resp.text()
                    doc = await resp.json()
                async with s.post(url + "/cache/invalidate", json={"all": True, "generation": 99}) as resp:
                    assert resp.status == 202
            assert set(doc) == {u for _, u in runners} and all(v["status"] == 202 for v in doc.values())
            first, second = seen[:3], seen[3:]
            assert len({json.dumps(b, sort_keys=True) for b in first}) == 1 and first[0]["tenant"] == "acme"
            assert first[0]["generation"] > 0 and all(b == {"all": True, "generation": 99} for b in second)
        finally:
            await r_runner.cleanup()
            for r, _ in runners:
                await r.cleanup()

    asyncio.run(main())


# ---------------------------------------------------------------------- TP ranks (review, session 23)
class _Agreement:
    """``HostTier.agree`` for ranks run as threads: an all-reduce MIN through a barrier."""

    def __init__(self, n: int):
        import threading

        self.barrier = threading.Barrier(n, timeout=30)
        self.votes: dict = {}
        self.calls = 0

    def for_rank(self, r: int):
        def agree(ok: bool) -> bool:
            self.votes[r] = bool(ok)
            self.barrier.wait()
            res = all(self.votes.values())
            self.calls += r == 0
            self.barrier.wait()
            return res

        return agree


@pytest.mark.parametrize("side", ["demote", "load"])
def test_tp_ranks_agree_on_every_t1_transfer(side):
    """Each TP rank runs its own tree and T1, equal only while they reach equal results. A copy
    that failed on one rank alone (demotion or promotion) left the ranks with different T1 hits
    for the next request: different prefill lengths per rank, mismatched collectives. Now every
    transfer's outcome is agreed: a failure on one rank is a failure on all."""
    import threading

    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

    page = 4
    ranks = [TieredRadixCache.create_simulated(16 * page, page, host_pages=32, verify_kv=True, debug_checks=True)
             for _ in range(2)]  # fmt: skip
    agreement = _Agreement(2)
    for r, c in enumerate(ranks):
        c.host.agree = agreement.for_rank(r)
    prompt = list(range(100, 100 + 3 * page)) + [1]
    out: dict = {}
    errors = []

    def failing(*_a, **_k):
        raise RuntimeError("a transient copy failure on rank 1")

    def rank(r: int, c) -> None:
        try:
            c.driver.run(prompt)
            if side == "demote" and r == 1:
                c.host._move = failing
            c.evict(EvictParams(num_tokens=16 * page))
            c.host.__dict__.pop("_move", None)
            if side == "load" and r == 1:
                c.host._move = failing
            out[r] = (c.driver.run(prompt).cached_len, c.host.pool.resident, c.driver.run(prompt).cached_len)
            c.host.__dict__.pop("_move", None)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
            agreement.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r, c)) for r, c in enumerate(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert out[0] == out[1], out  # the same hits, the same T1, on both ranks
    assert agreement.calls > 0
    if side == "demote":
        assert out[0][0] == 0 and all(c.host.stats.failed_demotions > 0 for c in ranks)
    else:
        assert out[0][0] == 0 < out[0][2] and all(c.host.stats.failed_promotions > 0 for c in ranks)


def test_t2_review_scenarios_on_a_real_mooncake_master(tmp_path):
    """S1: a peer not told of an invalidation re-writes the tenant's old page: not served. S2:
    the invalidating server restarts while a peer holds the object leased: still not served. S3:
    an object of another format under a live key: read once, removed after the lease, and the
    correct page lands and is served."""
    import json
    import sys

    from tests.test_t2 import _need_netns
    from tests.netns import run_in_netns

    _need_netns()
    out = tmp_path / "report.json"
    r = run_in_netns([sys.executable, "-m", "tests.t2_review23_scenario", str(out)], timeout=300)
    assert out.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep.get("ok"), rep
    assert rep["S1_B_stored"] == 1 and rep["S1_A_fetch_after_invalidation"] == 0
    assert rep["S2_peer_read"] == 1 and rep["S2_A_refuses_before_restart"] == 0 and rep["S2_A2_fetch_after_restart"] == 0
    assert rep["S3_gets_for_5_fetches"] == 1 and rep["S3_bad_pages"] == 1
    assert rep["S3_after_rewrite_fetch"] == 1 and rep["A2_stats"]["removed_bad"] == 1


# ---------------------------------------------------------------------- LoRA in the router (session 23)
def test_router_hashes_a_lora_request_in_sglangs_namespace():
    """SGLang adds a request's adapter id to its extra key; the router hashed every LoRA request
    as a base-model one, so the index never matched LoRA pages (and credited workers with base
    pages that are no hit). Servers now publish their startup adapters' ids with their key, and
    the router hashes in the adapter's namespace: the same page hashes as the server's tree."""
    import asyncio
    import json
    from array import array

    from sglang.srt.lora.lora_registry import LoRARef

    from sglang_tiered.fleet.publisher import IndexPublisher
    from sglang_tiered.fleet.router import Router
    from sglang_tiered.integration.identity import startup_adapters
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

    refs = [LoRARef(lora_id=LoRARef.deterministic_id("ad1", "/m/ad1"), lora_name="ad1", lora_path="/m/ad1"),
            LoRARef(lora_id=LoRARef.deterministic_id("ad2", "/m/ad2"), lora_name="ad2", lora_path="/m/ad2")]  # fmt: skip
    adapters = startup_adapters(NS(lora_paths=refs))
    assert adapters == {"ad1": refs[0].lora_id, "ad2": refs[1].lora_id}
    cache = TieredRadixCache.create_simulated(64 * 16, 16)
    pub = IndexPublisher("redis://127.0.0.1:1", "w", cache_key=cache.cache_key, adapters=adapters, start=False)
    cache.attach_index(pub)  # (as build.py does: the tree's pages keyed by their identity hashes)

    class FakeRedis:
        async def mget(self, keys):
            return [pub.key_json for _ in keys]

    router = Router(["http://w1", "http://w2"], None, load_poll_s=0, model_path="")
    router._redis = FakeRedis()
    asyncio.run(router._ensure_cache_key())
    assert router.cache_key == cache.cache_key and router.lora_ids == adapters
    assert router.lora_namespace("/generate", {"lora_path": "ad1"}) == refs[0].lora_id
    assert router.lora_namespace("/v1/chat/completions", {"model": "tiny:ad2"}) == refs[1].lora_id
    assert router.lora_namespace("/v1/completions", {"model": "tiny", "lora_path": "ad1"}) == refs[0].lora_id
    assert router.lora_namespace("/generate", {"lora_path": "loaded-later"}) == "lora-unknown:loaded-later"
    assert router.lora_namespace("/generate", {"lora_path": ["ad1", "ad2"]}) is None  # a batch
    assert router.lora_namespace("/generate", {"text": "hi"}) is None
    # the server's tree, for a request SGLang gave extra_key = lora_id, holds the router's hashes
    tokens = list(range(1000, 1000 + 5 * 16))
    cache.driver.run(tokens, tenant="acme", extra_key=refs[0].lora_id)
    node = next(iter(cache.root_node.children.values()))
    mine = router.hashes_of(array("q", tokens), "acme", refs[0].lora_id)
    assert mine[: len(node.tiered_hashes)] == list(node.tiered_hashes) and mine
    assert router.hashes_of(array("q", tokens), "acme", None)[0] != mine[0]  # (base: another namespace)
    assert json.loads(pub.key_json)["adapters"] == adapters


# ---------------------------------------------------------------------- the review of this session's changes
def test_generations_only_move_up_survive_a_bad_file_and_spare_the_new_pages(tmp_path):
    """(1) "all" at an earlier clock than a tenant's own invalidation moved that tenant back (and
    its file entry brought the older generation back after a restart); (2) a generations file
    that is JSON but not an object made the next invalidation raise in the scheduler; (3) the
    removals matched every generation, so they deleted the pages the fleet wrote under the new
    one."""
    import threading

    from sglang_tiered.tier.host_pool import HostPool
    from sglang_tiered.tier.t2 import T2Tier
    from sglang_tiered.tier.t2_config import T2Config
    from tests.test_t2 import LAYOUT, ByteStore, H

    store = ByteStore()
    cfg = T2Config(master="127.0.0.1:1", queue_pages=8, max_run_pages=4, timeout_ms=2000, lease_ms=0)
    state = tmp_path / "gen.json"

    def tier():
        return T2Tier(store, HostPool(LAYOUT), threading.RLock(), cfg=cfg, model_tag="m", state_path=state)

    t2 = tier()
    try:
        g_t = t2.invalidate(tenant=7, generation=1_000)
        g_all = t2.invalidate(everything=True, generation=500)  # an earlier clock
        assert g_all > g_t and t2.generation(7) == g_all == t2.generation(8)
        store.objects[t2.key(H(1), 7)] = b"new"  # written under the new generation
        store.objects[t2.key(H(1), 7, gen=g_t)] = b"old"
        t2.wait_removals()
        t2._remove_async(t2._old_generations(None, g_all))  # what the retry after the lease sends
        t2.wait_removals()
        assert t2.key(H(1), 7) in store.objects and t2.key(H(1), 7, gen=g_t) not in store.objects
    finally:
        t2.close()
    t2 = tier()  # restarted: the file says the same
    try:
        assert t2.generation(7) == g_all
    finally:
        t2.close()
    for bad in ("[]", '{"tenants": [1]}', '{"all": "x"}', "7"):
        state.write_text(bad)
        t2 = tier()  # unreadable: a generation of its own, never an old one
        try:
            assert t2.generation(7) > g_all
            t2.invalidate(tenant=7)  # does not raise (before: AttributeError in the scheduler)
        finally:
            t2.close()


def test_router_invalidation_fills_a_null_generation_and_retries_old_servers():
    """A body with ``"generation": null`` went out as it was (each worker took its own clock); a
    server from before session 23 refuses the field (400): sent again without it."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from sglang_tiered.fleet.router import Router
    from tests.test_fleet_hardening import _serve

    async def main():
        seen = {"new": [], "old": []}

        def worker(kind):
            app = web.Application()

            async def inv(req):
                body = await req.json()
                seen[kind].append(body)
                if kind == "old" and "generation" in body:
                    return web.json_response({"error": {"message": "invalid payload: Object contains unknown field `generation`"}}, status=400)
                return web.json_response({"dropped_tokens": 0}, status=202)

            app.router.add_post("/cache/invalidate", inv)
            app.router.add_get("/health", lambda _: web.json_response({}))
            return app

        runners = [await _serve(worker("new")), await _serve(worker("old"))]
        router = Router([u for _, u in runners], None, load_poll_s=0, model_path="")
        r_runner, url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/cache/invalidate", json={"tenant": "acme", "generation": None}) as resp:
                    assert resp.status == 202, await resp.text()
            assert seen["new"][0]["generation"] > 0
            assert [b.get("generation") for b in seen["old"]][-1] is None and seen["old"][-1] == {"tenant": "acme"}
        finally:
            await r_runner.cleanup()
            for r, _ in runners:
                await r.cleanup()

    asyncio.run(main())


def test_router_lora_namespace_follows_sglangs_model_parsing():
    from sglang_tiered.core.keys import CacheKey
    from sglang_tiered.fleet.router import Router

    router = Router(["http://w1"], None, load_poll_s=0, model_path="")
    router.cache_key = CacheKey(model_id="org/model:v2")
    router.lora_ids = {"ad1": "id1", "ad2": "id2"}
    assert router.lora_namespace("/v1/completions", {"model": "org/model:v2"}) is None  # the served name itself
    assert router.lora_namespace("/v1/completions", {"model": "org/model:v2:ad1"}) == "id1"
    assert router.lora_namespace("/v1/completions", {"model": "base:ad2", "lora_path": "ad1"}) == "id2"  # model first
    assert router.lora_namespace("/v1/chat/completions", {"model": "base:later"}) == "lora-unknown:later"


# ---------------------------------------------------------------------- the index publisher (review, session 23)
def test_publisher_keeps_publishing_after_an_overflow():
    """``_forget_all`` emptied the queue without lowering its page count: after one dropped
    removal every later event was dropped, for good."""
    from sglang_tiered.fleet import publisher as P

    pub = P.IndexPublisher("redis://127.0.0.1:1", "w", start=False)
    big = [i.to_bytes(16, "little") for i in range(P.QUEUE_PAGES)]
    pub.on_store(big)
    pub.on_remove([b"x" * 16])  # over the bound: dropped, and the publisher must start over
    assert pub._overflowed.is_set() and pub.stats["dropped_events"] == 1
    pub._forget_all()
    assert pub._queued_pages == 0 and pub._q.empty()
    pub.on_store([b"y" * 16])
    assert pub.stats["dropped_events"] == 1 and pub._queued_pages == 1


def test_publisher_withdraws_removals_lost_to_an_outage_and_resyncs_an_emptied_redis():
    """Removals drained while Redis failed were dropped, so those pages stayed claimed; and a
    Redis restarted empty was not resynced (redis-py reconnects by itself, no error shows), so
    held pages came back only at the next refresh."""
    import time

    redis = pytest.importorskip("redis")
    from sglang_tiered.fleet.index import page_key
    from sglang_tiered.fleet.publisher import IndexPublisher
    from tests.test_fleet import _redis_server

    with _redis_server() as (_, port):
        r = redis.Redis(port=port)
        pub = IndexPublisher(f"redis://127.0.0.1:{port}/0", "w", ttl_s=600)
        try:
            pages = [bytes([i]) * 16 for i in range(20)]
            pub.on_store(pages)

            def wait(cond, what):
                end = time.monotonic() + 10
                while not cond():
                    assert time.monotonic() < end, what
                    time.sleep(0.05)

            wait(lambda: all(r.hexists(page_key(h), "w") for h in pages), "published")
            r.flushall()  # Redis loses its data (a restart, an eviction): the next batch sees it
            pub.on_store([b"z" * 16])
            wait(lambda: all(r.hexists(page_key(h), "w") for h in pages), "republished after the loss")
            assert pub.stats["lost_index"] >= 1
            # an outage: removals made meanwhile are withdrawn once Redis answers again
            r.client_pause(2000, all=False)  # writes block past the publisher's socket timeout
            pub.on_remove(pages[:10])
            time.sleep(0.2)
            pub.on_store([b"w" * 16])
            wait(lambda: not any(r.hexists(page_key(h), "w") for h in pages[:10]), "withdrawn")
            assert all(r.hexists(page_key(h), "w") for h in pages[10:])
        finally:
            pub.close()


def test_router_refuses_a_published_key_with_a_non_text_field():
    """A list in a published CacheKey made the key unhashable: every routed request then failed
    (a 500 from ``matched``). Such a key is now another version's: not used."""
    import asyncio
    import json

    from sglang_tiered.core.keys import CacheKey
    from sglang_tiered.fleet.router import Router

    good = json.dumps({"model_id": "m", "weights_digest": "w"})
    bad = json.dumps({"model_id": ["m"], "weights_digest": "w"})

    class FakeRedis:
        async def mget(self, keys):
            return [good, bad]

    router = Router(["http://w1", "http://w2"], None, load_poll_s=0, model_path="")
    router._redis = FakeRedis()
    asyncio.run(router._ensure_cache_key())
    assert router.cache_keys == {"http://w1": CacheKey(model_id="m", weights_digest="w")}
    assert router.cache_key == CacheKey(model_id="m", weights_digest="w")


def test_router_admin_routes_take_an_admin_key():
    """/router/decisions listed every tenant's requests (digest, prompt length, matched tokens
    per worker) to anyone who could reach the router, clients included; with
    ``--admin-api-key`` only its holders read the router's own routes."""
    import asyncio

    import aiohttp

    from sglang_tiered.fleet.router import Router
    from tests.test_fleet_hardening import _serve

    from tests.test_fleet_hardening import _echo_worker

    async def main():
        w_runner, w_url = await _serve(_echo_worker([]))
        router = Router([w_url], None, load_poll_s=0, model_path="", admin_api_key="s3cret")
        runner, url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as s:
                # the worker's URL in the response: only for the key's holders
                async with s.post(url + "/generate", json={"input_ids": [1, 2]}) as resp:
                    assert resp.status == 200 and "x-sglang-tiered-worker" not in resp.headers
                async with s.post(url + "/generate", json={"input_ids": [1, 2]},
                                  headers={"Authorization": "Bearer s3cret"}) as resp:  # fmt: skip
                    assert resp.headers.get("x-sglang-tiered-worker") == w_url
                for path in ("/router/stats", "/router/metrics", "/router/decisions"):
                    async with s.get(url + path) as resp:
                        assert resp.status == 401, path
                    async with s.get(url + path, headers={"Authorization": "Bearer nope"}) as resp:
                        assert resp.status == 401, path
                    async with s.get(url + path, headers={"Authorization": "Bearer s3cret"}) as resp:
                        assert resp.status == 200, path
                async with s.get(url + "/health") as resp:
                    assert resp.status in (200, 503)  # (open: load balancers probe it)
        finally:
            await runner.cleanup()
            await w_runner.cleanup()

    asyncio.run(main())


def test_a_dead_servers_field_leaves_a_shared_page():
    """The key's expiry is per key: a live server refreshing a shared page kept every dead
    server's field in it, and with server ids new at every start the hash grew without bound."""
    import time

    redis = pytest.importorskip("redis")
    from sglang_tiered.fleet.index import page_key
    from sglang_tiered.fleet.publisher import FIELDS_SWEPT, IndexPublisher
    from tests.test_fleet import _redis_server

    with _redis_server() as (_, port):
        r = redis.Redis(port=port)
        h = b"s" * 16
        dead = {f"pod-{i}": str(int(time.time()) - 10_000) for i in range(3 * FIELDS_SWEPT)}
        r.hset(page_key(h), mapping=dead)
        pub = IndexPublisher(f"redis://127.0.0.1:{port}/0", "live", ttl_s=30, start=False)
        pub._client = pub._connect()
        pub._send([h], [])
        assert r.hkeys(page_key(h)) == [b"live"]
        fresh = {f"peer-{i}": str(int(time.time())) for i in range(2 * FIELDS_SWEPT)}
        r.hset(page_key(h), mapping=fresh)
        pub._send([h], [])
        assert len(r.hkeys(page_key(h))) == 2 * FIELDS_SWEPT + 1  # live peers stay


# ---------------------------------------------------------------------- stock SGLang stays stock (review, session 23)
def test_a_stock_server_gets_no_routes_and_no_middleware(monkeypatch):
    """The HTTP hook mounted /cache/* and the request middleware on every server of a machine
    where the package is installed, tiered or not."""
    from sglang_tiered.integration import hooks, http

    def boom():
        raise AssertionError("installed on a stock server")

    monkeypatch.setattr(http, "install", boom)
    assert hooks._before_http_server(NS(radix_cache_backend=None, tokenizer_worker_num=1)) is None
    assert hooks._before_http_server(NS(radix_cache_backend="lru", tokenizer_worker_num=4)) is None


def test_a_bad_variable_does_not_stop_a_stock_process(monkeypatch, caplog):
    """register() runs in every SGLang process; a bad SGLANG_TIERED_* variable stopped stock
    servers (exit 2). It now warns; a tiered launch stops in the server-args hook instead."""
    from sglang_tiered.integration import hooks, plugin

    monkeypatch.setenv("SGLANG_TIERED_HOST_GBS", "1")
    with caplog.at_level("WARNING", logger="sglang_tiered"):
        plugin.register()  # no SystemExit
    assert "invalid configuration" in caplog.text
    assert hooks._before_check_server_args(NS(radix_cache_backend=None)) is None
    with pytest.raises(SystemExit) as exc:
        hooks._before_check_server_args(NS(radix_cache_backend="tiered", tp_size=1, pp_size=1, dp_size=1))
    assert exc.value.code == 2


def test_prefix_attention_serves_tiered_servers_only(monkeypatch):
    """SGLANG_TIERED_PREFIX_ATTENTION=on replaced torch_native attention for every server of
    the process, stock ones included."""
    from sglang.srt.layers.attention import attention_registry as reg

    from sglang_tiered.integration import prefix_attention as pa

    monkeypatch.setattr(pa, "_INSTALLED", False)
    monkeypatch.setitem(reg.ATTENTION_BACKENDS, "torch_native", lambda runner: ("sglang's", runner))
    pa.install()
    factory = reg.ATTENTION_BACKENDS["torch_native"]
    runner = NS(server_args=NS(radix_cache_backend=None))
    assert factory(runner) == ("sglang's", runner)


# ---------------------------------------------------------------------- CLI and client (review, session 23)
def test_serve_refuses_a_taken_port_and_a_missing_model(tmp_path):
    """SGLang binds its port only after loading the model, so ``serve`` took whatever answered on
    a taken port for its own server; a mistyped model path was a traceback and a hub lookup."""
    import socket
    import subprocess
    import sys

    from sglang_tiered.dev.server import Server, ServerSpec, ServerStartError

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        sk.listen()
        port = sk.getsockname()[1]
        with pytest.raises(ServerStartError, match="in use"):
            Server(ServerSpec(model_path=str(tmp_path), port=port), tmp_path / "log").start(timeout_s=5)
    out = subprocess.run([sys.executable, "-m", "sglang_tiered.cli", "serve", "--model", str(tmp_path / "typo")],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2 and "no such folder or file" in out.stderr and "Traceback" not in out.stderr
    for argv in (["build-model", "--layers", "-1"], ["build-model", "--context", "0"],
                 ["serve", "--start-timeout", "nan"]):  # fmt: skip
        out = subprocess.run([sys.executable, "-m", "sglang_tiered.cli", *argv], capture_output=True, text=True,
                             timeout=120)  # fmt: skip
        assert out.returncode == 2 and "Traceback" not in out.stderr, (argv, out.stderr)


def test_serve_stops_its_server_when_interrupted_while_it_starts(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM) while the model loaded left the server running under init: it runs in
    its own session. ``Server.start`` now stops the child on any interruption."""
    import subprocess
    import sys

    from sglang_tiered.dev import server as srv

    script = tmp_path / "slow.py"
    script.write_text("import time\ntime.sleep(300)\n")
    spec = srv.ServerSpec(model_path=str(tmp_path))
    monkeypatch.setattr(srv.ServerSpec, "argv", lambda self: [sys.executable, str(script)])
    s = srv.Server(spec, tmp_path / "log")

    def interrupt(_timeout):
        raise KeyboardInterrupt

    monkeypatch.setattr(s, "wait_ready", interrupt)
    with pytest.raises(KeyboardInterrupt):
        s.start()
    assert s.proc.poll() is not None  # stopped, not orphaned
    assert subprocess.run(["pgrep", "-f", str(script)], capture_output=True).returncode == 1


def test_plan_and_client_knobs_refuse_nonsense(monkeypatch):
    from sglang_tiered.client import KVCacheLayeringPolicy
    from sglang_tiered.core.planner import ModelShape

    for cfg in ([1], {"num_attention_heads": 0, "hidden_size": 64, "num_hidden_layers": 2},
                {"num_attention_heads": "8", "hidden_size": 64, "num_hidden_layers": 2},
                {"num_attention_heads": 8, "hidden_size": 64, "num_hidden_layers": -2}):  # fmt: skip
        with pytest.raises(ValueError):
            ModelShape.from_config(cfg)
    monkeypatch.setenv("KV_CACHE_LAYERING", "flase")
    with pytest.raises(ValueError, match="KV_CACHE_LAYERING"):
        assert KVCacheLayeringPolicy().enabled
    monkeypatch.setenv("KV_CACHE_LAYERING", "off")
    assert not KVCacheLayeringPolicy().enabled
    with pytest.raises(ValueError):
        KVCacheLayeringPolicy(enabled="false")
