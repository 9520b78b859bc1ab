"""Prometheus metrics (``sglang_tiered_*``) under SGLang's ``--enable-metrics``.

Published from the scheduler (TP rank 0 of each replica) into prometheus_client's multiprocess
directory, which SGLang's ``/metrics`` already aggregates. Counters advance by deltas of our own
counters; gauges use ``livesum`` so data-parallel replicas add up. The tenant label set is bounded
(``MAX_TENANT_LABELS``; later tenants report as ``__other__``).
"""

from __future__ import annotations

from sglang_tiered.core.tenants import OTHER

MAX_TENANT_LABELS = 32
COUNTERS = {
    "requests": "Requests released by the cache, by tenant",
    "requests_hit": "Requests that reused at least one cached token, by tenant",
    "prompt_tokens": "Prompt tokens seen, by tenant",
    "cached_tokens": "Prompt tokens served from the cache, by tenant",
    "admitted_pages": "Pages admitted into the device tier, by tenant",
    "rejected_pages": "Pages the admission policy declined, by tenant",
    "evicted_pages": "Pages evicted from the device tier, by tenant",
    "invalidated_pages": "Pages dropped by /cache/invalidate, by tenant",
    "no_store_requests": "Requests with a no-store hint (kv_transfer_params lmcache.skip_save), by tenant",
    "promoted_pages": "Pages promoted from the host tier (T1) into the device tier, by tenant",
    "requeued_requests": "Requests admitted again after SGLang released them unfinished (decode retraction, "
                         "priority preemption), by tenant",
}


class TieredMetrics:
    def __init__(self, registry=None):
        from prometheus_client import Counter, Gauge

        kw = {} if registry is None else {"registry": registry}  # (tests: their own registry)
        self.counters = {
            k: Counter(f"sglang_tiered_{k}", doc, ["tenant"], **kw) for k, doc in COUNTERS.items()
        }
        self.resident = Gauge("sglang_tiered_resident_pages", "Pages resident per tier and tenant",
                              ["tier", "tenant"], multiprocess_mode="livesum", **kw)  # fmt: skip
        self.tier_tokens = Gauge("sglang_tiered_tier_tokens", "Evictable/protected tokens per tier",
                                 ["tier", "state"], multiprocess_mode="livesum", **kw)  # fmt: skip
        self.filtering = Gauge("sglang_tiered_admission_filtering", "1 while TinyLFU admission is on",
                               multiprocess_mode="livemax", **kw)  # fmt: skip
        self.thrashing = Gauge("sglang_tiered_thrashing", "1 while thrash is detected",
                               multiprocess_mode="livemax", **kw)  # fmt: skip
        self.protection_k = Gauge("sglang_tiered_protection_k", "Learned protection of reused context "
                                  "(0 = LRU; reused nodes age k LRU cycles later)", multiprocess_mode="livemax", **kw)  # fmt: skip
        self.cold_age_c = Gauge("sglang_tiered_cold_age_c", "Learned age, in LRU cycles, at which cold "
                                "prompts enter", multiprocess_mode="livemax", **kw)  # fmt: skip
        self.store_depth = Gauge("sglang_tiered_store_queue_pages", "Pages waiting in the T1 store queue",
                                 multiprocess_mode="livesum", **kw)  # fmt: skip
        self.store_pages = Counter("sglang_tiered_store_pages", "T1 store queue outcomes, in pages "
                                   "(stored by the worker, inline, value_dropped, filtered, cancelled)", ["outcome"], **kw)  # fmt: skip
        self.t2_pages = Counter("sglang_tiered_t2_pages", "T2 (fleet store) outcomes, in pages (fetched, "
                                "stored, dropped, filtered, bad)", ["outcome"], **kw)  # fmt: skip
        self.t2_bytes = Counter("sglang_tiered_t2_bytes", "Bytes moved to and from T2", ["direction"], **kw)
        self.t2_failures = Counter("sglang_tiered_t2_failures", "T2 calls that failed or missed their deadline", **kw)
        self.t2_up = Gauge("sglang_tiered_t2_available", "1 while T2 is in use (0: breaker open)",
                           multiprocess_mode="livemin", **kw)  # fmt: skip
        self._last: dict[tuple[str, str], int] = {}
        self._labels: dict[str, str] = {}

    def _label(self, tenant: str) -> str:
        lab = self._labels.get(tenant)
        if lab is None:
            lab = tenant if len(self._labels) < MAX_TENANT_LABELS else OTHER
            self._labels[tenant] = lab
        return lab

    def _inc(self, counter, key: tuple, value: int) -> None:
        if value > self._last.get(key, 0):
            counter.inc(value - self._last.get(key, 0))
        self._last[key] = value

    def _publish_t2(self, t2) -> None:
        st = t2.stats
        for outcome, v in (("fetched", st.fetched_pages), ("stored", st.stored_pages),
                           ("dropped", t2.dropped_pages),
                           ("filtered", st.filtered_pages), ("bad", st.bad_pages)):  # fmt: skip
            self._inc(self.t2_pages.labels(outcome=outcome), ("__t2__", outcome), v)
        self._inc(self.t2_bytes.labels(direction="read"), ("__t2__", "read"), st.fetched_bytes)
        self._inc(self.t2_bytes.labels(direction="write"), ("__t2__", "write"), st.stored_bytes)
        self._inc(self.t2_failures, ("__t2__", "failures"), st.failures)
        self.t2_up.set(1 if t2.up else 0)

    def publish(self, cache) -> None:
        resident: dict[str, int] = {}
        for tenant, c in cache.tenants.by_name.items():
            lab = self._label(tenant)
            for k in COUNTERS:
                v = getattr(c, k)
                key = (tenant, k)
                delta = v - self._last.get(key, 0)
                if delta > 0:
                    self.counters[k].labels(tenant=lab).inc(delta)
                self._last[key] = v
            resident[lab] = resident.get(lab, 0) + c.resident_pages
        for lab, v in resident.items():
            self.resident.labels(tier="device", tenant=lab).set(v)
        self.tier_tokens.labels(tier="device", state="evictable").set(cache.evictable_size_)
        self.tier_tokens.labels(tier="device", state="protected").set(cache.protected_size_)
        self.filtering.set(1 if cache.policy.filtering else 0)
        self.thrashing.set(1 if cache.policy.thrashing else 0)
        self.protection_k.set(min(cache.policy.k, 1e9))
        self.cold_age_c.set(cache.policy.c)
        store = getattr(cache, "store", None)
        if store is not None:
            st = store.stats
            self.store_depth.set(st.queued_pages)
            for outcome in ("stored", "inline", "value_dropped", "filtered", "cancelled"):
                v = getattr(st, f"{outcome}_pages")
                key = ("__store__", outcome)
                if v > self._last.get(key, 0):
                    self.store_pages.labels(outcome=outcome).inc(v - self._last.get(key, 0))
                self._last[key] = v
        t1 = getattr(cache, "t1", None)
        if t1 is not None and t1.host.t2 is not None:
            self._publish_t2(t1.host.t2)
