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

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from sglang_tiered.core.sketch import FrequencySketch


@dataclass
class PolicyConfig:
    pin_min_freq: int = 8
    pin_max_tokens: int = 2048
    pin_budget_share: float = 0.05
    tinylfu_admission: bool = True
    thrash_ratio: float = 0.9
    thrash_window: int = 64  # checkpoints per thrash measurement window
    thrash_sustain: int = 2  # consecutive windows above the ratio to enter (and below to leave)
    sketch_sample_factor: int = 10
    duel_sample_mask: int = 7  # miniature caches see pages whose hash & mask == 0 (1 in 8)
    duel_decay: float = 0.9995  # per sampled reference; ~2,000-reference memory


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
    extra: dict = field(default_factory=dict)


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
        # Set dueling between two miniature page caches over a hash-sampled subset of pages, each
        # with capacity/8: one admits everything, one admits by TinyLFU. The real cache filters
        # admissions while the filtering miniature is winning (SHARDS-style spatial sampling).
        mini_cap = max(4, self.capacity_pages // (self.cfg.duel_sample_mask + 1))
        self._mini_cap = mini_cap
        self._mini_all: OrderedDict[bytes, None] = OrderedDict()
        self._mini_lfu: OrderedDict[bytes, None] = OrderedDict()
        self.duel_score_all = 0.0
        self.duel_score_lfu = 0.0
        self.filtering = False

    # --- per request (called once per request, from checkpoint) -----------------------------
    def observe(self, page_hashes: list[bytes], device_hit_pages: int) -> None:
        """Count the request's pages in the sketch (once per request) and feed the duel."""
        self.stats.requests += 1
        inc = self.sketch.increment
        for h in page_hashes:
            inc(h)
        if self.cfg.tinylfu_admission:
            self._duel(page_hashes)

    def _duel(self, page_hashes: list[bytes]) -> None:
        mask = self.cfg.duel_sample_mask
        a, b = self._mini_all, self._mini_lfu
        cap, est, decay = self._mini_cap, self.sketch.estimate, self.cfg.duel_decay
        for h in page_hashes:
            if h[0] & mask:
                continue
            self.duel_score_all *= decay
            self.duel_score_lfu *= decay
            if h in a:
                a.move_to_end(h)
                self.duel_score_all += 1.0
            else:
                a[h] = None
                if len(a) > cap:
                    a.popitem(last=False)
            if h in b:
                b.move_to_end(h)
                self.duel_score_lfu += 1.0
            elif len(b) < cap:
                b[h] = None
            else:
                victim = next(iter(b))
                if est(h) > est(victim):
                    del b[victim]
                    b[h] = None
        # Hysteresis: switch on only with a clear margin once the filtering miniature is full.
        if self.filtering:
            self.filtering = self.duel_score_lfu > self.duel_score_all
        else:
            self.filtering = len(b) >= cap and self.duel_score_lfu > self.duel_score_all * 1.1

    def frequency(self, page_hash: bytes) -> int:
        return self.sketch.estimate(page_hash)

    def admit_pages(self, new_hashes: list[bytes], victim_freq: int | None) -> int:
        """How many of a request's new (not yet cached) pages to keep. Prefix-consistent: a
        refusal drops the page and everything after it."""
        n = len(new_hashes)
        self.stats.pages_offered += n
        admitted = n
        if n and self.cfg.tinylfu_admission and self.filtering and victim_freq is not None:
            # Admit the leading pages whose frequency beats the victim's (TinyLFU), at least the
            # first page if it does.
            admitted = 0
            for h in new_hashes:
                if self.sketch.estimate(h) > victim_freq:
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
            "admission_filtering": self.filtering,
            "duel_scores": [round(self.duel_score_all, 1), round(self.duel_score_lfu, 1)],
            "sketch_resets": self.sketch.resets,
            **{k: v for k, v in s.__dict__.items() if k != "extra"},
        }
