"""Shadows of SGLang's fixed eviction orders (lru, slru, lfu) for the safety duel
(``core/safety.py``): they answer "how many of this request's pages would SGLang's RadixCache
with that policy have hit?". ``TreeShadow`` replays the RadixCache itself, exactly (every order's
for caches up to ``tree_shadow_pages``, lru's alone up to ``lru_tree_pages``); the page-level
shadows below are SHARDS-sampled miniatures for larger caches (a model: whole-node eviction is not in it). Every shadow has ``run``, ``cap``, ``full``
(it holds a cache's worth: comparisons with the real cache mean something) and ``check``.

Each ``run`` takes one request's sampled pages (shallowest first) in SGLang's scheduler order:
the cached pages are used (and locked), room is made for the new pages by evicting other
requests' pages, then the new pages are inserted, deepest first, so a page-level order keeps a
radix tree's inclusion (a parent is never evicted before its children) and hits are prefix hits.

``TreeShadow`` is the optional C extension's (``_bookkeeping.TreeShadow``: the walk, splits, heap
and evictions in C, issue #11, session 43) when it was built and ``SGLANG_TIERED_PURE_PYTHON`` is
not ``1``; otherwise ``TreeShadowPy``, the reference the C is tested against step for step (the same
hits, pages, node bounds and touches, clock, ``full`` and ``track`` calls:
tests/test_tree_shadow_c.py). ``TREE_IMPL`` says which: ``"c"`` or ``"python"``. The C one exposes
``cap``, ``order``, ``used``, ``clock``, ``seq``, ``stamps``, ``full`` (read-only) and ``track``, not
the nodes (``root``, ``leaves``, ``heap``: the reference's alone).

``Divergence`` (the pages of lru's tree against the real cache's) is the same extension's
(``_bookkeeping.Divergence``, issue #11, session 45: one table of both sides, one lookup per page,
and the C TreeShadow's ``track`` calls reach it without a list) when built and not forced off;
otherwise ``DivergencePy``, the reference it is tested against (the same sets, counts and query
answers: tests/test_divergence_c.py). ``DIVERGENCE_IMPL`` says which. The C one's ``L`` and ``R``
are new sets on each read (assignable, as the reference's attributes); ``only_l``, ``only_r`` and
``counting`` are read-only there.

Invariants (each shadow's ``check``, run by ``AdaptivePolicy.check_invariants``): I1 no shadow
holds more pages than its capacity; I2 slru's segments are disjoint; I3 lfu's buckets partition its
pages by count.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from itertools import islice

from sglang_tiered.core.keys import PURE_PYTHON

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

    @property
    def full(self) -> bool:
        return len(self.d) >= self.cap

    def check(self) -> None:
        assert len(self.d) <= self.cap, "lru shadow over capacity"

    def run(self, sampled: list) -> int:
        d = self.d
        hit, fresh = [], []  # cached and new pages, shallowest first
        for h in sampled:
            (hit if h in d else fresh).append(h)
        nh = len(hit)
        for h in hit:  # used (locked): out of the way of the eviction below
            del d[h]
        over = len(d) + nh + len(fresh) - self.cap
        if over > 0:
            pop = d.popitem
            for _ in range(min(over, len(d))):
                pop(False)
        if fresh:
            # a request bigger than the shadow keeps only its shallowest new pages (as a tree
            # cannot hold a page whose parent is gone)
            del fresh[max(0, self.cap - len(d) - nh) :]
            d.update(dict.fromkeys(reversed(fresh)))
        if hit:  # ancestors more recent than the new pages below them
            d.update(dict.fromkeys(reversed(hit)))
        return nh


class SlruShadow:
    """SGLang's slru at page level over sampled pages (same per-request steps as the lru
    shadow): pages used by >= 2 requests (protected) are evicted after all others, each
    segment in LRU order, deepest first."""

    __slots__ = ("cap", "prob", "prot")

    def __init__(self, capacity: int):
        self.cap = max(1, capacity)
        self.prob: OrderedDict = OrderedDict()
        self.prot: OrderedDict = OrderedDict()

    @property
    def full(self) -> bool:
        return len(self.prob) + len(self.prot) >= self.cap

    def check(self) -> None:
        assert len(self.prob) + len(self.prot) <= self.cap, "slru shadow over capacity"
        assert not (self.prob.keys() & self.prot.keys()), "slru shadow segments overlap"

    def run(self, sampled: list) -> int:
        prob, prot = self.prob, self.prot
        hit, fresh = [], []
        for h in sampled:
            (hit if h in prot or h in prob else fresh).append(h)
        nh = len(hit)
        if hit:  # used: protected now, most recent, deepest first
            for h in hit:
                if prob.pop(h, 0) == 0:
                    del prot[h]
            prot.update(dict.fromkeys(reversed(hit)))
        over = len(prob) + len(prot) + len(fresh) - self.cap
        if over > 0:  # probationary pages first, then protected ones other than this request's
            k = min(over, len(prob))
            pop = prob.popitem
            for _ in range(k):
                pop(False)
            pop = prot.popitem
            for _ in range(min(over - k, len(prot) - nh)):
                pop(False)
        if fresh:
            del fresh[max(0, self.cap - len(prob) - len(prot)) :]
            prob.update(dict.fromkeys(reversed(fresh)))
        return nh


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

    @property
    def full(self) -> bool:
        return self.n >= self.cap

    def check(self) -> None:
        assert self.n == len(self.cnt) <= self.cap, "lfu shadow count"
        assert sum(len(b) for b in self.buckets.values()) == self.n and all(self.buckets.values()), "lfu buckets"
        assert all(self.cnt[h] == c for c, b in self.buckets.items() for h in b), "lfu bucket of a page"

    def _put(self, h, c: int) -> None:
        self.cnt[h] = c
        b = self.buckets.get(c)
        if b is None:
            b = self.buckets[c] = OrderedDict()
        b[h] = None

    def run(self, sampled: list) -> int:
        cnt, buckets = self.cnt, self.buckets
        hit, fresh = [], []
        for h in sampled:
            (hit if h in cnt else fresh).append(h)
        for h in reversed(hit):  # one more request each, most recent in its new bucket
            c = cnt[h]
            b = buckets[c]
            del b[h]
            if not b:
                del buckets[c]
            self._put(h, c + 1)
        over = self.n + len(fresh) - self.cap
        if over > 0:
            mine = set(hit)  # the request's own cached pages are locked
            skipped = []
            while over > 0 and buckets:
                c = 1 if 1 in buckets else min(buckets)
                b = buckets[c]
                pop = b.popitem
                while over > 0 and b:  # fewest requests first, least recent first
                    h = pop(False)[0]
                    if h in mine:
                        skipped.append((h, c))
                        continue
                    del cnt[h]
                    self.n -= 1
                    over -= 1
                if not b:
                    del buckets[c]
            for h, c in skipped:
                self._put(h, c)
        del fresh[max(0, self.cap - self.n) :]
        if fresh:
            b = buckets.get(1)
            if b is None:
                b = buckets[1] = OrderedDict()
            for h in reversed(fresh):
                cnt[h] = 1
                b[h] = None
            self.n += len(fresh)
        return len(hit)


class DivergencePy:
    """The pages the lru tree shadow holds (``L``) against those the real cache holds (``R``), as
    sets kept by bulk updates; while ``counting`` (the real cache is away from lru, or has not
    converged back), also ``only_l = |L - R|`` and ``only_r = |R - L|`` page by page. ``only_l``
    prices a switch back to lru: the pages lru would hit that the real cache must first miss.

    With sources (``l_pages``, ``r_pages``: callables returning each side's pages now) the sets
    are kept only while counting: ``start`` reads both sides whole, ``stop`` drops them, and the
    updates in between are ignored. While lru is followed (most requests) that saves two set
    updates per page stored or dropped on each side (13 % of the cache's time at page size 1,
    family-090 at 2 %, session 20) for one read of both trees per episode away from lru
    (measured: 0-3 reads per trace on family 0-29 at 0.5-20 % and on both named traces, each
    under 0.5 ms: an episode needs the duel's evidence first, gathered over turnovers of references).

    The safety duel reads the sets through ``l_run``, ``l_count``, ``l_only`` and ``l_spared``
    (session 45: the C ``Divergence`` keeps no Python sets; its ``L`` and ``R`` are new sets, for
    checks and tests).

    Invariants (``check``): while counting, the counts equal the set differences (and, with
    sources, the sets equal what the sources return)."""

    __slots__ = ("L", "R", "counting", "only_l", "only_r", "l_pages", "r_pages")

    def __init__(self, l_pages=None, r_pages=None):
        self.L: set = set()
        self.R: set = set()
        self.counting = False
        self.only_l = self.only_r = 0
        self.l_pages, self.r_pages = l_pages, r_pages  # both or neither
        assert (l_pages is None) == (r_pages is None), "a lazy divergence needs both sources"

    @property
    def lazy(self) -> bool:
        return self.l_pages is not None

    def start(self) -> None:
        if not self.counting:
            if self.lazy:
                self.L, self.R = set(self.l_pages()), set(self.r_pages())
            self.only_l, self.only_r = len(self.L - self.R), len(self.R - self.L)
            self.counting = True

    def stop(self) -> None:
        self.counting = False
        self.only_l = self.only_r = 0
        if self.lazy:
            self.L, self.R = set(), set()

    @staticmethod
    def _apply(pages, mine: set, other: set, add: bool) -> tuple:
        """Add (or remove) ``pages`` to (from) ``mine``; returns how many of those that changed
        ``other`` holds, and how many it does not (set operations: no per-page Python work).
        The usual add, of pages ``mine`` holds none of (a node the tree has just taken in), is
        two passes: ``mine`` grows by the distinct ones, and ``other``'s intersection with the
        list is a set (a page listed twice counts once, as in the general case). Session 44:
        half the time of the general case's four passes, which cost a long-prompt workload
        ~90 us per request (family-33 at 1 %)."""
        if add:
            if mine.isdisjoint(pages):
                n0 = len(mine)
                mine.update(pages)
                shared = len(other.intersection(pages))
                return shared, len(mine) - n0 - shared
            changed = set(pages)
            changed -= mine
            mine |= changed
        else:
            changed = mine.intersection(pages)
            mine -= changed
        shared = len(changed & other)
        return shared, len(changed) - shared

    def l_add(self, pages) -> None:
        if not self.counting:
            if self.l_pages is None:
                self.L.update(pages)
            return
        shared, alone = self._apply(pages, self.L, self.R, True)
        self.only_r -= shared
        self.only_l += alone

    def l_remove(self, pages) -> None:
        if not self.counting:
            if self.l_pages is None:
                self.L.difference_update(pages)
            return
        shared, alone = self._apply(pages, self.L, self.R, False)
        self.only_r += shared
        self.only_l -= alone

    def r_add(self, pages) -> None:
        if not self.counting:
            if self.l_pages is None:
                self.R.update(pages)
            return
        shared, alone = self._apply(pages, self.R, self.L, True)
        self.only_l -= shared
        self.only_r += alone

    def r_remove(self, pages) -> None:
        if not self.counting:
            if self.l_pages is None:
                self.R.difference_update(pages)
            return
        shared, alone = self._apply(pages, self.R, self.L, False)
        self.only_l += shared
        self.only_r -= alone

    def r_clear(self) -> None:
        self.R.clear()
        if self.counting:
            self.only_l, self.only_r = len(self.L), 0

    def check(self) -> None:
        if self.counting:
            assert self.only_l == len(self.L - self.R), ("only_l", self.only_l, len(self.L - self.R))
            assert self.only_r == len(self.R - self.L), ("only_r", self.only_r, len(self.R - self.L))
            if self.lazy:
                assert self.L == set(self.l_pages()) and self.R == set(self.r_pages()), "stale sides"
        elif self.lazy:
            assert not self.L and not self.R, "a lazy divergence keeps no sets while not counting"

    def held(self) -> bool:
        """Whether ``L`` and ``R`` are the two sides' pages now (always, unless lazy and idle)."""
        return self.counting or not self.lazy

    def l_run(self, pages) -> int:
        """How many of ``pages``, from the first, ``L`` holds (its leading run)."""
        L = self.L
        k = 0
        for h in pages:
            if h not in L:
                break
            k += 1
        return k

    def l_count(self, pages) -> int:
        """``|L & set(pages)|``: the distinct pages of ``pages`` that ``L`` holds."""
        return len(self.L.intersection(pages))

    def l_only(self, pages) -> int:
        """``|set(pages) & L - R|``; where the sets are not held (lazy, not counting), read from
        the sources."""
        held = self.held()
        over = set(pages)
        over &= self.L if held else set(self.l_pages())
        over -= self.R if held else set(self.r_pages())
        return len(over)

    def l_spared(self, pages, room) -> int:
        """-1 where ``L`` holds at least one of ``pages`` and more than ``room`` of them, else
        ``l_count(pages)``. The count stops past ``room`` (``room + 1`` lookups, not one per
        page); a NaN room is never exceeded (``SafetyDuel.div_spared``)."""
        L = self.L
        if room < 0:
            return -1 if not L.isdisjoint(pages) else 0
        if room < len(pages):
            k = len(list(islice(filter(L.__contains__, pages), int(room) + 1)))
            return -1 if k > room else k
        return len(L.intersection(pages))  # (at most room; a NaN room, as before: never held)


class _Node:
    __slots__ = ("key", "children", "parent", "last", "hits", "lock", "seq", "stamp")

    def __init__(self, key, parent, last: int, hits: int, seq: int):
        self.key = key  # page hashes (a run of the tree's pages)
        self.children: dict = {}  # first page hash -> child
        self.parent = parent
        self.last = last  # access clock (SGLang: time.monotonic() of the last touch)
        self.hits = hits  # SGLang's hit_count
        self.lock = 0
        self.seq = seq  # creation order: breaks exact priority ties deterministically
        self.stamp = -1  # the eviction heap's live entry for this node (older entries are stale)


class TreeShadowPy:
    """SGLang's ``RadixCache`` (0.5.23) with eviction policy ``order`` (lru, slru or lfu), kept as
    metadata only, at page granularity and at full size: nodes hold runs of pages and split where
    requests diverge; eviction removes whole leaf nodes (so it frees more than it needs, as
    SGLang's does), in the order of SGLang's strategy over ``(hit_count, last_access_time)``.
    Per request the steps are the scheduler's (``dev/simulate.py``'s ``CacheDriver``): match
    (touches the path, splits a partly matched node), lock the matched path, evict what the new
    pages (and a partial last page) need beyond the free pages, insert (touches the path, counts
    a hit on each node of it, as ``_insert_helper`` does for a new request), match again
    (checkpoint's re-match touches the path), unlock. The page model's error against the real
    tree (whole-node eviction, splits) reached 15 points on the workload family (family-072 at
    0.5 %: lru's page shadow over real lru, and slru's real lead of 18 points showed as 1); this
    replica's hits are SGLang's own (``tests/test_shadows_tree.py``: per request, against
    ``RadixCache`` itself). SGLang rebuilds a heap of every evictable leaf per eviction; here one
    lazy heap is kept (an entry per priority change, stale ones skipped, rebuilt when they
    outnumber the live ones), so a request costs its path and its evictions, not the cache size.

    Invariants (``check``): the pages held equal the tree's; within capacity; the evictable
    leaves are the unlocked nodes without children, each with a live heap entry; nothing is
    locked between requests."""

    __slots__ = ("cap", "order", "root", "used", "leaves", "clock", "seq", "full", "heap", "stamps", "track")

    def __init__(self, capacity: int, order: str = "lru"):
        if order not in FIXED_ORDERS:
            raise ValueError(f"order must be one of {FIXED_ORDERS}, got {order!r}")
        self.cap = max(1, capacity)
        self.order = order
        self.root = _Node([], None, 0, 0, 0)
        self.root.lock = 1  # as SGLang's root: never evictable
        self.used = 0
        self.leaves: set = set()
        self.clock = 0
        self.seq = 0
        self.full = False  # True once it held its capacity or had to evict (as full as SGLang's gets)
        self.heap: list = []  # (priority, stamp, node): lazy, see _push
        self.stamps = 0
        self.track: DivergencePy | None = None  # told of every page this tree takes in or drops

    def _push(self, n: _Node) -> None:
        """(Re)file evictable leaf ``n`` under its current priority (its older entries go stale)."""
        self.stamps += 1
        n.stamp = st = self.stamps
        o = self.order
        if o == "lru":
            pri = n.last
        elif o == "slru":
            pri = (n.hits >= 2, n.last)
        else:
            pri = (n.hits, n.last)
        heapq.heappush(self.heap, (pri, n.seq, st, n))
        if len(self.heap) > 2 * len(self.leaves) + 64:  # mostly stale: keep the live entries
            self.heap = [e for e in self.heap if e[3].stamp == e[2] and e[3] in self.leaves]
            heapq.heapify(self.heap)

    def _split(self, node: _Node, at: int) -> _Node:
        """``_split_node``: a new parent holding ``node.key[:at]`` (hit count and lock copied)."""
        self.seq += 1
        top = _Node(node.key[:at], node.parent, node.last, node.hits, self.seq)
        top.lock = node.lock
        node.parent.children[node.key[0]] = top
        node.key = node.key[at:]
        top.children[node.key[0]] = node
        node.parent = top
        return top

    def _walk(self, pages: list, t: int, path: list, node: _Node | None = None, i: int = 0,
              n: int | None = None) -> int:
        """Match ``pages[:n]`` (None: all of them) from the root (or from ``node``, which holds
        ``pages[:i]``), touching the path at clock ``t`` and splitting a partly matched node; the
        path's nodes (root or ``node`` excluded) are appended to ``path``. Returns the matched
        pages. (A leaf on the path is not re-filed in the heap: the caller does, or locks the path
        and unlocking re-files whatever is a leaf then.) ``n`` bounds the walk as a copy of
        ``pages[:n]`` would, without the copy (three tree shadows walk every request)."""
        node = self.root if node is None else node
        node.last = t
        if n is None:
            n = len(pages)
        children = node.children
        while i < n:
            child = children.get(pages[i])
            if child is None:
                break
            child.last = t
            key = child.key
            lk = len(key)
            m = lk if lk < n - i else n - i
            if m == 1 or key[1:m] == pages[i + 1 : i + m]:
                k = m
            else:
                k = 1
                while key[k] == pages[i + k]:
                    k += 1
            if k < lk:
                if child in self.leaves:
                    self._push(child)  # the lower part keeps the touch (SGLang touches, then splits)
                child = self._split(child, k)
            i += k
            path.append(child)
            children = child.children
        return i

    def _set_lock(self, node: _Node, d: int) -> None:
        leaves = self.leaves
        while node is not None:
            node.lock += d
            if node.lock > 0:
                leaves.discard(node)
            elif not node.children and node not in leaves:
                leaves.add(node)
                self._push(node)
            node = node.parent

    def _evict(self, pages: int) -> None:
        self.full = True
        leaves, freed = self.leaves, 0
        while freed < pages and self.heap:
            _, _, st, x = heapq.heappop(self.heap)
            if x.stamp != st or x not in leaves:
                continue  # stale: re-filed since, locked, or gone
            freed += len(x.key)
            self.used -= len(x.key)
            p = x.parent
            del p.children[x.key[0]]
            leaves.discard(x)
            x.stamp = -1
            if self.track is not None:
                self.track.l_remove(x.key)
            if not p.children and p.lock == 0:
                leaves.add(p)
                self._push(p)

    def run(self, pages: list, tail: int = 0, start: int = 0, limit: int | None = None, reserve: int = 0,
            decode: tuple | None = None) -> int:
        """One request: ``pages`` its full pages' hashes from its first page, ``tail`` 1 when a
        partial last page also needs a slot, ``start`` its pages counted before (an earlier
        chunk of the same request: not reuse), ``limit`` the most pages its match may reach
        (SGLang matches at most ``len - 1`` tokens, fewer for prompt logprobs: a fully cached
        page-aligned prompt recomputes its last page; None: all). Returns the pages of
        ``pages[start:]`` it hit.

        A request that decodes (session 41; the simulator's ``CacheDriver.decode``, a live
        server): ``reserve`` 1 at its prefill, where SGLang's extend evicts for a page more than
        its tokens (``alloc_paged_token_slots_extend``, page size over 1); ``decode`` =
        ``(prompt_tokens, steps, page_size)`` at its release, whose ``pages[start:]`` are the
        decoded tokens' full pages: each step evicts until a page is free while the prompt's
        path is locked (``alloc_paged_token_slots_decode``), a page is taken at each page
        boundary, then the pages are inserted. Without them the shadow evicted less than
        SGLang's lru on decoding replays (tests/test_review41_bound.py)."""
        if decode is not None:
            return self._decoded(pages, start, *decode)
        self.clock += 1
        path: list = []
        capped = limit is not None and limit < len(pages)
        matched = self._walk(pages, self.clock, path, None, 0, limit if capped else None)
        last = path[-1] if path else self.root
        need = len(pages) - matched + tail
        # SGLang takes a request only when it fits the free and evictable pages (PrefillAdder; the
        # replay driver does the same since session 32): only this request's path is locked here,
        # so one fits when the whole of it fits the cache, and one that does not evicts nothing
        # (before, it evicted everything and then did not fit, as the driver did)
        fits = len(pages) + tail <= self.cap
        # The lock only keeps the path from the eviction below: a request that evicts nothing
        # (most of them) takes and drops none, and re-files its last node, the one node of the
        # path that can be a leaf, as the unlock would (the same heap order: entries are
        # ordered by priority and creation order, never by their stamps)
        want = need + reserve if need else 0
        locked = fits and want > self.cap - self.used
        if locked:
            self._set_lock(last, 1)
            self._evict(want - (self.cap - self.used))
        if fits and need <= self.cap - self.used:
            self._insert(pages, start, path, last, matched, capped)
        if locked:
            self._set_lock(last, -1)
        elif last in self.leaves:  # (touched: its priority moved; a locked one is re-filed by the unlock)
            self._push(last)
        return max(0, matched - start)

    def _decoded(self, pages: list, start: int, n: int, steps: int, page: int) -> int:
        """``run``'s release of a request that decoded ``steps`` tokens after its ``n``-token
        prompt (``pages[:start]`` the prompt's full pages, inserted at its prefill; SGLang's lock
        sits at their end). Replays the decode's evictions, then SGLang's insert of every full
        page (touching the path, the decoded pages new). Returns 0 (nothing is matched)."""
        self.clock += 1
        path: list = []
        matched = self._walk(pages[:start], self.clock, path)
        last = path[-1] if path else self.root
        self._set_lock(last, 1)
        held = int(n % page > 0)  # pages the request holds outside the tree: its prompt's partial page
        # Each step evicts until a page is free, then takes one at a page boundary. Between a
        # step after a boundary and the next boundary nothing changes (an eviction that came
        # short finds nothing more), so only the first step, each boundary and the step after
        # it are visited: a release costs its pages, not its tokens (review, session 41: a
        # 32,000-token decode held the scheduler thread 2.9 ms per tree shadow, now 1.1 ms)
        pos, end = n, n + steps
        while pos < end:
            free = self.cap - self.used - held
            if free < 1:
                self._evict(1 - free)
            if pos % page == 0:
                held += 1
                pos += 1
            else:
                pos = min(end, (pos // page + 1) * page)
        if matched == start:  # (a prompt the shadow could not hold has no path to extend)
            self._insert(pages, start, path, last, matched, True)
        self._set_lock(last, -1)
        return 0

    def _insert(self, pages: list, start: int, path: list, last: _Node, matched: int, capped: bool) -> None:
        """SGLang's insert of ``pages`` after ``run``'s match (``path``, ending at ``last``,
        ``matched`` pages; ``capped``: the match stopped short of them, the insert walks on)."""
        # SGLang's insert (touches the matched path and counts a hit on each node ending
        # beyond ``start``), then checkpoint's re-match (touches it again). The path is locked
        # since the match, so both walk the nodes of ``path``; only the last touch survives
        # (two clock ticks: one per walk, as before).
        self.clock += 2
        t = self.clock
        self.root.last = t
        end = 0
        for node in path:
            node.last = t
            end += len(node.key)
            if end > start:
                node.hits += 1
        tip, inserted = last, matched
        if capped:  # SGLang's insert walks on over what is cached past the match's limit
            more: list = []
            inserted = self._walk(pages, t, more, last, matched)
            for node in more:  # (unlocked: touched and counted as the path's, then re-filed)
                end += len(node.key)
                if end > start:
                    node.hits += 1
                if node in self.leaves:
                    self._push(node)
            tip = more[-1] if more else last
        if inserted < len(pages):
            self.seq += 1
            leaf = _Node(pages[inserted:], tip, t, 1 if len(pages) > start else 0, self.seq)
            self.leaves.discard(tip)  # (an unlocked node the insert walked to: no longer a leaf)
            tip.children[pages[inserted]] = leaf
            self.used += len(leaf.key)
            if self.track is not None:
                self.track.l_add(leaf.key)
            if self.used >= self.cap:
                self.full = True
            self.leaves.add(leaf)  # (``last`` is locked, the root or the ``tip`` dropped above)
            self._push(leaf)

    def touch(self, pages: list) -> int:
        """SGLang's match of a request that is then never inserted (turned away: too long for the
        pool; aborted while it waited): ``_match_prefix_helper`` touches the matched path and
        splits a partly matched node, and nothing else changes (no lock survives, no hit count)."""
        self.clock += 1
        path: list = []
        matched = self._walk(pages, self.clock, path)
        if path and path[-1] in self.leaves:
            self._push(path[-1])  # (a touched leaf's priority moved; ``_walk`` leaves that to ``run``)
        return matched  # (the pages SGLang's match hit)

    def fork(self, order: str) -> "TreeShadowPy":
        """A copy of this tree, from now on evicting by ``order``: what SGLang's cache holding this
        content would do if its policy were switched now (the hit counts and access times carry
        over, as the nodes' own fields do; the priorities are ``order``'s). Between requests only:
        nothing is locked then."""
        t = TreeShadowPy(self.cap, order)
        t.used, t.clock, t.seq, t.full = self.used, self.clock, self.seq, self.full
        t.root.last, t.root.hits = self.root.last, self.root.hits
        stack = [(self.root, t.root)]
        while stack:
            src, dst = stack.pop()
            for k, c in src.children.items():
                n = _Node(c.key, dst, c.last, c.hits, c.seq)  # keys are never mutated in place
                dst.children[k] = n
                if c.children:
                    stack.append((c, n))
                else:
                    t.leaves.add(n)
        for n in sorted(t.leaves, key=lambda x: x.seq):
            t._push(n)
        return t

    def pages(self) -> set:
        """Every page hash the tree holds."""
        out, stack = set(), [self.root]
        while stack:
            n = stack.pop()
            out.update(n.key)
            stack.extend(n.children.values())
        return out

    def bounds(self) -> set:
        """The last page of every node (``lasts``' keys): its node boundaries."""
        return set(self.lasts())

    def lasts(self) -> dict:
        """The last page of every node -> (its last touch, its creation order): ``bounds`` with
        the order lru evicts in (``SafetyDuel._converged`` compares it with the real tree's)."""
        out, stack = {}, list(self.root.children.values())
        while stack:
            n = stack.pop()
            out[n.key[-1]] = (n.last, n.seq)
            stack.extend(n.children.values())
        return out

    def check(self) -> None:
        seen, stack = 0, [self.root]
        live = {id(e[3]) for e in self.heap if e[3].stamp == e[2]}
        while stack:
            n = stack.pop()
            seen += len(n.key)
            assert n is self.root or n.lock == 0, "a node stayed locked"
            assert (n in self.leaves) == (n is not self.root and not n.children), "evictable leaves"
            assert n not in self.leaves or id(n) in live, "an evictable leaf without a live heap entry"
            for k, c in n.children.items():
                assert c.parent is n and c.key and c.key[0] == k, "tree links"
                stack.append(c)
        assert seen == self.used <= self.cap, (seen, self.used, self.cap)
        if self.track is not None:
            assert not self.track.held() or self.track.L == self.pages(), "the divergence's L is not the tree's pages"
            self.track.check()


try:
    from sglang_tiered.core._bookkeeping import TreeShadow as _TreeShadowC
except ImportError:  # not built (no compiler: setup.py's extension is optional)
    _TreeShadowC = None

try:
    from sglang_tiered.core._bookkeeping import Divergence as _DivergenceC
except ImportError:  # (an extension built before session 45 has no Divergence)
    _DivergenceC = None

# SGLANG_TIERED_PURE_PYTHON=1: the references even where the extension is built
TREE_IMPL = "c" if _TreeShadowC is not None and not PURE_PYTHON else "python"
TreeShadow = _TreeShadowC if TREE_IMPL == "c" else TreeShadowPy
DIVERGENCE_IMPL = "c" if _DivergenceC is not None and not PURE_PYTHON else "python"
Divergence = _DivergenceC if DIVERGENCE_IMPL == "c" else DivergencePy
