"""The server's first tree sees the index lost whichever tree writes first after the loss (review,
session 40).

Each tree checks a heartbeat of its own for a lost index (session 40); the first tree's own is the
server's, which every other tree also writes (readers look at it). After Redis lost its data, a
tree other than the first that wrote first set the server's heartbeat again, and the first tree's
read of it found it there: its claims stayed lost until its refresh, TTL/2 later. Now the other
trees only refresh the server's heartbeat while it exists, and the first tree sets it again."""

from __future__ import annotations

import pytest

from tests.test_fleet import _redis_server
from tests.test_review40_dp_hints import _until


def test_the_first_tree_sees_the_index_lost_when_another_tree_writes_first():
    redis = pytest.importorskip("redis")
    from sglang_tiered.fleet.index import alive_key, holder_field, page_key
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
            _until(lambda: p0.stats["published_pages"] >= 1 and p1.stats["published_pages"] >= 1)
            r.flushall()
            p1.on_store([d])  # the other tree writes first after the loss
            _until(lambda: p1.stats["lost_index"] == 1 and r.hexists(page_key(b), holder_field(sid, "dp0.1")))
            p0.on_store([c])
            _until(lambda: p0.stats["lost_index"] == 1 and r.hexists(page_key(a), sid), 3.0)
            assert r.exists(alive_key(sid))  # (the server's heartbeat is back)
            p1.on_store([bytes([9]) * 16])
            _until(lambda: p1.stats["batches"] >= 3)
            assert r.ttl(alive_key(sid)) > 0
        finally:
            p0.close()
            p1.close()
