"""With Redis down, the index publisher's thread folds its queue into its held set in slices,
letting go of the GIL between them (session 40).

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


def test_the_held_set_and_unsent_removals_are_dicts_the_gc_does_not_walk():
    """The held set and the unsent removals (up to HELD_MAX pages each) are dicts of bytes to None:
    not tracked by the cyclic GC (an OrderedDict of 2^20 pages cost 45 ms of every full collection
    in the scheduler's process), through stores, removals, a clear and a fold with Redis down."""
    import gc

    p = P.IndexPublisher(f"redis://127.0.0.1:{_closed_port()}/0", "s", 30.0, start=False, socket_timeout_s=0.2)
    a, b, c = os.urandom(16), os.urandom(16), os.urandom(16)
    p._apply_local([("s", [a, b, c]), ("r", [b]), ("s", [a])])
    assert list(p._held) == [c, a] and not gc.is_tracked(p._held)
    p._keep_unsent([a, b], [c], [a])
    assert list(p._unsent) == [b, c, a] and not gc.is_tracked(p._unsent)
    p._apply_local([("c", None), ("s", [b])])
    assert list(p._held) == [b] and not gc.is_tracked(p._held)


def test_the_held_set_forgets_its_oldest_past_the_bound(monkeypatch):
    """Past HELD_MAX the oldest pages (by their last store) are forgotten first, in the held set
    and in the unsent removals."""
    monkeypatch.setattr(P, "HELD_MAX", 4)
    p = P.IndexPublisher("redis://127.0.0.1:1/0", "s", 30.0, start=False)
    hs = [bytes([i]) * 16 for i in range(6)]
    p._apply_local([("s", hs[:4]), ("s", [hs[0]]), ("s", hs[4:])])
    assert list(p._held) == [hs[3], hs[0], hs[4], hs[5]]
    p._keep_unsent(hs[:4], [hs[1]], hs[4:])
    assert list(p._unsent) == [hs[3], hs[1], hs[4], hs[5]]


def test_a_refresh_sends_every_held_page_a_batch_at_a_time(monkeypatch):
    """The refresh (here after a reconnection) reads the held set a batch at a time (a copy of 2^20
    pages in one call held the GIL for 0.45 s as an OrderedDict) and sends each page once, in
    order, the removals with the first batch; with nothing held it still beats the heartbeat."""

    def one_round(p) -> list:
        sent = []

        def send(stored, removed):
            sent.append((list(stored), list(removed)))
            p._stop.set()  # (the round goes on to its end)

        monkeypatch.setattr(p, "_send", send)
        monkeypatch.setattr(p, "_connect", lambda: object())
        p._run()
        return sent

    p = P.IndexPublisher("redis://127.0.0.1:1/0", "s", 30.0, start=False)
    held = [os.urandom(16) for _ in range(2 * P.BATCH_PAGES + 5)]
    p._apply_local([("s", held)])
    p.on_remove([b"x" * 16])
    sent = one_round(p)
    assert [len(s) for s, _ in sent] == [P.BATCH_PAGES, P.BATCH_PAGES, 5]
    assert [h for s, _ in sent for h in s] == held and sent[0][1] == [b"x" * 16] and not sent[1][1]
    assert one_round(P.IndexPublisher("redis://127.0.0.1:1/0", "s", 30.0, start=False)) == [([], [])]
