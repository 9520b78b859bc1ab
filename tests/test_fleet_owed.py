"""Invalidations a worker did not take are owed to it (session 38).

Before, the router's ``POST /cache/invalidate`` broadcast answered 502 for a worker that was down
(or answered 5xx) and forgot the call: when the worker came back it was routed to again and kept
serving the tenant's old pages from its device, from a named T1 and under its old T2 generation
(the leftover of session 37's fleet audit). Now the router keeps the call for that worker, takes
it out of the routing set, and delivers the same body (same generation) before it routes there
again. Stub aiohttp workers on 127.0.0.1, the real Router app in front of them."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from sglang_tiered.fleet.router import OWED_MAX, Router
from tests.test_fleet_hardening import _down, _serve, _serve_on


def _worker(name: str, log: list, state: dict):
    """A stub worker: ``/generate`` answers its name; ``/cache/invalidate`` answers
    ``state["inv_status"]`` (202 by default) and logs (name, body) of the calls it took."""
    app = web.Application()

    async def gen(req):
        await req.read()
        log.append((name, "generate", None))
        return web.json_response({"text": name, "meta_info": {}})

    async def inv(req):
        doc = await req.json()
        st = state.get("inv_status", 202)
        log.append((name, "invalidate", doc, st))
        if st >= 300:
            return web.json_response({"error": {"message": "no"}}, status=st)
        return web.json_response({"dropped_tokens": 0}, status=st)

    app.router.add_post("/generate", gen)
    app.router.add_post("/cache/invalidate", inv)
    app.router.add_get("/health", lambda _: web.json_response({}))
    return app


async def _gen(s, url, n):
    got = []
    for i in range(n):
        async with s.post(url + "/generate", json={"text": f"hello {i}", "sampling_params": {"max_new_tokens": 1}}) as r:
            assert r.status == 200
            got.append((await r.json())["text"])
    return got


async def _until(pred, timeout=10.0):
    t = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < t, "timed out"
        await asyncio.sleep(0.05)


def test_an_invalidation_a_worker_failed_is_delivered_before_it_routes_again():
    """w1 answers 503 to the broadcast: the answer says it is owed, w1 gets no request while it
    owes, and once it takes invalidations again it gets the same body (the same generation as
    w0's) before any request. Before: w1 kept routing and never got the call."""

    async def main():
        log: list = []
        s0, s1 = {}, {"inv_status": 503}
        (r0, u0), (r1, u1) = await _serve(_worker("w0", log, s0)), await _serve(_worker("w1", log, s1))
        router = Router([u0, u1], None, load_poll_s=0, model_path="", health_interval_s=0.1)
        rr, url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/cache/invalidate", json={"tenant": "t"}) as resp:
                    doc = await resp.json()
                assert resp.status == 503 and doc[u1].get("owed") is True and "owed" not in doc[u0], doc
                gen0 = [d for w, k, d, *_ in log if k == "invalidate" and w == "w0"][0]["generation"]
                assert not router.workers[u1].healthy and len(router.workers[u1].owed) == 1
                # while it owes (and keeps refusing), every request goes to w0
                assert set(await _gen(s, url, 6)) == {"w0"}
                assert len(router.workers[u1].owed) == 1
                s1["inv_status"] = 202
                await _until(lambda: router.workers[u1].healthy)
                took = [(d, st) for w, k, d, *st in log if w == "w1" and k == "invalidate"]
                assert took[-1] == ({"tenant": "t", "generation": gen0}, [202]), took
                first_gen_after = next(i for i, e in enumerate(log) if e[0] == "w1" and e[1] == "generate") \
                    if any(e[0] == "w1" and e[1] == "generate" for e in log) else None
                assert first_gen_after is None  # (nothing reached w1 before it took the call)
                assert "w1" in set(await _gen(s, url, 6))
                async with s.get(url + "/router/stats") as r:
                    st = await r.json()
                assert st["owed_invalidations"] == 1 and st["owed_delivered"] == 1, st
                assert st["workers"][u1]["owed"] == 0
                async with s.get(url + "/router/metrics") as r:
                    text = await r.text()
                assert "sglang_tiered_router_owed_delivered_total 1.0" in text, text
        finally:
            await rr.cleanup()
            await r0.cleanup()
            await r1.cleanup()

    asyncio.run(main())


def test_a_worker_that_was_down_gets_the_call_when_it_comes_back():
    """A worker nothing listened for (stopped) comes back on its port: the router delivers the
    invalidation it missed before routing to it; a newer one of the same scope replaces the older
    (one delivery, the newer generation), another scope is delivered too, in order."""

    async def main():
        log: list = []
        r0, u0 = await _serve(_worker("w0", log, {}))
        port, u1 = await _down(_worker("w1", log, {}))  # w1 is down
        router = Router([u0, u1], None, load_poll_s=0, model_path="", health_interval_s=0.1)
        rr, url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as s:
                for body in ({"tenant": "a", "generation": 10}, {"tenant": "b", "generation": 11},
                             {"tenant": "a", "generation": 12}):  # fmt: skip
                    async with s.post(url + "/cache/invalidate", json=body) as resp:
                        doc = await resp.json()
                    assert resp.status == 502 and doc[u1]["owed"] is True, doc
                assert len(router.workers[u1].owed) == 2
                assert set(await _gen(s, url, 4)) == {"w0"}
                runner = await _serve_on(_worker("w1", log, {}), port)  # back, on the same port
                await _until(lambda: router.workers[u1].healthy)
                took = [d for w, k, d, *_ in log if w == "w1" and k == "invalidate"]
                assert took == [{"tenant": "b", "generation": 11}, {"tenant": "a", "generation": 12}], took
                assert "w1" in set(await _gen(s, url, 6))
        finally:
            await rr.cleanup()
            await r0.cleanup()
            await runner.cleanup()

    asyncio.run(main())


def test_a_refused_or_a_client_error_is_not_owed():
    """A body the workers refuse (4xx) is the client's error: nothing is owed. An owed call the
    worker refuses when it comes back (4xx: it never will take it) is dropped with a warning, and
    the worker routes again."""

    async def main():
        log: list = []
        s0, s1 = {"inv_status": 400}, {"inv_status": 500}
        (r0, u0), (r1, u1) = await _serve(_worker("w0", log, s0)), await _serve(_worker("w1", log, s1))
        router = Router([u0, u1], None, load_poll_s=0, model_path="", health_interval_s=0.1)
        rr, url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/cache/invalidate", json={"x": 1}) as resp:
                    doc = await resp.json()
                assert resp.status == 400 and not router.workers[u1].owed and "owed" not in doc[u1], doc
                s0["inv_status"] = 202
                async with s.post(url + "/cache/invalidate", json={"tenant": "t"}) as resp:
                    doc = await resp.json()
                assert resp.status == 500 and doc[u1].get("owed") is True, doc
                s1["inv_status"] = 403
                await _until(lambda: router.workers[u1].healthy)
                assert not router.workers[u1].owed
                async with s.get(url + "/router/stats") as r:
                    st = await r.json()
                assert st["owed_refused"] == 1 and st["owed_delivered"] == 0, st
        finally:
            await rr.cleanup()
            await r0.cleanup()
            await r1.cleanup()

    asyncio.run(main())


def test_owed_calls_are_bounded_per_worker():
    """Past OWED_MAX scopes the oldest owed call is dropped (counted), never unbounded memory."""
    router = Router(["http://127.0.0.1:1"], None, load_poll_s=0, model_path="")
    ws = router.workers["http://127.0.0.1:1"]
    for i in range(OWED_MAX + 3):
        plain = json.dumps({"tenant": f"t{i}"}).encode()
        router._owe(ws, plain, plain, [])
    assert len(ws.owed) == OWED_MAX and router.stats.owed_dropped == 3
    assert next(iter(ws.owed))[0] == json.dumps({"tenant": "t3"}).encode()
