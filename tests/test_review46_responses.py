"""Tenants' stored-response ids do not meet in the router's map (review, session 46).

With a tenant header, workers in tenant mode store a tenant's response under its scoped id
(``scoped_response_id``, session 44), so two tenants naming the same ``request_id`` hold two
different responses. The router still kept a client-named id as sent, with its owner, next to
the scoped one:
1. A tenant naming a ``request_id`` another tenant had used got a 400 ("request_id is in use by
   another stored response"): an answer that told it the other tenant had used that id.
2. A tenant could claim another's id first (the id as sent, or its scoped form, which is the
   unkeyed digest of the tenant's name and the id): the owner's later creation was refused, or
   its GET and ``previous_response_id`` answered 404 by the router without reaching the worker
   that stored the response.
Now the map is keyed by the id as the workers store it (the caller's scoped id): a tenant's own
scope holds its responses alone. Stub workers in tenant mode on 127.0.0.1, the real Router.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from sglang_tiered.core.tenants import scoped_response_id
from tests.test_review42_passthrough import _fleet
from tests.test_review42_responses import _sglang_404, _steer

H = "x-tenant-id"


def _scoping_worker(name: str, hits: list):
    """A stub worker in tenant mode: SGLang's store behind ids scoped as the servers' middleware
    scopes them (``request_id``, ``previous_response_id`` and the route's id, each under the
    header's tenant; the operator's call, without the header, as sent)."""
    app = web.Application()
    store: dict = {}

    def scope(req, rid):
        tenant = req.headers.get(H)
        return scoped_response_id(tenant, rid) if tenant and isinstance(rid, str) else rid

    async def create(req):
        body = await req.json()
        prev = scope(req, body.get("previous_response_id"))
        hits.append((name, req.method, req.path, prev))
        if prev is not None and prev not in store:
            return _sglang_404(body["previous_response_id"])
        rid = scope(req, body.get("request_id") or f"resp_{name}_{len(hits)}")
        store[rid] = {"id": rid, "object": "response", "status": "completed", "worker": name,
                      "input": body.get("input"), "previous": prev}  # fmt: skip
        return web.json_response(store[rid])

    async def by_id(req):
        rid = scope(req, req.match_info["rid"])
        hits.append((name, req.method, req.path, rid))
        if rid not in store:
            return _sglang_404(req.match_info["rid"])
        if req.path.endswith("/cancel"):
            store[rid] = {**store[rid], "status": "cancelled"}
        return web.json_response(store[rid])

    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{rid}", by_id)
    app.router.add_post("/v1/responses/{rid}/cancel", by_id)
    app.router.add_get("/health", lambda _: web.json_response({}))
    return app


def _run(test):
    async def main():
        hits: list = []
        router, url, urls, runners = await _fleet(_scoping_worker("w0", hits), _scoping_worker("w1", hits),
                                                  tenant_header=H)  # fmt: skip
        try:
            async with aiohttp.ClientSession() as s:
                return await test(s, router, url, urls, hits)
        finally:
            for r in runners:
                await r.cleanup()

    asyncio.run(main())


async def _post(s, url, tenant, **body):
    hdr = {H: tenant} if tenant else {}
    async with s.post(url + "/v1/responses", json={"model": "m", **body}, headers=hdr) as r:
        return r.status, await r.json()


async def _get(s, url, tenant, rid, cancel=False):
    hdr = {H: tenant} if tenant else {}
    path = f"{url}/v1/responses/{rid}" + ("/cancel" if cancel else "")
    async with s.request("POST" if cancel else "GET", path, headers=hdr) as r:
        return r.status, await r.json()


async def _owner_reaches_it(s, url, urls, router, tenant, named, answered, worker, text):
    """``tenant``'s response (``named`` as it sent it, ``answered`` as its worker answered) is
    reached on ``worker`` (index) by a GET under either name, a follow-up and a cancel, while the
    other worker is the least busy."""
    _steer(router, urls, 1 - worker)
    for rid in (named, answered):
        status, doc = await _get(s, url, tenant, rid)
        assert status == 200, (tenant, rid, status, doc)
        assert doc["worker"] == f"w{worker}" and doc["input"] == text and doc["id"] == answered, (tenant, rid, doc)
    status, doc = await _post(s, url, tenant, input="more", previous_response_id=named, store=False)
    assert status == 200 and doc["worker"] == f"w{worker}" and doc["previous"] == answered, (tenant, status, doc)
    status, doc = await _get(s, url, tenant, named, cancel=True)
    assert status == 200 and doc["worker"] == f"w{worker}" and doc["status"] == "cancelled", (tenant, status, doc)


def test_a_tenant_may_name_an_id_another_tenant_used():
    """Before: globex's creation got a 400 "request_id is in use by another stored response",
    telling it that acme had used ``resp_conv``."""

    async def test(s, router, url, urls, hits):
        _steer(router, urls, 0)
        status, acme = await _post(s, url, "acme", input="acme's secret", request_id="resp_conv")
        assert status == 200 and acme["worker"] == "w0", (status, acme)
        _steer(router, urls, 1)
        status, globex = await _post(s, url, "globex", input="globex's", request_id="resp_conv")
        assert status == 200, (status, globex)
        assert globex["worker"] == "w1" and globex["id"] == scoped_response_id("globex", "resp_conv")
        await _owner_reaches_it(s, url, urls, router, "acme", "resp_conv", acme["id"], 0, "acme's secret")
        await _owner_reaches_it(s, url, urls, router, "globex", "resp_conv", globex["id"], 1, "globex's")
        # neither reads the other's by the other's answered id
        for tenant, other in (("acme", globex), ("globex", acme)):
            for to in (0, 1):
                _steer(router, urls, to)
                status, doc = await _get(s, url, tenant, other["id"])
                assert status == 404 and doc["error"]["message"] == f"Response with id '{other['id']}' not found."

    _run(test)


def test_a_tenant_cannot_claim_another_tenant_s_id_first():
    """globex (and a caller without the header) name acme's ids before acme does: the id as acme
    will send it and its scoped form (the answer acme will get). Before: acme's GET by the id its
    worker answered was the router's 404 (the map held it for the claimant), without reaching
    the worker that stored it."""

    async def test(s, router, url, urls, hits):
        _steer(router, urls, 0)
        claims = [("globex", "resp_next"), ("globex", scoped_response_id("acme", "resp_next")),
                  ("globex", scoped_response_id("acme", "resp_later")), (None, scoped_response_id("acme", "resp_op"))]
        for tenant, rid in claims:
            status, doc = await _post(s, url, tenant, input="claim", request_id=rid)
            assert status == 200 and doc["worker"] == "w0", (tenant, rid, status, doc)
        for k, named in enumerate(("resp_next", "resp_later", "resp_op")):
            _steer(router, urls, 1)
            status, acme = await _post(s, url, "acme", input=f"acme's {k}", request_id=named)
            assert status == 200, (named, status, acme)
            assert acme["worker"] == "w1" and acme["id"] == scoped_response_id("acme", named), acme
            await _owner_reaches_it(s, url, urls, router, "acme", named, acme["id"], 1, f"acme's {k}")
        # globex's own responses are its own still
        status, doc = await _get(s, url, "globex", "resp_next")
        assert status == 200 and doc["worker"] == "w0" and doc["input"] == "claim", doc

    _run(test)


def test_the_caller_without_the_header_still_cannot_read_or_take_a_tenant_s_response():
    """Kept from session 43: a caller without the header (its ids unscoped on the workers) that
    names a tenant's stored id is answered SGLang's 404 by the router, and its creation naming it
    is refused: on the workers it is that tenant's id, and the creation would overwrite it."""

    async def test(s, router, url, urls, hits):
        _steer(router, urls, 0)
        status, acme = await _post(s, url, "acme", input="acme's secret", request_id="resp_x")
        assert status == 200 and acme["worker"] == "w0"
        before = len(hits)
        status, doc = await _get(s, url, None, acme["id"])
        assert status == 404, (status, doc)
        status, doc = await _post(s, url, None, input="y", request_id=acme["id"])
        assert status == 400 and doc["error"]["param"] == "request_id", (status, doc)
        assert len(hits) == before

    _run(test)


def _map_only_router():
    """The real Router, its map alone exercised (no worker is reached)."""
    from sglang_tiered.fleet.router import Router

    return Router(["http://127.0.0.1:1", "http://127.0.0.1:2"], None, load_poll_s=0, model_path="",
                  tenant_header=H)  # fmt: skip


def test_tenants_creations_in_any_order_never_meet_in_the_map():
    """Model: workers in tenant mode store each tenant's ``request_id`` under its scope. Whatever
    ids tenants (and the caller without the header) name, in any order and on any worker, a
    tenant's creation is never refused and its own ids (as sent, and as answered) reach the worker
    of its last creation of that id; an id it never created is never routed to another's worker."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from sglang_tiered.fleet.router import FOREIGN

    tenants = ("acme", "globex", None)
    names = ["resp_a", "resp_b", "conv", scoped_response_id("acme", "resp_a"), scoped_response_id("globex", "resp_b")]
    step = st.tuples(st.sampled_from(tenants), st.sampled_from(names), st.integers(0, 1))

    @settings(max_examples=300, deadline=None)
    @given(st.lists(step, max_size=12))
    def check(steps):
        router = _map_only_router()
        urls = list(router.workers)
        where: dict = {}  # (tenant, id as the workers store it) -> worker url
        for tenant, named, w in steps:
            if router._takes_over(named, tenant):
                assert tenant is None, (tenant, named)  # (only the caller without the header, as before)
                continue
            wid = scoped_response_id(tenant, named) if tenant else named
            router._remember_response(wid, urls[w], tenant)  # (the id pinned before the answer)
            router._remember_response(wid, urls[w], tenant)  # (and learned from the answer: the same)
            where[(tenant, wid)] = urls[w]
        for tenant in ("acme", "globex"):
            for named in names:
                if not named.startswith("resp_"):
                    continue  # (SGLang reads no other id: any worker answers it alike)
                wid = scoped_response_id(tenant, named)
                got = router._response_worker(named, tenant)
                assert got == router._response_worker(wid, tenant)
                if (tenant, wid) in where:
                    assert got == where[(tenant, wid)], (tenant, named, got)
                else:  # (routed as any request, or SGLang's 404 by the router: no other's worker)
                    assert got is None or got == FOREIGN or (None, wid) in where, (tenant, named, got)

    check()
