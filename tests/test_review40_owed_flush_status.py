"""A worker that refused an owed flush (400: requests still running) is still queued behind it,
not refusing the next fleet-wide call (review, session 40).

``_pay`` keeps such a flush owed and records the worker's answer in ``owed_status``, which the
broadcast answers for a worker queued behind what it owes. A 400 there read as the worker refusing
the call: an invalidation its peers took came back a 400 and was owed to nobody (the worker came
back with the KV the invalidation dropped), and a weight update took the worker out of the routing
set as one that refused it, never owed the update. Stub aiohttp workers on 127.0.0.1, the real
Router app in front of them."""

from __future__ import annotations

import aiohttp
import asyncio

from sglang_tiered.fleet.router import Router
from tests.test_fleet_hardening import _down, _serve, _serve_on
from tests.test_fleet_owed import _until
from tests.test_review40_fleet_owed_routes import _worker


def test_a_worker_behind_an_owed_flush_it_refused_still_owes_the_next_calls():
    async def main():
        log: list = []
        r0, u0 = await _serve(_worker("w0", log, {}))
        port, u1 = await _down(_worker("w1", log, {}))  # w1 is down
        router = Router([u0, u1], None, load_poll_s=0, model_path="", health_interval_s=0.1)
        rr, url = await _serve(router.app())
        state1: dict = {"/flush_cache": 400}  # back, but busy: the owed flush is refused for now
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/flush_cache") as resp:
                    assert resp.status == 502 and (await resp.json())[u1].get("owed") is True
                runner = await _serve_on(_worker("w1", log, state1), port)
                await _until(lambda: any(e[:2] == ("w1", "/flush_cache") for e in log))
                async with s.post(url + "/cache/invalidate", json={"tenant": "t", "generation": 7}) as resp:
                    doc = await resp.json()
                assert resp.status >= 500 and doc[u1].get("owed") is True, (resp.status, doc)
                async with s.post(url + "/update_weights_from_disk", json={"model_path": "/m/v2"}) as resp:
                    doc = await resp.json()
                assert resp.status >= 500 and doc[u1].get("owed") is True, (resp.status, doc)
                assert router.workers[u1].weights_refused is None
                state1["/flush_cache"] = 200
                await _until(lambda: not router.workers[u1].owed)
                took = [p for w, p, _m, _b, *st in log if w == "w1" and st == [200]]
                assert took == ["/flush_cache", "/cache/invalidate", "/update_weights_from_disk"], took
        finally:
            await rr.cleanup()
            await r0.cleanup()
            await runner.cleanup()

    asyncio.run(main())
