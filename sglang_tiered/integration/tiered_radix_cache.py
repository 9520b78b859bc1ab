"""``TieredRadixCache``: SGLang's ``RadixCache`` with our admission policy and bookkeeping.

The only module (with plugin.py) that imports sglang. SGLang's ownership contract is kept intact:
the tree owns ``[0, req.kv.cache_protected_len)`` of a request's KV row, and whatever ``checkpoint``
does not adopt is freed by ``release_kv_cache`` (sglang/srt/mem_cache/common.py:400-444). We never
pass ``checkpoint`` an ``up_to`` below ``cache_protected_len`` (that would double-free tree pages).

Per tree node we keep (lazily, incrementally) the chained page hashes of its pages
(``node.tiered_hashes``) and the token depth of its end (``node.tiered_end``); a long prompt is
hashed once, page by page, as it is inserted, and never again.
"""

from __future__ import annotations

import heapq
import logging
import time
from typing import Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from sglang_tiered.core.keys import CacheKey, chain_page_hashes
from sglang_tiered.core.policy import COLD, PROTECTED, UNPROTECTED, AdaptivePolicy, PolicyConfig
from sglang_tiered.core.tenants import TenantTable, name_hash, tenant_of

logger = logging.getLogger("sglang_tiered")
SEED_TABLE_MAX = 4096  # memoised namespace seeds (bounded: clients may mint salts freely)
PENDING_HOST_MAX = 4096
COUNTED_MAX = 65536  # requests between their first checkpoint and their release  # T1 probes of requests still waiting for admission

# Defaults for the attributes we keep on SGLang's tree nodes (class attributes only add defaults;
# nothing of SGLang's changes): page hashes and depth (set lazily), the logical time of last use,
# and the cold / invalidated flags.
TreeNode.tiered_hashes = None
TreeNode.tiered_tick = 0
TreeNode.tiered_cold = False
TreeNode.tiered_invalid = False
TreeNode.tiered_entry = None  # (tick, protected) of the node's live entry in the victim queue


class _VictimQueue:
    """Eviction order for the adaptive mode, kept across ``evict`` calls: two lazy heaps of
    (tick of last use, node id, node), one for unprotected leaves and one for protected (reused)
    leaves. The victim is the older head once protected ones are shifted by the policy's boost.

    Entries are pushed when a node becomes an evictable leaf; an entry whose node has since been
    used, re-classed, locked or deleted is dropped when it reaches the top (and the node, if still
    evictable, re-queued with its current state), so eviction costs O(log n) per victim instead
    of SGLang's O(n) heap rebuild per call. A node's live entry is ``node.tiered_entry``."""

    def __init__(self, leaves: set):
        self.leaves = leaves  # the tree's evictable_leaves (SGLang keeps it current)
        self.heaps: tuple[list, list] = ([], [])

    def clear(self) -> None:
        self.heaps[0].clear()
        self.heaps[1].clear()

    def offer(self, node) -> None:
        prot = node.hit_count >= 2
        entry = (node.tiered_tick, prot)
        if node.tiered_entry != entry:
            node.tiered_entry = entry
            heapq.heappush(self.heaps[prot], (node.tiered_tick, node.id, node))
            if len(self.heaps[0]) + len(self.heaps[1]) > 4 * len(self.leaves) + 1024:
                self._rebuild()

    def _rebuild(self) -> None:
        self.clear()
        for n in self.leaves:
            prot = n.hit_count >= 2
            n.tiered_entry = (n.tiered_tick, prot)
            self.heaps[prot].append((n.tiered_tick, n.id, n))
        heapq.heapify(self.heaps[0])
        heapq.heapify(self.heaps[1])

    def _head(self, i: int):
        heap, leaves = self.heaps[i], self.leaves
        while heap:
            tick, _, node = heap[0]
            if node in leaves and node.tiered_tick == tick and (node.hit_count >= 2) == bool(i):
                return heap[0]
            heapq.heappop(heap)
            if node.tiered_entry == (tick, bool(i)):
                node.tiered_entry = None  # that was its live entry
            if node in leaves:  # stale: used or re-classed since; queue it afresh
                self.offer(node)
        return None

    def peek(self, boost: float):
        while True:  # cleaning one heap may re-queue a node into the other: settle both tops
            a = self._head(0)
            b = self._head(1)
            if self._head(0) is a:
                break
        if a is None and b is None:
            return None, -1
        # ties (same tick) go to the older node, as SGLang's lru does (creation order = id order)
        if b is None or (a is not None and (a[0] < b[0] + boost or (a[0] == b[0] + boost and a[1] <= b[1]))):
            return a[2], 0
        return b[2], 1

    def pop(self, boost: float):
        node, i = self.peek(boost)
        if node is not None:
            heapq.heappop(self.heaps[i])
            node.tiered_entry = None
        return node


class _RebuiltQueue:
    """The fixed orders (force_mode experiments): a heap rebuilt per ``evict`` call, like SGLang."""

    def __init__(self, items: list, priority):
        heapq.heapify(items)
        self.heap = items
        self.priority = priority

    def offer(self, node) -> None:
        heapq.heappush(self.heap, (self.priority(node), node.id, node))

    def peek(self, boost: float):
        return (self.heap[0][2], 0) if self.heap else (None, -1)

    def pop(self, boost: float):
        return heapq.heappop(self.heap)[2] if self.heap else None


class TieredRadixCache(RadixCache):
    """Radix cache backend registered as ``--radix-cache-backend tiered``."""

    def __init__(
        self,
        params,
        *,
        cache_key: Optional[CacheKey] = None,
        policy_config: Optional[PolicyConfig] = None,
        capacity_tokens: Optional[int] = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        debug_checks: bool = False,
    ):
        # RadixCache.__init__ calls self.reset(): our state must exist before it.
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.cache_key = cache_key or CacheKey()
        self.debug_checks = debug_checks
        alloc = params.token_to_kv_pool_allocator
        if capacity_tokens is None:
            capacity_tokens = getattr(alloc, "size", 0) or 1 << 16
        self.capacity_tokens = capacity_tokens
        self.policy = AdaptivePolicy(max(1, capacity_tokens // params.page_size), policy_config)
        self._pin_budget = self.policy.pin_budget_pages()
        self._seeds: dict = {}
        self._counted: dict[str, int] = {}
        self.tenants = TenantTable()
        self._invalid_nodes = 0  # invalidated nodes still held by running requests
        self.versions: dict[str, str] = {}  # identity names an invalidation may target
        self.last_invalidation: dict = {}
        self.metrics = None
        # Fleet hint index (sglang_tiered.fleet.publisher): told which page hashes this server
        # holds (device or T1) and which it dropped; never on the request path (it only queues).
        self.index_listener = None
        self._queue: Optional[_VictimQueue] = None
        self._cur = 0.0  # logical time of the cache call in progress (see _now)
        self._seq = self._seq_tick = 0
        self.host = None  # HostTier when T1 is on
        self.store = None  # StoreQueue: T1 writes off the request path (None: synchronous demotion)
        self._flushing = False
        self.host_decision = "off"
        self.t2_decision = "off: SGLANG_TIERED_T2 unset"
        self._pending_host: dict = {}  # rid -> (node, page hashes) probed in match_prefix
        self._load_locks: list = []
        if getattr(params, "enable_metrics", False) and tp_rank == 0:
            from sglang_tiered.integration.metrics import TieredMetrics

            self.metrics = TieredMetrics()
        super().__init__(params)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_build_context(cls, ctx) -> "TieredRadixCache":
        from sglang_tiered.integration.identity import cache_key_from_context

        from sglang_tiered.config import load_config

        cfg = load_config()
        key = cache_key_from_context(ctx)
        cache = cls(ctx.params, cache_key=key, tp_rank=ctx.tp_rank, tp_size=ctx.tp_size, debug_checks=cfg.debug)
        cache._setup_host_tier(ctx, cfg)
        if cfg.index_url and ctx.tp_rank == 0:  # ranks are identical: rank 0 publishes
            from sglang_tiered.fleet.publisher import IndexPublisher

            cache.attach_index(IndexPublisher.from_config(cfg, key))
        cache.versions = {
            "model_id": key.model_id,
            "weights_digest": key.weights_digest,
            "weight_version": str(getattr(ctx.server_args, "weight_version", "") or ""),
        }
        return cache

    @classmethod
    def create_simulated(
        cls,
        capacity_tokens: int,
        page_size: int = 16,
        policy_config: Optional[PolicyConfig] = None,
        cache_key: Optional[CacheKey] = None,
        max_request_tokens: int = 1 << 17,
        debug_checks: bool = False,
        host_pages: int = 0,
        verify_kv: bool = False,
        store_queue_pages: int = 0,
    ) -> "TieredRadixCache":
        """A ``TieredRadixCache`` over a simulated page allocator, without a model.

        ``cache.driver.run(token_ids, tenant=...)`` replays one request in the scheduler's call
        order and returns its ``RequestOutcome`` (prompt_len, cached_len, seconds). Use it to
        evaluate the policy on your own traces (see bench/trace_replay.py)."""
        from sglang_tiered.integration.simulate import CacheDriver, make_params

        params, alloc, pool = make_params(capacity_tokens, page_size, max_request_tokens,
                                          with_kv=bool(host_pages or verify_kv))  # fmt: skip
        cache = cls(params, cache_key=cache_key, policy_config=policy_config,
                    capacity_tokens=alloc.size, debug_checks=debug_checks)  # fmt: skip
        if host_pages:
            from sglang_tiered.tier.host_tier import HostTier

            kv = alloc.get_kvcache()
            cache.host = HostTier.build(kv, page_size=page_size, total_kv_heads=kv.head_num, tp_size=1,
                                        tp_rank=0, capacity_pages=host_pages, name=None)  # fmt: skip
            cache.host_decision = cache.host.decision = "on: simulated"
            if store_queue_pages:  # written by drain() after every request (deterministic)
                cache.store = cache.make_store_queue(store_queue_pages, threaded=False)
        cache.driver = CacheDriver(cache, alloc, pool, verify_kv=verify_kv)
        return cache

    # ------------------------------------------------------------------ fleet hint index
    def attach_index(self, listener) -> None:
        """Tell ``listener`` (``on_store(hashes)``, ``on_remove(hashes)``, ``on_clear()``) which
        page hashes this server holds, in device or T1. Hints only: a missed or late notification
        changes where a router sends a request, never what a request computes."""
        self.index_listener = listener
        if self.host is not None:
            self.host.pool.forget_listener = lambda h: listener.on_remove([h])

    def _notify(self, kind: str, hashes) -> None:
        if self.index_listener is not None and hashes:
            getattr(self.index_listener, kind)(hashes)

    def _setup_host_tier(self, ctx, cfg) -> None:
        from sglang_tiered.integration.host_setup import build_host_tier

        self.host, self.host_decision = build_host_tier(self, ctx, cfg)
        if cfg.t2 is not None:
            from sglang_tiered.integration.t2_setup import build_t2

            self.t2_decision = build_t2(self, ctx, cfg.t2)
        if self.host is not None and cfg.store == "async":
            # default: the device pool (a pending page is a device page, so this never binds
            # unless half the pool waits for T1: then one-shots are filtered and value-drop runs)
            pages = cfg.store_queue_pages or max(64, self.capacity_tokens // self.page_size)
            # TP ranks share one T1 and must make identical slot and drop decisions, so with TP > 1
            # the queue drains at the end of every batch in the scheduler thread (same point on
            # every rank) instead of on a free-running worker whose timing differs per rank.
            # On CPU a worker thread only competes with the forward pass for the GIL and the cores
            # (measured: TTFT p50 x1.6 on the demo workload), so there the queue drains at the
            # end of each batch too; the worker thread is for CUDA, where the copy runs on a side
            # stream while the forward pass runs.
            threaded = self.tp_size == 1 and self.host.k_buffers[0].is_cuda
            self.store = self.make_store_queue(pages, threaded=threaded)

    def make_store_queue(self, capacity_pages: int, threaded: bool = True):
        """The T1 store queue (sglang_tiered/core/store_queue.py) writing through ``self.host``.
        On CUDA the worker copies on a side stream after the event recorded at enqueue."""
        from sglang_tiered.core.store_queue import StoreQueue

        host = self.host
        side = None
        if host.k_buffers[0].is_cuda:
            side = torch.cuda.Stream(device=host.k_buffers[0].device)

        def write(job) -> None:
            pages = torch.tensor(job.pages, dtype=torch.int64)
            if side is None:
                host.demote(pages, job.hashes, job.tenant)
                return
            with torch.cuda.stream(side):
                host.demote(pages, job.hashes, job.tenant, ready=job.ctx)

        return StoreQueue(capacity_pages, write, threaded=threaded)

    def _page_ids(self, node) -> list:
        """Device page ids of a node's slots (one per page)."""
        return (node.value[:: self.page_size] // self.page_size).tolist()

    def _fence(self, node, run: bool) -> None:
        """Before a node's device pages are freed: no store of them may be pending or running."""
        if self.store is not None and self.store.pending:
            self.store.fence(self._page_ids(node), run=run)

    def _write_through(self, anchor, last) -> None:
        """Offer the runs of pages a request just added to the tree (``anchor``..``last``) to the
        store queue, one job per node, valued ``frequency x pages`` (R3)."""
        store, policy = self.store, self.policy
        ready = None
        if self.host.k_buffers[0].is_cuda:
            ready = torch.cuda.Event()
            ready.record()  # the forward pass that wrote these pages
        node = last
        while node is not anchor and node is not self.root_node:
            hashes = node.tiered_hashes
            if hashes and not node.tiered_invalid:
                freq = policy.node_frequency(hashes)
                store.offer(self._page_ids(node), hashes, freq * len(hashes), frequency=freq,
                            tenant=name_hash(tenant_of(node.key.cache_salt)), ctx=ready)  # fmt: skip
            node = node.parent

    def _demote_victim(self, x) -> None:
        """T1 gets an evicted leaf's pages: with the store queue they are usually there already
        (a pending write is finished inline; then only T1's recency is refreshed); a reused leaf
        the queue dropped is copied now; without the queue, every leaf is copied now."""
        ps = self.page_size
        pages = x.value[::ps] // ps
        tenant = name_hash(tenant_of(x.key.cache_salt))
        if self.store is not None:
            self._fence(x, run=True)
            if self.host.touch(x.tiered_hashes) or (x.hit_count < 2 and not self._flushing):
                return
            self.store.stats.inline_pages += self.host.demote(pages, x.tiered_hashes, tenant)
            return
        self.host.demote(pages, x.tiered_hashes, tenant)

    def describe(self) -> str:
        return (
            f"TieredRadixCache(page_size={self.page_size}, capacity_tokens={self.capacity_tokens}, "
            f"tp_rank={self.tp_rank}/{self.tp_size}, key={self.cache_key})"
        )

    def reset(self):
        # /flush_cache empties the device tree; with T1 on, its pages go to T1 first (so a flush
        # before shutdown leaves everything in a named T1 for a warm restart).
        if getattr(self, "host", None) is not None and getattr(self, "root_node", None) is not None:
            self._flushing = True  # everything goes to T1, whatever the store queue judged
            try:
                self.evict(EvictParams(num_tokens=self.evictable_size_))
            finally:
                self._flushing = False
        elif getattr(self, "index_listener", None) is not None:
            self.index_listener.on_clear()
        super().reset()
        # the adaptive order's persistent victim queue (fixed orders rebuild a heap per evict)
        adaptive = self.policy.eviction_order == "adaptive"
        self._queue = _VictimQueue(self.evictable_leaves) if adaptive else None
        self.root_node.tiered_hashes = []
        self.root_node.tiered_end = 0
        self._counted.clear()
        self._invalid_nodes = 0
        for c in self.tenants.by_name.values():
            c.resident_pages = 0

    # ------------------------------------------------------------------ identity
    def _seed(self, extra_key, cache_salt) -> bytes:
        """Chain seed of a tree namespace (structured: see ``CacheKey.namespace_seed``). Memoised
        in a bounded table (a seed is one hash away, so forgetting one costs nothing)."""
        k = (extra_key, cache_salt or None)
        s = self._seeds.get(k)
        if s is None:
            if len(self._seeds) >= SEED_TABLE_MAX:
                self._seeds.clear()
            s = self._seeds[k] = self.cache_key.namespace_seed(cache_salt, extra_key)
        return s

    def _ensure_hashes(self, node) -> None:
        """Give ``node`` and its ancestors their page hashes (top-down, only where missing)."""
        chain = []
        while node.tiered_hashes is None:
            chain.append(node)
            node = node.parent
        for n in reversed(chain):
            p = n.parent
            prev = p.tiered_hashes[-1] if p.tiered_hashes else self._seed(n.key.extra_key, n.key.cache_salt)
            n.tiered_hashes = chain_page_hashes(prev, n.key.raw_token_ids(), self.page_size)
            n.tiered_end = p.tiered_end + len(n.key)

    def _attach_hashes(self, node, hashes: list) -> None:
        """Give freshly inserted nodes on the path to ``node`` their slice of the request's page
        hashes (already computed in checkpoint), instead of hashing the pages again."""
        chain = []
        while node.tiered_hashes is None:
            chain.append(node)
            node = node.parent
        ps = self.page_size
        end = node.tiered_end
        for n in reversed(chain):
            start, end = end, end + len(n.key)
            if end // ps <= len(hashes):
                n.tiered_hashes = hashes[start // ps : end // ps]
                n.tiered_end = end
            else:  # not covered by this request's hashes (cannot happen; be safe)
                self._ensure_hashes(n)

    def path_hashes(self, node) -> list:
        self._ensure_hashes(node)
        parts = []
        while node is not self.root_node:
            parts.append(node.tiered_hashes)
            node = node.parent
        out = []
        for p in reversed(parts):
            out.extend(p)
        return out

    def _split_node(self, key, child, split_len: int):
        new_node = super()._split_node(key, child, split_len)
        new_node.tiered_tick = child.tiered_tick
        if self.policy.following != "adaptive":
            # SGLang stamps the node it splits (both halves) as used now; so does exact lru
            child.tiered_tick = new_node.tiered_tick = self._cur
        if child.tiered_invalid:
            new_node.tiered_invalid = True
            self._invalid_nodes += 1
        hashes = child.tiered_hashes
        if hashes is not None:
            k = split_len // self.page_size
            new_node.tiered_hashes, child.tiered_hashes = hashes[:k], hashes[k:]
            new_node.tiered_end = child.tiered_end - len(child.key)
        else:
            new_node.tiered_hashes = None
        return new_node

    # ------------------------------------------------------------------ admission
    def checkpoint(self, req, *, up_to: int):
        if self.disable:
            return
        ps = self.page_size
        cpl = req.kv.cache_protected_len
        aligned = (up_to // ps) * ps
        anchor = req.last_node if req.last_node is not None else self.root_node
        no_store = self._no_store(req)
        counted = self._counted.get(req.rid)
        first = counted is None
        if first:
            if len(self._counted) >= COUNTED_MAX:  # never released (aborted): forget the oldest
                del self._counted[next(iter(self._counted))]
            self._counted[req.rid] = 0
            self.policy.begin_request()
        if no_store or anchor.tiered_invalid or self._next_is_invalid(anchor, req, cpl):
            # Refuse: leave row, lock, last_node and cache_protected_len alone; release_kv_cache
            # frees [cache_protected_len, owned). No-store requests leave no trace (not even in
            # the sketch); paths through invalidated entries are never extended.
            if first and no_store:
                self.policy.stats.no_store_requests += 1
                self.tenants.get(tenant_of(req.cache_salt)).no_store_requests += 1
            return
        base = self.path_hashes(anchor)
        assert len(base) * ps == cpl or anchor is self.root_node, (len(base), cpl)
        tokens = req.full_untruncated_fill_ids
        prev = base[-1] if base else self._seed(req.extra_key, req.cache_salt)
        new = chain_page_hashes(prev, tokens[len(base) * ps : aligned], ps) if aligned > cpl else []
        hashes = base + new

        counted = counted or 0
        if first and new:
            self.policy.on_miss(new[0])  # ghost hit? (adapts the eviction order)
        if len(hashes) > counted:
            self.policy.observe(hashes[counted:], max(0, len(base) - counted))
            self._counted[req.rid] = len(hashes)

        victim_freq = self._victim_frequency() if (new and self.policy.filtering) else None
        n_admit = self.policy.admit_pages(new, victim_freq)
        tc = self.tenants.get(tenant_of(req.cache_salt))
        tc.rejected_pages += len(new) - n_admit
        admit_len = cpl + n_admit * ps
        if n_admit < len(new) and self.host is not None:
            self._demote_refused(req, admit_len, new[n_admit:])
        if admit_len <= cpl:
            if first:
                self._bump_hits(anchor)  # still count the prefix reuse
                self._cur = self._now()
                self._stamp(anchor)  # as SGLang's insert of the matched path would
            return
        if admit_len >= aligned:
            admit_len = up_to  # admit everything: let SGLang page-align as usual
        before = self.evictable_size_ + self.protected_size_
        self._cur = self._now()
        super().checkpoint(req, up_to=admit_len)
        stored = (self.evictable_size_ + self.protected_size_ - before) // ps
        tc.admitted_pages += stored
        tc.resident_pages += stored
        self._attach_hashes(req.last_node, hashes)
        self._notify("on_store", new[:n_admit])
        self._stamp(req.last_node)
        if self.store is not None:
            self._write_through(anchor, req.last_node)
        if cpl == 0 and self.policy.adaptive_extras:
            # A cold prompt (nothing of it cached): its new nodes enter aged, so a one-shot prompt
            # cannot push out reused context; one that comes back is stamped fresh on use.
            n, old = req.last_node, self.policy.tick - self.policy.cold_age()
            while n is not self.root_node and n.hit_count < 2:
                n.tiered_tick = old
                n.tiered_cold = True
                n = n.parent
        if self.debug_checks:
            self.check_invariants()

    def _demote_refused(self, req, start: int, hashes: list) -> None:
        """Pages the device refused go to T1 instead (the host tier is the victim buffer in which
        frequency evidence accumulates): a later request promotes them like any demoted page.
        Their KV is complete (``checkpoint`` runs after the forward pass that wrote it)."""
        ps = self.page_size
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, start : start + len(hashes) * ps]
        self.host.demote(row[::ps] // ps, hashes, name_hash(tenant_of(req.cache_salt)))
        if self.index_listener is not None:
            self._notify("on_store", [h for h in hashes if self.host.pool.contains(h)])

    @staticmethod
    def _no_store(req) -> bool:
        if getattr(req, "no_store", False):
            return True
        sp = getattr(req, "sampling_params", None)
        cp = getattr(sp, "custom_params", None)
        return bool(cp) and isinstance(cp, dict) and cp.get("lmcache.skip_save") is True

    def _next_is_invalid(self, anchor, req, cpl: int) -> bool:
        if not self._invalid_nodes:
            return False
        tokens = req.full_untruncated_fill_ids
        if len(tokens) < cpl + self.page_size:
            return False
        from sglang.srt.mem_cache.radix_cache import RadixKey

        key = RadixKey(tokens[cpl : cpl + self.page_size], req.extra_key, cache_salt=req.cache_salt)
        child = anchor.children.get(key.child_key(self.page_size))
        return child is not None and child.tiered_invalid

    def _now(self) -> float:
        """A fresh logical time of use: the request tick plus a sequence number within it, so
        uses are ordered exactly as SGLang's ``time.monotonic()`` stamps order them."""
        t = self.policy.tick
        if t != self._seq_tick:
            self._seq_tick, self._seq = t, 0
        self._seq += 1
        return t + min(self._seq, 999_999) * 1e-6

    def _stamp(self, node) -> None:
        """Record the current logical time of use (``self._cur``) on ``node`` and its ancestors
        (stops at the first one already stamped with it: its ancestors are too)."""
        tick, root = self._cur, self.root_node
        while node is not root and node.tiered_tick != tick:
            node.tiered_tick = tick
            node = node.parent

    def _bump_hits(self, node) -> None:
        while node is not self.root_node:
            node.hit_count += 1
            node = node.parent

    def on_release(self, req, *, checkpointed: bool) -> None:
        self._counted.pop(req.rid, None)
        self._pending_host.pop(req.rid, None)
        tc = self.tenants.get(tenant_of(req.cache_salt))
        tc.requests += 1
        tc.prompt_tokens += len(req.origin_input_ids)
        cached = int(getattr(req, "cached_tokens", 0) or 0)
        tc.cached_tokens += cached
        tc.requests_hit += cached > 0
        super().on_release(req, checkpointed=checkpointed)

    # ------------------------------------------------------------------ invalidation
    def match_prefix(self, params):
        self._cur = self._now()
        result = super().match_prefix(params)
        self._stamp(result.last_device_node)
        if self._invalid_nodes and result.device_prefix_len:
            # Never hand out an invalidated entry: cut the match before the shallowest one.
            node, cut = result.last_device_node, None
            while node is not self.root_node:
                if node.tiered_invalid:
                    cut = node
                node = node.parent
            if cut is not None:
                last = cut.parent
                self._ensure_hashes(last)
                result = result._replace(
                    device_prefix_len=last.tiered_end,
                    last_device_node=last, last_host_node=last, best_match_node=last,
                )  # fmt: skip
        if self.host is not None and params.req is not None:
            result = self._probe_host(params, result)
        return result

    def _probe_host(self, params, result):
        """Count the pages right after the device match that T1 holds (by chained page hash)."""
        key = params.key
        if getattr(key, "is_bigram", False):
            return result
        node = result.last_device_node
        if node.tiered_invalid:
            return result
        ps = self.page_size
        toks = key.raw_token_ids()
        start = result.device_prefix_len
        n_pages = (len(toks) - start) // ps
        if n_pages <= 0:
            return result
        contains = self.host.pool.contains
        rid = params.req.rid
        pending = self._pending_host.get(rid)
        if pending is not None and pending[0] is node and all(contains(h) for h in pending[1]):
            # match_prefix runs on every admission attempt: reuse this request's hashes from the
            # last attempt instead of hashing the same pages again.
            hashes = pending[1]
            return result._replace(host_hit_length=len(hashes) * ps, best_match_node=node)
        self._ensure_hashes(node)
        prev = node.tiered_hashes[-1] if node.tiered_hashes else self._seed(key.extra_key, key.cache_salt)
        hashes = []
        for i in range(n_pages):  # hash only as far as T1 has pages
            h = chain_page_hashes(prev, toks[start + i * ps : start + (i + 1) * ps], ps)[0]
            if not contains(h):
                break
            hashes.append(h)
            prev = h
        if len(hashes) < n_pages and self.host.t2 is not None:
            self.host.touch(hashes)  # the fetch below must not make room in T1 with these
            hashes += self._fetch_t2(prev, toks, start + len(hashes) * ps, n_pages - len(hashes), key.cache_salt)
        if not hashes:
            self._pending_host.pop(rid, None)
            return result
        pending = self._pending_host
        pending.pop(rid, None)
        if len(pending) >= PENDING_HOST_MAX:  # requests aborted before release: forget the oldest
            del pending[next(iter(pending))]
        pending[rid] = (node, hashes, toks[start : start + len(hashes) * ps])
        return result._replace(host_hit_length=len(hashes) * ps, best_match_node=node)

    def _fetch_t2(self, prev: bytes, toks, pos: int, n_pages: int, salt) -> list:
        """T2 (fleet store) holds pages past T1? Fetch the leading run into T1 (then promoted like
        any T1 hit). Returns the page hashes now in T1."""
        ps = self.page_size
        n_pages = min(n_pages, self.host.t2.run)
        rest = chain_page_hashes(prev, toks[pos : pos + n_pages * ps], ps)
        got = self.host.fetch_t2(rest, name_hash(tenant_of(salt)))
        return rest[:got]

    def init_load_back(self, params):
        """Promote the T1 pages probed for this request into new device pages, all or nothing.
        Returns (loaded_tokens, new_last_node); (0, node) is a clean miss (recompute)."""
        node = params.best_match_node
        req = params.req
        pending = self._pending_host.pop(getattr(req, "rid", None), None)
        if self.host is None or pending is None or pending[0] is not node:
            return 0, node
        _, hashes, toks = pending
        n = len(hashes) * self.page_size
        if n != params.host_hit_length:
            hashes = hashes[: params.host_hit_length // self.page_size]
            toks = toks[: len(hashes) * self.page_size]
            n = len(toks)
        if n == 0:
            return 0, node
        key = RadixKey(toks, req.extra_key, cache_salt=req.cache_salt)
        if key.child_key(self.page_size) in node.children:
            return 0, node  # the device got these pages meanwhile: nothing to promote
        lock = self.lock(node)  # allocation below may evict; keep the matched path
        alloc = self.token_to_kv_pool_allocator
        try:
            if alloc.available_size() < n:
                self.evict(EvictParams(num_tokens=n - alloc.available_size()))
            slots = alloc.alloc(n) if alloc.available_size() >= n else None
            if slots is None:  # (the lock is released in ``finally``, once)
                return None  # cannot allocate now: the scheduler retries later
            if not self.host.load(hashes, slots[:: self.page_size] // self.page_size):
                alloc.free(slots)
                return 0, node  # failed transfer: a clean miss, never partial KV
            new = TreeNode(priority=node.priority)
            new.parent = node
            new.key = key
            new.value = slots.to(dtype=torch.int64).clone()
            new.hit_count = 1
            new.tiered_hashes = list(hashes)
            new.tiered_end = node.tiered_end + n
            new.tiered_tick = self.policy.tick
            node.children[key.child_key(self.page_size)] = new
            self.evictable_size_ += n
            self._update_leaf_status(node)
            self._update_leaf_status(new)
            self.kv_events.record_store(new)
            self._notify("on_store", hashes)
            tc = self.tenants.get(tenant_of(req.cache_salt))
            tc.resident_pages += len(hashes)
            tc.promoted_pages += len(hashes)
            # Hold the new node until the batch that uses it has run (the scheduler locks
            # req.last_node when it commits the admission); released in flush_pending_backups.
            self._load_locks.append(self.lock(new))
        finally:
            self.unlock(lock)
        if self.debug_checks:
            self.check_invariants()
        return n, new

    def invalidate(self, *, tenant_hash: Optional[int] = None, version_hash: Optional[int] = None,
                   everything: bool = False) -> dict:  # fmt: skip
        """Drop matching entries now; entries a running request holds are cut off from matching
        at once and freed when released. Returns what was dropped (tokens)."""
        if version_hash is not None and any(name_hash(v) == version_hash for v in self.versions.values() if v):
            everything = True
        targets = []
        for child in list(self.root_node.children.values()):
            if everything or (tenant_hash is not None and name_hash(tenant_of(child.key.cache_salt)) == tenant_hash):
                targets.append(child)
        dropped = deferred = 0
        if self.host is not None:
            if self.store is not None:  # pending writes of what is invalidated never land
                self.store.cancel_where(lambda j: everything or j.tenant == tenant_hash)
            if everything:
                dropped += self.host.clear() * self.page_size
            elif tenant_hash is not None:
                dropped += self.host.drop_tenant(tenant_hash) * self.page_size
            if self.host.t2 is not None:  # this model's (or tenant's) objects, fleet-wide
                self.host.t2.invalidate(tenant=tenant_hash, everything=everything)
        for top in targets:
            stack, order = [top], []
            while stack:
                n = stack.pop()
                order.append(n)
                stack.extend(n.children.values())
            for n in order:
                if not n.tiered_invalid:
                    n.tiered_invalid = True
                    self._invalid_nodes += 1
            for n in reversed(order):  # children before parents
                if n.lock_ref == 0 and not n.children:
                    dropped += self._drop_node(n)
                else:
                    deferred += len(n.key)
        return {"dropped_tokens": dropped, "deferred_tokens": deferred, "subtrees": len(targets)}

    def apply_invalidation_key(self, key: str, value: int) -> None:
        """One key of an HTTP invalidation (see integration/hooks.py); the nonce comes first."""
        if key.endswith("_nonce"):
            self.last_invalidation = {"nonce": value, "dropped_tokens": 0, "deferred_tokens": 0}
            return
        if key.endswith("_tenant"):
            res = self.invalidate(tenant_hash=value)
        elif key.endswith("_version"):
            res = self.invalidate(version_hash=value)
        else:
            res = self.invalidate(everything=bool(value))
        inv = self.last_invalidation
        inv["dropped_tokens"] += res["dropped_tokens"]
        inv["deferred_tokens"] += res["deferred_tokens"]
        logger.info("sglang-tiered: invalidation %s: %s", key, res)

    def _drop_node(self, node) -> int:
        n = len(node.key)
        self._fence(node, run=False)  # an invalidated page is never written to T1
        self.token_to_kv_pool_allocator.free_segment(node.value, start_pos=0)
        tc = self.tenants.get(tenant_of(node.key.cache_salt))
        tc.invalidated_pages += n // self.page_size
        tc.resident_pages -= n // self.page_size
        self._delete_leaf(node)
        self.kv_events.record_remove(node)
        self._notify("on_remove", node.tiered_hashes)
        self._invalid_nodes -= 1
        return n

    def dec_lock_ref(self, node, params=None):
        result = super().dec_lock_ref(node, params)
        if self._invalid_nodes:
            # Free invalidated entries the moment their last holder lets go.
            while node is not self.root_node and node is not None:
                parent = node.parent
                if node.tiered_invalid and node.lock_ref == 0 and not node.children:
                    self._drop_node(node)
                node = parent
        return result

    # ------------------------------------------------------------------ eviction
    def _is_pinned(self, node, pinned_pages: int) -> bool:
        """Small, hot prefixes (near the root, high sketch frequency) are evicted last."""
        cfg = self.policy.cfg
        if (node.hit_count < cfg.pin_min_freq or node.tiered_end > cfg.pin_max_tokens
                or pinned_pages >= self._pin_budget):  # fmt: skip
            return False
        self._ensure_hashes(node)
        hashes = node.tiered_hashes
        return bool(hashes) and self.policy.node_frequency(hashes) >= self.policy.cfg.pin_min_freq

    def _order_key(self):
        order = self.policy.followed_order
        if order == "slru":
            return lambda n: n.hit_count >= 2
        if order == "lfu":
            return lambda n: n.hit_count
        return lambda n: 0

    @staticmethod
    def _kind(node) -> int:
        if node.hit_count >= 2:
            return PROTECTED
        return COLD if node.tiered_cold else UNPROTECTED

    def _update_leaf_status(self, node):
        super()._update_leaf_status(node)
        q = self._queue
        if q is not None and node in self.evictable_leaves:
            q.offer(node)

    def _victims(self):
        """The eviction order: the persistent queue (adaptive) or a heap built now (fixed)."""
        if self._queue is not None and self.policy.followed_order in ("adaptive", "lru"):
            return self._queue  # (lru: the same queue with no boost; exactly SGLang's lru order)
        order = self._order_key()
        priority = lambda n: (order(n), n.last_access_time)  # noqa: E731
        return _RebuiltQueue([(priority(n), n.id, n) for n in self.evictable_leaves], priority)

    def _victim_frequency(self) -> Optional[int]:
        best, _ = self._victims().peek(self.policy.protection_boost())
        if best is None:
            return None
        self._ensure_hashes(best)
        return self.policy.node_frequency(best.tiered_hashes) if best.tiered_hashes else 0

    def evict(self, params: EvictParams) -> EvictResult:
        """Least recently used leaf first, leaves reused by >= 2 requests aged by the policy's
        learned protection boost (forced modes: lru; slru: reused leaves after all others; lfu:
        fewest requests first), pinned hot prefixes last; same mechanics as RadixCache.evict
        (free the leaf's slots, delete it, offer its parent). Evicted leaves feed the policy's
        ghost list."""
        if self.disable:
            return EvictResult()
        start_time = time.perf_counter()
        num_tokens = params.num_tokens
        ps = self.page_size
        # pinning is part of the adaptive policy; a followed fixed order (safety duel) has none
        pin_hits = self.policy.cfg.pin_min_freq if self.policy.pinning else 1 << 62
        queue = self._victims()
        boost = self.policy.protection_boost()
        # Pinned prefixes are set aside as the queue reaches them (oldest first, within budget)
        # and evicted only once nothing else is left.
        pinned = []
        pinned_pages = 0

        num_evicted = 0
        policy = self.policy
        free_segment = self.token_to_kv_pool_allocator.free_segment
        root = self.root_node
        while num_evicted < num_tokens:
            x = queue.pop(boost)
            if x is not None:
                if x.hit_count >= pin_hits and self._is_pinned(x, pinned_pages):
                    pinned_pages += len(x.key) // ps
                    heapq.heappush(pinned, (x.last_access_time, x.id, x))
                    continue
                was_pinned = False
            elif pinned:
                _, _, x = heapq.heappop(pinned)
                was_pinned = True
            else:
                break
            if self.host is not None and not x.tiered_invalid and x.tiered_hashes:
                self._demote_victim(x)
                if self.index_listener is not None:  # a demoted page stays held, in T1
                    self._notify("on_remove", [h for h in x.tiered_hashes if not self.host.pool.contains(h)])
            else:  # gone from this server
                self._fence(x, run=False)
                self._notify("on_remove", x.tiered_hashes)
            free_segment(x.value, start_pos=0)
            num_evicted += len(x.value)
            policy.on_evict(len(x.key) // ps, pinned=was_pinned,
                            first_hash=x.tiered_hashes[0] if x.tiered_hashes else None,
                            kind=self._kind(x), last_tick=x.tiered_tick)  # fmt: skip
            tc = self.tenants.get(tenant_of(x.key.cache_salt))
            tc.evicted_pages += len(x.key) // ps
            tc.resident_pages -= len(x.key) // ps
            parent = x.parent
            self._delete_leaf(x)
            if parent is not root and len(parent.children) == 0 and parent.lock_ref == 0:
                queue.offer(parent)
            self.kv_events.record_remove(x)
        for _, _, x in pinned:  # spared: back in the queue for next time
            queue.offer(x)

        self.update_eviction_metrics(num_evicted, start_time)
        if self.debug_checks:
            self.check_invariants()
        return EvictResult(num_tokens_evicted=num_evicted)

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Tree accounting: evictable/protected sizes match the nodes; locks are consistent."""
        evictable = protected = 0
        stack = list(self.root_node.children.values())
        while stack:
            n = stack.pop()
            assert n.lock_ref >= 0, "negative lock_ref"
            if n.lock_ref > 0:
                assert n.parent is self.root_node or n.parent.lock_ref >= n.lock_ref, "lock not on path"
                protected += len(n.key)
            else:
                evictable += len(n.key)
            assert n.value is not None and len(n.value) == len(n.key), "value/key length mismatch"
            stack.extend(n.children.values())
        assert evictable == self.evictable_size_, (evictable, self.evictable_size_)
        if self.host is not None:
            with self.host.lock:  # the store queue's worker may be mid-write (slots reserved)
                self.host.pool.check_invariants()  # host: free + resident == capacity
            if self.host.t2 is not None:
                self.host.t2.check_invariants()
        if self.store is not None:
            self.store.check_invariants()
        # Identity: every node's stored page hashes equal a fresh chain over its tokens.
        stack = list(self.root_node.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.tiered_hashes is None:
                continue
            p = n.parent
            prev = p.tiered_hashes[-1] if p.tiered_hashes else self._seed(n.key.extra_key, n.key.cache_salt)
            assert n.tiered_hashes == chain_page_hashes(prev, n.key.raw_token_ids(), self.page_size), "stale page hashes"
            assert n.tiered_end == p.tiered_end + len(n.key), "stale depth"
        assert protected == self.protected_size_, (protected, self.protected_size_)
        self.policy.check_invariants()  # shadows of the safety duel, learned quantities bounded
        if self._queue is not None:
            # Every evictable leaf has a live entry in the victim queue (possibly stale, then
            # re-queued when it reaches the top), so nothing evictable is ever lost to eviction.
            live = {(e[1], e[0], i) for i in (0, 1) for e in self._queue.heaps[i]}
            for n in self.evictable_leaves:
                assert n.tiered_entry is not None, "evictable leaf without a queue entry"
                assert (n.id, n.tiered_entry[0], int(n.tiered_entry[1])) in live, "queue entry lost"

    def _host_snapshot(self) -> dict:
        snap = self.host.snapshot()
        q = self.store
        snap["store"] = "async" if q is not None else "sync"
        if q is not None:
            st = q.stats
            snap.update(queue_capacity_pages=q.capacity_pages, queue_depth_pages=st.queued_pages,
                        stored_pages=st.stored_pages, inline_pages=st.inline_pages,
                        value_dropped_pages=st.value_dropped_pages, filtered_pages=st.filtered_pages,
                        cancelled_pages=st.cancelled_pages)  # fmt: skip
        return snap

    def flush_pending_backups(self) -> None:
        """Called by the scheduler after every batch: publish metrics (no host backups yet)."""
        super().flush_pending_backups()
        if self.store is not None and self.store._thread is None:
            self.store.drain()  # no worker thread (simulation): the writes land between batches
        while self._load_locks:
            self.unlock(self._load_locks.pop())
        if self.metrics is not None:
            self.metrics.publish(self)

    def stats_snapshot(self) -> dict:
        """msgpack-safe per-rank stats (see sglang_tiered/stats.py for the aggregated schema)."""
        ps = self.page_size
        pol = self.policy.snapshot()
        return {
            "page_size": ps,
            "last_invalidation": dict(self.last_invalidation),
            "versions": dict(self.versions),
            "tenants": {name: c.as_dict() for name, c in self.tenants.by_name.items()},
            "tiers": [
                {
                    "name": "device",
                    "enabled": True,
                    "capacity_pages": self.capacity_tokens // ps,
                    "resident_pages": (self.evictable_size_ + self.protected_size_) // ps,
                    "evictable_tokens": self.evictable_size_,
                    "protected_tokens": self.protected_size_,
                    "decision": "device radix tree",
                },
                self._host_snapshot() if self.host is not None else
                {"name": "host", "enabled": False, "decision": self.host_decision},
                self.host.t2.snapshot() if self.host is not None and self.host.t2 is not None else
                {"name": "t2", "enabled": False, "decision": self.t2_decision},
            ],
            "index": self.index_listener.snapshot() if hasattr(self.index_listener, "snapshot") else None,
            "policy": {k: pol[k] for k in (
                "mode", "admission_filtering", "thrashing", "thrash_windows", "admissions_refused",
                "pages_admitted", "pages_rejected", "evicted_pages", "evicted_pinned", "sketch_resets",
                "protection_k", "cold_age_c", "lru_cycle_requests", "following", "fallbacks",
                "cycle_clamped", "shadow_rate", "shadow_lru_hit_rate", "real_sampled_hit_rate",
                "lru_model_bias")},
        }  # fmt: skip
