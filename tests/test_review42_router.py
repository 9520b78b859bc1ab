"""The fleet router's leftovers of session 41 (review, session 42). Stub aiohttp workers on
127.0.0.1, the real Router app in front of them.

1. Streams on ``/v1/messages`` (Anthropic) and ``/v1/responses`` (OpenAI Responses) go through
   ``passthrough``, which had neither ``SSECut`` nor the mid-stream stall check: a worker that
   died mid-stream left the client a half event and a transfer error, nothing said, and one that
   froze mid-stream left it waiting for good. Now they end as SGLang's own handlers end a failed
   stream, in the API's own events (Anthropic: ``content_block_stop`` of the open block,
   ``event: error``, ``message_stop``; Responses: ``response.failed``).
2. A caller that left during a fleet-wide broadcast cancelled it: workers not yet answered never
   got the call, and one that failed it was not owed it. Now the broadcast runs to its end
   whatever the caller does (``Router._broadcast``), owing it as usual.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from sglang_tiered.fleet.router import Router
from tests.test_fleet_hardening import _down, _serve, _serve_on
from tests.test_fleet_owed import _until
from tests.test_review41_router import _cleanup, _read_stream

# ---------------------------------------------------------------------- 1. the APIs' own error events
ANTHROPIC_HEAD = [
    ("message_start", {"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant",
                                                             "content": [], "model": "m"}}),
    ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
    # (a text that names an event line: only real event lines count)
    ("content_block_delta", {"type": "content_block_delta", "index": 0,
                             "delta": {"type": "text_delta", "text": "a\nevent: content_block_stop\n"}}),
]  # fmt: skip
RESPONSES_HEAD = [
    ("response.created", {"type": "response.created", "sequence_number": 0,
                          "response": {"id": "resp_42", "object": "response", "created_at": 1, "model": "m",
                                       "status": "in_progress", "output": []}}),
    ("response.in_progress", {"type": "response.in_progress", "sequence_number": 1,
                              "response": {"id": "resp_42", "object": "response", "created_at": 1, "model": "m",
                                           "status": "in_progress", "output": []}}),
    ("response.output_text.delta", {"type": "response.output_text.delta", "sequence_number": 2, "item_id": "msg_1",
                                    "output_index": 0, "content_index": 0, "delta": "ab", "logprobs": []}),
]  # fmt: skip


def _sse(name: str, doc: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(doc)}\n\n".encode()


def _api_worker(name: str, hits: list, how: str):
    """A stub worker streaming /v1/messages and /v1/responses as SGLang does (``event:`` and
    ``data:`` lines): the first events, then half of one more; ``how``: ``kill`` (its connection
    aborted, as a killed process's is) or ``freeze`` (it stops answering anything, /health too)."""
    app = web.Application()
    frozen = asyncio.Event()

    async def stream(req):
        await req.read()
        hits.append(name)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(req)
        for ev, doc in ANTHROPIC_HEAD if req.path == "/v1/messages" else RESPONSES_HEAD:
            await resp.write(_sse(ev, doc))
        await resp.write(b"event: content_block_delta\ndata: {\"type\": \"content_blo")
        if how == "freeze":
            frozen.set()
            await asyncio.Event().wait()
        await asyncio.sleep(0.05)
        req.transport.abort()
        await asyncio.sleep(1)
        return resp

    async def health(_):
        if frozen.is_set():
            await asyncio.Event().wait()
        return web.json_response({})

    app.router.add_post("/v1/messages", stream)
    app.router.add_post("/v1/responses", stream)
    app.router.add_get("/health", health)
    return app


def _events(got: bytes) -> list:
    """(event name, data doc) of each whole event the client got."""
    out = []
    for block in got.decode().split("\n\n"):
        if not block.strip():
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines.get("event"), json.loads(lines["data"])))
    return out


def _through_router(path: str, how: str) -> tuple[list, bool, list, Router, tuple]:
    """One stream on ``path`` through the router to two such workers: (events, cut, hits, router, urls)."""

    async def main():
        hits: list = []
        r0, u0 = await _serve(_api_worker("w0", hits, how), shutdown_timeout=1)
        r1, u1 = await _serve(_api_worker("w1", hits, how), shutdown_timeout=1)
        router = Router([u0, u1], None, load_poll_s=0, model_path="", health_interval_s=0.1)
        rr, url = await _serve(router.app(), shutdown_timeout=1)
        try:
            async with aiohttp.ClientSession() as s:
                body = {"model": "m", "stream": True, "max_tokens": 4, "input": "x",
                        "messages": [{"role": "user", "content": "x"}]}  # fmt: skip
                status, got, cut = await asyncio.wait_for(_read_stream(s, url, path, body), 20)
            assert status == 200
            return _events(got), cut, hits, router, (u0, u1)
        finally:
            await _cleanup(rr, r0, r1)

    return asyncio.run(main())


def _names_the_worker(message: str, hits: list, urls: tuple) -> bool:
    return [n for n, u in zip(("w0", "w1"), urls) if u in message] == hits


def test_an_anthropic_stream_whose_worker_dies_ends_with_the_apis_error_event():
    """/v1/messages, the worker killed mid-stream: the client has the whole events, then what
    SGLang's handler writes on a failed stream (``_flush_on_error``): the open block's
    ``content_block_stop``, ``event: error`` (``{"type": "error", "error": {"type": "api_error",
    "message": ...}}``, naming the worker) and ``message_stop``; cut without a clean end, no retry.
    Before: the half event, then a transfer error."""
    events, cut, hits, router, urls = _through_router("/v1/messages", "kill")
    assert cut and len(hits) == 1, (cut, hits)
    assert events[:3] == ANTHROPIC_HEAD, events
    assert [e for e, _ in events[3:]] == ["content_block_stop", "error", "message_stop"], events
    assert events[3][1] == {"type": "content_block_stop", "index": 0}
    err = events[4][1]
    assert set(err) == {"type", "error"} and err["type"] == "error" and err["error"]["type"] == "api_error", err
    assert "mid-stream" in err["error"]["message"] and _names_the_worker(err["error"]["message"], hits, urls), err
    assert events[5][1] == {"type": "message_stop"}
    assert router.stats.failed == 1 and router.stats.retries == 0


def test_a_responses_stream_whose_worker_dies_ends_with_response_failed():
    """/v1/responses, the worker killed mid-stream: the client has the whole events, then
    ``response.failed`` (as SGLang's handler writes it): numbered after the last event, the
    stream's response (its id) with status ``failed``, no output, and the error naming the worker."""
    events, cut, hits, router, urls = _through_router("/v1/responses", "kill")
    assert cut and len(hits) == 1, (cut, hits)
    assert events[:3] == RESPONSES_HEAD, events
    assert len(events) == 4 and events[3][0] == "response.failed", events
    doc = events[3][1]
    assert doc["type"] == "response.failed" and doc["sequence_number"] == 3, doc
    r = doc["response"]
    assert r["id"] == "resp_42" and r["status"] == "failed" and r["output"] == [] and r["model"] == "m", r
    assert r["error"]["code"] == "server_error" and _names_the_worker(r["error"]["message"], hits, urls), r
    assert router.stats.failed == 1 and router.stats.retries == 0


def test_an_anthropic_stream_whose_worker_freezes_ends_once_its_health_checks_miss():
    """/v1/messages, the worker stops answering altogether mid-stream: once its health checks
    miss, the stream ends with the API's error events (as ``handle``'s streams do since session
    41). Before: the client waited for good (this test's 20 s bound)."""
    events, cut, hits, router, urls = _through_router("/v1/messages", "freeze")
    assert cut and len(hits) == 1, (cut, hits)
    assert [e for e, _ in events] == [e for e, _ in ANTHROPIC_HEAD] + ["content_block_stop", "error", "message_stop"]
    msg = events[4][1]["error"]["message"]
    assert "stopped answering mid-stream" in msg and _names_the_worker(msg, hits, urls), msg
    assert router.stats.abandoned == 1 and router.stats.failed == 1


def test_a_responses_stream_read_by_the_openai_sdk_ends_with_a_failed_event():
    """The OpenAI SDK reading /v1/responses through the router from a worker that dies mid-stream
    sees the events, then a ``response.failed`` event whose response carries the error, and then
    the transfer error of the cut connection (before: that error alone, after the half event)."""
    import openai

    async def main():
        hits: list = []
        r0, u0 = await _serve(_api_worker("w0", hits, "kill"), shutdown_timeout=1)
        router = Router([u0], None, load_poll_s=0, model_path="", health_interval_s=0.1)
        rr, url = await _serve(router.app(), shutdown_timeout=1)
        try:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            seen, cut = [], None
            stream = await client.responses.create(model="m", input="x", stream=True)
            try:
                async for ev in stream:
                    seen.append(ev)
            except Exception as exc:  # noqa: BLE001 - the connection's end, cut (as handle's streams)
                cut = exc
            await client.close()
            return seen, cut
        finally:
            await _cleanup(rr, r0)

    seen, cut = asyncio.run(main())
    assert cut is not None and "incomplete" in str(cut), cut
    assert [e.type for e in seen] == [e for e, _ in RESPONSES_HEAD] + ["response.failed"], seen
    assert seen[-1].response.status == "failed" and "mid-stream" in seen[-1].response.error.message


def test_a_stream_that_ends_cleanly_passes_through_unchanged():
    """A whole /v1/messages stream (its last event ends it) reaches the client byte for byte."""
    body = b"".join(_sse(e, d) for e, d in ANTHROPIC_HEAD) + _sse("message_stop", {"type": "message_stop"})

    async def main():
        app = web.Application()

        async def stream(req):
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(req)
            for i in range(0, len(body), 7):  # (in odd pieces)
                await resp.write(body[i : i + 7])
            await resp.write_eof()
            return resp

        app.router.add_post("/v1/messages", stream)
        app.router.add_get("/health", lambda _: web.json_response({}))
        r0, u0 = await _serve(app)
        router = Router([u0], None, load_poll_s=0, model_path="")
        rr, url = await _serve(router.app())
        try:
            async with aiohttp.ClientSession() as s:
                return await _read_stream(s, url, "/v1/messages", {"stream": True})
        finally:
            await _cleanup(rr, r0)

    status, got, cut = asyncio.run(main())
    assert status == 200 and got == body and not cut


# ---------------------------------------------------------------------- 2. a caller that leaves a broadcast
def _flusher(name: str, log: list, delay: float = 0.0):
    """A stub worker whose /flush_cache answers after ``delay`` s (logged when it is done)."""
    app = web.Application()

    async def flush(req):
        await req.read()
        await asyncio.sleep(delay)
        log.append((name, req.path))
        return web.json_response({"success": True})

    app.router.add_post("/flush_cache", flush)
    app.router.add_get("/health", lambda _: web.json_response({}))
    return app


def test_a_caller_that_leaves_a_flush_midway_leaves_it_owed_to_a_worker_that_missed_it():
    """/flush_cache with w0 slow to answer (0.6 s) and w1 down; the caller gives up after 0.15 s
    (the router cancels a leaving client's handler, as ``serve`` runs it). The broadcast still runs
    to its end: w1 is owed the flush and gets it once it is back. Before: the caller's leaving
    cancelled the broadcast, w1 was never owed it, and came back with its cache unflushed while w0
    had flushed."""

    async def main():
        log: list = []
        r0, u0 = await _serve(_flusher("w0", log, delay=0.6))
        port1, u1 = await _down(_flusher("w1", log))
        router = Router([u0, u1], None, load_poll_s=0, model_path="", health_interval_s=0.1)
        rr, url = await _serve(router.app(), handler_cancellation=True)
        r1 = None
        try:
            async with aiohttp.ClientSession() as s:
                try:
                    async with s.post(url + "/flush_cache", timeout=aiohttp.ClientTimeout(total=0.15)) as r:
                        await r.read()
                    raise AssertionError("the flush answered within 0.15 s")
                except asyncio.TimeoutError:
                    pass  # (the caller left)
            await _until(lambda: ("w0", "/flush_cache") in log, 5)
            await _until(lambda: router.workers[u1].owed, 5)
            assert not router.workers[u1].healthy
            r1 = await _serve_on(_flusher("w1", log), port1)
            await _until(lambda: ("w1", "/flush_cache") in log, 10)
            await _until(lambda: router.workers[u1].healthy, 10)
            assert not router._broadcasts
        finally:
            await _cleanup(rr, r0, r1)

    asyncio.run(main())


def test_a_stream_whose_last_event_went_out_gets_no_error_event():
    """``SSECut.failed`` after the API's last event (``message_stop``; ``response.completed``):
    nothing more (the client has the whole answer; an error after it would make the SDKs raise)."""
    from types import SimpleNamespace

    from sglang_tiered.fleet.router import SSECut

    up = SimpleNamespace(headers={"content-type": "text/event-stream"})
    for api, events, last in (("anthropic", ANTHROPIC_HEAD, ("message_stop", {"type": "message_stop"})),
                              ("responses", RESPONSES_HEAD, ("response.completed", {"type": "response.completed",
                                                                                    "sequence_number": 3}))):  # fmt: skip
        cut = SSECut(api)
        cut.start(up)
        assert cut.lines(b"".join(_sse(e, d) for e, d in events)) and cut.failed("x")  # (not ended: an error)
        cut.lines(_sse(*last))
        assert cut.failed("x") == b"", api


def _parse_sse(data: bytes) -> list:
    """The events an SSE client reads from ``data`` (WHATWG: a blank line dispatches; ``data:``
    lines join with newlines; an event without data is not dispatched): (name, data) pairs."""
    events, name, buf = [], "message", None
    for line in data.replace(b"\r\n", b"\n").split(b"\n"):
        if not line:
            if buf is not None:
                events.append((name, "\n".join(buf)))
            name, buf = "message", None
            continue
        field, _, value = line.decode("utf-8", "replace").partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "event":
            name = value
        elif field == "data":
            buf = (buf or []) + [value]
    return events


def test_the_error_event_after_a_big_event_cut_mid_line_is_an_event_of_its_own():
    """An event past ``SSECut.HELD_MAX`` goes to the client in parts as it comes; when its worker
    fails mid-line, the error events must still reach the client as events of their own (the
    half event ended first: a line end, then a blank line). Before, one line end alone: the
    client's parser took the error event's ``event:`` and ``data:`` lines as more of the half
    event (its name replaced, its data the half JSON joined with the error's), so no SDK saw
    the error (Anthropic, Responses, and SGLang's ``data:`` streams alike)."""
    from types import SimpleNamespace

    from sglang_tiered.fleet.router import SSECut

    up = SimpleNamespace(headers={"content-type": "text/event-stream"})
    big = b"x" * (SSECut.HELD_MAX + 10)
    for api, head, part, want in (
            ("anthropic", b"".join(_sse(e, d) for e, d in ANTHROPIC_HEAD),
             b'event: content_block_delta\ndata: {"type": "content_block_delta", "delta": {"text": "' + big,
             "error"),
            ("responses", b"".join(_sse(e, d) for e, d in RESPONSES_HEAD),
             b'event: response.output_text.delta\ndata: {"delta": "' + big, "response.failed"),
            ("openai", b'data: {"text": "a"}\n\n', b'data: {"text": "' + big, "message")):  # fmt: skip
        cut = SSECut(api)
        cut.start(up)
        sent = cut.lines(head)
        sent += cut.lines(part[: len(part) // 2]) + cut.lines(part[len(part) // 2 :])
        assert len(sent) > SSECut.HELD_MAX  # (the big event went out in part)
        sent += cut.failed("worker w failed mid-stream")
        events = _parse_sse(sent)
        errors = [(n, d) for n, d in events if "worker w failed mid-stream" in d]
        assert len(errors) == 1, (api, [(n, d[:80]) for n, d in events[-3:]])
        name, data = errors[0]
        assert name == want and json.loads(data), (api, name, data[:200])
