"""Hypothesis state machine (review, session 39): ``IndexPublisher`` (fleet/publisher.py) against a
model of what the server holds, over a fake Redis that runs WRITE_LUA's HDEL/HSET and can go down
(before or part-way through a pipeline) or lose its data.

The background loop is driven a round at a time in the test's thread (``_stop`` answers "not yet"
for as many rounds as asked), with ``time.monotonic`` under the test's control.

  P1 bounds: the queue's page count equals the pages in its events, and stays <= QUEUE_PAGES;
     ``_held`` and ``_unsent`` <= HELD_MAX;
  P2 once settled (Redis up, a refresh done, nothing queued, nothing unsent): the index claims no
     page the server does not hold (a stale claim is refreshed for ever: the publisher's own
     promise), and, with no event ever dropped, every page it holds;
  P3 the publisher's held set is the server's, once settled with no event dropped.
"""

from __future__ import annotations

import os
import queue

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import sglang_tiered.fleet.publisher as P
from sglang_tiered.fleet.index import PREFIX, alive_key

SID = "srv"
PAGES = [bytes([i]) * 8 for i in range(12)]

settings.register_profile("review39", max_examples=150, stateful_step_count=40, deadline=None)
settings.register_profile("review39-deep", max_examples=1500, stateful_step_count=60, deadline=None)
PROFILE = settings.get_profile(os.environ.get("REVIEW39_PROFILE", "review39"))


class Down(ConnectionError):
    pass


class FakeRedis:
    def __init__(self):
        self.kv: dict = {}  # key -> value (strings) or dict (hashes)
        self.down = False
        self.fail_after = None  # None, or: the next pipeline applies this many commands, then fails

    def ping(self):
        if self.down:
            raise Down("down")

    def register_script(self, src):
        assert src == P.WRITE_LUA

        def script(keys, args, client):
            client.ops.append(("lua", list(keys), list(args)))

        return script

    def pipeline(self, transaction=False):
        return FakePipe(self)

    def claims(self) -> set:
        p = PREFIX + b"p:"
        return {k[len(p):] for k, v in self.kv.items() if k.startswith(p) and isinstance(v, dict) and SID in v}


class FakePipe:
    def __init__(self, r):
        self.r, self.ops = r, []

    def set(self, key, value, ex=None, get=False):
        self.ops.append(("set", key, value, get))

    def execute(self):
        r = self.r
        if r.down:
            raise Down("down")
        out = []
        for i, op in enumerate(self.ops):
            if r.fail_after is not None and i >= r.fail_after:
                r.fail_after = None
                r.down = True
                raise Down("went down part-way")
            if op[0] == "set":
                _, key, value, get = op
                old = r.kv.get(key)
                r.kv[key] = value
                out.append(old if get else True)
            else:
                _, keys, args = op
                sid, now, n = args[0], args[1], int(args[3])
                for j, k in enumerate(keys):
                    h = r.kv.setdefault(k, {})
                    if j < n:
                        h.pop(sid, None)
                        if not h:
                            del r.kv[k]
                    else:
                        h[sid] = now
                out.append(len(keys))
        r.fail_after = None
        return out


class Rounds:
    """``_stop`` for ``n`` rounds of ``_run``."""

    def __init__(self, n):
        self.n = n

    def is_set(self):
        self.n -= 1
        return self.n < 0

    def wait(self, _t=None):
        return False

    def set(self):
        self.n = 0


class PublisherMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.redis = FakeRedis()
        self.clock = [1000.0]
        self.saved = (P.QUEUE_MAX, P.QUEUE_PAGES, P.time.monotonic)
        P.QUEUE_MAX, P.QUEUE_PAGES = 4, 10  # small: events are dropped
        P.time.monotonic = lambda: self.clock[0]
        self.pub = P.IndexPublisher("redis://127.0.0.1:1/0", SID, ttl_s=30.0, start=False)
        self.pub._connect = self._connect
        self.server: set = set()  # model: the pages the server holds
        self.dropped = False

    def _connect(self):
        self.redis.ping()
        return self.redis

    def teardown(self):
        P.QUEUE_MAX, P.QUEUE_PAGES, P.time.monotonic = self.saved

    def _tell(self, fn, *args):
        before = self.pub.stats["dropped_events"]
        fn(*args)
        self.dropped |= self.pub.stats["dropped_events"] != before

    @rule(pages=st.sets(st.sampled_from(PAGES), min_size=1, max_size=5))
    def store(self, pages):
        self.server |= pages
        self._tell(self.pub.on_store, sorted(pages))

    @rule(pages=st.sets(st.sampled_from(PAGES), min_size=1, max_size=5))
    def remove(self, pages):
        self.server -= pages
        self._tell(self.pub.on_remove, sorted(pages))

    @rule()
    def clear(self):
        self.server.clear()
        self._tell(self.pub.on_clear)

    @rule(n=st.integers(1, 3), later=st.booleans())
    def rounds(self, n, later):
        if later:
            self.clock[0] += 16.0  # a refresh is due (ttl/2)
        self.pub._stop = Rounds(n)
        self.pub._run()

    @rule()
    def redis_down(self):
        self.redis.down = True

    @rule(k=st.integers(0, 4))
    def redis_fails_part_way(self, k):
        self.redis.fail_after = k

    @rule()
    def redis_up(self):
        self.redis.down = False

    @rule()
    def redis_loses_its_data(self):
        self.redis.kv.clear()

    def _settle(self):
        self.redis.down, self.redis.fail_after = False, None
        self.clock[0] += 16.0
        for _ in range(6):
            self.pub._stop = Rounds(1)
            self.pub._run()
            if (self.pub._q.empty() and not self.pub._unsent and not self.pub._overflowed.is_set()
                    and not self.pub._resync and self.pub._client is not None):  # fmt: skip
                break
        self.clock[0] += 16.0  # one more refresh with nothing pending (a lost index is seen here)
        self.pub._stop = Rounds(2)
        self.pub._run()

    @rule()
    def settle_and_compare(self):
        self._settle()
        claims = self.redis.claims()
        assert claims <= self.server, ("P2: stale claims", sorted(claims - self.server))
        if not self.dropped:
            assert claims == self.server, ("P2: held pages not claimed", sorted(self.server - claims))
            assert set(self.pub._held) == self.server, ("P3", sorted(set(self.pub._held) ^ self.server))

    @invariant()
    def bounded(self):
        pub = self.pub
        in_queue = sum(len(it[1] or ()) for it in list(pub._q.queue))
        assert pub._queued_pages == in_queue, ("P1: queued page count", pub._queued_pages, in_queue)
        assert 0 <= pub._queued_pages <= P.QUEUE_PAGES
        assert len(pub._held) <= P.HELD_MAX and len(pub._unsent) <= P.HELD_MAX

    @invariant()
    def heartbeat_is_a_string(self):
        v = self.redis.kv.get(alive_key(SID))
        assert v is None or isinstance(v, str)


PublisherMachine.TestCase.settings = PROFILE
TestPublisher = PublisherMachine.TestCase
