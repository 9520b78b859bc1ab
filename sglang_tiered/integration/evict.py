"""Device-tier eviction: which leaf goes first, pinned hot prefixes last, victims to T1.

Order (``core/eviction.py``): least recently used leaf first, leaves reused by >= 2 requests
aged by the policy's learned protection boost; while the safety duel follows a fixed order, that
order exactly (lru: the same queue with no boost; slru: reused leaves after all others; lfu:
fewest requests first). Pinned prefixes (near the root, high sketch frequency, within a page
budget) are set aside as the queue reaches them (oldest first) and evicted only once nothing else
is left. The mechanics are RadixCache.evict's: free the leaf's slots, delete it, offer its parent.
Evicted leaves feed the policy's ghost list.
"""

from __future__ import annotations

import heapq
from typing import Optional

from sglang_tiered.core.eviction import RebuiltQueue, VictimQueue, fixed_order_priority
from sglang_tiered.integration.node_state import node_kind, node_pages

NOT_PINNABLE = 1 << 62  # hit-count threshold that no node reaches (pinning off)


class Eviction:
    """Eviction state of one ``TieredRadixCache`` (``cache`` gives the tree and the tiers)."""

    def __init__(self, cache):
        self.cache = cache
        self.queue: Optional[VictimQueue] = None  # adaptive order: persistent across calls
        self.pin_budget_pages = cache.policy.pin_budget_pages()
        # The adaptive order's ticks differ from lru's (``node.tiered_lru``) where it aged a cold
        # prompt (admission) or kept a split's old tick: ``diverged`` says some may since the
        # last ``unage``; ``_exits``: the policy's exits from adaptive already seen
        # (``AdaptivePolicy.adaptive_exits``).
        self.diverged = False
        self._exits = cache.policy.adaptive_exits

    def reset(self) -> None:
        """After the tree was (re)built: the persistent queue of the adaptive order and of lru
        (boost 0: SGLang's lru order, O(log n) a victim; a forced lru too, session 34: the
        strict default on a server that may batch), or none (slru and lfu rebuild a heap per
        call, as SGLang does)."""
        persistent = self.cache.policy.eviction_order in ("adaptive", "lru")
        self.queue = VictimQueue(self.cache.evictable_leaves) if persistent else None

    def unage(self) -> int:
        """Give every node its lru tick again (``tiered_lru``: its last use, as SGLang's
        ``last_access_time`` orders it). Run once the real cache follows a fixed order after an
        adaptive episode, so that following lru is SGLang's lru exactly: the adaptive order ages
        cold prompts and keeps a split node's old tick, and such a node that the divergence cap
        had kept (lru held it too) went before older pages after the fallback, a loss outside
        every bound (review, session 24: 0.91 points below lru from aging; a second trace from
        splits). The victim queue takes the later ticks lazily (stale entries are re-queued).
        Returns the nodes changed."""
        changed = 0
        stack = list(self.cache.root_node.children.values())
        while stack:
            n = stack.pop()
            if n.tiered_tick != n.tiered_lru:
                n.tiered_tick = n.tiered_lru
                changed += 1
            stack.extend(n.children.values())
        self.diverged = False
        return changed

    def victims(self):
        """The eviction order: the persistent queue (adaptive) or a heap built now (fixed)."""
        policy = self.cache.policy
        if policy.adaptive_exits != self._exits:  # the real cache left adaptive since: lru's ticks back
            self._exits = policy.adaptive_exits
            if self.diverged and policy.following != "adaptive":
                self.unage()
        if self.queue is not None and self.cache.policy.followed_order in ("adaptive", "lru"):
            return self.queue  # (lru: the same queue with no boost; exactly SGLang's lru order)
        priority = fixed_order_priority(self.cache.policy.followed_order)
        return RebuiltQueue([(priority(n), n.id, n) for n in self.cache.evictable_leaves], priority)

    def ordered(self):
        """The evictable leaves in the order ``run`` would take them now (pinning aside), lazily;
        changes nothing (the store queue's write-ahead walks it)."""
        return self.victims().ordered(self.cache.policy.protection_boost())

    def next_victim(self):
        """The leaf ``evict`` would take first now (pinning aside), or None; changes nothing."""
        return self.victims().peek(self.cache.policy.protection_boost())[0]

    def victim_frequency(self) -> Optional[int]:
        """Sketch frequency of the next victim (TinyLFU admission compares against it)."""
        best = self.next_victim()
        if best is None:
            return None
        self.cache.hashes.ensure(best)
        return self.cache.policy.node_frequency(best.tiered_hashes) if best.tiered_hashes else 0

    def is_pinned(self, node, pinned_pages: int) -> bool:
        """Small, hot prefixes (near the root, high sketch frequency) are evicted last."""
        policy = self.cache.policy
        cfg = policy.cfg
        if (node.hit_count < cfg.pin_min_freq or node.tiered_end > cfg.pin_max_tokens
                or pinned_pages >= self.pin_budget_pages):  # fmt: skip
            return False
        self.cache.hashes.ensure(node)
        hashes = node.tiered_hashes
        return bool(hashes) and policy.is_pinned(node.tiered_end, policy.node_frequency(hashes))

    def run(self, num_tokens: int) -> int:
        """Evict at least ``num_tokens`` tokens if possible. Returns the tokens evicted."""
        cache = self.cache
        ps = cache.page_size
        # pinning is part of the adaptive policy; a followed fixed order (safety duel) has none
        pin_hits = cache.policy.cfg.pin_min_freq if cache.policy.pinning else NOT_PINNABLE
        queue = self.victims()
        boost = cache.policy.protection_boost()
        pinned, pinned_pages = [], 0
        policy = cache.policy
        room = policy.div_room()  # None: no cap (lru followed); else pages of lru's it may drop
        # leaves the cap spared (dropping their pages of lru's would pass it): a heap in lru's
        # order (least recently used first), the order they go in if the request needs them
        held = []

        def spare(x) -> bool:
            """The divergence cap (core/safety.py ``div_room``): hold ``x`` back if dropping its
            pages of lru's would pass the room left; else take them from the room."""
            nonlocal room
            cache.hashes.ensure(x)
            # (a leaf lru does not hold is free, even with the room overdrawn)
            cost = policy.div_spared(x.tiered_hashes, room)
            if cost < 0:
                heapq.heappush(held, (x.last_access_time, x.id, x))
                policy.stats.cap_spared += 1
                return True
            room -= cost
            return False

        num_evicted = 0
        # Nodes this run already took (held back, pinned or removed). The victim queue may hand
        # one out again: a rebuild of its heaps (too many stale entries) re-queues every
        # evictable leaf, a held or pinned one too, and a node removed twice corrupted SGLang's
        # tree (found at page size 1, family-096 at 0.5 %; session 18).
        taken = set()
        while num_evicted < num_tokens:
            x = queue.pop(boost)
            if x is not None:
                if x.id in taken:
                    continue
                taken.add(x.id)
                if x.hit_count >= pin_hits and self.is_pinned(x, pinned_pages):
                    pinned_pages += node_pages(x, ps)
                    heapq.heappush(pinned, (x.last_access_time, x.id, x))
                    continue
                if room is not None and spare(x):
                    continue
                was_pinned = False
            elif pinned:
                _, _, x = heapq.heappop(pinned)
                if room is not None and spare(x):
                    continue
                was_pinned = True
            elif held:
                # nothing else is evictable and the request needs the room: over the cap
                # (counted: the bound's overshoot term), least recently used first. lru's tree
                # makes room for the same request by dropping its least recently used pages, so
                # those diverge for a moment only; the adaptive order (the queue's) took a
                # 618-page leaf lru kept for a 97-page request, lost at the switch back
                # (family-096 at page size 1, 0.5 %: 0.46 points below lru; session 19)
                x = heapq.heappop(held)[2]
                cost = policy.div_cost(x.tiered_hashes)
                policy.over_cap(x.tiered_hashes, cost)
                room -= cost  # what is left of the cap is spent (leaves freed up next are held too)
                was_pinned = False
            else:
                break
            num_evicted += self._remove(x, was_pinned, queue)
        for _, _, x in pinned:  # spared: back in the queue for next time
            queue.offer(x)
        for _, _, x in held:  # spared by the cap: back in the queue too
            queue.offer(x)
        return num_evicted

    def _remove(self, x, was_pinned: bool, queue) -> int:
        """Free one victim leaf (to T1 first where it goes there). Returns its tokens."""
        cache = self.cache
        ps = cache.page_size
        t1 = cache.t1
        if t1 is not None and not x.tiered_invalid and x.tiered_hashes:
            t1.on_evict(x)
        else:  # gone from this server
            if t1 is not None:
                t1.fence(x, run=False)
            cache.index.device_removed(x.tiered_hashes)
        cache.token_to_kv_pool_allocator.free_segment(x.value, start_pos=0)
        n = len(x.value)
        pages = node_pages(x, ps)
        cache.policy.on_evict(pages, pinned=was_pinned, first_hash=x.tiered_hashes[0] if x.tiered_hashes else None,
                              kind=node_kind(x), last_tick=x.tiered_tick)  # fmt: skip
        tc = cache.tenant(x.key.cache_salt)
        tc.evicted_pages += pages
        tc.resident_pages -= pages
        parent = x.parent
        cache._delete_leaf(x)
        if parent is not cache.root_node and len(parent.children) == 0 and parent.lock_ref == 0:
            queue.offer(parent)
        cache.kv_events.record_remove(x)
        return n

    def check_invariants(self) -> None:
        """Every evictable leaf has a live entry in the victim queue (possibly stale, then
        re-queued when it reaches the top), so nothing evictable is ever lost to eviction."""
        if self.queue is not None:
            self.queue.check_invariants()
