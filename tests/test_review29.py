"""Review findings of session 29 (a hunt with adversarial clients and workers against the router,
``fleet/router.py``), each test failing on the code before its fix:

- upstream keep-alive: the proxy kept idle worker connections for aiohttp's 15 s, SGLang's server
  closes them after 5 s (uvicorn, ``SGLANG_TIMEOUT_KEEP_ALIVE``), so requests went out on
  connections the worker was closing. "Server disconnected" before any answer then marked a healthy
  worker down (its tenants rehomed, their cache lost) and, with one worker, ended in 502s;
- a passthrough answer (``/v1/models``, ``/v1/responses``, ...) cut off by its worker reached the
  client as a whole one: the router wrote the terminal chunk after the failure;
- a 10 KB bearer token, a 16 KB cookie or a 9 KB query string (SGLang takes them) were a bare 400
  from the router, and a burst of new connections overflowed its listen backlog of 128.

The router runs for real (in this process, or ``serve()`` in a subprocess) in front of stub
workers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from sglang_tiered.fleet import router as router_mod
from sglang_tiered.fleet.router import Router
from tests.test_fleet_hardening import _echo_worker, _router_up, _serve, _served_router


async def _raw_server(handle):
    """A raw asyncio server on 127.0.0.1 whose connections ``handle(reader, writer, n)`` serves,
    ``n`` counting the requests on each connection: (server, URL)."""

    async def conn(reader, writer):
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(x.split(b":", 1)[1]) for x in head.split(b"\r\n")
                               if x.lower().startswith(b"content-length:")), 0)  # fmt: skip
                body = await reader.readexactly(length) if length else b""
                n += 1
                if not await handle(head, body, writer, n):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(conn, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def _json_reply(doc: dict) -> bytes:
    data = json.dumps(doc).encode()
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " + str(len(data)).encode()
            + b"\r\n\r\n" + data)  # fmt: skip


def test_the_proxy_closes_idle_worker_connections_before_sglang_does():
    """The proxy's idle keep-alive is below SGLang's server's (uvicorn ``timeout_keep_alive``,
    ``SGLANG_TIMEOUT_KEEP_ALIVE``, 5 s by default), so the router, not the worker, closes an idle
    connection: a request never goes out on one the worker is closing."""
    from sglang.srt.environ import envs

    assert router_mod.UPSTREAM_KEEPALIVE_S < envs.SGLANG_TIMEOUT_KEEP_ALIVE.get()

    async def main():
        w_runner, w_url = await _serve(_echo_worker([]))
        router = Router([w_url], None, load_poll_s=0, model_path="")
        r_runner, _ = await _serve(router.app())
        try:
            for session in (router._proxy, router._session):
                assert session.connector._keepalive_timeout == router_mod.UPSTREAM_KEEPALIVE_S
        finally:
            await r_runner.cleanup()
            await w_runner.cleanup()

    asyncio.run(main())


def test_a_connection_closed_before_the_answer_does_not_take_a_worker_down():
    """A worker that closes a reused connection when the next request arrives on it (what a
    keep-alive timeout does at the wrong moment): the request is retried and served, the worker
    stays in the routing set (counted in ``disconnects``), and with one worker the client gets its
    answer, not a 502. A worker nothing listens on is still taken out at once."""

    async def main():
        async def worker(head, body, writer, n):
            if head.startswith(b"GET /health"):
                writer.write(_json_reply({}))
            elif n > 1:  # a second request on this connection: closed unanswered
                return False
            else:
                writer.write(_json_reply({"ok": True, "len": len(body)}))
            await writer.drain()
            return True

        servers = [await _raw_server(worker) for _ in range(2)]
        urls = [u for _, u in servers]
        for workers in (urls[:1], urls):
            router = Router(workers, None, load_poll_s=0, model_path="", health_interval_s=60)
            r_runner, r_url = await _serve(router.app())
            try:
                async with aiohttp.ClientSession() as s:
                    for i in range(6):  # one at a time: every request after the first reuses a connection
                        async with s.post(r_url + "/generate", json={"input_ids": [1, 2, 3, i]}) as resp:
                            assert resp.status == 200, (workers, i, resp.status, await resp.text())
                st = router.stats
                assert st.failed == 0 and st.disconnects >= 1, router.stats_doc()
                assert all(w.healthy for w in router.workers.values()), router.stats_doc()
            finally:
                await r_runner.cleanup()
        for server, _ in servers:
            server.close()
            await server.wait_closed()
        # nothing listens there now: a worker that cannot be reached still leaves the routing set at once
        router = Router(urls[:1], None, load_poll_s=0, model_path="", health_interval_s=60)
        r_runner, r_url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(r_url + "/generate", json={"input_ids": [7, 8]}) as resp:
                    assert resp.status == 502, await resp.text()
            assert not router.workers[urls[0]].healthy and router.stats.disconnects == 0, router.stats_doc()
        finally:
            await r_runner.cleanup()

    asyncio.run(main())


def test_a_passthrough_answer_cut_off_by_its_worker_is_not_made_whole():
    """A worker that dies in the middle of a proxied answer on a passthrough route: the client's
    transfer is cut off too (no terminal chunk), as it is straight from the worker and on the routed
    paths; it is counted as failed."""

    async def main():
        async def worker(head, body, writer, n):
            if head.startswith(b"GET /health"):
                writer.write(_json_reply({}))
                await writer.drain()
                return True
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"a\r\n{\"data\": [\r\n")  # fmt: skip
            await writer.drain()
            await asyncio.sleep(0.1)
            return False  # dies mid-answer

        server, w_url = await _raw_server(worker)
        router = Router([w_url], None, load_poll_s=0, model_path="", health_interval_s=60)
        r_runner, r_url = await _serve(router.app())
        port = int(r_url.rsplit(":", 1)[1])
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            await writer.drain()
            raw = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            head, _, payload = raw.partition(b"\r\n\r\n")
            assert b" 200 " in head.split(b"\r\n")[0] and b"chunked" in head.lower(), raw
            assert not payload.endswith(b"0\r\n\r\n"), payload  # a cut-off transfer, not a whole answer
            assert router.stats.failed == 1, router.stats_doc()
        finally:
            await r_runner.cleanup()
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def test_long_headers_and_query_strings_pass_the_router():
    """``serve()`` (the CLI's) takes the header and URL sizes SGLang's server takes: a 10 KB bearer
    token, a 16 KB cookie, a 9 KB query string (aiohttp's default limit, 8,190 bytes, made each a
    bare 400 from the router), and it listens with uvicorn's backlog of 2,048."""
    captured: dict = {}
    real = web.run_app
    try:
        web.run_app = lambda app, **kw: captured.update(kw)
        router_mod.serve(["http://127.0.0.1:9"], port=1, load_poll_s=0, model_path="")
    finally:
        web.run_app = real
    assert captured["backlog"] >= 2048 and captured["max_line_size"] >= 65536 and captured["max_headers"] >= 256

    async def main():
        hits: list = []
        # (the stub worker takes what SGLang's uvicorn takes)
        w_runner, w_url = await _serve(_echo_worker(hits), max_line_size=65536, max_field_size=65536)
        try:
            with _served_router(w_url) as url:
                async with aiohttp.ClientSession() as s:
                    await _router_up(s, url)
                    body = {"input_ids": [1, 2, 3]}
                    for headers, query in (({"Authorization": "Bearer " + "a" * 10_000}, ""),
                                           ({"Cookie": "c=" + "b" * 16_000}, ""),
                                           ({"X-Big": "x" * 8_200}, ""),
                                           ({}, "?q=" + "z" * 9_000)):  # fmt: skip
                        async with s.post(url + "/generate" + query, json=body, headers=headers) as resp:
                            assert resp.status == 200, (list(headers), len(query), resp.status, await resp.text())
        finally:
            await w_runner.cleanup()
        assert len(hits) == 4

    asyncio.run(main())


def test_requests_released_unfinished_and_admitted_again_are_counted_by_tenant():
    """A request SGLang retracts at decode or preempts for a higher priority is released unfinished
    (``checkpointed=False``) and prefilled again as the same ``Req``: each such time is counted in
    its tenant's ``requeued_requests`` (SGLang reports neither preemptions nor, outside its metrics,
    retractions), the request itself still once in ``requests``, and a no-store request once in
    ``no_store_requests`` (it was counted again at each re-admission)."""
    from tests.strict_sim import Req, Sim

    sim = Sim(capacity_tokens=256, page_size=4)
    plain = Req(list(range(100, 140)), salt="acme", max_new=4)
    quiet = Req(list(range(200, 230)), salt="acme", no_store=True)
    for r in (plain, quiet):
        assert sim.admit(r)
        sim.postfill(r)
        assert sim.decode(r, 7)
    for _ in range(2):  # retracted (or preempted) twice, prefilled again each time
        for r in (plain, quiet):
            sim.retract(r)
            assert sim.admit(r)
            sim.postfill(r)
    for r in (plain, quiet):
        sim.release(r)
    sim.check()
    tc = sim.cache.tenant("acme")
    assert (tc.requeued_requests, tc.requests, tc.no_store_requests) == (4, 2, 1), tc
    once = Req(list(range(300, 320)), salt="acme")
    assert sim.admit(once)
    sim.release(once)
    assert (tc.requeued_requests, tc.requests) == (4, 3), tc


def test_a_body_cut_off_by_a_client_that_left_is_not_run():
    """A client that sends less than its ``Content-Length`` (or a chunked body without its last
    chunk) and goes away: the app behind the middleware sees an unfinished body and the disconnect,
    as it does without the middleware (Starlette raises ClientDisconnect; nothing runs). Before,
    the part read was handed on as a whole body and run without the checks: a token id past the
    vocabulary killed the scheduler, and the body's own ``cache_salt`` chose the tenant over the
    trusted header (a helper's hunt, session 29). A whole body is still checked and salted."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from sglang_tiered.integration.http import HintMiddleware

    ran: list = []

    async def generate(request):  # (SGLang's routes read the body the same way: Starlette's Request)
        ran.append(await request.json())
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/generate", generate, methods=["POST"])])

    async def call(wrapped, body: bytes, messages: list):
        sent: list = []
        scope = {"type": "http", "method": "POST", "path": "/generate", "raw_path": b"/generate", "query_string": b"",
                 "headers": [(b"x-tenant-id", b"attacker"), (b"content-type", b"application/json"),
                             (b"content-length", str(len(body) + 16).encode())],
                 "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 1), "client": ("127.0.0.1", 2)}  # fmt: skip

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(m):
            sent.append(m)

        try:
            await wrapped(scope, receive, send)
        except Exception as exc:  # noqa: BLE001  (Starlette's ClientDisconnect, as without us)
            sent.append(type(exc).__name__)
        return sent

    body = json.dumps({"input_ids": [5000, 5], "cache_salt": "victim"}).encode()
    for tenant_header in ("x-tenant-id", None):
        for cut in (len(body), len(body) // 2):  # all of it but not its end, or half of it
            msgs = [{"type": "http.request", "body": body[:cut], "more_body": True}, {"type": "http.disconnect"}]
            asyncio.run(call(HintMiddleware(app, tenant_header), body, msgs))
            assert ran == [], (tenant_header, cut, ran)
            stock = [{"type": "http.request", "body": body[:cut], "more_body": True}, {"type": "http.disconnect"}]
            asyncio.run(call(app, body, stock))
            assert ran == [], ran  # (the same bytes reach the route no more without the middleware)
    # a whole body: checked (an id past the vocabulary is a 400 where the vocabulary is known) and
    # salted with the header's tenant
    whole = json.dumps({"input_ids": [5, 6], "cache_salt": "victim"}).encode()
    sent = asyncio.run(call(HintMiddleware(app, "x-tenant-id"), whole, [{"type": "http.request", "body": whole}]))
    assert sent[0]["status"] == 200 and ran and ran[-1]["cache_salt"] != "victim", (sent, ran)
