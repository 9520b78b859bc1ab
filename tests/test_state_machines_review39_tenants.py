"""Hypothesis state machines (review, session 39): ``TenantTable`` (core/tenants.py) and
``TieredMetrics`` (integration/metrics.py) against a model of each tenant's own counts.

TenantTable:
  N1 bounded: ``by_name`` <= max_tenants + 1 rows, ``by_hash`` <= max_tenants, ``_labels`` <=
     4 max_tenants + 4, every label <= 81 characters;
  N2 isolation: a tenant tracked by name has a row of its own, holding exactly its own counts
     (nothing of another tenant's); tenants past the bound share ``__other__`` only;
  N3 ``by_hash`` maps each tracked tenant's tier tag (``tenant_tag(salt)``) to its row,
     so T1's per-tenant counts (``Invalidation._count_t1``) land on the right row;
  N4 ``totals()`` is the sum of every tenant's counts.
TieredMetrics:
  M1 each Prometheus counter's sum over tenant labels == the table's totals (no drift, however
     often it publishes), the resident gauge's sum == the table's resident pages;
  M2 at most MAX_TENANT_LABELS + 1 tenant label values.
"""

from __future__ import annotations

import os

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sglang_tiered.core.tenants import OTHER, TenantCounters, TenantTable, tenant_tag
from sglang_tiered.integration import metrics as M

settings.register_profile("review39", max_examples=120, stateful_step_count=50, deadline=None)
settings.register_profile("review39-deep", max_examples=800, stateful_step_count=60, deadline=None)
PROFILE = settings.get_profile(os.environ.get("REVIEW39_PROFILE", "review39"))

# salts: untagged, short names, a long one, a non-ASCII one, one with '~', one like a made label,
# and the reserved names: a salt 'default' or '__other__' is a tenant of its own (session 40: it
# shared the untagged tenant's tier tag and, with raw labels, its row or the folded tenants' row)
SALTS = [None, "", "a", "b", "c", "d", "e", "x" * 100, "caf\u00e9", "t~1", "salt~0123456789abcdef", "\ud800",
         "default", "__other__"]
FIELDS = ["requests", "prompt_tokens", "admitted_pages", "evicted_pages", "invalidated_pages"]
MAX = 3


def tenant_key(salt, hashed):
    """Who a salt is: untagged requests ('' or None) are one tenant, every salt another."""
    return salt or None


class TenantTableMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.table = None
        self.own: dict = {}  # tenant key -> its counts (model)
        self.folded = TenantCounters()  # model: counts of tenants folded into __other__
        self.row_of: dict = {}  # tenant key -> the row object it was first given

    @rule(hashed=st.booleans())
    @precondition(lambda self: self.table is None)
    def build(self, hashed):
        self.table = TenantTable(max_tenants=MAX, hashed=hashed)

    @rule(salt=st.sampled_from(SALTS), field=st.sampled_from(FIELDS), n=st.integers(1, 5))
    @precondition(lambda self: self.table is not None)
    def count(self, salt, field, n):
        t = self.table
        row = t.for_salt(salt)
        key = tenant_key(salt, t.hashed)
        first = self.row_of.setdefault(key, row)
        assert first is row, "N2: a tenant's row changed"
        setattr(row, field, getattr(row, field) + n)
        label = t.label(salt)
        if t.by_name.get(label) is row and label != OTHER:
            c = self.own.setdefault(key, TenantCounters())
        else:
            c = self.folded
        setattr(c, field, getattr(c, field) + n)

    @rule(salt=st.sampled_from(SALTS), n=st.integers(1, 5))
    @precondition(lambda self: self.table is not None)
    def t1_invalidated(self, salt, n):
        """T1 dropped ``n`` pages of ``salt``'s tenant (``Invalidation._count_t1``'s lookup)."""
        t = self.table
        label = t.by_hash.get(tenant_tag(salt))
        key = tenant_key(salt, t.hashed)
        if label is None:
            assert key not in self.own, ("N3: a tracked tenant's T1 counts are lost", salt)
            return
        assert key in self.own and t.by_name[label] is self.row_of[key], \
            ("N3: T1 counts of one tenant land on another's row", salt, label)
        t.get(label).invalidated_pages += n
        self.own[key].invalidated_pages += n

    @invariant()
    def rows(self):
        t = self.table
        if t is None:
            return
        assert len(t.by_name) <= MAX + 1 and len(t.by_hash) <= MAX and len(t._labels) <= 4 * MAX + 4, "N1"
        assert all(len(lab) <= 81 for lab in t.by_name), "N1"
        rows = [self.row_of[k] for k in self.own]
        assert len({id(r) for r in rows}) == len(rows), "N2: two tenants share a row"
        for k, c in self.own.items():
            assert self.row_of[k].as_dict() == c.as_dict(), ("N2: a row holds others' counts", k)
        other = t.by_name.get(OTHER)
        if other is not None:
            assert other.as_dict() == self.folded.as_dict(), "N2: __other__"
        total = TenantCounters()
        for c in list(self.own.values()) + [self.folded]:
            for f, v in c.as_dict().items():
                setattr(total, f, getattr(total, f) + v)
        assert t.totals().as_dict() == total.as_dict(), "N4"


TenantTableMachine.TestCase.settings = PROFILE
TestTenantTable = TenantTableMachine.TestCase


class FakeCache:
    def __init__(self):
        from types import SimpleNamespace

        self.tenants = TenantTable(max_tenants=64)
        self.evictable_size_ = self.protected_size_ = 0
        self.policy = SimpleNamespace(filtering=False, thrashing=False, k=1.0, c=0.0)
        self.store = self.t1 = None


class MetricsMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry()
        self.metrics = M.TieredMetrics(registry=self.registry)
        self.cache = FakeCache()

    @rule(i=st.integers(0, 40), field=st.sampled_from(list(M.COUNTERS)), n=st.integers(1, 7))
    def count(self, i, field, n):
        c = self.cache.tenants.for_salt(f"tenant-{i}")
        setattr(c, field, getattr(c, field) + n)

    @rule(i=st.integers(0, 40), delta=st.integers(-5, 5))
    def resident(self, i, delta):
        c = self.cache.tenants.for_salt(f"tenant-{i}")
        c.resident_pages = max(0, c.resident_pages + delta)

    @rule()
    def flush(self):
        for c in self.cache.tenants.by_name.values():
            c.resident_pages = 0  # TieredRadixCache.reset

    @rule()
    def publish(self):
        self.metrics.publish(self.cache)
        tot = self.cache.tenants.totals()
        labels = set()
        for k in M.COUNTERS:
            s = 0.0
            for metric in self.registry.collect():
                if metric.name != f"sglang_tiered_{k}":
                    continue
                for sample in metric.samples:
                    if sample.name.endswith("_total"):
                        s += sample.value
                        labels.add(sample.labels["tenant"])
            assert s == getattr(tot, k), ("M1", k, s, getattr(tot, k))
        g = sum(sm.value for m in self.registry.collect() if m.name == "sglang_tiered_resident_pages"
                for sm in m.samples)  # fmt: skip
        assert g == tot.resident_pages, ("M1: resident gauge", g, tot.resident_pages)
        assert len(labels) <= M.MAX_TENANT_LABELS + 1, "M2"


MetricsMachine.TestCase.settings = PROFILE
TestMetrics = MetricsMachine.TestCase
