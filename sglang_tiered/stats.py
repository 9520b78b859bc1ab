"""The ``GET /cache/stats`` schema (msgspec Structs) and aggregation across data-parallel ranks.

Every scheduler (one per DP rank; TP ranks hold identical trees, so rank 0 of each reports)
contributes a ``RankStats`` dict through SGLang's internal-state readback; the HTTP process sums
them into ``CacheStats``. Hit rates are recomputed from the summed counters.
"""

from __future__ import annotations

from typing import Optional

import msgspec


class TenantStats(msgspec.Struct, kw_only=True):
    """One tenant's counters (``core.tenants.TenantCounters``, summed over ranks) and hit rates."""

    requests: int = 0
    requests_hit: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    token_hit_rate: float = 0.0
    request_hit_rate: float = 0.0
    admitted_pages: int = 0
    rejected_pages: int = 0
    evicted_pages: int = 0
    invalidated_pages: int = 0
    no_store_requests: int = 0
    resident_pages: int = 0
    promoted_pages: int = 0
    requeued_requests: int = 0


class TierStats(msgspec.Struct, kw_only=True):
    name: str
    enabled: bool
    capacity_bytes: int = 0
    resident_bytes: int = 0
    resident_pages: int = 0
    capacity_pages: int = 0
    evictable_tokens: int = 0
    protected_tokens: int = 0
    demotions: int = 0
    promotions: int = 0
    demote_skipped_pages: int = 0
    failed_promotions: int = 0
    failed_demotions: int = 0
    foreign_slots: int = 0
    # host tier writes: "async" through the store queue (sglang_tiered/core/store_queue.py), or "sync"
    store: str = ""
    queue_capacity_pages: int = 0
    queue_depth_pages: int = 0
    stored_pages: int = 0  # written by the queue's worker, off the request path
    inline_pages: int = 0  # written on the request path (pending at eviction, or a victim T1 lacked)
    value_dropped_pages: int = 0  # pending writes that left the full queue for more valuable ones
    filtered_pages: int = 0  # refused at enqueue (no value, or a one-shot while the queue is half full)
    cancelled_pages: int = 0  # pending writes of invalidated pages
    ahead_offered_pages: int = 0  # pages the device was about to evict, offered at batch ends
    through_offered_pages: int = 0  # admitted pages offered while T1 had free room (write-through)
    staging_pages: int = 0  # host slots outside T1's capacity for write-ahead copies
    staged_pages: int = 0  # written ahead, waiting for the device to evict them
    staged_used_pages: int = 0  # write-ahead copies an eviction adopted (no copy at eviction)
    staged_dropped_pages: int = 0  # write-ahead copies dropped unused (staging full, invalidated)
    # probed in T1, found on the device at load-back (another request of the batch promoted them)
    already_on_device_tokens: int = 0
    decision: str = ""


class T2TierStats(msgspec.Struct, kw_only=True):
    """The fleet tier (Mooncake Store, sglang_tiered/tier/t2.py): pages, bytes, ms, counts."""

    name: str = "t2"
    enabled: bool = False
    decision: str = ""
    backend: str = ""
    available: bool = False  # False while the circuit breaker skips T2 (after an error or timeout)
    down_for_s: float = 0.0
    writes_down_for_s: float = 0.0  # puts paused after the store refused a whole put (full)
    host_bytes: int = 0  # host memory T2 takes beside T1 at most (staging buffers, store queue)
    probes: int = 0  # batched existence checks
    probe_pages_hit: int = 0
    fetched_pages: int = 0  # verified pages brought into T1 (then promoted like T1 hits)
    fetched_bytes: int = 0
    fetch_seconds: float = 0.0  # exists + get + header checks + copy into T1
    read_gbps: Optional[float] = None
    bad_pages: int = 0  # short reads or wrong headers: misses
    oversized_pages: int = 0  # objects larger than a page's object under our keys (foreign): misses, removed
    stale_pages: int = 0  # (before session 23: written before an invalidation here; now always 0)
    offered_pages: int = 0  # T1 victims queued for T2
    filtered_pages: int = 0  # T1 victims below min_freq
    stored_pages: int = 0
    stored_bytes: int = 0
    store_seconds: float = 0.0
    write_gbps: Optional[float] = None
    dropped_pages: int = 0  # refused or value-dropped by the queue, store full or down
    queue_depth_pages: int = 0
    queue_capacity_pages: int = 0
    failures: int = 0  # calls that errored or missed their deadline
    skipped_down: int = 0
    put_refused: int = 0  # puts answered with error codes only (store full): writes paused, reads on
    invalidations: int = 0
    removed_objects: int = 0
    removed_bad: int = 0  # objects that failed the header/footer checks, removed (another format, torn)


class PolicyReport(msgspec.Struct, kw_only=True):
    """One rank's admission/eviction policy, as reported (a subset of ``AdaptivePolicy.snapshot``;
    its counters are ``core.policy.PolicyStats``). The rank snapshot sends exactly these fields."""

    mode: str
    admission_filtering: bool
    thrashing: bool
    thrash_windows: int
    admissions_refused: int
    pages_admitted: int
    pages_rejected: int
    evicted_pages: int
    evicted_pinned: int
    sketch_resets: int
    protection_k: float = 0.0  # learned: reused nodes age k x the LRU cycle later (0 = LRU)
    cold_age_c: float = 0.0  # learned: cold prompts enter c x the LRU cycle old
    lru_cycle_requests: float = 0.0  # mean age, in requests, of evicted leaves
    following: str = "adaptive"  # the safety duel: "adaptive", or "lru" (exact SGLang lru fallback)
    fallbacks: int = 0  # times the real cache fell back to exact lru
    cycle_clamped: int = 0  # LRU-cycle estimates cut at their bound
    shadow_rate: float = 0.0  # SHARDS sampling rate of the lru shadow (1.0: tree shadows)
    shadow_kind: str = ""  # "tree": the shadows replay SGLang's RadixCache exactly; "pages": sampled page model
    shadow_lru_hit_rate: float = 0.0  # lru shadow's hit rate on the sampled pages (recent)
    real_sampled_hit_rate: float = 0.0  # the real cache's hit rate on the same pages (recent)
    lru_model_bias: float = 0.0  # shadow minus real hit rate measured while following lru
    trials: int = 0  # switches from lru to slru/lfu tried first on a fork of the lru tree shadow
    trials_won: int = 0  # ... that came out ahead, so the real cache switched
    diverged_pages: int = 0  # pages SGLang's lru would hold now that this cache does not
    switch_back_price: float = 0.0  # what a switch back to lru may cost now (hits; the budget covers it)
    # the strict guarantee (SGLANG_TIERED_GUARANTEE=strict, the default: the divergence cap, or lru's
    # order itself where the server may batch); false and 0 where the cap cannot act (budget,
    # leader, page shadows above lru_tree_pages)
    strict_guarantee: bool = False
    max_in_flight: int = 1  # the most requests the server may run at once (SGLang's request pool)
    # strict on a server that may batch (max_in_flight > 1): lru's order itself, request for request
    burst_lru: bool = False
    cap_spared: int = 0  # victim leaves the cap passed over (their pages are SGLang lru's)
    cap_admitted: int = 0  # pages admitted that admission would have refused, to stay within the cap
    cap_over_pages: int = 0  # pages of lru's evicted beyond the cap (nothing else was evictable)
    cap_over_kept: int = 0  # ... that SGLang lru's cache still held after the same request (the bound's O)
    # back at lru's pages cut into other nodes: the cap stayed on until they were lru's nodes too
    unconverged_checks: int = 0
    # follow the leader (SGLANG_TIERED_GUARANTEE=leader): no bound against lru
    follow_leader: bool = False
    leader_switches: int = 0  # times the real cache switched to the order whose shadow led
    overlapped_requests: int = 0  # requests that started while another was in flight (lru then, strict)
    overlap_cut_pages: int = 0  # switch-back price charged to the budget for episodes an overlap cut short
    # paths SGLang touched without storing (a waiting request's refresh, a request released
    # unserved), replayed into the policy's tree shadows so that lru's yardstick stays SGLang's lru
    replayed_touches: int = 0
    # pages no-store requests stored back: lru's cache held them and this one did not (strict)
    restored_pages: int = 0


class IndexStats(msgspec.Struct, kw_only=True):
    """The fleet hint-index publisher (``SGLANG_TIERED_INDEX_URL``; rank 0 only)."""

    enabled: bool = False
    connected: bool = False
    published_pages: int = 0
    removed_pages: int = 0
    dropped_events: int = 0  # events dropped because the publish queue was full
    errors: int = 0  # failed Redis round trips (Redis down or slow); requests never wait on them
    batches: int = 0
    refreshes: int = 0
    queued_events: int = 0
    queued_pages: int = 0  # page hashes in the queued events (bounded: 2^20; past it events drop)
    held_pages: int = 0
    resyncs: int = 0  # a removal was dropped: every claim withdrawn and forgotten, published afresh


class CacheStats(msgspec.Struct, kw_only=True):
    """Response of ``GET /cache/stats[?tenant=]``."""

    schema_version: int = 1
    ranks: int = 0
    page_size: int = 0
    totals: TenantStats
    tiers: list[TierStats]
    policy: list[PolicyReport]
    tenants: dict[str, TenantStats]
    tenant: Optional[str] = None
    index: IndexStats = msgspec.field(default_factory=IndexStats)
    t2: T2TierStats = msgspec.field(default_factory=T2TierStats)


_COUNTERS = [f for f in TenantStats.__struct_fields__ if f not in ("token_hit_rate", "request_hit_rate")]


def _finish(t: dict) -> TenantStats:
    s = TenantStats(**{k: int(t.get(k, 0)) for k in _COUNTERS})
    s.token_hit_rate = s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0
    s.request_hit_rate = s.requests_hit / s.requests if s.requests else 0.0
    return s


def _label_of(tenant: str, hashed: bool, labels) -> str:
    """The row of tenant ``tenant`` (its name, its salt, or a label the stats show)."""
    from sglang_tiered.core.tenants import DEFAULT, SALT_PREFIX, salt_label, tenant_label

    if tenant.startswith(SALT_PREFIX) and tenant in labels:
        return tenant
    if hashed and tenant != DEFAULT:
        return salt_label(tenant)
    return tenant_label(tenant)


def aggregate(rank_stats: list[dict], tenant: Optional[str] = None, hashed: bool = False,
              confined: bool = False) -> CacheStats:  # fmt: skip
    """The ranks' stats summed; ``tenant``: only that tenant's row (``hashed``: tenants are
    labelled by their salt's digest, ``config.hashed_tenant_labels``). ``confined``: the view of a
    tenant's own call (``http.caller_tenant``): totals are its row's, and the server-wide sections
    (tiers, policy, index, T2) are left out; before session 37 its totals summed every tenant's
    traffic (a helper's audit)."""
    tenants: dict[str, dict] = {}
    tiers: dict[str, dict] = {}
    policies = []
    page_size = 0
    index = None
    t2 = T2TierStats()
    for rs in rank_stats:
        if rs.get("index"):
            d = rs["index"]
            if index is None:
                index = IndexStats(enabled=True)
            index.connected = index.connected or bool(d.get("connected"))
            for k in IndexStats.__struct_fields__:
                if k not in ("enabled", "connected") and isinstance(d.get(k), int):
                    setattr(index, k, getattr(index, k) + d[k])
        page_size = rs.get("page_size", page_size)
        for name, counters in rs.get("tenants", {}).items():
            acc = tenants.setdefault(name, {})
            for k in _COUNTERS:
                acc[k] = acc.get(k, 0) + counters.get(k, 0)
        for tier in rs.get("tiers", []):
            if tier["name"] == "t2":  # TP = 1 only: one rank reports it
                t2 = T2TierStats(**{k: v for k, v in tier.items() if k in T2TierStats.__struct_fields__})
                continue
            acc = tiers.setdefault(tier["name"], {"name": tier["name"], "enabled": False})
            acc["enabled"] = acc["enabled"] or tier.get("enabled", False)
            acc["decision"] = tier.get("decision", acc.get("decision", ""))
            if "store" in tier:
                acc["store"] = tier["store"]
            for k, v in tier.items():
                if isinstance(v, int) and not isinstance(v, bool):
                    acc[k] = acc.get(k, 0) + v
        if "policy" in rs:
            policies.append(PolicyReport(**{k: rs["policy"][k] for k in PolicyReport.__struct_fields__
                                           if k in rs["policy"]}))  # fmt: skip
    finished = {name: _finish(c) for name, c in sorted(tenants.items())}
    shown = tenants
    if tenant is not None:
        # a tenant's own call names itself by its name alone: a name that looks like a label
        # (``salt~`` and a digest, computable from another tenant's name) was given that label's
        # row (a helper's audit, session 40); the operator may name a row by its label
        label = _label_of(tenant, hashed, () if confined else finished)
        finished = {tenant: finished.get(label, TenantStats())}
        if confined:
            shown = {label: tenants[label]} if label in tenants else {}
    total: dict = {}
    for c in shown.values():
        for k in _COUNTERS:
            total[k] = total.get(k, 0) + c.get(k, 0)
    if confined:
        tiers, policies, index, t2 = {}, [], None, T2TierStats()
    return CacheStats(
        ranks=len(rank_stats),
        page_size=page_size,
        totals=_finish(total),
        tiers=[TierStats(**t) for t in tiers.values()],
        policy=policies,
        tenants=finished,
        tenant=tenant,
        index=index or IndexStats(),
        t2=t2,
    )
