"""Admission and eviction policy for the device tier (pure Python; page hashes in, decisions out).

**The safety duel (never worse than SGLang's lru by more than a stated bound).** Beside the
adaptive machinery below, the policy keeps SHARDS-sampled page-level shadows of the fixed orders
SGLang ships for its RadixCache: lru (pages whose hash bytes 2-3 fall below a threshold, rate
``R = min(1, shadow_pages / capacity)``, capacity ``R x capacity``), and slru and lfu on half of
that sample. Each request's sampled pages go through every shadow in SGLang's scheduler order
(cached pages used, room made for the new ones, new ones inserted; deepest page first, so the
page-level LRU keeps a radix tree's inclusion and its hits are prefix hits). The real cache's own
hits on the same sampled pages are counted too. The real cache then follows one of:

* ``adaptive`` (the learned policy below) while a CUSUM of (real hits - yardstick shadow's hits +
  (bias + allowance) x sampled pages) stays above ``-T`` (credit decays, so old wins do not mask
  a phase change). The yardstick is the leading fixed order, but only one whose ``bias`` has been
  measured (the shadow-vs-real-tree difference while that order was followed: the page model is
  not the tree, and an unmeasured slru shadow overstates slru by ~4 points on Mooncake); else
  lru. ``allowance`` = 0.1 point;
* a fixed order (``lru``, ``slru``, ``lfu``) for a hold period once it does not: then the real
  cache *is* SGLang's RadixCache with that policy, exactly (admit everything, no protection
  boost, no cold aging, no pinning; the same hit for every request, tests/test_guarantee.py).
  A followed slru or lfu is itself checked against the lru shadow the same way and dropped for
  lru if behind; another fixed order is followed only if its shadow leads by ``max(2T, 1 %)``.
* **The entry gate.** When a hold ends, adaptive is followed again only on evidence: the better
  adaptive miniature (below) must lead a plain-lru miniature on the same sample by more than
  twice its paired noise (root of the summed squared per-request differences), 2 % of lru's
  hits, the bias-corrected lead of the best measured fixed order, and an entry lead that is one
  miniature turnover after the first failed episode and doubles after each further one (reset
  when adaptive earns ``2T`` of credit). Without evidence the hold is extended by one turnover.
  The first episode starts at request 0 (no switch cost: the cache starts empty).

Bound (per run, hit pages): while adaptive is followed, real >= yardstick - (bias error +
allowance) x references - T/R per episode, plus at most one cache turnover of pages per switch
(the next order starts from the other one's content). Episodes after the first need the entry
gate's evidence, so on traffic where the miniatures see no lead (the short, lru-friendly traces
that lost 1-3 points before the gate) there is one episode; with repeated false evidence the
required lead doubles, so episodes grow at most logarithmically in the trace length. While a
fixed order is followed the real cache is SGLang's, exactly. So the loss to lru is at most
``(T/R + C) x episodes + 0.1 point x references`` (``C`` the capacity in pages): a bound in
pages, not in points, and on a short trace with a tiny cache one episode can cost more than the
0.2-point bar (bench/results/workload_family.json counts the cells where it does). The
estimate's error is the SHARDS sampling error plus the page-vs-tree model error that the
measured bias corrects, so the bound is on the sampled estimate of lru, not an oracle.

What it does, and why (the Mooncake trace measured plain W-TinyLFU *losing* to LRU above ~3 %
capacity, DESIGN.md decision 2; SGLang's own slru/lfu lose to its lru there by 4-9 points at
5-20 %, while on multi-tenant traffic they beat lru by 1-15 points):

* **Adaptive protection of reused context (eviction order).** A tree node reused by two or more
  requests is *protected*: it is evicted as if it had been used ``boost`` requests later than it
  was, with ``boost = k x`` the cache's own LRU cycle time (the mean age, in requests, of the
  leaves it evicts). ``k = 0`` is LRU, ``k = inf`` is SGLang's slru; ``k`` is learned online from
  *ghost hits*, ARC-style: the first page hash of every evicted leaf is remembered (as many pages
  as the cache holds) with whether it was protected. A request that misses on a remembered
  protected leaf says protection was too weak (``k`` up); one that misses on an unprotected leaf
  says recency was starved (``k`` down). Steps are weighted by the leaf's pages and by the ghost
  sizes (ARC's balancing), on a log scale in ``[1/64, 64]``. Everything is in request counts
  (a logical clock), never wall time, so every TP rank keeps the same order.
* **Adaptive admission by set dueling.** Two miniature page caches run beside the real one over a
  hash-sampled 1-in-8 subset of pages, each with 1/8 of the capacity (SHARDS-style spatial
  sampling), both with the real cache's current eviction order: one admits everything, one admits
  by TinyLFU (a new page enters only if its sketch frequency beats the victim's). Their hit counts
  decay per sampled reference. While the filtering miniature wins by ``admit_margin``, the real
  cache filters admissions the same way (a request's new pages are kept only while their
  frequency beats the next eviction victim's); otherwise it admits everything. So it is selective
  where the workload thrashes (small caches, scans) and admits freely where reuse is
  recency-driven (conversations, whose first turn is seen once), and it finds out which by itself.
* **Pinning small hot prefixes.** Leaves within ``pin_max_tokens`` of the root whose sketch
  frequency reaches ``pin_min_freq`` are evicted only when nothing else is left (bounded budget),
  so one-shot prompts cannot evict system prompts.
* **Thrash detection** (evictions above 0.9x stores while under 5 % of requested pages hit, over
  sustained windows: eviction work that buys no hits) makes the policy more selective: while it
  lasts, TinyLFU admission switches on as soon as its miniature is at par. It is reported in
  stats and metrics.
* Reuse is counted once per request (in ``checkpoint``), never in ``match_prefix``.
* Everything is driven by event counts and deterministic hashes, so every TP rank reaches identical
  decisions.

Page-level miniatures model the tree exactly for these orders: a parent is used whenever its child
is, so its recency and reuse count are never lower and it is never evicted before its children.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from sglang_tiered.core.sketch import FrequencySketch


EVICTION_ORDERS = ("adaptive", "lru", "slru", "lfu")
UNPROTECTED, PROTECTED, COLD = 0, 1, 2  # kinds of evicted leaves (ghost list)


@dataclass(frozen=True)
class Mode:
    admission: str  # "all" | "tinylfu"
    # "adaptive": LRU with protected (reused) nodes aged k x the LRU cycle time later, k learned;
    # "lru"; "slru": reused nodes after all others (k = inf); "lfu": fewest requests first, then
    # least recent (SGLang's lfu order). The fixed orders are for experiments (force_mode).
    eviction: str

    def __str__(self) -> str:
        return f"{self.admission}+{self.eviction}"


FIXED_ORDERS = ("lru", "slru", "lfu")  # SGLang's orders the safety duel can follow exactly
_FOLLOW = {o: Mode("all", o) for o in FIXED_ORDERS}


class _MiniCache:
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


class _LruShadow:
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


class _SlruShadow:
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


class _LfuShadow:
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


@dataclass
class PolicyConfig:
    pin_min_freq: int = 8
    pin_max_tokens: int = 2048
    pin_budget_share: float = 0.05
    thrash_ratio: float = 0.9
    thrash_window: int = 64  # checkpoints per thrash measurement window
    thrash_sustain: int = 2  # consecutive windows above the ratio to enter (and below to leave)
    # ... while pages hit in the window stay below this share: a full cache always evicts about
    # what it stores; it thrashes when that work buys (almost) no hits (seed section 8)
    thrash_hit_share: float = 0.05
    sketch_sample_factor: int = 10
    sketch_sample_mask: int = 3  # count pages whose first hash byte & mask == 0 (1 in 4)
    force_mode: str | None = None  # e.g. "tinylfu+slru": disable both adaptations, use this mode
    # miniature caches see pages whose first hash byte & mask == 0 (1 in 8, a subset of the
    # counted pages, so their TinyLFU estimates are exact-sketch ones)
    duel_sample_mask: int = 7
    duel_decay: float = 0.9995  # per sampled reference; ~2,000-reference memory
    admit_margin: float = 1.1  # TinyLFU admission must beat admit-all by this factor to switch on
    # adaptive protection: log2(k) starts here, moves by this much per ghost hit of an average
    # leaf (scaled by the leaf's pages and ARC's ghost-size balance), within +-protect_log_bound
    protect_log_k0: float = 0.0
    # cold prompts (no cached prefix at all) enter c x the LRU cycle time old; log2(c) learned
    cold_log_c0: float = 0.0
    cold_log_bound: float = 6.0
    protect_step: float = 0.02
    protect_log_bound: float = 6.0
    # --- the safety duel against lru (see the module docstring) ---
    safety_duel: bool = True  # False only in unit tests of the adaptive machinery alone
    shadow_pages: int = 2048  # SHARDS: sample pages at rate min(1, shadow_pages / capacity)
    guard_allowance: float = 0.001  # hit-rate shortfall per sampled page tolerated (0.1 point)
    guard_threshold: float = 0.03  # x shadow size: cumulative shortfall (sampled pages) to fall back
    guard_hold: float = 4.0  # x shadow size: sampled references of the first lru hold (doubles)
    guard_start_lru: bool = False  # begin as exact lru for a short hold (bias calibration)
    guard_start_hold: float = 1.0  # x shadow size: sampled references of that first hold
    # entering (or returning to) adaptive needs evidence: the better adaptive miniature's decayed
    # hits beat a plain-lru miniature on the same sample by this share and by one turnover of
    # the miniature (what a switch and its way back can cost); None: enter when a hold ends
    guard_entry_margin: float | None = 0.02
    guard_memory: float = 8.0  # x shadow size: sampled references over which credit fades


@dataclass
class PolicyStats:
    requests: int = 0
    pages_offered: int = 0
    pages_admitted: int = 0
    pages_rejected: int = 0
    admissions_refused: int = 0
    evicted_pages: int = 0
    evicted_pinned: int = 0
    thrash_windows: int = 0
    no_store_requests: int = 0
    fallbacks: int = 0  # times the safety duel switched the real cache to exact lru
    cycle_clamped: int = 0  # LRU-cycle estimates cut at their bound (see AdaptivePolicy.on_evict)


class AdaptivePolicy:
    def __init__(self, capacity_pages: int, config: PolicyConfig | None = None):
        self.cfg = config or PolicyConfig()
        self.capacity_pages = max(1, capacity_pages)
        self.sketch = FrequencySketch(self.capacity_pages, self.cfg.sketch_sample_factor)
        self.stats = PolicyStats()
        self._win_stores = 0
        self._win_evicts = 0
        self._win_events = 0
        self._win_pages = 0
        self._win_hits = 0
        self._hot_windows: deque[bool] = deque(maxlen=self.cfg.thrash_sustain)
        self.thrashing = False
        self.tick = 0  # logical clock: requests begun
        # adaptive protection (see the module docstring)
        self.log_k = self.cfg.protect_log_k0
        self.k = 2.0**self.log_k
        self.cycle = 0.0  # mean age (requests since last use) of evicted leaves
        self.log_c = self.cfg.cold_log_c0
        self.c = 2.0**self.log_c
        # ghost lists (first page hash -> (kind, pages)), each as many pages as the cache holds:
        # warm leaves (unprotected + protected) and cold ones, so one-shot scans cannot push the
        # evidence about reused context out
        self._ghosts: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self._cold_ghosts: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self._ghost_pages = [0, 0, 0]  # pages remembered from [unprotected, protected, cold] leaves
        self.modes = [Mode(adm, ev) for ev in EVICTION_ORDERS for adm in ("all", "tinylfu")]
        self.mode_index = 0  # admit everything, adaptive order
        self.following = "adaptive"  # or a fixed SGLang order followed exactly: "lru", "slru", "lfu"
        self._adapt = self.cfg.force_mode is None
        if not self._adapt:
            names = [str(m) for m in self.modes]
            if self.cfg.force_mode not in names:
                raise ValueError(f"force_mode must be one of {names}, got {self.cfg.force_mode!r}")
            self.mode_index = names.index(self.cfg.force_mode)
            self.k = {"lru": 0.0, "slru": float("inf")}.get(self.mode.eviction, self.k)
        # Set dueling on admission: miniatures over a hash-sampled 1-in-8 subset of pages, each
        # with capacity/8 (SHARDS-style spatial sampling), both under the real eviction order.
        self._mini_cap = max(4, self.capacity_pages // (self.cfg.duel_sample_mask + 1))
        # the third miniature is plain lru (k = 0): the yardstick adaptive must beat to be followed
        self._minis = [_MiniCache(False, self._mini_cap), _MiniCache(True, self._mini_cap),
                       _MiniCache(False, self._mini_cap)]  # fmt: skip
        self.scores = [0.0, 0.0, 0.0, 0.0]  # decayed hits of all, tinylfu, lru; references
        # decayed sums of squared per-request differences (all - lru, tinylfu - lru): the paired
        # variance of each lead, so the entry gate asks for a lead beyond its own noise
        self._lead_var = [0.0, 0.0]
        # The safety duel: a SHARDS-sampled lru shadow, and the real cache's own hits on the same
        # sampled page references (a page is sampled when bytes 2-3 of its hash fall below t).
        cfg = self.cfg
        self._guard = self._adapt and cfg.safety_duel
        t = min(65536, max(1, round(65536 * cfg.shadow_pages / self.capacity_pages)))
        self._shard_t = t
        self.shard_rate = t / 65536
        cap = round(self.capacity_pages * self.shard_rate)
        self._shadow = _LruShadow(cap)
        self._shadows = {"lru": self._shadow, "slru": _SlruShadow(cap // 2), "lfu": _LfuShadow(cap // 2)}
        self._sh_hits = {o: 0.0 for o in FIXED_ORDERS}  # decayed hits of each shadow
        self._banned: set = set()  # fixed orders that fell behind lru during the current hold
        self._credit = 0.0  # CUSUM of (real - lru shadow + allowance) sampled hits
        self._credit_decay = 1.0 - 1.0 / max(2048.0, cfg.guard_memory * self._shadow.cap)
        self._decay = self._credit_decay
        self._threshold = max(16.0, cfg.guard_threshold * self._shadow.cap)
        self._hold_len = cfg.guard_hold * self._shadow.cap
        self._hold = 0.0  # sampled references left in the current lru hold
        # extra lead (decayed miniature hits) adaptive's miniature needs over lru's to be
        # followed: none at first; after an adaptive episode that fell behind, one miniature
        # turnover (what the switch cost), doubled after each further one
        self._entry_lead = 0.0
        self._settle = 0.0  # references at the start of a hold not used to calibrate the bias
        # per fixed order, while it is followed: (shadow - real) hits and references (decayed),
        # the page-level model's bias against the real tree under that order
        self._bias = {o: [0.0, 0.0] for o in FIXED_ORDERS}
        self._sh = [0.0, 0.0, 0.0]  # decayed sampled references, lru-shadow hits, real hits
        if self._guard and cfg.guard_start_lru:
            # Start as SGLang's lru: its first hold measures the page model's bias against the
            # real tree before the adaptive policy is tried (and compared with bias corrected).
            self.following = "lru"
            self._hold = cfg.guard_start_hold * self._shadow.cap

    # --- per request (called once per request, from checkpoint) -----------------------------
    def begin_request(self) -> int:
        self.tick += 1
        return self.tick

    def observe(self, page_hashes: list[bytes], device_hit_pages: int) -> None:
        """Count the request's pages in the sketch (once per request) and feed the duel."""
        self.stats.requests += 1
        self._win_pages += len(page_hashes)
        self._win_hits += device_hit_pages
        inc = self.sketch.increment
        m = self.cfg.sketch_sample_mask
        counted = [h for h in page_hashes if not h[0] & m]
        for h in counted:
            inc(h)
        if page_hashes and page_hashes[-1][0] & m:
            inc(page_hashes[-1])  # the request's last page is always counted
        if self._adapt:
            dm = self.cfg.duel_sample_mask  # a subset of the counted pages
            self._duel([h for h in counted if not h[0] & dm])
        if self._guard:
            t = self._shard_t
            if t >= 65536:
                self._safety(page_hashes, device_hit_pages, len(page_hashes))
            else:
                idx = [i for i, h in enumerate(page_hashes) if (h[2] << 8 | h[3]) < t]
                if idx:
                    real = 0
                    for i in idx:
                        if i >= device_hit_pages:
                            break
                        real += 1
                    self._safety([page_hashes[i] for i in idx], real, len(idx))

    def _safety(self, sampled: list, real: int, n: int) -> None:
        """The safety duel, once per request: ``n`` sampled page references of which the real
        cache hit ``real`` (a prefix of them); each fixed-order shadow hits some."""
        # lru on the whole sample; slru and lfu (rarely the leaders, and only compared on
        # decayed totals or against lru) on half of it, at half the size, hits counted twice
        half = [h for h in sampled if not h[4] & 1]
        hits = {"lru": self._shadow.run(sampled)}
        hits["slru"] = 2 * self._shadows["slru"].run(half)
        hits["lfu"] = 2 * self._shadows["lfu"].run(half)
        d = self._decay**n
        acc = self._sh_hits
        for o in FIXED_ORDERS:
            acc[o] = acc[o] * d + hits[o]
        sh = self._sh
        sh[0] = sh[0] * d + n
        sh[1] = sh[1] * d + hits["lru"]
        sh[2] = sh[2] * d + real
        if len(self._shadow.d) < self._shadow.cap:
            return  # the shadows are not full yet: nothing evicted, nothing to compare
        # the leading fixed order: lru unless another beats it clearly (ties and noise: lru)
        lead = max(2 * self._threshold, 0.01 * sh[0])  # hysteresis: switching orders costs hits
        best = "lru"
        for o in ("slru", "lfu"):
            if acc[o] > acc[best] + lead:
                best = o
        fol = self.following
        if fol != "lru":
            # Adaptive is checked against the leading fixed order; a followed slru or lfu against
            # lru itself (the shadows' ranking is a model; lru is the bar that must hold).
            # An order never followed has no measured bias (its page model may overstate it by
            # points: slru's shadow on Mooncake, +4 points): it is not a yardstick until measured.
            ref = best if fol == "adaptive" and self._bias[best][1] else "lru"
            bias = self._bias_rate(ref)
            c = self._credit
            if c > 0:
                c *= self._credit_decay**n  # credit earned long ago fades (phase changes)
            c += real - hits[ref] + (bias + self.cfg.guard_allowance) * n
            self._credit = c
            if fol == "adaptive" and c > 2 * self._threshold:
                self._hold_len = self.cfg.guard_hold * self._shadow.cap  # vindicated
                self._entry_lead = 0.0
            if c < -self._threshold:  # behind: follow the reference order
                self._credit = 0.0
                if fol == "adaptive":
                    self._follow(ref)
                    self._hold = self._hold_len
                    self._hold_len *= 2  # each failed return to adaptive waits twice as long
                    # ... and more evidence (the miniatures erred): a turnover, then doubling
                    self._entry_lead = max(float(self._mini_cap), 2 * self._entry_lead)
                else:
                    self._banned.add(fol)  # not again during this hold
                    self._follow("lru")
                return
        if fol != "adaptive":
            if self._settle > 0:
                self._settle -= n
            else:
                b = self._bias[fol]
                b[0] = b[0] * d + hits[fol] - real
                b[1] = b[1] * d + n
            if best != fol and best not in self._banned and acc[best] > acc[fol] + lead:
                self._follow(best)  # another fixed order leads now (hold continues)
                self._credit = 0.0
            self._hold -= n
            if self._hold <= 0:
                self._banned.clear()
                if self._adaptive_ahead():
                    self.following = "adaptive"
                    self._credit = 0.0
                else:  # no evidence that adaptive would do better: look again in a turnover
                    self._hold = float(self._shadow.cap)

    def _adaptive_ahead(self) -> bool:
        """Evidence for following adaptive: its better miniature leads the lru miniature, by more
        than the best fixed order's shadow leads the lru shadow (both as shares of references;
        the shadows corrected by the bias measured while that order was followed)."""
        # NOTE: the miniatures sample other pages than the shadows (byte 0 vs bytes 2-3 of the
        # hash), so their absolute hit rates differ (a hot page in one sample and not the
        # other); leads over each sample's own lru are what is compared.
        margin = self.cfg.guard_entry_margin
        if margin is None:
            return True
        s = self.scores
        if not self._minis[2].full():
            return False
        i = 1 if s[1] > s[0] else 0
        best = s[i]
        # ... and by more than twice its noise (paired: the root of the summed squared
        # per-request differences, as in a sign test)
        need = max(margin * s[2], self._entry_lead, 2.0 * self._lead_var[i] ** 0.5)
        acc, sh = self._sh_hits, self._sh
        if sh[0] > 0:
            # orders never followed have no measured bias: their shadows are not evidence yet
            rate = {o: acc[o] / sh[0] - self._bias_rate(o) for o in FIXED_ORDERS
                    if o == "lru" or o == self.following or self._bias[o][1]}  # fmt: skip
            need += max(0.0, max(rate.values()) - rate["lru"]) * s[3]
        return best - s[2] > need

    def _bias_rate(self, order: str) -> float:
        """(shadow - real) hits per reference measured while ``order`` was followed, bounded."""
        b = self._bias[order]
        return min(0.05, max(-0.05, b[0] / b[1])) if b[1] else 0.0

    def _follow(self, order: str) -> None:
        self.following = order
        self.stats.fallbacks += 1
        self._settle = self._shadow.cap  # about one turnover of the cache's content

    @property
    def mode(self) -> "Mode":
        if self.following != "adaptive":
            return _FOLLOW[self.following]
        return self.modes[self.mode_index]

    @property
    def filtering(self) -> bool:
        return self.following == "adaptive" and self.modes[self.mode_index].admission == "tinylfu"

    @property
    def followed_order(self) -> str:
        """The eviction order the real cache uses now: the policy's, or a followed fixed one."""
        return self.modes[self.mode_index].eviction if self.following == "adaptive" else self.following

    @property
    def eviction_order(self) -> str:
        return self.modes[self.mode_index].eviction

    @property
    def adaptive_extras(self) -> bool:
        """Cold aging and pinning: only while the adaptive order is followed (not in fallback)."""
        return self.following == "adaptive" and self.modes[self.mode_index].eviction == "adaptive"

    @property
    def pinning(self) -> bool:
        return self.following == "adaptive"

    def protection_boost(self) -> float:
        """Requests by which a protected (reused) node's last use is shifted for eviction."""
        if self.following != "adaptive":
            return 0.0
        return self.k * self.cycle

    def cold_age(self) -> float:
        """Requests by which a cold prompt's pages are aged at insertion."""
        if self.following != "adaptive":
            return 0.0
        return self.c * self.cycle

    def _duel(self, sampled: list[bytes]) -> None:
        """Run the request's sampled pages through both miniatures; score hits with decay."""
        if not sampled:
            return
        est, tick, k = self.sketch.estimate, self.tick, self.k
        all_, lfu, lru = self._minis
        # Like the real tree: a miniature that refuses a page of this request refuses the rest of
        # it too (admission is prefix-consistent), and only the leading run of hits counts (a
        # page past a miss cannot be reused by a radix prefix match).
        hits_a = hits_f = hits_l = 0
        run_a = run_f = run_l = True  # still in the leading run of hits
        refused = False
        for h in sampled:
            r = lru.access(h, tick, 0.0, est)
            if run_l and r > 0:
                hits_l += 1
            else:
                run_l = False
            r = all_.access(h, tick, k, est)
            if run_a and r > 0:
                hits_a += 1
            else:
                run_a = False
            r = lfu.access(h, tick, k, est, refused)
            if r < 0:
                refused = True
            if run_f and r > 0:
                hits_f += 1
            else:
                run_f = False
        d = self.cfg.duel_decay ** len(sampled)
        scores = self.scores
        scores[0] = scores[0] * d + hits_a
        scores[1] = scores[1] * d + hits_f
        scores[2] = scores[2] * d + hits_l
        scores[3] = scores[3] * d + len(sampled)
        v = self._lead_var
        v[0] = v[0] * d + (hits_a - hits_l) ** 2
        v[1] = v[1] * d + (hits_f - hits_l) ** 2
        if not all_.full():  # decide once the miniatures are nearly full
            return
        # TinyLFU admission only if its miniature beats admit-everything by ``admit_margin``
        # (page-level miniatures overstate what filtering buys a radix tree, whose deep pages
        # are useless once a parent is gone); hysteresis: leaving needs it to fall below par.
        # Under sustained thrash the policy gets more selective (seed section 8): par suffices.
        margin = 1.0 if (self.filtering or self.thrashing) else self.cfg.admit_margin
        self.mode_index = 1 if scores[1] > scores[0] * margin else 0

    # --- adaptive protection ------------------------------------------------------------------
    def on_miss(self, first_new_hash: bytes) -> None:
        """A request's first uncached page (once per request): learn from a ghost hit."""
        g = self._ghosts.pop(first_new_hash, None)
        if g is None:
            g = self._cold_ghosts.pop(first_new_hash, None)
            if g is None:
                return
        kind, pages = g
        gp = self._ghost_pages
        gp[kind] -= pages
        if self.eviction_order != "adaptive" or self.following != "adaptive":
            return  # ghosts of a fixed order say nothing about the adaptive one's parameters
        # a leaf of average size (over the ghost lists, this one included) moves log2 k by one step
        n_ghosts = len(self._ghosts) + len(self._cold_ghosts) + 1
        step = self.cfg.protect_step * pages * n_ghosts / (gp[0] + gp[1] + gp[2] + pages)
        # ARC's balance: a hit in the smaller ghost list counts for the size ratio.
        if kind == COLD:  # a cold prompt came back: age cold prompts less
            self.log_c -= step * max(1.0, (gp[0] + gp[1]) / max(1, gp[2]))
        else:
            self.log_c += step * max(1.0, gp[2] / max(1, gp[0] + gp[1]))
            if kind == PROTECTED:
                self.log_k += step * max(1.0, gp[0] / max(1, gp[1]))
            else:
                self.log_k -= step * max(1.0, gp[1] / max(1, gp[0]))
        bk, bc = self.cfg.protect_log_bound, self.cfg.cold_log_bound
        self.log_k = min(bk, max(-bk, self.log_k))
        self.log_c = min(bc, max(-bc, self.log_c))
        self.k = 2.0**self.log_k
        self.c = 2.0**self.log_c

    def on_evict(self, n_pages: int, pinned: bool = False, first_hash: bytes | None = None,
                 kind: int = UNPROTECTED, last_tick: float | None = None) -> None:  # fmt: skip
        """A leaf of ``n_pages`` left the device; ``kind`` is UNPROTECTED, PROTECTED or COLD."""
        self.stats.evicted_pages += n_pages
        if pinned:
            self.stats.evicted_pinned += n_pages
        self._record(evicts=n_pages)
        if last_tick is not None and kind != COLD:
            # Cold leaves are skipped: their tick was aged by c x the cycle at insertion, and
            # feeding that age back made the estimate grow geometrically (1.6e22 on a 4k-request
            # trace). Ages of warm leaves are real, hence at most the clock; clamp to be sure.
            age = max(0.0, self.tick - last_tick)
            if age > self.tick:
                age = float(self.tick)
                self.stats.cycle_clamped += 1
            self.cycle += 0.01 * (age - self.cycle)
        if first_hash is not None and n_pages:
            gp = self._ghost_pages
            for g in (self._ghosts, self._cold_ghosts):
                old = g.pop(first_hash, None)
                if old is not None:
                    gp[old[0]] -= old[1]
            cold = kind == COLD
            g = self._cold_ghosts if cold else self._ghosts
            g[first_hash] = (kind, n_pages)
            gp[kind] += n_pages
            cap = self.capacity_pages
            while (gp[2] if cold else gp[0] + gp[1]) > cap:
                kd, n = g.popitem(last=False)[1]
                gp[kd] -= n

    def frequency(self, page_hash: bytes) -> int:
        return self.sketch.estimate(page_hash)

    def node_frequency(self, hashes: list[bytes]) -> int:
        """Frequency of a run of pages (a tree node): its last counted page's estimate."""
        m = self.cfg.sketch_sample_mask
        for h in reversed(hashes):
            if not h[0] & m:
                return self.sketch.estimate(h)
        return self.sketch.estimate(hashes[-1]) if hashes else 0

    def admit_pages(self, new_hashes: list[bytes], victim_freq: int | None) -> int:
        """How many of a request's new (not yet cached) pages to keep. Prefix-consistent: a
        refusal drops the page and everything after it."""
        n = len(new_hashes)
        self.stats.pages_offered += n
        admitted = n
        if n and self.filtering and victim_freq is not None:
            # Admit the leading pages whose frequency beats the victim's (TinyLFU), at least the
            # first page if it does.
            # Pages are counted 1 in 4 (plus each request's last page); an uncounted page takes
            # the estimate of the next counted page after it, a lower bound of its own frequency
            # since frequency never grows with depth along a prefix chain.
            est, m = self.sketch.estimate, self.cfg.sketch_sample_mask
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
            if admitted < n:
                self.stats.admissions_refused += 1
        self.stats.pages_admitted += admitted
        self.stats.pages_rejected += n - admitted
        self._record(stores=admitted)
        return admitted

    # --- eviction ---------------------------------------------------------------------------
    def is_pinned(self, depth_tokens: int, freq: int) -> bool:
        return depth_tokens <= self.cfg.pin_max_tokens and freq >= self.cfg.pin_min_freq

    def pin_budget_pages(self) -> int:
        return int(self.capacity_pages * self.cfg.pin_budget_share)

    # --- thrash detection -------------------------------------------------------------------
    def _record(self, stores: int = 0, evicts: int = 0) -> None:
        self._win_stores += stores
        self._win_evicts += evicts
        if stores or not evicts:
            self._win_events += 1
        if self._win_events >= self.cfg.thrash_window:
            cfg = self.cfg
            hot = (self._win_evicts > cfg.thrash_ratio * max(1, self._win_stores)
                   and self._win_hits < cfg.thrash_hit_share * self._win_pages)  # fmt: skip
            self._hot_windows.append(hot)
            if len(self._hot_windows) == self._hot_windows.maxlen:
                if all(self._hot_windows):
                    self.thrashing = True
                elif not any(self._hot_windows):
                    self.thrashing = False
            if self.thrashing:
                self.stats.thrash_windows += 1
            self._win_stores = self._win_evicts = self._win_events = self._win_pages = self._win_hits = 0

    def check_invariants(self) -> None:
        """The safety duel's structures and the learned quantities are consistent and bounded."""
        lru, slru, lfu = self._shadows["lru"], self._shadows["slru"], self._shadows["lfu"]
        assert len(lru.d) <= lru.cap, "lru shadow over capacity"
        assert len(slru.prob) + len(slru.prot) <= slru.cap, "slru shadow over capacity"
        assert not (slru.prob.keys() & slru.prot.keys()), "slru shadow segments overlap"
        assert lfu.n == len(lfu.cnt) <= lfu.cap, "lfu shadow count"
        assert sum(len(b) for b in lfu.buckets.values()) == lfu.n and all(lfu.buckets.values()), "lfu buckets"
        assert all(lfu.cnt[h] == c for c, b in lfu.buckets.items() for h in b), "lfu bucket of a page"
        assert self.following in ("adaptive",) + FIXED_ORDERS, self.following
        assert not self._banned or self.following != "adaptive", "banned orders outlive their hold"
        assert self._credit == self._credit and self._credit <= 1e12, "credit not finite"
        bk, bc = self.cfg.protect_log_bound, self.cfg.cold_log_bound
        assert -bk <= self.log_k <= bk and -bc <= self.log_c <= bc, "learned k or c out of bounds"
        assert 0.0 <= self.cycle <= max(1.0, float(self.tick)), "LRU cycle out of bounds"
        for m in self._minis:
            assert len(m.prob) + len(m.prot) <= m.cap, "miniature over capacity"
            assert not (m.prob.keys() & m.prot.keys()), "miniature segments overlap"
        sc = self.scores
        assert len(sc) == 4 and min(sc) >= 0.0 and max(sc[:3]) <= sc[3] + 1e-6, f"duel scores {sc}"
        assert self._entry_lead >= 0.0 and self._entry_lead == self._entry_lead, "entry lead"
        assert min(self._lead_var) >= 0.0, "lead variances"
        gp = self._ghost_pages
        assert gp[0] + gp[1] <= self.capacity_pages + max((g[1] for g in self._ghosts.values()), default=0)
        assert min(gp) >= 0, "ghost page counts"

    def snapshot(self) -> dict:
        s = self.stats
        return {
            "thrashing": self.thrashing,
            "mode": str(self.mode),
            "admission_filtering": self.filtering,
            "duel_scores": {"all": round(self.scores[0], 1), "tinylfu": round(self.scores[1], 1),
                            "lru": round(self.scores[2], 1)},
            "protection_k": round(min(self.k, 1e9), 3),
            "cold_age_c": round(self.c, 3),
            "lru_cycle_requests": round(self.cycle, 1),
            "sketch_resets": self.sketch.resets,
            "following": self.following,
            "adaptive_mode": str(self.modes[self.mode_index]),
            "shadow_rate": round(self.shard_rate, 5),
            "shadow_lru_hit_rate": round(self._sh[1] / self._sh[0], 4) if self._sh[0] else 0.0,
            "real_sampled_hit_rate": round(self._sh[2] / self._sh[0], 4) if self._sh[0] else 0.0,
            "lru_model_bias": round(self._bias["lru"][0] / self._bias["lru"][1], 4) if self._bias["lru"][1] else 0.0,
            "shadow_hit_rates": {o: round(self._sh_hits[o] / self._sh[0], 4) if self._sh[0] else 0.0
                                 for o in FIXED_ORDERS},
            **s.__dict__,
        }
