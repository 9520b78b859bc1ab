"""The fleet router maps OpenAI Responses ids to the worker that stored them (review, session 42).

SGLang 0.5.23 keeps a stored response (``store``, its default) in the memory of the one server
that answered it (``serving_responses.py``'s ``response_store``): a later request's
``previous_response_id``, ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` find
it there alone, and any other server answers 404 ("Response with id ... not found"). Before, the
router sent them where it sends any request (a follow-up by tenant affinity and load, a GET or
cancel to the least busy worker), so with two workers they reached the wrong one. Stub workers
on 127.0.0.1 that store responses as SGLang does, the real Router app in front of them.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

import sglang_tiered.fleet.router as router_mod
from tests.test_review42_passthrough import _fleet


def _sglang_404(rid: str):
    """SGLang's answer for a response id its store does not hold (``_make_not_found_error``)."""
    return web.json_response({"error": {"message": f"Response with id '{rid}' not found.",
                                        "type": "invalid_request_error", "param": "response_id",
                                        "code": 404}}, status=404)  # fmt: skip


def _responses_worker(name: str, hits: list, gate: asyncio.Event = None):
    """A stub worker with SGLang's Responses store: a created response is stored (unless
    ``store`` is false) under the client's ``request_id`` or a fresh ``resp_<name>_<n>`` id; a
    ``previous_response_id``, a GET or a cancel of an id it does not hold is SGLang's 404. A
    streamed creation sends ``response.created``, waits for ``gate`` (when given), then ends
    with ``response.completed``. ``hits``: (name, method, path, id) per request."""
    app = web.Application()
    store: dict = {}

    async def create(req):
        body = await req.json()
        prev = body.get("previous_response_id")
        hits.append((name, req.method, req.path, prev))
        if prev is not None and prev not in store:
            return _sglang_404(prev)
        rid = body.get("request_id") or f"resp_{name}_{len(store)}_{len(hits)}"
        doc = {"id": rid, "object": "response", "created_at": 0, "model": "m", "status": "completed",
               "output": [{"id": "msg_1", "type": "message"}], "worker": name, "previous": prev}  # fmt: skip
        if body.get("store", True):
            store[rid] = doc
        if not body.get("stream"):
            return web.json_response(doc)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(req)
        created = {"type": "response.created", "sequence_number": 0, "response": {**doc, "status": "in_progress"}}
        await resp.write(f"event: response.created\ndata: {json.dumps(created)}\n\n".encode())
        if gate is not None:
            await asyncio.wait_for(gate.wait(), 10)
        done = {"type": "response.completed", "sequence_number": 1, "response": doc}
        await resp.write(f"event: response.completed\ndata: {json.dumps(done)}\n\n".encode())
        await resp.write_eof()
        return resp

    async def by_id(req):
        rid = req.match_info["rid"]
        hits.append((name, req.method, req.path, rid))
        if rid not in store:
            return _sglang_404(rid)
        if req.path.endswith("/cancel"):
            store[rid] = {**store[rid], "status": "cancelled"}
        return web.json_response(store[rid])

    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{rid}", by_id)
    app.router.add_post("/v1/responses/{rid}/cancel", by_id)
    app.router.add_get("/health", lambda _: web.json_response({}))
    return app


def _run(test, n: int = 2, gate=None, **kw):
    """``test(s, router, url, urls, hits, runners)`` against ``n`` stub workers behind the router
    (``kw``: the Router's)."""

    async def main():
        hits: list = []
        apps = [_responses_worker(f"w{i}", hits, gate() if gate else None) for i in range(n)]
        router, url, urls, runners = await _fleet(*apps, **kw)
        try:
            async with aiohttp.ClientSession() as s:
                return await test(s, router, url, urls, hits, runners)
        finally:
            for r in runners:
                await r.cleanup()

    return asyncio.run(main())


def _steer(router, urls, to: int):
    """Make worker ``to`` the least busy one (the other looks busier): what the router picks for a
    request it does not pin."""
    for i, u in enumerate(urls):
        router.workers[u].inflight = 0 if i == to else 100


async def _create(s, url, **kw) -> dict:
    async with s.post(url + "/v1/responses", json={"model": "m", "input": "x", **kw}) as resp:
        assert resp.status == 200, (resp.status, await resp.text())
        return await resp.json()


def test_a_follow_up_goes_to_the_worker_that_stored_its_previous_response():
    """Responses stored on each worker in turn; each follow-up (``previous_response_id``) is sent
    while the other worker is the least busy, and still reaches the one that stored it, as does
    the follow-up of a follow-up (its own id learned too). Before: each went to the least busy
    worker, which answered 404."""

    async def test(s, router, url, urls, hits, _):
        made = []
        for k in range(6):
            _steer(router, urls, k % 2)
            made.append(await _create(s, url))
        assert {m["worker"] for m in made} == {"w0", "w1"}, made
        for m in made:
            holder = int(m["worker"][1:])
            _steer(router, urls, 1 - holder)  # (the wrong worker is the least busy)
            follow = await _create(s, url, previous_response_id=m["id"])
            assert follow["worker"] == m["worker"] and follow["previous"] == m["id"], (m, follow)
            again = await _create(s, url, previous_response_id=follow["id"])
            assert again["worker"] == m["worker"], (follow, again)
        return router

    router = _run(test)
    assert router.stats.reasons.get("response") == 12, router.stats.reasons


def test_get_and_cancel_by_id_reach_the_worker_that_stored_it_and_an_unknown_id_falls_back():
    """``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` (``passthrough``) go to
    the worker that stored the response, however busy; an id the router never saw goes to the
    least busy worker as before (its 404 is SGLang's own). Before: the least busy worker, 404."""

    async def test(s, router, url, urls, hits, _):
        for holder in (0, 1):
            _steer(router, urls, holder)
            made = await _create(s, url)
            assert made["worker"] == f"w{holder}"
            _steer(router, urls, 1 - holder)
            async with s.get(url + f"/v1/responses/{made['id']}") as resp:
                assert resp.status == 200 and (await resp.json())["worker"] == made["worker"]
            async with s.post(url + f"/v1/responses/{made['id']}/cancel") as resp:
                got = await resp.json()
                assert resp.status == 200 and got["worker"] == made["worker"] and got["status"] == "cancelled"
        _steer(router, urls, 1)
        async with s.get(url + "/v1/responses/resp_never_seen") as resp:
            assert resp.status == 404 and "not found" in (await resp.json())["error"]["message"]
        assert hits[-1][:3] == ("w1", "GET", "/v1/responses/resp_never_seen"), hits[-1]
        # an unknown previous_response_id: routed as any request (the least busy worker's 404)
        async with s.post(url + "/v1/responses", json={"model": "m", "input": "x",
                                                       "previous_response_id": "resp_gone"}) as resp:  # fmt: skip
            assert resp.status == 404
        assert hits[-1][0] == "w1", hits[-1]

    _run(test)


def test_a_streamed_creation_teaches_the_router_its_id_at_response_created():
    """A streamed creation: the router learns the id from the ``response.created`` event as it
    passes (the stream still open, the worker holding its end back until the client's GET by id
    has been answered by the worker that stored it), and the client's bytes are the worker's,
    unchanged. Before: the GET went to the least busy worker (404)."""
    gates: list = []

    def gate():
        gates.append(asyncio.Event())
        return gates[-1]

    async def test(s, router, url, urls, hits, _):
        _steer(router, urls, 1)
        body = {"model": "m", "input": "x", "stream": True}
        async with s.post(url + "/v1/responses", json=body) as resp:
            got = await resp.content.readuntil(b"\n\n")  # (the response.created event, as sent)
            assert got.startswith(b"event: response.created\ndata: "), got
            rid = json.loads(got.split(b"data: ", 1)[1])["response"]["id"]
            _steer(router, urls, 0)
            async with s.get(url + f"/v1/responses/{rid}") as by_id:
                assert by_id.status == 200 and (await by_id.json())["worker"] == "w1"
            for g in gates:
                g.set()
            got += await resp.content.read()
        assert got.count(b"event: ") == 2 and got.endswith(b"\n\n") and b"response.completed" in got
        stored = json.loads(got.split(b"data: ")[2])["response"]
        assert stored["id"] == rid and stored["worker"] == "w1"

    _run(test, gate=gate)


def test_the_map_is_bounded_oldest_first_long_ids_as_digests_and_store_false_not_kept(monkeypatch):
    """The router keeps RESPONSES_KEPT ids, the least recently used forgotten first (a follow-up
    or a GET keeps an id); a client's ``request_id`` (SGLang's response id then) of 100,000
    characters is learned from the request and kept as a 16-byte digest (as session ids are); a
    response created with ``store: false`` (SGLang keeps none) is not kept. A forgotten id is
    routed as before (the least busy worker)."""
    monkeypatch.setattr(router_mod, "RESPONSES_KEPT", 3)

    async def test(s, router, url, urls, hits, _):
        _steer(router, urls, 0)
        ids = [(await _create(s, url))["id"] for _ in range(3)]
        async with s.get(url + f"/v1/responses/{ids[0]}") as resp:  # ids[0] used: ids[1] is the oldest
            assert resp.status == 200
        _steer(router, urls, 0)
        long_id = "resp_" + "x" * 100_000
        assert (await _create(s, url, request_id=long_id))["id"] == long_id
        await _create(s, url, store=False)  # (not kept: nothing pushed out)
        assert len(router.responses) == 3, list(router.responses)
        assert ids[1] not in router.responses and ids[0] in router.responses and ids[2] in router.responses
        assert long_id not in router.responses and all(len(k) <= 256 for k in router.responses)
        _steer(router, urls, 1)
        for rid, status in ((ids[0], 200), (ids[2], 200), (ids[1], 404)):
            async with s.get(url + f"/v1/responses/{rid}") as resp:
                assert resp.status == status, (rid, resp.status)
        # (a URL that long is past any HTTP server's line limit: a follow-up names it)
        assert (await _create(s, url, previous_response_id=long_id))["worker"] == "w0"

    _run(test)


def test_a_dead_workers_ids_answer_a_502_naming_it_and_never_reach_another_worker():
    """The worker that stored a response is gone: a follow-up, a GET and a cancel naming it are
    answered 502 in the Responses API's error shape, saying which worker held it (its position:
    worker URLs are for the admin key's holders) and why no other worker can answer; the live
    worker never sees them. Before: they went to the live worker, which answered 404 as for an id
    that never existed."""

    async def test(s, router, url, urls, hits, runners):
        _steer(router, urls, 0)
        made = await _create(s, url)
        assert made["worker"] == "w0"
        await runners[1].cleanup()  # (runners[0] is the router's)
        router.workers[urls[0]].healthy = False  # (as its health checks would find it)
        _steer(router, urls, 1)
        n = len(hits)
        calls = (("POST", "/v1/responses", {"model": "m", "input": "x", "previous_response_id": made["id"]},
                  "previous_response_id"), ("GET", f"/v1/responses/{made['id']}", None, "response_id"),
                 ("POST", f"/v1/responses/{made['id']}/cancel", None, "response_id"))  # fmt: skip
        for method, path, body, param in calls:
            async with s.request(method, url + path, json=body) as resp:
                doc = await resp.json()
                assert resp.status == 502, (path, resp.status, doc)
                err = doc["error"]
                assert err["code"] == 502 and err["param"] == param, err
                assert made["id"] in err["message"] and "worker-0" in err["message"], err
                assert urls[0] not in err["message"], err  # (no admin key sent)
        assert len(hits) == n, hits[n:]

    _run(test, admin_api_key="k")
