"""T1, the host DRAM tier behind the device tree: probe, promote (load back), demote, store queue.

The tier interface the adapter calls (a T2 tier behind T1 implements the same verbs; see
ARCHITECTURE.md "Adding a tier"):

| verb | called from | does |
|---|---|---|
| ``probe(params, result)`` | ``match_prefix`` | counts the pages after the device match it holds; remembers a ``PendingLoad`` |
| ``load_back(params)`` | ``init_load_back`` | promotes the pending pages into new device pages, all or nothing |
| ``on_admitted(anchor, last)`` | ``checkpoint`` | offers a request's new pages to the store queue (write-through into free T1 room) |
| ``on_refused(req, start, hashes)`` | ``checkpoint`` | pages the device refused go to T1 instead |
| ``on_evict(node)`` | ``evict`` | a device victim's pages go to (or stay in) T1 |
| ``fence(node, run)`` | before device pages are freed | no store of them may be pending or running |
| ``invalidate(tenant_hash, everything)`` | invalidation | drops T1 entries, cancels pending writes |
| ``drop_all()`` | a weight update (and a flush while paused) | drops every T1 entry, cancels pending writes (T2 untouched) |
| ``after_batch()`` / ``forget(rid)`` | scheduler | offers the next victims (write-ahead), drains the queue / forgets a finished request |

State table of a page (by chained hash): device only -> (evict/refuse, T1 on) -> T1 only ->
(probe + load_back) -> device + T1 (T1 copy kept as a victim-cache entry; its recency refreshed on
the next demotion). A failed load is a clean miss: the device pages are freed, nothing partial.

``paused`` (set by ``TieredRadixCache.on_weights_updated`` while the device tree still holds KV of
the old weights, i.e. SGLang did not flush it): no probe, no store, no demotion, so neither T1 nor
T2 is read or written under the old identity; cleared when the tree is empty again (re-seeded).
"""

from __future__ import annotations

import math
from array import array
from typing import NamedTuple, Optional, Protocol

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from sglang_tiered.core.eviction import is_reused
from sglang_tiered.core.keys import chain_page_hashes
from sglang_tiered.core.tenants import tenant_tag
from sglang_tiered.integration.node_state import node_tag
from sglang_tiered.tier.host_tier import AHEAD, THROUGH

PENDING_HOST_MAX = 4096  # T1 probes of requests still waiting for admission (aborted ones age out)
# Write-ahead (store queue): at each batch end, the pages the eviction order takes next, about
# this many batches' worth at the recent eviction rate, are queued for T1 (see ``write_ahead``).
AHEAD_BATCHES = 3
EVICT_RATE_DECAY = 0.8  # the rate is a decaying maximum of the pages evicted per batch


class PendingLoad(NamedTuple):
    """Pages ``probe`` found in T1 for one request, right after its device match ``node``."""

    node: TreeNode  # the device match's last node; the pages continue from its end
    hashes: list  # chained page hashes of the run, in order
    tokens: list  # the run's tokens (``len(hashes) x page_size``)
    namespace: tuple = (None, None)  # the request's (extra_key, cache_salt)


class Tier(Protocol):
    """The verbs the adapter (and a tier in front) calls on a tier below the device. ``T1Tier``
    implements them; a T2 tier behind T1 implements them too and is held by T1 (ARCHITECTURE.md)."""

    def probe(self, params, result): ...
    def load_back(self, params) -> Optional[tuple]: ...
    def on_admitted(self, anchor, last) -> None: ...
    def on_refused(self, req, start: int, hashes: list) -> None: ...
    def on_evict(self, node) -> None: ...
    def fence(self, node, run: bool) -> None: ...
    def invalidate(self, tenant_hash, everything: bool, generation=None) -> int: ...
    def after_batch(self) -> None: ...
    def forget(self, rid) -> None: ...
    def snapshot(self) -> dict: ...
    def check_invariants(self) -> None: ...


def make_store_queue(host, capacity_pages: int, threaded: bool = True):
    """The T1 store queue (``core/store_queue.py``) writing through ``host``. On CUDA the worker
    copies on a side stream after the event recorded at enqueue."""
    from sglang_tiered.core.store_queue import StoreQueue

    side = None
    if host.k_buffers[0].is_cuda:
        side = torch.cuda.Stream(device=host.k_buffers[0].device)

    def write(job) -> None:
        pages = torch.tensor(job.pages, dtype=torch.int64)
        ready, kind = job.ctx  # (CUDA events or None, THROUGH or AHEAD: see HostTier.demote)
        if side is None:
            host.demote(pages, job.hashes, job.tenant, kind=kind)
            return
        with torch.cuda.stream(side):
            host.demote(pages, job.hashes, job.tenant, ready=ready, kind=kind)

    return StoreQueue(capacity_pages, write, threaded=threaded)


class T1Tier:
    """The host tier as seen by one ``TieredRadixCache`` (``cache`` gives the tree)."""

    def __init__(self, cache, host, store=None):
        if not cache.hashes.identity:  # (policy keys are not an identity: page_hashes.py)
            raise RuntimeError("sglang-tiered: T1 needs a tree keyed by identity hashes (TieredRadixCache.attach_host)")
        self.cache = cache
        self.host = host  # tier/host_tier.py HostTier
        self.store = store  # StoreQueue, or None: synchronous demotion at eviction
        self.pending: dict[str, PendingLoad] = {}
        self.load_locks: list = []  # promoted nodes held until the batch that uses them ran
        self.flushing = False  # persist_to_host: everything goes to T1, whatever the queue judged
        self.paused: Optional[str] = None  # why T1 (and T2) are neither read nor written now
        self.already_on_device_tokens = 0  # probed in T1, found on the device at load-back
        self.evicted_since_batch = 0  # device pages evicted since the last batch end
        self.evict_rate = 0.0  # decaying maximum of pages evicted per batch
        self.ahead_offered_pages = 0  # victims-to-be offered to the queue by ``write_ahead``
        self.through_offered_pages = 0  # admitted pages offered while T1 had free room

    # ------------------------------------------------------------------ helpers
    def _page_ids(self, node) -> list:
        """Device page ids of a node's slots (one per page)."""
        ps = self.cache.page_size
        return (node.value[::ps] // ps).tolist()

    def fence(self, node, run: bool) -> None:
        """Before a node's device pages are freed: no store of them may be pending or running."""
        if self.store is not None and self.store.pending:
            self.store.fence(self._page_ids(node), run=run)

    def fence_tree(self) -> None:
        """Fence (``run=True``) every node of the device tree: before the whole pool is freed
        (a flush), no write of its pages may stay queued."""
        if self.store is None or not self.store.pending:
            return
        stack = list(self.cache.root_node.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            self.fence(n, run=not n.tiered_invalid)

    def holds(self, page_hash) -> bool:
        return self.host.pool.contains(page_hash)

    # ------------------------------------------------------------------ stores
    def _ready_event(self):
        """On CUDA, the events after the forward passes that wrote the pages being offered: one
        recorded on the model runner's forward stream, where the overlap loop runs them (on the
        current stream, SGLang's overlap loop only waits for a forward's shared reads, not its KV
        writes, when the prefill read-done fast path is on: review, session 19), and one on the
        current stream, where the normal loop runs them (``event_loop_normal`` forwards on the
        schedule stream: review, session 22). The store waits for both (``HostTier.demote``).
        Checked on an H200 with a stand-in forward stream (``bench/gpu_correctness.py``)."""
        if not self.host.k_buffers[0].is_cuda:
            return None
        current = torch.cuda.current_stream()
        fwd = getattr(self.host, "forward_stream", None)
        events = []
        for stream in (current,) if fwd is None or fwd == current else (fwd, current):
            ev = torch.cuda.Event()
            ev.record(stream)
            events.append(ev)
        return tuple(events)

    def _offer(self, node, ready, kind: str, pages=None, hashes=None) -> int:
        """Offer a node's pages (or the given subset) to the store queue, valued ``frequency x
        pages`` (R3); ``kind``: THROUGH or AHEAD (``HostTier.demote``). Returns the pages offered."""
        hashes = node.tiered_hashes if hashes is None else hashes
        freq = self.cache.policy.node_frequency(node.tiered_hashes)
        pages = self._page_ids(node) if pages is None else pages
        self.store.offer(pages, hashes, freq * len(hashes), frequency=freq,
                         tenant=node_tag(node), ctx=(ready, kind))  # fmt: skip
        return len(pages)

    def on_admitted(self, anchor, last) -> None:
        """Write-through of the runs of pages a request just added to the tree (``anchor``..``last``),
        one job per node, *into free T1 room only*: the copy goes to free slots at T1's least
        recently used end (``HostTier.demote``, THROUGH), so it never pushes out a page only T1
        holds, and it is the first to make room for one later; when the device evicts the page,
        the copy is adopted like a fresh victim. Once T1 is full nothing is written through:
        ``write_ahead`` writes what the device is about to evict, outside T1's capacity."""
        if self.store is None or self.paused:
            return
        cache = self.cache
        room = self.host.pool.free_pages - self.store.stats.queued_pages
        ready = None
        node = last
        while node is not anchor and node is not cache.root_node:
            hashes = node.tiered_hashes
            if hashes and not node.tiered_invalid:
                if len(hashes) > room:
                    return
                if ready is None:
                    ready = self._ready_event()  # the forward pass that wrote these pages
                n = self._offer(node, ready, THROUGH)
                room -= n
                self.through_offered_pages += n
            node = node.parent

    def write_ahead(self) -> int:
        """At a batch end: queue copies of the pages the device will evict next, so that eviction
        finds them written (off the request path) instead of copying them inline, as the
        synchronous store does. The walk follows the eviction order itself (``Eviction.ordered``)
        and covers ``AHEAD_BATCHES`` x the recent eviction rate (a decaying maximum of pages
        evicted per batch), at most the queue's bound and the staging area; pages T1 holds, has
        staged, or the queue has pending are skipped. The copies go to staging slots outside
        T1's capacity (``HostPool.reserve_staging``) and become T1 pages only when the device
        evicts them (``HostPool.reserve`` adopts them): so T1 holds exactly the pages, in the same
        order, that the synchronous store gives it; a wrong guess costs a staging slot, never a
        T1 page. Returns the pages offered."""
        if self.paused:
            return 0
        self.evict_rate = max(float(self.evicted_since_batch), EVICT_RATE_DECAY * self.evict_rate)
        self.evicted_since_batch = 0
        target = min(self.store.capacity_pages, self.host.pool.staging, math.ceil(AHEAD_BATCHES * self.evict_rate))
        if target <= 0:
            return 0
        store, has_copy = self.store, self.host.pool.has_copy
        walked = offered = 0
        ready = None
        for node in self.cache.eviction.ordered():
            if walked >= target:
                break
            hashes = node.tiered_hashes
            if not hashes or node.tiered_invalid:
                continue  # (eviction does not demote these either)
            walked += len(hashes)
            if all(has_copy(h) for h in hashes):
                continue  # the usual case: written at an earlier batch end (no page ids needed)
            need = [(p, h) for p, h in zip(self._page_ids(node), hashes) if not has_copy(h) and not store.is_pending(p)]
            if need:
                if ready is None:
                    ready = self._ready_event()
                offered += self._offer(node, ready, AHEAD, [p for p, _ in need], [h for _, h in need])
        self.ahead_offered_pages += offered
        return offered

    def on_refused(self, req, start: int, hashes: list) -> None:
        """Pages the device refused go to T1 instead (the host tier is the victim buffer in which
        frequency evidence accumulates): a later request promotes them like any demoted page.
        Their KV is complete (``checkpoint`` runs after the forward pass that wrote it)."""
        if self.paused:
            return
        cache = self.cache
        ps = cache.page_size
        row = cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx, start : start + len(hashes) * ps]
        self.host.demote(row[::ps] // ps, hashes, tenant_tag(req.cache_salt))
        if cache.index.listener is not None:
            cache.index.notify("on_store", [h for h in hashes if self.holds(h)])

    def on_evict(self, x) -> None:
        """T1 gets an evicted leaf's pages: with the store queue they are usually written already
        (a pending write is finished inline; then ``HostTier.demote`` adopts the copies); a
        leaf that is not (T1 replaced its write-through copy, staging dropped it, or the queue
        refused it) is copied now, like the synchronous store does, except a one-shot so far
        while the queue is under pressure (what the queue itself refuses, rule 2); without the
        queue, every leaf is copied now. So T1 receives every victim the synchronous store
        would, unless the queue is under pressure. While ``paused`` nothing is copied."""
        if self.paused:
            self.fence(x, run=False)
            self.cache.index.device_removed(x.tiered_hashes)
            return
        self._demote_victim(x)
        index = self.cache.index
        if index.listener is not None or index.policy is not None:  # a demoted page stays held, in T1
            index.device_removed(x.tiered_hashes, kept=self.holds)

    def _demote_victim(self, x) -> None:
        self.evicted_since_batch += len(x.tiered_hashes)
        if self.store is not None:
            self.fence(x, run=True)
            if (not is_reused(x.hit_count) and not self.flushing and self.store.under_pressure
                    and not all(map(self.host.pool.has_copy, x.tiered_hashes))):  # fmt: skip
                return  # a one-shot so far, while the queue is under pressure: not worth a copy
        ps = self.cache.page_size
        n = self.host.demote(x.value[::ps] // ps, x.tiered_hashes, node_tag(x))
        if self.store is not None:
            self.store.stats.inline_pages += n

    def invalidate(self, tenant_hash, everything: bool, generation=None) -> int:
        """Drop T1 entries of a tenant (or all) and cancel their pending writes; T2 moves to a new
        generation (``generation``, or its clock's) for them. Returns tokens."""
        if self.store is not None:  # pending writes of what is invalidated never land
            self.store.cancel_where(lambda j: everything or j.tenant == tenant_hash)
        # T1 first, then T2: while T1 still held the tenant's pages, a store running for another
        # tenant could evict one of them into T2's queue after T2's cancel (review, session 22).
        # Dropping waits for that store (the host lock); its victims are queued by then.
        dropped = 0
        if everything:
            dropped = self.host.clear() * self.cache.page_size
        elif tenant_hash is not None:
            dropped = self.host.drop_tenant(tenant_hash) * self.cache.page_size
        if self.host.t2 is not None:  # this model's (or tenant's) objects, fleet-wide
            self.host.t2.invalidate(tenant=tenant_hash, everything=everything, generation=generation)
        return dropped

    def drop_all(self) -> int:
        """Drop every T1 entry (resident and staged) and cancel every pending write, waiting for
        one in flight, so no write of a device page lands after its page is freed or reused.
        Probes not yet loaded are forgotten. T2 is not touched (see ``TieredRadixCache.reset``).
        Returns tokens dropped."""
        self.cancel_pending()
        return self.host.clear() * self.cache.page_size

    def cancel_pending(self) -> None:
        """Cancel every pending write of a device page (waiting for one in flight) and forget the
        probes: before the device pages may be freed or unreadable; T1's pages stay."""
        if self.store is not None:
            self.store.cancel_where(lambda j: True)
        self.pending.clear()

    def after_batch(self) -> None:
        if self.store is not None:
            self.write_ahead()
            if self.store._thread is None:
                self.store.drain()  # no worker thread (simulation): the writes land between batches
        while self.load_locks:
            self.cache.unlock(self.load_locks.pop())

    def forget(self, rid) -> None:
        self.pending.pop(rid, None)

    # ------------------------------------------------------------------ probe
    def probe(self, params, result):
        """Count the pages right after the device match that T1 holds (by chained page hash)."""
        key = params.key
        rid = getattr(params.req, "rid", None)
        node = result.last_device_node
        if getattr(key, "is_bigram", False) or self.paused or node.tiered_invalid:
            self.pending.pop(rid, None)  # nothing to load for this match: no earlier probe stays
            return result
        ps = self.cache.page_size
        toks = key.raw_token_ids()
        start = result.device_prefix_len
        n_pages = (len(toks) - start) // ps
        if n_pages <= 0:
            self.pending.pop(rid, None)
            return result
        pending = self.pending.get(rid)
        namespace = (key.extra_key, key.cache_salt)
        # A probe is this request's only if it is for the same node, namespace and tokens: a rid
        # may be reused once its request is gone, and one aborted while waiting is never released
        # (its probe, at the root every tenant shares, would load its tokens' KV for another's).
        if (pending is not None and pending.node is node and pending.namespace == namespace
                and pending.tokens == toks[start : start + len(pending.tokens)]
                and all(self.holds(h) for h in pending.hashes)):  # fmt: skip
            # match_prefix runs on every admission attempt: reuse this request's hashes from the
            # last attempt instead of hashing the same pages again.
            return result._replace(host_hit_length=len(pending.hashes) * ps, best_match_node=node)
        hashes = self._held_run(node, key, toks, start, n_pages)
        self.pending.pop(rid, None)
        if not hashes:
            return result
        if len(self.pending) >= PENDING_HOST_MAX:  # requests aborted before release: forget the oldest
            del self.pending[next(iter(self.pending))]
        self.pending[rid] = PendingLoad(node, hashes, toks[start : start + len(hashes) * ps], namespace)
        return result._replace(host_hit_length=len(hashes) * ps, best_match_node=node)

    def _held_run(self, node, key, toks, start: int, n_pages: int) -> list:
        """Hashes of the pages after ``start`` that T1 holds, hashing only as far as it has them."""
        ps = self.cache.page_size
        self.cache.hashes.ensure(node)
        prev = self.cache.hashes.prev_of(node, key)
        hashes = []
        for i in range(n_pages):
            h = chain_page_hashes(prev, toks[start + i * ps : start + (i + 1) * ps], ps)[0]
            if not self.holds(h):
                break
            hashes.append(h)
            prev = h
        t2 = self.host.t2
        tenant = tenant_tag(key.cache_salt) if t2 is not None else 0
        if t2 is not None and len(hashes) < n_pages and t2.may_hold(h, tenant):
            # T2 (the fleet store, tier/t2.py) may hold the pages that follow (``h``, the first
            # page T1 lacks, onwards): its leading run is fetched into T1 now and then promoted
            # like any T1 hit. The rest of the run is hashed only when T2 is worth asking.
            self.host.touch(hashes)  # making room in T1 for the fetch must not evict these
            # ... and it cannot, if the fetch is no longer than the room the other pages leave
            room = self.host.pool.capacity - len(hashes)
            want = min(n_pages - len(hashes), t2.run, room)
            if want > 0:
                pos = start + (len(hashes) + 1) * ps
                rest = [h] + chain_page_hashes(h, toks[pos : pos + (want - 1) * ps], ps)
                hashes += rest[: self.host.fetch_t2(rest, tenant)]
        return hashes

    # ------------------------------------------------------------------ promote
    def load_back(self, params):
        """Promote the T1 pages probed for this request into new device pages, all or nothing.
        Returns (loaded_tokens, new_last_node); (0, node) is a clean miss (recompute); None when
        the device cannot make room now (the scheduler retries later)."""
        cache = self.cache
        node, req = params.best_match_node, params.req
        pending = self.pending.pop(getattr(req, "rid", None), None)
        if pending is None or pending.node is not node or pending.namespace != (req.extra_key, req.cache_salt):
            return 0, node  # (not this request's probe: a clean miss)
        hashes, toks = pending.hashes, pending.tokens
        if len(hashes) * cache.page_size != params.host_hit_length:
            hashes = hashes[: params.host_hit_length // cache.page_size]
            toks = toks[: len(hashes) * cache.page_size]
        n = len(toks)
        if n == 0:
            return 0, node
        key = RadixKey(toks, req.extra_key, cache_salt=req.cache_salt)
        if key.child_key(cache.page_size) in node.children:
            return self._already_on_device(node, key, n)
        lock = cache.lock(node)  # allocation below may evict; keep the matched path
        try:
            # the device victims the allocation demotes into T1 must not push out the very pages
            # about to be promoted (they were T1's least recently used: review, session 18)
            self.host.touch(hashes)
            slots = self._alloc(n)
            if slots is None:  # (the lock is released in ``finally``, once)
                # the scheduler retries this request later: keep its probe, so the retry's
                # match_prefix reuses these hashes instead of hashing the run again
                self.pending[req.rid] = pending
                return None
            if not self.host.load(hashes, slots[:: cache.page_size] // cache.page_size):
                cache.token_to_kv_pool_allocator.free(slots)
                return 0, node  # failed transfer: a clean miss, never partial KV
            new = cache.graft(node, key, slots, hashes)
            tc = cache.tenant(req.cache_salt)
            tc.resident_pages += len(hashes)
            tc.promoted_pages += len(hashes)
            # Hold the new node until the batch that uses it has run (the scheduler locks
            # req.last_node when it commits the admission); released in after_batch.
            self.load_locks.append(cache.lock(new))
        finally:
            cache.unlock(lock)
        cache.after_op()
        return n, new

    def _already_on_device(self, node, key, n: int):
        """The device got (some of) the probed pages after the probe (another request of the same
        batch promoted or computed them). When it holds the whole run now, this request uses
        those pages: (n, their last node), as a promotion would, with nothing copied. Otherwise a
        clean miss (the scheduler's contract is all or nothing)."""
        cache = self.cache
        have = node.children[key.child_key(cache.page_size)].key.token_ids
        if type(have) is not type(key.token_ids):  # the tree's token container (SGLang asserts it)
            ids = array(have.typecode, key.token_ids) if isinstance(have, array) else list(key.token_ids)
            key = RadixKey(ids, key.extra_key, cache_salt=key.cache_salt)
        value, last = cache._match_prefix_helper(node, key)
        x = last
        while x is not node:  # never hand out an invalidated entry
            if x.tiered_invalid:
                return 0, node
            x = x.parent
        if sum(len(v) for v in value) < n:
            return 0, node
        cache.hashes.ensure(last)
        self.already_on_device_tokens += n
        self.load_locks.append(cache.lock(last))  # held until the batch that uses it has run
        return n, last

    def _alloc(self, n: int):
        alloc = self.cache.token_to_kv_pool_allocator
        if alloc.available_size() < n:
            self.cache.evict(EvictParams(num_tokens=n - alloc.available_size()))
        return alloc.alloc(n) if alloc.available_size() >= n else None

    # ------------------------------------------------------------------ stats, invariants
    def snapshot(self) -> dict:
        snap = self.host.snapshot()
        q = self.store
        snap["store"] = "async" if q is not None else "sync"
        snap["already_on_device_tokens"] = self.already_on_device_tokens
        if q is not None:
            st = q.stats
            snap.update(queue_capacity_pages=q.capacity_pages, queue_depth_pages=st.queued_pages,
                        stored_pages=st.stored_pages, inline_pages=st.inline_pages,
                        value_dropped_pages=st.value_dropped_pages, filtered_pages=st.filtered_pages,
                        cancelled_pages=st.cancelled_pages, ahead_offered_pages=self.ahead_offered_pages,
                        through_offered_pages=self.through_offered_pages)  # fmt: skip
        return snap

    def check_invariants(self) -> None:
        with self.host.lock:  # the store queue's worker may be mid-write (slots reserved)
            self.host.pool.check_invariants()  # host: free + resident == capacity
            if self.host.t2 is not None:
                self.host.t2.check_invariants()
        if self.store is not None:
            self.store.check_invariants()
