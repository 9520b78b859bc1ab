"""A review of session 41's merged change (its seven helpers' work together): the defects it
introduced, each with a test that fails on the merged code.

1. The router cut a stream by its own silence alone (``Router._check``: no byte since the worker's
   health checks began to miss), so a worker alive and answering /health with a 503 (SGLang's
   answer while it drains for a graceful shutdown, finishing the requests in flight) lost every
   stream still waiting for its first token to an error event. Now only a worker that answers
   nothing at all (``Router._silent``) has its silent streams cut.
2. A release/resume cycle of the weights on a server without ``--enable-memory-saver`` (SGLang's
   adapter is then a no-op: the weights never leave) was taken as a weight update: T1 dropped and
   the identity re-seeded to the server's own (``hooks._weights_released``).
"""

from __future__ import annotations

import asyncio
import types

import aiohttp
import pytest
from aiohttp import web

from sglang_tiered.fleet.router import Router
from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache
from tests.test_fleet_hardening import _serve
from tests.test_review41_router import _read_stream


def test_a_draining_worker_keeps_its_streams_that_wait_for_their_first_token():
    """The worker answers /health 503 (draining) once a stream has its headers, and sends the
    stream's events 1.2 s later (the request was queued, or in a long prefill), then ends it
    cleanly: the client gets the whole stream, uncut. Before: after ``health_misses`` 503s (0.3 s
    here) the router cut it, an error event in place of the answer the worker was computing."""

    async def main():
        state = {"draining": False}

        async def gen(req):
            await req.read()
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(req)
            state["draining"] = True
            await asyncio.sleep(1.2)
            await resp.write(b'data: {"text": "a"}\n\n')
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp

        async def health(_):
            return web.json_response({}, status=503 if state["draining"] else 200)

        app = web.Application()
        app.router.add_post("/generate", gen)
        app.router.add_get("/health", health)
        r0, u0 = await _serve(app, shutdown_timeout=1)
        router = Router([u0], None, load_poll_s=0, model_path="", health_interval_s=0.05)
        rr, url = await _serve(router.app(), shutdown_timeout=1)
        try:
            async with aiohttp.ClientSession() as s:
                _, got, cut = await asyncio.wait_for(_read_stream(s, url), 20)
            assert not cut and got == b'data: {"text": "a"}\n\ndata: [DONE]\n\n', (cut, got)
            assert router.workers[u0].missed >= router.health_misses  # (it was out of the routing set)
            assert router.stats.abandoned == 0 and router.stats.failed == 0
        finally:
            await rr.cleanup()
            await r0.cleanup()

    asyncio.run(main())


def test_silent_needs_no_answer_of_any_kind_since_the_first_miss():
    ws = types.SimpleNamespace(first_miss_at=10.0, heard_at=5.0, answered_at=5.0, streams={"t": 4.0})
    assert Router._silent(ws)
    for field, value in (("heard_at", 10.0), ("answered_at", 11.0)):
        assert not Router._silent(types.SimpleNamespace(**{**vars(ws), field: value}))
    assert not Router._silent(types.SimpleNamespace(**{**vars(ws), "streams": {"t": 4.0, "u": 12.0}}))


def _cycle(manager_extra: dict, sa_extra: dict, tags=None):
    from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput, ResumeMemoryOccupationReqInput

    from sglang_tiered.integration import hooks

    cache = TieredRadixCache.create_simulated(256, page_size=1, host_pages=256, verify_kv=True, debug_checks=True)
    sched = types.SimpleNamespace(tree_cache=cache,
                                  server_args=types.SimpleNamespace(enable_weights_cpu_backup=False, **sa_extra))
    manager = types.SimpleNamespace(scheduler=sched, **manager_extra)
    old = list(range(1, 41))
    cache.driver.run(old + [99])
    cache.persist_to_host()  # T1 holds the prompt
    seed = cache.hashes.seed(None, None)
    hooks._before_release_memory(manager, ReleaseMemoryOccupationReqInput(tags=tags))
    if not tags or "kv_cache" in tags:
        cache.reset()  # SGLang's flush at a release of the KV pool
    hooks._after_resume_memory(None, manager, ResumeMemoryOccupationReqInput(tags=tags))
    return cache, old, seed


@pytest.mark.parametrize("manager_extra, sa_extra", [
    ({"memory_saver_adapter": types.SimpleNamespace(enabled=False)}, {}),  # SGLang's no-op adapter
    ({}, {"enable_memory_saver": False}),
])  # fmt: skip
def test_a_resume_without_the_memory_saver_is_no_weight_update(manager_extra, sa_extra):
    """Without the memory saver nothing was released: the identity and T1 are kept (before: T1
    dropped, the seed the server's own, its fleet's T2 pages out of reach until a restart)."""
    cache, old, seed = _cycle(manager_extra, sa_extra)
    assert cache.hashes.seed(None, None) == seed and cache.weight_updates == 0
    assert cache.driver.run(old + [7]).cached_len == 40  # (from T1: the device tree was flushed)
    cache.check_invariants()


def test_a_resume_with_the_memory_saver_and_no_backup_is_still_a_weight_update():
    cache, old, seed = _cycle({"memory_saver_adapter": types.SimpleNamespace(enabled=True)}, {})
    assert cache.hashes.seed(None, None) != seed and cache.weight_updates == 1
    assert cache.driver.run(old + [7]).cached_len == 0


def test_a_stream_line_without_an_end_is_held_up_to_a_bound_then_goes_on():
    """A worker's event-stream line that never ends went nowhere and was held whole (without
    bound: the router's memory grew with it); past ``SSECut.HELD_MAX`` it goes on as it comes.
    Whole lines still go on at their end, the half line after them held."""
    from sglang_tiered.fleet.router import SSECut

    cut = SSECut()
    cut.on = True
    part = b"x" * (1 << 20)
    sent = [cut.lines(part) for _ in range(4)]
    assert sent == [b""] * 4  # (4 MiB: at the bound, held)
    out = cut.lines(part)
    assert len(out) == 5 << 20 and cut.held_bytes == 0  # (past it: all of it, at once)
    assert cut.lines(b'data: {"a"}\n\ndata: {"b') == b'data: {"a"}\n\n'
    assert cut.lines(b'"}\n\n') == b'data: {"b"}\n\n' and cut.rest() == b""
    assert cut.failed("x").startswith(b"data: ")  # (an ended event: no line end added)
    assert cut.lines(b"data: half") == b""  # (held: dropped if the worker fails now)
    assert cut.failed("x").startswith(b"data: ")
    assert len(cut.lines(b"z" * (5 << 20))) == (5 << 20) + 10  # (past the bound, sent half)
    # (the half line the client got is ended, and its event: session 42, the error is an event of its own)
    assert cut.failed("x").startswith(b"\n\ndata: ")


def test_an_event_in_many_parts_is_joined_once():
    """An event arriving in k parts is copied once when its end comes (before: ``held + chunk`` at
    each part, k copies of a growing buffer; SGLang's /generate stream repeats the whole text so
    far in each event)."""
    from sglang_tiered.fleet.router import SSECut

    cut = SSECut()
    cut.on = True
    parts = [b"data: " + b"y" * 1000] + [b"y" * 1000] * 98 + [b"y\n\n"]
    outs = [cut.lines(p) for p in parts]
    assert outs[:-1] == [b""] * 99 and outs[-1] == b"".join(parts)
    assert isinstance(cut.held, list) and cut.held_bytes == 0


def _decoded_per_step(t, pages, start, n, steps, page):
    """``TreeShadow._decoded`` as merged (one visit per decoded token): the reference."""
    t.clock += 1
    path: list = []
    matched = t._walk(pages[:start], t.clock, path)
    last = path[-1] if path else t.root
    t._set_lock(last, 1)
    held = int(n % page > 0)
    for pos in range(n, n + steps):
        free = t.cap - t.used - held
        if free < 1:
            t._evict(1 - free)
        if pos % page == 0:
            held += 1
    if matched == start:
        t._insert(pages, start, path, last, matched, True)
    t._set_lock(last, -1)
    return 0


@pytest.mark.parametrize("seed", range(6))
def test_the_decode_replay_by_pages_leaves_the_per_token_loops_trees(seed):
    """The decode replay visits the first step, each page boundary and the step after it (a
    release costs its pages, not its tokens: a performance change, session 41); the trees it
    leaves are the per-token loop's, on random prompts, shared heads and decodes that fit."""
    import random

    from sglang_tiered.core.shadows import TreeShadow, TreeShadowPy

    rng = random.Random(seed)
    a = TreeShadow(rng.randint(12, 40))  # (the C one where built: its decode replay against the per-token loop)
    b = TreeShadowPy(a.cap)  # (the per-token loop steps the reference's internals)
    for i in range(300):
        page = rng.choice((1, 2, 4, 16))
        pre = rng.randint(0, 3)
        n = pre * page + rng.randint(0, page * 6)
        prompt = [("p", j) if j < pre else ("u", i, j) for j in range(n // page)]  # (a shared head)
        for t in (a, b):
            t.run(prompt, int(n % page > 0), 0, None, int(page > 1))
        # (a request SGLang holds fits its pool: prompt, decoded pages and a partial one)
        steps = rng.randint(0, max(0, min(page * 12, (a.cap - 1) * page - n)))
        pages = prompt + [("d", i, j) for j in range(len(prompt), (n + steps) // page)]
        if rng.random() < 0.5:
            a.run(pages, 0, len(prompt), None, 0, (n, steps, page))
            _decoded_per_step(b, pages, len(prompt), n, steps, page)
        for t in (a, b):
            t.check()
        assert a.pages() == b.pages() and a.used == b.used and a.clock == b.clock, i
