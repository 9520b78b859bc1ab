"""What the index publisher's thread costs the scheduler's calls while Redis is down.

The publisher (``sglang_tiered/fleet/publisher.py``) points at a closed port (``--stalled``: a
server that accepts and never answers, so each try waits out the socket timeout), with
``--pages`` page hashes queued (events of ``--event-pages``). Its thread then starts, fails to
connect, and folds the queue into its held set; the main thread (the scheduler's side) calls
``on_store`` with a new event every ``--gap-us`` meanwhile and times each call, and each step (the
call and the gap: a wait for the GIL anywhere in it). Run it on one
core (``taskset -c 1``): the scheduler and the publisher's thread share the GIL, and a call that
has to take the GIL back waits for the other thread's switch interval (5 ms) each time.

    taskset -c 1 python -m bench.publisher_stall [--pages 1048576] [--seconds 3]

``--event clear`` / ``--event forget`` (session 41): ``--pages`` page hashes are held instead
(2^21, HELD_MAX, by default then), the thread's first round is let run (Redis refused, or with
``--redis`` the refresh of them all), and the timed window starts with a clear (``on_clear``) or a
dropped removal (the thread forgets everything it holds); ``--seconds`` covers the thread's work on
it, and with ``--redis`` the withdrawals.

Prints one JSON line: the calls' p50/p99/max in microseconds, how many, the steps' longest delay,
and the publisher's stats.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import threading
import time


def main(argv=None) -> dict:
    from sglang_tiered.fleet import publisher as pub

    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=1 << 20)
    ap.add_argument("--event-pages", type=int, default=64)
    ap.add_argument("--store-pages", type=int, default=16, help="pages of each timed on_store")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--gap-us", type=float, default=200.0, help="the scheduler's own work between calls")
    ap.add_argument("--stalled", action="store_true", help="a server that accepts and never answers")
    ap.add_argument("--gc-off", action="store_true", help="no cyclic GC (its full passes apart from the GIL's)")
    ap.add_argument("--redis", default=None, help="a live Redis (redis://...): the pages are held, not queued, and "
                                                  "the thread's first round re-publishes them all (a refresh)")
    ap.add_argument("--full-gc", action="store_true", help="also time gc.collect() with the pages held")
    ap.add_argument("--event", choices=("clear", "forget"), default=None,
                    help="the pages held; time a clear, or a forget-all after a dropped removal")
    a = ap.parse_args(argv)
    if a.event and a.pages == ap.get_default("pages"):
        a.pages = pub.HELD_MAX
    if a.gc_off:
        gc.disable()

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    if a.stalled:
        srv.listen(16)  # (accepted by the kernel, never read or answered)
    else:
        srv.close()  # a closed port: connection refused
    url = a.redis or f"redis://127.0.0.1:{port}/0"
    p = pub.IndexPublisher(url, "stall-bench", 30.0, start=False, socket_timeout_s=0.5)
    n = 0
    while n < a.pages:
        k = min(a.event_pages, a.pages - n)
        p.on_store([os.urandom(16) for _ in range(k)])
        n += k
        if (a.redis or a.event) and n % 16384 < a.event_pages:
            p._apply_local(p._drain(pub.QUEUE_PAGES))  # (held, as after a long run)
    if a.redis or a.event:
        p._apply_local(p._drain(pub.QUEUE_PAGES))
    queued = p.snapshot()["queued_pages"]
    gc_ms = None
    if a.full_gc:
        t0 = time.perf_counter()
        gc.collect()
        gc_ms = round((time.perf_counter() - t0) * 1e3, 1)
    t = threading.Thread(target=p._run, daemon=True)
    t.start()
    if a.event:  # (the thread's first round over: Redis refused, or the refresh sent)
        while not (p.stats["errors"] if not a.redis else p.stats["refreshes"]):
            time.sleep(0.01)
        time.sleep(0.2)
        if a.event == "clear":
            p.on_clear()
        else:
            p._overflowed.set()  # (as a dropped removal does: _put)
    times, steps = [], []
    end = time.perf_counter() + a.seconds
    i = 0
    prev = time.perf_counter_ns()
    while time.perf_counter() < end:
        hs = [i.to_bytes(16, "little", signed=False) for _ in range(a.store_pages)]
        i += 1
        t0 = time.perf_counter_ns()
        p.on_store(hs)
        times.append(time.perf_counter_ns() - t0)
        spin = time.perf_counter() + a.gap_us / 1e6  # (the scheduler's own Python work)
        while time.perf_counter() < spin:
            pass
        now = time.perf_counter_ns()
        steps.append(now - prev - a.gap_us * 1e3)  # (a scheduler step's delay: the call, and any wait for the GIL)
        prev = now
    p.close()
    srv.close()
    times.sort()
    out = {"queued_pages": queued, "held_before": n if a.redis or a.event else 0, "redis": bool(a.redis), "stalled": a.stalled,
           "gc": not a.gc_off, "full_gc_ms": gc_ms, "event": a.event, "calls": len(times),
           "p50_us": round(times[len(times) // 2] / 1e3, 1), "p99_us": round(times[int(len(times) * 0.99)] / 1e3, 1),
           "max_us": round(times[-1] / 1e3, 1), "over_1ms": sum(x > 1e6 for x in times),
           "step_delay_max_ms": round(max(steps) / 1e6, 1), "step_delays_over_10ms": sum(x > 1e7 for x in steps),
           "unsent_after": len(p._unsent),
           "publisher": {k: v for k, v in p.snapshot().items() if k in ("held_pages", "dropped_events", "errors",
                                                                         "queued_pages", "refreshes", "resyncs",
                                                                         "removed_pages")}}  # fmt: skip
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
