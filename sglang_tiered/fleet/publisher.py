"""Publish the page hashes a server holds to the fleet hint index (Redis), off the request path.

Runs in the scheduler process of the first rank of each tree (TP rank 0; attention-TP rank 0 of
each DP rank under DP attention, and of each data-parallel replica: ``build.hint_rank``). The
scheduler thread only appends to a bounded queue (``on_store`` / ``on_remove`` / ``on_clear``: a
``put_nowait``; a full queue drops the event and counts it). A dropped store only leaves a page unclaimed; a dropped removal (or clear) makes the
thread start over (``resyncs``): it discards what is queued, withdraws every claim it holds and
forgets them, and publishes again only what is stored after (otherwise the page would stay in the
held set, refreshed every TTL/2: a stale claim kept alive for ever). Locality until the held pages
are stored again is the price. A daemon thread drains the queue in batches into one Redis pipeline, beats the
server's heartbeat, and re-publishes everything it believes the server holds every TTL/2 so live
entries never expire. Redis down or slow costs the request path nothing: the thread counts the
error, backs off, reconnects, and re-publishes the whole held set once Redis is back.

Imports ``redis`` (redis-py) lazily; no torch, no sglang.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from itertools import islice

from sglang_tiered.fleet.index import alive_key, ckey_key, holder_field, page_key

logger = logging.getLogger("sglang_tiered")

QUEUE_MAX = 65536  # pending events (each a list of page hashes)
# ... and pending page hashes in them all (about 64 MB): bounded in events alone, 600 events of
# 2,048 pages took 85 MB and the worst case was 9 GB (review, session 19)
QUEUE_PAGES = 1 << 20
HELD_MAX = 1 << 21  # page hashes remembered for refresh (bounded; oldest forgotten first)
# The held set (and the unsent removals) are plain dicts, in insertion order (a page stored again
# is moved to the end: popped and set), not OrderedDicts: ``list()`` of an OrderedDict of 2^20
# pages took 0.45 s in one C call (the refresh's copy of the held set every TTL/2, GIL held: every
# scheduler step waited), a dict's 0.02 s; and an OrderedDict is a container the cyclic GC walks
# (45 ms of every full collection in the scheduler's process at 2^20 pages), a dict of bytes to
# None is not tracked at all (session 40, bench/publisher_stall.py).
# One batch's writes, run by Redis: the pages to withdraw (HDEL), then those to claim (HSET +
# EXPIRE). As pipelined commands they cost 7.5 us of Python per claimed page and 3.3 per removed
# one in the scheduler's process (review, session 23: a refresh of 2^21 held pages took 17 s of
# CPU every 15 s); as a script's arguments, about 0.3 (bench/publish_cost.py, both in one run).
# A claimed page's hash with more than FIELDS_SWEPT fields also loses those older than the key's
# expiry: a live server refreshing a shared page kept every dead server's field in it for good
# (the expiry is per key; review, session 23), and with server ids new at every start it grew.
FIELDS_SWEPT = 16
WRITE_LUA = """
local sid, now, ttl, n = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local oldest = tonumber(now) - ttl
for i = 1, n do redis.call('HDEL', KEYS[i], sid) end
for i = n + 1, #KEYS do
  local k = KEYS[i]
  redis.call('HSET', k, sid, now)
  redis.call('EXPIRE', k, ttl)
  if redis.call('HLEN', k) > """ + str(FIELDS_SWEPT) + """ then
    local f = redis.call('HGETALL', k)
    for j = 1, #f, 2 do
      local t = tonumber(f[j + 1])
      if t == nil or t < oldest then redis.call('HDEL', k, f[j]) end
    end
  end
end
return #KEYS
"""
BATCH_PAGES = 4096
# With Redis down the thread folds everything queued into its held set (up to QUEUE_PAGES): in
# one go, that held the GIL for about 0.5 s, and a scheduler call that had to take the GIL back
# (``on_store``: the queue's and the count's locks, when the thread held them) waited out the
# switch interval (5 ms) each time: 60-165 ms at worst on one core (session 40, bench/publisher_stall.py).
# It folds FOLD_PAGES at a time and sleeps FOLD_PAUSE_S between (the GIL let go: the scheduler's
# thread takes it at once).
FOLD_PAGES = 2048
FOLD_PAUSE_S = 0.0005
# Nor does a clear or a forget-all (a dropped removal) touch the held set in one C call: ``list()``
# of 2^21 held pages took 43 ms and ``clear()`` 32 ms (each a GIL hold the scheduler waited out),
# and freeing the copy after the send as long. The held set is swapped for a fresh one and the old
# one joins the withdrawals (``_unsent``: swapped in whole, or poured a page at a time), which the
# connected round sends a batch at a time, taking each page out with ``popitem`` (review, session 41,
# bench/publisher_stall.py --event).


class IndexPublisher:
    def __init__(self, url: str, server_id: str, ttl_s: float = 30.0, *, start: bool = True,
                 socket_timeout_s: float = 0.5, cache_key=None, adapters=None, rank: str = ""):  # fmt: skip
        # routers read the cache identity from the index to compute the same page hashes, and the
        # startup LoRA adapters' ids (SGLang adds a request's adapter id to its namespace)
        self.adapters = dict(adapters or {})
        self.ttl_s = float(ttl_s)
        self.key_json = ""
        if cache_key is not None:
            self.set_key(cache_key)
        self.url = url
        self.server_id = server_id
        # the field this tree's claims go under (``rank``: a tree other than the server's first;
        # the heartbeat and the key are the server's, written alike by each of its trees)
        self.field = holder_field(server_id, rank)
        self.socket_timeout_s = socket_timeout_s
        self._q: queue.Queue = queue.Queue(maxsize=QUEUE_MAX)
        self._pages_lock = threading.Lock()
        self._queued_pages = 0  # page hashes in the queue's events (bounded by QUEUE_PAGES)
        self._held: dict = {}
        self._stop = threading.Event()
        self._client = None
        self._write = None  # WRITE_LUA, registered on the first batch (redis-py reloads it on NOSCRIPT)
        self._resync = True  # publish the whole held set on the next (re)connection
        self._overflowed = threading.Event()  # a removal was dropped: start over (_forget_all)
        # withdrawals not sent yet: removals sent while Redis failed (withdrawn first when it is
        # back: review, session 23, they were dropped and the pages stayed claimed), and the held set
        # of a clear or a forget-all (session 41); a page held again by the time its batch goes out
        # is not withdrawn. Bounded, the oldest age out instead
        self._unsent: dict = {}
        self.stats = {"published_pages": 0, "removed_pages": 0, "dropped_events": 0, "errors": 0,
                      "batches": 0, "refreshes": 0, "resyncs": 0, "lost_index": 0}  # fmt: skip
        self.connected = False
        self.last_error = ""
        self._thread = None
        if start:
            self._thread = threading.Thread(target=self._run, name="sglang-tiered-index", daemon=True)
            self._thread.start()

    def set_key(self, cache_key) -> None:
        """The identity routers read (re-set after a weight update re-seeds it)."""
        import json
        from dataclasses import asdict

        doc = asdict(cache_key)
        if self.adapters:
            doc["adapters"] = self.adapters
        doc["index_ttl_s"] = self.ttl_s  # (routers judge this server's claims by it)
        self.key_json = json.dumps(doc, sort_keys=True)

    @classmethod
    def from_config(cls, cfg, cache_key=None, adapters=None, rank: str = "") -> "IndexPublisher":
        logger.info("sglang-tiered: publishing the fleet hint index to %s as %s (ttl %gs)",
                    cfg.index_url, holder_field(cfg.server_id, rank), cfg.index_ttl_s)  # fmt: skip
        return cls(cfg.index_url, cfg.server_id, cfg.index_ttl_s, cache_key=cache_key, adapters=adapters, rank=rank)

    # ---------------------------------------------------------------- scheduler side (never blocks)
    def _put(self, item) -> None:
        n = len(item[1] or ())
        try:
            with self._pages_lock:
                if self._queued_pages + n > QUEUE_PAGES:
                    raise queue.Full
                self._q.put_nowait(item)
                self._queued_pages += n
        except queue.Full:
            self.stats["dropped_events"] += 1
            if item[0] != "s":  # a lost store costs a claim; a lost removal would leave one standing
                self._overflowed.set()

    def on_store(self, hashes) -> None:
        self._put(("s", list(hashes)))

    def on_remove(self, hashes) -> None:
        self._put(("r", list(hashes)))

    def on_clear(self) -> None:
        self._put(("c", None))

    def snapshot(self) -> dict:
        return {"enabled": True, "connected": self.connected, "queued_events": self._q.qsize(),
                "queued_pages": self._queued_pages,
                "held_pages": len(self._held), **self.stats}  # fmt: skip

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    # ---------------------------------------------------------------- background thread
    def _connect(self):
        import redis

        c = redis.Redis.from_url(self.url, socket_timeout=self.socket_timeout_s,
                                 socket_connect_timeout=self.socket_timeout_s)  # fmt: skip
        c.ping()
        return c

    def _drain(self, max_pages: int) -> list:
        items, n = [], 0
        while n < max_pages:
            try:
                it = self._q.get_nowait()
            except queue.Empty:
                break
            items.append(it)
            k = len(it[1] or ())
            with self._pages_lock:
                self._queued_pages -= k
            n += k + 1
        return items

    def _forget_all(self) -> None:
        """After a dropped removal: discard the queue and the held set, whose pages join the
        withdrawals (``_withdraw_held``).

        The flag is cleared before the queue is emptied, so every event queued before the drop
        (a store of the page whose removal was dropped, say) is discarded with it, and a drop
        during this is seen on the next round. Stores queued after it only lose their claim."""
        self._overflowed.clear()
        # through _drain, which keeps the page count: emptied with get_nowait, the count stayed at
        # the bound and every later event was dropped, for good (review, session 23)
        while self._drain(QUEUE_PAGES + QUEUE_MAX):
            pass
        self._withdraw_held()
        self.stats["resyncs"] += 1

    def _withdraw_held(self) -> None:
        """Start an empty held set; every page held joins the withdrawals (``_unsent``).

        No C call touches more than one page (review, session 41): the old held set is swapped in
        as the withdrawals when there are none, else the smaller of the two is poured into the
        larger a page at a time (``popitem``, so it is freed as it goes), with a pause every
        FOLD_PAGES (as ``_fold_queued``)."""
        old, self._held = self._held, {}
        u = self._unsent
        if len(old) > len(u):
            old, u = u, old
            self._unsent = u
        n = 0
        while old:
            u[old.popitem()[0]] = None
            n += 1
            if n % FOLD_PAGES == 0:
                time.sleep(FOLD_PAUSE_S)
        _trim(u)

    def _take_unsent(self, n: int) -> list:
        """Up to ``n`` withdrawals to send, taken out of ``_unsent`` one ``popitem`` at a time (a
        page held again since is dropped: not withdrawn). Put back (``_keep_unsent``) if the send fails."""
        u, held = self._unsent, self._held
        part: list = []
        while u and len(part) < n:
            h = u.popitem()[0]
            if h not in held:
                part.append(h)
        return part

    def _apply_local(self, items) -> tuple[list, list]:
        """Fold events into the held set; return (stored, removed) page hashes to send: each page's
        *last* event in the batch wins. ``_send`` issues all removals before all stores, so a page
        stored and then evicted within one batch (a short prompt under memory pressure, or any
        page during a flush) must be sent as removed only; sending it in both lists left it in the
        index as held until its entry aged out (TTL), a claim the router then trusted.

        A clear moves the held set to the withdrawals (``_withdraw_held``), which the round sends
        before these, each page unless held again by then (stored after the clear: session 41,
        before, the held set was copied into ``removed`` and cleared, two C calls over it all)."""
        stored: dict = {}
        removed: dict = {}
        held = self._held
        for op, hs in items:
            if op == "s":
                for h in hs:
                    held.pop(h, None)  # (to the end: the newest)
                    held[h] = None
                    removed.pop(h, None)
                    stored[h] = None
            elif op == "r":
                for h in hs:
                    held.pop(h, None)
                    stored.pop(h, None)
                    removed[h] = None
            else:
                self._withdraw_held()
                held = self._held
                stored.clear()
        _trim(held)
        return list(stored), list(removed)

    def _fold_queued(self) -> list:
        """Fold what is queued (as much as the queue holds, QUEUE_PAGES) into the held set,
        FOLD_PAGES at a time with a pause between (``FOLD_PAUSE_S``); return the removed pages."""
        removed: list = []
        for _ in range((QUEUE_PAGES + QUEUE_MAX) // FOLD_PAGES + 1):
            items = self._drain(FOLD_PAGES)
            if not items or self._stop.is_set():
                break
            removed += self._apply_local(items)[1]
            time.sleep(FOLD_PAUSE_S)
        return removed

    def _keep_unsent(self, *lists) -> None:
        u = self._unsent
        n = 0
        for hs in lists:
            for h in hs:
                u.pop(h, None)
                u[h] = None
                n += 1
                if n % FOLD_PAGES == 0:  # (up to HELD_MAX pages: with pauses, as _fold_queued)
                    time.sleep(FOLD_PAUSE_S)
        _trim(u)

    def _send(self, stored, removed) -> None:
        c = self._client
        now = str(int(time.time()))
        ttl = max(1, int(self.ttl_s * 4))
        sid = self.server_id
        field = self.field
        pipe = c.pipeline(transaction=False)
        # GET: the heartbeat as it was. Refreshed every ttl/2, it is gone only if Redis lost its
        # data (restarted empty, flushed, evicted): redis-py reconnects by itself, no error shows,
        # and before session 23 the held set came back only at the next refresh (review). Each
        # tree its own (``field``): on the server's one, the tree that wrote it first after the
        # loss found it gone and every other tree found it back, and kept its claims lost
        pipe.set(alive_key(field), now, ex=max(1, int(self.ttl_s)), get=True)
        if field != sid:  # (readers look at the server's; refreshed only while it exists: set
            # again here after a loss, the first tree, whose own heartbeat it is, found it back)
            pipe.set(alive_key(sid), now, ex=max(1, int(self.ttl_s)), xx=True)
        if self.key_json:
            pipe.set(ckey_key(sid), self.key_json, ex=max(1, int(self.ttl_s)))
        if (removed or stored) and self._write is None:
            self._write = c.register_script(WRITE_LUA)
        # one script call per BATCH_PAGES (a clear withdraws up to HELD_MAX pages: Redis serves
        # other clients between the calls)
        for i in range(0, len(removed), BATCH_PAGES):
            part = removed[i : i + BATCH_PAGES]
            self._write(keys=[page_key(h) for h in part], args=[field, now, ttl, len(part)], client=pipe)
        for i in range(0, len(stored), BATCH_PAGES):
            part = stored[i : i + BATCH_PAGES]
            self._write(keys=[page_key(h) for h in part], args=[field, now, ttl, 0], client=pipe)
        res = pipe.execute()
        if res and res[0] is None and not self._resync:
            self._resync = True  # (the heartbeat was missing: send everything held again)
            self.stats["lost_index"] += 1
        self.stats["published_pages"] += len(stored)
        self.stats["removed_pages"] += len(removed)
        self.stats["batches"] += 1

    def _run(self) -> None:
        backoff = 0.1
        last_refresh = 0.0
        while not self._stop.is_set():
            # withdrawn once, best effort: with Redis down they age out instead (never refreshed)
            if self._overflowed.is_set():
                self._forget_all()
            items = self._drain(BATCH_PAGES)
            stored, removed = self._apply_local(items)
            part: list = []  # withdrawals taken out of _unsent and not sent yet
            try:
                if self._client is None:
                    self._client = self._connect()
                    self.connected = True
                    self._resync = True
                while self._unsent:  # a batch at a time (pages held again since are not withdrawn)
                    part = self._take_unsent(BATCH_PAGES)
                    if part:
                        self._send([], part)
                    part = []
                now = time.monotonic()
                if self._resync or now - last_refresh >= self.ttl_s / 2:
                    # refresh (also after reconnecting): everything held, in batches, read a
                    # batch at a time (nothing else changes the held set meanwhile: this thread's)
                    it = iter(self._held)
                    part = list(islice(it, BATCH_PAGES))
                    self._send(part, removed)  # (once with nothing held: the heartbeat)
                    while len(part) == BATCH_PAGES:
                        part = list(islice(it, BATCH_PAGES))
                        if part:
                            self._send(part, [])
                    removed, stored = [], []
                    last_refresh, self._resync = now, False
                    self.stats["refreshes"] += 1
                elif stored or removed:
                    self._send(stored, removed)
                backoff = 0.1
            except Exception as exc:  # Redis down or slow: count, back off, resync later
                self.stats["errors"] += 1
                self.last_error = f"{type(exc).__name__}: {exc}"[:200]
                self.connected = False
                self._client = None
                self._resync = True
                # fold everything queued into the held set meanwhile (the resync sends it all): a
                # batch per back-off drained 4,096 pages per 2 s and the queue filled and dropped
                more = self._fold_queued()
                self._keep_unsent(part, removed, more)
                self._stop.wait(backoff)
                backoff = min(2.0, backoff * 2)
                continue
            if not items:
                self._stop.wait(0.05)


def _trim(d: dict) -> None:
    """Forget ``d``'s oldest keys past HELD_MAX (a dict keeps them in insertion order), a page at a
    time (up to HELD_MAX of them after ``_withdraw_held``: a list() of them, and freeing it, were
    C calls over them all; review, session 41)."""
    excess = len(d) - HELD_MAX
    if excess > 0:
        gone = [h for h in islice(d, excess)]  # (a Python loop: the GIL can switch between pages)
        while gone:
            del d[gone.pop()]
