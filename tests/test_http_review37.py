"""A helper's audit of the server's HTTP layer, control plane and client policy (session 37):
unit-level reproducers, each failed before its fix (each docstring tells what happened then)."""

from __future__ import annotations

import asyncio
import json
import math
from types import SimpleNamespace

import pytest


def _tenant_app():
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from sglang_tiered.integration.http import HintMiddleware

    async def echo(request):
        body = await request.json()
        return JSONResponse({"salt": body.get("cache_salt"), "input_ids": body.get("input_ids")})

    routes = [Route("/generate", echo, methods=["POST", "PUT"]), Route("/v1/embeddings", echo, methods=["POST"])]
    return Starlette(routes=routes, middleware=[Middleware(HintMiddleware, tenant_header="x-tenant-id")])


def _call(app, path: str, body: dict | None, headers: dict, root_path: str = "", method: str = "POST"):
    """One request as uvicorn 0.54 hands it to the app (h11_impl.py:206 / httptools_impl.py:261:
    ``scope["path"] = root_path + path`` and ``scope["root_path"] = root_path``, root_path being
    SGLang's ``--fastapi-root-path``, http_server.py:2953/2996/3056)."""
    raw = json.dumps(body).encode() if body is not None else b""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
        "path": root_path + path, "raw_path": (root_path + path).encode(), "root_path": root_path,
        "query_string": b"", "server": ("127.0.0.1", 30000), "client": ("127.0.0.1", 5555),
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
        + [(k.encode(), v.encode()) for k, v in headers.items()],
    }  # fmt: skip
    sent = [{"type": "http.request", "body": raw, "more_body": False}]
    out = {"status": None, "body": b""}

    async def receive():
        return sent.pop(0) if sent else {"type": "http.disconnect"}

    async def send(msg):
        if msg["type"] == "http.response.start":
            out["status"] = msg["status"]
        elif msg["type"] == "http.response.body":
            out["body"] += msg.get("body", b"")

    asyncio.run(app(scope, receive, send))
    return out["status"], json.loads(out["body"] or b"null")


def test_control_no_root_path_header_wins():
    """Control: without a root path the trusted header replaces the client's own salt."""
    status, body = _call(_tenant_app(), "/generate", {"text": "hi", "cache_salt": "bob"}, {"x-tenant-id": "alice"})
    assert status == 200 and body["salt"] == "alice"


def test_fastapi_root_path_bypasses_tenant_header():
    """With SGLang's ``--fastapi-root-path /sglang`` uvicorn hands every request the path
    ``/sglang/generate``; Starlette still routes it to ``/generate`` (``get_route_path`` strips
    root_path), but HintMiddleware compares the raw ``scope["path"]`` with its route names
    (http.py:212-219): every body passes unparsed, so a client's own ``cache_salt`` picks the
    tenant (here alice's request writes into bob's namespace)."""
    status, body = _call(_tenant_app(), "/generate", {"text": "hi", "cache_salt": "bob"}, {"x-tenant-id": "alice"},
                         root_path="/sglang")  # fmt: skip
    assert status == 200
    assert body["salt"] == "alice", f"route got cache_salt={body['salt']!r}: the client's salt, not the header's"


def test_fastapi_root_path_unsalted_route_not_refused():
    """Same root path: an unsalted route (403 in tenant mode) is served."""
    status, _ = _call(_tenant_app(), "/v1/embeddings", {"input": "hi"}, {"x-tenant-id": "alice"}, root_path="/sglang")
    assert status == 403, f"status {status}: /v1/embeddings served in tenant-header mode"


def test_fastapi_root_path_skips_token_id_check(monkeypatch):
    """Same root path, no tenant header needed: the out-of-vocabulary id check (which guards the
    scheduler from a crash, http.py ID_PATHS) is skipped."""
    from sglang_tiered.integration import http

    monkeypatch.setattr(http, "_vocab", [128])
    status, _ = _call(_tenant_app(), "/generate", {"input_ids": [1, 10**6]}, {"x-tenant-id": "alice"},
                      root_path="/sglang")  # fmt: skip
    assert status == 400, f"status {status}: input_ids with id 10**6 passed the middleware"


def _server_args(**kw):
    base = dict(tp_size=1, pp_size=1, dp_size=1, radix_eviction_policy="lru", enable_hierarchical_cache=False,
                enable_streaming_session=False, tokenizer_worker_num=1, speculative_algorithm=None,
                grpc_port=None, smg_grpc_mode=False, grpc_mode=False, fastapi_root_path="")  # fmt: skip
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("override", [{"grpc_port": 50051}, {"smg_grpc_mode": True}, {"grpc_mode": True}])
def test_tenant_header_with_args_that_bypass_the_middleware_is_refused(override):
    """``check_server_args`` refuses a tenant header with ``--tokenizer-worker-num > 1`` (its
    workers lack the middleware) but accepts the other SGLang arguments under which requests
    reach the scheduler without it: ``--grpc-port`` (native gRPC server beside HTTP, whose
    GenerateRequest carries no cache_salt: every caller lands in one namespace, ids unchecked),
    ``--smg-grpc-mode`` (no HTTP server: install() never runs), ``--fastapi-root-path`` (above)."""
    from sglang_tiered.config import ConfigError, check_server_args, load_config

    cfg = load_config({"SGLANG_TIERED_TENANT_HEADER": "x-tenant-id"})
    check_server_args(cfg, _server_args(tokenizer_worker_num=1))  # control: passes
    check_server_args(cfg, _server_args(fastapi_root_path="/sglang"))  # (the middleware strips it now)
    with pytest.raises(ConfigError):
        check_server_args(cfg, _server_args(**override))


def test_client_policy_constructor_accepts_nan_threshold():
    """The env knobs refuse a non-finite threshold (client.py ``_env_num``), the constructor takes
    one without a word and the signal then never fires: a 40k-token system prompt is judged a
    one-off and gets skip_save."""
    from sglang_tiered.client import KVCacheLayeringPolicy

    try:
        p = KVCacheLayeringPolicy(min_prefix_tokens=math.nan, min_context_tokens=math.nan)
    except ValueError:
        return  # fail-fast: fine
    d = p.decide(system_prompt="x" * 160_000, user_prompt="q")
    assert d.cache_worthy, f"160k-char system prompt judged not cache-worthy: {d.reasons}"


def test_client_policy_counts_openai_sdk_messages_by_repr():
    """The usual OpenAI loop appends ``resp.choices[0].message`` (a pydantic
    ``ChatCompletionMessage``) to the history. client.py ``_text_of`` falls back to ``str(message)``
    for anything that is not a str or Mapping, so a 2-character reply counts as its 134-character
    repr; ``_prior_turns`` sees no roles on such objects and counts every one as a user turn."""
    from openai.types.chat import ChatCompletionMessage

    from sglang_tiered.client import KVCacheLayeringPolicy

    reply = ChatCompletionMessage(role="assistant", content="ok")
    p = KVCacheLayeringPolicy(min_history_turns=1000)
    d = p.decide(system_prompt="be brief", user_prompt="next?", message_history=[reply] * 64)
    # the content is 64 * 2 chars = 32 tokens at 4 chars a token, far below 2048
    assert d.signals["context_tokens"] < 100 and not d.signals["large_context"], d.signals
    assert d.signals["history_turns"] == 0, d.signals


def test_a_tenants_invalidation_cannot_name_a_generation_far_ahead():
    """A tenant confined by the tenant header could pass ``generation`` with its own invalidation
    (up to 2^62-1). T2 keeps it and raises the next ``{"all": true}`` above it (t2.py
    ``invalidate``): after the router broadcast one all-invalidation with one clock value, the
    server where the tenant did this keyed every tenant's pages under another generation than its
    peers (no T2 page shared with it any more, and the floor saved to the generations file).
    Now a tenant's call may name one at most ``GENERATION_AHEAD_NS`` ahead of the clock (the
    router's broadcast sends its own clock's); the operator's call is not limited."""
    import time

    from sglang_tiered.integration.http import GENERATION_AHEAD_NS, confined_invalidation_refused, parse_invalidate

    far = parse_invalidate(b'{"tenant": "alice", "generation": 4611686018427387903}')
    assert confined_invalidation_refused(far, "alice")[0] == 400
    assert confined_invalidation_refused(far, None) is None
    now = parse_invalidate(json.dumps({"tenant": "alice", "generation": time.time_ns() + GENERATION_AHEAD_NS // 2}).encode())
    assert confined_invalidation_refused(now, "alice") is None
    assert confined_invalidation_refused(parse_invalidate(b'{"tenant": "alice"}'), "alice") is None
    assert confined_invalidation_refused(parse_invalidate(b'{"tenant": "bob"}'), "alice")[0] == 403
    assert confined_invalidation_refused(parse_invalidate(b'{"all": true}'), "alice")[0] == 403


def test_tenant_named_like_another_tenants_label_shares_its_stats_row():
    """Raw labels (the default with a tenant header): a tenant name over 64 characters (or not
    printable ASCII) is shown as ``<32-char head>~<16 hex>`` (core/tenants.py tenant_label), but a
    name that already *is* such a string is shown as itself: the two tenants share one stats row,
    and the second one's confined /cache/stats (aggregate with tenant=own) returns the first one's
    counters."""
    from sglang_tiered.core.tenants import TenantTable, tenant_label
    from sglang_tiered.stats import aggregate

    victim = "victim-organisation-with-a-long-name-" + "x" * 40
    mimic = tenant_label(victim)  # 49 printable ASCII characters: a valid header value
    table = TenantTable(hashed=False)
    table.for_salt(victim).requests += 7
    rank = {"tenants": {k: v.as_dict() for k, v in table.by_name.items()}, "page_size": 16}
    seen = aggregate([rank], tenant=mimic, hashed=False).tenants[mimic]
    assert seen.requests == 0, f"tenant {mimic!r} (never sent a request) sees {seen.requests} requests of {victim[:20]}..."


def test_a_standard_header_is_not_a_tenant_header():
    """``authorization`` as the tenant header printed API keys as tenant names in stats and
    /metrics; ``host`` or ``cookie`` mean something else to every hop."""
    from sglang_tiered.config import ConfigError, load_config

    for name in ("authorization", "Authorization", "host", "cookie", "x-api-key", "content-type"):
        with pytest.raises(ConfigError, match="standard HTTP header"):
            load_config({"SGLANG_TIERED_TENANT_HEADER": name})
    assert load_config({"SGLANG_TIERED_TENANT_HEADER": "x-tenant-id"}).tenant_header == "x-tenant-id"


def test_route_path_is_starlettes():
    from starlette.routing import get_route_path

    from sglang_tiered.integration.http import route_path

    for path, root in (("/generate", ""), ("/sglang/generate", "/sglang"), ("/sglang", "/sglang"),
                       ("/sglangx/generate", "/sglang"), ("/other/generate", "/sglang")):  # fmt: skip
        scope = {"path": path, "root_path": root}
        assert route_path(scope) == get_route_path(scope), scope


def test_server_info_answers_lose_the_cache_stats_and_nothing_else():
    from sglang_tiered.integration.http import _without_cache_stats
    from sglang_tiered.integration.protocol import STATE_KEY

    def run(chunks, headers=((b"content-type", b"application/json"),)):
        out = []

        async def send(msg):
            out.append(msg)

        async def main():
            wrapped = _without_cache_stats(send)
            await wrapped({"type": "http.response.start", "status": 200, "headers": list(headers)})
            for i, c in enumerate(chunks):
                await wrapped({"type": "http.response.body", "body": c, "more_body": i < len(chunks) - 1})

        asyncio.run(main())
        return out

    doc = {"internal_states": [{"x": 1, STATE_KEY: {"tenants": {"bob": {}}}}, {"y": 2}], "version": "v"}
    raw = json.dumps(doc).encode()
    out = run([raw[:10], raw[10:]])
    body = b"".join(m.get("body", b"") for m in out[1:])
    assert json.loads(body) == {"internal_states": [{"x": 1}, {"y": 2}], "version": "v"}
    assert dict(out[0]["headers"])[b"content-length"] == str(len(body)).encode()
    plain = json.dumps({"internal_states": [{"x": 1}]}).encode()  # nothing of ours: passed as it came
    out = run([plain])
    assert out[1]["body"] == plain and b"content-length" not in dict(out[0]["headers"])


def test_the_realtime_websocket_is_closed_in_tenant_mode():
    """SGLang's /v1/realtime (a websocket to the scheduler, no ``cache_salt``) went past the
    middleware, which looked at HTTP requests only: in tenant mode every tenant shared one
    namespace there. It is now closed before it is accepted; other websockets, and every
    websocket without a tenant header, pass."""
    from sglang_tiered.integration.http import HintMiddleware

    def run(mw, path):
        reached, sent = [], []

        async def app(scope, receive, send):
            reached.append(scope["path"])

        async def receive():
            return {"type": "websocket.connect"}

        async def send(msg):
            sent.append(msg)

        asyncio.run(HintMiddleware(app, tenant_header=mw)(
            {"type": "websocket", "path": path, "root_path": "", "headers": []}, receive, send))
        return reached, sent

    reached, sent = run("x-tenant-id", "/v1/realtime")
    assert not reached and sent[0]["type"] == "websocket.close" and sent[0]["code"] == 1008
    assert run("x-tenant-id", "/other")[0] == ["/other"]
    assert run(None, "/v1/realtime")[0] == ["/v1/realtime"]
