"""``TieredRadixCache``: SGLang's ``RadixCache`` with our admission policy, eviction order and T1.

The adapter: it keeps SGLang's overrides only, and each one delegates to a module that holds one
concept (see ARCHITECTURE.md):

| SGLang call | delegates to |
|---|---|
| ``checkpoint`` | ``admission.Admission`` (plan -> SGLang's insert -> adopted) |
| ``_match_prefix_helper``, ``_insert_helper``, checkpoint's insert | ``tree_ops`` (SGLang's walks on key offsets; ``tree_ops.checkpoint``) |
| ``match_prefix`` | ``clock`` (stamp), ``invalidation`` (cut), ``t1.T1Tier.probe`` |
| ``init_load_back`` | ``t1.T1Tier.load_back`` |
| ``evict`` | ``evict.Eviction`` (order: ``core/eviction.py``) |
| ``dec_lock_ref`` | ``invalidation.Invalidation.on_unlock`` |
| ``_split_node`` | ``page_hashes``, ``invalidation`` |
| ``sanity_check`` | ``invariants.check_cache`` |
| ``reset``, ``flush_pending_backups``, ``on_release`` | the modules' ``reset`` / ``after_batch`` / ``forget`` |
| weight updates (integration/hooks.py) | ``on_weights_updated``: T1 dropped, identity re-seeded |

SGLang's ownership contract is kept intact (admission.py): the tree owns
``[0, req.kv.cache_protected_len)`` of a request's row; what ``checkpoint`` does not adopt is
freed by ``release_kv_cache``. Node state is declared once, in node_state.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult, IncLockRefResult
from sglang.srt.mem_cache.radix_cache import RadixCache, TreeNode

from sglang_tiered.config import lifetime_id
from sglang_tiered.core.keys import CacheKey
from sglang_tiered.core.policy import AdaptivePolicy, PolicyConfig
from sglang_tiered.core.tenants import TenantCounters, TenantTable
from sglang_tiered.integration import build, tree_ops
from sglang_tiered.integration.admission import COUNTED_MAX as IN_FLIGHT_MAX, SEEN, Admission, no_store
from sglang_tiered.integration.clock import LogicalClock
from sglang_tiered.integration.evict import Eviction
from sglang_tiered.integration.index_hints import IndexHints, tree_pages, tree_ticks
from sglang_tiered.integration.invalidation import Invalidation
from sglang_tiered.integration.invariants import check_cache
from sglang_tiered.integration.page_hashes import PageHashes
from sglang_tiered.integration.snapshot import stats_snapshot
from sglang_tiered.integration.t1 import T1Tier, Tier

logger = logging.getLogger("sglang_tiered")


class TieredRadixCache(RadixCache):
    """Radix cache backend registered as ``--radix-cache-backend tiered``."""

    def __init__(self, params, *, cache_key: Optional[CacheKey] = None, policy_config: Optional[PolicyConfig] = None,
                 capacity_tokens: Optional[int] = None, tp_rank: int = 0, tp_size: int = 1,
                 debug_checks: bool = False, max_in_flight: Optional[int] = None):  # fmt: skip
        # RadixCache.__init__ calls self.reset(): our state must exist before it.
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.cache_key = cache_key or CacheKey()
        self.base_key = self.cache_key  # the identity at start-up (before any weight update)
        self.weight_version: Optional[str] = None  # SGLang's --weight-version, then each update's
        self.weight_updates = 0  # weight updates seen (on_weights_updated)
        self.weight_session: str | None = None  # why a weight-update session is open (begin..end)
        # Identity epoch: +1 at every weight update and invalidation. A request records it when it
        # matches holding no KV of its own (``match_prefix``); KV it computed under an older epoch
        # is never adopted (``Admission.plan``): a request in flight across a weight update (the
        # in-place pause of RL weight syncs) or an invalidation computed it before (review,
        # session 19: T1 then served old-weights KV, and a deleted tenant's pages).
        self.epoch = 0
        # SGLang released the KV pool (release_memory_occupation, until resume): its pages
        # cannot be read, so a flush drops the device tree instead of demoting it (hooks.py)
        self.kv_released = False
        self.lifetime_tag: Optional[str] = None  # this server's lifetime (build.py); else lifetime_id()
        self._pending_key: Optional[CacheKey] = None  # re-seed waiting for an empty device tree
        self.debug_checks = debug_checks
        if capacity_tokens is None:
            capacity_tokens = getattr(params.token_to_kv_pool_allocator, "size", 0) or 1 << 16
        self.capacity_tokens = capacity_tokens
        # the most requests in flight at once: SGLang sizes its request pool by
        # --max-running-requests (kv_cache_configurator.py); on such a server the strict guarantee
        # is lru's order itself (PolicyConfig.max_in_flight)
        if max_in_flight is None:
            max_in_flight = int(getattr(params.req_to_token_pool, "size", 1) or 1)
        policy_config = replace(policy_config or PolicyConfig(), max_in_flight=max(1, max_in_flight))
        self.policy = AdaptivePolicy(max(1, capacity_tokens // params.page_size), policy_config)
        self.tenants = TenantTable()
        self.hashes = PageHashes(self.cache_key, params.page_size)
        self.clock = LogicalClock(self.policy)
        self.admission = Admission(self)
        # rids matched and not yet released (bounded: IN_FLIGHT_MAX), each with the key SGLang
        # matched it by until the policy is shown its pages (``SEEN``; ``_replay_unseen_match``)
        self.in_flight: dict = {}
        self.eviction = Eviction(self)
        self.invalidation = Invalidation(self)
        self.index = IndexHints()  # fleet hint index (sglang_tiered.fleet.publisher)
        self.index.policy = self.policy
        self.policy.track_real_pages(self.device_pages, self.device_bounds)
        self.t1: Optional[Tier] = None  # the host tier (T1Tier), when on
        self.host_decision = "off"
        self.t2_decision = "off: SGLANG_TIERED_T2 unset"
        self.metrics = None
        if getattr(params, "enable_metrics", False) and tp_rank == 0:
            from sglang_tiered.integration.metrics import TieredMetrics

            self.metrics = TieredMetrics()
        super().__init__(params)

    def device_pages(self) -> set:
        """The page hashes of the device tree now (none before SGLang's ``reset`` built it)."""
        root = getattr(self, "root_node", None)
        return set() if root is None else tree_pages(root)

    def device_bounds(self) -> dict:
        """The last page hash of every node of the device tree -> its lru tick (``tree_ticks``):
        its node boundaries and the order lru evicts them in."""
        root = getattr(self, "root_node", None)
        return {} if root is None else tree_ticks(root)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_build_context(cls, ctx) -> "TieredRadixCache":
        return build.from_build_context(cls, ctx)

    @classmethod
    def create_simulated(cls, capacity_tokens: int, page_size: int = 16, policy_config: Optional[PolicyConfig] = None,
                         cache_key: Optional[CacheKey] = None, max_request_tokens: int = 1 << 17,
                         debug_checks: bool = False, host_pages: int = 0, verify_kv: bool = False,
                         store_queue_pages: int = 0, max_in_flight: int = 1) -> "TieredRadixCache":  # fmt: skip
        """A ``TieredRadixCache`` over a simulated page allocator, without a model (build.py).
        ``host_pages``: T1 size (0 = off); ``store_queue_pages``: store queue bound (0 = sync);
        ``max_in_flight``: the most requests the simulated server runs at once (1: one at a time,
        as ``driver.run`` replays them; over 1 the strict guarantee is lru's order itself).

        ``cache.driver.run(token_ids, tenant=...)`` replays one request in the scheduler's call
        order and returns its ``RequestOutcome`` (prompt_len, cached_len, seconds). Use it to
        evaluate the policy on your own traces (see bench/trace_replay.py)."""
        return build.create_simulated(cls, capacity_tokens, page_size, policy_config, cache_key, max_request_tokens,
                                      debug_checks, host_pages, verify_kv, store_queue_pages, max_in_flight)  # fmt: skip

    def attach_host(self, host, store=None) -> None:
        """Put T1 (a ``HostTier``, and optionally its ``StoreQueue``) behind the device tree."""
        self.use_identity("T1")  # (first: a refusal leaves the policy as it was)
        self.policy.read_sketch()  # T1's and T2's page value
        self.t1 = T1Tier(self, host, store)
        if self.index.listener is not None:
            self.attach_index(self.index.listener)

    def attach_index(self, listener) -> None:
        """Tell ``listener`` (``on_store(hashes)``, ``on_remove(hashes)``, ``on_clear()``) which
        page hashes this server holds, in device or T1 (index_hints.py)."""
        self.use_identity("the fleet index")
        self.index.listener = listener
        if self.t1 is not None:
            self.t1.host.pool.forget_listener = self.index.t1_forgot

    def use_identity(self, reader: str) -> None:
        """Key the tree's pages by identity hashes (page_hashes.py): ``reader`` reads them. Only
        while no node holds policy keys: the policy's state (sketch, shadows, divergence) is
        keyed by the pages' keys, and a page keyed twice would be two pages to it."""
        if self.hashes.identity:
            return
        stack = list(self.root_node.children.values())
        while stack:
            n = stack.pop()
            if n.tiered_hashes is not None:
                raise RuntimeError(f"sglang-tiered: {reader} attached to a tree that already keys its pages by "
                                   "policy keys: attach it before the first request")  # fmt: skip
            stack.extend(n.children.values())
        self.hashes.use_identity()

    # ------------------------------------------------------------------ public accessors
    @property
    def host(self):
        """T1's ``HostTier`` (None when T1 is off)."""
        return self.t1.host if self.t1 is not None else None

    @property
    def store(self):
        """T1's store queue (None when T1 is off or writes are synchronous)."""
        return self.t1.store if self.t1 is not None else None

    def tenant(self, cache_salt) -> TenantCounters:
        """The counters of the tenant a request or node with ``cache_salt`` belongs to."""
        return self.tenants.for_salt(cache_salt)

    def hashes_read(self) -> bool:
        """Whether anything reads the page hashes of a request's pages as they are stored: the
        policy (``reads_pages``), T1 (and T2 behind it) or the fleet index. When nothing does
        (lru's order on a batching server, T1 off, no index), checkpoint hashes nothing: a node
        gets its hashes when something first needs them (``PageHashes.ensure``: an invalidation's
        cut), as a split's node does. The chained hashes are the identity of what
        leaves the device; the tree itself keys pages by their tokens and tenant namespace."""
        return self.policy.reads_pages or self.t1 is not None or self.index.listener is not None

    def _key_pages(self, key) -> list:
        """The page hashes of a ``RadixKey``'s tokens (its limit honoured; the full pages; under
        EAGLE each page with the token after it, as checkpoint hashes them) in its namespace."""
        tokens, ps, eagle = key.raw_token_ids(), self.page_size, int(self.is_eagle)
        aligned = ((len(tokens) - eagle) // ps) * ps
        seed = self.hashes.seed(key.extra_key, key.cache_salt)
        return self.hashes.chain(seed, tokens[: aligned + eagle], ps, eagle) if aligned > 0 else []

    def path_hashes(self, node) -> list:
        """Chained page hashes from the root to the end of ``node``."""
        return self.hashes.path(node, self.root_node)

    def open_requests(self) -> int:
        """Requests with per-request state held (counted in the sketch or probed in T1)."""
        return len(self.admission.counted) + (len(self.t1.pending) if self.t1 is not None else 0)

    def describe(self) -> str:
        return (f"TieredRadixCache(page_size={self.page_size}, capacity_tokens={self.capacity_tokens}, "
                f"tp_rank={self.tp_rank}/{self.tp_size}, key={self.cache_key})")  # fmt: skip

    def stats_snapshot(self) -> dict:
        """msgpack-safe per-rank stats (see sglang_tiered/stats.py for the aggregated schema)."""
        return stats_snapshot(self)

    # ------------------------------------------------------------------ SGLang overrides
    def reset(self):
        """SGLang's flush (``Scheduler.flush_cache``, managers/scheduler.py:5518-5523; also after
        every weight update, scheduler_components/weight_updater.py:120-133) empties the device
        tree. With T1 on, its pages go to T1 first, so a flush before shutdown leaves everything
        in a named T1 for a warm restart. After a weight update that is undone at once: the
        update's hook (``on_weights_updated``, integration/hooks.py) runs after the update's own
        flush, drops T1 and re-seeds the identity, so nothing demoted from the old weights is
        served. While T1 is paused (a weight update SGLang did not flush) nothing is demoted:
        T1 is dropped instead. While the KV pool is released (``release_memory_occupation``
        pauses it before this flush: weight_updater.py:365-366) nothing is read from it: the
        device tree is dropped, T1 keeps what it holds (review, session 18: demoting then copied
        unmapped memory, and T1 served it after the resume)."""
        if self.t1 is not None and getattr(self, "root_node", None) is not None:
            if self.t1.paused or getattr(self, "_pending_key", None) is not None:
                self.t1.drop_all()
                self.index.clear()
            elif self.kv_released:
                self.t1.cancel_pending()
                self.index.clear()  # device pages gone (T1's go unclaimed too: a missed hint, never wrong)
            else:
                self.persist_to_host()
                if self.root_node.children:
                    # locked nodes stay on the device through persist_to_host (a load-back whose
                    # batch never ran) and are dropped below: their pages leave the device, kept
                    # as held where T1 has them (review, session 25: the index and the policy's
                    # record of device pages kept them). Their pending T1 writes are done now,
                    # while the pages still hold their KV: left queued, the worker copied the
                    # pages' next contents into T1 under these hashes (review, session 40)
                    self.t1.fence_tree()
                    self.index.device_removed(list(tree_pages(self.root_node)), kept=self.t1.holds)
            # locks on nodes of the tree dropped below would be released into the new tree's
            # counts (idle flushes hold none: only a load-back whose batch never ran; before
            # session 23 the persist branch kept them)
            self.t1.load_locks = []
        else:
            self.index.clear()
        super().reset()
        self.policy.device_flushed()  # SGLang's own tree under any order is empty now too
        self.eviction.reset()
        self.root_node.tiered_hashes = []
        self.root_node.tiered_end = 0
        self.admission.reset()
        self.invalidation.reset()
        for c in self.tenants.by_name.values():
            c.resident_pages = 0
        if getattr(self, "_pending_key", None) is not None:
            self._apply_key(self._pending_key)

    def persist_to_host(self) -> int:
        """Demote every evictable device page into T1 (what ``/flush_cache`` does first; also
        the ``sglang_tiered_persist_to_host`` internal-state key). Locked pages stay. Returns the
        tokens demoted (0 when T1 is off or paused)."""
        if self.t1 is None or self.t1.paused or self.disable:
            return 0
        self.t1.flushing = True  # everything goes to T1, whatever the store queue judged
        try:
            return self.evict(EvictParams(num_tokens=self.evictable_size_)).num_tokens_evicted
        finally:
            self.t1.flushing = False

    # ------------------------------------------------------------------ weight updates
    def on_weights_updated(self, weight_version=None, source: str = "weights update") -> None:
        """The served weights changed (or may have: a failed update can leave them half loaded).
        Called by the scheduler hooks (integration/hooks.py) after every ``update_weights_from_*``
        and ``end_weight_update`` of ``SchedulerWeightUpdaterManager`` and every weight-version
        change (``Scheduler.record_weight_version_change``).

        * T1 is dropped now (pending writes cancelled): nothing in it was computed with the new
          weights.
        * The identity is re-seeded: ``weights_digest`` gets ``+update:<server lifetime id>:<n>:
          <weight_version>``, so every page hash changes and no T2 object (or named-T1 page)
          stored under an earlier identity, by this server or any other, can match again. The
          lifetime id (config.lifetime_id) is shared by the TP ranks of one server (they must
          hash alike) and unique per server start; a weight version alone is a label that may be
          reused for other weights. Servers updated to the same weights do not share T2 pages.
        * If SGLang did not flush the device tree (``flush_cache=False`` or a refused flush) it
          still holds old-weights KV, whose page hashes chain from the old seed: T1 and T2 are
          paused (no probe, store or demotion) and the new seed applied when the tree is empty
          again (the next ``reset``, or the batch end after the last node left)."""
        self.epoch += 1  # KV that requests in flight computed before now is never adopted (admission)
        self.weight_updates += 1
        if source == "end_weight_update":
            self.weight_session = None
        if weight_version is not None:
            self.weight_version = str(weight_version)
        base = self.base_key
        life = self.lifetime_tag or lifetime_id()
        digest = f"{base.weights_digest}+update:{life}:{self.weight_updates}:{self.weight_version or ''}"
        key = replace(self.cache_key, weights_digest=digest)
        dropped = self.t1.drop_all() if self.t1 is not None else 0
        self.invalidation.versions.update(weights_digest=digest, weight_version=self.weight_version or "")
        if self.t1 is not None and not self.root_node.children:
            self.index.clear()  # the T1 pages just dropped (a device tree left is withdrawn at its flush)
        if self.root_node.children:
            self._pending_key = key
            if self.t1 is not None:
                self.t1.paused = f"{source}: the device tree still holds KV of the old weights (not flushed)"
        else:
            self._apply_key(key)
        paused = "" if self._pending_key is None else "; T1/T2 paused until the device tree is flushed"
        logger.warning("sglang-tiered: %s (weight_version=%s): T1 dropped (%d tokens), cache identity re-seeded%s",
                       source, self.weight_version, dropped, paused)  # fmt: skip

    def on_weight_session_begin(self) -> None:
        """``begin_weight_update`` opens a session: until its ``end_weight_update`` the weights
        change under the server with no load call to hook (packed weights restored at begin, then
        P2P/RDMA writes), while requests may keep running. KV computed meanwhile would be adopted
        under the old identity, written to T1, and evicted into T2, where servers still on the old
        weights would be served it (review, session 22). So T1 and T2 are paused now (no probe,
        store or demotion) and requests in flight are not adopted; ``end_weight_update``
        (``on_weights_updated``) re-seeds the identity and resumes them once the device tree
        holds no KV of the session."""
        self.epoch += 1
        self.weight_session = "a weight-update session is open (begin_weight_update): the weights are changing"
        if self.t1 is not None:
            self.t1.paused = self.weight_session
        logger.warning("sglang-tiered: weight-update session opened: T1/T2 paused until end_weight_update")

    def _apply_key(self, key: CacheKey) -> None:
        """Re-seed the page hashes (only with an empty device tree: every node's hashes chain
        from the seed) and resume T1/T2."""
        assert not self.root_node.children, "re-seeding a non-empty tree"
        self.cache_key = key
        self.hashes = PageHashes(key, self.page_size, identity=self.hashes.identity)
        self._pending_key = None
        if self.t1 is not None:
            self.t1.paused = self.weight_session  # (None: resumed)
        listener = self.index.listener
        if listener is not None and hasattr(listener, "set_key"):  # routers hash with the new key
            listener.set_key(key)

    def checkpoint(self, req, *, up_to: int):
        if self.disable:
            return
        plan = self.admission.plan(req, up_to)
        if plan is None:
            return
        if self.is_eagle or self.invalidation.count:  # bigram keys; invalidated entries to cut
            super().checkpoint(req, up_to=plan.admit_len)
        else:
            tree_ops.checkpoint(self, req, plan.admit_len)
        self.admission.adopted(req, plan)
        self.after_op()

    def match_prefix(self, params):
        self.clock.now()
        req = params.req
        if req is not None and getattr(req.kv, "req_pool_idx", None) is None:
            req.tiered_epoch = self.epoch  # (no KV of its own yet: what it computes is of this epoch)
        if req is not None:
            held = self.in_flight.get(req.rid)
            if held is None:
                # a request that starts while another is in flight: the policy's shadows model
                # requests one at a time (PolicyConfig.guard_serial)
                if self.in_flight:
                    self.policy.note_overlap(len(self.in_flight) + 1)
                else:
                    self.policy.note_serial()
                if len(self.in_flight) >= IN_FLIGHT_MAX:  # never released (aborted): forget the oldest
                    del self.in_flight[next(iter(self.in_flight))]
            if held is not SEEN:  # what SGLang's match touches (its limit included; the same object
                self.in_flight[req.rid] = params.key  # the match below turns into bigrams under EAGLE)
        key = params.key
        if self.disable or self.is_eagle or key.is_bigram:  # (bigram keys: SGLang's code)
            result = super().match_prefix(params)
        else:  # SGLang's match, without its copies (tree_ops.match_prefix)
            result = tree_ops.match_prefix(self, key)
        self.clock.stamp(result.last_device_node, self.root_node)
        result = self.invalidation.cut_match(result)
        if self.t1 is not None and params.req is not None:
            result = self.t1.probe(params, result)
        return result

    def touch_prefix(self, key) -> None:
        """SGLang's refresh of a waiting request's cached path (``SchedulePolicy`` calls it while
        the request waits; on by default for fcfs + lru): its ``last_access_time``, and our logical
        tick, which the victim queue orders by (before, only the former moved, so "following lru"
        evicted a waiting request's prefix that SGLang's lru keeps: review, session 24).

        The policy's tree shadows replay the touch too (``match_only``), so lru's yardstick stays
        SGLang's lru. Before session 36 they did not: on a server that runs one request at a time
        (the only one where the adaptive order runs) with requests waiting, lru's shadow evicted
        prefixes SGLang's lru kept because a waiting request's refresh touched them, the books
        showed a gain over lru that was not there, and the strict default lost 2.2 to 4.7 points
        to lru (tests/test_review36.py)."""
        key, _ = key.maybe_to_bigram_view(self.is_eagle)
        if self.disable or len(key) == 0:
            return
        key = key.page_aligned(self.page_size)
        if len(key) == 0:
            return
        self.clock.now()
        _, node = self._match_prefix_helper(self.root_node, key)
        self.clock.stamp(node, self.root_node)
        if self.policy.replays_matches:
            self.policy.match_only(self._key_pages(key))

    def init_load_back(self, params):
        """Promote the T1 pages probed for this request into new device pages, all or nothing.
        Returns (loaded_tokens, new_last_node); (0, node) is a clean miss (recompute)."""
        if self.t1 is None:  # no T1: nothing was probed
            return 0, params.best_match_node
        return self.t1.load_back(params)

    def evict(self, params: EvictParams) -> EvictResult:
        """See evict.py: LRU with reused leaves aged by the learned boost, pinned prefixes last."""
        if self.disable:
            return EvictResult()
        start_time = time.perf_counter()
        num_evicted = self.eviction.run(params.num_tokens)
        self.update_eviction_metrics(num_evicted, start_time)
        self.after_op()
        return EvictResult(num_tokens_evicted=num_evicted)

    def inc_lock_ref(self, node):
        """SGLang's ``inc_lock_ref`` with its per-node ``_update_leaf_status`` inlined: a locked
        node is never an evictable leaf, so each one on the path is just taken out of the set."""
        if self.disable:
            return IncLockRefResult(delta=0)
        delta = 0
        root, leaves = self.root_node, self.evictable_leaves
        while node is not root:
            if node.lock_ref == 0:
                n = len(node.key)
                self.evictable_size_ -= n
                self.protected_size_ += n
                delta -= n
            node.lock_ref += 1
            leaves.discard(node)
            node = node.parent
        return IncLockRefResult(delta=delta)

    def dec_lock_ref(self, node, params=None):
        result = super().dec_lock_ref(node, params)
        self.invalidation.on_unlock(node)
        return result

    def release_aborted_request(self, handle) -> None:
        """SGLang finishes a request aborted before it ran (``Scheduler._release_aborted_request``
        -> ``finish(handle, ABORT)``) without ``release_kv_cache``, so ``on_release`` never sees
        it: its probe and admission state go here (a later request may reuse the rid)."""
        super().release_aborted_request(handle)
        rid = getattr(handle, "rid", None)  # (SGLang's ``CacheRequestHandle``: rid, attempt_id)
        self._replay_unseen_match(rid)
        self.admission.forget(rid)
        if self.t1 is not None:
            self.t1.forget(rid)

    def _replay_unseen_match(self, rid) -> None:
        """SGLang lets go of ``rid`` (released or aborted). If its pages never reached the policy
        (aborted while it waited; turned away as too long for the pool; refused whole at
        checkpoint: the no-store hint, a stale epoch, an invalidated path; released before any
        checkpoint, as a forward whose output SGLang discards), its match still touched its
        cached path in SGLang's lru, so the tree shadows replay that touch (``match_only``) from
        the key SGLang matched it by. Before session 36 only the first case was replayed, from
        the request's prompt, and on a real server not even that (SGLang passes a
        ``CacheRequestHandle``, which has no prompt; the simulator passed the request): each of
        these cost the strict default 1.2 to 3.7 points to lru (a helper's audit;
        tests/test_review36.py). A no-store request's pages are not inserted in the shadows: the
        real cache never stores them, so lru's yardstick is the tree the real cache sees."""
        key = self.in_flight.pop(rid, None)
        if key is not None and key is not SEEN and self.policy.replays_matches:
            self.policy.match_only(self._key_pages(key))

    def on_release(self, req, *, checkpointed: bool) -> None:
        self._replay_unseen_match(req.rid)
        self.admission.forget(req.rid)
        if self.t1 is not None:
            self.t1.forget(req.rid)
        # A request retracted at decode (out of memory) or preempted is released unfinished and
        # later re-admitted as the same ``Req`` (schedule_batch.py ``release_req``, then
        # ``reset_for_retract``): its tenant counts it once, at its first release. (Its pages do
        # go through the sketch and the duel's shadows again: the re-admission is a real second
        # reference in SGLang's tree too, which the shadows must replay.)
        if not getattr(req, "tiered_released", False):
            req.tiered_released = True
            tc = self.tenant(req.cache_salt)
            tc.requests += 1
            tc.prompt_tokens += len(req.origin_input_ids)
            cached = int(getattr(req, "cached_tokens", 0) or 0)
            tc.cached_tokens += cached
            tc.requests_hit += cached > 0
            if no_store(req):
                tc.no_store_requests += 1
                self.policy.stats.no_store_requests += 1
        super().on_release(req, checkpointed=checkpointed)

    def flush_pending_backups(self) -> None:
        """Called by the scheduler after every batch: T1 writes land, promotions are released,
        metrics are published."""
        super().flush_pending_backups()
        if self._pending_key is not None and not self.root_node.children:
            self._apply_key(self._pending_key)  # the old-weights tree is gone: resume T1/T2
        if self.t1 is not None:
            self.t1.after_batch()
        if self.metrics is not None:
            self.metrics.publish(self)

    def _match_prefix_helper(self, node, key):
        if key.is_bigram:
            return super()._match_prefix_helper(node, key)
        return tree_ops.match(self, node, key)

    def _insert_helper(self, node, key, value, priority: int = 0, inserted_len: int = 0):
        if key.is_bigram:
            return super()._insert_helper(node, key, value, priority, inserted_len)
        return tree_ops.insert(self, node, key, value, priority, inserted_len)

    def _split_node(self, key, child, split_len: int):
        new_node = super()._split_node(key, child, split_len)
        new_node.tiered_tick = child.tiered_tick
        # SGLang stamps the node it splits (both halves) as used now: lru's tick; the adaptive
        # order keeps the old one (a split is not a use of the lower half), until it is left
        child.tiered_lru = new_node.tiered_lru = self.clock.current
        if not self.policy.adaptive_extras:  # a fixed order, followed or forced
            child.tiered_tick = new_node.tiered_tick = self.clock.current
        else:
            self.eviction.diverged = True
        self.invalidation.on_split(new_node, child)
        self.hashes.split(new_node, child, split_len)
        return new_node

    def _update_leaf_status(self, node):
        # SGLang's (radix_cache.py:790-803), then the victim queue offered the node if it is an
        # evictable leaf now (inlined: this runs on every node of every lock, unlock and insert)
        leaves = self.evictable_leaves
        if node.value is None or node.lock_ref > 0:  # evicted or locked
            leaves.discard(node)
            return
        for child in node.children.values():
            if child.value is not None:
                leaves.discard(node)
                return
        leaves.add(node)
        queue = self.eviction.queue
        if queue is not None:
            queue.offer(node)

    # ------------------------------------------------------------------ invalidation
    def invalidate(self, *, tenant_hash: Optional[int] = None, version_hash: Optional[int] = None,
                   everything: bool = False) -> dict:  # fmt: skip
        """Drop matching entries now; entries a running request holds are cut off from matching
        at once and freed when released. Returns what was dropped (tokens)."""
        return self.invalidation.invalidate(tenant_hash=tenant_hash, version_hash=version_hash, everything=everything)

    def apply_invalidation_key(self, key: str, value: int) -> None:
        """One key of an HTTP invalidation (integration/protocol.py); the nonce comes first."""
        self.invalidation.apply_key(key, value)

    # ------------------------------------------------------------------ tree helpers for the modules
    def graft(self, parent, key, slots, hashes: list):
        """Insert a new leaf under ``parent`` holding ``slots`` (promoted from a lower tier)."""
        n = len(key)
        new = TreeNode(priority=parent.priority)
        new.parent = parent
        new.key = key
        new.value = slots.to(dtype=torch.int64).clone()
        new.hit_count = 1
        new.tiered_hashes = list(hashes)
        new.tiered_end = parent.tiered_end + n
        new.tiered_tick = new.tiered_lru = self.policy.tick
        parent.children[key.child_key(self.page_size)] = new
        self.evictable_size_ += n
        self._update_leaf_status(parent)
        self._update_leaf_status(new)
        self.kv_events.record_store(new)
        self.index.device_stored(hashes)
        return new

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Every invariant of the tree and the structures it owns (invariants.py)."""
        check_cache(self)

    def sanity_check(self) -> None:
        """SGLang's hook (``SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK``): our checkers, then SGLang's."""
        self.check_invariants()
        base = getattr(super(), "sanity_check", None)
        if base is not None:
            base()

    def after_op(self) -> None:
        """Debug mode (``SGLANG_TIERED_DEBUG=1``): check every invariant after every operation."""
        if self.debug_checks:
            self.check_invariants()
