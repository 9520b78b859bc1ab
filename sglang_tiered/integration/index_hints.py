"""Notifications to the fleet hint index (``sglang_tiered/fleet/publisher.py``).

The listener is told which page hashes this server holds (device or T1) and which it dropped.
Hints only: a missed or late notification changes where a router sends a request, never what a
request computes. The listener only queues (never on the request path's critical section).
"""

from __future__ import annotations


class IndexHints:
    def __init__(self):
        self.listener = None  # on_store(hashes), on_remove(hashes), on_clear(); optional snapshot()

    def notify(self, kind: str, hashes) -> None:
        if self.listener is not None and hashes:
            getattr(self.listener, kind)(hashes)

    def clear(self) -> None:
        if self.listener is not None:
            self.listener.on_clear()

    def snapshot(self):
        return self.listener.snapshot() if hasattr(self.listener, "snapshot") else None
