"""SGLang's radix-tree walks, without the per-step ``RadixKey`` slices (the bookkeeping of issue
#11, item 4): ``match`` and ``insert`` are ``RadixCache._match_prefix_helper`` and
``_insert_helper`` on offsets into the key, and ``checkpoint`` is ``RadixCache.checkpoint``
without its second walk of the path it has just inserted.

Semantically identical to SGLang 0.5.23's code (radix_cache.py:510-543, 651-760): the same
nodes, the same splits (through the cache's own ``_split_node``), the same ``hit_count``,
``priority`` and ``last_access_time`` updates (one ``time.monotonic()`` per walk, set in the
same order), the same KV events, leaf status and sizes. Only the way there is cheaper: SGLang
slices the key after every node (a new ``RadixKey`` and an array copy of the rest of the prompt)
and calls ``len(key)`` through ``_raw_len`` several times per node; here a node whose whole key
matches is recognised by one C-level array compare, and anything else goes through SGLang's own
``RadixKey.match_at``. Bigram keys (EAGLE) take SGLang's code unchanged.
tests/test_tree_ops.py checks the equivalence against a plain ``RadixCache`` (Hypothesis).
"""

from __future__ import annotations

import time

import torch
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchResult
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode
from sglang.srt.utils.common import ceil_align


def _match_len(node_key: RadixKey, key: RadixKey, off: int, n: int, ps: int) -> int:
    """``node_key.match(key[off:], page_size=ps)`` for a plain (non-bigram) ``key`` of length
    ``n``: a whole-node match by one array compare, else SGLang's own ``match_at``."""
    t0 = node_key.token_ids
    m = len(t0)
    if (node_key.limit is None and not node_key.is_bigram and off + m <= n and m % ps == 0
            and key.token_ids[off : off + m] == t0 and node_key.extra_key == key.extra_key
            and node_key.cache_salt == key.cache_salt):  # fmt: skip
        return m
    return node_key.match_at(key, off, page_size=ps)


def _walk(cache, node: TreeNode, key: RadixKey, n: int, value):
    """SGLang's match walk from ``node`` over ``key[:n]``: each node on the path stamped, a partly
    matched one split. Returns (tokens matched, last node); each matched node's value is appended
    to ``value`` unless it is None."""
    access_time = time.monotonic()
    node.last_access_time = access_time
    ps = cache.page_size
    child_key = key.child_key_at(0, ps)
    off = 0
    while off < n and child_key in node.children:
        child = node.children[child_key]
        child.last_access_time = access_time
        prefix_len = _match_len(child.key, key, off, n, ps)
        if prefix_len < len(child.key):
            node = cache._split_node(child.key, child, prefix_len)
            if value is not None:
                value.append(node.value)
            return off + prefix_len, node
        if value is not None:
            value.append(child.value)
        node = child
        off += prefix_len
        if off < n:
            child_key = key.child_key_at(off, ps)
    return off, node


def match(cache, node: TreeNode, key: RadixKey):
    """``RadixCache._match_prefix_helper(node, key)``: (values on the matched path, last node)."""
    value = []
    _, node = _walk(cache, node, key, len(key), value)
    return value, node


def match_prefix(cache, key: RadixKey) -> MatchResult:
    """``RadixCache.match_prefix`` for a plain (non-bigram) key on an enabled cache: the walk on
    the key's page-aligned length, without SGLang's aligned copy of the key, the list of the
    path's values and the sum of their lengths (the result holds only the length): the path's
    length is the walk's offset. The same nodes, splits and access times; the same result."""
    ps = cache.page_size
    n = len(key)
    if ps > 1:
        n = n // ps * ps
    if n == 0:
        return cache._empty_match_result
    off, node = _walk(cache, cache.root_node, key, n, None)
    return MatchResult(device_prefix_len=off, last_device_node=node, last_host_node=node, best_match_node=node)


def insert(cache, node: TreeNode, key: RadixKey, value, priority: int = 0, inserted_len: int = 0,
           owned: bool = False):
    """``RadixCache._insert_helper``: (tokens already in the tree, last node of ``key``).
    ``owned``: ``value`` is a fresh copy nothing else holds (checkpoint's), so a new node that
    takes all of it takes it as it is, where SGLang clones it again (the same indices)."""
    if priority is None:
        priority = 0
    access_time = time.monotonic()
    node.last_access_time = access_time
    node.priority = max(node.priority, priority)
    n = len(key)
    if n == 0:
        return 0, node
    ps = cache.page_size
    child_key = key.child_key_at(0, ps)
    off = 0  # SGLang's total_prefix_length
    while off < n and child_key in node.children:
        node = node.children[child_key]
        node.last_access_time = access_time
        prefix_len = _match_len(node.key, key, off, n, ps)
        off += prefix_len
        if prefix_len < len(node.key):
            new_node = cache._split_node(node.key, node, prefix_len)
            new_node.priority = max(new_node.priority, priority)
            node = new_node
        else:
            node.priority = max(node.priority, priority)
        if off > inserted_len:  # nodes this request already inserted were counted back then
            cache._inc_hit_count(node)
        if off < n:
            child_key = key.child_key_at(off, ps)
    if off < n:
        new_node = TreeNode(priority=priority)
        new_node.parent = node
        new_node.key = key[off:] if off else key
        new_node.value = value[off:].clone() if off else (value if owned else value.clone())
        if n > inserted_len:
            cache._inc_hit_count(new_node)
        node.children[child_key] = new_node
        cache.evictable_size_ += n - off
        cache._update_leaf_status(node)
        cache._update_leaf_status(new_node)
        cache.kv_events.record_store(new_node)
        node = new_node
    return off, node


def touch_path(cache, node: TreeNode) -> int:
    """What SGLang's checkpoint gets from matching the key it has just inserted (whose end is a
    node boundary, so the walk splits nothing): ``last_access_time`` of the root and every node
    on the path set to one fresh ``time.monotonic()``. Returns the path's length in tokens."""
    access_time = time.monotonic()
    root = cache.root_node
    depth = 0
    while node is not root:
        node.last_access_time = access_time
        depth += len(node.value)
        node = node.parent
    root.last_access_time = access_time
    return depth


def touch(cache, node: TreeNode) -> int:
    """A use of the path to ``node`` now, as SGLang's checkpoint makes one whatever it adds: the
    adapter's clock stamp and ``last_access_time`` along the path. Returns its length in tokens."""
    cache.clock.now()
    cache.clock.stamp(node, cache.root_node)
    return touch_path(cache, node)


def checkpoint(cache, req, up_to: int) -> None:
    """SGLang's ``RadixCache.checkpoint`` (radix_cache.py:510-543) for plain keys, less its second
    walk: SGLang matches the key it has just inserted to find the path's last node and indices;
    ``insert`` returned that node already. The match's side effects are kept: the adapter's clock
    stamp, and ``last_access_time`` along the path."""
    ps = cache.page_size
    token_ids = req.full_untruncated_fill_ids[:up_to]
    floor = req.kv.swa_evict_floor
    # --- SGLang's _insert_cache, keeping the insert's last node ---
    kv_indices = cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(token_ids)]
    key = RadixKey(token_ids, req.extra_key, cache_salt=req.cache_salt).page_aligned(ps)
    if floor > 0:
        key = key[: ceil_align(floor, ps)]
    key_len = len(key)
    values = kv_indices[:key_len].to(dtype=torch.int64, copy=True)
    priority = req.priority or 0
    # RadixCache.insert would re-align (copy) the aligned key and cut the values to its length
    prefix_len, last = insert(cache, cache.root_node, key, values, priority, req.kv.cache_inserted_len, True)
    req.kv.cache_inserted_len = max(req.kv.cache_inserted_len, key_len)
    if len(req.origin_input_ids) < len(token_ids):  # else the prompt key is the whole key
        prompt_key = RadixKey(token_ids[: len(req.origin_input_ids)], req.extra_key,
                              cache_salt=req.cache_salt).page_aligned(ps)  # fmt: skip
        if 0 < len(prompt_key) < key_len:  # split at the prompt boundary (the deepest node stays)
            cache.insert(InsertParams(key=prompt_key, value=values[: len(prompt_key)],
                                      inserted_len=len(prompt_key),
                                      priority=min(priority + 1, torch.iinfo(torch.int64).max)))  # fmt: skip
    cpl = req.kv.cache_protected_len
    cache.token_to_kv_pool_allocator.free_segment(kv_indices[cpl:prefix_len], start_pos=cpl)
    # --- what SGLang's match of the inserted key did: our stamp, the path's access time ---
    depth = touch(cache, last)
    assert depth == key_len, f"{depth=}, {key_len=}"
    # --- the tree's indices of [cpl, key_len) into the request's row ---
    # (the nodes the insert created hold [prefix_len, key_len) of the row as it is, split at the
    # prompt boundary or not: the indices are the row's own, so only [cpl, prefix_len) can
    # change; SGLang writes the whole range, the same values. A request whose pages were all
    # new, the usual case, writes nothing. The path has a node boundary at prefix_len.)
    end, node = key_len, last
    while end > prefix_len:
        end -= len(node.value)
        node = node.parent
    assert end == prefix_len, (end, prefix_len)
    write_end = end
    parts = []
    while end > cpl:
        v = node.value
        start = end - len(v)
        parts.append(v if start >= cpl else v[cpl - start :])
        end, node = start, node.parent
    if parts:
        tail = parts[0] if len(parts) == 1 else torch.cat(parts[::-1])
        cache.req_to_token_pool.write((req.kv.req_pool_idx, slice(cpl, write_end)), tail)
    req.kv.cache_protected_len = key_len
    cache.unlock(req.lock)
    req.lock = cache.lock(last)
    req.last_node = last
