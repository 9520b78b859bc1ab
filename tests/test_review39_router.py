"""Fleet router audit (helper hD): reproductions of the defects it found, each failing before its fix.

Stub aiohttp workers on 127.0.0.1 and the real Router app in front of them."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

import sglang_tiered.fleet.router as router_mod
from sglang_tiered.fleet.router import Router
from tests.test_fleet_hardening import _echo_worker, _serve


def _inv_worker(name: str, log: list, state: dict):
    """``/cache/invalidate`` answers ``state["inv_status"]`` (202 by default) and logs the calls."""
    app = web.Application()

    async def inv(req):
        doc = await req.json()
        st = state.get("inv_status", 202)
        log.append((name, doc, req.headers.get("x-tenant"), st))
        return web.json_response({"ok": st < 300}, status=st)

    async def gen(req):
        await req.read()
        return web.json_response({"text": name})

    app.router.add_post("/cache/invalidate", inv)
    app.router.add_post("/generate", gen)
    app.router.add_get("/health", lambda _: web.json_response({}))
    return app


def test_another_tenants_invalidations_cannot_push_out_an_owed_one(monkeypatch):
    """Header mode, w1 fails invalidations: tenant A's invalidation is owed to w1. Tenant B then
    invalidates its own tenant a few times, each call with its own x-request-id (as SDKs send).
    Each such call is the same scope (tenant B); before the fix every distinct header set was a new
    owed entry, so B's calls pushed A's owed invalidation past OWED_MAX and it was dropped: w1 came
    back and served A's invalidated pages."""
    monkeypatch.setattr(router_mod, "OWED_MAX", 4)

    async def main():
        log: list = []
        (r0, u0), (r1, u1) = (await _serve(_inv_worker("w0", log, {})),
                              await _serve(_inv_worker("w1", log, {"inv_status": 503})))  # fmt: skip
        router = Router([u0, u1], None, tenant_header="x-tenant", load_poll_s=0, model_path="",
                        health_interval_s=3600)  # fmt: skip
        rr, url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/cache/invalidate", json={"tenant": "A"},
                                  headers={"x-tenant": "A", "x-request-id": "a-1"}) as resp:  # fmt: skip
                    assert resp.status == 503
                for i in range(6):
                    async with s.post(url + "/cache/invalidate", json={"tenant": "B"},
                                      headers={"x-tenant": "B", "x-request-id": f"b-{i}"}) as resp:  # fmt: skip
                        assert resp.status == 503
            owed = [json.loads(raw) for raw, *_ in router.workers[u1].owed.values()]
            assert any(d.get("tenant") == "A" for d in owed), owed
            # B's six calls are one scope: the newest of them
            assert [d.get("tenant") for d in owed].count("B") == 1, owed
            assert router.stats.owed_dropped == 0
        finally:
            await rr.cleanup()
            await r0.cleanup()
            await r1.cleanup()

    asyncio.run(main())


async def _raw(url: str, head: bytes, body: bytes) -> bytes:
    host, port = url.rsplit("/", 1)[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    data = await reader.read()
    writer.close()
    return data


def test_tenant_header_named_in_connection_still_reaches_the_worker():
    """Header mode: the router takes the tenant from the header (routes, hashes and scopes by it)
    and must forward that same header. A client that names it in ``Connection`` had it dropped
    as hop-by-hop: the worker then saw an untagged request, i.e. the ``default`` namespace for a
    generation and the operator's whole view on control routes (/cache/stats of every tenant,
    /cache/invalidate of any tenant, /flush_cache)."""

    async def main():
        hits: list = []
        w_runner, w_url = await _serve(_echo_worker(hits))
        router = Router([w_url], None, tenant_header="X-Tenant", load_poll_s=0, model_path="")
        r_runner, r_url = await _serve(router.app())
        try:
            body = json.dumps({"input_ids": [1, 2, 3]}).encode()
            head = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"X-Tenant: A\r\nConnection: close, X-Tenant\r\n")  # fmt: skip
            data = await _raw(r_url, head, body)
            assert data.startswith(b"HTTP/1.1 200"), data[:200]
            got = [v for k, v in hits[-1]["headers"] if k.lower() == "x-tenant"]
            assert got == ["A"], hits[-1]["headers"]
        finally:
            await r_runner.cleanup()
            await w_runner.cleanup()

    asyncio.run(main())


def _sid_worker(name: str, log: list):
    """``/open_session`` answers the id it was given (as SGLang does); ``/generate`` its name."""
    app = web.Application(client_max_size=8 << 20)

    async def open_session(req):
        return web.json_response((await req.json())["session_id"])

    async def close_session(req):
        log.append((name, "close"))
        return web.Response(status=200)

    async def gen(req):
        await req.read()
        log.append((name, "generate"))
        return web.json_response({"text": name})

    app.router.add_post("/open_session", open_session)
    app.router.add_post("/close_session", close_session)
    app.router.add_post("/generate", gen)
    app.router.add_get("/health", lambda _: web.json_response({}))
    return app


def test_session_map_holds_no_client_sized_ids():
    """The router remembers which worker opened each session (SESSIONS_KEPT of them), keyed by the
    session id the worker answers, which is the client's own ``session_id``: any length. Sessions
    opened with a short ``timeout`` leave the workers and stay in the router: 65,536 ids of 1 MiB
    held 64 GiB. A long id is now remembered by a digest; its turns and its close still find the
    worker that opened it."""

    async def main():
        log: list = []
        ws = [await _serve(_sid_worker(f"w{i}", log)) for i in range(3)]
        router = Router([u for _, u in ws], None, load_poll_s=0, model_path="")
        rr, url = await _serve(router.app())
        big = "s" * (1 << 20)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/open_session", json={"session_id": big, "timeout": 0.01}) as r:
                    assert r.status == 200
                held = sum(len(k) for k in router.sessions)
                assert held < 4096, held
                owner = f"w{[u for _, u in ws].index(next(iter(router.sessions.values())))}"
                for i in range(4):
                    async with s.post(url + "/generate", json={"text": f"turn {i}", "session_params": {"id": big}}) as r:
                        assert r.status == 200 and (await r.json())["text"] == owner
                async with s.post(url + "/close_session", json={"session_id": big}) as r:
                    assert r.status == 200
                assert not router.sessions and (owner, "close") in log
        finally:
            await rr.cleanup()
            for runner, _ in ws:
                await runner.cleanup()

    asyncio.run(main())


def _strict_session_worker(name: str, log: list):
    """Sessions as SGLang keeps them: ``/open_session`` of an id still open is refused (400,
    "Check if a session with the same id is still open"); a turn runs on the session's history."""
    app = web.Application()
    sessions: dict = {}

    async def open_session(req):
        sid = (await req.json())["session_id"]
        if sid in sessions:
            return web.json_response({"error": {"message": "Failed to open the session."}}, status=400)
        sessions[sid] = []
        return web.json_response(sid)

    async def gen(req):
        doc = await req.json()
        sid = (doc.get("session_params") or {}).get("id")
        if sid not in sessions:
            return web.json_response({"error": {"message": f"session id {sid} does not exist"}}, status=400)
        history = list(sessions[sid])
        sessions[sid].append(doc["text"])
        log.append((name, sid, doc["text"]))
        return web.json_response({"text": name, "history": history})

    app.router.add_post("/open_session", open_session)
    app.router.add_post("/generate", gen)
    app.router.add_get("/health", lambda _: web.json_response({}))
    return app


def test_an_open_session_cannot_be_opened_again_on_another_worker():
    """SGLang refuses to open a session id that is still open. Through the router, the second
    ``/open_session`` of the same id went to the least busy worker, where it did not exist yet, so
    it was opened there and the router's map moved the id to that worker: tenant A's next turn ran
    in tenant B's session (A's prompt in B's history, B's history in A's answer). Now an open of
    an id the router maps goes to that worker, which refuses it as one server would."""

    async def main():
        log: list = []
        ws = [await _serve(_strict_session_worker(f"w{i}", log)) for i in range(2)]
        router = Router([u for _, u in ws], None, load_poll_s=0, model_path="")
        rr, url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/open_session", json={"session_id": "chat-1"}) as r:
                    assert r.status == 200
                async with s.post(url + "/generate", json={"text": "A: my secret", "session_params": {"id": "chat-1"},
                                                           "cache_salt": "A"}) as r:  # fmt: skip
                    assert r.status == 200
                    owner = (await r.json())["text"]
                async with s.post(url + "/open_session", json={"session_id": "chat-1"}) as r:  # tenant B
                    assert r.status == 400, await r.text()
                async with s.post(url + "/generate", json={"text": "A: turn 2", "session_params": {"id": "chat-1"},
                                                           "cache_salt": "A"}) as r:  # fmt: skip
                    doc = await r.json()
                assert doc["text"] == owner and doc["history"] == ["A: my secret"], doc
        finally:
            await rr.cleanup()
            for runner, _ in ws:
                await runner.cleanup()

    asyncio.run(main())


def test_a_newer_owed_invalidation_replacing_one_in_delivery_is_still_delivered():
    """While the router delivers an owed invalidation (``_pay``), a second one of the same scope
    (same tenant, a newer T2 generation) fails on the worker too and replaces it in the owed map.
    Before, the delivery then popped the map's entry by its key: the newer one was dropped
    undelivered, and the worker came back reading T2 at the older generation (the pages the newer
    invalidation removed). Now only the delivered entry is settled; the newer one follows."""
    import aiohttp as _aiohttp
    from aiohttp import web as _web

    from tests.test_fleet_hardening import _serve

    async def main():
        got, entered, release = [], asyncio.Event(), asyncio.Event()
        app = _web.Application()

        async def inv(req):
            doc = await req.json()
            got.append(doc["generation"])
            if len(got) == 1:
                entered.set()
                await release.wait()
            return _web.json_response({"dropped_tokens": 0}, status=202)

        app.router.add_post("/cache/invalidate", inv)
        app.router.add_get("/health", lambda _: _web.json_response({}))
        wr, wu = await _serve(app)
        router = Router([wu], None, load_poll_s=0, model_path="", health_interval_s=3600)
        rr, _url = await _serve(router.app())
        try:
            await asyncio.sleep(0.2)  # (the health loop's first round: nothing owed yet)
            ws = router.workers[wu]
            hdrs = [("Content-Type", "application/json")]
            plain = json.dumps({"tenant": "t"}).encode()
            router._owe(ws, json.dumps({"tenant": "t", "generation": 1}).encode(), plain, hdrs)
            pay = asyncio.ensure_future(router._pay(ws))
            await asyncio.wait_for(entered.wait(), 10)
            router._owe(ws, json.dumps({"tenant": "t", "generation": 2}).encode(), plain, hdrs)
            release.set()
            assert await asyncio.wait_for(pay, 10) is True
            assert got == [1, 2], got
            assert not ws.owed
        finally:
            await rr.cleanup()
            await wr.cleanup()

    asyncio.run(main())


def test_one_hung_worker_does_not_hold_up_the_others_health_checks():
    """Three workers whose /health never answers (2 s timeout each) and one that is back: it
    rejoins the routing set within a round. Before, the checks ran one by one and it waited for
    the three timeouts (6 s) every round."""
    from aiohttp import web as _web

    from tests.test_fleet_hardening import _serve

    async def main():
        async def hang(_):
            await asyncio.sleep(3)  # (past the router's 2 s timeout)
            return _web.json_response({})

        servers = []
        for _ in range(3):
            app = _web.Application()
            app.router.add_get("/health", hang)
            servers.append(await _serve(app))
        ok = _web.Application()
        ok.router.add_get("/health", lambda _: _web.json_response({}))
        servers.append(await _serve(ok))
        urls = [u for _, u in servers]
        router = Router(urls, None, load_poll_s=0, model_path="", health_interval_s=0.1)
        rr, _url = await _serve(router.app())
        try:
            await asyncio.sleep(0.3)
            back = router.workers[urls[-1]]
            back.healthy = False
            t0 = asyncio.get_running_loop().time()
            while not back.healthy:
                await asyncio.sleep(0.05)
                assert asyncio.get_running_loop().time() - t0 < 1.5, "a hung worker held up the health checks"
        finally:
            await rr.cleanup()
            for r, _ in servers:
                await r.cleanup()

    asyncio.run(main())


def test_a_client_leaving_a_passthrough_stream_is_gone_not_failed():
    """A passthrough route (here SGLang's /get_model_info, streamed slowly by the stub) whose
    client leaves mid-body: counted as ``client_gone``, not as a failure (a worker's fault in the
    stats). Before, the write to the closed client raised and was counted as ``failed``."""
    import time as _time

    async def main():
        app = web.Application()

        async def slow(req):
            resp = web.StreamResponse()
            await resp.prepare(req)
            for _ in range(40):
                try:
                    await resp.write(b"x" * 65536)
                except ConnectionResetError:
                    break
                await asyncio.sleep(0.05)
            return resp

        app.router.add_get("/get_model_info", slow)
        app.router.add_get("/health", lambda _: web.json_response({}))
        wr, wu = await _serve(app)
        router = Router([wu], None, load_poll_s=0, model_path="", health_interval_s=3600)
        rr, url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as s:
                resp = await s.get(url + "/get_model_info")
                await resp.content.read(1000)
                resp.close()  # the client leaves mid-body
            deadline = _time.monotonic() + 10
            while not (router.stats.client_gone or router.stats.failed) and _time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
            assert router.stats.client_gone == 1 and router.stats.failed == 0, router.stats_doc()
        finally:
            await rr.cleanup()
            await wr.cleanup()

    asyncio.run(main())
