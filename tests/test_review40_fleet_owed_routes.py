"""Every fleet-wide call a worker must not miss is owed to it (session 40).

Before, only ``/cache/invalidate`` was owed: a worker down through a ``/flush_cache``, an
``/update_weights_from_disk``, an ``/update_weight_version`` or an adapter load or unload came back
and was routed to again with the flushed KV, the old weights or the old adapters, beside peers on
the new ones (the broadcast answered 502 for it and forgot). Now each is kept for it, in order
with its owed invalidations, and delivered before it routes again. Stub aiohttp workers on
127.0.0.1, the real Router app in front of them."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from sglang_tiered.fleet.router import Router
from tests.test_fleet_hardening import _down, _serve, _serve_on
from tests.test_fleet_owed import _gen, _until

ROUTES = ("/flush_cache", "/update_weights_from_disk", "/update_weight_version", "/load_lora_adapter",
          "/unload_lora_adapter", "/cache/invalidate")  # fmt: skip


def _worker(name: str, log: list, state: dict):
    """A stub worker: ``/generate`` answers its name; every route of ROUTES logs (name, path,
    method, body) and answers ``state[path]`` (200 by default)."""
    app = web.Application()

    async def gen(req):
        await req.read()
        log.append((name, "/generate", req.method, None))
        return web.json_response({"text": name, "meta_info": {}})

    async def call(req):
        raw = await req.read()
        st = state.get(req.path, 200)
        log.append((name, req.path, req.method, raw.decode() or None, st))
        return web.json_response({"success": st < 300}, status=st)

    app.router.add_post("/generate", gen)
    for route in ROUTES:
        app.router.add_route("*", route, call)
    app.router.add_get("/health", lambda _: web.json_response({}))
    return app


def test_a_worker_down_through_flush_weights_and_adapter_calls_gets_them_before_it_routes_again():
    """w1 is down through a flush, two weight updates, a version label, two adapter loads, an
    unload and an invalidation: each answer says it is owed; back on its port, w1 gets them in
    order (the newer weight update in place of the older, both adapter loads), the flush it first
    refuses (400: requests running) is tried again, not dropped (the rest wait behind it), and no request reaches w1 before."""

    async def main():
        log: list = []
        r0, u0 = await _serve(_worker("w0", log, {}))
        port, u1 = await _down(_worker("w1", log, {}))  # w1 is down
        router = Router([u0, u1], None, load_poll_s=0, model_path="", health_interval_s=0.1)
        rr, url = await _serve(router.app())
        calls = [("GET", "/flush_cache", None), ("POST", "/update_weights_from_disk", {"model_path": "/m/v1"}),
                 ("POST", "/load_lora_adapter", {"lora_name": "a", "lora_path": "/l/a"}),
                 ("POST", "/update_weights_from_disk", {"model_path": "/m/v2"}),
                 ("POST", "/update_weight_version", {"new_version": "v2"}),
                 ("POST", "/load_lora_adapter", {"lora_name": "b", "lora_path": "/l/b"}),
                 ("POST", "/unload_lora_adapter", {"lora_name": "a"}),
                 ("POST", "/cache/invalidate", {"tenant": "t", "generation": 5})]  # fmt: skip
        state1: dict = {"/flush_cache": 400}
        try:
            async with aiohttp.ClientSession() as s:
                for method, path, body in calls:
                    async with s.request(method, url + path, json=body) as resp:
                        doc = await resp.json()
                    assert resp.status == 502 and doc[u1].get("owed") is True, (path, doc)
                assert set(await _gen(s, url, 4)) == {"w0"}
                runner = await _serve_on(_worker("w1", log, state1), port)  # back, on the same port
                await _until(lambda: any(e[:2] == ("w1", "/flush_cache") for e in log))
                await asyncio.sleep(0.4)
                assert not router.workers[u1].healthy and router.workers[u1].owed  # (the flush is still owed)
                state1["/flush_cache"] = 200
                await _until(lambda: router.workers[u1].healthy)
                took = [(p, m, b) for w, p, m, b, *st in log if w == "w1" and p != "/generate" and st == [200]]
                assert [p for p, _, _ in took] == ["/flush_cache", "/load_lora_adapter", "/update_weights_from_disk",
                                                   "/update_weight_version", "/load_lora_adapter",
                                                   "/unload_lora_adapter", "/cache/invalidate"], took  # fmt: skip
                assert took[0][1] == "GET" and '"/m/v2"' in took[2][2], took
                assert not any(w == "w1" and p == "/generate" for w, p, *_ in log)
                assert "w1" in set(await _gen(s, url, 6))
        finally:
            await rr.cleanup()
            await r0.cleanup()
            await runner.cleanup()

    asyncio.run(main())


def test_a_flush_is_owed_to_a_down_worker_even_when_a_busy_peer_refuses_it():
    """w0 answers 400 to the flush (requests still running there) while w1 is down: the answer is
    w0's 400, and w1 still owes the flush (a body that one worker refuses is refused by all, but a
    flush has none)."""

    async def main():
        log: list = []
        r0, u0 = await _serve(_worker("w0", log, {"/flush_cache": 400}))
        router = Router([u0, "http://127.0.0.1:1"], None, load_poll_s=0, model_path="", health_interval_s=30)
        rr, url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/flush_cache") as resp:
                    doc = await resp.json()
                assert resp.status == 400 and doc["http://127.0.0.1:1"].get("owed") is True, doc
                assert len(router.workers["http://127.0.0.1:1"].owed) == 1
        finally:
            await rr.cleanup()
            await r0.cleanup()

    asyncio.run(main())


def test_a_flush_the_workers_refuse_for_authority_is_not_owed():
    """A flush a tenant may not make (the servers' 403 in tenant mode without the admin key) is not
    owed to a worker that was down: it would refuse it too, and was out of the routing set meanwhile."""

    async def main():
        log: list = []
        r0, u0 = await _serve(_worker("w0", log, {"/flush_cache": 403}))
        router = Router([u0, "http://127.0.0.1:1"], None, load_poll_s=0, model_path="", health_interval_s=30)
        rr, url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/flush_cache") as resp:
                    doc = await resp.json()
                assert resp.status == 403 and "owed" not in doc["http://127.0.0.1:1"], doc
                assert not router.workers["http://127.0.0.1:1"].owed
        finally:
            await rr.cleanup()
            await r0.cleanup()

    asyncio.run(main())


def test_a_worker_that_never_answers_owes_the_call_instead_of_holding_the_answer(monkeypatch):
    """w1 accepts connections and never answers (frozen): an invalidation and a flush through the
    router are answered once their bound passes, with w1's 502 and ``"owed": true``. Before, the
    broadcast waited for w1 for good (no timeout) and nothing was owed."""
    import socket
    import threading

    from sglang_tiered.fleet import router as router_mod

    monkeypatch.setattr(router_mod, "OWED_TIMEOUT_S", 1.0)
    monkeypatch.setattr(router_mod, "OWED_FLUSH_S", 1.0)
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(16)
    held: list = []
    stop = threading.Event()

    def accept():
        lsock.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(lsock.accept()[0])  # (kept open, never read from, never answered)
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    u1 = f"http://127.0.0.1:{lsock.getsockname()[1]}"

    async def main():
        log: list = []
        r0, u0 = await _serve(_worker("w0", log, {}))
        router = Router([u0, u1], None, load_poll_s=0, model_path="", health_interval_s=30)
        rr, url = await _serve(router.app(), shutdown_timeout=1)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=8)) as s:
                for path, body in (("/cache/invalidate", {"tenant": "t"}), ("/flush_cache", None)):
                    async with s.post(url + path, json=body) as resp:
                        doc = await resp.json()
                    # (504 since session 41: no answer in the call's bound, said naming the worker)
                    assert resp.status == 504 and doc[u1].get("owed") is True and doc[u0]["status"] == 200, doc
            assert len(router.workers[u1].owed) == 2 and not router.workers[u1].healthy
        finally:
            await rr.cleanup()
            await r0.cleanup()

    try:
        asyncio.run(main())
    finally:
        stop.set()
        t.join(2)
        for c in held:
            c.close()
        lsock.close()


def test_an_owed_flush_is_not_replaced_by_another_callers():
    """With every worker down, the operator's flush is owed; a later flush by a caller the workers
    will refuse (another key) is owed apart and does not replace it: the operator's is still
    delivered (before, one scope per route: the refused one replaced it, and was dropped)."""
    router = Router(["http://127.0.0.1:1"], None, load_poll_s=0, model_path="")
    ws = router.workers["http://127.0.0.1:1"]
    router._owe(ws, b"", b"", [("Authorization", "Bearer admin")], "POST", "/flush_cache")
    router._owe(ws, b"", b"", [("Authorization", "Bearer wrong")], "POST", "/flush_cache")
    router._owe(ws, b"", b"", [("Authorization", "Bearer admin"), ("X-Request-Id", "2")], "POST", "/flush_cache")
    assert [e[2][0][1] for e in ws.owed.values()] == ["Bearer wrong", "Bearer admin"]


def test_one_server_weight_calls_are_refused_not_sent_to_one_worker():
    """``/update_weights_from_tensor`` (and the other calls that carry one server's tensors, process
    group or sleep) through the router: a 400 that says to call each worker, and no worker gets it.
    Before, the least busy worker alone took it and the fleet served mixed weights."""

    async def main():
        log: list = []
        app = _worker("w0", log, {})
        seen: list = []

        async def any_call(req):
            seen.append(req.path)
            return web.json_response({"success": True})

        for path in ("/update_weights_from_tensor", "/release_memory_occupation"):
            app.router.add_post(path, any_call)
        r0, u0 = await _serve(app)
        router = Router([u0], None, load_poll_s=0, model_path="", health_interval_s=30)
        rr, url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as s:
                for path in ("/update_weights_from_tensor", "/release_memory_occupation"):
                    async with s.post(url + path, json={"serialized_named_tensors": []}) as resp:
                        doc = await resp.json()
                    assert resp.status == 400 and "each worker" in doc["error"]["message"], doc
            assert seen == []
        finally:
            await rr.cleanup()
            await r0.cleanup()

    asyncio.run(main())


def test_a_flush_is_given_its_own_wait_and_the_time_to_persist(monkeypatch):
    """A flush through the router is bounded by OWED_FLUSH_S plus the wait its ``timeout`` query
    asks SGLang for (with T1 on a flush first copies the device tree to host memory). Before, it
    had OWED_TIMEOUT_S (10 s) like an invalidation: a slow flush answered the client 502 and was
    owed to a worker that had taken it (review, session 40)."""
    from sglang_tiered.fleet import router as router_mod

    monkeypatch.setattr(router_mod, "OWED_TIMEOUT_S", 0.3)
    monkeypatch.setattr(router_mod, "OWED_FLUSH_S", 0.3)
    assert router_mod.owed_timeout("/flush_cache?timeout=2").total == 2.3
    assert router_mod.owed_timeout("/flush_cache?timeout=nan").total == 0.3
    assert router_mod.owed_timeout("/cache/invalidate").total == 0.3

    def slow_worker(log):
        app = web.Application()

        async def flush(req):
            await asyncio.sleep(1.0)  # (a flush persisting a big tree to T1)
            log.append(req.query.get("timeout"))
            return web.json_response({"success": True})

        app.router.add_route("*", "/flush_cache", flush)
        app.router.add_get("/health", lambda _: web.json_response({}))
        return app

    async def main():
        log: list = []
        r0, u0 = await _serve(slow_worker(log))
        r1, u1 = await _serve(slow_worker(log))
        router = Router([u0, u1], None, load_poll_s=0, model_path="", health_interval_s=30)
        rr, url = await _serve(router.app(), shutdown_timeout=1)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=8)) as s:
                async with s.post(url + "/flush_cache?timeout=2") as resp:
                    doc = await resp.json()
            assert resp.status == 200, doc
            assert log == ["2", "2"]
            assert not router.workers[u0].owed and not router.workers[u1].owed
        finally:
            await rr.cleanup()
            await r1.cleanup()
            await r0.cleanup()

    asyncio.run(main())
