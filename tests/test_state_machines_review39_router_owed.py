"""Hypothesis state machine (review, session 39): the router's owed invalidations
(``WorkerState.owed``, ``Router._owe``/``_pay``, fleet/router.py) against a model of each worker's
T2 generations.

The real ``Router.passthrough`` broadcasts ``POST /cache/invalidate`` (a mocked aiohttp request);
``_invalidate_one`` is replaced by fake workers that apply a body as the server does
(``T2Tier.invalidate``: the tenant's generation becomes ``max(given, current + 1)``) and answer
a status the test picks (a 5xx: not taken). ``_pay`` is what a passing health check runs.

  O1 bounded: at most OWED_MAX scopes per worker; ``owed_invalidations`` counts every one owed;
  O2 a worker that owes is out of the routing set (``healthy`` False);
  O3 a worker never takes a generation of a scope older than one it took (generations only move
     up: an older one moved it to ``current + 1``, off the fleet's, and its T2 removed the fleet's
     objects under every other generation);
  O4 once every worker has taken what it owes (none dropped), every worker's generation of each
     scope is the fleet's (the last broadcast's): they share T2 again.
"""

from __future__ import annotations

import asyncio
import json
import os

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import sglang_tiered.fleet.router as R

URLS = ["http://127.0.0.1:9/w0", "http://127.0.0.1:9/w1", "http://127.0.0.1:9/w2"]
SCOPES = ["acme", "globex", "__all__"]
TENANTS = ["acme", "globex"]


def apply(t2: dict, scope: str, given: int) -> None:
    """``T2Tier.invalidate``'s generations (tier/t2.py): ``t2`` maps a tenant to its own
    generation and "__all__" to every tenant's floor; an invalidation always moves, above the
    current generation (for all: above every tenant's)."""
    every = t2.get("__all__", 0)
    if scope == "__all__":
        floor = max([every] + [g for k, g in t2.items() if k != "__all__"])
        t2.clear()
        t2["__all__"] = max(given, floor + 1)
    else:
        t2[scope] = max(given, max(every, t2.get(scope, 0)) + 1)


def generation(t2: dict, tenant: str) -> int:
    return max(t2.get("__all__", 0), t2.get(tenant, 0))
OWED = 3

settings.register_profile("review39", max_examples=120, stateful_step_count=40, deadline=None)
settings.register_profile("review39-deep", max_examples=800, stateful_step_count=60, deadline=None)
PROFILE = settings.get_profile(os.environ.get("REVIEW39_PROFILE", "review39"))


class RouterOwedMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.saved = (R.OWED_MAX, R.read_body)
        R.OWED_MAX = OWED
        self.router = R.Router(URLS, page_size=16)
        self.router._invalidate_one = self._invalidate_one
        self.status = {u: 200 for u in URLS}  # what each worker answers next
        self.gen = {u: {} for u in URLS}  # worker -> scope -> its T2 generation
        self.taken = {u: [] for u in URLS}  # worker -> [(scope, generation given)]
        self.fleet = {}  # the generations of a worker that took every broadcast in order
        self.clock = 1000
        self.owed_calls = 0
        self.dropped = False
        self.contract = True  # check the broadcast's answer and owed count (the regression test: off)

    def teardown(self):
        R.OWED_MAX, R.read_body = self.saved

    async def _invalidate_one(self, ws, raw, plain, headers, timeout=None):
        st = self.status[ws.url]
        if st >= 300:
            return st, "no"
        doc = json.loads(raw)
        scope = "__all__" if doc.get("all") else doc["tenant"]
        apply(self.gen[ws.url], scope, doc["generation"])
        self.taken[ws.url].append((scope, doc["generation"]))
        return 200, "{}"

    @rule(scope=st.sampled_from(SCOPES), down=st.sets(st.sampled_from(URLS), max_size=2),
          bad=st.sampled_from([500, 502, 503]))  # fmt: skip
    def broadcast(self, scope, down, bad):
        from aiohttp.test_utils import make_mocked_request

        self.clock += 1
        doc = {"all": True} if scope == "__all__" else {"tenant": scope}
        body = json.dumps({**doc, "generation": self.clock}).encode()

        async def read_body(request, limit=None):
            return body

        R.read_body = read_body
        for u in URLS:
            self.status[u] = bad if u in down else 200
        req = make_mocked_request("POST", "/cache/invalidate", headers={"content-type": "application/json"})
        before = self.router.stats.owed_invalidations
        owing = {u: ws.owed_status for u, ws in self.router.workers.items() if ws.owed}  # (queued behind)
        resp = asyncio.run(self.router.passthrough(req))
        want = max([bad] * bool(down - set(owing)) + list(owing.values()) + [200])
        assert resp.status == want or not self.contract, (resp.status, want)
        apply(self.fleet, scope, self.clock)
        self.owed_calls += len(down | set(owing))
        got = self.router.stats.owed_invalidations - before
        assert got == len(down | set(owing)) or not self.contract, "O1: owed count"
        self.owed_calls += got - len(down | set(owing))
        self.dropped |= self.router.stats.owed_dropped > 0

    @rule(u=st.sampled_from(URLS), ok=st.booleans())
    def health_check(self, u, ok):
        """A passing health check delivers what the worker owes (``_check``); ``ok`` False: the
        worker still answers 5xx to them."""
        ws = self.router.workers[u]
        self.status[u] = 200 if ok else 503
        if ws.owed:
            asyncio.run(self.router._pay(ws))
        if not ws.owed:
            ws.healthy = True  # (``_check``: nothing owed, not cooling down)

    @invariant()
    def bounded_and_out_of_the_routing_set(self):
        for ws in self.router.workers.values():
            assert len(ws.owed) <= OWED, "O1"
            assert not (ws.owed and ws.healthy), "O2: a worker that owes is routed to"
        assert self.router.stats.owed_invalidations == self.owed_calls, "O1"

    @invariant()
    def generations_only_move_up(self):
        for u, taken in self.taken.items():
            last = {}
            for scope, g in taken:
                assert g >= last.get(scope, 0), ("O3: an older generation delivered after a newer one", u, taken)
                last[scope] = g

    @invariant()
    def settled_workers_agree(self):
        if self.dropped or any(ws.owed for ws in self.router.workers.values()):
            return
        for u in URLS:
            for t in TENANTS:
                got, want = generation(self.gen[u], t), generation(self.fleet, t)
                assert got == want, ("O4: a worker off the fleet's generation", u, t, got, want)


RouterOwedMachine.TestCase.settings = PROFILE
TestRouterOwed = RouterOwedMachine.TestCase


def test_a_newer_invalidation_waits_behind_an_older_one_owed():
    """The machine's shortest failure before the fix: w0 misses acme's invalidation at 1001 (500),
    takes the next at 1002 directly, then the health check delivers 1001: its T2 went to 1003
    (max(1001, 1002 + 1)), off the fleet's 1002, and removed the fleet's objects under 1002.
    Now the newer one waits behind the older (502, owed) and both arrive in order."""
    m = RouterOwedMachine()
    m.contract = False  # (so that the code before the fix fails on what it did, below)
    try:
        m.broadcast(scope="acme", down={URLS[0]}, bad=500)
        m.broadcast(scope="acme", down=set(), bad=500)
        assert len(m.router.workers[URLS[0]].owed) == 1  # the newer replaced the older: one scope
        m.health_check(u=URLS[0], ok=True)
        m.generations_only_move_up()
        m.settled_workers_agree()
        assert m.taken[URLS[0]] == [("acme", 1002)] and generation(m.gen[URLS[0]], "acme") == 1002
    finally:
        m.teardown()
