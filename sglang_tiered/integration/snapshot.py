"""Per-rank stats of a ``TieredRadixCache`` (msgpack-safe; summed by ``sglang_tiered/stats.py``)."""

from __future__ import annotations

# The policy fields a rank reports (the rest of ``AdaptivePolicy.snapshot`` is for debugging).
POLICY_FIELDS = (
    "mode", "admission_filtering", "thrashing", "thrash_windows", "admissions_refused",
    "pages_admitted", "pages_rejected", "evicted_pages", "evicted_pinned", "sketch_resets",
    "protection_k", "cold_age_c", "lru_cycle_requests", "following", "fallbacks",
    "cycle_clamped", "shadow_rate", "shadow_lru_hit_rate", "real_sampled_hit_rate",
    "lru_model_bias",
)  # fmt: skip


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
        ],
        "index": cache.index.snapshot(),
        "policy": {k: pol[k] for k in POLICY_FIELDS},
    }  # fmt: skip
