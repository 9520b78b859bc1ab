"""A helper's audit of request features (session 38), unit level, through the real middleware.

1. A client's ``extra_key`` is fenced (``client:<key>:``) on every salted route and in Vertex's
   ``parameters``: SGLang appends a LoRA adapter's id to ``extra_key``, and adapters given with
   ``--lora-paths`` have ids anyone can compute, so a base-model request sent with
   ``"extra_key": "<adapter id>"`` wrote its KV into the adapter's namespace and the adapter's
   requests were served it (wrong output, live: tests/test_e2e_review38.py has the session half;
   the LoRA half needs a CPU LoRA shim and was run by hand). Before, the chat, responses and
   invocations routes passed a plain body unparsed, and Vertex's ``parameters`` (which SGLang
   spreads into the request) were never looked at, ``lora_id`` included.
2. In tenant-header mode SGLang's session ids are scoped per tenant (SGLang keys sessions by id
   alone: tenant B naming tenant A's session continued it and read A's prompt back through prompt
   logprobs, and could close it).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from sglang_tiered.integration.http import HintMiddleware

ADAPTER_ID = "0123456789abcdef" * 2  # shape of SGLang's lora_id (uuid .hex)


def _through(path: str, body: dict, tenant: str | None = None, method: str = "POST", tenant_header=None) -> dict:
    """The body the route behind the real middleware receives (None: the middleware answered),
    for a call carrying ``tenant`` in ``x-tenant-id`` (the tenant header when ``tenant`` is set)."""
    seen = {}

    async def app(scope, receive, send):
        chunks, more = [], True
        while more:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        seen["body"] = b"".join(chunks)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    mw = HintMiddleware(app, tenant_header=tenant_header or ("x-tenant-id" if tenant is not None else None))
    raw = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    if tenant is not None:
        headers.append((b"x-tenant-id", tenant.encode()))
    scope = {"type": "http", "method": method, "path": path, "root_path": "", "query_string": b"", "headers": headers}

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(msg):
        pass

    asyncio.run(mw(scope, receive, send))
    return json.loads(seen["body"]) if "body" in seen else None


@pytest.mark.parametrize("path,body", [
    ("/generate", {"text": "hi", "extra_key": ADAPTER_ID}),
    ("/v1/completions", {"model": "m", "prompt": "hi", "extra_key": ADAPTER_ID}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "extra_key": ADAPTER_ID}),
    ("/v1/responses", {"model": "m", "input": "hi", "extra_key": ADAPTER_ID}),
    ("/invocations", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "extra_key": ADAPTER_ID}),
])
def test_client_extra_key_is_fenced_on_every_salted_route(path, body):
    out = _through(path, body)
    assert out["extra_key"] == f"client:{ADAPTER_ID}:", (path, out["extra_key"])


def test_client_extra_key_is_fenced_in_vertex_parameters():
    from sglang_tiered.integration.http import VERTEX_PATH

    out = _through(VERTEX_PATH, {"instances": [{"text": "hi"}], "parameters": {"extra_key": ADAPTER_ID}})
    assert out["parameters"]["extra_key"] == f"client:{ADAPTER_ID}:", out


def test_vertex_parameters_cannot_name_a_lora_id():
    from sglang_tiered.integration.http import VERTEX_PATH

    out = _through(VERTEX_PATH, {"instances": [{"text": "hi"}], "parameters": {"lora_id": ADAPTER_ID}})
    assert out is None or "lora_id" not in (out.get("parameters") or {}), out


def test_tenants_session_ids_are_their_own():
    gen = {"input_ids": [7, 8], "session_params": {"id": "chat-1", "rid": "a-1"}}
    a = _through("/generate", gen, "A")["session_params"]["id"]
    b = _through("/generate", gen, "B")["session_params"]["id"]
    assert a != b, "tenants A and B name the same SGLang session"
    # B naming the id A's session has on the server does not reach it either
    assert _through("/generate", {"input_ids": [7], "session_params": {"id": a}}, "B")["session_params"]["id"] != a
    # the id A is handed back stays A's
    assert _through("/generate", {"input_ids": [7], "session_params": {"id": a}}, "A")["session_params"]["id"] == a
    for route in ("/v1/chat/completions", "/v1/completions"):
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "prompt": "x",
                "session_params": {"id": "chat-1"}}
        assert _through(route, body, "B")["session_params"]["id"] != a, route


def test_open_and_close_session_are_scoped_on_every_method():
    for method in ("POST", "GET"):
        a = _through("/open_session", {"capacity_of_str_len": 10, "session_id": "chat-1"}, "A", method)
        b = _through("/close_session", {"session_id": "chat-1"}, "B", method)
        assert a is not None and b is not None
        assert a["session_id"] != b["session_id"], (method, a, b)


def test_the_router_finds_a_tenants_session_by_its_own_id_only():
    """Through the router in tenant-header mode: the servers hand back a scoped id; the router
    pins the session's requests (by the id the tenant chose or the one it was handed) and its
    close to the worker that opened it, and another tenant naming either id is pinned to nothing."""
    from aiohttp import ClientSession, web

    from sglang_tiered.core.tenants import scoped_session_id
    from sglang_tiered.fleet.router import Router
    from tests.test_fleet_hardening import _serve

    def worker(name, log):
        app = web.Application()

        async def open_session(req):
            doc = await req.json()
            return web.json_response(scoped_session_id(req.headers["x-tenant-id"], doc["session_id"]))

        async def gen(req):
            doc = await req.json()
            log.append((name, (doc.get("session_params") or {}).get("id")))
            return web.json_response({"text": name, "meta_info": {}})

        async def close(req):
            log.append((name, "close"))
            return web.json_response({})

        app.router.add_post("/open_session", open_session)
        app.router.add_post("/generate", gen)
        app.router.add_post("/close_session", close)
        app.router.add_get("/health", lambda _: web.json_response({}))
        return app

    async def main():
        log: list = []
        ws = [await _serve(worker(f"w{i}", log)) for i in range(3)]
        router = Router([u for _, u in ws], None, load_poll_s=0, model_path="", tenant_header="x-tenant-id")
        rr, url = await _serve(router.app())
        try:
            async with ClientSession() as s:
                async with s.post(url + "/open_session", json={"session_id": "chat-1"}, headers={"x-tenant-id": "A"}) as r:
                    sid = await r.json()
                owner = router.sessions[sid]
                assert sid == scoped_session_id("A", "chat-1")
                for tenant, name in (("A", "chat-1"), ("A", sid), ("B", "chat-1"), ("B", sid)):
                    assert router._session_of({"session_params": {"id": name}}, tenant) == (owner if tenant == "A" else None)
                for _ in range(4):
                    async with s.post(url + "/generate", json={"text": "x", "session_params": {"id": "chat-1"}},
                                      headers={"x-tenant-id": "A"}) as r:  # fmt: skip
                        assert r.status == 200
                owner_name = f"w{[u for _, u in ws].index(owner)}"
                assert {w for w, sp in log if sp == "chat-1"} == {owner_name}, log
                async with s.post(url + "/close_session", json={"session_id": "chat-1"}, headers={"x-tenant-id": "B"}):
                    pass
                assert sid in router.sessions  # (B's close named another session)
                async with s.post(url + "/close_session", json={"session_id": "chat-1"}, headers={"x-tenant-id": "A"}):
                    pass
                assert sid not in router.sessions and (owner_name, "close") in log
        finally:
            await rr.cleanup()
            for runner, _ in ws:
                await runner.cleanup()

    asyncio.run(main())


@pytest.mark.parametrize("params", [
    {"input_ids": [1, 10**6]},  # (the first instance has no text or ids: parameters give the prompt)
    {"top_logprobs_num": 10**6, "return_logprob": True},
    {"sampling_params": {"n": 10**6}},
    {"sampling_params": {"max_new_tokens": 1, "logit_bias": {"1": 1e300}}},
    {"lora_id": ADAPTER_ID},
    {"positional_embed_overrides": {}},
])  # fmt: skip
def test_vertex_parameters_get_every_generate_check(monkeypatch, params):
    """Vertex's route builds ``GenerateReqInput(**inputs, image_data=..., **parameters)``: its
    ``parameters`` are any ``/generate`` field, and each of these kills stock SGLang 0.5.23's
    scheduler on ``/generate`` (sessions 26-27), where the middleware refuses them; through Vertex
    only the instances' ids were checked (found in the review of the audit's fix, session 38)."""
    from sglang_tiered.integration import http

    monkeypatch.setattr(http, "_vocab", [128])
    body = {"instances": [{"image_data": None}], "parameters": params}
    with pytest.raises(http.BadRequest):
        http.rewrite_body(json.dumps(body).encode(), http.VERTEX_PATH, None, False)
    ok = {"instances": [{"text": "hi"}], "parameters": {"sampling_params": {"max_new_tokens": 1}}}
    assert json.loads(http.rewrite_body(json.dumps(ok).encode(), http.VERTEX_PATH, None, False)) == ok
