"""Stored OpenAI Responses and their tenant (review of session 43's change, helper h3).

1. Another tenant's id was answered with a 404 a client could tell from SGLang's own for an id it
   does not hold: ``previous_response_id`` named ``param: previous_response_id`` (SGLang's
   ``_make_not_found_error`` always says ``response_id``), the body was aiohttp's spaced JSON with
   ``charset=utf-8`` (SGLang: compact ``ORJSONResponse``, ``application/json``), and an id that
   does not begin with ``resp_`` got a 404 where SGLang answers 400 (``_make_invalid_id_error``)
   before it looks in its store: each told the caller that the id was another tenant's.
Stub workers with SGLang's store (tests/test_review42_responses.py), the real Router.
"""

from __future__ import annotations

from fastapi.responses import ORJSONResponse

from tests.test_review42_responses import _run, _steer

H = "x-tenant-id"


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
