"""The fleet router's leftovers of session 40 (issue #13), and an audit of its fault paths
(review, session 41). Stub aiohttp workers on 127.0.0.1, the real Router app in front of them.

1. /abort_request, /pause_generation and /continue_generation had no bound: a worker that accepts
   and never answers held the caller for good. Now each is bounded by what SGLang does
   (``owed_timeout``), and a worker that stops answering altogether answers its part as a 504
   naming it at once (``Router._hang_up``); pausing and continuing are owed to a worker that missed
   them (one scope: the last word counts), aborting is not.
2. A worker restarted after a /load_lora_adapter came back without the adapter (each request
   naming it there a 400): it is owed the fleet's adapter loads (``fleet_adapters``), in order,
   less those unloaded since, and out of the routing set until it takes them.
3. A worker whose weights differ from the fleet's was out of the routing set for good: it is owed
   the fleet's last weight calls, and back once its /model_info agrees.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from sglang_tiered.fleet import router as router_mod
from sglang_tiered.fleet.router import Router
from tests.test_fleet_hardening import _down, _serve, _serve_on
from tests.test_fleet_owed import _gen, _until

CONTROL = ("/pause_generation", "/continue_generation", "/abort_request", "/load_lora_adapter",
           "/unload_lora_adapter", "/update_weights_from_disk", "/update_weight_version")  # fmt: skip


def _worker(name: str, log: list, state: dict, launch: str = "/m/v1"):
    """A stub SGLang worker: ``/generate`` answers its name; the control routes log (name, path,
    body) and act as SGLang's do on ``state`` (paused, adapters, weights); ``state['frozen']``:
    every route, /health too, waits for ever (a stopped process with its socket open);
    ``state['hang']``: the routes it names wait for ever; ``state['sticky']``: a weight update is
    answered 200 and changes nothing."""
    app = web.Application()
    state.setdefault("adapters", [])
    state.setdefault("info", {"model_path": launch, "weight_version": "default"})

    async def hold(path: str) -> None:
        if state.get("frozen") or path in state.get("hang", ()):
            await asyncio.Event().wait()

    async def gen(req):
        await req.read()
        await hold(req.path)
        log.append((name, "/generate", None))
        return web.json_response({"text": name, "meta_info": {}})

    async def control(req):
        raw = await req.read()
        await hold(req.path)
        body = json.loads(raw) if raw else {}
        log.append((name, req.path, body))
        if req.path == "/pause_generation":
            state["paused"] = True
        elif req.path == "/continue_generation":
            state["paused"] = False
        elif req.path == "/load_lora_adapter":
            state["adapters"].append(body["lora_name"])
        elif req.path == "/unload_lora_adapter":
            if body["lora_name"] not in state["adapters"]:
                return web.json_response({"success": False, "error_message": "not loaded"}, status=400)
            state["adapters"].remove(body["lora_name"])
        elif req.path == "/update_weights_from_disk" and not state.get("sticky"):
            state["info"]["model_path"] = body["model_path"]
        elif req.path == "/update_weight_version" and not state.get("sticky"):
            state["info"]["weight_version"] = body["new_version"]
        return web.json_response({"success": True})

    async def health(req):
        await hold(req.path)
        return web.json_response({})

    async def models(req):
        await hold(req.path)
        cards = [{"id": "base", "root": launch}] + [{"id": a, "parent": "base"} for a in state["adapters"]]
        return web.json_response({"object": "list", "data": cards})

    async def info(req):
        await hold(req.path)
        return web.json_response(dict(state["info"]))

    app.router.add_post("/generate", gen)
    for route in CONTROL:
        app.router.add_post(route, control)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/model_info", info)
    return app


async def _cleanup(*runners) -> None:
    """Stop the test's servers (runners), in order; one never started (None) is skipped."""
    for r in runners:
        if r is not None:
            await r.cleanup()


async def _read_stream(s, url: str, path: str = "/generate", body=None) -> tuple[int, bytes, bool]:
    """A streamed /generate (or ``path`` with ``body``) through the router: (status, the bytes the
    client got, whether its connection was cut without a clean end)."""
    got, cut = b"", False
    async with s.post(url + path, json=body or {"text": "x", "stream": True}) as resp:
        try:
            async for chunk in resp.content.iter_any():
                got += chunk
        except aiohttp.ClientPayloadError:
            cut = True
    return resp.status, got, cut


def _calls(log: list, name: str) -> list:
    """What ``name`` was sent, in order: paths (with the adapter's name for adapter calls)."""
    return [p + (f":{b['lora_name']}" if isinstance(b, dict) and "lora_name" in b else "")
            for n, p, b in log if n == name]  # fmt: skip


def test_a_frozen_worker_answers_its_part_of_a_pause_as_a_504_naming_it_and_owes_it():
    """w1 stops answering (every route, /health too) before /pause_generation: the caller gets
    w0's 200 and, once w1 has missed its health checks, a 504 for w1 that names it, marked owed
    (before: no bound, the caller waited for ever). Answering again, w1 gets the pause before any
    request."""

    async def main():
        log: list = []
        s1: dict = {}
        r0, u0 = await _serve(_worker("w0", log, {}))
        r1, u1 = await _serve(_worker("w1", log, s1), shutdown_timeout=1)
        router = Router([u0, u1], None, load_poll_s=0, model_path="", health_interval_s=0.1)
        rr, url = await _serve(router.app(), shutdown_timeout=1)
        try:
            async with aiohttp.ClientSession() as s:
                s1["frozen"] = True
                t0 = asyncio.get_running_loop().time()

                async def pause():
                    async with s.post(url + "/pause_generation", json={"mode": "abort"}) as resp:
                        return resp.status, await resp.json()

                status, doc = await asyncio.wait_for(pause(), 20)
                took = asyncio.get_running_loop().time() - t0
                assert status == 504 and doc[u0]["status"] == 200, doc
                assert doc[u1]["status"] == 504 and u1 in doc[u1]["body"] and "stopped answering" in doc[u1]["body"]
                assert doc[u1].get("owed") is True and not router.workers[u1].healthy, doc
                assert took < 15, took
                s1["frozen"] = False
                await _until(lambda: router.workers[u1].healthy)
                assert s1.get("paused") is True and _calls(log, "w1") == ["/pause_generation"], log
        finally:
            await _cleanup(rr, r0, r1)

    asyncio.run(main())


def test_an_abort_a_worker_never_answers_is_a_504_in_its_bound_and_not_owed(monkeypatch):
    """w1 answers /health but never /abort_request: the caller gets a 504 naming w1 after the
    abort's bound (OWED_TIMEOUT_S: SGLang's handler only queues the abort), and w1 owes nothing
    (an abort_all delivered later would abort requests sent after it). Before: no bound."""
    monkeypatch.setattr(router_mod, "OWED_TIMEOUT_S", 0.5)

    async def main():
        log: list = []
        r0, u0 = await _serve(_worker("w0", log, {}))
        r1, u1 = await _serve(_worker("w1", log, {"hang": ("/abort_request",)}), shutdown_timeout=1)
        router = Router([u0, u1], None, load_poll_s=0, model_path="", health_interval_s=0.1)
        rr, url = await _serve(router.app(), shutdown_timeout=1)
        try:
            async with aiohttp.ClientSession() as s:

                async def abort():
                    async with s.post(url + "/abort_request", json={"abort_all": True}) as resp:
                        return resp.status, await resp.json()

                status, doc = await asyncio.wait_for(abort(), 10)
                assert status == 504 and doc[u0]["status"] == 200, doc
                assert doc[u1]["status"] == 504 and u1 in doc[u1]["body"] and "0.5 s" in doc[u1]["body"], doc
                assert "owed" not in doc[u1] and not router.workers[u1].owed
                assert router.workers[u1].healthy
        finally:
            await _cleanup(rr, r0, r1)

    asyncio.run(main())


def test_pausing_and_continuing_are_owed_the_last_word_counting():
    """w1 down through a pause: back on its port, it gets the pause before any request (before:
    it served while its peers were paused). Down again through a pause and a continue: it gets the
    continue alone (the later call replaces the owed earlier one). A worker that missed a continue
    no longer stays paused for good."""

    async def main():
        log: list = []
        r0, u0 = await _serve(_worker("w0", log, {}))
        port, u1 = await _down(_worker("w1", log, {}))
        router = Router([u0, u1], None, load_poll_s=0, model_path="", health_interval_s=0.1)
        rr, url = await _serve(router.app())
        r1 = None
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/pause_generation", json={"mode": "in_place"}) as resp:
                    doc = await resp.json()
                assert resp.status == 502 and doc[u1].get("owed") is True, doc
                s1: dict = {}
                r1 = await _serve_on(_worker("w1", log, s1), port)
                await _until(lambda: router.workers[u1].healthy)
                assert s1.get("paused") is True and _calls(log, "w1") == ["/pause_generation"], log
                await r1.cleanup()
                for path in ("/pause_generation", "/continue_generation"):
                    async with s.post(url + path, json={}) as resp:
                        doc = await resp.json()
                    assert doc[u1].get("owed") is True, doc
                assert len(router.workers[u1].owed) == 1
                log.clear()
                s1 = {"paused": True}  # (as if it took a pause and then missed the continue)
                r1 = await _serve_on(_worker("w1", log, s1), port)
                await _until(lambda: router.workers[u1].healthy)
                assert _calls(log, "w1") == ["/continue_generation"] and s1["paused"] is False, log
                assert "w1" in set(await _gen(s, url, 6))
        finally:
            await _cleanup(rr, r0, r1)

    asyncio.run(main())


def test_a_restarted_worker_is_owed_the_fleets_adapters_in_order_before_it_routes_again():
    """Both take loads of a, b, c and an unload of a; w1 restarts (no adapters): before any request
    reaches it, it gets the loads of b and c, in that order (a was unloaded), and then routes
    again. Before: it came back without them and each request naming one there was a 400."""

    async def main():
        log: list = []
        r0, u0 = await _serve(_worker("w0", log, {}))
        r1, u1 = await _serve(_worker("w1", log, {}))
        port = int(u1.rsplit(":", 1)[1])
        router = Router([u0, u1], None, load_poll_s=0, model_path="", health_interval_s=0.1)
        rr, url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as s:
                for path, name in (("/load_lora_adapter", "a"), ("/load_lora_adapter", "b"),
                                   ("/load_lora_adapter", "c"), ("/unload_lora_adapter", "a")):  # fmt: skip
                    async with s.post(url + path, json={"lora_name": name, "lora_path": f"/l/{name}"}) as resp:
                        assert resp.status == 200, await resp.text()
                assert list(router.fleet_adapters) == ["b", "c"]
                await r1.cleanup()
                log.clear()
                s1: dict = {}
                r1 = await _serve_on(_worker("w1", log, s1), port)
                await _until(lambda: s1["adapters"] == ["b", "c"])
                await _until(lambda: router.workers[u1].healthy)
                assert _calls(log, "w1") == ["/load_lora_adapter:b", "/load_lora_adapter:c"], log
                assert "w1" in set(await _gen(s, url, 6))
                await asyncio.sleep(0.3)  # (its checks now find both: nothing more is sent)
                assert _calls(log, "w1").count("/load_lora_adapter:b") == 1
        finally:
            await _cleanup(rr, r0, r1)

    asyncio.run(main())


def test_a_worker_with_other_weights_is_owed_the_fleets_weight_calls_and_comes_back():
    """The fleet takes /m/v2 and then the label v3; w1 restarts on /m/v1: it is out of the routing
    set, gets the disk update and then the label (in the fleet's order), and routes again once its
    /model_info agrees. Before: out of the routing set until someone sent the update again. One
    that takes the calls and still differs gets them once, not every health check."""

    async def main():
        log: list = []
        r0, u0 = await _serve(_worker("w0", log, {}))
        r1, u1 = await _serve(_worker("w1", log, {}))
        port = int(u1.rsplit(":", 1)[1])
        router = Router([u0, u1], None, load_poll_s=0, model_path="", health_interval_s=0.1)
        rr, url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/update_weights_from_disk", json={"model_path": "/m/v2"}) as resp:
                    assert resp.status == 200, await resp.text()
                async with s.post(url + "/update_weight_version", json={"new_version": "v3"}) as resp:
                    assert resp.status == 200, await resp.text()
                await r1.cleanup()
                log.clear()
                s1: dict = {}
                r1 = await _serve_on(_worker("w1", log, s1), port)
                await _until(lambda: router.workers[u1].weights_differ is not None or _calls(log, "w1"))
                await _until(lambda: router.workers[u1].healthy)
                assert _calls(log, "w1") == ["/update_weights_from_disk", "/update_weight_version"], log
                assert s1["info"] == {"model_path": "/m/v2", "weight_version": "v3"}
                assert router.workers[u1].weights_differ is None
                assert "w1" in set(await _gen(s, url, 6))
                await r1.cleanup()  # back on its launch weights, and deaf to updates
                log.clear()
                r1 = await _serve_on(_worker("w1", log, {"sticky": True}), port)
                await _until(lambda: len(_calls(log, "w1")) == 2)
                await asyncio.sleep(0.5)
                assert _calls(log, "w1") == ["/update_weights_from_disk", "/update_weight_version"], log
                assert not router.workers[u1].healthy and router.workers[u1].weights_differ
        finally:
            await _cleanup(rr, r0, r1)

    asyncio.run(main())


def _streamer(name: str, hits: list):
    """A stub worker whose streamed /generate sends two events and half a third, then dies (its
    connection aborted, as a killed process's is)."""
    app = web.Application()

    async def gen(req):
        await req.read()
        hits.append(name)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(req)
        await resp.write(b'data: {"text": "a"}\n\n')
        await resp.write(b'data: {"text": "ab"}\n\n')
        await resp.write(b'data: {"text": "ab')
        await asyncio.sleep(0.05)
        req.transport.abort()
        await asyncio.sleep(1)
        return resp

    app.router.add_post("/generate", gen)
    app.router.add_get("/health", lambda _: web.json_response({}))
    return app


def test_a_worker_killed_mid_stream_ends_the_stream_with_an_error_event_and_no_retry():
    """The worker dies mid-stream: the client has the two whole events, then an error event naming
    the worker (SGLang's ``data: {"error": ...}`` form), and the connection is cut without a clean
    end (never a whole-looking answer); the request goes to no other worker (the tokens the client
    has are not sent again). Before: the half event ``data: {"text": "ab`` and a transfer error."""

    async def main():
        hits: list = []
        r0, u0 = await _serve(_streamer("w0", hits))
        r1, u1 = await _serve(_streamer("w1", hits))
        router = Router([u0, u1], None, load_poll_s=0, model_path="", health_interval_s=0.1)
        rr, url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as s:
                status, got, cut = await _read_stream(s, url)
                assert status == 200
            events = [e for e in got.decode().split("\n\n") if e]
            assert cut and len(hits) == 1, (cut, hits)
            assert events[:2] == ['data: {"text": "a"}', 'data: {"text": "ab"}'] and len(events) == 3, events
            err = json.loads(events[2][len("data: "):])["error"]
            assert err["code"] == 502 and "mid-stream" in err["message"], err
            assert ({u0: "w0", u1: "w1"}[next(u for u in (u0, u1) if u in err["message"])]) == hits[0]
            assert router.stats.failed == 1 and router.stats.retries == 0
        finally:
            await _cleanup(rr, r0, r1)

    asyncio.run(main())


def test_a_worker_frozen_mid_stream_ends_the_stream_once_its_health_checks_miss():
    """The worker sends two events and then stops answering altogether (every route, /health too:
    a stopped process): once its health checks miss, the client's stream ends with the two events
    and an error event naming it, cut without a clean end, and no other worker gets the request.
    Before: the client waited for ever (no read bound on a generation, and nothing looked)."""

    async def main():
        hits: list = []

        def app(name):
            a = web.Application()
            frozen = asyncio.Event()  # (this worker's)

            async def gen(req):
                await req.read()
                hits.append(name)
                resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
                await resp.prepare(req)
                await resp.write(b'data: {"text": "a"}\n\n')
                await resp.write(b'data: {"text": "ab"}\n\n')
                frozen.set()
                await asyncio.Event().wait()

            async def health(_):
                if frozen.is_set():
                    await asyncio.Event().wait()
                return web.json_response({})

            a.router.add_post("/generate", gen)
            a.router.add_get("/health", health)
            return a

        r0, u0 = await _serve(app("w0"), shutdown_timeout=1)
        r1, u1 = await _serve(app("w1"), shutdown_timeout=1)
        router = Router([u0, u1], None, load_poll_s=0, model_path="", health_interval_s=0.1)
        rr, url = await _serve(router.app(), shutdown_timeout=1)
        try:
            async with aiohttp.ClientSession() as s:
                _, got, cut = await asyncio.wait_for(_read_stream(s, url), 20)
            events = [e for e in got.decode().split("\n\n") if e]
            assert cut and len(hits) == 1, (cut, hits)
            assert events[:2] == ['data: {"text": "a"}', 'data: {"text": "ab"}'] and len(events) == 3, events
            err = json.loads(events[2][len("data: "):])["error"]
            assert "stopped answering mid-stream" in err["message"] and (u0 in err["message"] or u1 in err["message"])
            assert router.stats.failed == 1 and router.stats.abandoned == 1
        finally:
            await _cleanup(rr, r0, r1)

    asyncio.run(main())


def test_a_worker_slow_on_v1_loads_does_not_hold_back_the_others_reports():
    """w1 answers /v1/loads after 5 s (past the poll's bound): w0 is still polled every
    ``load_poll_s``. Before, the polls went in rounds that waited for every worker, and w0 was
    polled every 3 periods (its report up to 3 periods old for routing)."""

    def app(slow: bool):
        a = web.Application()

        async def loads(_):
            if slow:
                await asyncio.sleep(5)
            return web.json_response({"loads": [{"num_running_reqs": 0, "num_waiting_reqs": 0}]})

        a.router.add_get("/v1/loads", loads)
        a.router.add_get("/health", lambda _: web.json_response({}))
        return a

    async def main():
        r0, u0 = await _serve(app(False))
        r1, u1 = await _serve(app(True), shutdown_timeout=0.1)
        router = Router([u0, u1], None, load_poll_s=0.1, model_path="", health_interval_s=0.1)
        rr, url = await _serve(router.app())
        try:
            await asyncio.sleep(3.0)
            # (w0 alone answers: 30 polls in 3 s at 0.1 s; in rounds held by w1's 0.2 s bound, 10)
            assert router.stats.load_polls >= 18, router.stats
            assert router.stats.load_poll_errors >= 5
        finally:
            await _cleanup(rr, r0, r1)

    asyncio.run(main())


def test_a_worker_whose_weights_changed_past_the_router_is_not_sent_the_old_calls():
    """The fleet takes /m/v2 through the router; then w1's weights change past it (an RL trainer's
    own /update_weights_from_disk: /model_info says /ckpt/rl-7, weights the router never saw
    before a broadcast). It is out of the routing set, and *not* sent the disk update again, which would
    have undone the trainer's weights (the review of session 41's re-sending). Before: re-sent."""

    async def main():
        log: list = []
        r0, u0 = await _serve(_worker("w0", log, {}))
        s1: dict = {}
        r1, u1 = await _serve(_worker("w1", log, s1))
        router = Router([u0, u1], None, load_poll_s=0, model_path="", health_interval_s=0.1)
        rr, url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/update_weights_from_disk", json={"model_path": "/m/v2"}) as resp:
                    assert resp.status == 200, await resp.text()
                log.clear()
                s1["info"]["model_path"] = "/ckpt/rl-7"  # changed past the router
                await _until(lambda: router.workers[u1].weights_differ is not None)
                await asyncio.sleep(0.6)  # several health checks
                assert _calls(log, "w1") == [], log
                assert not router.workers[u1].healthy
                assert set(await _gen(s, url, 4)) == {"w0"}
                s1["info"]["model_path"] = "/m/v2"  # back on the fleet's: routed again
                await _until(lambda: router.workers[u1].weights_differ is None and router.workers[u1].healthy)
                assert _calls(log, "w1") == [], log
        finally:
            await _cleanup(rr, r0, r1)

    asyncio.run(main())
