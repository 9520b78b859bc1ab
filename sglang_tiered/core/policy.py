"""Admission and eviction policy for the device tier (pure Python; page hashes in, decisions out).

What it does, and why (the Mooncake trace measured plain W-TinyLFU *losing* to LRU above ~3 %
capacity, DESIGN.md decision 2; we measured an ARC-style recency/frequency split losing to LRU at
5-20 % too, so it is not here):

* **Adaptive admission by set dueling.** Two miniature page caches run beside the real one over a
  hash-sampled 1-in-8 subset of pages, each with 1/8 of the capacity (SHARDS-style spatial
  sampling): one admits everything (LRU), one admits by TinyLFU (a new page enters only if its
  sketch frequency beats the LRU victim's). Their hit counts decay per sampled reference. While the
  filtering miniature is winning, the real cache filters admissions the same way (a request's new
  pages are kept only while their frequency beats the next eviction victim's); otherwise it admits
  everything and behaves exactly like LRU. So it is selective where the workload thrashes (small
  caches, scans) and LRU-like where reuse is recency-driven, and it finds out which by itself.
* **Pinning small hot prefixes.** Leaves within ``pin_max_tokens`` of the root whose sketch
  frequency reaches ``pin_min_freq`` are evicted only when nothing else is left (bounded budget),
  so one-shot prompts cannot evict system prompts.
* **Thrash detection** (evictions above 0.9x stores over sustained windows) is reported in stats.
* Reuse is counted once per request (in ``checkpoint``), never in ``match_prefix``.
* Everything is driven by event counts and deterministic hashes, so every TP rank reaches identical
  decisions.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from dataclasses import dataclass

from sglang_tiered.core.sketch import FrequencySketch


@dataclass(frozen=True)
class Mode:
    admission: str  # "all" | "tinylfu"
    # "lru"; "slru": pages reused by >= 2 requests go after all others; "lfu": fewest requests
    # first, then least recent (SGLang's lfu order)
    eviction: str

    def __str__(self) -> str:
        return f"{self.admission}+{self.eviction}"


class _MiniCache:
    """A page-level miniature of the device cache under one mode (for set dueling)."""

    def __init__(self, mode: Mode, capacity: int):
        self.mode = mode
        self.cap = capacity
        self.prob: OrderedDict[bytes, None] = OrderedDict()  # reused by < 2 requests
        self.prot: OrderedDict[bytes, None] = OrderedDict()  # reused by >= 2 (slru only)

    def full(self) -> bool:
        return len(self.prob) + len(self.prot) >= 0.75 * self.cap

    def _victim(self):
        if self.prob:
            return self.prob, next(iter(self.prob))
        return self.prot, next(iter(self.prot))

    def access(self, h: bytes, est, refusing: bool = False) -> float:
        """1.0 on a hit, 0.0 on an admitted miss, -1.0 on a refused miss."""
        prob, prot = self.prob, self.prot
        if h in prot:
            prot.move_to_end(h)
            return 1.0
        if h in prob:
            if self.mode.eviction == "slru":
                del prob[h]
                prot[h] = None
            else:
                prob.move_to_end(h)
            return 1.0
        if len(prob) + len(prot) >= self.cap:
            where, victim = self._victim()
            if self.mode.admission == "tinylfu" and (refusing or est(h) <= est(victim)):
                return -1.0
            del where[victim]
        prob[h] = None
        return 0.0


class _MiniLFU:
    """LFU miniature: evict the page reused by the fewest requests, least recent first."""

    def __init__(self, mode: Mode, capacity: int):
        self.mode = mode
        self.cap = capacity
        self.entries: dict[bytes, tuple[int, int]] = {}
        self.heap: list[tuple[int, int, bytes]] = []
        self.clock = 0

    def full(self) -> bool:
        return len(self.entries) >= 0.75 * self.cap

    def _peek(self) -> bytes:
        heap, entries = self.heap, self.entries
        while True:
            hits, t, h = heap[0]
            if entries.get(h) == (hits, t):
                return h
            heapq.heappop(heap)

    def access(self, h: bytes, est, refusing: bool = False) -> float:
        self.clock += 1
        e = self.entries.get(h)
        if e is not None:
            new = (e[0] + 1, self.clock)
            self.entries[h] = new
            heapq.heappush(self.heap, (new[0], new[1], h))
            return 1.0
        if len(self.entries) >= self.cap:
            victim = self._peek()
            if self.mode.admission == "tinylfu" and (refusing or est(h) <= est(victim)):
                return -1.0
            heapq.heappop(self.heap)
            del self.entries[victim]
        self.entries[h] = (1, self.clock)
        heapq.heappush(self.heap, (1, self.clock, h))
        if len(self.heap) > 4 * self.cap + 64:  # drop stale entries
            self.heap = [(v[0], v[1], k) for k, v in self.entries.items()]
            heapq.heapify(self.heap)
        return 0.0


@dataclass
class PolicyConfig:
    pin_min_freq: int = 8
    pin_max_tokens: int = 2048
    pin_budget_share: float = 0.05
    thrash_ratio: float = 0.9
    thrash_window: int = 64  # checkpoints per thrash measurement window
    thrash_sustain: int = 2  # consecutive windows above the ratio to enter (and below to leave)
    sketch_sample_factor: int = 10
    sketch_sample_mask: int = 3  # count pages whose first hash byte & mask == 0 (1 in 4)
    force_mode: str | None = None  # e.g. "tinylfu+slru": disable the duel, always use this mode
    # miniature caches see pages whose first hash byte & mask == 0 (1 in 8, a subset of the
    # counted pages, so their TinyLFU estimates are exact-sketch ones)
    duel_sample_mask: int = 7
    duel_decay: float = 0.9995  # per sampled reference; ~2,000-reference memory
    admit_margin: float = 1.1  # TinyLFU admission must beat admit-all by this factor to switch on


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


class AdaptivePolicy:
    def __init__(self, capacity_pages: int, config: PolicyConfig | None = None):
        self.cfg = config or PolicyConfig()
        self.capacity_pages = max(1, capacity_pages)
        self.sketch = FrequencySketch(self.capacity_pages, self.cfg.sketch_sample_factor)
        self.stats = PolicyStats()
        self._win_stores = 0
        self._win_evicts = 0
        self._win_events = 0
        self._hot_windows: deque[bool] = deque(maxlen=self.cfg.thrash_sustain)
        self.thrashing = False
        # Set dueling between miniature page caches over a hash-sampled 1-in-8 subset of pages,
        # each with capacity/8 (SHARDS-style spatial sampling), one per candidate mode
        # (admission x eviction order). The real cache runs the mode whose miniature wins.
        mini_cap = max(4, self.capacity_pages // (self.cfg.duel_sample_mask + 1))
        self._mini_cap = mini_cap
        # lfu is not a duel candidate: page-level miniatures cannot tell it from slru (measured:
        # identical scores), so it would only cost time. It stays available as a forced mode.
        self.modes = [Mode(adm, ev) for ev in ("lru", "slru") for adm in ("all", "tinylfu")]
        self.modes += [Mode(adm, "lfu") for adm in ("all", "tinylfu")]
        self._dueling = 4
        self._minis = [(_MiniLFU if m.eviction == "lfu" else _MiniCache)(m, mini_cap)
                       for m in self.modes[: self._dueling]]  # fmt: skip
        self.scores = [0.0] * self._dueling
        self.mode_index = 0  # admit everything, LRU: SGLang's default until evidence says otherwise
        self._decided = False
        if self.cfg.force_mode is not None:
            names = [str(m) for m in self.modes]
            if self.cfg.force_mode not in names:
                raise ValueError(f"force_mode must be one of {names}, got {self.cfg.force_mode!r}")
            self.mode_index = names.index(self.cfg.force_mode)

    # --- per request (called once per request, from checkpoint) -----------------------------
    def observe(self, page_hashes: list[bytes], device_hit_pages: int) -> None:
        """Count the request's pages in the sketch (once per request) and feed the duel."""
        self.stats.requests += 1
        inc = self.sketch.increment
        m = self.cfg.sketch_sample_mask
        for h in page_hashes:
            if not h[0] & m:
                inc(h)
        if page_hashes and page_hashes[-1][0] & m:
            inc(page_hashes[-1])  # the request's last page is always counted
        if self.cfg.force_mode is None:
            self._duel(page_hashes)

    @property
    def mode(self) -> "Mode":
        return self.modes[self.mode_index]

    @property
    def filtering(self) -> bool:
        return self.modes[self.mode_index].admission == "tinylfu"

    @property
    def eviction_order(self) -> str:
        return self.modes[self.mode_index].eviction

    def _duel(self, page_hashes: list[bytes]) -> None:
        mask = self.cfg.duel_sample_mask
        est, decay = self.sketch.estimate, self.cfg.duel_decay
        minis, scores = self._minis, self.scores
        # Like the real tree: a miniature that refuses a page of this request refuses the rest of
        # it too (admission is prefix-consistent), and only the leading run of hits counts (a
        # page past a miss cannot be reused by a radix prefix match).
        refused = [False] * len(minis)
        missed = [False] * len(minis)
        sampled = False
        for h in page_hashes:
            if h[0] & mask:
                continue
            sampled = True
            for i, mini in enumerate(minis):
                r = mini.access(h, est, refused[i])
                if r < 0:
                    refused[i] = True
                if r <= 0:
                    missed[i] = True
                    r = 0.0
                elif missed[i]:
                    r = 0.0
                scores[i] = scores[i] * decay + r
        if not sampled or not minis[0].full():  # decide once the miniatures are nearly full
            return
        self._choose_mode()

    def _choose_mode(self) -> None:
        """Two stages, each with hysteresis: the eviction order whose admit-everything miniature
        wins, then TinyLFU admission only if its miniature beats admit-everything under that
        order by ``admit_margin`` (page-level miniatures overstate what filtering buys a radix
        tree, whose deep pages are useless once a parent is gone)."""
        scores, modes, cur = self.scores, self.modes, self.modes[self.mode_index]
        idx = {(m.admission, m.eviction): i for i, m in enumerate(modes[: self._dueling])}
        orders = ("lru", "slru")
        best = max(orders, key=lambda o: scores[idx[("all", o)]])
        order = cur.eviction
        # The first decision (once the miniatures are full) takes the best order outright.
        switch = 1.0 if not self._decided else 1.02
        if scores[idx[("all", best)]] > scores[idx[("all", order)]] * switch:
            order = best
        self._decided = True
        base, filt = scores[idx[("all", order)]], scores[idx[("tinylfu", order)]]
        margin = 1.0 if (cur.admission == "tinylfu" and cur.eviction == order) else self.cfg.admit_margin
        self.mode_index = idx[("tinylfu" if filt > base * margin else "all", order)]

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

    def on_evict(self, n_pages: int, pinned: bool = False) -> None:
        self.stats.evicted_pages += n_pages
        if pinned:
            self.stats.evicted_pinned += n_pages
        self._record(evicts=n_pages)

    # --- thrash detection -------------------------------------------------------------------
    def _record(self, stores: int = 0, evicts: int = 0) -> None:
        self._win_stores += stores
        self._win_evicts += evicts
        if stores or not evicts:
            self._win_events += 1
        if self._win_events >= self.cfg.thrash_window:
            hot = self._win_evicts > self.cfg.thrash_ratio * max(1, self._win_stores)
            self._hot_windows.append(hot)
            if len(self._hot_windows) == self._hot_windows.maxlen:
                if all(self._hot_windows):
                    self.thrashing = True
                elif not any(self._hot_windows):
                    self.thrashing = False
            if self.thrashing:
                self.stats.thrash_windows += 1
            self._win_stores = self._win_evicts = self._win_events = 0

    def snapshot(self) -> dict:
        s = self.stats
        return {
            "thrashing": self.thrashing,
            "mode": str(self.mode),
            "admission_filtering": self.filtering,
            "duel_scores": {str(m): round(x, 1) for m, x in zip(self.modes[: self._dueling], self.scores)},
            "sketch_resets": self.sketch.resets,
            **s.__dict__,
        }
