"""Stored OpenAI Responses and their tenant (review of session 43's change, helper h3).

1. Another tenant's id was answered with a 404 a client could tell from SGLang's own for an id it
   does not hold: ``previous_response_id`` named ``param: previous_response_id`` (SGLang's
   ``_make_not_found_error`` always says ``response_id``), the body was aiohttp's spaced JSON with
   ``charset=utf-8`` (SGLang: compact ``ORJSONResponse``, ``application/json``), and an id that
   does not begin with ``resp_`` got a 404 where SGLang answers 400 (``_make_invalid_id_error``)
   before it looks in its store: each told the caller that the id was another tenant's.
2. A client-named ``request_id`` took over another tenant's stored response: the router re-pinned
   the id to the caller on the 200, before SGLang stored anything (a streamed response is stored
   at its end; one cut off, or failing, stores nothing), so the caller's next GET went to the
   worker holding the other tenant's response and read it.
Stub workers with SGLang's store (tests/test_review42_responses.py), the real Router.
"""

from __future__ import annotations

import json

from aiohttp import web
from fastapi.responses import ORJSONResponse

import tests.test_review42_responses as r42
from tests.test_review42_responses import _run, _steer

H = "x-tenant-id"
_worker = r42._responses_worker


def _sglang(rid: str, status: int):
    """SGLang's bytes and content type (``OpenAIServingResponses.create_error_response``)."""
    if status == 404:
        msg = f"Response with id '{rid}' not found."
    else:
        msg = f"Invalid 'response_id': '{rid}'. Expected an ID that begins with 'resp'."
    r = ORJSONResponse(content={"error": {"message": msg, "type": "invalid_request_error", "param": "response_id",
                                          "code": status}}, status_code=status)  # fmt: skip
    return r.body, r.headers["content-type"]


def test_a_foreign_id_is_answered_byte_for_byte_as_sglang_answers_an_unknown_one():
    async def test(s, router, url, urls, hits, _):
        _steer(router, urls, 0)
        rids = []
        for named in (None, "resp_é\"x", "conv-1"):
            body = {"model": "m", "input": "x", **({"request_id": named} if named else {})}
            async with s.post(url + "/v1/responses", json=body, headers={H: "acme"}) as r:
                assert r.status == 200
                rids.append((await r.json())["id"])
        before = len(hits)
        for rid in rids:
            status = 404 if rid.startswith("resp_") else 400
            want = _sglang(rid, status)
            for method, path, body in (("GET", f"/v1/responses/{rid}", None),
                                       ("POST", f"/v1/responses/{rid}/cancel", None),
                                       ("POST", "/v1/responses", {"model": "m", "input": "y",
                                                                  "previous_response_id": rid})):  # fmt: skip
                async with s.request(method, url + path, json=body, headers={H: "globex"}) as r:
                    got = (await r.read(), r.headers["content-type"])
                    assert (r.status, got) == (status, want), (method, path)
        assert len(hits) == before, "another tenant's request reached a worker"

    _run(test, tenant_header=H)


def _failing_stream_worker(name: str, hits: list, gate=None):
    """SGLang's store, and a streamed creation asking ``"fail": true`` answers 200 and fails in
    its stream, storing nothing (SGLang stores a streamed response at its end only: the
    tokenizer's "Duplicate request ID detected" for an id in flight, a generation error, a cut
    connection)."""
    app = _worker(name, hits, gate)
    create = next(r.handler for r in app.router.routes()
                  if r.method == "POST" and r.resource.canonical == "/v1/responses")  # fmt: skip

    async def maybe_fail(req):
        body = await req.json()
        if not (body.get("stream") and body.get("fail")):
            return await create(req)
        hits.append((name, req.method, req.path, None))
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(req)
        err = {"type": "error", "sequence_number": 0, "message": "Duplicate request ID detected"}
        await resp.write(f"event: error\ndata: {json.dumps(err)}\n\n".encode())
        await resp.write_eof()
        return resp

    out = web.Application()
    out.router.add_post("/v1/responses", maybe_fail)
    for r in app.router.routes():
        if r.resource.canonical != "/v1/responses":
            out.router.add_route(r.method, r.resource.canonical, r.handler)
    return out


def test_a_client_named_request_id_does_not_take_over_another_tenant_s_response(monkeypatch):
    monkeypatch.setattr(r42, "_responses_worker", _failing_stream_worker)

    async def test(s, router, url, urls, hits, _):
        _steer(router, urls, 0)
        async with s.post(url + "/v1/responses", json={"model": "m", "input": "secret"}, headers={H: "acme"}) as r:
            rid = (await r.json())["id"]
        # globex names acme's id in a stream that fails (SGLang stores nothing)
        body = {"model": "m", "input": "x", "request_id": rid, "stream": True, "fail": True}
        before = len(hits)
        async with s.post(url + "/v1/responses", json=body, headers={H: "globex"}) as r:
            assert r.status == 400, r.status
            assert (await r.json())["error"]["param"] == "request_id"
        assert len(hits) == before, "it reached a worker (which would overwrite acme's response)"
        for i in range(2):
            _steer(router, urls, i)
            async with s.get(f"{url}/v1/responses/{rid}", headers={H: "globex"}) as r:
                assert r.status != 200 or (await r.json())["worker"] != "w0", "globex read acme's response"
        async with s.get(f"{url}/v1/responses/{rid}", headers={H: "acme"}) as r:
            assert r.status == 200 and (await r.json())["worker"] == "w0"

    _run(test, tenant_header=H)
