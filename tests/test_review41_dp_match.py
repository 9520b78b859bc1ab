"""A server with several trees matches its best tree's prefix, not its trees' pages together (session 41).

Under DP attention (and data-parallel replicas) each tree publishes its claims under a field of its
own (``index.holder_field``). The router's lookup (``index.LOOKUP_LUA``) followed the *server* from
page to page: a prompt whose first pages tree 0 holds and whose later pages tree 1 holds counted as
one match of them all, while the request lands on one tree, which holds only its part. Now the walk
follows each tree on its own and a server's match is its best tree's; a server with one tree
(its id as the only field) matches as before."""

from __future__ import annotations

import time

import pytest

from tests.test_fleet import _redis_server


def _lookup_matched(pages: list[dict], workers: list[str]) -> dict:
    """LOOKUP_LUA over a fake index (``pages``: per page, field -> claimed), every worker alive."""
    redis = pytest.importorskip("redis")
    from sglang_tiered.fleet.index import LOOKUP_LUA, alive_key, matched_from_lookup, page_key

    with _redis_server() as (_, port):
        r = redis.Redis(port=port)
        now = int(time.time())
        for w in workers:
            r.set(alive_key(w), "1")
        hashes = [bytes([i]) * 16 for i in range(len(pages))]
        for h, fields in zip(hashes, pages):
            for f in fields:
                r.hset(page_key(h), f, str(now))
        reply = r.register_script(LOOKUP_LUA)(keys=[alive_key(w) for w in workers] + [page_key(h) for h in hashes],
                                               args=[len(workers), now, 30.0, *workers])  # fmt: skip
        return matched_from_lookup(reply, 16)


def test_a_prefix_split_over_two_trees_is_not_one_match():
    """Tree 0 (the server's id) holds pages 0-1, tree 1 (``id#dp0.1``) pages 2-4 (and page 0): before,
    the server matched 5 pages (80 tokens); no tree holds more than 2 of the prefix. Server b, one
    tree, holds pages 0-2 and keeps its 3."""
    from sglang_tiered.fleet.index import holder_field

    a, b = "http://127.0.0.1:1", "http://127.0.0.1:2"
    t0, t1 = holder_field(a), holder_field(a, "dp0.1")
    pages = [{t0, t1, b}, {t0, b}, {t1, b}, {t1}, {t1}]
    assert _lookup_matched(pages, [a, b]) == {a: 32, b: 48}


def test_the_best_tree_wins_and_one_tree_servers_are_unchanged():
    """Tree 1 holds the longer prefix (4 pages) and tree 0 only the first: the server's match is 4
    pages; the reference (holders_from_replies + longest_match + servers_match) agrees."""
    from sglang_tiered.fleet.index import holder_field, holders_from_replies, servers_match
    from sglang_tiered.fleet.routing import longest_match

    a, b = "http://127.0.0.1:1", "w2"
    t0, t1 = holder_field(a), holder_field(a, "dp1.0")
    pages = [{t0, t1, b}, {t1}, {t1, b}, {t1}, {t0}]
    assert _lookup_matched(pages, [a, b]) == {a: 64, b: 16}
    now = time.time()
    holders = holders_from_replies([{f: str(int(now)) for f in p} for p in pages], {a: True, b: True}, 30.0, now)
    assert servers_match(longest_match([b""] * len(pages), holders, 16, [t0, t1, b])) == {a: 64, b: 16}
