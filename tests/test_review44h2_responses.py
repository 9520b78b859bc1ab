"""A tenant's 404 for a stored response names the id it sent, as SGLang's does (session 44 review).

In tenant-header mode the server's middleware scopes response ids (``scoped_response_id``), and
SGLang's 404 for an id its store does not hold (``_make_not_found_error``) named the scoped form,
``resp_t<digest>~...``. Through the router that told ids apart: another tenant's id (one the router
remembers) gets the router's copy of SGLang's 404 naming the id as sent, without reaching a worker;
an id nobody holds reached a worker and got its 404 naming the scoped id. Now the worker's answer
names the id as the client sent it, byte for byte the router's (and stock SGLang's) answer.
"""

from __future__ import annotations

import asyncio
import json

from sglang_tiered.core.tenants import scoped_response_id
from sglang_tiered.fleet.router import _response_not_found
from sglang_tiered.integration.http import HintMiddleware

H = "x-tenant-id"


def _sglang_not_found(rid: str):
    """SGLang's own 404 for ``rid`` (``OpenAIServingResponses._make_not_found_error`` with its
    nested ``create_error_response``, an ORJSONResponse). ``serving_responses`` imports
    ``openai_harmony``, which the test environment lacks: there the two functions' bodies as
    SGLang 0.5.23 writes them (serving_responses.py:246-259, 1948-1954; checked against the source
    by ``test_sglang_writes_its_not_found_as_copied``), encoded by the same ORJSONResponse."""
    import types

    try:
        from sglang.srt.entrypoints.openai.serving_responses import OpenAIServingResponses as O
    except ImportError:
        from fastapi.responses import ORJSONResponse

        err = {"message": f"Response with id '{rid}' not found.", "type": "invalid_request_error",
               "param": "response_id", "code": 404}  # fmt: skip
        return ORJSONResponse(content={"error": err}, status_code=404)
    fake = types.SimpleNamespace()
    fake.create_error_response = lambda *a, **k: O.create_error_response(fake, *a, **k)
    return O._make_not_found_error(fake, rid)


def test_sglang_writes_its_not_found_as_copied():
    """The copy above is SGLang's: its source still builds the 404 so (a new SGLang that words it
    otherwise fails here, and the servers' naming of the id as sent, which matches these bytes,
    would stop acting)."""
    import importlib.util
    import pathlib

    src = pathlib.Path(importlib.util.find_spec("sglang.srt.entrypoints.openai").submodule_search_locations[0])
    text = (src / "serving_responses.py").read_text()
    assert "message=f\"Response with id '{response_id}' not found.\"," in text
    assert 'err_type="invalid_request_error",\n            status_code=HTTPStatus.NOT_FOUND,\n            param="response_id",' in text
    assert 'return ORJSONResponse(content={"error": nested_error}, status_code=status_code)' in text
    for field in ('"message": message,', '"type": err_type,', '"param": param,', '"code": status_code,'):
        assert field in text, field


def _store_app(store: set):
    """SGLang's three Responses routes as far as the store goes: an id it does not hold is its 404."""

    async def app(scope, receive, send):
        chunks, more = [], True
        while more:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        path = scope["path"]
        if path == "/v1/responses":
            rid = json.loads(b"".join(chunks)).get("previous_response_id")
        else:
            rid = path[len("/v1/responses/") :].partition("/")[0]
        if rid is not None and rid not in store:
            return await _sglang_not_found(rid)(scope, receive, send)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"id":"ok"}'})

    return app


def _call(app, method: str, path: str, body: dict | None, tenant: str | None, tenant_header: str | None = H):
    """(status, headers, body bytes) the client gets through the real middleware."""
    mw = HintMiddleware(app, tenant_header=tenant_header)
    raw = json.dumps(body).encode() if body is not None else b""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    if tenant is not None:
        headers.append((H.encode(), tenant.encode()))
    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "headers": headers}  # fmt: skip
    out: list = []

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(msg):
        out.append(msg)

    asyncio.run(mw(scope, receive, send))
    start = out[0]
    data = b"".join(m.get("body", b"") for m in out[1:])
    hdrs = dict(start.get("headers", []))
    return start["status"], hdrs, data


def test_a_tenants_404_names_the_id_it_sent_as_sglang_and_the_router_do():
    theirs = scoped_response_id("acme", "resp_abc")
    store = {theirs}
    app = _store_app(store)
    for rid in ("resp_abc", theirs, "resp_nobody", "resp_a b\u00e9\"'\\"):
        expected = _sglang_not_found(rid).body  # (stock SGLang, the id as sent)
        assert _response_not_found(rid).body == expected  # (the router's copy, session 43)
        for method, path, body in [("GET", f"/v1/responses/{rid}", None),
                                   ("POST", f"/v1/responses/{rid}/cancel", None),
                                   ("POST", "/v1/responses", {"model": "m", "input": "x",
                                                              "previous_response_id": rid})]:  # fmt: skip
            status, hdrs, data = _call(app, method, path, body, "globex")
            assert status == 404 and data == expected, (method, path, data)
            assert hdrs[b"content-length"] == str(len(data)).encode()
            # the same without tenant mode: stock SGLang's answer, byte for byte
            if rid not in store:
                assert _call(app, method, path, body, None, None)[2] == expected


def test_what_is_found_and_an_owners_own_scoped_id_are_unchanged():
    theirs = scoped_response_id("acme", "resp_abc")
    app = _store_app({theirs})
    for path in ("/v1/responses/resp_abc", f"/v1/responses/{theirs}"):
        assert _call(app, "GET", path, None, "acme")[::2] == (200, b'{"id":"ok"}')
    # a 404 that names the scoped id the tenant sent itself keeps it
    mine = scoped_response_id("acme", "resp_gone")
    assert _call(app, "GET", f"/v1/responses/{mine}", None, "acme")[2] == _sglang_not_found(mine).body
    # a creation naming no previous response is served as it is (other 404s pass as they are:
    # test_other_404s_reach_the_client_as_they_are)
    status, _, data = _call(app, "POST", "/v1/responses", {"model": "m", "input": "x"}, "acme")
    assert status == 200


def test_a_null_request_id_is_left_for_sglang_to_refuse():
    """SGLang refuses ``"request_id": null`` (a string, or none at all: ``ResponsesRequest``); a
    tenant's was made a fresh id and served, where the operator's and any other server's is refused."""
    seen = []

    async def app(scope, receive, send):
        msg = await receive()
        seen.append(json.loads(msg["body"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    _call(app, "POST", "/v1/responses", {"model": "m", "input": "x", "request_id": None}, "acme")
    assert seen[-1]["request_id"] is None
    _call(app, "POST", "/v1/responses", {"model": "m", "input": "x"}, "acme")
    assert seen[-1]["request_id"].startswith("resp_t")  # (none named: a fresh one, scoped)


def _answering(status: int, parts: list):
    """An app that reads the request and answers ``status`` with the body in ``parts`` (one ASGI
    message each, content-length set to their total)."""

    async def app(scope, receive, send):
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        total = str(sum(map(len, parts))).encode()
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-length", total)]})
        for i, part in enumerate(parts):
            await send({"type": "http.response.body", "body": part, "more_body": i < len(parts) - 1})

    return app


def test_other_404s_reach_the_client_as_they_are():
    """Only SGLang's 404 for the id the tenant sent, in its scoped form, is rewritten: another
    route's 404, one naming some other scoped id, one that is not JSON, and one past
    NOT_FOUND_CAP in parts reach the client byte for byte (the last one's parts all, in order)."""
    from sglang_tiered.integration.http import NOT_FOUND_CAP

    other = _sglang_not_found(scoped_response_id("globex", "resp_other")).body
    big = [b"x" * (NOT_FOUND_CAP // 2 + 1), b"y" * (NOT_FOUND_CAP // 2 + 1), b"z"]
    for parts in ([b'{"detail":"Not Found"}'], [other], [b"not json"], [other[:7], other[7:]], big):
        for method, path, body in [("GET", "/v1/responses/resp_abc", None),
                                   ("POST", "/v1/responses", {"model": "m", "input": "x",
                                                              "previous_response_id": "resp_abc"})]:  # fmt: skip
            status, hdrs, data = _call(_answering(404, parts), method, path, body, "globex")
            assert (status, data) == (404, b"".join(parts)), (method, path, data[:80])
            assert hdrs[b"content-length"] == str(len(data)).encode()
    # SGLang's 404 for the id sent, in parts under the cap: put together, and named as sent
    mine = _sglang_not_found(scoped_response_id("globex", "resp_abc")).body
    status, hdrs, data = _call(_answering(404, [mine[:5], mine[5:9], mine[9:]]), "GET", "/v1/responses/resp_abc",
                               None, "globex")  # fmt: skip
    assert (status, data) == (404, _sglang_not_found("resp_abc").body)
    assert hdrs[b"content-length"] == str(len(data)).encode()
