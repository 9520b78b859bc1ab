"""Review findings of session 21, each with the request that showed it (reproduced on a live CPU
server before the fix; here against the middleware and the cache, which is where they were)."""

from __future__ import annotations

import json

import pytest

VOCAB = 1000


def _app(monkeypatch, tenant_header=None):
    """SGLang's route shapes behind the hint middleware; each route echoes the body it got."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from sglang_tiered.integration import http

    monkeypatch.setattr(http, "_vocab", [VOCAB])

    async def echo(request):
        return JSONResponse({"body": (await request.body()).decode()})

    routes = [Route(p, echo, methods=["POST", "PUT"]) for p in ("/generate", "/v1/completions", "/v1/score",
                                                                 "/v1/chat/completions")]  # fmt: skip
    mw = [Middleware(http.HintMiddleware, tenant_header=tenant_header)]
    return TestClient(Starlette(routes=routes, middleware=mw))


@pytest.mark.parametrize("prompt", [[11, 5000.0], [11, "5000"], [[11, " 5000 "]], [11, "+5_000"], [[1], [2, 1e4]]])
def test_ids_sglang_coerces_are_checked_as_it_reads_them(monkeypatch, prompt):
    """``"prompt": [11, 5000.0]`` passed the range check (a float) and SGLang's CompletionRequest
    made it the id 5000: the scheduler died (IndexError in the embedding). Now the ids are read
    as SGLang's own pydantic model reads them."""
    c = _app(monkeypatch)
    r = c.post("/v1/completions", json={"model": "m", "prompt": prompt})
    assert r.status_code == 400 and "token id" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("prompt", [["11", "5000"], "5000", [11, 999.0], [11, 5000.5]])
def test_text_prompts_and_valid_ids_still_pass(monkeypatch, prompt):
    """Strings are text prompts to SGLang (not ids); 999.0 is a valid id; 5000.5 is SGLang's
    own 400 (its model refuses it), not ours."""
    c = _app(monkeypatch)
    r = c.post("/v1/completions", json={"model": "m", "prompt": prompt})
    assert r.status_code == 200, r.text


def test_escaped_key_does_not_bypass_the_id_check(monkeypatch):
    """``{"\\u0069nput_ids": [11, 5000]}`` is ``input_ids`` to every JSON parser; a byte search
    for ``input_ids`` missed it and the scheduler died."""
    c = _app(monkeypatch)
    raw = b'{"\\u0069nput_ids": [11, 5000], "sampling_params": {"max_new_tokens": 1}}'
    r = c.post("/generate", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "token id" in r.text, r.text
    # an escaped hint is seen too (it used to be passed through unread)
    raw = b'{"text": "x", "kv_transfer_param\\u0073": {"lmcache.skip_save": true}}'
    r = c.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    body = json.loads(r.json()["body"])
    assert "kv_transfer_params" not in body and body["custom_params"] == {"lmcache.skip_save": True}


@pytest.mark.parametrize("field,value", [("query", [11, 5000]), ("items", [[13, 5000]]),
                                         ("label_token_ids", [20, 5000]), ("items", [[13, 5000.0]])])  # fmt: skip
def test_score_ids_are_checked(monkeypatch, field, value):
    """/v1/score's token ids reach the embedding (query, items) or index the logits
    (label_token_ids): an out-of-vocabulary one killed the scheduler."""
    c = _app(monkeypatch)
    body = {"query": [11, 12], "items": [[13, 14]], "label_token_ids": [20, 21]}
    body[field] = value
    r = c.post("/v1/score", json=body)
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    ok = c.post("/v1/score", json={"query": "a question", "items": ["x", "y"], "label_token_ids": [20, 21]})
    assert ok.status_code == 200


def test_control_plane_is_scoped_to_the_callers_tenant(monkeypatch):
    """In tenant-header mode without --admin-api-key, a tenant read every tenant's names and
    counters on /cache/stats and could POST /cache/invalidate {"tenant": "<another>"}. A call
    carrying the header is now confined to that tenant; an untagged one (the operator's side of
    the gateway) and, with an admin key, its holders see everything."""
    from starlette.requests import Request

    from sglang_tiered.integration.http import BadRequest, caller_tenant

    def req(*headers):
        return Request({"type": "http", "method": "GET", "path": "/cache/stats",
                        "headers": [(k.encode(), v) for k, v in headers]})  # fmt: skip

    monkeypatch.setenv("SGLANG_TIERED_TENANT_HEADER", "x-tenant-id")
    assert caller_tenant(req(("x-tenant-id", b"acme")), None) == "acme"
    assert caller_tenant(req(("x-tenant-id", "café".encode())), None) == "café"  # as the middleware salts
    assert caller_tenant(req(), None) is None  # untagged: from behind the gateway (the operator's view)
    assert caller_tenant(req(("x-tenant-id", b"acme")), "admin-secret") is None  # the operator's view
    with pytest.raises(BadRequest):
        caller_tenant(req(("x-tenant-id", b"a"), ("x-tenant-id", b"b")), None)
    with pytest.raises(BadRequest):
        caller_tenant(req(("x-tenant-id", b"\xff")), None)
    monkeypatch.delenv("SGLANG_TIERED_TENANT_HEADER")
    assert caller_tenant(req(("x-tenant-id", b"acme")), None) is None  # no tenant mode: unchanged


@pytest.mark.parametrize("url", ["redis://127.0.0.1:99999", "redis://host:abc", "redis://:6379", "redis://127.0.0.1:0"])
def test_index_url_that_redis_cannot_use_fails_at_launch(url):
    """``redis://127.0.0.1:99999`` was accepted; the server loaded its model and then every
    publish failed (``Port out of range``) with nothing in the stats saying why."""
    from sglang_tiered.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="SGLANG_TIERED_INDEX_URL"):
        load_config({"SGLANG_TIERED_INDEX_URL": url, "SGLANG_TIERED_SERVER_ID": "s1"})
    assert load_config({"SGLANG_TIERED_INDEX_URL": "redis://127.0.0.1:6379/2", "SGLANG_TIERED_SERVER_ID": "s1"})


def test_explicit_host_on_that_rounds_to_zero_pages_fails():
    """``SGLANG_TIERED_HOST=on`` with a T1 that rounds to zero pages was turned off silently."""
    import types

    from sglang_tiered.config import ConfigError, load_config
    from sglang_tiered.integration.host_setup import build_host_tier
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

    cache = TieredRadixCache.create_simulated(64 * 16, 16, verify_kv=True)
    ctx = types.SimpleNamespace(tp_size=1, tp_rank=0, server_args=None,
                                model_config=types.SimpleNamespace(get_total_num_kv_heads=lambda: 2))  # fmt: skip
    with pytest.raises(ConfigError, match="rounds to zero pages"):
        build_host_tier(cache, ctx, load_config({"SGLANG_TIERED_HOST": "on", "SGLANG_TIERED_HOST_RATIO": "1e-9"}))
    tier, decision = build_host_tier(cache, ctx, load_config({"SGLANG_TIERED_HOST": "auto", "SGLANG_TIERED_HOST_RATIO": "1e-9"}))
    assert tier is None and "zero pages" in decision


# ---------------------------------------------------------------- router (review, session 21)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}}},
    {"function": {"description": "d", "name": "add", "strict": True, "parameters": {"b": {}, "a": {}}}, "defer_loading": True},
    {"type": "function", "function": {"parameters": {}, "name": "z", "extra": 1}},
]  # fmt: skip


@pytest.mark.parametrize("choice", [None, "auto", "required", "none", {"type": "function", "function": {"name": "add"}},
                                    {"type": "function", "function": {"name": "missing"}}])  # fmt: skip
def test_router_tools_are_what_sglang_renders(choice):
    """SGLang renders ``Tool.model_dump()`` of each tool, none for ``tool_choice: "none"``, the
    named one for a named choice (serving_chat.py); the router rendered the raw list always."""
    from sglang.srt.entrypoints.openai.protocol import Tool

    from sglang_tiered.fleet.router import template_tools

    body = {"tools": TOOLS} if choice is None else {"tools": TOOLS, "tool_choice": choice}
    dumped = [Tool.model_validate(t).model_dump() for t in TOOLS]
    if choice == "none":
        want = None
    elif isinstance(choice, dict):
        want = [d for d in dumped if d["function"]["name"] == choice["function"]["name"]] or None
    else:
        want = dumped
    got = template_tools(body)
    assert got == want
    if got:  # the client's key order kept, as SGLang's serializer keeps it
        assert [list(g["function"]) for g in got] == [list(w["function"]) for w in want]


def test_router_ignores_template_call_arguments_from_the_client(tiny_model_path):
    """``chat_template_kwargs`` went straight into ``apply_chat_template``: padding to a length of
    millions froze or killed the router and stuck in the shared tokenizer (every later prompt
    padded), truncation cut every later prompt to one token, and a client's own Jinja template
    ran in the router. Those keys are dropped now; a request's own template is not rendered."""
    from transformers import AutoTokenizer

    from sglang_tiered.fleet.router import Router, fast_encode

    router = Router(["http://127.0.0.1:9"], None, load_poll_s=0, model_path="")
    router.tokenizer = AutoTokenizer.from_pretrained(tiny_model_path, local_files_only=True)
    router._encode = fast_encode(router.tokenizer)  # (as the router sets it when it loads one)
    plain = {"messages": [{"role": "user", "content": "the shared system prompt and a question"}]}
    want = router.tokens_of("/v1/chat/completions", plain)
    text_before = router.tokens_of("/generate", {"text": "Hello world"})
    for kw in ({"padding": "max_length", "max_length": 100_000}, {"truncation": True, "max_length": 1},
               {"tokenize": False}, {"return_tensors": "np"}):  # fmt: skip
        assert router.tokens_of("/v1/chat/completions", {**plain, "chat_template_kwargs": kw}) == want, kw
        assert router.tokens_of("/generate", {"text": "Hello world"}) == text_before, kw
    loop = "{% for i in range(10**9) %}{% for j in range(10**9) %}x{% endfor %}{% endfor %}"
    assert router.tokens_of("/v1/chat/completions", {**plain, "chat_template_kwargs": {"chat_template": loop}}) == []


def test_router_passes_other_routes_through_and_speaks_to_keyed_workers():
    """Through the router, ``GET /v1/models`` (the OpenAI SDK's ``models.list()``),
    ``/get_model_info``, ``PUT /generate`` and CORS preflights were 404 or 405; ``/flush_cache``
    reached no worker; and with workers started with ``--api-key`` the router's own calls got 401
    and it routed blind, silently. Now other routes are proxied to one healthy worker,
    ``/flush_cache`` to every worker, and ``worker_api_key`` goes on the router's own calls."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from sglang_tiered.fleet.router import Router
    from tests.test_fleet_hardening import _serve

    KEY = "sk-test"

    def worker(log):
        app = web.Application()

        def keyed(handler):
            async def h(req):
                log.append((req.method, req.path, req.headers.get("authorization")))
                if req.headers.get("authorization") != f"Bearer {KEY}":
                    return web.json_response({"error": "unauthorized"}, status=401)
                out = handler(req)
                return await out if asyncio.iscoroutine(out) else out
            return h

        async def models(_):
            return web.json_response({"object": "list", "data": [{"id": "tiny"}]})

        async def loads(_):
            return web.json_response({"loads": [{"num_running_reqs": 1, "num_waiting_reqs": 0}]})

        async def gen(req):
            return web.json_response({"method": req.method, "len": len(await req.read())})

        async def options(_):
            return web.Response(headers={"access-control-allow-origin": "*"})

        app.router.add_get("/health", lambda _: web.json_response({}))
        app.router.add_get("/v1/models", keyed(models))
        app.router.add_get("/v1/loads", keyed(loads))
        app.router.add_get("/model_info", keyed(lambda _: web.json_response({"model_path": None})))
        app.router.add_get("/server_info", keyed(lambda _: web.json_response({"page_size": 16})))
        app.router.add_post("/flush_cache", keyed(lambda _: web.Response(text="flushed")))
        app.router.add_route("PUT", "/generate", keyed(gen))
        app.router.add_route("POST", "/generate", keyed(gen))
        app.router.add_route("OPTIONS", "/v1/chat/completions", options)
        return app

    async def main():
        logs = [[], []]
        ws = [await _serve(worker(log)) for log in logs]
        router = Router([u for _, u in ws], None, load_poll_s=0.05, model_path="", worker_api_key=KEY)
        r_runner, r_url = await _serve(router.app())
        try:
            auth = {"authorization": f"Bearer {KEY}"}
            async with aiohttp.ClientSession(headers=auth) as s:
                async with s.get(r_url + "/v1/models") as r:
                    assert r.status == 200 and (await r.json())["data"][0]["id"] == "tiny"
                async with s.put(r_url + "/generate", json={"input_ids": [1, 2, 3]}) as r:
                    assert r.status == 200 and (await r.json())["method"] == "PUT"
                async with s.options(r_url + "/v1/chat/completions") as r:
                    assert r.status == 200 and r.headers.get("access-control-allow-origin") == "*"
                async with s.post(r_url + "/flush_cache") as r:
                    assert r.status == 200 and len(await r.json()) == 2
                async with s.get(r_url + "/no/such/route") as r:
                    assert r.status == 404  # the worker's answer, passed on
            await asyncio.sleep(0.3)
            assert router.stats.load_polls > 0 and router.stats.load_poll_errors == 0
            assert all(("POST", "/flush_cache", f"Bearer {KEY}") in log for log in logs)
        finally:
            await r_runner.cleanup()
            for runner, _ in ws:
                await runner.cleanup()

    asyncio.run(main())


def test_router_drops_hop_by_hop_headers():
    from multidict import CIMultiDict

    from sglang_tiered.fleet.router import forward_headers

    h = CIMultiDict([("Connection", "keep-alive, X-Secret-Hop"), ("X-Secret-Hop", "1"), ("TE", "trailers"),
                     ("Upgrade", "h2c"), ("Keep-Alive", "timeout=5"), ("X-Keep", "a"), ("X-Keep", "b"),
                     ("X-Latin", "caf\udce9")])  # fmt: skip
    assert forward_headers(h, False, "x-tenant-id") == [("X-Keep", "a"), ("X-Keep", "b")]
    with pytest.raises(ValueError):
        forward_headers(CIMultiDict([("X-Tenant-Id", "caf\udce9")]), False, "x-tenant-id")


def test_tenant_invalidated_pages_count_t1_too():
    """A tenant's ``invalidated_pages`` counted its device pages only; what T1 dropped for it was
    in ``dropped_tokens`` alone. Now both, so the per-tenant count adds up to what was dropped."""
    from sglang_tiered.core.tenants import name_hash

    page = 16
    cache = TieredRadixCache_sim(page)
    for i in range(40):  # two tenants' prompts, more than the device holds: T1 takes the victims
        for t in ("acme", "globex"):
            cache.driver.run([1000 * (i % 20) + j for j in range(6 * page)], tenant=t)
    host = cache.host.tenant_pages()
    assert host.get(name_hash("acme"), 0) > 0 and host.get(name_hash("globex"), 0) > 0
    before = {t: cache.tenant(t).invalidated_pages for t in ("acme", "globex")}
    res = cache.invalidate(tenant_hash=name_hash("acme"))
    got = cache.tenant("acme").invalidated_pages - before["acme"]
    assert got * page == res["dropped_tokens"] and got > host[name_hash("acme")] > 0
    assert cache.tenant("globex").invalidated_pages == before["globex"]
    before = cache.tenant("globex").invalidated_pages
    res = cache.invalidate(everything=True)
    assert (cache.tenant("globex").invalidated_pages - before) * page == res["dropped_tokens"]


def TieredRadixCache_sim(page):
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

    return TieredRadixCache.create_simulated(24 * page, page, host_pages=64, debug_checks=True)
