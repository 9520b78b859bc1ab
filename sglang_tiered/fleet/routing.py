"""Fleet routing policies (pure Python: no torch, no sglang).

One interface for the live router (``sglang_tiered.fleet.router``) and the fleet simulator
(``bench/fleet_sim.py``): a policy sees a ``RouteRequest`` (page hashes of the prompt, an affinity
key, prompt length) and a ``FleetView`` (workers, their load, what the hint index says each one
holds) and returns a ``Decision``.

Ours (``AffinityCachePolicy``), seed R2 + section 9.3:

* **Affinity**: the affinity key is rendezvous-hashed onto its top-``k`` home workers (k = 1 by
  default). The key is the tenant's prompt family (its first page hash, which the tenant seeds;
  ``per_prefix=False``: the tenant itself, ``cache_salt`` or the trusted header), or without a
  tenant the prompt's first ``affinity_pages`` pages (its conversation or template). Rendezvous
  (highest random weight) hashing moves only the keys whose top-k contained a leaving worker (or
  now contains a joining one): about k/n of them per membership change.
* **Occupancy escape hatch**: a worker is *eligible* while its load (``FleetView.load``: requests
  in flight, or the simulator's recent work) is at most ``overload`` x the fleet mean + ``slack``
  (1.25 and 2). The first eligible home in rendezvous order is the candidate (R2: the next homes
  only take overflow, so a working set is not copied k times); when no home is eligible the
  request spills to the least loaded worker (counted in ``spill``).
* **Cache locality** from the hint index, in units of time (section 9.3: prefer a warmer replica if
  matched_tokens x recompute cost per token > extra queue delay): every eligible worker the index
  says holds a prefix of the prompt is a candidate too; each costs

      cost(w) = (prompt_tokens - matched_tokens(w)) x c_tok x (1 + followers)  +  queue_delay(w)

  where ``c_tok`` is the recompute time per token (seconds), ``followers`` the requests queued
  behind this one that each recomputed token also delays (default 2, i.e. rho ~ 0.67), and
  ``queue_delay(w)`` the work queued on w ahead of this request, in seconds
  (``FleetView.queue_s``). The minimum wins; ties go to the home.
* **Cold requests balance**: with the index up, a prompt of which no worker holds ``cold_frac``
  (a quarter) recomputes the same everywhere, so when its home is above ``cold_over`` x the mean
  load + slack/2 it goes to the least loaded worker instead; warm requests stay unless the hatch
  moves them.

Without the index (Redis down) nothing is known to match and the rule is affinity + load.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence


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


@dataclass
class RouteRequest:
    prompt_tokens: int
    page_hashes: Sequence[bytes]
    tenant: Optional[str] = None
    page_size: int = 16
    key: Optional[bytes] = None  # affinity key (default: affinity_key(tenant, page_hashes))
    text: str = ""  # what smg-like text policies see


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
    """Ours: rendezvous top-k homes + occupancy escape hatch + index locality, priced in seconds."""

    k: int = 1
    overload: float = 1.25  # a worker is over the hatch above overload x the fleet mean load ...
    slack: float = 2.0  # ... plus this many requests (small fleets at low load never spill)
    c_tok_s: float = 35e-6  # recompute seconds per prompt token (seed: 35 us on its fleet)
    affinity_pages: int = 2
    per_prefix: bool = True  # affinity unit: the tenant (R2), or the tenant's first page
    use_index: bool = True
    # A recomputed token delays this request and, queued on the server, the requests behind it:
    # priced at (1 + followers) x c_tok (followers ~ rho / (1 - rho) requests at utilisation rho).
    followers: float = 2.0
    # Cold requests balance the load: with the index up, a prompt of which no worker holds more
    # than cold_frac recomputes the same everywhere, so when its home is above the mean load it
    # goes to the least loaded worker instead (warm requests stay; only the hatch moves them).
    cold_frac: float = 0.25
    cold_over: float = 1.15  # ... above cold_over x the mean load + slack / 2
    name: str = "ours"

    def over(self, view: FleetView, w: str) -> bool:
        n = len(view.workers)
        mean = sum(view.load.get(x, 0.0) for x in view.workers) / n if n else 0.0
        return view.load.get(w, 0.0) > self.overload * mean + self.slack

    def route(self, req: RouteRequest, view: FleetView) -> Decision:
        workers = view.workers
        key = req.key if req.key is not None else affinity_key(req.tenant, req.page_hashes, self.affinity_pages,
                                                               self.per_prefix)  # fmt: skip
        homes = rendezvous_top_k(key, workers, self.k)
        matched = (view.matched or {}) if self.use_index else {}
        # R2: the first home (in rendezvous order) under the hatch; the others only as overflow
        cands = [w for w in homes if not self.over(view, w)][:1]
        warm = [w for w, m in matched.items() if m > 0 and w not in homes and w in view.load
                and not self.over(view, w)]  # fmt: skip
        if not cands and not warm:
            w = min(workers, key=lambda x: (view.load.get(x, 0.0), view.queue_s.get(x, 0.0), x))
            return Decision(w, spill=True, home=False, reason="spill", matched=matched.get(w, 0))
        order = {w: i for i, w in enumerate(homes)}
        if (self.cold_frac > 0 and view.matched is not None and self.use_index and cands
                and max(matched.values(), default=0) < self.cold_frac * req.prompt_tokens):
            mean = sum(view.load.get(x, 0.0) for x in workers) / len(workers)
            if view.load.get(cands[0], 0.0) > self.cold_over * mean + self.slack / 2:
                w = min(workers, key=lambda x: (view.load.get(x, 0.0), order.get(x, len(order)), x))
                return Decision(w, spill=False, home=w in order, reason="cold", matched=matched.get(w, 0))

        def cost(w):
            miss = max(0, req.prompt_tokens - matched.get(w, 0))
            recompute = miss * self.c_tok_s * (1.0 + self.followers)
            return (recompute + view.queue_s.get(w, 0.0), order.get(w, len(order)), w)

        best = min(cands + warm, key=cost)
        return Decision(best, spill=False, home=best in order,
                        reason="home" if best in order else "warm", matched=matched.get(best, 0))  # fmt: skip


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
