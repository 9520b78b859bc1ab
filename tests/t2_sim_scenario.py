"""Two simulated caches sharing one Mooncake master (run inside a loopback-only namespace by
tests/test_t2.py): B gets T2 hits on prefixes only A computed, with the KV checked against
recomputation; another tenant and a changed weights digest get none; the master killed -> every
request is served by recomputation within a bounded delay. Writes a JSON report to argv[1]."""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
import pathlib

from sglang_tiered.core.keys import CacheKey
from sglang_tiered.integration.t2_setup import attach_t2
from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache
from sglang_tiered.tier.t2_config import parse_t2_url
from tests.netns import start_master

PORT = 50061


def make_cache(key: CacheKey, url: str):
    c = TieredRadixCache.create_simulated(512, page_size=16, cache_key=key, host_pages=64, verify_kv=True,
                                          debug_checks=True)  # fmt: skip
    attach_t2(c, parse_t2_url(url))
    return c


def run(cache, prompts, tenant):
    host0 = cache.driver.host_loaded_tokens
    outs = [cache.driver.run(p, tenant=tenant) for p in prompts]
    assert all(o.served for o in outs)
    return {"cached": sum(o.cached_len for o in outs), "prompt": sum(o.prompt_len for o in outs),
            "from_t1": cache.driver.host_loaded_tokens - host0}  # fmt: skip


def main(out_path: str) -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(1, 30000) for _ in range(320)] for _ in range(12)]
    tmp = pathlib.Path(tempfile.mkdtemp())
    master = start_master(PORT, tmp / "master.log", lease_ms=1200)  # (timeout_ms < lease_ms / 2)
    url = f"mooncake://127.0.0.1:{PORT}?segment_mb=64&buffer_mb=16&mode=on&min_freq=1&timeout_ms=500&lease_ms=1200"
    key = CacheKey(model_id="sim", weights_digest="w1", kv_dtype="float32")
    report: dict = {}
    try:
        a = make_cache(key, url)
        report["a_first"] = run(a, prompts, "acme")  # 12 x 20 pages > 32 device + 64 T1 pages
        assert a.t1.host.t2.wait_idle(30)
        report["a_t2"] = a.t1.host.t2.snapshot()
        b = make_cache(key, url)
        report["b_same_tenant"] = run(b, prompts, "acme")
        report["b_t2"] = b.t1.host.t2.snapshot()
        c = make_cache(key, url)
        report["c_other_tenant"] = run(c, prompts, "globex")
        report["c_t2"] = c.t1.host.t2.snapshot()
        d = make_cache(CacheKey(model_id="sim", weights_digest="w2", kv_dtype="float32"), url)
        report["d_changed_weights"] = run(d, prompts, "acme")
        report["d_t2"] = d.t1.host.t2.snapshot()
        # invalidation: A removes tenant acme's pages fleet-wide; a fresh E then finds none
        from sglang_tiered.core.tenants import name_hash

        time.sleep(1.3)  # objects read above are leased for lease_ms (1,200 in this test)
        a.t1.host.t2.invalidate(tenant=name_hash("acme"))
        a.t1.host.t2.wait_removals()  # (removals run off the scheduler thread)
        report["invalidate_removed"] = a.t1.host.t2.stats.removed_objects
        e = make_cache(key, url)
        report["e_after_invalidate"] = run(e, prompts, "acme")
        # the master dies: B keeps serving (recomputes), each request delayed by at most the deadline
        master.kill()
        master.wait()
        t0 = time.perf_counter()
        report["b_master_down"] = run(b, [[rng.randrange(1, 30000) for _ in range(320)] for _ in range(4)] + prompts[:4], "acme")
        report["b_master_down_s"] = time.perf_counter() - t0
        report["b_t2_down"] = b.t1.host.t2.snapshot()
        report["ok"] = True
    finally:
        if master.poll() is None:
            master.kill()
        pathlib.Path(out_path).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main(sys.argv[1])
