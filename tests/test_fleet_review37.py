"""A helper's audit of the fleet router (session 37): ten defects, each test failed before its fix.

Stub aiohttp workers on 127.0.0.1, the real Router app in front of them. Each docstring tells
what the router did before."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import aiohttp
from aiohttp import web

from sglang_tiered.fleet.router import Router
from tests.test_fleet_hardening import _serve


def _tagged_worker(name: str, hits: list, delay: float = 0.0, status: int = 200):
    """A stub worker answering every route (any method) with its name, the raw path it got and
    the body's length; ``hits`` collects (name, method, raw_path)."""
    app = web.Application()

    async def any_route(req):
        raw = await req.read()
        hits.append((name, req.method, req.raw_path))
        if delay:
            await asyncio.sleep(delay)
        return web.json_response({"worker": name, "raw_path": req.raw_path, "len": len(raw)}, status=status)

    async def health(_):
        return web.json_response({})

    app.router.add_get("/health", health)
    app.router.add_route("*", "/{tail:.*}", any_route)
    return app


async def _fleet(n: int, hits: list, **kw):
    ws = [await _serve(_tagged_worker(f"w{i}", hits, **kw)) for i in range(n)]
    router = Router([u for _, u in ws], None, load_poll_s=0, model_path="")
    r_runner, r_url = await _serve(router.app())
    return ws, router, r_runner, r_url


async def _close(ws, r_runner):
    await r_runner.cleanup()
    for runner, _ in ws:
        await runner.cleanup()


def test_passthrough_generation_routes_spread_over_workers():
    """SGLang 0.5.23 serves generation on more routes than the three the router routes:
    /v1/responses, /v1/messages (Anthropic), /api/chat and /api/generate (Ollama), /invocations,
    /v1/embeddings, /v1/rerank, /encode ... These go through ``passthrough``, which picks
    ``min(live, key=inflight)``, but ``inflight`` only counts requests that ``handle`` proxied, so
    every passthrough request ties at 0 and goes to the first worker: 30 concurrent
    /v1/messages requests over 3 workers all land on w0."""

    async def main():
        hits: list = []
        ws, router, r_runner, r_url = await _fleet(3, hits, delay=0.2)
        try:
            async with aiohttp.ClientSession() as s:

                async def one(i):
                    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": f"hello {i}"}]}
                    async with s.post(r_url + "/v1/messages", json=body) as resp:
                        assert resp.status == 200
                        return (await resp.json())["worker"]

                got = await asyncio.gather(*(one(i) for i in range(30)))
        finally:
            await _close(ws, r_runner)
        return Counter(got)

    by_worker = asyncio.run(main())
    print("per worker:", dict(by_worker))
    # a load balancer over 3 workers: no worker takes more than 2/3 of 30 concurrent requests
    assert max(by_worker.values()) <= 20, by_worker


# ----------------------------------------------------------------------------- with a Redis index
import contextlib  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

from sglang_tiered.core.keys import CacheKey  # noqa: E402
from sglang_tiered.fleet.index import alive_key, ckey_key, page_key  # noqa: E402
from tests.test_fleet import _redis_server  # noqa: E402


def _publish_key(r, w: str, ttl: int = 60) -> None:
    """What a server's IndexPublisher writes for itself: heartbeat + CacheKey (default key)."""
    from dataclasses import asdict

    r.set(alive_key(w), str(int(time.time())), ex=ttl)
    r.set(ckey_key(w), json.dumps(asdict(CacheKey()), sort_keys=True), ex=ttl)


def _claim(r, w: str, hashes, at: float | None = None) -> None:
    now = str(int(time.time() if at is None else at))
    for h in hashes:
        r.hset(page_key(h), w, now)
        r.expire(page_key(h), 120)


async def _wait_key(router, timeout=5.0):
    t = time.monotonic()
    while router.cache_key is None or len(router.cache_keys) < len(router.workers):
        if time.monotonic() - t > timeout:
            return False
        await asyncio.sleep(0.05)
    return True


def test_a_worker_answering_5xx_is_retried_around_and_counted():
    """A worker whose generation answers 500 (its /health 200) holds a tenant's prefix by the
    index: every request of that tenant goes there (warm), is answered 500, and is never tried on
    the healthy peer; the worker is never taken out of the routing set (only connection errors
    count). SGLang's own gateway (smg) retries 5xx on another worker."""
    redis = pytest.importorskip("redis")

    async def main(port):
        hits: list = []
        bad = await _serve(_tagged_worker("w0", hits, status=500))
        good = await _serve(_tagged_worker("w1", hits))
        urls = [bad[1], good[1]]
        r = redis.Redis(port=port)
        for u in urls:
            _publish_key(r, u)
        router = Router(urls, f"redis://127.0.0.1:{port}/0", load_poll_s=0, model_path="", page_size=16)
        r_runner, r_url = await _serve(router.app())
        statuses = []
        try:
            assert await _wait_key(router)
            toks = list(range(100, 100 + 16 * 20))
            _claim(r, urls[0], router.hashes_of(toks, "acme"))  # w0 served the tenant's document before
            async with aiohttp.ClientSession() as s:
                for i in range(10):
                    body = {"input_ids": toks + [7] * (i + 1), "cache_salt": "acme"}
                    async with s.post(r_url + "/generate", json=body) as resp:
                        statuses.append(resp.status)
        finally:
            await r_runner.cleanup()
            await bad[0].cleanup()
            await good[0].cleanup()
        return statuses, Counter(h[0] for h in hits), router.stats_doc()

    with _redis_server() as (_, port):
        statuses, per_worker, stats = asyncio.run(main(port))
    print("statuses", statuses, "per worker", dict(per_worker), "reasons", stats["reasons"],
          "failures", {w: x["failures"] for w, x in stats["workers"].items()})
    # before: 9 of 10 answered 500 while w1 was idle, none retried elsewhere, no failures shown
    assert statuses == [200] * 10, statuses
    bad_failures = [x["failures"] for w, x in stats["workers"].items()]
    assert max(bad_failures) >= 3 and stats["error_answers"] >= 3 and stats["error_downs"] == 1, stats


def test_one_malformed_ckey_leaves_the_other_workers_keys_read():
    """``_ensure_cache_key`` catches TypeError/ValueError/AttributeError per worker, but
    ``json.loads`` of a deeply nested value raises RecursionError, which escapes the loop: the keys
    of the workers listed after that one are never read, so the router routes without the index
    for good (every lookup needs ``cache_key``)."""
    redis = pytest.importorskip("redis")

    async def main(port):
        hits: list = []
        ws = [await _serve(_tagged_worker(f"w{i}", hits)) for i in range(2)]
        urls = [u for _, u in ws]
        r = redis.Redis(port=port)
        _publish_key(r, urls[1])
        r.set(alive_key(urls[0]), "1", ex=60)
        r.set(ckey_key(urls[0]), "[" * 100000 + "]" * 100000, ex=60)  # a corrupt value
        router = Router(urls, f"redis://127.0.0.1:{port}/0", load_poll_s=0, model_path="", page_size=16)
        r_runner, r_url = await _serve(router.app())
        try:
            await asyncio.sleep(2.0)
            return dict(router.cache_keys), router.cache_key
        finally:
            await r_runner.cleanup()
            for runner, _ in ws:
                await runner.cleanup()

    with _redis_server() as (_, port):
        keys, key = asyncio.run(main(port))
    print("cache_keys", keys, "cache_key", key)
    assert key is not None, "the healthy worker's key was never read"


def test_a_wrong_type_page_key_costs_only_its_own_lookup():
    """One key under ``st:p:`` that is not a hash (WRONGTYPE in the lookup script) makes the
    EVALSHA fail; the router treats that as Redis down (``_index_down``: connection reset, no
    index for 1 s), so tenant B, whose pages the index holds correctly, is routed blind right
    after tenant A's lookup hit the bad key."""
    redis = pytest.importorskip("redis")

    async def main(port):
        hits: list = []
        ws = [await _serve(_tagged_worker(f"w{i}", hits)) for i in range(3)]
        urls = [u for _, u in ws]
        r = redis.Redis(port=port)
        for u in urls:
            _publish_key(r, u)
        router = Router(urls, f"redis://127.0.0.1:{port}/0", load_poll_s=0, model_path="", page_size=16)
        r_runner, r_url = await _serve(router.app())
        try:
            assert await _wait_key(router)
            a = list(range(5000, 5000 + 64))
            b = list(range(9000, 9000 + 64))
            r.set(page_key(router.hashes_of(a, "A")[0]), "garbage")
            _claim(r, urls[2], router.hashes_of(b, "B"))
            async with aiohttp.ClientSession() as s:
                async with s.post(r_url + "/generate", json={"input_ids": a, "cache_salt": "A"}) as resp:
                    assert resp.status == 200
                async with s.post(r_url + "/generate", json={"input_ids": b, "cache_salt": "B"}) as resp:
                    assert resp.status == 200
            return router.decisions[-1], router.stats_doc()
        finally:
            await r_runner.cleanup()
            for runner, _ in ws:
                await runner.cleanup()

    with _redis_server() as (_, port):
        last, stats = asyncio.run(main(port))
    print("B's decision", last, "index_errors", stats["index_errors"], "unavailable", stats["index_unavailable"])
    assert last["index"] is not None and last["index"].get(last["worker"], 0) > 0, last


def test_an_unloadable_tokenizer_is_said_once_and_retried_rarely(caplog):
    """Workers whose /model_info names a model this host does not have (a hub id, or a path only
    the GPU hosts mount): ``_learn_from_workers`` warns and sets ``model_path = None``, so
    ``_learning()`` stays true and the health loop asks /model_info and calls
    ``AutoTokenizer.from_pretrained`` (on the event loop) again every ``health_interval_s``,
    warning each time: one warning a second, for the router's lifetime."""
    import logging

    async def main():
        app = web.Application()
        app.router.add_get("/health", lambda _: web.json_response({}))
        app.router.add_get("/model_info", lambda _: web.json_response({"model_path": "/nonexistent/org/model"}))
        app.router.add_get("/server_info", lambda _: web.json_response({"page_size": 16}))
        runner, url = await _serve(app)
        router = Router([url], None, load_poll_s=0, health_interval_s=0.1)
        r_runner, _ = await _serve(router.app())
        try:
            await asyncio.sleep(2.0)
        finally:
            await r_runner.cleanup()
            await runner.cleanup()

    with caplog.at_level(logging.WARNING, logger="sglang_tiered.router"):
        asyncio.run(main())
    n = sum("no tokenizer at" in rec.getMessage() for rec in caplog.records)
    print("tokenizer warnings in 2 s:", n)
    assert n <= 1, n


def test_requests_on_a_worker_that_stopped_answering_go_elsewhere():
    """A worker that stops answering without closing its socket (SIGSTOP, a host that lost power or
    network: the kernel accepted the connection, nothing answers). The health loop takes it out of
    the routing set within a few seconds, but a request already proxied there (nothing sent back
    yet, so it could go elsewhere) waits for ever: the proxy has no read timeout and nothing
    revisits in-flight requests when their worker is declared down."""

    async def main():
        frozen = asyncio.Event()

        def stub(name):
            app = web.Application()

            async def gen(req):
                await req.read()
                if name == "w0":
                    frozen.set()
                    await asyncio.Event().wait()  # never answers
                return web.json_response({"worker": name})

            async def health(_):
                if name == "w0" and frozen.is_set():
                    await asyncio.Event().wait()
                return web.json_response({})

            app.router.add_post("/generate", gen)
            app.router.add_get("/health", health)
            return app

        ws = [await _serve(stub(f"w{i}"), shutdown_timeout=0.5) for i in range(2)]
        urls = [u for _, u in ws]
        router = Router(urls, None, load_poll_s=0, model_path="", health_interval_s=0.2)
        r_runner, r_url = await _serve(router.app(), shutdown_timeout=0.5)
        try:
            async with aiohttp.ClientSession() as s:

                async def one(i):
                    body = {"input_ids": list(range(i * 100, i * 100 + 64)), "cache_salt": f"t{i}"}
                    async with s.post(r_url + "/generate", json=body) as resp:
                        return resp.status

                tasks = [asyncio.create_task(one(i)) for i in range(6)]
                t0 = time.monotonic()
                while router.workers[urls[0]].healthy and time.monotonic() - t0 < 15:
                    await asyncio.sleep(0.1)
                down_after = time.monotonic() - t0
                await asyncio.sleep(3.0)  # well after the router declared w0 down
                pending = sum(not t.done() for t in tasks)
                for t in tasks:
                    t.cancel()
                got = await asyncio.gather(*tasks, return_exceptions=True)
                assert got == [200] * 6 and router.stats.abandoned >= 1, (got, router.stats)
                return down_after, pending, router.workers[urls[0]].healthy
        finally:
            await r_runner.cleanup()
            for runner, _ in ws:
                await runner.cleanup()

    down_after, pending, healthy = asyncio.run(main())
    print(f"w0 declared down after {down_after:.1f} s (healthy={healthy}); requests still waiting 3 s later: {pending}")
    assert not healthy
    assert pending == 0, f"{pending} requests still wait on a worker the router declared down"


def test_the_servers_own_index_ttl_judges_their_claims():
    """The servers' TTL (``SGLANG_TIERED_INDEX_TTL_S``, 1-86,400 s) sets how often they refresh a
    claim (every TTL/2); the router judges a claim stale by its own ``--index-ttl-s`` (default 30)
    and never reads the servers' value (it reads their CacheKey and page size, not this). Servers
    at TTL 120 refresh every 60 s: 40 s after a refresh their live claims (heartbeat alive, page
    held) are ignored by a default router, for half of every refresh period."""
    redis = pytest.importorskip("redis")
    from unittest import mock

    from sglang_tiered.fleet import publisher as P

    async def main(port):
        hits: list = []
        ws = [await _serve(_tagged_worker(f"w{i}", hits)) for i in range(3)]
        urls = [u for _, u in ws]
        router = Router(urls, f"redis://127.0.0.1:{port}/0", load_poll_s=0, model_path="", page_size=16)
        toks = list(range(300, 300 + 16 * 8))
        probe = Router(urls, None, load_poll_s=0, page_size=16)
        probe.cache_key = CacheKey()
        hashes = probe.hashes_of(toks, "acme")
        pubs = []
        for u in urls:
            pub = P.IndexPublisher(f"redis://127.0.0.1:{port}/0", u, ttl_s=120.0, start=False, cache_key=CacheKey())
            pub._client = pub._connect()
            with mock.patch.object(P.time, "time", return_value=time.time() - 40):  # its last refresh: 40 s ago
                pub._send(hashes if u == urls[2] else [], [])
            pubs.append(pub)
        r_runner, r_url = await _serve(router.app())
        try:
            assert await _wait_key(router)
            async with aiohttp.ClientSession() as s:
                async with s.post(r_url + "/generate", json={"input_ids": toks, "cache_salt": "acme"}) as resp:
                    assert resp.status == 200
            return router.decisions[-1], urls[2]
        finally:
            await r_runner.cleanup()
            for runner, _ in ws:
                await runner.cleanup()

    with _redis_server() as (_, port):
        d, holder = asyncio.run(main(port))
    print("index said", d["index"], "chosen", d["worker"], "holder", holder)
    assert (d["index"] or {}).get(holder, 0) == 16 * 8, d["index"]


def test_sessions_open_over_all_workers():
    """``/open_session`` goes through ``passthrough`` (least ``inflight``, which passthrough never
    counts): every session opens on the first worker, and every request of every session is then
    pinned there (``_session_of``), however many workers the fleet has."""
    import uuid

    async def main():
        hits: list = []

        def stub(name):
            app = web.Application()

            async def open_session(req):
                await req.read()
                return web.json_response(f"{name}-{uuid.uuid4().hex}")

            async def gen(req):
                await req.read()
                hits.append(name)
                await asyncio.sleep(0.05)
                return web.json_response({"worker": name})

            app.router.add_post("/open_session", open_session)
            app.router.add_post("/generate", gen)
            app.router.add_get("/health", lambda _: web.json_response({}))
            return app

        ws = [await _serve(stub(f"w{i}")) for i in range(4)]
        router = Router([u for _, u in ws], None, load_poll_s=0, model_path="")
        r_runner, r_url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as s:
                sids = []
                for _ in range(8):
                    async with s.post(r_url + "/open_session", json={"capacity_of_str_len": 1000}) as resp:
                        sids.append(await resp.json())

                async def turn(sid, i):
                    body = {"text": f"turn {i}", "session_params": {"id": sid}}
                    async with s.post(r_url + "/generate", json=body) as resp:
                        return (await resp.json())["worker"]

                await asyncio.gather(*(turn(sid, i) for sid in sids for i in range(3)))
        finally:
            await r_runner.cleanup()
            for runner, _ in ws:
                await runner.cleanup()
        return Counter(hits)

    per_worker = asyncio.run(main())
    print("session turns per worker:", dict(per_worker))
    assert max(per_worker.values()) <= 12, per_worker  # 24 turns of 8 sessions over 4 workers


def test_passthrough_goes_around_a_dead_worker():
    """``passthrough`` has no retry and does not take an unreachable worker out of the routing
    set (``handle`` does both): with worker 0 gone (and together with the first defect every
    passthrough request goes to worker 0), /v1/models, /v1/messages, /v1/embeddings ... answer
    502 until the health loop has missed it ``health_misses`` times, while worker 1 is fine."""

    async def main():
        hits: list = []
        ws = [await _serve(_tagged_worker(f"w{i}", hits)) for i in range(2)]
        urls = [u for _, u in ws]
        router = Router(urls, None, load_poll_s=0, model_path="", health_interval_s=1.0)
        r_runner, r_url = await _serve(router.app())
        await ws[0][0].cleanup()  # worker 0 dies
        out = []
        try:
            async with aiohttp.ClientSession() as s:
                for path in ("/v1/messages", "/v1/embeddings", "/generate"):
                    async with s.post(r_url + path, json={"input": "x", "messages": [], "text": "x"}) as resp:
                        out.append((path, resp.status))
        finally:
            await r_runner.cleanup()
            await ws[1][0].cleanup()
        return out

    out = asyncio.run(main())
    print(out)
    assert all(st == 200 for _, st in out), out


def test_unreadable_cache_keys_are_said(caplog):
    """Every server publishes a CacheKey this router cannot read (a newer sglang-tiered with one
    more identity field, mid rolling upgrade): ``_ensure_cache_key`` drops each one silently
    (TypeError caught per worker), ``cache_key`` stays None, and every request is routed without
    the index, with nothing in the log (the loop's once-a-minute warning is only for exceptions
    that escape, e.g. Redis down)."""
    import logging
    from dataclasses import asdict

    redis = pytest.importorskip("redis")

    async def main(port):
        hits: list = []
        ws = [await _serve(_tagged_worker(f"w{i}", hits)) for i in range(2)]
        urls = [u for _, u in ws]
        r = redis.Redis(port=port)
        for u in urls:
            r.set(alive_key(u), "1", ex=60)
            r.set(ckey_key(u), json.dumps({**asdict(CacheKey()), "kv_layout": "v3"}), ex=60)
        router = Router(urls, f"redis://127.0.0.1:{port}/0", load_poll_s=0, model_path="", page_size=16)
        r_runner, r_url = await _serve(router.app())
        try:
            await asyncio.sleep(1.5)
            return router.cache_key
        finally:
            await r_runner.cleanup()
            for runner, _ in ws:
                await runner.cleanup()

    with _redis_server() as (_, port), caplog.at_level(logging.INFO, logger="sglang_tiered.router"):
        key = asyncio.run(main(port))
    msgs = [rec.getMessage() for rec in caplog.records]
    print("cache_key", key, "log", msgs)
    assert key is not None or any("key" in m for m in msgs), "index silently unused"
