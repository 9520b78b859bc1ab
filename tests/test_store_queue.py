"""The T1 store queue (sglang_tiered/core/store_queue.py): a Hypothesis state machine against a
plain model (value order, value-drop, filter, fencing), value-drop drops the lowest-valued
entries, and with a real worker thread no page is overwritten while its copy is in flight."""

from __future__ import annotations

import random
import threading
import time

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sglang_tiered.core.store_queue import StoreQueue

CAP = 12


class StoreQueueMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.written: list = []  # (page, hash) in write order
        self.q = StoreQueue(CAP, lambda job: self.written.extend(zip(job.pages, job.hashes)), threaded=False)
        self.model: list = []  # pending [seq, value, pages, hashes, tenant]
        self.want: list = []
        self.seq = 0

    def _depth(self):
        return sum(len(j[2]) for j in self.model)

    @rule(pages=st.lists(st.integers(0, 30), min_size=1, max_size=5, unique=True),
          value=st.integers(0, 6), freq=st.integers(1, 3), tenant=st.integers(0, 2))  # fmt: skip
    def offer(self, pages, value, freq, tenant):
        hashes = [f"h{p}-{self.seq}" for p in pages]
        got = self.q.offer(pages, hashes, value, frequency=freq, tenant=tenant)
        n = len(pages)
        pending = {p for j in self.model for p in j[2]}
        if value <= 0 or n > CAP or (freq <= 1 and 2 * self._depth() >= CAP) or pending & set(pages):
            want = False
        else:
            lower = sum(len(j[2]) for j in self.model if j[1] < value)
            want = self._depth() - lower + n <= CAP  # (else refused, and nothing dropped)
            while want and self._depth() + n > CAP:
                low = min(self.model, key=lambda j: (j[1], -j[0]))
                if low[1] >= value:
                    want = False
                    break
                self.model.remove(low)
            if want:
                self.model.append([self.seq, value, list(pages), hashes, tenant])
        assert got == want
        self.seq += 1

    @precondition(lambda self: self.model)
    @rule()
    def worker_runs_one(self):
        job = self.q._next()
        self.q._execute(job)
        top = min(self.model, key=lambda j: (-j[1], j[0]))
        self.model.remove(top)
        self.want.extend(zip(top[2], top[3]))

    @rule(pages=st.lists(st.integers(0, 30), max_size=6, unique=True), run=st.booleans())
    def fence(self, pages, run):
        self.q.fence(pages, run=run)
        for j in self.model:
            keep = [(p, h) for p, h in zip(j[2], j[3]) if p not in pages]
            if run:
                self.want.extend((p, h) for p, h in zip(j[2], j[3]) if p in pages)
            j[2], j[3] = [p for p, _ in keep], [h for _, h in keep]
        self.model = [j for j in self.model if j[2]]

    @rule(tenant=st.integers(0, 2))
    def cancel_tenant(self, tenant):
        self.q.cancel_where(lambda j: j.tenant == tenant)
        self.model = [j for j in self.model if j[4] != tenant]

    @invariant()
    def agrees_with_model(self):
        self.q.check_invariants()
        assert self.q.depth_pages == self._depth() <= CAP
        assert self.q.under_pressure == (2 * self._depth() >= CAP)
        assert sorted(self.written) == sorted(self.want)
        assert set(self.q._page_job) == {p for j in self.model for p in j[2]}


TestStoreQueueMachine = StoreQueueMachine.TestCase
TestStoreQueueMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_full_queue_drops_the_lowest_valued_entries():
    q = StoreQueue(10, lambda job: None, threaded=False)
    for v in (5, 1, 4, 2, 3):
        assert q.offer([v * 10, v * 10 + 1], ["a", "b"], v)
    assert q.depth_pages == 10
    assert q.offer([70, 71, 72], ["a", "b", "c"], 3.5)  # needs 3 pages: values 1 and 2 leave
    assert q.stats.value_dropped_pages == 4
    assert set(q._page_job) == {50, 51, 40, 41, 30, 31, 70, 71, 72}
    assert not q.offer([80, 81], ["a", "b"], 0.5)  # does not fit, least valuable of all: refused
    assert q.stats.value_dropped_pages == 6 and set(q._page_job) >= {30, 31}
    assert not q.offer([90], ["a"], 9, frequency=1)  # a one-shot while half full: filtered
    order = []
    q._write = lambda job: order.append(job.value)
    q.drain()
    assert order == [5, 4, 3.5, 3]  # most valuable first


def test_no_page_is_overwritten_while_its_copy_is_in_flight():
    """A slow writer thread copies pages; an 'allocator' fences pages before reusing them. No
    reuse falls inside a copy of the same page, and no fenced page is copied afterwards."""
    log = []  # (page, start, end)
    lock = threading.Lock()

    def write(job):
        t0 = time.perf_counter()
        time.sleep(0.002)
        t1 = time.perf_counter()
        with lock:
            log.extend((p, t0, t1) for p in job.pages)

    q = StoreQueue(64, write, threaded=True)
    rng = random.Random(0)
    reused = []  # (page, time of reuse)
    for step in range(300):
        pages = rng.sample(range(40), rng.randrange(1, 4))
        q.offer(pages, [f"h{p}" for p in pages], rng.randrange(1, 9))
        if step % 3 == 0:
            victims = rng.sample(range(40), 3)
            q.fence(victims, run=rng.random() < 0.5)
            now = time.perf_counter()
            reused.extend((p, now) for p in victims)
    q.close(drain=True)
    for p, t in reused:
        for lp, t0, t1 in log:
            if lp == p:
                assert not (t0 < t < t1), "page reused while its copy was in flight"
    q.check_invariants()
    assert q.depth_pages == 0


def test_finished_jobs_do_not_accumulate():
    """The drop heap keeps only queued jobs' entries (bounded), however many jobs were written:
    a queue that never fills used to keep every job ever offered, with its pages, hashes and ctx."""
    written = []
    q = StoreQueue(64, lambda job: written.append(len(job.pages)), threaded=False)
    for i in range(10_000):
        assert q.offer([2 * i, 2 * i + 1], [b"a", b"b"], value=1.0 + i % 7)
        if i % 3 == 0:
            q.drain()
        q.check_invariants()
    q.drain()
    assert sum(written) == 20_000
    assert len(q._lo) <= q._lo_limit <= 2 * 32 + 64  # at most 32 two-page jobs queued at once
    q.offer([1, 2], [b"x", b"y"], value=5.0)
    q.check_invariants()


def test_a_run_that_cannot_fit_drops_nothing():
    """Review, session 19: a queue of 10 pages holding A (4 pages, value 1) and B (6 pages, value
    5); C (5 pages, value 3) cannot fit even without A, so A stays and C is refused (A used to be
    dropped first, and C refused anyway)."""
    q = StoreQueue(10, lambda job: None, threaded=False)
    assert q.offer([1, 2, 3, 4], ["a"] * 4, 1.0) and q.offer([5, 6, 7, 8, 9, 10], ["b"] * 6, 5.0)
    assert not q.offer([11, 12, 13, 14, 15], ["c"] * 5, 3.0)
    assert set(q._page_job) == set(range(1, 11)) and q.stats.queued_pages == 10
    assert q.stats.value_dropped_pages == 5  # C's pages, refused
    assert q.offer([11, 12, 13, 14], ["d"] * 4, 3.0)  # fits once A goes: A dropped
    assert set(q._page_job) == set(range(5, 15))
    q.check_invariants()
