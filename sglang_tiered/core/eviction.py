"""Eviction order of the device tier: the "reused" predicate, the victim rule and the victim queues.

Pure Python (no torch, no sglang). The adapter (``integration/cache.py``) keeps its evictable
leaves here; the policy's page-level miniatures (``core/policy.py``) use the same rule.

**The rule.** Leaves are split into *unprotected* ones and *protected* (reused: touched by at
least ``REUSE_MIN_REQUESTS`` requests). Each class is kept in LRU order by the logical tick of
last use. The victim is the unprotected head unless the protected head is older even after it is
shifted ``boost`` requests later (``boost = 0``: plain LRU; ``boost = inf``: SGLang's slru). Ties
go to the unprotected head, and within equal ticks to the smaller id (SGLang creates nodes in id
order, so this is its lru tie-break).

**The queue.** ``VictimQueue`` keeps that order across ``evict`` calls as two lazy heaps of
``(tick, id, node)``; a node's live entry is ``node.tiered_entry = (tick, protected)``. An entry
whose node was used, re-classed, locked or deleted since is dropped when it reaches the top (and
the node, if still evictable, re-queued), so a victim costs O(log n) instead of SGLang's O(n)
heap rebuild per call. ``RebuiltQueue`` is that rebuild (the fixed orders of the safety duel).

Invariants (``VictimQueue.check_invariants``):
  I1 every evictable leaf has a live entry: ``node.tiered_entry == (tick, protected)`` for an
     entry ``(tick, node.id, node)`` in heap ``protected``;
  I2 a popped victim is the minimum of ``unprotected_first`` over the evictable leaves (checked
     against a sorted-list model in tests/test_victim_queue_machine.py).
Stale entries are bounded: past ``4 x leaves + 1024`` entries the heaps are rebuilt.

Items are duck-typed tree nodes: ``id`` (int, creation order), ``hit_count`` (requests that used
it), ``tiered_tick`` (logical time of last use) and a writable ``tiered_entry``.
"""

from __future__ import annotations

import heapq
import itertools
import math

REUSE_MIN_REQUESTS = 2  # a node used by this many requests is "reused" (protected, slru's segment)


def is_reused(hit_count: int) -> bool:
    """A node (or page) touched by ``REUSE_MIN_REQUESTS`` or more requests: protected."""
    return hit_count >= REUSE_MIN_REQUESTS


def unprotected_first(unprotected, protected, boost: float) -> bool:
    """The victim rule: does the unprotected head ``(tick, id)`` go before the protected head
    ``(tick, id)`` once the latter is aged ``boost`` requests younger? (ids 0 where there are none)"""
    return (unprotected[0], unprotected[1]) <= (protected[0] + boost, protected[1])


class VictimQueue:
    """The adaptive (and exact lru, ``boost = 0``) eviction order, persistent across calls."""

    def __init__(self, leaves: set):
        self.leaves = leaves  # the tree's evictable leaves (the tree keeps this set current)
        self.heaps: tuple[list, list] = ([], [])

    def clear(self) -> None:
        self.heaps[0].clear()
        self.heaps[1].clear()

    def offer(self, node) -> None:
        """Queue ``node`` (an evictable leaf) with its current tick and class, unless already so."""
        prot = is_reused(node.hit_count)
        entry = (node.tiered_tick, prot)
        if node.tiered_entry != entry:
            node.tiered_entry = entry
            heapq.heappush(self.heaps[prot], (node.tiered_tick, node.id, node))
            if len(self.heaps[0]) + len(self.heaps[1]) > 4 * len(self.leaves) + 1024:
                self._rebuild()

    def _rebuild(self) -> None:
        # A node out of the leaves now (locked, or with a child) loses its live entry here: its
        # ``tiered_entry`` goes too, so ``offer`` queues it again when it is back, even at the
        # same tick and class. Kept, the entry looked current and the leaf was never queued nor
        # evicted until its next use (session 45, a helper's differential test).
        leaves = self.leaves
        for i, heap in enumerate(self.heaps):
            prot = bool(i)
            for tick, _, n in heap:
                if n not in leaves and n.tiered_entry == (tick, prot):
                    n.tiered_entry = None
        self.clear()
        for n in self.leaves:
            prot = is_reused(n.hit_count)
            n.tiered_entry = (n.tiered_tick, prot)
            self.heaps[prot].append((n.tiered_tick, n.id, n))
        heapq.heapify(self.heaps[0])
        heapq.heapify(self.heaps[1])

    def _head(self, i: int):
        heap, leaves = self.heaps[i], self.leaves
        while heap:
            tick, _, node = heap[0]
            if node in leaves and node.tiered_tick == tick and is_reused(node.hit_count) == bool(i):
                return heap[0]
            heapq.heappop(heap)
            if node.tiered_entry == (tick, bool(i)):
                node.tiered_entry = None  # that was its live entry
            if node in leaves:  # stale: used or re-classed since; queue it afresh
                self.offer(node)
        return None

    def peek(self, boost: float):
        """``(victim, heap index)`` without removing it; ``(None, -1)`` when nothing is evictable."""
        heap0 = self.heaps[0]
        while True:  # cleaning one heap may re-queue a node into the other: settle both tops
            a = self._head(0)
            b = self._head(1)
            # heap 0's top unchanged (the same entry, still valid: cleaning heap 1 changes no
            # node heap 0's top is checked on): settled, without a third walk (session 44)
            if (heap0[0] if heap0 else None) is a:
                break
        if a is None and b is None:
            return None, -1
        if b is None or (a is not None and unprotected_first(a, b, boost)):
            return a[2], 0
        return b[2], 1

    def pop(self, boost: float):
        """Remove and return the victim (None when nothing is evictable)."""
        node, i = self.peek(boost)
        if node is not None:
            heapq.heappop(self.heaps[i])
            node.tiered_entry = None
        return node

    def ordered(self, boost: float):
        """The evictable leaves in victim order (the order successive ``pop`` calls would return
        them if nothing changed), lazily and without changing the queue: O(k log k) for the first
        k plus the stale entries met on the way. A leaf is yielded once, at its current tick and
        class (a stale entry's node is re-placed at its true key, which is never earlier: ticks
        only grow and re-classing only protects)."""
        leaves, heaps = self.leaves, self.heaps
        inf = math.isinf(boost)

        def key(tick, prot: int, node_id: int):
            return (prot, tick, node_id) if inf else (tick + boost * prot, 0, node_id)

        seq = itertools.count()
        frontier = []  # (key, seq, heap index or -1 for a re-placed node, heap position, node)
        for i in (0, 1):
            if heaps[i]:
                tick, nid, node = heaps[i][0]
                frontier.append((key(tick, i, nid), next(seq), i, 0, node))
        heapq.heapify(frontier)
        seen = set()
        while frontier:
            _, _, i, j, node = heapq.heappop(frontier)
            if i >= 0:
                heap = heaps[i]
                for c in (2 * j + 1, 2 * j + 2):
                    if c < len(heap):
                        tick, nid, child = heap[c]
                        heapq.heappush(frontier, (key(tick, i, nid), next(seq), i, c, child))
                tick = heap[j][0]
                if node.id in seen or node not in leaves:
                    continue
                prot = int(is_reused(node.hit_count))
                if node.tiered_tick != tick or prot != i:  # stale: its true place is later
                    heapq.heappush(frontier, (key(node.tiered_tick, prot, node.id), next(seq), -1, 0, node))
                    continue
            elif node.id in seen or node not in leaves:
                continue
            seen.add(node.id)
            yield node

    def check_invariants(self) -> None:
        live = {(e[1], e[0], i) for i in (0, 1) for e in self.heaps[i]}
        for n in self.leaves:
            assert n.tiered_entry is not None, f"I1 violated: evictable leaf {n.id} without a queue entry"
            assert (n.id, n.tiered_entry[0], int(n.tiered_entry[1])) in live, f"I1 violated: entry of {n.id} lost"


class RebuiltQueue:
    """The fixed orders (safety duel, force_mode experiments): a heap of ``(priority(node), id,
    node)`` rebuilt per ``evict`` call, exactly as SGLang's RadixCache does."""

    def __init__(self, items: list, priority):
        heapq.heapify(items)
        self.heap = items
        self.priority = priority

    def offer(self, node) -> None:
        heapq.heappush(self.heap, (self.priority(node), node.id, node))

    def peek(self, boost: float):
        return (self.heap[0][2], 0) if self.heap else (None, -1)

    def pop(self, boost: float):
        return heapq.heappop(self.heap)[2] if self.heap else None

    def ordered(self, boost: float):
        """The leaves in victim order without changing the heap: pops of a copy, O(k log n) for
        the first k (a walk stops early) instead of sorting all n."""
        heap = list(self.heap)
        while heap:
            yield heapq.heappop(heap)[2]


def fixed_order_priority(order: str):
    """SGLang's priority of a leaf under a fixed order, as a function of the node: ``(class,
    last_access_time)`` with class ``reused`` for slru, ``hit_count`` for lfu, 0 for lru/fifo."""
    if order == "slru":
        cls = lambda n: is_reused(n.hit_count)  # noqa: E731
    elif order == "lfu":
        cls = lambda n: n.hit_count  # noqa: E731
    else:
        cls = lambda n: 0  # noqa: E731
    return lambda n: (cls(n), n.last_access_time)
