"""Chained page hashes on tree nodes: computed lazily, once per page, and kept through splits.

A node's ``tiered_hashes`` are the chained page keys of its pages, of one of two kinds for the
whole tree (``PageHashes.identity``):
- **identity hashes** (``keys.chain_page_hashes``, BLAKE2b-128 over the ``CacheKey``'s seed)
  wherever anything outside this process reads a page's identity: T1 (and T2 behind it) and the
  fleet index. ``TieredRadixCache.attach_host`` / ``attach_index`` switch the tree to them
  (``use_identity``, while no node holds keys yet), and T1 refuses a tree that has not;
- **policy keys** (``keys.chain_page_keys``: a 128-bit MurmurHash3-style chain from the same
  seed, ~8x cheaper a page, not collision resistant; only where the C extension is built:
  ``keys.POLICY_KEYS``) otherwise: then the keys are read by the
  policy alone (its sketch, samples, shadows and divergence), where a collision costs an
  estimate and never a page (the tree matches by tokens and namespace). BLAKE2b was 21-30 % of
  SGLang lru's whole bookkeeping time on long prompts (issue #11, session 45).

Either kind chains the same way, seeded by its
tree namespace (``CacheKey.namespace_seed``) or continued from its parent's last hash;
``tiered_end`` is the token depth of its end. A long prompt is hashed once, page by page, as it
is inserted (``attach``), never again; nodes created without hashes get them on first need
(``ensure``). Where nothing reads a page hash at insertion (``TieredRadixCache.hashes_read``:
lru's order on a server that may batch, without T1 or the fleet index) nothing is hashed then.

Invariants (checked by ``check``):
  H1 ``node.tiered_hashes == chain(prev, node tokens, page_size)`` (``chain`` the tree's kind; a bigram key, EAGLE:
     each page with the token after it) where ``prev`` is
     the parent's last hash or the namespace seed;
  H2 ``node.tiered_end == parent.tiered_end + len(node.key)``;
  H3 the tree's keys are identity hashes wherever T1 or the fleet index is attached (checked by
     ``integration/invariants.py``, which knows what is attached).
"""

from __future__ import annotations

from sglang_tiered.core import keys as _keys
from sglang_tiered.core.keys import CacheKey, chain_page_hashes, chain_page_keys
from sglang_tiered.integration import node_state  # noqa: F401  (declares the node attributes)

SEED_TABLE_MAX = 4096  # memoised namespace seeds (bounded: clients may mint salts freely)


class PageHashes:
    """Page-hash plumbing for one tree (one ``CacheKey``, one page size)."""

    def __init__(self, cache_key: CacheKey, page_size: int, identity: bool = False):
        self.cache_key = cache_key
        self.page_size = page_size
        self._seeds: dict = {}
        self.identity = False
        self.chain = chain_page_keys  # (prev, tokens, page_size, overlap) -> this tree's page keys
        if identity or not _keys.POLICY_KEYS:  # (no C chain: the identity hashes, keys.POLICY_KEYS)
            self.use_identity()

    def use_identity(self) -> None:
        """Key pages by their identity hashes from now on (T1, T2 or the fleet index reads them).
        Only before any node holds keys of the other kind: the caller checks (``TieredRadixCache``)."""
        self.identity = True
        self.chain = chain_page_hashes

    def seed(self, extra_key, cache_salt) -> bytes:
        """Chain seed of a tree namespace (structured: see ``CacheKey.namespace_seed``). Memoised
        in a bounded table (a seed is one hash away, so forgetting one costs nothing)."""
        k = (extra_key, cache_salt or None)
        s = self._seeds.get(k)
        if s is None:
            if len(self._seeds) >= SEED_TABLE_MAX:
                self._seeds.clear()
            s = self._seeds[k] = self.cache_key.namespace_seed(cache_salt, extra_key)
        return s

    @property
    def seeds_held(self) -> int:
        """Namespace seeds memoised now (at most ``SEED_TABLE_MAX``)."""
        return len(self._seeds)

    def prev_of(self, parent, key) -> bytes:
        """The hash a child of ``parent`` (with ``key``'s namespace) chains from."""
        return parent.tiered_hashes[-1] if parent.tiered_hashes else self.seed(key.extra_key, key.cache_salt)

    def of_node(self, n) -> list:
        """``n``'s page hashes from its tokens (H1's right-hand side; its parent's must be known)."""
        return self.chain(self.prev_of(n.parent, n.key), n.key.raw_token_ids(), self.page_size,
                          int(n.key.is_bigram))  # fmt: skip

    def ensure(self, node) -> None:
        """Give ``node`` and its ancestors their page hashes (top-down, only where missing)."""
        chain = []
        while node.tiered_hashes is None:
            chain.append(node)
            node = node.parent
        for n in reversed(chain):
            n.tiered_hashes = self.of_node(n)
            n.tiered_end = n.parent.tiered_end + len(n.key)

    def attach(self, node, hashes: list) -> None:
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
                self.ensure(n)

    def path(self, node, root) -> list:
        """All page hashes from the root to the end of ``node``."""
        self.ensure(node)
        parts = []
        while node is not root:
            parts.append(node.tiered_hashes)
            node = node.parent
        out = []
        for p in reversed(parts):
            out.extend(p)
        return out

    def split(self, new_node, child, split_len: int) -> None:
        """``child`` was split at ``split_len`` tokens into ``new_node`` (its new parent)."""
        hashes = child.tiered_hashes
        if hashes is not None:
            k = split_len // self.page_size
            new_node.tiered_hashes, child.tiered_hashes = hashes[:k], hashes[k:]
            new_node.tiered_end = child.tiered_end - len(child.key)
        else:
            new_node.tiered_hashes = None

    def check(self, root) -> None:
        """H1, H2 over the whole tree."""
        stack = list(root.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.tiered_hashes is None:
                continue
            assert n.tiered_hashes == self.of_node(n), f"H1 violated: stale page hashes on node {n.id}"
            assert n.tiered_end == n.parent.tiered_end + len(n.key), f"H2 violated: stale depth on node {n.id}"
