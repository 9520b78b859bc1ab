"""Store queue: T1 writes leave the request path (seed section 5 decision 4, R3).

Pages the device tier admits are offered here and written to T1 by one worker thread, most
valuable first, while the request that computed them goes on. Nothing here knows about torch:
a job is a run of device page ids with their page hashes, and ``write(job)`` does the copy.

Value (R3 writes it as "matched length x sketch frequency"): ``frequency x pages`` of the run,
where frequency is the TinyLFU sketch estimate of the run's pages, i.e. how many requests have
used them. A run that a hit would save more compute for, and that more requests use, goes first.

Rules, and the invariants ``check_invariants`` asserts:

1. **Bounded.** ``queued_pages <= capacity_pages`` at all times.
2. **Filter at enqueue.** A run whose value is not positive never takes a slot, and while the queue
   is at least half full a run seen by a single request (frequency <= 1: a one-shot so far) is
   refused: under pressure one-shots never take a slot (``under_pressure``; the cache applies the
   same rule when it evicts a page the queue has not written: a one-shot is then not copied).
3. **Value-drop.** When a run does not fit, strictly lower-valued pending runs leave, lowest first,
   until it fits; if dropping all of them would still not make room, the new run is refused and
   nothing is dropped. So a full queue drops its least valuable pending write, never blindly the
   newest, and never for nothing.
4. **Page fencing.** A device page is in at most one pending job. ``fence(pages)`` returns only
   when none of ``pages`` is queued or being copied: queued ones are taken out of their job (and,
   with ``run=True``, written inline first), a copy in flight is waited for. The cache fences every
   device page before it frees it (eviction, invalidation, reset), so no page is overwritten while
   its copy is in flight, and no freed page is copied later.

Threading: with ``threaded=True`` a daemon worker drains the queue; otherwise jobs run when the
owner calls ``drain()`` (the simulator does it after every batch, as a worker would between
batches), which keeps simulations deterministic.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from dataclasses import dataclass

logger = logging.getLogger("sglang_tiered")

QUEUED, RUNNING, DONE, DROPPED = 0, 1, 2, 3


@dataclass(eq=False)
class StoreJob:
    seq: int
    value: float
    pages: list  # device page ids (ints)
    hashes: list  # page hashes, same order
    tenant: int = 0
    ctx: object = None  # whatever the writer needs (e.g. a CUDA event the copy must wait for)
    state: int = QUEUED


@dataclass
class StoreQueueStats:
    offered_pages: int = 0
    queued_pages: int = 0  # now (depth)
    stored_pages: int = 0  # written by the worker
    inline_pages: int = 0  # written inline by a fence (the worker had not reached them)
    filtered_pages: int = 0  # refused at enqueue (rule 2)
    value_dropped_pages: int = 0  # left the full queue for a more valuable run (rule 3)
    cancelled_pages: int = 0  # fenced without a write (invalidation, or run=False)
    failed_pages: int = 0  # the write raised


class StoreQueue:
    def __init__(self, capacity_pages: int, write, *, threaded: bool = True, name: str = "sglang-tiered-store"):
        if capacity_pages < 1:
            raise ValueError("capacity_pages must be >= 1")
        self.capacity_pages = capacity_pages
        self._write = write
        self._cv = threading.Condition()
        self._hi: list = []  # (-value, seq, job): next to write
        self._lo: list = []  # (value, -seq, job): next to drop (newest of equal value first)
        # _hi is drained by the worker, _lo only by a full queue's drops: past this length its
        # finished jobs (pages, hashes, a CUDA event each) are compacted away
        self._lo_limit = 64
        # _hi keeps a dropped or cancelled job until the worker pops its way down to it, which a
        # queue that never empties (writes slower than offers: when value-drop acts) never does;
        # past this length it is compacted too
        self._hi_limit = 64
        self._page_job: dict = {}  # device page -> its pending job
        self._seq = itertools.count()
        self.stats = StoreQueueStats()
        self._closed = False
        self._thread = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ producer side
    def offer(self, pages: list, hashes: list, value: float, *, frequency: int = 2, tenant: int = 0,
              ctx=None) -> bool:  # fmt: skip
        """Queue a run of device pages for T1. Returns False when it was filtered or did not fit."""
        n = len(pages)
        if not n:
            return True
        st = self.stats
        with self._cv:
            st.offered_pages += n
            if value <= 0 or n > self.capacity_pages or (
                frequency <= 1 and self.under_pressure
            ):
                st.filtered_pages += n
                return False
            if any(p in self._page_job for p in pages):  # already pending: keep the first offer
                st.filtered_pages += n
                return False
            if st.queued_pages + n > self.capacity_pages:
                # would dropping every strictly lower-valued pending run make room? If not, refuse
                # now and drop nothing (dropping first lost those writes for nothing; review,
                # session 19)
                lower = sum(len(j.pages) for _, _, j in self._lo if j.state == QUEUED and j.pages and j.value < value)
                if st.queued_pages - lower + n > self.capacity_pages:
                    st.value_dropped_pages += n
                    return False
            while st.queued_pages + n > self.capacity_pages:
                low = self._lowest()
                if low is None or low.value >= value:
                    st.value_dropped_pages += n  # the new run is the least valuable: refused
                    return False
                self._unlink(low, DROPPED)
                st.value_dropped_pages += len(low.pages)
            job = StoreJob(next(self._seq), value, list(pages), list(hashes), tenant, ctx)
            for p in job.pages:
                self._page_job[p] = job
            st.queued_pages += n
            heapq.heappush(self._hi, (-value, job.seq, job))
            heapq.heappush(self._lo, (value, -job.seq, job))
            if len(self._lo) > self._lo_limit:
                self._compact_lo()
            if len(self._hi) > self._hi_limit:
                self._compact_hi()
            self._cv.notify_all()
            return True

    def is_pending(self, page) -> bool:
        """Whether a write of ``page`` is queued or being copied."""
        with self._cv:
            return page in self._page_job

    def fence(self, pages, *, run: bool = True) -> None:
        """Return once none of ``pages`` is queued or being copied (rule 4). Queued pages are
        removed from their jobs; with ``run`` they are written inline first (so a page the
        worker had not reached yet still reaches T1), otherwise they are cancelled."""
        if not self._page_job:
            return
        inline: dict = {}
        with self._cv:
            for p in pages:
                job = self._page_job.get(p)
                while job is not None and job.state == RUNNING:
                    self._cv.wait()
                    job = self._page_job.get(p)
                if job is None:
                    continue
                i = job.pages.index(p)
                del self._page_job[p]
                job.pages.pop(i)
                h = job.hashes.pop(i)
                self.stats.queued_pages -= 1
                if run:
                    inline.setdefault(id(job), (job, [], []))
                    inline[id(job)][1].append(p)
                    inline[id(job)][2].append(h)
                else:
                    self.stats.cancelled_pages += 1
                if not job.pages:
                    job.state = DROPPED  # empty: its heap entries are skipped lazily
        for job, ps, hs in inline.values():
            part = StoreJob(-1, job.value, ps, hs, job.tenant, job.ctx, RUNNING)
            if self._call(part):
                self.stats.inline_pages += len(ps)

    def cancel_where(self, pred, *, wait: bool = True) -> int:
        """Cancel every pending job for which ``pred(job)`` holds (e.g. an invalidated tenant),
        waiting for one in flight (``wait``; T1's jobs read device pages the caller is about to
        free). ``wait=False``: a job in flight is left to finish, for a writer whose jobs hold
        copies (T2: review, session 41, its invalidations waited seconds for a slow store's put on
        the scheduler thread). Returns pages cancelled."""
        n = 0
        with self._cv:
            while wait and any(j.state == RUNNING and pred(j) for j in set(self._page_job.values())):
                self._cv.wait()
            for job in {id(j): j for j in self._page_job.values()}.values():
                if job.state == QUEUED and pred(job):
                    n += len(job.pages)
                    self._unlink(job, DROPPED)
            self.stats.cancelled_pages += n
        return n

    def drain(self) -> None:
        """Write everything queued now, in value order (the worker's job, done synchronously)."""
        while True:
            with self._cv:
                job = self._next()
                if job is None:
                    return
            self._execute(job)

    @property
    def pending(self) -> bool:
        """Whether any write is queued or in flight (a fence is a no-op otherwise)."""
        return bool(self._page_job)

    @property
    def under_pressure(self) -> bool:
        """At least half full: one-shots are refused (rule 2), at enqueue and at eviction."""
        return 2 * self.stats.queued_pages >= self.capacity_pages

    @property
    def depth_pages(self) -> int:
        return self.stats.queued_pages

    def close(self, drain: bool = False) -> None:
        if drain:
            self.drain()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # ------------------------------------------------------------------ worker side
    def _run(self) -> None:
        while True:
            with self._cv:
                job = self._next()
                while job is None and not self._closed:
                    self._cv.wait()
                    job = self._next()
                if job is None:
                    return
            self._execute(job)

    def _next(self):
        """Pop the most valuable live job and mark it running (caller holds the lock)."""
        while self._hi:
            _, _, job = heapq.heappop(self._hi)
            if job.state == QUEUED and job.pages:
                job.state = RUNNING
                return job
        return None

    def _execute(self, job: StoreJob) -> None:
        ok = self._call(job)
        with self._cv:
            for p in job.pages:
                if self._page_job.get(p) is job:
                    del self._page_job[p]
            self.stats.queued_pages -= len(job.pages)
            if ok:
                self.stats.stored_pages += len(job.pages)
            job.state = DONE
            # written: its payload goes now. A finished job stays in ``_lo`` until it is compacted
            # (past 64 entries), and with it, before session 41, its payload: for T2 the run's
            # page copies, up to 64 runs of them beyond the queue's bound (review, session 41)
            job.ctx = None
            self._cv.notify_all()

    def _call(self, job: StoreJob) -> bool:
        try:
            self._write(job)
            return True
        except Exception:  # noqa: BLE001 - a failed store is a skipped store, never a crash
            self.stats.failed_pages += len(job.pages)
            if self.stats.failed_pages == len(job.pages):
                logger.exception("sglang-tiered: T1 store of %d pages failed; skipped", len(job.pages))
            return False

    def _lowest(self):
        while self._lo:
            _, _, job = self._lo[0]
            if job.state == QUEUED and job.pages:
                return job
            heapq.heappop(self._lo)
        return None

    def _compact_lo(self) -> None:
        """Keep only the queued jobs' entries in ``_lo``; the next compaction waits until it has
        doubled (amortized O(1) per offer, and at most 2 x the live jobs + 64 entries)."""
        self._lo = [e for e in self._lo if e[2].state == QUEUED and e[2].pages]
        heapq.heapify(self._lo)
        self._lo_limit = 2 * len(self._lo) + 64

    def _compact_hi(self) -> None:
        """Keep only the queued jobs' entries in ``_hi`` (as ``_compact_lo``)."""
        self._hi = [e for e in self._hi if e[2].state == QUEUED and e[2].pages]
        heapq.heapify(self._hi)
        self._hi_limit = 2 * len(self._hi) + 64

    def _unlink(self, job: StoreJob, state: int) -> None:
        for p in job.pages:
            if self._page_job.get(p) is job:
                del self._page_job[p]
        self.stats.queued_pages -= len(job.pages)
        job.state = state
        job.ctx = None  # never written now: its payload (T2: the copied-out pages) goes at once

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        with self._cv:
            pending = {id(j): j for j in self._page_job.values()}.values()
            assert self.stats.queued_pages <= self.capacity_pages, "queue over capacity"
            assert self.stats.queued_pages == sum(len(j.pages) for j in pending), "depth != pending pages"
            for j in pending:
                assert j.state in (QUEUED, RUNNING), "pending job in a final state"
                assert len(j.pages) == len(j.hashes), "pages/hashes out of step"
                for p in j.pages:
                    assert self._page_job[p] is j, "page in two jobs"
            assert all(j.state != QUEUED or j.pages == [] or any(e[2] is j for e in self._hi) for j in pending), \
                "queued job not reachable by the worker"
            assert len(self._lo) <= self._lo_limit, "finished jobs kept in the drop heap"
            assert len(self._hi) <= self._hi_limit, "finished jobs kept in the write heap"
