"""A weight update every worker missed and then took on delivery is the fleet's weights (review,
session 40).

``fleet_weights`` (what ``/model_info`` is compared with at each health check) moved only when a
worker took a weight update in the broadcast itself. With every worker down (or queued behind what
it owes) the update was owed to all, delivered when each came back, and ``fleet_weights`` still
named the weights before it: every worker then reported "other weights than the fleet's" and was
out of the routing set, for good, until the next weight broadcast. Stub aiohttp workers on
127.0.0.1, the real Router app in front of them."""

from __future__ import annotations

import asyncio

import aiohttp

from sglang_tiered.fleet.router import Router
from tests.test_fleet_hardening import _serve, _serve_on
from tests.test_fleet_owed import _until
from tests.test_fleet_weights_consistency import _worker


def test_an_update_owed_to_every_worker_and_delivered_is_the_fleets_weights():
    async def main():
        r0, u0 = await _serve(_worker("w0"))
        r1, u1 = await _serve(_worker("w1"))
        ports = [int(u.rsplit(":", 1)[1]) for u in (u0, u1)]
        router = Router([u0, u1], None, load_poll_s=0, model_path="", health_interval_s=0.1)
        rr, url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/update_weights_from_disk", json={"model_path": "/m/v2"}) as resp:
                    assert resp.status == 200, await resp.text()
                await r0.cleanup()
                await r1.cleanup()  # the whole fleet is down
                async with s.post(url + "/update_weights_from_disk", json={"model_path": "/m/v3"}) as resp:
                    doc = await resp.json()
                assert resp.status == 502 and doc[u0].get("owed") and doc[u1].get("owed"), doc
                r0 = await _serve_on(_worker("w0"), ports[0])
                r1 = await _serve_on(_worker("w1"), ports[1])
                await _until(lambda: not router.workers[u0].owed and not router.workers[u1].owed)
                await asyncio.sleep(0.5)  # (health checks read /model_info: /m/v3 on both)
                assert router.fleet_weights.get("model_path") == "/m/v3", router.fleet_weights
                for u in (u0, u1):
                    w = router.workers[u]
                    assert w.healthy and w.weights_differ is None, (u, w.weights_differ)
        finally:
            await rr.cleanup()
            await r0.cleanup()
            await r1.cleanup()

    asyncio.run(main())


def test_an_update_owed_to_every_worker_and_refused_by_each_takes_none_out():
    """The same, the update refused (4xx) by each worker on delivery: no worker took it, the
    fleet's weights are as they were, and no worker is out of the routing set for refusing it (as
    when the broadcast itself was refused by all). Before, each was out, "refused an update its
    peers took", until the next weight broadcast."""

    async def main():
        r0, u0 = await _serve(_worker("w0"))
        r1, u1 = await _serve(_worker("w1"))
        ports = [int(u.rsplit(":", 1)[1]) for u in (u0, u1)]
        router = Router([u0, u1], None, load_poll_s=0, model_path="", health_interval_s=0.1)
        rr, url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/update_weights_from_disk", json={"model_path": "/m/v2"}) as resp:
                    assert resp.status == 200, await resp.text()
                await r0.cleanup()
                await r1.cleanup()
                async with s.post(url + "/update_weights_from_disk", json={"model_path": "/m/bad"}) as resp:
                    assert resp.status == 502
                r0 = await _serve_on(_worker("w0", launch="/m/v2", refuse=True), ports[0])
                r1 = await _serve_on(_worker("w1", launch="/m/v2", refuse=True), ports[1])
                await _until(lambda: not router.workers[u0].owed and not router.workers[u1].owed)
                await asyncio.sleep(0.5)
                assert router.fleet_weights.get("model_path") == "/m/v2", router.fleet_weights
                for u in (u0, u1):
                    w = router.workers[u]
                    assert w.healthy and w.weights_refused is None and w.weights_differ is None, (u, w.weights_refused)
        finally:
            await rr.cleanup()
            await r0.cleanup()
            await r1.cleanup()

    asyncio.run(main())
