"""The bookkeeping speed-ups (issue #11, item 4) against the code they replaced, kept here as the
reference: the shadows' and miniatures' per-request ``run`` and the sketch's ``increment_all``
must leave exactly the state, and return exactly the hits, of the per-page code of dae6791, on
random request sequences (chains that share prefixes, hits, misses, evictions, oversized
requests, TinyLFU refusals, sketch aging). The replay-level proof is tests/test_bookkeeping_digest.py."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_tiered.core.miniature import MiniCache
from sglang_tiered.core.shadows import LfuShadow, LruShadow, SlruShadow
from sglang_tiered.core.sketch import FrequencySketch


def _page(chain: int, j: int) -> bytes:
    return hashlib.blake2b(f"{chain}:{j}".encode(), digest_size=16).digest()


# a request: the first `depth` pages of one of a few chains, every `step`-th one (a sample)
request_st = st.tuples(st.integers(0, 5), st.integers(0, 14), st.integers(1, 3))
requests_st = st.lists(request_st, min_size=1, max_size=60)


def _pages(req) -> list[bytes]:
    chain, depth, step = req
    return [_page(chain, j) for j in range(0, depth, step)]


# ---------------------------------------------------------------- the reference (dae6791)
class RefLru:
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


class RefSlru:
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


class RefLfu:
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
class RefMini:
    """A page-level miniature of the device cache (for set dueling): probationary pages (reused
    by < 2 requests) and protected pages, each in LRU order, valued by the tick of their last use;
    the victim is whichever head is older once protected ones are shifted by ``boost``."""

    __slots__ = ("tinylfu", "cap", "prob", "prot", "age")

    def __init__(self, tinylfu: bool, capacity: int):
        self.tinylfu = tinylfu
        self.cap = capacity
        self.prob: OrderedDict[bytes, int] = OrderedDict()
        self.prot: OrderedDict[bytes, int] = OrderedDict()
        self.age = 0.0  # mean age of victims, in requests (this miniature's LRU cycle time)

    def full(self) -> bool:
        return len(self.prob) + len(self.prot) >= 0.75 * self.cap

    def _victim(self, k: float):
        prob, prot = self.prob, self.prot
        if prob:
            h = next(iter(prob))
            # eviction.unprotected_first with no ids, inlined: this runs on every full miss
            if not prot or prob[h] <= prot[next(iter(prot))] + k * self.age:
                return prob, h
        return prot, next(iter(prot))

    def access(self, h: bytes, tick: int, k: float, est, refusing: bool = False) -> float:
        """1.0 on a hit, 0.0 on an admitted miss, -1.0 on a refused miss."""
        prob, prot = self.prob, self.prot
        if h in prot:
            prot.move_to_end(h)
            prot[h] = tick
            return 1.0
        if h in prob:
            del prob[h]
            prot[h] = tick
            return 1.0
        if len(prob) + len(prot) >= self.cap:
            where, victim = self._victim(k)
            if self.tinylfu and (refusing or est(h) <= est(victim)):
                return -1.0
            self.age += 0.01 * (tick - where.pop(victim) - self.age)
        prob[h] = tick
        return 0.0


# ---------------------------------------------------------------- the comparisons
@settings(max_examples=200, deadline=None)
@given(reqs=requests_st, cap=st.integers(1, 24))
def test_shadows_run_same_state_as_reference(reqs, cap):
    pairs = [(LruShadow(cap), RefLru(cap)), (SlruShadow(cap), RefSlru(cap)), (LfuShadow(cap), RefLfu(cap))]
    for req in reqs:
        pages = _pages(req)
        for new, ref in pairs:
            assert new.run(list(pages)) == ref.run(list(pages))
        lru, slru, lfu = (p[0] for p in pairs)
        rlru, rslru, rlfu = (p[1] for p in pairs)
        assert list(lru.d) == list(rlru.d)
        assert list(slru.prob) == list(rslru.prob) and list(slru.prot) == list(rslru.prot)
        assert lfu.cnt == rlfu.cnt and lfu.n == rlfu.n
        assert {c: list(b) for c, b in lfu.buckets.items()} == {c: list(b) for c, b in rlfu.buckets.items()}


@settings(max_examples=200, deadline=None)
@given(reqs=requests_st, cap=st.integers(1, 16), k=st.sampled_from([0.0, 0.5, 2.0, float("inf")]),
       tinylfu=st.booleans())  # fmt: skip
def test_miniature_run_same_state_as_reference(reqs, cap, k, tinylfu):
    sketch = FrequencySketch(16, sample_factor=1)  # ages every 160 increments
    new, ref = MiniCache(tinylfu, cap), RefMini(tinylfu, cap)
    for tick, req in enumerate(reqs):
        pages = _pages(req)
        est = sketch.estimate
        hits, leading, refused = 0, True, False
        for h in pages:  # the per-page loop of AdmissionDuel._duel at dae6791
            r = ref.access(h, tick, k, est, refused)
            if r < 0:
                refused = True
            if leading and r > 0:
                hits += 1
            else:
                leading = False
        assert new.run(pages, tick, k, est) == hits
        assert list(new.prob.items()) == list(ref.prob.items())
        assert list(new.prot.items()) == list(ref.prot.items())
        assert new.age == ref.age
        for h in pages:
            sketch.increment(h)


def _ref_increment(sk: FrequencySketch, key: bytes) -> None:
    """FrequencySketch.increment at dae6791 (one key per call)."""
    sk.additions += 1
    v = int.from_bytes(key, "little")
    n = sk.door_bits
    a, b = (v >> 16) % n, (v >> 80) % n
    door = sk.door
    if not (door[a >> 3] & (1 << (a & 7)) and door[b >> 3] & (1 << (b & 7))):
        door[a >> 3] |= 1 << (a & 7)
        door[b >> 3] |= 1 << (b & 7)
    else:
        m = sk.mask
        idx = (v & m, (v >> 32) & m, (v >> 64) & m, (v >> 96) & m)
        cs = [row[i] for row, i in zip(sk.rows, idx)]
        low = min(cs)
        if low < 15:  # conservative update: raise only the minimum counters
            for row, i, c in zip(sk.rows, idx, cs):
                if c == low:
                    row[i] = low + 1
    if sk.additions >= sk.sample_size:
        sk.age()


@settings(max_examples=100, deadline=None)
@given(reqs=requests_st)
def test_sketch_increment_all_same_as_increment(reqs):
    a, b = FrequencySketch(16, sample_factor=1), FrequencySketch(16, sample_factor=1)
    for req in reqs:
        pages = _pages(req)
        a.increment_all(pages)
        for h in pages:
            _ref_increment(b, h)
        assert (a.rows, a.door, a.additions, a.resets) == (b.rows, b.door, b.additions, b.resets)


def _admit_reference(new_hashes, victim_freq, est, m) -> int:
    """AdmissionDuel.admit_pages's filter at dae6791: every estimate first, then the leading run."""
    n = len(new_hashes)
    ests = [0] * n
    nxt = est(new_hashes[-1])
    for j in range(n - 1, -1, -1):
        h = new_hashes[j]
        if not h[0] & m:
            nxt = est(h)
        ests[j] = nxt
    admitted = 0
    for e in ests:
        if e > victim_freq:
            admitted += 1
        else:
            break
    return admitted


@settings(max_examples=200, deadline=None)
@given(reqs=requests_st, victim_freq=st.integers(0, 4), mask=st.sampled_from([0, 3]))
def test_admit_pages_same_as_reference(reqs, victim_freq, mask):
    from sglang_tiered.core.policy import AdaptivePolicy

    pol = AdaptivePolicy(256 if mask else 64)
    assert pol._sketch_mask == mask
    pol.following, pol.mode_index = "adaptive", 1  # filtering (TinyLFU admission)
    assert pol.filtering
    for req in reqs:
        pages = _pages(req)
        pol.sketch.increment_all(pages)
        if pages:
            want = _admit_reference(pages, victim_freq, pol.sketch.estimate, mask)
            assert pol.admit_pages(pages, victim_freq) == want
