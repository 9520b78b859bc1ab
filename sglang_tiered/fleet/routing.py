"""Fleet routing policies (pure Python: no torch, no sglang).

One interface for the live router (``sglang_tiered.fleet.router``) and the fleet simulator
(``bench/fleet_sim.py``): a policy sees a ``RouteRequest`` (page hashes of the prompt, an affinity
key, prompt length) and a ``FleetView`` (workers, their load, what the hint index says each one
holds) and returns a ``Decision``.

Ours (``AffinityCachePolicy``), seed R2 + section 9.3, per request:

* **Affinity key**: the tenant's prompt family (its first page hash, which the tenant seeds;
  ``per_prefix=False``: the tenant itself, ``cache_salt`` or the trusted header), or without a
  tenant the prompt's first ``affinity_pages`` pages (its conversation or template).
* **Homes, k adapted to the key's load share**: the key is rendezvous-hashed (highest random
  weight) onto its top-k workers. The policy keeps the last ``horizon`` x N keys (bounded memory);
  a key with share s of that window gets k = max(k_min, ceil(s x N / home_share)) homes, up to
  ``k_max``: a hot key spreads over as many homes as its load needs (one per 0.8 of a worker's
  fair share), a cold one keeps k_min (1). A key not seen in the window gets its first
  ``new_choices`` (2) homes: a new conversation has no cache anywhere yet, so it goes to the less
  loaded of two (power of two choices [1]) instead of one random home, which on small families
  (Mooncake conversations) is what keeps the servers' cache inflow even; its later requests find
  it through the index. Rendezvous moves only the keys whose top-k contained a leaving worker (or
  now contains a joining one): about k/n of them per membership change.
* **Cold choice, bounded load**: the least loaded home. A worker is *over the hatch* when its load
  (``FleetView.load``: requests in flight, or the simulator's recent work) exceeds ``overload`` x
  the fleet mean + ``slack`` (1.25 and 2) and so does the work this policy routed to it over its
  last ``horizon`` x N requests (``hatch_load="both"``: a transient pile-up of requests in flight
  is not a sustained occupancy, see the field's comment; the policy's own work counts what the
  index says each worker held, not the routing memory's credit, ``share_by_index``); when the chosen home is over it, the request *spills* to
  the least loaded worker (R2's occupancy escape hatch, counted in ``spill``); when it is only above
  ``cold_over`` (1.3) x the mean it goes to the least loaded worker too (``reason="cold"``).
* **Locality from the index, priced in seconds** (section 9.3: prefer a warmer replica when
  matched_tokens x recompute cost per token > extra queue delay): the worker the index says holds
  the longest prefix (at least ``warm_frac`` of the prompt; ties: home order, then load), if not
  over the hatch, wins over the cold choice c exactly when

      (matched(w) - matched(c)) x c_tok x (1 + followers)  >  queue_s(w) - queue_s(c)

  with ``c_tok`` the recompute time per token (seconds), ``followers`` the requests queued behind
  this one that each recomputed token also delays (rho / (1 - rho): 9 at rho = 0.9) and
  ``queue_s(w)`` the work queued on w ahead of this request, in seconds (``FleetView.queue_s``).
  Comparing the best warm worker with the cold choice (not every worker's cost with every other's)
  keeps a family on one worker when several tie on the match: pricing all of them against each
  other's instantaneous queues split families between equally warm workers and lost 4 (Mooncake)
  and 8 (multi-tenant) points of hit rate at N = 44 in the simulator (with k_min = 2).

  A warm worker over the hatch still qualifies when the work routed to it over the last
  ``inflow_horizon`` x N requests, this one's included, stays within ``warm_cap`` (1.25) x the
  fleet mean of that window: the hatch reads a short window and requests in flight, and spilled
  warm families off workers whose long-run share was fine (each such spill recomputes the family
  elsewhere and seeds a second copy), while ignoring the hatch for warm workers altogether let the
  long-run share pass 1.3 x the mean. Measured before/after in one run (session 22, whole traces,
  README "Fleet simulator"): cache_aware's lead on Mooncake N = 8 (-0.76 points) became +0.11,
  and every multi-tenant cell at N = 8 and 44 came out above cache_aware, with work max/mean
  1.25 or less.

* **The load bound** (``cap_all``, session 31): the same long-window test, with ``slack`` mean
  requests' work of room, bounds every decision: a worker past it takes no request, home, warm or
  fresh, while another worker is within it (``reason="cap"`` when it moves a cold choice). The
  bound, by construction: a worker takes a request only if its work over the window, this
  request's included (as the policy believes it: the prompt less what the index and the memory
  say the worker holds), stays within ``warm_cap`` x the fleet mean + ``slack`` x the window's
  mean work per request, unless no worker does (then the bound yields; as the window slides, a
  worker that took nothing can still end up above it while the mean falls). Before it, only a
  warm worker over the hatch was capped,
  and the hatch itself (view and share both over, its slack in whole requests against a share of
  uncached work) let a worker reach about overload + slack / (horizon x (1 - hit rate)) of the
  mean: work max/mean up to 1.62 at N = 44 on generated shapes where a few tenants carry the
  traffic. Measured before/after in one run (README "Fleet simulator", session 31): those shapes
  1.16-1.32 with hit rates -1.7 to +1.8 points (mean -0.2 on 1,200 requests, +0.1 on 4,800);
  Mooncake and multi-tenant at N = 8 as before, at N = 44 within half a point either way (one
  bar cell, multi-tenant seed 1, flips to 0.14 points under cache_aware); the live bench's
  replica decides exactly as before.

* **Routing memory** (smg cache_aware's idea, under the index): the policy remembers the last
  worker it sent each page hash to (LRU, ``memory_pages``), and a worker's match is the longer of
  what the index says it holds and what was last sent there. The index says where a prefix *is*;
  after an eviction it forgets, and the family's next request went wherever the cold rule put it,
  seeding a second copy. The memory sends it back where it *was*: it recomputes once there and the
  family stays on one worker. Measured in the simulator (multi-tenant, N = 8): 0.429 -> 0.448.
  The memory is the router's own state, so it applies with Redis down too; the live router keys
  it by its own chain of the prompt's pages (``RouteRequest.memory_hashes``), not by the servers'
  page hashes, which it can compute only once it has read their ``CacheKey`` from the index: keyed
  by those, a router that started with the index slow or down remembered nothing, and a family
  placed on the less loaded of its two new-key homes went to its one home on its next request.

* **Fresh placement by cache inflow**: a request that no worker holds ``warm_frac`` (10 %) of, by
  the index and the memory, is new content (a new conversation, a one-shot scan, a new document):
  it goes to the worker, under the hatch, whose cache took the least *inflow* (prompt tokens sent
  to it that it did not hold) over the last ``inflow_horizon`` x N requests. Its later requests
  find it through the index and the memory. Why (``bench/fleet_sim.py --diagnose``, per request
  against one server with the same total cache): routing losses, i.e. a request sent to a worker
  holding less than another did, were 0.0000-0.0008 of prompt tokens on the multi-tenant mix at
  N = 8; what separated the policies was *capacity loss*, i.e. pages no server held that the
  single server had, because new content placed by its key's homes or by work left some servers'
  caches under more pressure than others. smg's cache_aware places low-match requests on the
  worker with the smallest tree (pages sent), which is this rule without the load bound. Measured
  before/after in one run: Mooncake N = 44 0.279 -> 0.283, generated shapes at N = 44 0 to +1.8
  points, multi-tenant a tie within the seed-to-seed spread, and the simulated queueing delay
  about halved (results in the README). A worker that joins starts with no inflow, so new content
  goes to it (its cache is empty) until it has caught up, bounded by the hatch.

Without the index (Redis down) the index part of the match is unknown: the memory still keeps
families where they were sent, and anything else goes by affinity + load (no fresh placement: the
homes are what a router with no index can find again).

[1] M. Mitzenmacher, "The power of two choices in randomized load balancing", IEEE TPDS 2001.
"""

from __future__ import annotations

import hashlib
import math
import struct
import sys
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence


_LITTLE_ENDIAN = sys.byteorder == "little"


def _h64(data: bytes) -> int:
    return struct.unpack("<Q", hashlib.blake2b(data, digest_size=8).digest())[0]


def rendezvous_rank(key: str | bytes, workers: Sequence[str]) -> list[str]:
    """Workers in decreasing rendezvous weight for ``key`` (deterministic across processes)."""
    kb = key.encode() if isinstance(key, str) else key
    return sorted(workers, key=lambda w: (_h64(kb + b"\x00" + w.encode()), w), reverse=True)


def rendezvous_top_k(key: str | bytes, workers: Sequence[str], k: int) -> list[str]:
    return rendezvous_rank(key, workers)[: max(1, k)]


def affinity_key(tenant: Optional[str], page_hashes: Sequence[bytes], affinity_pages: int = 2,
                 per_prefix: bool = False) -> bytes:  # fmt: skip
    """The tenant when there is one (``per_prefix``: the tenant's prompt family, i.e. its first
    page, whose hash is seeded by the tenant), else the prompt's head (its first
    ``affinity_pages`` pages: a conversation or template); prompts shorter than one page share
    the empty key."""
    if tenant and not (per_prefix and page_hashes):
        return b"t:" + tenant.encode()
    if tenant:
        return b"f:" + page_hashes[0]
    if page_hashes:
        return b"p:" + page_hashes[min(len(page_hashes), affinity_pages) - 1]
    return b"p:"


def token_affinity_key(tenant: Optional[str], tokens: Sequence[int], page_size: int, affinity_pages: int = 2,
                       per_prefix: bool = True) -> bytes:  # fmt: skip
    """``affinity_key`` from the prompt's token ids instead of its chained page hashes: the same
    families, but it does not depend on knowing the servers' ``CacheKey`` (a router that learns it
    from the index later, or never because Redis is down, keeps every key's homes)."""

    def digest(n_pages: int) -> bytes:
        head = tokens[: n_pages * page_size]
        if isinstance(head, array) and head.typecode == "q" and _LITTLE_ENDIAN:  # the router's tokens
            return hashlib.blake2b(head.tobytes(), digest_size=16).digest()  # the same bytes as below
        return hashlib.blake2b(struct.pack(f"<{len(head)}q", *head), digest_size=16).digest()

    full = len(tokens) // page_size
    if tenant and not (per_prefix and full):
        return b"t:" + tenant.encode()
    if tenant:
        return b"f:" + tenant.encode() + b"\x00" + digest(1)
    return b"p:" + digest(min(full, affinity_pages)) if full else b"p:"


@dataclass
class RouteRequest:
    prompt_tokens: int
    page_hashes: Sequence[bytes]
    tenant: Optional[str] = None
    page_size: int = 16
    key: Optional[bytes] = None  # affinity key (default: affinity_key(tenant, page_hashes))
    text: str = ""  # what smg-like text policies see
    # the routing memory's page keys (default: page_hashes); the live router passes its own chain
    # of the prompt's pages, which needs no CacheKey from the index (see the module docstring)
    memory_hashes: Optional[Sequence[bytes]] = None

    @property
    def memory_keys(self) -> Sequence[bytes]:
        return self.page_hashes if self.memory_hashes is None else self.memory_hashes


@dataclass
class FleetView:
    """What a policy may look at. ``load[w]``: in-flight work on w (requests, or the simulator's
    windowed count); ``queue_s[w]``: estimated seconds of work queued on w; ``matched[w]``: tokens
    of the prompt's prefix the hint index says w holds (absent: 0; ``None`` = no index)."""

    workers: list[str]
    load: dict[str, float]
    queue_s: dict[str, float]
    matched: Optional[dict[str, int]] = None


@dataclass
class Decision:
    worker: str
    spill: bool = False
    home: bool = False
    reason: str = ""
    matched: int = 0  # tokens the index said the chosen worker holds


def longest_match(page_hashes: Sequence[bytes], holders: Sequence[set], page_size: int,
                  workers: Sequence[str]) -> dict[str, int]:  # fmt: skip
    """From per-page holder sets (``holders[i]``: workers holding page i, in prompt order), the
    matched prefix in tokens per worker (a worker's match ends at its first missing page)."""
    out: dict[str, int] = {}
    alive = set(workers)
    for i, hs in enumerate(holders):
        alive &= hs
        if not alive:
            break
        for w in alive:
            out[w] = (i + 1) * page_size
    return out


@dataclass
class AffinityCachePolicy:
    """Ours: index locality (section 9.3) first, else rendezvous homes with adaptive k, bounded load.

    Keeps a window of the last ``horizon`` x N affinity keys (bounded memory) to know each key's
    load share; see the module docstring for the rule.
    """

    k: int = 1  # homes of a key with history and a small share (hot keys get more, up to k_max)
    k_max: int = 8
    home_share: float = 0.8  # a key gets one home per home_share x (1/N) of the fleet's requests
    new_choices: int = 2  # a key not seen in the window: the less loaded of its first 2 homes
    horizon: int = 32  # window: horizon x N requests
    overload: float = 1.25  # the hatch: a worker is over above overload x the fleet mean load ...
    slack: float = 2.0  # ... plus this many requests (small fleets at low load never spill)
    cold_over: float = 1.3  # a cold request leaves its home above cold_over x the mean load
    warm_frac: float = 0.1  # an index match shorter than this fraction of the prompt is ignored
    c_tok_s: float = 35e-6  # recompute seconds per prompt token (seed: 35 us on its fleet)
    # A recomputed token delays this request and, queued on the server, the requests behind it:
    # priced at (1 + followers) x c_tok (followers ~ rho / (1 - rho) requests at utilisation rho).
    followers: float = 9.0
    affinity_pages: int = 2
    per_prefix: bool = True  # affinity unit: the tenant (R2), or the tenant's first page
    use_index: bool = True
    # Routing memory: the last worker each page hash was sent to (LRU, at most memory_pages, about
    # 150 bytes each); 0 turns it off.
    memory_pages: int = 1 << 18
    # Fresh placement: with the index, a request no worker holds warm_frac of (new content) goes to
    # the worker, under the hatch, with the least cache inflow (prompt tokens it was sent that it
    # did not hold) over the last inflow_horizon x N requests; False: to its cold choice (homes).
    fresh: bool = True
    inflow_horizon: int = 256
    # What fresh placement minimises first: "inflow" (the cache's pressure, then load) or "queue"
    # (the work queued ahead, FleetView.queue_s, then inflow: this request's own TTFT first)
    fresh_by: str = "inflow"
    # A warm worker over the hatch may still take the request when the time rule says the recompute
    # it saves outweighs its extra queue (True), or never (False: the hatch is a hard bound).
    warm_over_hatch: bool = False
    # A warm worker over the hatch may still take the request when the time rule says so and the
    # work routed to it over the last inflow_horizon x N requests, this request's included, stays
    # within warm_cap x the fleet mean of that window (0: off). The hatch reads a short window and
    # in-flight counts, which spilled warm families off workers whose long-run share was fine;
    # warm_over_hatch=True gained the hit rate back but let the long-run share run over 1.3 x the
    # mean. Measured (bench/fleet_sim.py, whole traces, session 22; module docstring): above
    # cache_aware in all 12 cells with work max/mean <= 1.25, where 0 lost 5 of them.
    warm_cap: float = 1.25
    # The warm cap as a bound on every decision (True), not only as leave for a warm worker over
    # the hatch (False, before session 31); why, and what it cost: the module docstring.
    cap_all: bool = True
    # What the hatch reads: "view", FleetView.load as given (live: requests in flight, an
    # instantaneous count; the simulator: a windowed work share); "share", this policy's own routed
    # work per worker (uncached prompt tokens it believed + decode_tokens per request) over the last
    # horizon x N requests, against the mean request (prompt + decode); "both": over only when both
    # say so. Why "both" (bench/fleet_sim.py, before/after in one run): on the live bench's closed
    # loop, in-flight counts alone spilled warm families on a transient pile-up (5 of 6 requests on
    # one server: live replica 0.4767 -> 0.4814, above cache_aware in 3 of 3 seeds); the believed
    # share alone under-counts work on servers the routing memory over-credits and loaded them
    # more (multi-tenant N = 44: 0.4184 -> 0.4145, work max/mean 1.24 -> 1.39); both together keep
    # the first gain and the second's numbers.
    hatch_load: str = "both"
    # The share's believed work per request: the prompt less what the index says the worker holds
    # (True), or less the index raised by the routing memory (False). The memory remembers what
    # was sent, also pages the worker has since evicted, and so over-credits hot workers; in the
    # share that hid work from the hatch (bench/fleet_sim.py --seeds 0 1 2 3 4, one run:
    # multi-tenant N = 44 seed 3, work max/mean 1.36 -> 1.29). Without an index: the memory's.
    share_by_index: bool = True
    decode_tokens: int = 32
    name: str = "ours"
    # the hatch's work share and the cache inflow, per worker, each over its own window of requests
    _shares: "WindowSums" = field(default_factory=lambda: WindowSums(0.0), repr=False)
    _inflows: "WindowSums" = field(default_factory=lambda: WindowSums(0), repr=False)
    _long: "WindowSums" = field(default_factory=lambda: WindowSums(0.0), repr=False)
    _window: deque = field(default_factory=deque, repr=False)
    _count: dict = field(default_factory=dict, repr=False)
    _sent: OrderedDict = field(default_factory=OrderedDict, repr=False)

    def over(self, view: FleetView, w: str) -> bool:
        """Over the hatch: load above ``overload`` x the fleet mean + ``slack`` (mean requests)."""
        return self._hatch(view)(w)

    def _hatch(self, view: FleetView) -> Callable[[str], bool]:
        """``over`` for one view: the fleet means computed once, not per worker asked about (a
        route asks for its cold choice, each warm worker and each fresh candidate: O(N^2) at N =
        44 in the simulator)."""
        view_limit = self.overload * _mean_load(view) + self.slack
        load = view.load
        if self.hatch_load == "view" or not self._shares.window:
            return lambda w: load.get(w, 0.0) > view_limit
        share_limit = None

        def over(w: str) -> bool:
            nonlocal share_limit
            by_view = load.get(w, 0.0) > view_limit
            if not (by_view or self.hatch_load == "share"):
                return by_view
            if share_limit is None:
                shares, ws = self._shares, view.workers
                mean_request = shares.full / len(shares.window)  # prompt + decode tokens: slack's unit
                mean = sum(shares.by_worker.get(x, 0.0) for x in ws) / max(1, len(ws))
                share_limit = self.overload * mean + self.slack * mean_request
            return self._shares.by_worker.get(w, 0.0) > share_limit

        return over

    def homes(self, key: bytes, workers: Sequence[str]) -> list[str]:
        """The key's homes: ``new_choices`` for a key not seen in the window, else k adapted to
        its share of the window's requests (hot keys spread over more homes, cold keys have k)."""
        n = len(workers)
        seen = self._count.get(key, 0)
        if not seen:
            k = max(self.k, self.new_choices)
        else:
            share = seen / (self.horizon * max(1, n))  # of a full window: a young window is not a hot key
            k = max(self.k, min(self.k_max, math.ceil(share * n / self.home_share)))
        return rendezvous_top_k(key, workers, min(n, k))

    def _record(self, key: bytes, n: int) -> None:
        self._window.append(key)
        self._count[key] = self._count.get(key, 0) + 1
        while len(self._window) > self.horizon * max(1, n):
            old = self._window.popleft()
            c = self._count[old] - 1
            if c:
                self._count[old] = c
            else:
                del self._count[old]

    def route(self, req: RouteRequest, view: FleetView, remembered: Optional[dict] = None) -> Decision:
        """Route ``req``; ``remembered``: ``self.remembered(req, view.workers)`` if the caller has it."""
        mview = self._with_memory(req, view, remembered)
        # fresh placement needs the index (to know that nobody holds the prompt) and the prompt's
        # page hashes (a router that has not learnt the servers' CacheKey yet has none)
        d = self._route(req, mview, fresh=self.fresh and view.matched is not None and bool(req.page_hashes))
        new_tokens = max(0, req.prompt_tokens - (mview.matched or {}).get(d.worker, 0))
        n = len(view.workers)
        self._count_inflow(d.worker, new_tokens, n)
        work = new_tokens
        if self.share_by_index and view.matched is not None:
            work = max(0, req.prompt_tokens - view.matched.get(d.worker, 0))
        self._count_share(d.worker, work + self.decode_tokens, req.prompt_tokens + self.decode_tokens, n)
        if self.memory_pages:
            sent = self._sent
            for h in req.memory_keys:
                sent[h] = d.worker
                sent.move_to_end(h)
            while len(sent) > self.memory_pages:
                sent.popitem(last=False)
        return d

    def _count_share(self, worker: str, work: float, full: float, n: int) -> None:
        """The hatch's load: work routed to ``worker`` over the last ``horizon`` x N requests
        (``full``: the request's size with nothing cached, for the mean request)."""
        self._shares.add(worker, work, self.horizon * max(1, n), full)
        if self.warm_cap:
            self._long.add(worker, work, self.inflow_horizon * max(1, n))

    def _count_inflow(self, worker: str, new_tokens: int, n: int) -> None:
        """Cache inflow: tokens sent to ``worker`` that it did not hold (by index + memory), over
        the last ``inflow_horizon`` x N requests (bounded memory)."""
        self._inflows.add(worker, max(0, new_tokens), self.inflow_horizon * max(1, n))

    def remembered(self, req: RouteRequest, workers: Sequence[str]) -> dict[str, int]:
        """The routing memory's matches: per worker, the prompt's prefix (tokens) last sent there."""
        if not self.memory_pages or not self.use_index:
            return {}
        # longest_match with one holder per page: the first page's worker, for as long as the
        # following pages were last sent there too
        sent, keys = self._sent, req.memory_keys
        w = sent.get(keys[0]) if len(keys) else None
        if w is None or w not in workers:
            return {}
        i = 1
        while i < len(keys) and sent.get(keys[i]) == w:
            i += 1
        return {w: i * req.page_size}

    def _with_memory(self, req: RouteRequest, view: FleetView, remembered: Optional[dict] = None) -> FleetView:
        """The index's matches, each raised to the prefix this router last sent to that worker.
        The memory is the router's own: with Redis down it still keeps each family where it was
        sent (a Redis outage must not move families that fresh placement put off their homes)."""
        if remembered is None:
            remembered = self.remembered(req, view.workers)
        if not remembered:
            return view
        matched = dict(view.matched or {})
        for w, m in remembered.items():
            matched[w] = max(matched.get(w, 0), m)
        return FleetView(view.workers, view.load, view.queue_s, matched)

    def _route(self, req: RouteRequest, view: FleetView, fresh: bool = False) -> Decision:
        workers = view.workers
        n = len(workers)
        key = req.key if req.key is not None else affinity_key(req.tenant, req.page_hashes, self.affinity_pages,
                                                               self.per_prefix)  # fmt: skip
        homes = self.homes(key, workers)
        self._record(key, n)
        order = {w: i for i, w in enumerate(homes)}
        load = lambda w: view.load.get(w, 0.0)  # noqa: E731
        rank = lambda w: (load(w), order.get(w, n), w)  # noqa: E731
        over = self._hatch(view)
        matched = (view.matched or {}) if self.use_index else {}
        # the warm cap's leave over the hatch, and the load bound (cap_all): who may take this
        # request at all; when no worker fits, every choice below falls back to the unbounded one
        under_cap, fits = self._cap_tests(req, view, matched)
        if not self.cap_all:
            fits = lambda w: True  # noqa: E731
        # 1. the cold choice: the least loaded home; above cold_over x the mean (or over the
        #    hatch: a spill; or past the load bound: "cap") the least loaded worker that fits
        choice, reason = min(homes, key=rank), "home"
        spill = over(choice)
        cold = load(choice) > self.cold_over * _mean_load(view)
        if spill or cold or not fits(choice):
            pool = [w for w in workers if fits(w)] or workers
            choice, reason = min(pool, key=rank), ("spill" if spill else "cold" if cold else "cap")
        # 2. locality (section 9.3): the worker the index says holds the longest prefix, under the
        #    hatch (or within the warm cap) and the load bound, wins when the recompute it saves
        #    outweighs its extra queue delay
        floor = max(1, self.warm_frac * req.prompt_tokens)
        warm = [w for w, m in matched.items()
                if m >= floor and w in view.load and fits(w)
                and (self.warm_over_hatch or not over(w) or under_cap(w))]  # fmt: skip
        if fresh and self.use_index and not any(m >= floor for m in matched.values()):
            # 2'. new content (no worker holds warm_frac of it): to the worker whose cache takes the
            #     least inflow, under the hatch, so that every server's cache is under the same
            #     pressure (placing by work or by home left some servers' caches thrashing)
            fit = [w for w in workers if fits(w)] or workers  # the bound first, then the hatch
            pool = [w for w in fit if not over(w)] or fit
            inflow = self._inflows.by_worker
            if self.fresh_by == "queue":
                w = min(pool, key=lambda x: (view.queue_s.get(x, 0.0), inflow.get(x, 0), order.get(x, n), x))
            else:
                w = min(pool, key=lambda x: (inflow.get(x, 0), load(x), order.get(x, n), x))
            return Decision(w, home=w in order, reason="fresh", matched=matched.get(w, 0))
        if warm:
            best = max(warm, key=lambda w: (matched[w], -order.get(w, n), -load(w), w))
            saved_s = (matched[best] - matched.get(choice, 0)) * self.c_tok_s * (1.0 + self.followers)
            extra_s = view.queue_s.get(best, 0.0) - view.queue_s.get(choice, 0.0)
            if best != choice and saved_s > extra_s:
                return Decision(best, home=best in order, reason="warm", matched=matched[best])
        return Decision(choice, spill=spill and reason == "spill", home=choice in order, reason=reason,
                        matched=matched.get(choice, 0))  # fmt: skip

    def _cap_tests(self, req: RouteRequest, view: FleetView, matched: dict) -> tuple[Callable[[str], bool], Callable[[str], bool]]:
        """The two long-window tests of one route, sharing the window's fleet total and each
        worker's figures (the cold choice, the warm workers and fresh placement ask about the same
        workers): ``under_cap(w)``, would ``w``'s long-window work, with this request's work there,
        stay within warm_cap x the fleet mean of that window (the warm cap's leave over the
        hatch)? ``fits(w)``, the same plus ``slack`` x the window's mean work per request, so that
        a young window, where one request is a large part of a worker's share, does not split
        families by granularity alone (the load bound, ``cap_all``; always true while the window
        is empty)."""
        window = self._long.window
        if not (self.warm_cap and window):
            return (lambda w: False), (lambda w: True)
        by, ws = self._long.by_worker, view.workers
        n, refs = max(1, len(ws)), len(window) + 1
        total = None  # the window's work over the fleet: summed once per route, when first asked
        memo: dict = {}

        def sides(w: str) -> tuple:
            """(w's window work with this request's, the cap, the room)."""
            nonlocal total
            got = memo.get(w)
            if got is None:
                if total is None:
                    total = sum(by.get(x, 0.0) for x in ws)
                work = max(0, req.prompt_tokens - matched.get(w, 0)) + self.decode_tokens
                got = memo[w] = (by.get(w, 0.0) + work, self.warm_cap * (total + work) / n,
                                 self.slack * (total + work) / refs)  # fmt: skip
            return got

        def under_cap(w: str) -> bool:
            have, cap, _ = sides(w)
            return have <= cap

        def fits(w: str) -> bool:
            have, cap, room = sides(w)
            return have <= cap + room

        return under_cap, fits


class WindowSums:
    """Per-worker sums of a value over the last ``limit`` entries (a sliding window of requests),
    and the window's total of a second value (``full``) where one is given.

    I1 ``by_worker[w] == sum of the values of w's entries in window`` and
       ``full == sum of the entries' full values``; ``len(window) <= limit`` after every add.
    """

    __slots__ = ("by_worker", "window", "full", "zero")

    def __init__(self, zero=0):
        self.by_worker: dict = {}
        self.window: deque = deque()
        self.full = zero
        self.zero = zero

    def add(self, worker: str, value, limit: int, full=None) -> None:
        self.by_worker[worker] = self.by_worker.get(worker, self.zero) + value
        if full is None:
            self.window.append((worker, value))
        else:
            self.full += full
            self.window.append((worker, value, full))
        while len(self.window) > limit:
            old = self.window.popleft()
            self.by_worker[old[0]] -= old[1]
            if len(old) > 2:
                self.full -= old[2]


def _mean_load(view: FleetView) -> float:
    n = len(view.workers)
    return sum(view.load.get(x, 0.0) for x in view.workers) / n if n else 0.0


# ---------------------------------------------------------------------------- baselines (smg-like)
@dataclass
class RoundRobin:
    name: str = "round_robin"
    i: int = 0

    def route(self, req: RouteRequest, view: FleetView) -> Decision:
        w = view.workers[self.i % len(view.workers)]
        self.i += 1
        return Decision(w)


@dataclass
class LeastLoad:
    name: str = "least_load"

    def route(self, req: RouteRequest, view: FleetView) -> Decision:
        return Decision(min(view.workers, key=lambda x: (view.load.get(x, 0.0), x)))


@dataclass
class ConsistentHash:
    """smg ``consistent_hashing``/``prefix_hash``: a hash ring over workers (virtual nodes), keyed by
    the routing key (tenant header) or, without one, a hash of the first ``prefix_tokens`` tokens.
    With ``load_factor`` (prefix_hash), a worker whose load exceeds load_factor x the average AND
    the average + ``abs_threshold`` is skipped for the next one on the ring (smg 1.13 defaults:
    1.25 and 10)."""

    load_factor: Optional[float] = 1.25
    abs_threshold: float = 10.0
    vnodes: int = 160
    name: str = "prefix_hash"
    prefix_pages: int = 16  # 256 tokens / 16
    _ring: list = field(default_factory=list)
    _ring_for: tuple = ()

    def _build(self, workers):
        ring = []
        for w in workers:
            for v in range(self.vnodes):
                ring.append((_h64(f"{w}#{v}".encode()), w))
        ring.sort()
        self._ring, self._ring_for = ring, tuple(workers)

    def route(self, req: RouteRequest, view: FleetView) -> Decision:
        if tuple(view.workers) != self._ring_for:
            self._build(view.workers)
        if req.tenant:
            key = b"t:" + req.tenant.encode()
        else:
            ph = req.page_hashes
            key = b"p:" + (ph[min(len(ph), self.prefix_pages) - 1] if ph else b"")
        import bisect

        h = _h64(key)
        i = bisect.bisect_left(self._ring, (h, ""))
        n = len(view.workers)
        avg = sum(view.load.get(x, 0.0) for x in view.workers) / n
        seen = []
        for j in range(len(self._ring)):
            w = self._ring[(i + j) % len(self._ring)][1]
            if w in seen:
                continue
            seen.append(w)
            if self.load_factor is None:
                return Decision(w, home=True)
            ld = view.load.get(w, 0.0)
            if not (ld > self.load_factor * avg and ld > avg + self.abs_threshold):
                return Decision(w, home=len(seen) == 1, spill=len(seen) > 1)
            if len(seen) == n:
                break
        return Decision(seen[0], home=True)


@dataclass
class CacheAware:
    """smg ``cache_aware``: an approximate per-worker prefix tree of what the router *sent* there
    (it never learns evictions), at page granularity here (smg: characters or tokens). If the
    fleet is imbalanced (max load - min load > ``abs_threshold`` AND max > ``rel_threshold`` x min),
    route to the least loaded; else to the worker with the longest match if match/prompt >=
    ``threshold``, else to the worker with the smallest tree. The tree is bounded (LRU)."""

    threshold: float = 0.3
    abs_threshold: float = 64.0
    rel_threshold: float = 1.5
    max_pages: int = 1 << 22
    name: str = "cache_aware"
    _trees: dict = field(default_factory=dict)

    def route(self, req: RouteRequest, view: FleetView) -> Decision:
        from collections import OrderedDict

        trees = self._trees
        for w in view.workers:
            trees.setdefault(w, OrderedDict())
        loads = [view.load.get(w, 0.0) for w in view.workers]
        if max(loads) - min(loads) > self.abs_threshold and max(loads) > self.rel_threshold * min(loads):
            w = min(view.workers, key=lambda x: (view.load.get(x, 0.0), x))
            self._insert(w, req)
            return Decision(w, spill=True)
        best, best_m = None, -1
        for w in view.workers:
            t = trees[w]
            m = 0
            for h in req.page_hashes:
                if h in t:
                    m += 1
                else:
                    break
            if m > best_m:
                best, best_m = w, m
        total = max(1, req.prompt_tokens // req.page_size)
        if best_m > 0 and best_m / total >= self.threshold:
            w = best
        else:
            w = min(view.workers, key=lambda x: (len(trees[x]), x))
        self._insert(w, req)
        return Decision(w, home=w == best and best_m > 0)

    def _insert(self, w, req):
        t = self._trees[w]
        for h in req.page_hashes:
            t[h] = None
            t.move_to_end(h)
        while len(t) > self.max_pages:
            t.popitem(last=False)


POLICIES: dict[str, Callable[[], object]] = {
    "round_robin": RoundRobin,
    "least_load": LeastLoad,
    "cache_aware": CacheAware,
    "consistent_hashing": lambda: ConsistentHash(load_factor=None, name="consistent_hashing"),
    "prefix_hash": ConsistentHash,
    "ours": AffinityCachePolicy,
}
