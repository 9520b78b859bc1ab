"""Router and publisher hardening (review findings): the trusted tenant header, a client's huge
tenant string, the proxy's connection pool, a dropped removal in the publisher, a client that
leaves before a non-streamed answer, and a body nested too deeply for the JSON parser.

The router runs for real in front of small aiohttp stub workers on 127.0.0.1; the publisher
against a throwaway redis-server (tests/test_fleet.py's helper)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
import time

import aiohttp
import pytest
from aiohttp import web

from sglang_tiered.fleet.router import Router, tenant_digest
from tests.conftest import ROOT
from tests.test_fleet import _redis_server

ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")


async def _serve(app, **runner_kw):
    """Start ``app`` on 127.0.0.1 (a free port): (runner, base URL)."""
    runner = web.AppRunner(app, **runner_kw)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


async def _serve_on(app, port: int):
    """Start ``app`` on 127.0.0.1:``port`` (a worker back on its port): its runner."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def _down(app):
    """A worker that was up once and is down now: (its port, its base URL)."""
    runner, url = await _serve(app)
    await runner.cleanup()
    return int(url.rsplit(":", 1)[1]), url


def _echo_worker(hits: list):
    """A stub worker: answers with the headers it got (every copy of a repeated one) and the body's
    length, and sets two cookies; ``hits`` collects what each request carried."""
    app = web.Application(client_max_size=64 << 20)

    async def gen(req):
        raw = await req.read()
        seen = {"headers": [[k, v] for k, v in req.headers.items()], "body_len": len(raw)}
        hits.append(seen)
        resp = web.json_response(seen)
        resp.headers.add("set-cookie", "a=1")
        resp.headers.add("set-cookie", "b=2")
        return resp

    for r in ROUTES:
        app.router.add_post(r, gen)
    app.router.add_get("/health", lambda _: web.json_response({}))
    return app


@contextlib.asynccontextmanager
async def _echo_router(hits: list, redis_url=None, **kw):
    """An ``_echo_worker`` behind a ``Router`` (no load polls; no index unless ``redis_url``):
    yields (router, its URL)."""
    w_runner, w_url = await _serve(_echo_worker(hits))
    router = Router([w_url], redis_url, load_poll_s=0, model_path="", **kw)
    r_runner, r_url = await _serve(router.app())
    try:
        yield router, r_url
    finally:
        await r_runner.cleanup()
        await w_runner.cleanup()


async def _raw_post(url: str, header: bytes, body: bytes) -> bytes:
    """POST /generate with one header line as raw bytes (aiohttp's client sends only valid UTF-8)."""
    host, port = url.rsplit("/", 1)[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + header
                 + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)  # fmt: skip
    await writer.drain()
    data = await reader.read()
    writer.close()
    return data


def test_tenant_header_alone_names_the_tenant():
    """Header mode: the tenant is the header (stripped) and nothing else; the body's cache_salt (the
    server drops it) neither routes nor reaches the routing memory, so a client without the header
    cannot probe another tenant's prompts. A repeated or non-UTF-8 header is a 400, not forwarded.
    Other repeated headers pass both ways."""

    async def main():
        hits: list = []
        w_runner, w_url = await _serve(_echo_worker(hits))
        router = Router([w_url], None, tenant_header="X-Tenant-Id", load_poll_s=0, model_path="")
        r_runner, r_url = await _serve(router.app())
        secret = json.dumps({"input_ids": list(range(1000, 1064)), "cache_salt": "victim"})
        try:
            async with aiohttp.ClientSession() as s:
                twice = [("x-tenant-id", "victim"), ("x-tenant-id", "attacker")]
                async with s.post(r_url + "/generate", data=secret, headers=twice) as resp:
                    assert resp.status == 400
                    assert "at most once" in (await resp.json())["error"]["message"]
                assert hits == [] and router.stats.requests == 0
                data = await _raw_post(r_url, b"X-Tenant-Id: caf\xe9", secret.encode())
                assert data.startswith(b"HTTP/1.1 400") and b"UTF-8" in data and hits == []

                async with s.post(r_url + "/generate", data=secret, headers={"x-tenant-id": " victim "}) as resp:
                    assert resp.status == 200
                assert router.decisions[-1]["tenant"] == tenant_digest("victim")  # never the name itself
                # the same prompt, no header, the victim's salt in the body: no tenant, nothing remembered
                async with s.post(r_url + "/generate", data=secret) as resp:
                    assert resp.status == 200
                assert router.decisions[-1]["tenant"] is None and router.decisions[-1]["memory"] == {}
                async with s.post(r_url + "/generate", data=secret, headers={"x-tenant-id": "  "}) as resp:
                    assert resp.status == 200
                assert router.decisions[-1]["tenant"] is None

                trace = [("x-tenant-id", "acme"), ("x-trace", "1"), ("x-trace", "2")]
                async with s.post(r_url + "/generate", data=secret, headers=trace) as resp:
                    assert resp.headers.getall("set-cookie") == ["a=1", "b=2"]
                assert [v for k, v in hits[-1]["headers"] if k.lower() == "x-trace"] == ["1", "2"]
        finally:
            await r_runner.cleanup()
            await w_runner.cleanup()

    asyncio.run(main())


def test_long_tenant_is_stored_as_a_label_and_hashed_whole():
    """A 1 MiB cache_salt: the decisions log, the seed memos and the policy's key window keep a
    short label, while the page hashes still take the whole tenant, as the server's do (a
    simulated TieredRadixCache publishing to an index: the router's hashes match its pages)."""
    from sglang_tiered.core.keys import CacheKey
    from sglang_tiered.fleet.sim import SimIndex
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

    long = "acme-" + "x" * (1 << 20)
    toks = list(range(16, 16 + 160))
    cache = TieredRadixCache.create_simulated(512, page_size=16)
    idx = SimIndex()
    cache.attach_index(idx.listener("s0"))
    cache.driver.run(toks, tenant=long)
    probe = Router(["http://127.0.0.1:1"], None, load_poll_s=0)
    probe.cache_key = CacheKey()
    assert idx.matched(probe.hashes_of(toks, long), 16, ["s0"]) == {"s0": 160}
    assert idx.matched(probe.hashes_of(toks, long[:-1] + "y"), 16, ["s0"]) == {}  # the whole name counts

    async def main():
        hits: list = []
        w_runner, w_url = await _serve(_echo_worker(hits))
        router = Router([w_url], None, load_poll_s=0, model_path="")
        router.cache_key = CacheKey()
        r_runner, r_url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as s:
                for i in range(8):
                    body = json.dumps({"input_ids": toks, "cache_salt": f"{i}-{long}"})
                    async with s.post(r_url + "/generate", data=body) as resp:
                        assert resp.status == 200
        finally:
            await r_runner.cleanup()
            await w_runner.cleanup()
        labels = [d["tenant"] for d in router.decisions]
        assert len(set(labels)) == 8 and max(map(len, labels)) <= 81
        (seeds,) = router._seeds.values()  # one CacheKey
        assert len(seeds) == len(router._memory_seeds) == 8
        assert max(len(k) for k in [*(t for t, _ in seeds), *router._memory_seeds, *router.policy._window]) <= 100

    asyncio.run(main())


def test_proxy_pool_is_uncapped_and_health_checks_have_their_own():
    """150 long requests at once reach the workers together (aiohttp's default pool stopped at
    100, the rest waited inside the router), and health checks keep answering meanwhile."""

    async def main():
        now = {"n": 0, "peak": 0}
        health_under_load: list = []

        def stub():
            app = web.Application()

            async def gen(req):
                await req.read()
                now["n"] += 1
                now["peak"] = max(now["peak"], now["n"])
                await asyncio.sleep(5.0)  # a long generation: longer than two health checks time out (2 s)
                now["n"] -= 1
                return web.json_response({})

            async def health(_):
                if now["n"]:
                    health_under_load.append(time.monotonic())
                return web.json_response({})

            app.router.add_post("/generate", gen)
            app.router.add_get("/health", health)
            return app

        workers = [await _serve(stub()) for _ in range(3)]
        router = Router([u for _, u in workers], None, load_poll_s=0, model_path="", health_interval_s=0.2,
                        health_misses=2)  # fmt: skip
        r_runner, r_url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

                async def one(i):
                    async with s.post(r_url + "/generate", json={"input_ids": [i] * 40}) as resp:
                        await resp.read()
                        return resp.status

                codes = await asyncio.gather(*(one(i) for i in range(150)))
        finally:
            await r_runner.cleanup()
            for runner, _ in workers:
                await runner.cleanup()
        assert set(codes) == {200} and now["peak"] == 150, now
        assert len(health_under_load) >= 3 and router.stats.health_downs == 0
        assert all(w.healthy and w.inflight == 0 for w in router.workers.values())

    asyncio.run(main())


def test_publisher_dropped_removal_withdraws_its_claims():
    """A removal dropped by a full queue: the publisher starts over (discards the queue, withdraws
    and forgets every claim) instead of refreshing the stale page for ever; pages stored after are
    published again. A dropped store alone only costs its claim. Redis down: still never blocks."""
    redis = pytest.importorskip("redis")
    from sglang_tiered.fleet import publisher as P
    from sglang_tiered.fleet.index import page_key

    h, g = b"\x01" * 16, b"\x02" * 16
    with _redis_server() as (_, port):
        r = redis.Redis(port=port)
        pub = P.IndexPublisher(f"redis://127.0.0.1:{port}/0", "srv", ttl_s=2.0, start=False)
        try:
            pub._client = pub._connect()
            pub._send(*pub._apply_local([("s", [h])]))
            assert r.hget(page_key(h), "srv") is not None
            for _ in range(P.QUEUE_MAX):  # a burst fills the queue (here: stores of h again)
                pub.on_store([h])
            pub.on_store([g])  # dropped: g is only unclaimed
            assert pub.stats["dropped_events"] == 1 and not pub._overflowed.is_set()
            pub.on_remove([h])  # dropped: the server evicted h
            assert pub.stats["dropped_events"] == 2 and pub._overflowed.is_set()
            pub._thread = threading.Thread(target=pub._run, daemon=True)
            pub._thread.start()
            deadline = time.time() + 5
            while r.hget(page_key(h), "srv") is not None and time.time() < deadline:
                time.sleep(0.05)
            assert r.hget(page_key(h), "srv") is None and pub.stats["resyncs"] == 1
            pub.on_store([g])
            while r.hget(page_key(g), "srv") is None and time.time() < deadline:
                time.sleep(0.05)
            time.sleep(2.5)  # past a refresh (TTL/2): h stays withdrawn, g claimed
            assert r.hget(page_key(h), "srv") is None and r.hget(page_key(g), "srv") is not None
            assert list(pub._held) == [g]
        finally:
            pub.close()

    down = P.IndexPublisher("redis://127.0.0.1:1/0", "srv", ttl_s=2.0, socket_timeout_s=0.05, start=False)
    for _ in range(P.QUEUE_MAX):
        down.on_store([h])
    t0 = time.perf_counter()
    down.on_remove([h])
    assert time.perf_counter() - t0 < 0.25 and down._overflowed.is_set()
    down._thread = threading.Thread(target=down._run, daemon=True)
    down._thread.start()
    try:
        deadline = time.time() + 5
        while (down.stats["resyncs"] == 0 or down.stats["errors"] == 0) and time.time() < deadline:
            time.sleep(0.05)
        assert down.stats["resyncs"] == 1 and down.stats["errors"] >= 1 and not down.connected
    finally:
        down.close()


@contextlib.contextmanager
def _served_router(worker_url: str):
    """``sglang-tiered route``'s own serve() in a subprocess on 127.0.0.1: yields its base URL."""
    from sglang_tiered.dev.server import free_port

    port = free_port()
    code = ("import sys; from sglang_tiered.fleet.router import serve; "
            "serve([sys.argv[1]], port=int(sys.argv[2]), load_poll_s=0, model_path='')")  # fmt: skip
    p = subprocess.Popen([sys.executable, "-c", code, worker_url, str(port)], cwd=ROOT)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        p.terminate()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


async def _router_up(s, url: str, timeout_s: float = 30.0) -> None:
    """Wait until the router at ``url`` (a subprocess) answers ``/health`` with 200."""
    deadline = time.monotonic() + timeout_s
    while True:  # the subprocess up, and its worker healthy
        try:
            async with s.get(url + "/health") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            pass
        assert time.monotonic() < deadline, "router did not start"
        await asyncio.sleep(0.1)


def test_client_gone_before_a_non_streamed_answer():
    """serve() cancels a handler whose client left: the upstream request closes, so the worker sees
    the disconnect (SGLang then aborts the request instead of generating for nobody), and the
    router's in-flight count returns to 0. Served without cancellation (aiohttp's default), the
    answer's headers meet a closed client connection: client_gone too, not a worker failure."""

    async def main():
        seen: dict = {}

        def stub():
            app = web.Application()

            async def gen(req):
                mode = (await req.json())["mode"]
                if mode == "late":
                    await asyncio.sleep(0.8)
                    return web.json_response({})
                for i in range(40):  # a 4 s generation that checks for a disconnect, as SGLang does
                    await asyncio.sleep(0.1)
                    if req.transport is None or req.transport.is_closing():
                        seen["aborted_after_s"] = i / 10
                        return web.json_response({})
                seen["completed"] = True
                return web.json_response({})

            app.router.add_post("/generate", gen)
            app.router.add_get("/health", lambda _: web.json_response({}))
            return app

        async def leave_early(s, url, mode):
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(s.post(url + "/generate", json={"input_ids": [1, 2], "mode": mode}), 0.3)

        w_runner, w_url = await _serve(stub())
        try:
            async with aiohttp.ClientSession() as s:
                with _served_router(w_url) as url:
                    await _router_up(s, url)
                    await leave_early(s, url, "watch")
                    deadline = time.monotonic() + 5
                    while True:
                        async with s.get(url + "/router/stats") as resp:
                            doc = await resp.json()
                        done = doc["client_gone"] and not doc["workers"][w_url]["inflight"] and seen
                        if done or time.monotonic() > deadline:
                            break
                        await asyncio.sleep(0.05)
                    assert doc["client_gone"] == 1 and doc["failed"] == 0, doc
                    assert doc["workers"][w_url] == {**doc["workers"][w_url], "inflight": 0, "failures": 0,
                                                     "healthy": True}, doc  # fmt: skip
                    assert "aborted_after_s" in seen and "completed" not in seen, seen

                router = Router([w_url], None, load_poll_s=0, model_path="")
                r_runner, url = await _serve(router.app())
                try:
                    await leave_early(s, url, "late")
                    ws = router.workers[w_url]
                    deadline = time.monotonic() + 5
                    while (ws.inflight or not router.stats.client_gone) and time.monotonic() < deadline:
                        await asyncio.sleep(0.05)
                    assert ws.inflight == 0 and router.stats.client_gone == 1, router.stats_doc()
                    assert router.stats.failed == 0 and ws.failures == 0 and ws.healthy, router.stats_doc()
                finally:
                    await r_runner.cleanup()
        finally:
            await w_runner.cleanup()

    asyncio.run(main())


def test_deeply_nested_json_body_is_forwarded_as_it_is():
    """A body nested past the JSON parser's depth (RecursionError, not ValueError) routes without
    locality and reaches the worker unchanged, as any other unparsable body: not a 500."""

    async def main():
        hits: list = []
        w_runner, w_url = await _serve(_echo_worker(hits))
        router = Router([w_url], None, load_poll_s=0, model_path="")
        r_runner, r_url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(r_url + "/generate", data=b"[" * 100_000) as resp:
                    assert resp.status == 200 and (await resp.json())["body_len"] == 100_000
        finally:
            await r_runner.cleanup()
            await w_runner.cleanup()
        assert router.stats.requests == 1 and router.stats.failed == 0 and router.decisions[-1]["tokens"] == 0

    asyncio.run(main())


def test_a_bad_header_is_the_clients_fault_not_the_workers():
    """A header with bytes that are not UTF-8 is dropped (session 21: SGLang serves such a
    request, and python-requests sends latin-1 values) and the request is served; no worker is
    marked down (before session 17, the upstream request failed to encode it and every worker
    was blamed in turn). The tenant header and ``authorization`` still get a 400
    (test_tenant_header_alone_names_the_tenant)."""
    import asyncio
    import json as _json

    from sglang_tiered.fleet.router import Router

    async def main():
        from aiohttp import web

        async def gen(request):
            return web.json_response({"ok": True})

        app = web.Application()
        app.router.add_post("/generate", gen)
        runners, urls = [], []
        for _ in range(2):
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        router = Router(urls, None, load_poll_s=0, model_path="", health_interval_s=60)
        rr = web.AppRunner(router.app())
        await rr.setup()
        rsite = web.TCPSite(rr, "127.0.0.1", 0)
        await rsite.start()
        port = rsite._server.sockets[0].getsockname()[1]
        try:
            body = _json.dumps({"input_ids": list(range(32))}).encode()
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Trace: caf\xe9\r\n"
                    b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
            await w.drain()
            status = (await r.read()).split(b"\r\n", 1)[0]
            w.close()
            assert b" 200 " in status, status
            assert all(s.healthy for s in router.workers.values())
            assert router.stats.retries == 0 and router.stats.failed == 0
        finally:
            await rr.cleanup()
            for x in runners:
                await x.cleanup()

    asyncio.run(main())


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions", "/cache/invalidate", "/v1/tokenize"])
def test_a_body_that_is_not_its_content_encoding_is_400(path):
    """A body whose ``Content-Encoding`` lies (plain JSON labelled gzip, or garbage labelled
    deflate) is a 400 with a message, on the routed paths and on the proxied ones alike; before
    (session 27, a differential fuzz of the router against its worker) aiohttp's decode error
    escaped the handler and the client got a 500. A real gzip body is still decoded and forwarded
    plain, and nothing reaches a worker for the refused ones."""
    import gzip

    async def main():
        hits: list = []
        app = _echo_worker(hits)
        for p in ("/cache/invalidate", "/v1/tokenize"):
            app.router.add_post(p, lambda req: web.json_response({"ok": True}))
        w_runner, w_url = await _serve(app)
        router = Router([w_url], None, load_poll_s=0, model_path="")
        r_runner, r_url = await _serve(router.app())
        body = json.dumps({"text": "hello", "sampling_params": {"max_new_tokens": 1}}).encode()
        try:
            async with aiohttp.ClientSession() as s:
                for enc, data in (("gzip", body), ("deflate", b"\x00garbage"), ("gzip", b"\x1f\x8b\x08\x00" + b"not deflate" * 9)):
                    async with s.post(r_url + path, data=data, headers={"Content-Encoding": enc}) as resp:
                        text = await resp.text()
                        assert resp.status == 400, (enc, resp.status, text)
                        msg = json.loads(text)["error"]["message"]
                        assert "Content-Encoding: " + enc in msg and "Traceback" not in msg, msg
                assert not hits
                async with s.post(r_url + path, data=gzip.compress(body), headers={"Content-Encoding": "gzip"}) as resp:
                    assert resp.status == 200, await resp.text()
        finally:
            await r_runner.cleanup()
            await w_runner.cleanup()
        if path in ROUTES:
            assert len(hits) == 1 and hits[0]["body_len"] == len(body)
            assert not any(k.lower() == "content-encoding" for k, _ in hits[0]["headers"])

    asyncio.run(main())


def test_a_refused_invalidation_is_the_clients_400_even_with_a_worker_down():
    """``/cache/invalidate`` goes to every worker and answers the worst status, so with one worker
    down a body every live worker refuses (400) came back as a 502 (session 27, the router fuzz);
    a refusal now wins: the client learns its body is wrong. An accepted one with a worker down
    is still a 502 (that worker's entries may still be there)."""

    async def main():
        app = web.Application()

        async def inv(req):
            doc = await req.json()
            if "tenant" not in doc:
                return web.json_response({"error": {"message": "name a tenant"}}, status=400)
            return web.json_response({"dropped_tokens": 0}, status=202)

        app.router.add_post("/cache/invalidate", inv)
        app.router.add_get("/health", lambda _: web.json_response({}))
        w_runner, w_url = await _serve(app)
        with socket.socket() as sk:  # a port nothing listens on: the down worker
            sk.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{sk.getsockname()[1]}"
        router = Router([w_url, dead], None, load_poll_s=0, model_path="", health_interval_s=60)
        r_runner, url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/cache/invalidate", json={"x": 1}) as resp:
                    doc = await resp.json()
                    assert resp.status == 400 and doc[w_url]["status"] == 400 and doc[dead]["status"] == 502, doc
                async with s.post(url + "/cache/invalidate", json={"tenant": "t"}) as resp:
                    doc = await resp.json()
                    assert resp.status == 502 and doc[w_url]["status"] == 202, doc
        finally:
            await r_runner.cleanup()
            await w_runner.cleanup()

    asyncio.run(main())
