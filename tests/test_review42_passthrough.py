"""The fleet router's Anthropic (``/v1/messages``) and OpenAI Responses (``/v1/responses``) routes
get ``handle``'s robustness and routing (review, session 42). Stub aiohttp workers on 127.0.0.1,
the real Router app in front of them.

Before, they went through ``passthrough`` (least busy worker, no cache routing):
1. a worker whose connection closed before it answered failed the request (``handle`` sends it
   once more, on a new connection, then to another worker);
2. a worker frozen before its headers held the client for good (``handle``'s requests waiting on
   a worker that stops answering go to another one: ``Router._abandon``);
3. no tenant affinity, no cache locality: an operator on these APIs got none of the fleet cache.
Other pass-through routes (``/v1/models``, ...) keep ``passthrough``, which now also gives up on a
worker frozen before its headers and tries another (4).
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from sglang_tiered.fleet.router import Router
from tests.test_fleet_hardening import _serve
from tests.test_review41_router import _read_stream

APIS = ("/v1/messages", "/v1/responses")
ANTHROPIC_BODY = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
RESPONSES_BODY = {"model": "m", "input": "x"}


def _body(path: str, **kw) -> dict:
    return {**(ANTHROPIC_BODY if path == "/v1/messages" else RESPONSES_BODY), **kw}


def _worker(name: str, hits: list, how: str = "ok"):
    """A stub worker answering /v1/messages, /v1/responses and /v1/models with its name. ``how``:
    ``ok``; ``close`` (it reads the request, then closes the connection without answering, as a
    process killed mid-request does); ``freeze`` (it reads the request, then answers nothing
    more, /health too)."""
    app = web.Application()
    frozen = asyncio.Event()

    async def answer(req):
        await req.read()
        hits.append((name, req.path))
        if how == "close":
            req.transport.close()
            await asyncio.sleep(1)
        if how == "freeze":
            frozen.set()
            await asyncio.Event().wait()
        return web.json_response({"worker": name})

    async def health(_):
        if frozen.is_set():
            await asyncio.Event().wait()
        return web.json_response({})

    for p in APIS:
        app.router.add_post(p, answer)
    app.router.add_get("/v1/models", answer)
    app.router.add_get("/health", health)
    return app


async def _fleet(*apps, **kw):
    runners, urls = [], []
    for a in apps:
        r, u = await _serve(a, shutdown_timeout=1)
        runners.append(r)
        urls.append(u)
    router = Router(urls, None, load_poll_s=0, model_path="", **kw)
    rr, url = await _serve(router.app(), shutdown_timeout=1)
    runners.insert(0, rr)
    return router, url, urls, runners


def _request_each(path: str, method: str, how: str, **kw):
    """One request on ``path`` through the router to a ``how`` worker and a good one, each in
    turn the first choice: [(status, answer, hits)], the router."""

    async def main():
        out = []
        for bad_first in (True, False):
            hits: list = []
            apps = [_worker("bad", hits, how), _worker("good", hits)]
            router, url, urls, runners = await _fleet(*(apps if bad_first else apps[::-1]), **kw)
            try:
                async with aiohttp.ClientSession() as s:
                    # (the bad worker first: the good one looks busier)
                    router.workers[urls[1 if bad_first else 0]].inflight += 1
                    body = _body(path) if method == "POST" else None
                    coro = s.request(method, url + path, json=body)
                    async with await asyncio.wait_for(coro, 15) as resp:
                        out.append((resp.status, await resp.json(content_type=None), hits, router))
            finally:
                for r in runners:
                    await r.cleanup()
        return out

    return asyncio.run(main())


def test_a_worker_that_closes_before_answering_is_retried_elsewhere_on_both_apis():
    """The worker reads the request and closes the connection with no answer: the request goes
    to the other worker, and the client gets its answer. Before: a 502 (``passthrough`` tried
    another worker only when no connection could be made)."""
    for path in APIS:
        for status, answer, hits, router in _request_each(path, "POST", "close"):
            assert status == 200 and answer == {"worker": "good"}, (path, status, answer, hits)
            assert ("bad", path) in hits and router.stats.retries >= 1, (path, hits)


def test_a_worker_frozen_before_its_headers_is_given_up_and_retried_elsewhere_on_both_apis():
    """The worker reads the request and then answers nothing (no headers, no /health): once its
    health checks miss, the request goes to the other worker. Before: the client waited for good
    (this test's 15 s bound)."""
    for path in APIS:
        for status, answer, hits, router in _request_each(path, "POST", "freeze", health_interval_s=0.1):
            assert status == 200 and answer == {"worker": "good"}, (path, status, answer, hits)
            assert hits[0] == ("bad", path) and router.stats.abandoned == 1, (path, hits)


def test_another_pass_through_route_frozen_before_its_headers_is_retried_elsewhere():
    """``/v1/models`` (``passthrough``) on a worker frozen before its headers: once its health
    checks miss, another worker answers. Before: the client waited for good."""
    for status, answer, hits, router in _request_each("/v1/models", "GET", "freeze", health_interval_s=0.1):
        assert status == 200 and answer == {"worker": "good"}, (status, answer, hits)
        assert hits[0] == ("bad", "/v1/models") and router.stats.abandoned == 1, hits


def test_a_stream_on_both_apis_passes_through_byte_for_byte():
    """Through ``handle`` now, a whole stream still reaches the client unchanged, and a worker
    that dies mid-stream still ends it in its API's events (tests/test_review42_router.py)."""
    body = b"event: message_start\ndata: {}\n\nevent: message_stop\ndata: {}\n\n"

    async def main():
        app = web.Application()

        async def stream(req):
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(req)
            for i in range(0, len(body), 5):
                await resp.write(body[i : i + 5])
            await resp.write_eof()
            return resp

        for p in APIS:
            app.router.add_post(p, stream)
        app.router.add_get("/health", lambda _: web.json_response({}))
        router, url, _, runners = await _fleet(app)
        try:
            async with aiohttp.ClientSession() as s:
                return [await _read_stream(s, url, p, _body(p, stream=True)) for p in APIS]
        finally:
            for r in runners:
                await r.cleanup()

    for status, got, cut in asyncio.run(main()):
        assert status == 200 and got == body and not cut


# ---------------------------------------------------------------------- 3. routed by the prompt's tokens
SYSTEM, Q, A, Q2 = "You answer briefly.", "What is a page?", "A run of tokens.", "And a tier?"
# (the chat request SGLang 0.5.23's handlers build from the Anthropic and Responses bodies below)
CHAT = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": Q},
                     {"role": "assistant", "content": A}, {"role": "user", "content": Q2}]}  # fmt: skip
ANTHROPIC = {"model": "m", "max_tokens": 8, "system": [{"type": "text", "text": SYSTEM}],
             "messages": [{"role": "user", "content": Q},
                          {"role": "assistant", "content": [{"type": "text", "text": A}]},
                          {"role": "user", "content": Q2}]}  # fmt: skip
RESPONSES = {"model": "m", "instructions": SYSTEM,
             "input": [{"role": "user", "content": Q}, {"type": "message", "role": "assistant", "content": A},
                       {"role": "user", "content": Q2}]}  # fmt: skip


def _tokenizing_router(tiny_model_path, urls=("http://127.0.0.1:9",)) -> Router:
    from transformers import AutoTokenizer

    router = Router(list(urls), None, load_poll_s=0, model_path="")
    router.tokenizer = AutoTokenizer.from_pretrained(tiny_model_path, local_files_only=True)
    return router


def test_anthropic_and_responses_prompts_are_the_chat_prompt_the_worker_renders(tiny_model_path):
    """The router's tokens of an Anthropic or Responses request are those of the chat request
    SGLang's handler converts it to, through the served model's chat template (before: none, so
    no cache locality for these APIs)."""
    router = _tokenizing_router(tiny_model_path)
    want = router.tokens_of("/v1/chat/completions", CHAT)
    assert want
    assert router.tokens_of("/v1/messages", ANTHROPIC) == want
    assert router.tokens_of("/v1/messages", {**ANTHROPIC, "system": SYSTEM}) == want
    assert router.tokens_of("/v1/responses", RESPONSES) == want
    one = router.tokens_of("/v1/chat/completions", {"messages": [{"role": "user", "content": Q}]})
    assert router.tokens_of("/v1/responses", {"model": "m", "input": Q}) == one


def test_what_the_router_cannot_render_as_the_worker_routes_by_tenant_and_load(tiny_model_path):
    """Tools, thinking, images, tool results, a Responses ``previous_response_id`` (its history
    lives in the worker that answered it), ...: no tokens (tenant affinity and load), never a
    guess at a prompt the worker renders otherwise."""
    router = _tokenizing_router(tiny_model_path)
    tool = {"name": "f", "description": "", "input_schema": {"type": "object"}}
    for body in ({**ANTHROPIC, "tools": [tool]}, {**ANTHROPIC, "thinking": {"type": "enabled", "budget_tokens": 2048}},
                 {**ANTHROPIC, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                 {**ANTHROPIC, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]},
                 {**ANTHROPIC, "messages": [{"role": "system", "content": "inline"}]}):  # fmt: skip
        assert router.tokens_of("/v1/messages", body) == [], body
    for body in ({**RESPONSES, "previous_response_id": "resp_1"}, {**RESPONSES, "tools": [{"type": "function"}]},
                 {**RESPONSES, "reasoning": {"effort": "low"}}, {**RESPONSES, "input": [{"type": "function_call"}]},
                 {**RESPONSES, "input": [{"role": "developer", "content": "d"}]},
                 {**RESPONSES, "input": [{"role": "user", "content": [{"type": "input_image"}]}]}):  # fmt: skip
        assert router.tokens_of("/v1/responses", body) == [], body


def test_both_apis_are_routed_by_their_prompt_and_tenant(tiny_model_path):
    """Through the app: /v1/messages and /v1/responses are routing decisions with the prompt's
    tokens, as /v1/chat/completions is; the same conversation goes to the same worker, which holds
    its pages (the router's memory of what it sent where). The tenant: a Responses
    ``cache_salt``; none for /v1/messages, whose ``cache_salt`` SGLang's Anthropic request drops
    (its pages are in the default namespace). Before: no tokens, routed by load alone."""

    async def main():
        hits: list = []
        router, url, urls, runners = await _fleet(_worker("w0", hits), _worker("w1", hits))
        from transformers import AutoTokenizer

        router.tokenizer = AutoTokenizer.from_pretrained(tiny_model_path, local_files_only=True)
        try:
            async with aiohttp.ClientSession() as s:
                for path, body in (("/v1/messages", ANTHROPIC), ("/v1/responses", RESPONSES)) * 2:
                    async with s.post(url + path, json={**body, "cache_salt": "tenant-a"}) as resp:
                        assert resp.status == 200
            return list(router.decisions), hits
        finally:
            for r in runners:
                await r.cleanup()

    decisions, hits = asyncio.run(main())
    assert len(decisions) == 4 and all(d["tokens"] > 0 for d in decisions), decisions
    assert [bool(d["tenant"]) for d in decisions] == [False, True, False, True], decisions
    assert len({d["tokens"] for d in decisions}) == 1, decisions
    for api in (decisions[0::2], decisions[1::2]):  # (each API's conversation: its own namespace)
        assert api[0]["worker"] == api[1]["worker"] and api[1]["matched"] > 0, decisions
