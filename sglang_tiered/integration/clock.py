"""Logical time of use on tree nodes (``node.tiered_tick``), in request counts, never wall time.

Every TP rank must keep the same eviction order, so the order cannot come from
``time.monotonic()``. A time of use is the policy's request tick plus a sequence number within
that tick (``now``), so uses are ordered exactly as SGLang's monotonic stamps order them.
"""

from __future__ import annotations

from sglang_tiered.integration import node_state  # noqa: F401  (declares the node attributes)

MAX_SEQ_PER_TICK = 999_999  # sequence numbers are scaled by 1e-6 and must stay below one tick


class LogicalClock:
    def __init__(self, policy):
        self.policy = policy
        self.current = 0.0  # logical time of the cache call in progress
        self._seq = self._seq_tick = 0
        # Ticks the clock has run ahead of the policy's: a tick whose sequence numbers ran out
        # (more than MAX_SEQ_PER_TICK uses before the next request began: a scheduler refreshing
        # waiting requests' prefixes every round while long decodes run) carries into the next.
        # Before (session 34, a helper's hunt) later uses in that tick all had one stamp, and ties
        # went to the older node id instead of the later use: not SGLang's lru order.
        self.carried = 0

    def now(self) -> float:
        """A fresh logical time of use (also kept as ``current``), later than every earlier one."""
        t = self.policy.tick + self.carried
        if t != self._seq_tick:
            self._seq_tick, self._seq = t, 0
        self._seq += 1
        if self._seq > MAX_SEQ_PER_TICK:
            self.carried += 1
            t = self._seq_tick = t + 1
            self._seq = 1
        self.current = t + self._seq * 1e-6
        return self.current

    def stamp(self, node, root) -> None:
        """Record ``current`` on ``node`` and its ancestors (stops at the first one already
        stamped with it: its ancestors are too)."""
        tick = self.current
        while node is not root and node.tiered_tick != tick:
            node.tiered_tick = node.tiered_lru = tick
            node = node.parent


def bump_hits(node, root) -> None:
    """One more request used ``node`` and its ancestors (SGLang's ``hit_count``)."""
    while node is not root:
        node.hit_count += 1
        node = node.parent
