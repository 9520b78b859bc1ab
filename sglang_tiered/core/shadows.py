"""Page-level shadows of SGLang's fixed eviction orders (lru, slru, lfu) for the safety duel
(``core/safety.py``): SHARDS-sampled miniatures that answer "how many of this request's sampled
pages would SGLang's RadixCache with that policy have hit?".

Each ``run`` takes one request's sampled pages (shallowest first) in SGLang's scheduler order:
the cached pages are used (and locked), room is made for the new pages by evicting other
requests' pages, then the new pages are inserted, deepest first, so a page-level order keeps a
radix tree's inclusion (a parent is never evicted before its children) and hits are prefix hits.

Invariants (checked by ``AdaptivePolicy.check_invariants``): I1 no shadow holds more pages than
its capacity; I2 slru's segments are disjoint; I3 lfu's buckets partition its pages by count.
"""

from __future__ import annotations

from collections import OrderedDict

FIXED_ORDERS = ("lru", "slru", "lfu")  # SGLang's orders the safety duel can follow exactly


class LruShadow:
    """A SHARDS-sampled page-level LRU: what SGLang's lru would hold, over sampled pages only.

    Per request, as SGLang's scheduler does it: the request's cached pages are used (locked),
    room is made for its new pages by evicting least recent pages of other requests, then the
    new pages are inserted. A request's pages end up ordered deepest first, so an ancestor is
    always at least as recent as its descendants and is never evicted before them (inclusion),
    as in a radix tree evicted leaf by leaf; hits therefore count prefix hits."""

    __slots__ = ("cap", "d")

    def __init__(self, capacity: int):
        self.cap = max(1, capacity)
        self.d: OrderedDict = OrderedDict()

    def run(self, sampled: list) -> int:
        d = self.d
        hit = [h for h in sampled if h in d]
        new = len(sampled) - len(hit)
        for h in reversed(hit):
            d.move_to_end(h)
        over = len(d) + new - self.cap
        while over > 0 and len(d) > len(hit):
            d.popitem(last=False)
            over -= 1
        if new:
            # a request bigger than the shadow keeps only its shallowest new pages (as a tree
            # cannot hold a page whose parent is gone)
            fresh = [h for h in sampled if h not in d][: max(0, self.cap - len(d))]
            for h in reversed(fresh):
                d[h] = None
            for h in reversed(hit):  # ancestors more recent than the new pages below them
                d.move_to_end(h)
        return len(hit)


class SlruShadow:
    """SGLang's slru at page level over sampled pages (same per-request steps as the lru
    shadow): pages used by >= 2 requests (protected) are evicted after all others, each
    segment in LRU order, deepest first."""

    __slots__ = ("cap", "prob", "prot")

    def __init__(self, capacity: int):
        self.cap = max(1, capacity)
        self.prob: OrderedDict = OrderedDict()
        self.prot: OrderedDict = OrderedDict()

    def run(self, sampled: list) -> int:
        prob, prot = self.prob, self.prot
        hit = [h for h in sampled if h in prot or h in prob]
        new = len(sampled) - len(hit)
        for h in reversed(hit):
            if h in prob:
                del prob[h]
            prot[h] = None
            prot.move_to_end(h)
        over = len(prob) + len(prot) + new - self.cap
        while over > 0 and (prob or len(prot) > len(hit)):
            (prob if prob else prot).popitem(last=False)
            over -= 1
        if new:
            fresh = [h for h in sampled if h not in prot and h not in prob]
            for h in reversed(fresh[: max(0, self.cap - len(prob) - len(prot))]):
                prob[h] = None
        return len(hit)


class LfuShadow:
    """SGLang's lfu at page level over sampled pages (same per-request steps as the lru
    shadow): fewest requests first, then least recent (deepest first within a request).
    O(1) per reference: one LRU-ordered bucket per count."""

    __slots__ = ("cap", "cnt", "buckets", "n")

    def __init__(self, capacity: int):
        self.cap = max(1, capacity)
        self.cnt: dict = {}  # page -> count (requests that used it)
        self.buckets: dict[int, OrderedDict] = {}
        self.n = 0

    def _put(self, h, c: int) -> None:
        self.cnt[h] = c
        b = self.buckets.get(c)
        if b is None:
            b = self.buckets[c] = OrderedDict()
        b[h] = None

    def run(self, sampled: list) -> int:
        cnt, buckets = self.cnt, self.buckets
        hit = [h for h in sampled if h in cnt]
        new = len(sampled) - len(hit)
        for h in reversed(hit):
            c = cnt[h]
            b = buckets[c]
            del b[h]
            if not b:
                del buckets[c]
            self._put(h, c + 1)
        over = self.n + new - self.cap
        if over > 0:
            mine = set(hit)  # the request's own cached pages are locked
            skipped = []
            while over > 0 and buckets:
                c = 1 if 1 in buckets else min(buckets)
                b = buckets[c]
                h = b.popitem(last=False)[0]
                if not b:
                    del buckets[c]
                if h in mine:
                    skipped.append((h, c))
                    continue
                del cnt[h]
                self.n -= 1
                over -= 1
            for h, c in skipped:
                self._put(h, c)
        fresh = [h for h in sampled if h not in cnt][: max(0, self.cap - self.n)]
        for h in reversed(fresh):
            self._put(h, 1)
            self.n += 1
        return len(hit)
