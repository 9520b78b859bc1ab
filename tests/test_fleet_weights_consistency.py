"""The fleet serves one set of weights: a worker whose weights differ from what the router last
broadcast is out of the routing set, with its reason in ``/router/stats`` (session 40).

Before: (a) a worker restarted after a weight update it took came back on its launch weights,
owed nothing, and was routed to beside peers on the new weights; (b) a worker that refused (4xx)
a weight update its peers took stayed in the routing set on the old weights. Stub aiohttp workers
on 127.0.0.1 that report ``model_path`` and ``weight_version`` at ``/model_info`` as SGLang does,
the real Router app in front of them."""

from __future__ import annotations

import asyncio
import aiohttp
from aiohttp import web

from sglang_tiered.fleet.router import Router
from tests.test_fleet_hardening import _serve, _serve_on
from tests.test_fleet_owed import _until


async def _gen(s, url, n):
    """``n`` requests of 2n tenants (``cache_salt``: spread over the workers by rendezvous): the
    names of the workers that answered."""
    got = set()
    for i in range(2 * n):
        body = {"text": f"hello {i}", "cache_salt": f"t{i}", "sampling_params": {"max_new_tokens": 1}}
        async with s.post(url + "/generate", json=body) as r:
            assert r.status == 200
            got.add((await r.json())["text"])
    return got


def _worker(name: str, launch: str = "/m/v1", refuse: bool = False):
    """A stub SGLang worker launched on ``launch`` (weight_version 'default'): a weight update
    moves ``model_path`` (and the label when given), as SGLang's does; ``refuse``: it answers 400
    (the checkpoint is not there) and keeps its weights."""
    app = web.Application()
    info = {"model_path": launch, "weight_version": "default"}

    async def gen(req):
        await req.read()
        return web.json_response({"text": name, "meta_info": {}})

    async def from_disk(req):
        body = await req.json()
        if refuse:
            return web.json_response({"success": False, "message": "no such checkpoint"}, status=400)
        info["model_path"] = body["model_path"]
        if body.get("weight_version") is not None:
            info["weight_version"] = body["weight_version"]
        return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})

    async def version(req):
        info["weight_version"] = (await req.json())["new_version"]
        return web.json_response({"success": True, "new_version": info["weight_version"]})

    app.router.add_post("/generate", gen)
    app.router.add_post("/update_weights_from_disk", from_disk)
    app.router.add_post("/update_weight_version", version)
    app.router.add_get("/model_info", lambda _: web.json_response(dict(info)))
    app.router.add_get("/health", lambda _: web.json_response({}))
    return app


def test_a_worker_restarted_on_its_launch_weights_after_an_update_is_not_routed_to():
    """Both workers take /m/v2 (label v2); w1 restarts on /m/v1 (its launch weights, label
    'default'): it answers /health, but no request reaches it while it reports other weights than
    the fleet's; the update it is owed then brings it back (session 41)."""

    async def main():
        r0, u0 = await _serve(_worker("w0"))
        r1, u1 = await _serve(_worker("w1"))
        port = int(u1.rsplit(":", 1)[1])
        router = Router([u0, u1], None, load_poll_s=0, model_path="", health_interval_s=0.1)
        rr, url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as s:
                body = {"model_path": "/m/v2", "weight_version": "v2"}
                async with s.post(url + "/update_weights_from_disk", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                assert set(await _gen(s, url, 4)) == {"w0", "w1"}
                await r1.cleanup()  # w1 restarts: back on its launch weights
                r1 = await _serve_on(_worker("w1"), port)
                await _until(lambda: router.workers[u1].weights_differ is not None)
                assert not router.workers[u1].healthy
                # (since session 41 it is owed the fleet's last update, takes it, and comes back
                # by itself once its /model_info agrees: tests/test_review41_router.py)
                await _until(lambda: router.workers[u1].healthy)
                assert router.workers[u1].weights_differ is None
                assert "w1" in set(await _gen(s, url, 6))
        finally:
            await rr.cleanup()
            await r0.cleanup()
            await r1.cleanup()

    asyncio.run(main())


def test_a_worker_that_refuses_a_weight_update_its_peers_took_leaves_the_routing_set():
    """w1 answers 400 to an update w0 took (its checkpoint path is missing there): the answer is
    the 400 with w1 marked out of the routing set, no request reaches w1 (not even before the next
    health check), and it stays out, also for an update to the same path (model_info cannot tell),
    until it takes one."""

    async def main():
        r0, u0 = await _serve(_worker("w0"))
        r1, u1 = await _serve(_worker("w1", refuse=True))
        port = int(u1.rsplit(":", 1)[1])
        router = Router([u0, u1], None, load_poll_s=0, model_path="", health_interval_s=0.1)
        rr, url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as s:
                # a reload from the launch path (new files there): model_info is the same after it
                async with s.post(url + "/update_weights_from_disk", json={"model_path": "/m/v1"}) as resp:
                    doc = await resp.json()
                assert resp.status == 400, doc
                assert doc[u0]["status"] == 200 and doc[u1]["status"] == 400 and doc[u1].get("out_of_routing"), doc
                assert set(await _gen(s, url, 4)) == {"w0"}
                await asyncio.sleep(0.4)  # (health checks: its model_info matches the fleet's)
                assert set(await _gen(s, url, 4)) == {"w0"}
                async with s.get(url + "/router/stats") as resp:
                    w1 = (await resp.json())["workers"][u1]
                assert w1["healthy"] is False and "refused" in w1["weights_differ"], w1
                await r1.cleanup()
                r1 = await _serve_on(_worker("w1"), port)  # (its checkpoint is there now)
                async with s.post(url + "/update_weights_from_disk", json={"model_path": "/m/v1"}) as resp:
                    assert resp.status == 200, await resp.text()
                await _until(lambda: router.workers[u1].healthy)
                assert "w1" in set(await _gen(s, url, 6))
        finally:
            await rr.cleanup()
            await r0.cleanup()
            await r1.cleanup()

    asyncio.run(main())


def test_a_weight_update_every_worker_refuses_takes_none_out():
    """A weight update every worker refuses (a bad path) changes nothing: no worker leaves the
    routing set."""

    async def main():
        r0, u0 = await _serve(_worker("w0", refuse=True))
        r1, u1 = await _serve(_worker("w1", refuse=True))
        router = Router([u0, u1], None, load_poll_s=0, model_path="", health_interval_s=0.1)
        rr, url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/update_weights_from_disk", json={"model_path": "/nope"}) as resp:
                    assert resp.status == 400
                await asyncio.sleep(0.3)
                assert set(await _gen(s, url, 4)) == {"w0", "w1"}
        finally:
            await rr.cleanup()
            await r0.cleanup()
            await r1.cleanup()

    asyncio.run(main())


def test_a_weight_update_one_worker_refuses_is_still_owed_to_a_down_one():
    """w0 takes the update, w1 refuses it, w2 is down: w2 owes it (before, one refusal made the
    whole broadcast the client's fault, and w2 was owed nothing), and w1 is out."""

    async def main():
        r0, u0 = await _serve(_worker("w0"))
        r1, u1 = await _serve(_worker("w1", refuse=True))
        u2 = "http://127.0.0.1:1"
        router = Router([u0, u1, u2], None, load_poll_s=0, model_path="", health_interval_s=30)
        rr, url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/update_weights_from_disk", json={"model_path": "/m/v2"}) as resp:
                    doc = await resp.json()
                assert resp.status == 400 and doc[u2].get("owed") is True and doc[u1].get("out_of_routing"), doc
                assert len(router.workers[u2].owed) == 1 and not router.workers[u1].healthy
                assert router.fleet_weights == {"model_path": "/m/v2"}
        finally:
            await rr.cleanup()
            await r0.cleanup()
            await r1.cleanup()

    asyncio.run(main())
