"""T2 removes an invalidated generation's objects now and once more after the lease. The second
removal's pattern is the one made at the invalidation, sparing only the generation moved to then:
when a later invalidation has moved the tenant on (an 'all' after a tenant's, or a tenant's after
an 'all'), it removes the objects of the tenant's *current* generation, which this server and its
peers just wrote and still read (T2 hits lost fleet-wide, a lease after every such pair)."""
import threading
import time

import pytest
import torch

from sglang_tiered.tier.host_pool import HostPool, PoolLayout
from sglang_tiered.tier.t2 import T2Tier
from sglang_tiered.tier.t2_config import T2Config
from tests.test_t2 import ByteStore

LAY = PoolLayout(num_pages=8, layers=2, kv_heads=2, page_size=4, head_dim=4, dtype="float32")


def _tier():
    cfg = T2Config(master="127.0.0.1:1", queue_pages=16, max_run_pages=4, timeout_ms=50, min_gbps=1.0, lease_ms=1)
    return T2Tier(ByteStore(), HostPool(LAY), threading.RLock(), cfg=cfg, model_tag="m")


def _write_current(t2, tenant, n=3):
    """What the fleet writes after the invalidations: pages of ``tenant`` at its current generation."""
    keys = [t2.key(i.to_bytes(2, "little") * 8, tenant) for i in range(n)]
    for k in keys:
        t2.client.objects[k] = b"page"
    return keys


@pytest.mark.parametrize("order", ["all_then_tenant", "tenant_then_all"])
def test_retry_spares_the_current_generation(order):
    t2 = _tier()
    try:
        if order == "all_then_tenant":
            t2.invalidate(everything=True)
            t2.invalidate(tenant=7)
        else:
            t2.invalidate(tenant=7)
            t2.invalidate(everything=True)
        assert t2.wait_removals()
        keys = _write_current(t2, 7)
        time.sleep(t2._lease_s() + 0.5)  # the retries run
        assert t2.wait_removals()
        gone = [k for k in keys if k not in t2.client.objects]
        assert not gone, f"{len(gone)} of {len(keys)} objects of tenant 7's current generation removed"
    finally:
        t2.close()


@pytest.mark.parametrize("order", ["all_then_tenant", "tenant_then_all", "tenant"])
def test_retry_still_removes_older_generations(order):
    t2 = _tier()
    try:
        old = {t: _write_current(t2, t) for t in (7, 8)}  # generation 0, before any invalidation
        if order != "tenant_then_all":
            t2.invalidate(everything=True) if order == "all_then_tenant" else None
            t2.invalidate(tenant=7)
        else:
            t2.invalidate(tenant=7)
            t2.invalidate(everything=True)
        assert t2.wait_removals()
        for t, keys in old.items():  # a read kept them leased: the first removal missed them
            for k in keys:
                t2.client.objects[k] = b"page"
        time.sleep(t2._lease_s() + 0.5)
        assert t2.wait_removals()
        left = [k for t, keys in old.items() for k in keys if k in t2.client.objects]
        want_left = old[8] if order == "tenant" else []  # tenant 8 was never invalidated there
        assert left == want_left
    finally:
        t2.close()
