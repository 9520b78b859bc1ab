"""Thrash detection (a mixin of ``AdaptivePolicy``): evictions above ``thrash_ratio`` x stores
while under ``thrash_hit_share`` of requested pages hit, over ``thrash_sustain`` consecutive
windows of ``thrash_window`` checkpoints (eviction work that buys no hits, seed section 8).
"""

from __future__ import annotations

from collections import deque


class ThrashDetector:
    def _init_thrash(self) -> None:
        """Window counters and the sustained-window history."""
        self._win_stores = 0
        self._win_evicts = 0
        self._win_events = 0
        self._win_pages = 0
        self._win_hits = 0
        self._hot_windows: deque[bool] = deque(maxlen=self.cfg.thrash_sustain)
        self.thrashing = False

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
