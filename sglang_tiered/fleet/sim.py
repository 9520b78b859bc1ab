"""Fleet simulator core (pure Python): N simulated servers, a hint index, a routing policy.

A *server* is anything with ``run(tokens, tenant) -> (prompt_len, cached_len)`` and an
``attach_index(listener)`` hook (bench/fleet_sim.py passes ``TieredRadixCache.create_simulated``
caches, device + T1). Requests are replayed one at a time in trace order.

Load model (stated, used by every policy alike): each server works off a backlog of tokens at
1/``c_tok`` tokens per second; a request adds its uncached prompt tokens plus ``decode_tokens``.
Arrivals are evenly spaced so that the fleet would be ``rho`` busy if nothing were cached. A
server's *queue delay* is its backlog x ``c_tok``; its *load* (its occupancy, for the hatch and
least_load) is the work routed to it over the last ``horizon`` x N arrivals, in units of the mean
request's work (a sustained share, like R2's KV occupancy, not the instantaneous backlog). Reported imbalance (the acceptance's load metric):
max/mean over servers of **work done** (uncached prompt tokens + decode_tokens per request, i.e.
busy time); max/mean of requests routed is reported beside it.

Closed loop (``clients`` > 0, the live bench's shape: C clients, each sends its next request when
the previous one finished): a server works its requests first come first served, each taking
(uncached prompt + ``decode_tokens``) x ``c_tok``; a server's *load* is then its requests in
flight and its *queue delay* their remaining work, which is what the live router sees (its own
in-flight counts and ``/v1/loads``).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from sglang_tiered.fleet.routing import FleetView, RouteRequest, longest_match


class SimIndex:
    """The hint index, exact and instantaneous (Redis without latency): page hash -> servers."""

    def __init__(self):
        self.holders: dict[bytes, set] = {}
        self.held: dict[str, int] = {}  # pages per worker

    def listener(self, worker: str):
        idx = self

        class _L:
            def on_store(self, hashes):
                for h in hashes:
                    s = idx.holders.setdefault(h, set())
                    if worker not in s:
                        s.add(worker)
                        idx.held[worker] = idx.held.get(worker, 0) + 1

            def on_remove(self, hashes):
                for h in hashes:
                    s = idx.holders.get(h)
                    if s is not None and worker in s:
                        s.discard(worker)
                        idx.held[worker] -= 1
                        if not s:
                            del idx.holders[h]

            def on_clear(self):
                for h in [h for h, s in idx.holders.items() if worker in s]:
                    self.on_remove([h])

        return _L()

    def matched(self, hashes, page_size, workers) -> dict[str, int]:
        empty: set = set()
        return longest_match(hashes, [self.holders.get(h, empty) for h in hashes], page_size, workers)


@dataclass
class SimResult:
    policy: str
    n: int
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    spills: int = 0
    unserved: int = 0
    per_worker_requests: list = field(default_factory=list)
    per_worker_work: list = field(default_factory=list)
    queue_s: float = 0.0  # summed queueing delay of all requests (simulated seconds)
    ttft_s: float = 0.0  # summed queueing delay + own uncached prefill (a TTFT proxy, seconds)
    ttfts: list = field(default_factory=list, repr=False)  # each request's TTFT proxy (for its p90)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def imbalance(self) -> float:
        r = self.per_worker_requests
        return max(r) / (sum(r) / len(r)) if r and sum(r) else 1.0

    @property
    def work_imbalance(self) -> float:
        r = self.per_worker_work
        return max(r) / (sum(r) / len(r)) if r and sum(r) else 1.0

    def as_dict(self) -> dict:
        return {"policy": self.policy, "n": self.n, "requests": self.requests,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "hit_rate": round(self.hit_rate, 4), "load_imbalance": round(self.imbalance, 3),
                "work_imbalance": round(self.work_imbalance, 3),
                "mean_queue_ms": round(1e3 * self.queue_s / self.requests, 3) if self.requests else 0.0,
                "mean_ttft_ms": round(1e3 * self.ttft_s / self.requests, 3) if self.requests else 0.0,
                "p90_ttft_ms": round(1e3 * _quantile(self.ttfts, 0.9), 3),
                "spill_rate": round(self.spills / self.requests, 4) if self.requests else 0.0,
                "unserved": self.unserved}  # fmt: skip


def simulate(requests, servers: dict, policy, hashes_of, *, page_size: int = 16, rho: float = 0.9,
             decode_tokens: int = 32, c_tok_s: float = 35e-6, horizon: int = 32, clients: int = 0,
             on_route=None) -> SimResult:  # fmt: skip
    """``requests``: list of (tokens, tenant); ``servers``: worker name -> server;
    ``hashes_of(tokens, tenant)``: the prompt's chained page hashes (same as the servers').
    ``clients`` > 0: closed loop with that many clients (see the module docstring).
    ``on_route(i, req, view, decision, prompt, cached)``: called per request (diagnostics)."""
    if clients:
        return _simulate_closed(requests, servers, policy, hashes_of, page_size=page_size, clients=clients,
                                decode_tokens=decode_tokens, c_tok_s=c_tok_s, on_route=on_route)  # fmt: skip
    workers = list(servers)
    index = SimIndex()
    for w, s in servers.items():
        s.attach_index(index.listener(w))
    mean_work = sum(len(t) + decode_tokens for t, _ in requests) / max(1, len(requests))
    # Arrivals are evenly spaced so that, without any cache, the fleet would be rho busy.
    drain = mean_work / rho / len(workers)  # tokens each server works off between two arrivals
    backlog = {w: 0.0 for w in workers}
    recent: deque = deque()  # (worker, work) of the last horizon x N arrivals
    share = {w: 0.0 for w in workers}
    window = horizon * len(workers)
    res = SimResult(policy.name, len(workers), per_worker_requests=[0] * len(workers),
                    per_worker_work=[0] * len(workers))  # fmt: skip
    pos = {w: i for i, w in enumerate(workers)}
    for tokens, tenant in requests:
        for w in workers:
            backlog[w] = max(0.0, backlog[w] - drain)
        hashes = hashes_of(tokens, tenant)
        view = FleetView(workers, {w: share[w] / mean_work for w in workers},
                         {w: backlog[w] * c_tok_s for w in workers},
                         index.matched(hashes, page_size, workers))  # fmt: skip
        req = RouteRequest(len(tokens), hashes, tenant, page_size)
        d = policy.route(req, view)
        prompt, cached = servers[d.worker].run(tokens, tenant)
        if on_route is not None:
            on_route(res.requests, req, view, d, prompt, cached)
        work = (prompt - cached) + decode_tokens
        b = backlog[d.worker]
        _account(res, pos[d.worker], d, prompt, cached, work, b * c_tok_s, (b + prompt - cached) * c_tok_s)
        backlog[d.worker] += work
        recent.append((d.worker, work))
        share[d.worker] += work
        if len(recent) > window:
            ow, oc = recent.popleft()
            share[ow] -= oc
    return res


def _simulate_closed(requests, servers: dict, policy, hashes_of, *, page_size: int, clients: int,
                     decode_tokens: int, c_tok_s: float, on_route) -> SimResult:  # fmt: skip
    """The closed loop: ``clients`` clients send the requests in trace order, each its next one
    when its previous one finished; servers serve first come first served."""
    workers = list(servers)
    index = SimIndex()
    for w, s in servers.items():
        s.attach_index(index.listener(w))
    res = SimResult(policy.name, len(workers), per_worker_requests=[0] * len(workers),
                    per_worker_work=[0] * len(workers))  # fmt: skip
    pos = {w: i for i, w in enumerate(workers)}
    free_at = [0.0] * clients  # heap: when each client sends its next request
    busy_until = {w: 0.0 for w in workers}
    running: dict = {w: [] for w in workers}  # heap of (finish time, start time, work s) per server
    for i, (tokens, tenant) in enumerate(requests):
        now = heapq.heappop(free_at)
        for w in workers:
            q = running[w]
            while q and q[0][0] <= now:
                heapq.heappop(q)
        hashes = hashes_of(tokens, tenant)
        view = FleetView(workers, {w: float(len(running[w])) for w in workers},
                         {w: max(0.0, busy_until[w] - now) for w in workers},
                         index.matched(hashes, page_size, workers))  # fmt: skip
        req = RouteRequest(len(tokens), hashes, tenant, page_size)
        d = policy.route(req, view)
        prompt, cached = servers[d.worker].run(tokens, tenant)
        if on_route is not None:
            on_route(i, req, view, d, prompt, cached)
        work = (prompt - cached) + decode_tokens
        start = max(now, busy_until[d.worker])
        finish = start + work * c_tok_s
        busy_until[d.worker] = finish
        heapq.heappush(running[d.worker], (finish, start, work))
        heapq.heappush(free_at, finish)
        _account(res, pos[d.worker], d, prompt, cached, work, start - now, start - now + (prompt - cached) * c_tok_s)
    return res


def _account(res: SimResult, i: int, d, prompt: int, cached: int, work: float, queue_s: float, ttft_s: float) -> None:
    """One routed request into the result (``i``: its worker's position)."""
    res.requests += 1
    res.prompt_tokens += prompt
    res.cached_tokens += cached
    res.spills += bool(d.spill)
    res.per_worker_requests[i] += 1
    res.per_worker_work[i] += work
    res.queue_s += queue_s
    res.ttft_s += ttft_s
    res.ttfts.append(ttft_s)


def _quantile(xs: list, q: float) -> float:
    """The q-quantile (nearest rank) of ``xs``; 0 for none."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]
