"""The invariant checker of a ``TieredRadixCache``: one function, called from three places.

``check_cache`` runs (a) in the Hypothesis machines of tests/, (b) from
``TieredRadixCache.sanity_check()``, which SGLang's scheduler calls when
``SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK`` is on, and (c) after every operation with
``SGLANG_TIERED_DEBUG=1``.

  T1 locks: ``lock_ref >= 0``, and a locked node's parent (unless the root) holds at least as many;
  T2 device accounting: ``evictable_size_`` / ``protected_size_`` equal the sums over unlocked /
     locked nodes, and every node has one slot per token;
  V1, V2 (integration/invalidation.py): the count of invalidated nodes is exact, and none that
     nothing holds stays a leaf; C1 each tenant's ``resident_pages`` is its device pages in the
     tree (session 39: checked exactly only by a test's machine before);
  T3 ticks: a node's lru tick is at least its adaptive one; once the eviction has seen the
     policy's last exit from adaptive (``Eviction.unage``) and a fixed order is followed, they
     are equal on every node (following lru is SGLang's lru exactly);
  plus H1-H3 (page_hashes.py), I1 (core/eviction.py), the host pool's
  ``free + resident == capacity``, the store queue's and the policy's own checkers, and S4
  (``check_store_fenced``): a page with a pending T1 write is a page of the tree.
"""

from __future__ import annotations

from sglang_tiered.integration.index_hints import tree_pages


def check_tree(cache) -> None:
    """T1, T2 over the whole device tree."""
    evictable = protected = invalid = 0
    pages: dict = {}  # id(a tenant's counters) -> its device pages in the tree
    pol, ev = cache.policy, cache.eviction
    unaged = not pol.adaptive_extras and ev._exits == pol.adaptive_exits
    stack = list(cache.root_node.children.values())
    while stack:
        n = stack.pop()
        assert n.tiered_lru >= n.tiered_tick, f"T3 violated: node {n.id}'s lru tick is older than its tick"
        assert not (unaged and n.tiered_lru != n.tiered_tick), f"T3 violated: node {n.id} not on lru's tick under a fixed order"
        assert n.lock_ref >= 0, f"T1 violated: lock_ref={n.lock_ref} on node {n.id}"
        if n.lock_ref > 0:
            assert n.parent is cache.root_node or n.parent.lock_ref >= n.lock_ref, \
                f"T1 violated: lock of node {n.id} not on its path"
            protected += len(n.key)
        else:
            evictable += len(n.key)
        assert n.value is not None and len(n.value) == len(n.key), f"T2 violated: node {n.id} value/key length"
        if n.tiered_invalid:
            invalid += 1
            assert n.lock_ref > 0 or n.children, f"V2 violated: invalidated node {n.id}, unheld and a leaf, stays"
        row = id(cache.tenant(n.key.cache_salt))  # (the row the cache counts it in: __other__ past the table's bound)
        pages[row] = pages.get(row, 0) + len(n.key) // cache.page_size
        stack.extend(n.children.values())
    assert evictable == cache.evictable_size_, ("T2 violated: evictable", evictable, cache.evictable_size_)
    assert protected == cache.protected_size_, ("T2 violated: protected", protected, cache.protected_size_)
    assert invalid == cache.invalidation.count, ("V1 violated: invalidated nodes", invalid, cache.invalidation.count)
    held = {id(c): c.resident_pages for c in cache.tenants.by_name.values() if c.resident_pages}
    assert held == {row: n for row, n in pages.items() if n}, \
        ("C1 violated: tenants' resident_pages", sorted(held.values()), sorted(pages.values()))


def check_cache(cache) -> None:
    """Every checker of the cache and the structures it owns."""
    check_tree(cache)
    if cache.t1 is not None:
        cache.t1.check_invariants()
    cache.hashes.check(cache.root_node)
    assert cache.hashes.identity or (cache.t1 is None and cache.index.listener is None), \
        "H3 violated: T1 or the fleet index reads policy keys as page identities"
    cache.policy.check_invariants()  # shadows of the safety duel, learned quantities bounded
    cache.eviction.check_invariants()
    check_store_fenced(cache)
    check_index_device(cache)


def check_store_fenced(cache) -> None:
    """S4 (page fencing, core/store_queue.py) from the cache's side: every device page with a
    pending T1 write belongs to a node of the tree. A pending write of a freed page would copy
    whatever the page holds next into T1 under the old hash (review, session 19: no checker saw it)."""
    store = cache.t1.store if cache.t1 is not None else None
    if store is None:
        return
    with store._cv:
        pending = set(store._page_job)
    if not pending:
        return
    tree = set()
    stack = list(cache.root_node.children.values())
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        tree.update(cache.t1._page_ids(n))
    assert pending <= tree, ("S4 violated: pending T1 writes of pages outside the tree", sorted(pending - tree)[:8])


def check_index_device(cache) -> None:
    """I1 of index_hints.py: with a listener, the hint index's device set is the tree's pages;
    and the safety duel's record of the real cache's pages (``Divergence.R``) is too."""
    div = getattr(cache.policy, "_div", None)
    if div is not None and not div.held():
        div = None  # (lazy and lru followed: no record kept; it is read from the tree when needed)
    if cache.index.listener is None and div is None:
        return
    held = tree_pages(cache.root_node)
    if cache.index.listener is not None:
        assert held == cache.index.device, ("I1 violated: index device set", len(held), len(cache.index.device))
    if div is not None:
        assert held == div.R, ("the duel's record of the device pages", len(held), len(div.R))
