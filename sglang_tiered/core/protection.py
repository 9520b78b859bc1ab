"""Adaptive protection of reused context (a mixin of ``AdaptivePolicy``): the protection factor
``k`` and the cold-age factor ``c`` learned ARC-style from ghost hits on evicted leaves, and the
LRU cycle time they scale (bounded: see ``on_evict``). See the docstring of ``core/policy.py``.
"""

from __future__ import annotations

from collections import OrderedDict

UNPROTECTED, PROTECTED, COLD = 0, 1, 2  # kinds of evicted leaves (ghost list)


class ProtectionLearning:
    def _init_protection(self) -> None:
        """Learned k and c, the LRU cycle estimate and the ghost lists."""
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
