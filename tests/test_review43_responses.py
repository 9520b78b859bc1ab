"""Stored OpenAI Responses are their tenant's (review, session 43).

SGLang 0.5.23 keeps one response store per server and knows no tenant: with a tenant header
(``--tenant-header``), any tenant that had another's response id read it (``GET
/v1/responses/{id}``), continued that conversation (``previous_response_id``: its messages
become the prompt) or cancelled it, through the router, which pinned the id to its worker and
sent anyone's request there. Now the router remembers whose each id is and answers another
tenant as SGLang answers an id it does not hold (404, its own error shape), without reaching a
worker. Without a tenant header nothing changes (a GET carries no body, so no ``cache_salt``).
Stub workers with SGLang's store on 127.0.0.1, the real Router in front (tests/test_review42_responses.py).
"""

from __future__ import annotations

from tests.test_review42_responses import _create, _run, _steer

H = "x-tenant-id"


def test_another_tenant_cannot_read_continue_or_cancel_a_stored_response():
    async def test(s, router, url, urls, hits, _):
        _steer(router, urls, 0)
        async with s.post(url + "/v1/responses", json={"model": "m", "input": "x"}, headers={H: "acme"}) as r:
            assert r.status == 200
            mine = await r.json()
        rid = mine["id"]
        before = len(hits)
        for tenant in ("globex", None):
            hdr = {H: tenant} if tenant else {}
            async with s.get(f"{url}/v1/responses/{rid}", headers=hdr) as r:
                assert r.status == 404, (tenant, r.status, await r.text())
                err = (await r.json())["error"]
                assert err == {"message": f"Response with id '{rid}' not found.", "type": "invalid_request_error",
                               "param": "response_id", "code": 404}, err  # fmt: skip
            async with s.post(f"{url}/v1/responses/{rid}/cancel", headers=hdr) as r:
                assert r.status == 404, (tenant, r.status)
            async with s.post(url + "/v1/responses", json={"model": "m", "input": "y", "previous_response_id": rid},
                              headers=hdr) as r:  # fmt: skip
                assert r.status == 404, (tenant, r.status)
                assert (await r.json())["error"]["param"] == "response_id"  # (SGLang names response_id for it too)
        assert len(hits) == before, "another tenant's request reached a worker"
        # its own tenant still reaches it, wherever the least busy worker is
        _steer(router, urls, 1)
        async with s.get(f"{url}/v1/responses/{rid}", headers={H: "acme"}) as r:
            assert r.status == 200 and (await r.json())["worker"] == "w0"
        async with s.post(url + "/v1/responses", json={"model": "m", "input": "y", "previous_response_id": rid},
                          headers={H: "acme"}) as r:  # fmt: skip
            assert r.status == 200 and (await r.json())["worker"] == "w0"
        async with s.post(f"{url}/v1/responses/{rid}/cancel", headers={H: "acme"}) as r:
            assert r.status == 200 and (await r.json())["status"] == "cancelled"

    _run(test, tenant_header=H)


def test_a_streamed_response_is_its_tenant_s_too():
    async def test(s, router, url, urls, hits, _):
        _steer(router, urls, 1)
        async with s.post(url + "/v1/responses", json={"model": "m", "input": "x", "stream": True},
                          headers={H: "acme"}) as r:  # fmt: skip
            assert r.status == 200
            text = await r.text()
        rid = text.split('"id": "', 1)[1].split('"', 1)[0]
        async with s.get(f"{url}/v1/responses/{rid}", headers={H: "globex"}) as r:
            assert r.status == 404
        _steer(router, urls, 0)
        async with s.get(f"{url}/v1/responses/{rid}", headers={H: "acme"}) as r:
            assert r.status == 200 and (await r.json())["worker"] == "w1"

    _run(test, tenant_header=H)


def test_without_a_tenant_header_any_caller_reaches_a_stored_response():
    """No tenant header: no request names its tenant (a GET has no body), so every caller is one."""

    async def test(s, router, url, urls, hits, _):
        _steer(router, urls, 0)
        doc = await _create(s, url, cache_salt="acme")
        _steer(router, urls, 1)
        async with s.get(f"{url}/v1/responses/{doc['id']}") as r:
            assert r.status == 200 and (await r.json())["worker"] == "w0"

    _run(test)
