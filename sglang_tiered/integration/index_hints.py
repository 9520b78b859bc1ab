"""Notifications to the fleet hint index (``sglang_tiered/fleet/publisher.py``).

The listener is told which page hashes this server holds (device or T1) and which it dropped.
Hints only: a missed or late notification changes where a router sends a request, never what a
request computes. The listener only queues (never on the request path's critical section).
"""

from __future__ import annotations


def tree_pages(root) -> set:
    """The page hashes of every node of the device tree under ``root`` (those that have them:
    the pages ``IndexHints`` was told of)."""
    held, stack = set(), list(root.children.values())
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        if n.tiered_hashes:
            held.update(n.tiered_hashes)
    return held


def tree_ticks(root) -> dict:
    """The last page hash of every node under ``root`` (a node not hashed: its id, which matches
    no page, so two trees compare unequal) -> its lru tick (``tiered_lru``: its last use): with
    the same pages, the same keys are the same node boundaries, and the ticks the order lru
    evicts the real tree in."""
    out, stack = {}, list(root.children.values())
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        out[n.tiered_hashes[-1] if n.tiered_hashes else ("node", n.id)] = n.tiered_lru
    return out


class IndexHints:
    """I1 (with a listener): ``device`` == the page hashes of the device tree's nodes, so that a
    page T1 drops is reported gone only when the device does not hold it too (T1 keeps copies of
    device pages: write-through, write-ahead, promoted pages; reporting those as gone, the index
    said less than the server then served for 63 of 500 requests, 15k of their cached tokens, on
    one simulated server of bench/fleet_sim.py's multi-tenant N = 8)."""

    def __init__(self):
        self.listener = None  # on_store(hashes), on_remove(hashes), on_clear(); optional snapshot()
        self.device: set = set()  # page hashes on the device (kept only while a listener listens)
        # also told of every device store and removal: the policy (its safety duel prices a
        # switch back to lru by the pages lru holds and the device does not)
        self.policy = None

    def notify(self, kind: str, hashes) -> None:
        if self.listener is not None and hashes:
            getattr(self.listener, kind)(hashes)

    def device_stored(self, hashes) -> None:
        """Pages entered the device tree."""
        if self.policy is not None and hashes:
            self.policy.real_stored(hashes)
        if self.listener is not None and hashes:
            self.device.update(hashes)
            self.listener.on_store(hashes)

    def device_removed(self, hashes, kept=None) -> None:
        """Pages left the device tree; ``kept(h)``: T1 still holds h (then it stays held)."""
        if self.policy is not None and hashes:
            self.policy.real_removed(hashes)
        if self.listener is not None and hashes:
            self.device.difference_update(hashes)
            gone = hashes if kept is None else [h for h in hashes if not kept(h)]
            if gone:
                self.listener.on_remove(gone)

    def t1_forgot(self, page_hash) -> None:
        """T1 dropped its copy of a page: gone from this server unless the device holds it."""
        if self.listener is not None and page_hash not in self.device:
            self.listener.on_remove([page_hash])

    def clear(self) -> None:
        if self.policy is not None:
            self.policy.real_cleared()
        self.device.clear()
        if self.listener is not None:
            self.listener.on_clear()

    def snapshot(self):
        return self.listener.snapshot() if hasattr(self.listener, "snapshot") else None
