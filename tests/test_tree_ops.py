"""``integration/tree_ops.py`` against SGLang's own code: the same random inserts (with
``inserted_len`` and priorities) and matches, on two plain ``RadixCache`` trees, one through
SGLang's ``_insert_helper`` / ``_match_prefix_helper``, one through ``tree_ops``, must give the
same results, the same tree (keys, values, hit counts, priorities, access times, leaf status,
sizes) and the same KV events. Time is frozen per operation so access times compare exactly."""

from __future__ import annotations

import time
from array import array

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from sglang_tiered.integration import tree_ops

PAGE = 2
BLOCKS = [[b * 10 + i for i in range(PAGE)] for b in range(1, 6)]
SALTS = [None, "acme"]

op_st = st.tuples(
    st.sampled_from(["insert", "match"]),
    st.lists(st.integers(0, len(BLOCKS) - 1), min_size=1, max_size=7),  # pages of the key
    st.sampled_from(SALTS),
    st.integers(0, 8),  # inserted_len, in pages
    st.integers(0, 3),  # priority
)


class _Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def _tree(cache):
    """Every node as (path of child keys, token ids, value, hit_count, priority, lock_ref,
    last_access_time, evictable leaf), in a canonical order."""
    out = []
    stack = [((), cache.root_node)]
    while stack:
        path, n = stack.pop()
        out.append((path, list(n.key.token_ids), list(n.value.tolist() if torch.is_tensor(n.value) else n.value),
                    n.hit_count, n.priority, n.lock_ref, n.last_access_time, n in cache.evictable_leaves))  # fmt: skip
        for ck, c in n.children.items():
            stack.append((path + (repr(ck),), c))
    return sorted(out, key=lambda r: r[0])


def _path(cache, node):
    keys = []
    while node is not cache.root_node:
        keys.append(list(node.key.token_ids))
        node = node.parent
    return keys


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(op_st, min_size=1, max_size=30))
def test_tree_ops_same_tree_as_sglang(ops):
    clock = _Clock()
    real = time.monotonic
    time.monotonic = clock
    try:
        a = RadixCache.create_simulated(page_size=PAGE, enable_kv_cache_events=True)
        b = RadixCache.create_simulated(page_size=PAGE, enable_kv_cache_events=True)
        next_value = 1000
        for i, (kind, pages, salt, inserted_pages, priority) in enumerate(ops):
            clock.t = float(i)
            toks = [t for p in pages for t in BLOCKS[p]]
            ka = RadixKey(array("q", toks), None, cache_salt=salt)
            kb = RadixKey(array("q", toks), None, cache_salt=salt)
            if kind == "insert":
                value = torch.arange(next_value, next_value + len(toks), dtype=torch.int64)
                next_value += len(toks)
                ra = a._insert_helper(a.root_node, ka, value, priority, inserted_pages * PAGE)
                rb = tree_ops.insert(b, b.root_node, kb, value, priority, inserted_pages * PAGE)
                assert ra[0] == rb[0]
            else:
                ra = a._match_prefix_helper(a.root_node, ka)
                rb = tree_ops.match(b, b.root_node, kb)
                assert [v.tolist() for v in ra[0]] == [v.tolist() for v in rb[0]]
            assert _path(a, ra[1]) == _path(b, rb[1])
            assert _tree(a) == _tree(b)
            assert (a.evictable_size_, a.protected_size_) == (b.evictable_size_, b.protected_size_)
            assert len(a.kv_events.take()) == len(b.kv_events.take())
    finally:
        time.monotonic = real


def test_touch_path_sets_the_path_like_a_match():
    a = RadixCache.create_simulated(page_size=PAGE)
    key = RadixKey(array("q", BLOCKS[0] + BLOCKS[1]), None)
    _, last = a._insert_helper(a.root_node, key, torch.arange(4))
    a._insert_helper(a.root_node, RadixKey(array("q", BLOCKS[0] + BLOCKS[2]), None), torch.arange(4, 8))
    assert tree_ops.touch_path(a, last) == 4
    n, times = last, set()
    while n is not a.root_node:
        times.add(n.last_access_time)
        n = n.parent
    assert times == {a.root_node.last_access_time}


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(op_st, st.integers(0, PAGE - 1), st.one_of(st.none(), st.integers(0, 16))),
                    min_size=1, max_size=30))
def test_match_prefix_same_as_sglang(ops):
    """``tree_ops.match_prefix`` against ``RadixCache.match_prefix`` itself, on keys that are not
    page-aligned and keys with a ``limit``: the same result, tree and access times."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    clock = _Clock()
    real = time.monotonic
    time.monotonic = clock
    try:
        a = RadixCache.create_simulated(page_size=PAGE, enable_kv_cache_events=True)
        b = RadixCache.create_simulated(page_size=PAGE, enable_kv_cache_events=True)
        next_value = 1000
        for i, ((kind, pages, salt, inserted_pages, priority), extra, limit) in enumerate(ops):
            clock.t = float(i)
            toks = [t for p in pages for t in BLOCKS[p]]
            if kind == "insert":
                ka = RadixKey(array("q", toks), None, cache_salt=salt)
                value = torch.arange(next_value, next_value + len(toks), dtype=torch.int64)
                next_value += len(toks)
                a._insert_helper(a.root_node, ka, value, priority, inserted_pages * PAGE)
                tree_ops.insert(b, b.root_node, RadixKey(array("q", toks), None, cache_salt=salt), value, priority,
                                inserted_pages * PAGE)  # fmt: skip
            else:
                toks = toks + [99] * extra  # a partial last page
                ra = a.match_prefix(MatchPrefixParams(key=RadixKey(array("q", toks), None, cache_salt=salt, limit=limit)))
                rb = tree_ops.match_prefix(b, RadixKey(array("q", toks), None, cache_salt=salt, limit=limit))
                assert ra.device_prefix_len == rb.device_prefix_len
                assert _path(a, ra.last_device_node) == _path(b, rb.last_device_node)
                assert _path(a, ra.best_match_node) == _path(b, rb.best_match_node)
                assert _path(a, ra.last_host_node) == _path(b, rb.last_host_node)
            assert _tree(a) == _tree(b)
            assert (a.evictable_size_, a.protected_size_) == (b.evictable_size_, b.protected_size_)
            assert len(a.kv_events.take()) == len(b.kv_events.take())
    finally:
        time.monotonic = real
