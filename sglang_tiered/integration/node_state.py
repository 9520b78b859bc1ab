"""What sglang-tiered keeps on SGLang's radix tree nodes, declared once.

Class attributes on ``TreeNode`` only add defaults; nothing of SGLang's changes. Every module
that reads or writes these attributes imports this one (importing it is what declares them).

| attribute | type | meaning | set by |
|---|---|---|---|
| ``tiered_hashes`` | ``list[bytes] or None`` | chained page keys of the node's pages (lazily): identity hashes or policy keys (page_hashes.py) | ``PageHashes`` |
| ``tiered_end`` | ``int`` | token depth of the node's end (with ``tiered_hashes``) | ``PageHashes`` |
| ``tiered_tick`` | ``float`` | logical time of last use (request tick + sequence) | ``LogicalClock`` |
| ``tiered_cold`` | ``bool`` | entered aged as part of a cold prompt | admission |
| ``tiered_lru`` | ``float`` | the tick SGLang's lru order gives it (its last use, splits included); ``tiered_tick`` is the adaptive order's: older where it aged a cold prompt or kept a split's | ``LogicalClock`` |
| ``tiered_invalid`` | ``bool`` | invalidated; never matched again, freed when released | ``Invalidation`` |
| ``tiered_entry`` | ``(tick, protected) or None`` | the node's live entry in the victim queue | ``core.eviction.VictimQueue`` |
"""

from __future__ import annotations

from sglang.srt.mem_cache.radix_cache import TreeNode

from sglang_tiered.core.eviction import is_reused
from sglang_tiered.core.policy import COLD, PROTECTED, UNPROTECTED
from sglang_tiered.core.tenants import tenant_tag

TreeNode.tiered_hashes = None
TreeNode.tiered_end = 0
TreeNode.tiered_tick = 0
TreeNode.tiered_cold = False
TreeNode.tiered_lru = 0
TreeNode.tiered_invalid = False
TreeNode.tiered_entry = None


def node_kind(node) -> int:
    """The node's class in the policy's ghost list: protected (reused), cold, or unprotected."""
    if is_reused(node.hit_count):
        return PROTECTED
    return COLD if node.tiered_cold else UNPROTECTED


def node_tag(node) -> int:
    """The T1/T2 tenant tag of a node (``tenant_tag`` of its tree namespace's ``cache_salt``)."""
    return tenant_tag(node.key.cache_salt)


def node_pages(node, page_size: int) -> int:
    return len(node.key) // page_size
