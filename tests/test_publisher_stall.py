"""With Redis down, the index publisher's thread folds its queue into its held set in slices,
letting go of the GIL between them (session 41).

In one go (up to QUEUE_PAGES, 2^20 pages) the fold held the GIL for about 0.5 s, and a scheduler
call (``on_store``) that had to take the GIL back waited out the switch interval each time: 60-165
ms at worst on one core (bench/publisher_stall.py). No Redis: the publisher points at a closed port."""

from __future__ import annotations

import os
import socket

from sglang_tiered.fleet import publisher as P


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_a_full_queue_is_folded_in_slices_with_pauses_when_redis_is_down(monkeypatch):
    """64k pages queued, Redis refused: the thread's first round folds every one of them into its
    held set (the resync sends them all), FOLD_PAGES (plus one event) at a time, with a pause
    (the GIL let go) after each slice; what the scheduler's side stores meanwhile is never slowed
    and the queue's page count goes back to 0."""
    p = P.IndexPublisher(f"redis://127.0.0.1:{_closed_port()}/0", "s", 30.0, start=False, socket_timeout_s=0.2)
    pages = [os.urandom(16) for _ in range(1 << 16)]
    for i in range(0, len(pages), 64):
        p.on_store(pages[i : i + 64])
    sizes, pauses = [], []
    apply_local, keep_unsent = p._apply_local, p._keep_unsent

    def counted(items):
        sizes.append(sum(len(hs or ()) for _, hs in items))
        return apply_local(items)

    def last(*lists):
        keep_unsent(*lists)
        p._stop.set()  # (one round)

    monkeypatch.setattr(p, "_apply_local", counted)
    monkeypatch.setattr(p, "_keep_unsent", last)
    monkeypatch.setattr(P.time, "sleep", lambda s: pauses.append(s))
    p._run()
    assert p.stats["errors"] == 1 and set(p._held) == set(pages) and p._queued_pages == 0 and p._q.empty()
    assert sizes[0] <= P.BATCH_PAGES + 64  # (the round's own batch, before it tried Redis)
    assert max(sizes[1:]) <= P.FOLD_PAGES + 64, max(sizes[1:])
    assert len(pauses) >= len(sizes) - 2, (len(pauses), len(sizes))
