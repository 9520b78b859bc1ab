"""Per-rank stats of a ``TieredRadixCache`` (msgpack-safe; summed by ``sglang_tiered/stats.py``,
whose Structs are the schema: ``TenantStats``, ``TierStats``, ``PolicyReport``, ``IndexStats``)."""

from __future__ import annotations

from sglang_tiered.stats import PolicyReport

# The policy fields a rank reports: the schema's (the rest of ``AdaptivePolicy.snapshot`` is for
# debugging), so the schema is the one list.
POLICY_FIELDS = PolicyReport.__struct_fields__


def device_tier(cache) -> dict:
    ps = cache.page_size
    return {
        "name": "device",
        "enabled": True,
        "capacity_pages": cache.capacity_tokens // ps,
        "resident_pages": (cache.evictable_size_ + cache.protected_size_) // ps,
        "evictable_tokens": cache.evictable_size_,
        "protected_tokens": cache.protected_size_,
        "decision": "device radix tree",
    }


def stats_snapshot(cache) -> dict:
    pol = cache.policy.snapshot()
    return {
        "page_size": cache.page_size,
        "last_invalidation": dict(cache.invalidation.last),
        "versions": dict(cache.invalidation.versions),
        "tenants": {name: c.as_dict() for name, c in cache.tenants.by_name.items()},
        "tiers": [
            device_tier(cache),
            cache.t1.snapshot() if cache.t1 is not None else
            {"name": "host", "enabled": False, "decision": cache.host_decision},
            cache.t1.host.t2.snapshot() if cache.t1 is not None and cache.t1.host.t2 is not None else
            {"name": "t2", "enabled": False, "decision": cache.t2_decision},
        ],
        "index": cache.index.snapshot(),
        "policy": {k: pol[k] for k in POLICY_FIELDS},
    }  # fmt: skip
