"""Every tree of a server publishes its hints (session 40).

Under ``--enable-dp-attention`` each DP rank keeps a tree of its own (``build.tree_ranks``), and
under ``--dp-size`` without it each data-parallel replica does; before, only the global TP rank 0
attached a publisher, so the pages of DP rank 1's tree never reached the index (a router saw a
server holding none of them), and each replica's TP rank 0 published under the one server id,
so one replica's eviction (HDEL) or flush withdrew a page another still held. Now each tree's
first rank publishes, under a field of its own (``index.holder_field``), read as the server's."""

from __future__ import annotations

import random
import time
import types

import pytest

from tests.test_fleet import _redis_server


def test_each_dp_rank_of_dp_attention_publishes_its_tree(monkeypatch):
    """``--tp 2 --dp 2 --enable-dp-attention``: global TP rank 1 is DP rank 1's tree rank 0, and
    publishes (a field of its own); without DP attention TP rank 1 is not its tree's first."""
    import torch.distributed as dist

    from sglang_tiered.integration import build

    group = object()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda g=None: 0 if g is group else 1)
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: 1 if g is group else 2)
    ctx = types.SimpleNamespace(tp_rank=1, tp_size=2, params=types.SimpleNamespace(tp_cache_group=group))
    r, n = build.tree_ranks(ctx)
    assert build.hint_rank(ctx, r, n) == "dp0.1"
    ctx0 = types.SimpleNamespace(tp_rank=0, tp_size=2, params=types.SimpleNamespace())
    assert build.hint_rank(ctx0, *build.tree_ranks(ctx0)) == ""  # the server's first tree: its id alone
    ctx1 = types.SimpleNamespace(tp_rank=1, tp_size=2, params=types.SimpleNamespace())
    assert build.hint_rank(ctx1, *build.tree_ranks(ctx1)) is None  # plain TP: rank 0 publishes


def _until(pred, timeout=10.0):
    t = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < t, "timed out"
        time.sleep(0.02)


def test_two_trees_of_one_server_claim_apart_and_are_read_as_the_server():
    """DP rank 0 and DP rank 1 of one server publish to a real redis-server: a prompt only rank 1
    holds matches the server; rank 0 evicting (and then clearing) the shared first page leaves
    rank 1's claim standing, so the server still matches its whole prefix."""
    redis = pytest.importorskip("redis")
    from sglang_tiered.fleet.index import LOOKUP_LUA, alive_key, matched_from_lookup, page_key
    from sglang_tiered.fleet.publisher import IndexPublisher

    with _redis_server() as (_, port):
        url, sid = f"redis://127.0.0.1:{port}/0", "http://127.0.0.1:30000"
        r = redis.Redis(port=port)
        lookup = r.register_script(LOOKUP_LUA)
        p0 = IndexPublisher(url, sid, 30.0)
        p1 = IndexPublisher(url, sid, 30.0, rank="dp0.1")
        try:
            a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
            p0.on_store([a])
            p1.on_store([a, b, c])
            _until(lambda: p0.stats["published_pages"] >= 1 and p1.stats["published_pages"] >= 3)

            def matched():
                reply = lookup(keys=[alive_key(sid)] + [page_key(h) for h in (a, b, c)],
                               args=[1, time.time(), 30.0, sid])  # fmt: skip
                return matched_from_lookup(reply, 16).get(sid, 0)

            assert matched() == 48
            p0.on_remove([a])
            _until(lambda: p0.stats["removed_pages"] >= 1)
            assert matched() == 48  # rank 1 still holds it
            p0.on_clear()
            time.sleep(0.3)
            assert matched() == 48
            p1.on_remove([c])
            _until(lambda: p1.stats["removed_pages"] >= 1)
            assert matched() == 32
        finally:
            p0.close()
            p1.close()


def test_lookup_script_reads_a_trees_field_as_its_server():
    """LOOKUP_LUA against holders_from_replies + longest_match with trees' fields (``id#rank``) mixed in."""
    redis = pytest.importorskip("redis")
    from sglang_tiered.fleet.index import (LOOKUP_LUA, alive_key, holder_field, holders_from_replies,
                                           matched_from_lookup, page_key, servers_match)  # fmt: skip
    from sglang_tiered.fleet.routing import longest_match

    with _redis_server() as (_, port):
        r = redis.Redis(port=port)
        lookup = r.register_script(LOOKUP_LUA)
        rng = random.Random(1)
        workers = ["http://127.0.0.1:1", "http://127.0.0.1:2", "w3"]
        ttl, now = 30.0, time.time()
        for case in range(40):
            r.flushall()
            alive = {w: rng.random() < 0.9 for w in workers}
            for w, up in alive.items():
                if up:
                    r.set(alive_key(w), "1")
            hashes = [bytes([case, i]) * 8 for i in range(rng.randint(1, 10))]
            for i, h in enumerate(hashes):
                for w in workers:
                    for rank in ("", "dp0.1", "dp1.0"):
                        if rng.random() < 0.5 - 0.03 * i:
                            r.hset(page_key(h), holder_field(w, rank), str(int(now)))
            replies = [r.hgetall(page_key(h)) for h in hashes]
            holders = holders_from_replies(replies, alive, ttl, now)
            trees = sorted(set().union(*holders))  # (per tree, its best one per server: session 41)
            want = servers_match(longest_match(hashes, holders, 16, trees))
            got = matched_from_lookup(lookup(keys=[alive_key(w) for w in workers] + [page_key(h) for h in hashes],
                                             args=[len(workers), now, ttl, *workers]), 16)  # fmt: skip
            assert got == want, (case, got, want)


def test_each_tree_sees_the_index_lost():
    """Redis loses its data (FLUSHALL): every tree of the server re-publishes what it holds at its
    next write, not only the one that wrote the server's heartbeat first after the loss (the
    others found it back and kept their claims lost until the refresh, TTL/2 later)."""
    redis = pytest.importorskip("redis")
    from sglang_tiered.fleet.index import holder_field, page_key
    from sglang_tiered.fleet.publisher import IndexPublisher

    with _redis_server() as (_, port):
        url, sid = f"redis://127.0.0.1:{port}/0", "http://127.0.0.1:30000"
        r = redis.Redis(port=port)
        p0 = IndexPublisher(url, sid, 30.0)
        p1 = IndexPublisher(url, sid, 30.0, rank="dp0.1")
        try:
            a, b, c, d = (bytes([i]) * 16 for i in range(4))
            p0.on_store([a])
            p1.on_store([b])
            _until(lambda: p0.stats["batches"] >= 1 and p1.stats["published_pages"] >= 1)
            r.flushall()
            p0.on_store([c])
            _until(lambda: p0.stats["lost_index"] == 1 and r.hexists(page_key(a), sid))
            p1.on_store([d])
            _until(lambda: p1.stats["lost_index"] == 1 and r.hexists(page_key(b), holder_field(sid, "dp0.1")), 3.0)
        finally:
            p0.close()
            p1.close()
