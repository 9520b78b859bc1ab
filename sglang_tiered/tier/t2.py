"""T2: a fleet-wide DRAM tier on Mooncake Store, behind T1 (issue #14, seed section 5).

* **What goes there.** Pages that leave this server's T1 (T1's LRU victims), when the policy values
  them (sketch frequency >= ``min_freq``), are copied out of their T1 slots *before* the slot is
  reused and handed to a bounded, value-ordered store queue (``core/store_queue.py``: the lowest
  valued run leaves when it is full, one-shots are refused under pressure). A worker thread writes
  each run with one ``batch_put_from`` from a registered staging buffer. T2 full or down: the run
  is dropped and counted, never a stall (the scheduler only copies host->host under T1's lock).
* **What comes back.** On a request whose prefix continues past the device and T1, one batched
  ``batch_is_exist`` finds the leading run T2 holds, one ``batch_get_into`` fetches it into a
  registered staging buffer, every page's header is checked (magic, layout digest, page hash,
  tenant), and the verified leading pages are written into T1 slots; the existing T1 promotion
  then moves them to the device, all or nothing. Anything else (timeout, error, short read, bad
  header) is a clean miss: the request recomputes.
* **Identity.** An object is one page in the canonical TP-independent layout
  ``[kv][layer][kv_head][token][dim]`` (all KV heads), between a 64-byte header and a 64-byte
  footer that repeats the header's first 48 bytes. Its key is
  ``sgt/v3/<model tag>/<tenant>/<generation>/<chained page hash>``; the page hash already carries
  tenant, model, weights digest, KV dtype, RoPE, attention implementation and software versions,
  so a tenant or a changed model never finds another's page. The format version is in the key, so
  an object of another format is never read (review, session 23: such an object kept its key
  poisoned for good, re-read by every fetch). The model tag and tenant in the key let
  invalidation name what to remove by pattern, fleet-wide (``remove_by_regex``).
* **Invalidation is a generation.** A tenant's (or every tenant's) invalidation moves it to a new
  generation, which is part of every key this server reads and writes from then on: it never
  reads an object written under an older one, whoever wrote it and whenever. Before session 23 the
  server refused objects *written* before its invalidation (a time in the header); a peer not told
  of it kept re-writing the tenant's old KV with new write times, which passed (review, session
  23). Servers share a tenant's pages only while they agree on its generation: invalidate every
  server with the same ``generation`` (the router's ``/cache/invalidate`` does; a server given none
  uses its clock). The generations are kept in a file per model (``cache_root()/t2``), so a restart
  does not read the old ones again (before: the floors were in memory, and objects a peer kept
  leased were served after a restart); an invalidation appends one line to its log, folded into
  the file off the scheduler thread (session 39: rewriting the whole file cost ~0.2 s per
  invalidation at 65,536 tenants). Removal is still attempted (space), off the scheduler
  thread, and once more after the lease.
* **Torn reads.** A read checks the header (magic, format, layout digest, page hash, tenant) and
  that the footer repeats it: an object whose memory was reused by a put while it was being read
  (its lease ran out) shows a footer of the new object. The fetch size is capped so its deadline
  stays within half the lease, and its transfer time at ``min_gbps`` within ``FETCH_BUDGET_S``
  (the scheduler waits for it; at the default 0.1 GB/s that is 200 MB per fetch).
* **Never a stall on the request path.** Every store call runs on a helper thread and is waited
  for with a deadline (``timeout_ms`` plus the transfer time at ``min_gbps``); a call that fails or
  misses its deadline opens a circuit breaker (T2 skipped for 1 s, doubling to 60 s while it keeps
  failing). A put the store answers with error codes only (full, or refused) closes the writes
  alone for that time: the store is up and its objects are still worth reading (before, a full
  store stopped every read too). A staging buffer whose call timed out is not reused until that call returns, so a late
  transfer can never land in a buffer another request reads.
  At most one call per helper thread is queued or running: with both blocked (a hung store) a
  call is refused at once, a failure, not queued behind them (session 39: one more queued call
  each time the breaker let one through, and the helpers, joined at interpreter exit, held the
  process).
* **Limits.** TP = 1 only (ranks of a TP > 1 server would have to agree on every probe, which needs
  a collective on the request path; T2 turns off there with a warning), and one pipeline stage
  (keys name no stage). Host memory beside T1: three staging buffers of ``max_run_pages`` objects
  and up to ``queue_pages`` pages copied out for the store queue plus a run of victims not yet
  offered to it, beside T1's size
  (``t2_host_bytes``): T2 is built only where the host has that memory available (session 24;
  before, it was neither counted nor checked), and ``/cache/stats`` reports it (``host_bytes``).
"""

from __future__ import annotations

import concurrent.futures as cf
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import queue
import re
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import asdict, dataclass, field

import torch

from sglang_tiered.core.store_queue import StoreQueue
from sglang_tiered.tier.host_pool import PoolLayout
from sglang_tiered.tier.t2_config import T2Config

logger = logging.getLogger("sglang_tiered")

HEADER_BYTES = 64  # and as many for the footer
MAGIC = b"SGT2"
FORMAT_VERSION = 3  # 2: the write time after the tenant (session 18); 3: footer, generation keys (23)
_ID_BYTES = 40  # magic, version, pad, layout digest, page hash, tenant: what a read must match
_FOOTER_MATCH = 48  # the footer repeats the header's id and write time
_INVALIDATIONS = 65536  # tenants whose generation is kept (older ones: folded into everyone's)
_MASK = 2**64 - 1
KEY_ROOT = "sgt"
KEY_FORMAT = f"v{FORMAT_VERSION}"  # the object format, in every key: another format's objects are never read
FETCH_BUDGET_S = 2.0  # a fetch's transfer time at min_gbps, at most (the scheduler waits for it)
OBJECT_NOT_FOUND = -704  # Mooncake's code for a key that is not there (gone since the existence check)
# Mooncake's code for an object larger than the buffer it is read into ("Buffer too small for key"):
# never one of ours (every object of this format is ``object_bytes``), a miss for its key alone
BUFFER_OVERFLOW = -600
LEASE_MARGIN_S = 0.05  # past a lease we took (measured from our call's return, after the master granted it)
_LOG_COMPACT_BYTES = 1 << 20  # the generations log is folded into the file past this (off the scheduler thread)


def _fold(alls: int, tenants: dict) -> tuple[int, dict]:
    """Generations as kept (in memory, in the file): tenants at or below "all" dropped, and past
    ``_INVALIDATIONS`` the oldest folded into "all"; the rest oldest first."""
    kept = sorted((g, t) for t, g in tenants.items() if g > alls)
    if len(kept) > _INVALIDATIONS:
        alls = max(alls, kept[-_INVALIDATIONS - 1][0])
        kept = kept[-_INVALIDATIONS:]
    return alls, {t: g for g, t in kept}


def _log_line(who: str, gen: int) -> str:
    """One line of the generations log: ``<tenant|all> <generation> <crc32 of the two>``."""
    body = f"{who} {gen}"
    return f"{body} {zlib.crc32(body.encode()):08x}\n"


def _log_fields(line: str) -> tuple[str, str]:
    """(who, generation) of a log line; ``ValueError`` unless it is whole. A line torn by a failed
    write (a full disk) and run into the next append can still parse as numbers, e.g. tenant
    ``1234`` torn to ``12`` and followed by ``34 <gen>``: another tenant's line, and tenant 1234's
    invalidation gone (its old objects readable after a restart). The checksum refuses it, and an
    unreadable log moves every tenant to a new generation (``_load_generations``)."""
    body, _, crc = line.rpartition(" ")
    if not body or f"{zlib.crc32(body.encode()):08x}" != crc:
        raise ValueError(f"torn or foreign generations log line {line[:80]!r}")
    who, _, gen = body.partition(" ")
    return who, gen


class _Busy(RuntimeError):
    """The helper threads are all still blocked in earlier calls (the store is not answering)."""


class _Helpers:
    """Daemon helper threads running store calls, with at most ``max_pending`` calls queued or
    running. Review, session 39: with a hung store (a master that accepts and never answers) a
    ``ThreadPoolExecutor`` queued one more call behind its blocked threads each time the breaker
    let one through (without bound), and its threads, joined at interpreter exit, kept the process
    from exiting. A call past the bound is refused at once (``_Busy``): a failure, as a timeout is."""

    def __init__(self, workers: int, max_pending: int, name: str):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._max = max_pending
        self.pending = 0  # calls queued or running
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, fn, *args) -> cf.Future:
        with self._lock:
            if self._closed:
                raise RuntimeError("T2 helpers shut down")
            if self.pending >= self._max:
                raise _Busy(f"{self.pending} store calls still unanswered")
            self.pending += 1
        fut: cf.Future = cf.Future()
        self._q.put((fut, fn, args))
        return fut

    def _done(self) -> None:
        with self._lock:
            self.pending -= 1

    def _work(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fut, fn, args = item
            try:
                if fut.set_running_or_notify_cancel():
                    try:
                        res = fn(*args)
                    except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                        fut.set_exception(exc)
                    else:
                        fut.set_result(res)
            finally:
                self._done()

    def shutdown(self, wait: bool = False, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
        if cancel_futures:
            while True:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
                    self._done()
        for _ in self._threads:
            self._q.put(None)
        if wait:
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join()


def object_bytes(layout: PoolLayout) -> int:
    """One T2 object: a page in T1's canonical layout between its header and footer."""
    return 2 * HEADER_BYTES + layout.page_bytes


def fetch_pages(cfg, layout) -> int:
    """Pages per fetch: its deadline (``timeout_ms`` + the bytes at ``min_gbps``) within
    ``FETCH_BUDGET_S`` and within half the lease (an object whose lease runs out mid-read may be
    reused by a put: review, session 23: 256 pages of a 70B model had a 13.6 s deadline, past the
    10 s lease). 0: not even one page's read ends within half the lease (``build_t2`` keeps T2 off)."""
    budget = FETCH_BUDGET_S  # the transfer's share of the deadline
    if cfg.lease_ms:
        budget = min(budget, cfg.lease_ms / 2e3 - cfg.timeout_ms / 1e3)
    per_page = object_bytes(layout) / (cfg.min_gbps * 1e9)
    return max(0, min(cfg.max_run_pages, int(budget / per_page)))


# ---------------------------------------------------------------------- stats
@dataclass
class T2Stats:
    probes: int = 0  # batched existence checks made
    probe_pages_hit: int = 0  # pages T2 said it holds (leading runs)
    fetched_pages: int = 0  # verified pages written into T1 (then promoted as T1 hits)
    fetched_bytes: int = 0
    fetch_seconds: float = 0.0  # exists + get + verify + copy into T1
    bad_pages: int = 0  # short reads or headers that did not match: treated as misses
    oversized_pages: int = 0  # objects larger than a page's object (foreign): misses, removed after the lease
    stale_pages: int = 0  # (before session 23; generations in the keys replace the write-time check)
    offered_pages: int = 0  # T1 victims offered (after the value filter)
    filtered_pages: int = 0  # T1 victims below min_freq
    stored_pages: int = 0  # written by the worker
    stored_bytes: int = 0
    store_seconds: float = 0.0
    dropped_pages: int = 0  # dropped here: the store was full or down (see T2Tier.dropped_pages for the total)
    failures: int = 0  # calls that errored or missed their deadline
    skipped_down: int = 0  # probes or writes skipped while the breaker was open
    put_refused: int = 0  # puts the store answered with error codes only (full): writes paused
    invalidations: int = 0
    removed_objects: int = 0
    removed_bad: int = 0  # objects removed because they failed the checks (another format, torn)


class _Breaker:
    """A pause that doubles while its cause repeats: ``trip`` pauses for ``backoff`` seconds (1 s,
    doubling to 60 s), ``ok`` resets it. T2 keeps two: one for every call (errors, missed
    deadlines) and one for writes alone (the store refused a whole put: full)."""

    __slots__ = ("until", "backoff")

    def __init__(self):
        self.until = 0.0
        self.backoff = 1.0

    @property
    def closed(self) -> bool:
        return time.monotonic() >= self.until

    def left_s(self) -> float:
        return round(max(0.0, self.until - time.monotonic()), 3)

    def trip(self) -> float:
        """Pause now; returns the pause's length."""
        pause = self.backoff
        self.until = time.monotonic() + pause
        self.backoff = min(60.0, pause * 2)
        return pause

    def ok(self) -> None:
        self.backoff = 1.0


@dataclass
class _Staging:
    """A registered buffer of ``pages`` objects; busy while a store call may still write it."""

    buf: torch.Tensor
    busy: bool = False  # in use by a fetch or a put
    late: bool = False  # a call that missed its deadline may still write it
    ptr: int = field(init=False)

    @property
    def free(self) -> bool:
        return not (self.busy or self.late)

    def __post_init__(self):
        self.ptr = self.buf.data_ptr()


def t2_host_bytes(layout: PoolLayout, cfg: T2Config) -> int:
    """Host memory T2 takes beside T1 at most: three staging buffers of ``max_run_pages``
    objects (two for reads, one for writes), one object (the re-read of an object found bad),
    ``queue_pages`` pages copied out of T1 for the store queue, and up to a run
    (``max_run_pages``) of T1's victims copied out and not yet offered to it, beside a full queue
    (review, session 41: they were not counted)."""
    return (3 * cfg.max_run_pages + 1) * object_bytes(layout) + (cfg.queue_pages + cfg.max_run_pages) * layout.page_bytes


def layout_digest(layout: PoolLayout) -> bytes:
    """8 bytes naming the page format (not the pool size): layers, heads, page size, dim, dtype."""
    spec = f"{FORMAT_VERSION}|{layout.layers}|{layout.kv_heads}|{layout.page_size}|{layout.head_dim}|{layout.dtype}"
    return hashlib.blake2b(spec.encode(), digest_size=8).digest()


def _generations_doc(doc) -> tuple[int, dict]:
    """("all", {tenant: generation}) of a generations file (``TypeError``/``ValueError`` when it
    is not one); tenants at or below "all" are left out (it decides for them)."""
    if not isinstance(doc, dict):
        raise TypeError("not a JSON object")
    alls = int(doc.get("all", 0) or 0)
    raw = doc.get("tenants") or {}
    if not isinstance(raw, dict):
        raise TypeError("'tenants' is not an object")
    tenants = {int(t): int(g) for t, g in raw.items()}
    return alls, {t: g for t, g in tenants.items() if g > alls}


class _Run(list):
    """A store job's page data, with the generation its keys are written under (taken when the
    pages left T1: a job running across an invalidation keeps the old one)."""

    gen = 0


class T2Tier:
    """T2 behind one server's T1 pool (``pool``: a ``HostPool``; ``lock``: the ``HostTier`` lock
    that guards it). ``model_tag``: short hex naming the model identity (first key component).
    ``state_path``: the file that keeps the invalidation generations across restarts (None: kept
    in memory only)."""

    def __init__(self, client, pool, lock, *, cfg: T2Config, model_tag: str, value_of=None, state_path=None):
        self.client = client
        self.pool = pool
        self.lock = lock
        self.cfg = cfg
        self.model_tag = model_tag
        self.value_of = value_of  # page hash -> sketch frequency, None where the sketch has no count
        lay = pool.layout
        self.layout = lay
        self.obj_bytes = object_bytes(lay)
        self.digest = layout_digest(lay)
        self.run = cfg.max_run_pages
        self.fetch_pages = max(1, fetch_pages(cfg, lay))  # (build_t2 keeps T2 off where it is 0)
        self.state_path = state_path
        self.stats = T2Stats()
        self.decision = "on"
        self.breaker = _Breaker()  # every call
        self.write_breaker = _Breaker()  # writes alone: a store that refuses puts (full) is up for reads
        self._invalidated: OrderedDict = OrderedDict()  # tenant hash -> its generation (last invalidation)
        self._invalidated_all = 0  # every tenant's generation is at least this (invalidation of all)
        self._closed = False
        self._compacting: threading.Thread | None = None  # the generations log's fold, when running
        self._load_generations()
        # at most one call per helper: with both blocked (a hung store) a call is refused, not queued
        self._calls = _Helpers(2, 2, "sglang-tiered-t2")
        # removals: off the scheduler thread, and off the helpers fetches wait on (space only: past
        # REMOVALS_PENDING a removal is given up, the retries after the lease come again)
        self._removals = _Helpers(1, self.REMOVALS_PENDING, "sglang-tiered-t2-rm")
        self._retries: dict = {}  # pattern -> its pending retry (one per pattern)
        self._retry_lock = threading.Lock()  # (timers pop their own entry)
        self._read = [_Staging(self._alloc(self.run)) for _ in range(2)]
        self._write = _Staging(self._alloc(self.run))
        self._verify = _Staging(self._alloc(1))  # the removal thread's re-read of an object found bad
        self._stage_lock = threading.Lock()
        self._closed = False
        self._missed: OrderedDict = OrderedDict()  # first page hashes T2 just said it lacks
        self._victims: list = []  # (hash, tenant, frequency, page data) copied out of T1
        self.queue = StoreQueue(cfg.queue_pages, self._put_job, threaded=True, name="sglang-tiered-t2-store")

    REMOVALS_PENDING = 64

    def start(self) -> None:
        """Take T1's victims from now on (only once the tier is attached and on: a tier built and
        then refused, e.g. slower than recompute, must not copy victims nobody drains)."""
        self.pool.victim_listener = self.on_victim

    def _alloc(self, pages: int) -> torch.Tensor:
        t = torch.zeros(pages * self.obj_bytes, dtype=torch.uint8)
        self.client.register(t)
        return t.view(pages, self.obj_bytes)

    # ------------------------------------------------------------------ keys and headers
    def generation(self, tenant: int) -> int:
        """The tenant's generation: its last invalidation here (or of all), 0 if none."""
        return max(self._invalidated_all, self._invalidated.get(tenant, 0))

    def key(self, h: bytes, tenant: int, gen: int | None = None) -> str:
        g = self.generation(tenant) if gen is None else gen
        return f"{KEY_ROOT}/{KEY_FORMAT}/{self.model_tag}/{tenant & _MASK:016x}/{g:x}/{h.hex()}"

    def _old_generations(self, tenant: int | None, gen: int, spare=()) -> str:
        """The regex of this model's objects of ``tenant`` (None: every tenant but those in
        ``spare``) under any generation but ``gen`` (the one just moved to: the fleet's new pages
        stay; review, session 23. Mooncake's regexes are ECMAScript: the lookahead works on a
        real master)."""
        if tenant is None:
            who = "".join(f"(?!{t & _MASK:016x}/)" for t in spare) + "[0-9a-f]{16}"
        else:
            who = f"{tenant & _MASK:016x}"
        return f"^{KEY_ROOT}/{KEY_FORMAT}/{self.model_tag}/{who}/(?!{gen:x}/)"

    def _headers(self, hashes: list, tenant: int, written_ns: int = 0) -> torch.Tensor:
        stamp = written_ns.to_bytes(8, "little")
        rows = [MAGIC + FORMAT_VERSION.to_bytes(2, "little") + b"\0\0" + self.digest + h
                + (tenant & _MASK).to_bytes(8, "little") + stamp for h in hashes]  # fmt: skip
        hdr = torch.zeros(len(hashes), HEADER_BYTES, dtype=torch.uint8)
        filled = torch.frombuffer(bytearray(b"".join(rows)), dtype=torch.uint8).view(len(hashes), -1)
        hdr[:, : filled.shape[1]] = filled
        return hdr

    def _data_view(self, staging: torch.Tensor, n: int) -> torch.Tensor:
        """The page payloads of the first ``n`` staged objects as ``[n, kv, layer, head, token, dim]``."""
        lay = self.layout
        return staging[:n, HEADER_BYTES : HEADER_BYTES + lay.page_bytes].view(lay.torch_dtype).view(
            n, 2, lay.layers, lay.kv_heads, lay.page_size, lay.head_dim)  # fmt: skip

    # ------------------------------------------------------------------ breaker and deadlines
    @property
    def up(self) -> bool:
        """False while the circuit breaker skips T2 (after an error or a missed deadline)."""
        return self.breaker.closed

    def available(self) -> bool:
        if not self.up:
            self.stats.skipped_down += 1
            return False
        return True

    def may_hold(self, first: bytes, tenant: int) -> bool:
        """Worth asking T2 for a run starting at page ``first``? (cheap: the caller hashes the
        rest of the run only when this says yes)"""
        return not self._recently_missed(first) and self.available()

    def _failed(self, what: str, exc=None) -> None:
        self.stats.failures += 1
        pause = self.breaker.trip()
        if self.stats.failures == 1 or pause >= 60:
            logger.warning("sglang-tiered: T2 %s failed (%s); skipping T2 for %.0f s", what, exc or "error", pause)

    @property
    def writes_up(self) -> bool:
        """False while puts are skipped: the breaker is open, or the store refused a whole put."""
        return self.up and self.write_breaker.closed

    def _refused(self, codes) -> None:
        """The store answered a put with error codes only (full, or refusing): pause the writes
        alone, 1 s doubling to 60 s while it keeps refusing; reads go on."""
        self.stats.put_refused += 1
        pause = self.write_breaker.trip()
        if self.stats.put_refused == 1 or pause >= 60:
            logger.warning("sglang-tiered: T2 refused a put (codes %s); pausing writes for %.0f s", codes, pause)

    def _call(self, what: str, fn, *args, nbytes: int = 0, staging: _Staging | None = None):
        """Run one store call on a helper thread with a deadline; None on error or timeout."""
        deadline = self.cfg.timeout_ms / 1e3 + nbytes / (self.cfg.min_gbps * 1e9)
        try:
            fut = self._calls.submit(fn, *args)
        except RuntimeError as exc:  # executor shut down
            self._failed(what, exc)
            return None
        try:
            return fut.result(timeout=deadline)
        except cf.TimeoutError:
            if staging is not None:  # a late transfer may still write it: keep it out of use
                staging.late = True
                fut.add_done_callback(lambda _f: setattr(staging, "late", False))
            self._failed(what, f"no answer within {deadline * 1e3:.0f} ms")
        except Exception as exc:  # noqa: BLE001 - a failed transfer is a miss, never an error
            self._failed(what, exc)
        return None

    # ------------------------------------------------------------------ read path
    MISS_MEMO_S = 2.0  # a page T2 lacked is not asked for again for this long

    def _recently_missed(self, h: bytes) -> bool:
        t = self._missed.get(h)
        if t is None:
            return False
        if time.monotonic() - t < self.MISS_MEMO_S:
            return True
        del self._missed[h]
        return False

    def fetch(self, hashes: list, tenant: int) -> int:
        """Bring the leading run of ``hashes`` that T2 holds into T1. Returns how many of the
        leading pages T1 holds afterwards from this fetch (0: nothing, the caller recomputes)."""
        hashes = hashes[: self.fetch_pages]
        if not hashes or not self.may_hold(hashes[0], tenant):
            return 0
        t0 = time.perf_counter()
        gen = self.generation(tenant)
        keys = [self.key(h, tenant, gen) for h in hashes]
        n = self._leading_run(keys, hashes[0])
        stage = next((s for s in self._read if s.free), None) if n else None
        if stage is None:
            return 0
        stage.busy = True
        try:
            good, bad_first = self._read_verified(stage, keys[:n], hashes[:n], tenant)
            landed = self._into_t1(hashes[:good], stage.buf, tenant) if good else 0
        finally:
            stage.busy = False
        if bad_first:
            # an object that fails the checks stays bad: removed once the lease our read just
            # took on it is over (Mooncake keeps a read object), and not read again until then
            # (before session 23 every fetch re-read it, and a correct put could not replace it).
            # Only if it is still bad then: see _check_bad (review, session 39)
            self._remember_miss(hashes[0], hold_s=self._lease_s())
            self.stats.removed_bad += 1
            self._schedule_bad_check(keys[0], hashes[0], tenant)
        self.stats.fetched_pages += landed
        self.stats.fetched_bytes += landed * self.layout.page_bytes
        self.stats.fetch_seconds += time.perf_counter() - t0
        return landed

    def _lease_s(self) -> float:
        return self.cfg.lease_ms / 1e3 + 1.0

    def _object_ok(self, obj: torch.Tensor, h: bytes, tenant: int) -> bool:
        """The checks a read makes, on one object's bytes: the header its key promises, and a
        footer that repeats it."""
        ob = self.obj_bytes
        want = self._headers([h], tenant)[0, :_ID_BYTES]
        return bool(torch.equal(obj[:_ID_BYTES], want)
                    and torch.equal(obj[ob - HEADER_BYTES : ob - HEADER_BYTES + _FOOTER_MATCH], obj[:_FOOTER_MATCH]))  # fmt: skip

    def _schedule_bad_check(self, key: str, h: bytes, tenant: int) -> None:
        """Remove the object under ``key`` once our read's lease is over, if it is still bad then.
        Review, session 39: the removal was by key, now and again after the lease, whatever the
        key held by then: a correct object a peer wrote there since (the bad one evicted), or the
        correct object a torn or garbled read mistook for a bad one, was removed."""
        if self.cfg.lease_ms <= 0:  # no lease: check now
            self._submit_removal(self._check_bad, key, h, tenant)
            return
        timer = threading.Timer(self.cfg.lease_ms / 1e3 + LEASE_MARGIN_S, self._bad_timer, args=(key, h, tenant))
        self._keep_timer(("bad", key), timer)

    def _bad_timer(self, key: str, h: bytes, tenant: int) -> None:
        with self._retry_lock:
            self._retries.pop(("bad", key), None)
        self._submit_removal(self._check_bad, key, h, tenant)

    def _check_bad(self, key: str, h: bytes, tenant: int) -> int:
        """Removal thread: re-read the object under ``key``; remove it only if it still fails the
        checks. Mooncake has no conditional remove, and our re-read leases the object: where the
        removal is refused for that lease, it is tried once more right after it (the object can
        be replaced only once it is gone, so what is removed then is the object found bad, unless
        it was evicted and the page written again within ``LEASE_MARGIN_S``: a lost hit at worst,
        never a wrong page)."""
        st, ob = self._verify, self.obj_bytes
        got = self.client.get([key], [st.ptr], [ob])
        if not got or (got[0] != ob and got[0] != BUFFER_OVERFLOW):
            return 0  # gone, or unreadable now: nothing of ours to remove
        if got[0] == ob and self._object_ok(st.buf[0], h, tenant):
            return 0  # a correct object is there now (the one found bad went, or the read was torn)
        pattern = "^" + re.escape(key) + "$"
        n = self.client.remove_regex(pattern)
        if isinstance(n, int) and n > 0:
            return n
        if self.cfg.lease_ms > 0:  # refused for the lease our re-read took: once more after it
            timer = threading.Timer(self.cfg.lease_ms / 1e3 + LEASE_MARGIN_S, self._bad_final, args=(key, pattern))
            self._keep_timer(("bad", key), timer)
        return 0

    def _bad_final(self, key: str, pattern: str) -> None:
        with self._retry_lock:
            self._retries.pop(("bad", key), None)
        self._remove_async(pattern)

    def _remember_miss(self, first: bytes, hold_s: float = 0.0) -> None:
        """Not asked for again for ``MISS_MEMO_S`` (plus ``hold_s``)."""
        self._missed[first] = time.monotonic() + hold_s
        self._missed.move_to_end(first)
        if len(self._missed) > 4096:
            self._missed.popitem(last=False)

    def _leading_run(self, keys: list, first: bytes) -> int:
        """One batched existence check: how many leading pages T2 holds (0 on any failure)."""
        self.stats.probes += 1
        found = self._call("exists", self.client.exists, keys)
        if found is None:
            return 0
        if found and found[0] < 0:  # an error code, not "absent": the store is not answering
            self._failed("exists", f"code {found[0]}")
            return 0
        n = next((i for i, f in enumerate(found) if f != 1), len(found))
        if n == 0:
            self.breaker.ok()
            # match_prefix runs on every admission attempt of a waiting request: do not ask
            # the store again for the same first page right away
            self._remember_miss(first)
        self.stats.probe_pages_hit += n
        return n

    def _read_verified(self, stage: _Staging, keys: list, hashes: list, tenant: int) -> tuple[int, bool]:
        """One batched read into ``stage``; returns how many leading pages arrived whole with the
        header their key promises (page hash, tenant, page format) and a footer that repeats it,
        and whether the first page arrived but failed those checks."""
        ob, n = self.obj_bytes, len(keys)
        got = self._call("get", self.client.get, keys, [stage.ptr + i * ob for i in range(n)], [ob] * n,
                         nbytes=n * ob, staging=stage)  # fmt: skip
        if got is None:
            return 0, False
        self.stats.oversized_pages += got.count(BUFFER_OVERFLOW)
        if got and got[0] == BUFFER_OVERFLOW:
            # a foreign object under the first key, larger than an object of ours: a miss for this
            # key, found bad (removed after our read's lease, if still so). Review, session 42: it
            # was a failed call, and tripped the breaker: one such object turned T2 off for every
            # key, 1 s doubling to 60 s each time a request asked for it.
            self.stats.bad_pages += n
            return 0, True
        if got and got[0] < 0 and got[0] != OBJECT_NOT_FOUND:
            # the store listed the object and could not move it (-800: its replica is on a peer
            # that died, until the master drops that peer, ~10 s): a failed call, as an exception
            # is. Before (session 30), each such read waited ~1 s on the scheduler thread, and
            # every admission attempt of a waiting request read it again.
            self._remember_miss(hashes[0])
            self._failed("get", f"code {got[0]}")
            return 0, False
        whole = next((i for i, g in enumerate(got) if g != ob), len(got))
        good = whole
        if good:
            buf = stage.buf[:good]
            want = self._headers(hashes[:good], tenant)[:, :_ID_BYTES]
            ok = (buf[:, :_ID_BYTES] == want).all(dim=1)
            ok &= (buf[:, ob - HEADER_BYTES : ob - HEADER_BYTES + _FOOTER_MATCH] == buf[:, :_FOOTER_MATCH]).all(dim=1)
            ok = ok.tolist()
            good = ok.index(False) if False in ok else good
        self.stats.bad_pages += n - good
        if good:
            self.breaker.ok()
        return good, whole > 0 and good == 0

    def _into_t1(self, hashes: list, staging: torch.Tensor, tenant: int) -> int:
        """Write verified staged pages into T1 slots (T1's own victims go to T2 as usual)."""
        pool = self.pool
        with self.lock:
            pairs = pool.reserve(hashes, evict=True)
            if pairs:
                pos = {h: i for i, h in enumerate(hashes)}
                rows = [pos[h] for h, _ in pairs]
                slots = torch.tensor([s for _, s in pairs], dtype=torch.int64)
                src = self._data_view(staging, len(hashes))  # [n, kv, layer, head, token, dim]
                if rows != list(range(len(hashes))):  # some pages were already in T1
                    src = src[torch.tensor(rows, dtype=torch.int64)]
                pool.begin_write(slots.tolist())
                pool.data.index_copy_(3, slots, src.permute(1, 2, 3, 0, 4, 5))
                pool.commit(pairs, tenant)
            self.flush()
            return pool.leading_hits(hashes)

    # ------------------------------------------------------------------ write path
    def on_victim(self, h: bytes, slot: int, tenant: int) -> None:
        """``HostPool.victim_listener``: a T1 slot is about to be reused (caller holds T1's lock).
        A valued page is copied out now (its slot is overwritten next) and waits for ``flush``."""
        freq = self.value_of(h) if self.value_of is not None else None
        if freq is None:  # the sketch does not count this page (sampled): no evidence either way
            freq = self.cfg.min_freq
        elif freq < self.cfg.min_freq:
            self.stats.filtered_pages += 1
            return
        self._victims.append((h, tenant, freq, self.pool.data[:, :, :, slot].clone()))
        if len(self._victims) >= self.run:
            self.flush()

    def flush(self) -> None:
        """Offer the copied-out victims to the store queue as runs (one job per tenant and run)."""
        if not self._victims:
            return
        victims, self._victims = self._victims, []
        by_tenant: dict = {}
        for v in victims:
            by_tenant.setdefault(v[1], []).append(v)
        for tenant, items in by_tenant.items():
            hashes = [h for h, _, _, _ in items]
            data = _Run(d for _, _, _, d in items)  # per page [kv, layer, head, token, dim]; the worker stages them
            data.gen = self.generation(tenant)  # now: a job running across an invalidation keeps it
            freq = max(1, min(f for _, _, f, _ in items))
            self.stats.offered_pages += len(items)
            # a refused run is counted by the queue (filtered or value-dropped): see dropped_pages
            self.queue.offer(hashes, hashes, freq * len(items), frequency=freq, tenant=tenant, ctx=data)

    def _put_job(self, job) -> None:
        """Worker: one batched put of a run from the registered staging buffer."""
        n = len(job.hashes)
        if not n:
            return
        if not self.writes_up:
            self.stats.skipped_down += n
            self.stats.dropped_pages += n
            return
        t0 = time.perf_counter()
        data = job.ctx  # n pages [kv, layer, head, token, dim], copied out of T1 (jobs are never fenced)
        with self._stage_lock:
            st = self._write
            if not st.free:  # the last put missed its deadline and may still read the buffer
                self.stats.dropped_pages += n
                return
            ob = self.obj_bytes
            hdr = self._headers(job.hashes, job.tenant, time.time_ns())
            st.buf[:n, :HEADER_BYTES] = hdr
            st.buf[:n, ob - HEADER_BYTES :] = hdr  # the footer: a read that was overtaken by a put shows it
            view = self._data_view(st.buf, n)
            for i, page in enumerate(data):
                view[i].copy_(page)
            keys = [self.key(h, job.tenant, data.gen) for h in job.hashes]
            res = self._call("put", self.client.put, keys, [st.ptr + i * ob for i in range(n)], [ob] * n,
                             nbytes=n * ob, staging=st)  # fmt: skip
        if res is None:
            self.stats.dropped_pages += n
            return
        stored = sum(1 for r in res if r == 0)
        if res and all(r < 0 for r in res):  # full or refusing: pause writes (drops are counted)
            self._refused(sorted(set(res))[:3])
        self.stats.stored_pages += stored
        self.stats.stored_bytes += stored * self.layout.page_bytes
        self.stats.dropped_pages += n - stored  # full store, or already there under lease
        self.stats.store_seconds += time.perf_counter() - t0
        if stored:
            self.breaker.ok()
            self.write_breaker.ok()
            if data.gen != self.generation(job.tenant):
                # invalidated while this put was in flight (an invalidation does not wait for it):
                # its objects went in after that removal; removed now (space only: never read)
                self._remove_async(self._old_generations(job.tenant, self.generation(job.tenant)))

    # ------------------------------------------------------------------ invalidation
    def invalidate(self, *, tenant: int | None = None, everything: bool = False, generation: int | None = None) -> int:
        """Move ``tenant`` (or every tenant) to a new generation: this server reads and writes its
        pages under new keys from now on, so it never serves what was in T2 before, whoever wrote
        it. ``generation``: the new one (ns; a fleet invalidated together passes one value, so its
        servers keep sharing; None: now on this server's clock); it is raised above the current
        one when it is not (an invalidation always moves). Its objects under every generation are
        removed off the scheduler thread (space; a read object is leased and removed by the retry
        after ``lease_ms``). Returns the new generation."""
        if tenant is None and not everything:
            return 0
        self.stats.invalidations += 1
        # an invalidation always moves: above the tenant's generation, and for all of them above
        # every tenant's (review, session 23: "all" at an earlier clock than a tenant's own
        # invalidation moved that tenant back, and its file entry brought the old one back later)
        floor = self.generation(tenant)
        if everything and self._invalidated:
            floor = max(floor, max(self._invalidated.values()))
        gen = max(generation if generation is not None else time.time_ns(), floor + 1)
        if everything:
            self._invalidated_all = max(self._invalidated_all, gen)
            self._invalidated.clear()
        else:
            inv = self._invalidated
            inv.pop(tenant, None)
            inv[tenant] = gen
            if len(inv) > _INVALIDATIONS:  # the oldest's becomes everyone's floor (stricter: keys move)
                self._invalidated_all = max(self._invalidated_all, inv.popitem(last=False)[1])
        self._append_generation(None if everything else tenant, gen)
        # victims copied out of T1 before now, not yet offered: under the old generation, dropped
        self._victims = [v for v in self._victims if not (everything or v[1] == tenant)]
        # not waiting for a put in flight (review, session 41: the scheduler thread waited for it,
        # up to its whole deadline with the store slow): its pages are copies, written under the
        # generation they were taken at (``_Run.gen``), which this server never reads again; a put
        # that lands after the removal below removes its objects itself (``_put_job``). Until it
        # returns, its pages' new-generation copies are not queued (the queue keeps the first
        # offer of a page): a store lost, never a wrong one
        self.queue.cancel_where(lambda j: everything or j.tenant == tenant, wait=False)
        scope = None if everything else tenant
        self._remove_with_retry(self._old_generations(scope, gen), ("gen", scope))
        return gen

    def _remove_with_retry(self, pattern: str, scope) -> None:
        """Remove now and once more after the lease (a read object cannot be removed before). One
        retry per ``scope`` (a tenant, all, or one key): a later invalidation's replaces it."""
        self._remove_async(pattern)
        self._keep_timer(scope, threading.Timer(self._lease_s(), self._retry_remove, args=(pattern, scope)))

    def _keep_timer(self, scope, timer: threading.Timer) -> None:
        """Start ``timer`` as the one pending retry of ``scope`` (a later one replaces it)."""
        timer.daemon = True
        with self._retry_lock:
            if self._closed:
                return
            old = self._retries.pop(scope, None)
            if old is not None:
                old.cancel()
            if len(self._retries) >= 1024:  # bounded: the oldest retries are given up (space only)
                for p in list(self._retries)[:512]:
                    self._retries.pop(p).cancel()
            self._retries[scope] = timer
        timer.start()

    def _retry_remove(self, pattern: str, scope) -> None:
        with self._retry_lock:
            self._retries.pop(scope, None)
        if scope[0] == "gen":
            # made now, not at the invalidation: a later one may have moved the tenant (or every
            # tenant) to a newer generation, whose objects the fleet is writing and reading; the
            # pattern of then removed them all (a helper's hunt)
            pattern = self._stale_generations(scope[1])
            if pattern is None:
                return
        self._remove_async(pattern)

    def _stale_generations(self, tenant: int | None) -> str | None:
        """The pattern of the objects of ``tenant`` (None: every tenant) under a generation older
        than its current one, as things stand now (None: cannot say; space only, skipped)."""
        if tenant is not None:
            return self._old_generations(tenant, self.generation(tenant))
        for _ in range(3):
            try:  # (the scheduler thread may be adding a tenant's invalidation)
                moved = list(self._invalidated)
                break
            except RuntimeError:
                continue
        else:
            return None
        if len(moved) > 256:  # their pages keep their own retries; a pattern this long is not worth it
            return None
        return self._old_generations(None, self._invalidated_all, spare=moved)

    def _remove_async(self, pattern: str) -> None:
        """Remove the objects matching ``pattern``, on the removal thread (never waited for)."""
        self._submit_removal(self.client.remove_regex, pattern)

    def _submit_removal(self, fn, *args) -> None:
        if self._closed:
            return
        try:
            fut = self._removals.submit(fn, *args)
        except RuntimeError:  # shut down, or REMOVALS_PENDING still waiting (a hung store): space only
            return
        fut.add_done_callback(self._removed)

    def _removed(self, fut) -> None:
        try:
            n = fut.result()
        except Exception:  # noqa: BLE001 - space only: the keys are unreachable anyway
            return
        if isinstance(n, int) and n > 0:
            self.stats.removed_objects += n

    def wait_removals(self, timeout_s: float = 10.0) -> bool:
        """Wait until the removals asked for so far have run (tests)."""
        try:
            self._removals.submit(lambda: None).result(timeout=timeout_s)
            return True
        except Exception:  # noqa: BLE001
            return False

    # ------------------------------------------------------------------ generations on disk
    # ``state_path`` (JSON: "all" and each tenant's generation) plus ``<state_path>.log``, one line
    # per invalidation ("<tenant> <generation>" or "all <generation>"), appended under a lock
    # (servers of one machine share them). Review, session 39: every invalidation parsed, merged,
    # sorted and rewrote the whole file on the scheduler thread: ~0.2 s with 65,536 tenants, for
    # every invalidation (a tenant repeating its own), every request waiting. The log is folded
    # into the file past ``_LOG_COMPACT_BYTES``, on a thread of its own: the log is renamed to
    # ``.log.old`` (under the lock, no copy), merged into the file, then removed; a reader takes
    # the file, ``.log.old`` and ``.log`` together (the highest generation of each wins, so a
    # line read twice changes nothing).
    def _state_files(self):
        path = pathlib.Path(self.state_path)
        return (path, path.with_name(path.name + ".log"), path.with_name(path.name + ".log.old"),
                path.with_name(path.name + ".lock"), path.with_name(path.name + ".compact.lock"))  # fmt: skip

    @staticmethod
    def _read_log(path, alls: int, tenants: dict) -> int:
        """Apply a generations log's lines (highest wins); returns the new "all". ``ValueError``
        on a line that is not one (torn, foreign)."""
        try:
            text = path.read_text()
        except FileNotFoundError:
            return alls
        for line in text.splitlines():
            who, gen = _log_fields(line)
            g = int(gen)
            if who == "all":
                alls = max(alls, g)
            else:
                t = int(who)
                tenants[t] = max(g, tenants.get(t, 0))
        return alls

    def _read_state(self) -> tuple[int, dict]:
        """("all", {tenant: generation}) of the file and its logs, folded as in memory
        (``OSError``, ``ValueError`` or ``TypeError`` where a part is unreadable)."""
        path, log, old, _, _ = self._state_files()
        try:
            alls, tenants = _generations_doc(json.loads(path.read_text()))
        except FileNotFoundError:
            alls, tenants = 0, {}
        for p in (old, log):
            alls = self._read_log(p, alls, tenants)
        return _fold(alls, tenants)

    def _load_generations(self) -> None:
        """The generations this model's T2 keys were at (``state_path``): an invalidation before
        a restart still holds after it."""
        if self.state_path is None:
            return
        _, _, _, lock_path, compact_path = self._state_files()
        try:
            lock_path.parent.mkdir(parents=True, exist_ok=True)
            with open(compact_path, "a") as compact, open(lock_path, "a") as lock:
                fcntl.flock(compact, fcntl.LOCK_EX)  # no fold in progress (it moves lines between files)
                fcntl.flock(lock, fcntl.LOCK_EX)
                alls, tenants = self._read_state()
        except (OSError, ValueError, TypeError) as exc:
            # unreadable: every tenant moves to a generation of its own (safe: nothing old is read),
            # and the file is rewritten with it at once (start-up, not the request path): left in
            # the log, the bad line made every later start pick a generation of its own, and
            # servers started apart never shared a page again
            self._invalidated_all = time.time_ns()
            logger.warning("sglang-tiered: T2 generations file %s unreadable (%s); starting a new generation",
                           self.state_path, exc)  # fmt: skip
            self._compact(memory=(self._invalidated_all, {}))
            return
        self._invalidated_all = alls
        for t, g in sorted(tenants.items(), key=lambda kv: kv[1]):
            self._invalidated[t] = g

    def _append_generation(self, tenant: int | None, gen: int) -> None:
        """Keep one invalidation (``tenant`` None: every tenant): one line appended to the log, on
        the scheduler thread (O(1), whatever the number of tenants); the fold, when the log has
        grown, on a thread of its own."""
        if self.state_path is None:
            return
        _, log, _, lock_path, _ = self._state_files()
        try:
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(lock_path, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                with open(log, "a") as f:
                    f.write(_log_line("all" if tenant is None else str(int(tenant)), int(gen)))
                    size = f.tell()
        except OSError as exc:
            logger.warning("sglang-tiered: cannot keep T2 generations in %s (%s)", log, exc)
            return
        if size > _LOG_COMPACT_BYTES and not self._closed:
            th = self._compacting
            if th is None or not th.is_alive():
                self._compacting = threading.Thread(target=self._compact, name="sglang-tiered-t2-gen", daemon=True)
                self._compacting.start()

    def wait_compaction(self, timeout_s: float = 30.0) -> bool:
        th = self._compacting
        if th is not None:
            th.join(timeout_s)
            return not th.is_alive()
        return True

    def _compact(self, memory: tuple[int, dict] | None = None) -> None:
        """Fold the log into the file (its own thread; ``memory``: this server's generations too)."""
        path, log, old, lock_path, compact_path = self._state_files()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(compact_path, "a") as compact:
                fcntl.flock(compact, fcntl.LOCK_EX)  # one fold at a time, on this machine
                with open(lock_path, "a") as lock:  # appends wait only for the rename
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    if not old.exists() and log.exists():  # (a fold that died left .log.old: it goes first)
                        os.replace(log, old)
                # the file and .log.old: only folds write them (this one holds the fold lock)
                alls, tenants, bad = 0, {}, False
                try:
                    alls, tenants = _generations_doc(json.loads(path.read_text()))
                except FileNotFoundError:
                    pass
                except (OSError, ValueError, TypeError):
                    bad = True
                try:
                    alls = self._read_log(old, alls, tenants)
                except (ValueError, TypeError):
                    bad = True
                if bad:  # unreadable: what a reader would make of it (this server's new one, if given)
                    alls = max(alls, memory[0] if memory is not None else time.time_ns())
                if memory is not None:
                    alls = max(alls, memory[0])
                    for t, g in memory[1].items():
                        tenants[t] = max(g, tenants.get(t, 0))
                alls, tenants = _fold(alls, tenants)
                doc = {"all": alls, "tenants": {str(t): g for t, g in tenants.items()}}
                tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
                tmp.write_text(json.dumps(doc))
                os.replace(tmp, path)
                old.unlink(missing_ok=True)
        except (OSError, ValueError, TypeError) as exc:
            logger.warning("sglang-tiered: cannot fold T2 generations into %s (%s)", path, exc)

    def _save_generations(self) -> None:
        """Merge this server's generations into the file now (the highest of each), folding the
        log in (tests; the invalidations append: ``_append_generation``)."""
        if self.state_path is None:
            return
        self._compact(memory=(self._invalidated_all, dict(self._invalidated)))

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write has been attempted (tests, benchmarks, shutdown)."""
        self.flush()
        end = time.monotonic() + timeout_s
        while self.queue.pending and time.monotonic() < end:
            time.sleep(0.01)
        return not self.queue.pending

    def check_invariants(self) -> None:
        """The write queue's rules (bounded, reachable, one job per page); no fetch in progress
        between cache calls; the victim buffer never outgrows one run."""
        self.queue.check_invariants()
        assert not any(s.busy for s in self._read), "a read staging buffer left busy"
        assert len(self._victims) < self.run, "victims not flushed"
        for j in [j for j in self.queue._page_job.values()]:
            assert j.ctx is not None and len(j.ctx) == len(j.hashes), "job data out of step with its pages"

    # ------------------------------------------------------------------ reporting
    @property
    def dropped_pages(self) -> int:
        """Pages offered that will not reach T2: refused or value-dropped by the queue (counted
        there, once), or dropped by the worker (store full or down, staging busy)."""
        q = self.queue.stats
        return self.stats.dropped_pages + q.value_dropped_pages + q.filtered_pages

    def snapshot(self) -> dict:
        """Counters as kept (``T2Stats``; schema ``stats.T2TierStats``) plus the derived figures."""
        s = self.stats
        snap = asdict(s)
        snap.update(
            name="t2", enabled=True, backend=self.cfg.url, decision=self.decision, available=self.up,
            down_for_s=self.breaker.left_s(), writes_down_for_s=self.write_breaker.left_s(),
            host_bytes=t2_host_bytes(self.layout, self.cfg),
            read_gbps=round(s.fetched_bytes / s.fetch_seconds / 1e9, 3) if s.fetch_seconds else None,
            write_gbps=round(s.stored_bytes / s.store_seconds / 1e9, 3) if s.store_seconds else None,
            dropped_pages=self.dropped_pages,
            queue_depth_pages=self.queue.stats.queued_pages, queue_capacity_pages=self.queue.capacity_pages,
        )  # fmt: skip
        return snap

    def remove_after_lease(self, pattern: str, scope) -> None:
        """Remove the objects matching ``pattern`` once the lease a read just took on them is over
        (the start-up probe's: ``measure_t2_gbps``)."""
        self._keep_timer(scope, threading.Timer(self._lease_s(), self._remove_async, args=(pattern,)))

    def close(self, after_s: float = 0.0) -> None:
        """Stop the tier. ``after_s``: the removals pending run first (a tier refused at start-up,
        whose probe objects can be removed only after their lease), then the tier closes; it takes
        no victims meanwhile."""
        if after_s > 0 and not self._closed:
            if self.pool.victim_listener == self.on_victim:
                self.pool.victim_listener = None
            th = threading.Timer(after_s + 0.5, self.close)
            th.daemon = True
            th.start()
            return
        self._closed = True
        if self.pool.victim_listener == self.on_victim:
            self.pool.victim_listener = None
        self.queue.close(drain=False)
        with self._retry_lock:
            for t in self._retries.values():
                t.cancel()
        self._removals.shutdown(wait=False, cancel_futures=True)
        self._calls.shutdown(wait=False, cancel_futures=True)

        def unmount():  # after a call still running returns (it may be using the client)
            self._calls.shutdown(wait=True)
            close = getattr(self.client, "close", None)
            if close is not None:
                close()

        threading.Thread(target=unmount, name="sglang-tiered-t2-close", daemon=True).start()
