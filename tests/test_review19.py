"""Findings of session 18's review left open then, fixed in session 19."""

from __future__ import annotations

from sglang_tiered.dev.simulate import SimReq
from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

PAGE = 16


def test_a_retracted_request_counts_once_in_its_tenant():
    """SGLang releases a request retracted at decode (or preempted) unfinished, with
    ``checkpointed=False`` (schedule_batch.py ``release_req``), and re-admits the same ``Req``
    later: the tenant counted its requests and prompt tokens at each release."""
    cache = TieredRadixCache.create_simulated(64 * PAGE, PAGE)
    cache.driver.run(list(range(100, 164)), tenant="acme")
    tc = cache.tenant("acme")
    assert (tc.requests, tc.prompt_tokens) == (1, 64)
    req = SimReq("retracted", list(range(500, 540)), cache_salt="acme")
    cache.on_release(req, checkpointed=False)  # retracted
    cache.on_release(req, checkpointed=False)  # retracted again after its re-admission
    cache.on_release(req, checkpointed=True)  # finished
    assert (tc.requests, tc.prompt_tokens) == (2, 104)
    other = SimReq("handed-on", list(range(600, 610)), cache_salt="acme")
    cache.on_release(other, checkpointed=False)  # released unfinished once (e.g. handed on): counted
    assert (tc.requests, tc.prompt_tokens) == (3, 114)


# --- the fleet router (review, session 19) ------------------------------------------------------


def _wait(cond, timeout_s: float = 10.0) -> None:
    import time

    deadline = time.time() + timeout_s
    while not cond():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def test_router_hashes_each_worker_with_its_own_key_and_rereads_them():
    """After a weight update each server publishes a new CacheKey (with its own lifetime id, so two
    servers updated to the same weights differ); the router read one key once, and its index
    lookups never matched again. Now it re-reads every worker's key and looks each worker up with
    the prompt hashed under that worker's key; ``extra_key`` is part of the namespace too."""
    import asyncio

    from sglang_tiered.core.keys import CacheKey
    from sglang_tiered.fleet import router as router_mod
    from sglang_tiered.fleet.publisher import IndexPublisher
    from sglang_tiered.fleet.router import Router
    from tests.test_fleet import _redis_server

    toks = list(range(1000, 1000 + 8 * PAGE))
    cm = _redis_server()
    _, port = cm.__enter__()
    url = f"redis://127.0.0.1:{port}/0"
    w = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    keys = [CacheKey(model_id="m", weights_digest="w0"), CacheKey(model_id="m", weights_digest="w0")]
    hasher = Router(w, None, load_poll_s=0)
    pubs = [IndexPublisher(url, w[i], 30.0, cache_key=keys[i]) for i in range(2)]
    old_refresh = router_mod.KEY_REFRESH_S
    router_mod.KEY_REFRESH_S = 0.2
    try:
        pubs[0].on_store(hasher.hashes_of(toks, "acme", key=keys[0]))
        pubs[1].on_store(hasher.hashes_of(toks[: 4 * PAGE], "acme", "lora-1", key=keys[1]))
        _wait(lambda: all(p.stats["published_pages"] for p in pubs))

        async def main():
            router = Router(w, url, load_poll_s=0, model_path="", health_interval_s=60)
            await router.start()
            try:
                for _ in range(100):
                    if len(router.cache_keys) == 2:
                        break
                    await asyncio.sleep(0.05)
                got = await router.matched(router.hashes_of(toks, "acme"), w, toks, "acme")
                assert got == {w[0]: 8 * PAGE}, got
                got = await router.matched(router.hashes_of(toks, "acme", "lora-1"), w, toks, "acme", "lora-1")
                assert got == {w[1]: 4 * PAGE}, got
                # a weight update on worker 0: new key, the pages re-published under it
                keys[0] = CacheKey(model_id="m", weights_digest="w0+update:life0:1:")
                pubs[0].key_json = __import__("json").dumps(__import__("dataclasses").asdict(keys[0]), sort_keys=True)
                pubs[0].on_clear()
                pubs[0].on_store(hasher.hashes_of(toks, "acme", key=keys[0]))
                for _ in range(100):
                    if router.cache_keys.get(w[0]) == keys[0]:
                        break
                    await asyncio.sleep(0.05)
                assert router.cache_keys[w[0]] == keys[0] and router.cache_keys[w[1]] == keys[1]
                for _ in range(100):  # (the publisher's thread sends the re-stored pages)
                    got = await router.matched(router.hashes_of(toks, "acme"), w, toks, "acme")
                    if got:
                        break
                    await asyncio.sleep(0.05)
                assert got == {w[0]: 8 * PAGE}, got
            finally:
                await router.close()

        asyncio.run(main())
    finally:
        router_mod.KEY_REFRESH_S = old_refresh
        for p in pubs:
            p.close()
        cm.__exit__(None, None, None)


def test_router_learns_the_tokenizer_and_page_size_once_workers_answer():
    """A router started before its workers asked them once, found nothing, and routed every prompt
    as 0 tokens for good; its page size was fixed at 16 whatever the servers ran."""
    import asyncio

    from aiohttp import web

    from sglang_tiered.fleet.router import Router
    from tests.test_fleet_hardening import _serve

    async def main():
        state = {"up": False}

        async def info(_):
            if not state["up"]:
                return web.json_response({}, status=503)
            return web.json_response({"page_size": 1})

        app = web.Application()
        app.router.add_get("/server_info", info)
        app.router.add_get("/model_info", lambda _: web.json_response({"model_path": None}))
        app.router.add_get("/health", lambda _: web.json_response({}))
        runner, url = await _serve(app)
        router = Router([url], None, load_poll_s=0, page_size=None, health_interval_s=0.05)
        await router.start()
        try:
            assert router.page_size == 16 and not router.page_size_given
            state["up"] = True
            for _ in range(100):
                if router.page_size_given:
                    break
                await asyncio.sleep(0.05)
            assert router.page_size == 1
        finally:
            await router.close()
            await runner.cleanup()

    asyncio.run(main())


def test_router_decisions_never_show_a_cache_salt_and_gzip_bodies_go_on_decoded():
    import asyncio
    import gzip
    import json

    import aiohttp

    from sglang_tiered.fleet.router import Router, tenant_digest
    from tests.test_fleet_hardening import _echo_worker, _serve

    async def main():
        hits: list = []
        w_runner, w_url = await _serve(_echo_worker(hits))
        router = Router([w_url], None, load_poll_s=0, model_path="")
        r_runner, r_url = await _serve(router.app())
        body = json.dumps({"input_ids": list(range(64)), "cache_salt": "victim-salt-7f3a"}).encode()
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(r_url + "/generate", data=body) as resp:
                    assert resp.status == 200
                async with s.get(r_url + "/router/decisions") as resp:
                    text = await resp.text()
                assert "victim-salt-7f3a" not in text and tenant_digest("victim-salt-7f3a") in text
                async with s.post(r_url + "/generate", data=gzip.compress(body),
                                  headers={"content-encoding": "gzip"}) as resp:  # fmt: skip
                    assert resp.status == 200
                seen = {k.lower() for k, _ in hits[-1]["headers"]}
                assert "content-encoding" not in seen and hits[-1]["body_len"] == len(body)
        finally:
            await r_runner.cleanup()
            await w_runner.cleanup()

    asyncio.run(main())


def test_publisher_queue_is_bounded_in_pages_and_drains_while_redis_is_down():
    """Bounded in events only, 600 events of 2,048 pages queued 85 MB, and with Redis down the
    thread drained one batch (4,096 pages) per back-off of up to 2 s (review, session 19)."""
    import socket
    import time

    from sglang_tiered.fleet import publisher as pub_mod
    from sglang_tiered.fleet.publisher import IndexPublisher

    with socket.socket() as sk:  # a port nobody listens on: Redis down
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    old = pub_mod.QUEUE_PAGES
    pub_mod.QUEUE_PAGES = 50_000
    p = IndexPublisher(f"redis://127.0.0.1:{port}/0", "s", 30.0, start=False)
    try:
        for i in range(40):  # 80,000 pages offered: the bound keeps 50,000 and drops the rest
            p.on_store([i.to_bytes(4, "big") + j.to_bytes(4, "big") for j in range(2000)])
        snap = p.snapshot()
        assert snap["queued_pages"] == 50_000 and snap["dropped_events"] == 15, snap
        p._thread = __import__("threading").Thread(target=p._run, daemon=True)
        p._thread.start()
        deadline = time.time() + 10
        while (p.snapshot()["queued_pages"] or p.snapshot()["held_pages"] < 50_000) and time.time() < deadline:
            time.sleep(0.05)
        snap = p.snapshot()
        assert snap["queued_pages"] == 0 and snap["held_pages"] == 50_000 and snap["errors"] >= 1, snap
    finally:
        pub_mod.QUEUE_PAGES = old
        p.close()


# --- in-flight requests across a weight update or an invalidation (review, session 19) ---------


def _inflight_case(during_factory):
    """A request computes its KV, then ``during`` runs (it is still in flight), then it ends; its
    pages are evicted (into T1, were they adopted) and the same prompt comes again: its cached
    tokens."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cache = TieredRadixCache.create_simulated(16 * PAGE, PAGE, host_pages=32, verify_kv=True)
    toks = list(range(300, 300 + 4 * PAGE))
    out = cache.driver.run(toks, tenant="a", during=during_factory(cache))
    assert out.served
    cache.evict(EvictParams(num_tokens=cache.evictable_size_))
    cache.flush_pending_backups()
    again = cache.driver.run(toks, tenant="a")
    cache.check_invariants()
    return again.cached_len


def test_kv_computed_before_a_weight_update_is_never_adopted():
    """SGLang's in-place pause (RL weight syncs) lets a weight update run while a request is in
    flight; with the device tree empty the identity was re-seeded at once, and the request's KV
    of the old weights was then adopted under the new identity, demoted to T1 and served."""
    assert _inflight_case(lambda c: (lambda: c.on_weights_updated("1"))) == 0


def test_kv_computed_before_an_invalidation_is_never_adopted():
    """A request of tenant a with nothing matched computed its KV, then tenant a was invalidated:
    the KV was adopted afterwards and served from T1 (the rule: nothing written before an
    invalidation is served)."""
    from sglang_tiered.core.tenants import name_hash

    assert _inflight_case(lambda c: (lambda: c.invalidation.invalidate(tenant_hash=name_hash("a")))) == 0


def test_requests_that_match_after_the_update_are_cached_as_usual():
    cache = TieredRadixCache.create_simulated(16 * PAGE, PAGE, host_pages=32, verify_kv=True)
    toks = list(range(300, 300 + 4 * PAGE))
    cache.driver.run(toks, tenant="a", during=lambda: cache.on_weights_updated("1"))
    cache.driver.run(toks, tenant="a")  # matched after the update: adopted
    assert cache.driver.run(toks, tenant="a").cached_len == 4 * PAGE


# --- checkers (review, session 19) ---------------------------------------------------------------


def test_check_cache_sees_a_pending_t1_write_of_a_freed_page():
    """A device page freed without its fence, with its T1 write still queued: every checker passed
    (the write would later copy whatever the page held next into T1 under the old hash)."""
    import pytest

    from sglang_tiered.integration.invariants import check_cache

    ps = 4
    c = TieredRadixCache.create_simulated(8 * ps, ps, host_pages=16, store_queue_pages=8, verify_kv=True)
    c.driver.run(list(range(1, 2 * ps + 1)), tenant="a")
    c.host.clear()
    check_cache(c)
    node = next(iter(c.root_node.children.values()))
    c.t1._offer(node, None, "through")  # a pending write-through job of the node's pages
    check_cache(c)  # pending, and in the tree: fine
    c.token_to_kv_pool_allocator.free_segment(node.value, start_pos=0)  # freed WITHOUT the fence
    c._delete_leaf(node)
    c.tenant(node.key.cache_salt).resident_pages -= len(node.key) // ps  # (counted as a delete does: C1 holds)
    with pytest.raises(AssertionError, match="S4 violated"):
        check_cache(c)


def test_host_pool_checker_compares_the_lru_list_with_the_index():
    import pytest

    ps = 4
    c = TieredRadixCache.create_simulated(8 * ps, ps, host_pages=4)
    pool = c.host.pool
    pool.commit(pool.reserve([bytes([i]) * 16 for i in range(2)]))
    pool.check_invariants()
    res, free = next(iter(pool.lru)), pool.free[-1]
    del pool.lru[res]
    pool.lru[free] = None  # the LRU list names a free slot instead of a resident one
    with pytest.raises(AssertionError, match="LRU list"):
        pool.check_invariants()
