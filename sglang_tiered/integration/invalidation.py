"""Invalidation of cached entries by tenant, by model version, or all of them.

An invalidated node is marked ``tiered_invalid`` at once: matching stops before it, and no
request extends a path through it. It is freed now if nothing holds it, otherwise the moment its
last holder lets go (``on_unlock``). T1 entries of the same scope are dropped, and pending T1
writes of them cancelled, so nothing invalidated is ever served again.

Invariants:
  V1 ``count`` equals the number of invalidated nodes still in the tree;
  V2 an invalidated node with no lock and no children does not stay in the tree.
"""

from __future__ import annotations

import logging
from typing import Optional

from sglang.srt.mem_cache.radix_cache import RadixKey

from sglang_tiered.core.tenants import name_hash, tenant_tags
from sglang_tiered.integration.node_state import node_pages, node_tag
from sglang_tiered.integration.protocol import InvalidationKind, parse_invalidation_key

logger = logging.getLogger("sglang_tiered")


class Invalidation:
    """Invalidation state of one ``TieredRadixCache`` (``cache`` gives the tree and the tiers)."""

    def __init__(self, cache):
        self.cache = cache
        self.count = 0  # invalidated nodes still held by running requests (V1)
        self.versions: dict[str, str] = {}  # identity names an invalidation may target
        self.last: dict = {}  # what the last HTTP invalidation dropped (stats)
        self.generation: Optional[int] = None  # T2's generation given with the request being applied

    def reset(self) -> None:
        self.count = 0

    def invalidate(self, *, tenant_hash: Optional[int] = None, version_hash: Optional[int] = None,
                   everything: bool = False) -> dict:  # fmt: skip
        """Drop matching entries now; entries a running request holds are cut off from matching
        at once and freed when released. Returns what was dropped (tokens)."""
        cache = self.cache
        cache.epoch += 1  # KV computed before now by requests in flight is not adopted (admission)
        if version_hash is not None and any(name_hash(v) == version_hash for v in self.versions.values() if v):
            everything = True
        tags = () if tenant_hash is None else tenant_tags(tenant_hash)
        targets = []
        for child in list(cache.root_node.children.values()):
            if everything or node_tag(child) in tags:
                targets.append(child)
        dropped = 0
        if cache.t1 is not None:
            if everything:
                per = cache.t1.host.tenant_pages()
                dropped = cache.t1.invalidate(None, True, self.generation)
            else:
                per = {}
                for tag in tags:
                    per[tag] = cache.t1.invalidate(tag, False, self.generation) // cache.page_size
                dropped = sum(per.values()) * cache.page_size
            self._count_t1(per)
        deferred = 0
        for top in targets:
            d, f = self._invalidate_subtree(top)
            dropped, deferred = dropped + d, deferred + f
        return {"dropped_tokens": dropped, "deferred_tokens": deferred, "subtrees": len(targets)}

    def _count_t1(self, pages_by_tenant: dict) -> None:
        """T1 pages dropped, into each tenant's ``invalidated_pages`` beside its device pages
        (before session 21 a tenant's count was device pages only). Tenants are matched by their
        name's hash, which the tenant table maps to their label (a hashed salt, or a long name, was
        not matched before session 23); one folded into ``__other__`` is counted in
        ``dropped_tokens`` only."""
        if not pages_by_tenant:
            return
        table = self.cache.tenants
        for h, n in pages_by_tenant.items():
            label = table.by_hash.get(h)
            if n and label is not None:
                table.get(label).invalidated_pages += n

    def _invalidate_subtree(self, top) -> tuple[int, int]:
        stack, order = [top], []
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        for n in order:
            if not n.tiered_invalid:
                n.tiered_invalid = True
                self.count += 1
        dropped = deferred = 0
        for n in reversed(order):  # children before parents
            if n.lock_ref == 0 and not n.children:
                dropped += self.drop(n)
            else:
                deferred += len(n.key)
        return dropped, deferred

    def apply_key(self, key: str, value: int) -> None:
        """One key of an HTTP invalidation (``integration/protocol.py``); the nonce comes first."""
        kind = parse_invalidation_key(key)
        if kind is InvalidationKind.NONCE:
            self.last = {"nonce": value, "dropped_tokens": 0, "deferred_tokens": 0}
            self.generation = None
            return
        if kind is InvalidationKind.GENERATION:  # for the keys that follow in this request
            self.generation = value
            return
        if kind is InvalidationKind.TENANT:
            res = self.invalidate(tenant_hash=value)
        elif kind is InvalidationKind.VERSION:
            res = self.invalidate(version_hash=value)
        else:
            res = self.invalidate(everything=bool(value))
        # SGLang's own ``/set_internal_state`` can send a key without our nonce first: it is
        # applied all the same and reported under no nonce (a missing nonce must not raise in the
        # scheduler, which would take the server down)
        inv = self.last if "dropped_tokens" in self.last else {"nonce": None, "dropped_tokens": 0, "deferred_tokens": 0}
        self.last = inv
        inv["dropped_tokens"] += res["dropped_tokens"]
        inv["deferred_tokens"] += res["deferred_tokens"]
        logger.info("sglang-tiered: invalidation %s: %s", key, res)

    def drop(self, node) -> int:
        """Free an invalidated leaf now (its pages never reach T1). Returns its tokens."""
        cache = self.cache
        n = len(node.key)
        if cache.t1 is not None:
            cache.t1.fence(node, run=False)  # an invalidated page is never written to T1
        cache.token_to_kv_pool_allocator.free_segment(node.value, start_pos=0)
        tc = cache.tenant(node.key.cache_salt)
        tc.invalidated_pages += node_pages(node, cache.page_size)
        tc.resident_pages -= node_pages(node, cache.page_size)
        cache._delete_leaf(node)
        cache.kv_events.record_remove(node)
        cache.index.device_removed(node.tiered_hashes)
        self.count -= 1
        return n

    def on_unlock(self, node) -> None:
        """Free invalidated entries the moment their last holder lets go."""
        if not self.count:
            return
        root = self.cache.root_node
        while node is not root and node is not None:
            parent = node.parent
            if node.tiered_invalid and node.lock_ref == 0 and not node.children:
                self.drop(node)
            node = parent

    def on_split(self, new_node, child) -> None:
        if child.tiered_invalid:
            new_node.tiered_invalid = True
            self.count += 1

    def cut_match(self, result):
        """Never hand out an invalidated entry: cut a match before the shallowest one."""
        cache = self.cache
        if not self.count or not result.device_prefix_len:
            return result
        node, cut = result.last_device_node, None
        while node is not cache.root_node:
            if node.tiered_invalid:
                cut = node
            node = node.parent
        if cut is None:
            return result
        last = cut.parent
        cache.hashes.ensure(last)
        return result._replace(
            device_prefix_len=last.tiered_end,
            last_device_node=last, last_host_node=last, best_match_node=last,
        )  # fmt: skip

    def next_is_invalid(self, anchor, req, cpl: int) -> bool:
        """Would ``req`` extend its path into an invalidated child of ``anchor``?"""
        if not self.count:
            return False
        ps = self.cache.page_size
        tokens = req.full_untruncated_fill_ids
        # the child key as the tree makes it: under EAGLE a page of bigrams spans ps + 1 tokens
        # (a plain key never found the invalidated child there, and SGLang's checkpoint then
        # extended the invalidated path: an assertion in the scheduler, a double free under -O;
        # review, session 24)
        eagle = self.cache.is_eagle
        if len(tokens) < cpl + ps + eagle:
            return False
        key = RadixKey(tokens[cpl : cpl + ps + eagle], req.extra_key, is_bigram=eagle, cache_salt=req.cache_salt)
        child = anchor.children.get(key.child_key(ps))
        return child is not None and child.tiered_invalid
