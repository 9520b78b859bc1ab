"""The admission duel's page-level miniature of the device cache (set dueling, SHARDS-sampled):
probationary and protected pages in LRU order, protected ones aged ``k`` x the miniature's own
LRU cycle later (``k = 0`` is plain lru), and optionally TinyLFU admission. Used by
``AdaptivePolicy._duel`` (admit-all vs TinyLFU, and a plain-lru yardstick for the entry gate).

Invariants: I1 ``len(prob) + len(prot) <= cap``; I2 the segments are disjoint (``check``).

``MiniCache`` is the optional C extension's (``_bookkeeping.MiniCache``: the per-page loop in C,
issue #11, session 42) when it was built and ``SGLANG_TIERED_PURE_PYTHON`` is not ``1``;
otherwise ``MiniCachePy`` below, the reference the C is tested against, decision for decision
(tests/test_bookkeeping_c.py). ``MINI_IMPL`` says which: ``"c"`` or ``"python"``. The C one's
``prob`` and ``prot`` are copies (OrderedDicts, for tests and checks), not the live segments.
"""

from __future__ import annotations

from collections import OrderedDict

from sglang_tiered.core.keys import PURE_PYTHON


class MiniCachePy:
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

    def check(self) -> None:
        assert len(self.prob) + len(self.prot) <= self.cap, "miniature over capacity"
        assert not (self.prob.keys() & self.prot.keys()), "miniature segments overlap"

    def run(self, pages: list, tick: int, k: float, est) -> int:
        """One request's sampled pages in turn: a hit moves the page to the protected segment; a
        miss, once full, evicts the older head (protected heads shifted by ``k`` x the
        miniature's LRU cycle), unless TinyLFU refuses the page (then the rest of the request
        too: admission is prefix-consistent, like the real tree). Returns the hits in the
        leading run (a page past a miss cannot be reused by a radix prefix match)."""
        prob, prot, cap, tinylfu = self.prob, self.prot, self.cap, self.tinylfu
        age = self.age
        hits = 0
        leading = True
        refusing = False
        for h in pages:
            if h in prot:
                prot.move_to_end(h)
                prot[h] = tick
                hits += leading
                continue
            if h in prob:
                del prob[h]
                prot[h] = tick
                hits += leading
                continue
            leading = False
            if len(prob) + len(prot) >= cap:
                # the victim: eviction.unprotected_first with no ids (runs on every full miss)
                if prob:
                    victim = next(iter(prob))
                    where = prob
                    if prot and not prob[victim] <= prot[next(iter(prot))] + k * age:
                        where, victim = prot, next(iter(prot))
                else:
                    where, victim = prot, next(iter(prot))
                if tinylfu and (refusing or est(h) <= est(victim)):
                    refusing = True
                    continue
                age += 0.01 * (tick - where.pop(victim) - age)
            prob[h] = tick
        self.age = age
        return hits


try:
    from sglang_tiered.core._bookkeeping import MiniCache as _MiniCacheC
except ImportError:  # not built (no compiler: setup.py's extension is optional)
    _MiniCacheC = None

# SGLANG_TIERED_PURE_PYTHON=1: the reference even where the extension is built
MINI_IMPL = "c" if _MiniCacheC is not None and not PURE_PYTHON else "python"
MiniCache = _MiniCacheC if MINI_IMPL == "c" else MiniCachePy
