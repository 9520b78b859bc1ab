"""``TieredRadixCache``: SGLang's ``RadixCache`` with our admission policy and bookkeeping.

The only module (with plugin.py) that imports sglang. SGLang's ownership contract is kept intact:
the tree owns ``[0, req.kv.cache_protected_len)`` of a request's KV row, and whatever ``checkpoint``
does not adopt is freed by ``release_kv_cache`` (sglang/srt/mem_cache/common.py:400-444).
"""

from __future__ import annotations

import logging

from sglang.srt.mem_cache.radix_cache import RadixCache

logger = logging.getLogger("sglang_tiered")


class TieredRadixCache(RadixCache):
    """Radix cache backend registered as ``--radix-cache-backend tiered``."""

    def __init__(self, params, *, tp_rank: int = 0, tp_size: int = 1):
        # RadixCache.__init__ calls self.reset(): our state must exist before it.
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        super().__init__(params)

    @classmethod
    def from_build_context(cls, ctx) -> "TieredRadixCache":
        return cls(ctx.params, tp_rank=ctx.tp_rank, tp_size=ctx.tp_size)

    def describe(self) -> str:
        return (
            f"TieredRadixCache(page_size={self.page_size}, eviction_policy={self.eviction_policy}, "
            f"tp_rank={self.tp_rank}/{self.tp_size})"
        )
