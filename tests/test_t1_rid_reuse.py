"""A T1 probe belongs to one request's tokens, namespace and life (session 17 review finding).

SGLang rejects duplicate rids only while both are live, so a client may reuse a rid once the first
request is gone; a request aborted while waiting is finished with ``release_aborted_request``,
never released. Before the fix, the aborted request's probe (its T1 pages after a device match
at the root, which every tenant shares) was reused by the later request with the same rid, other
tokens and another tenant, and loaded back as that request's prefix: another tenant's KV.
"""

from __future__ import annotations

from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, CacheRequestOutcome, EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from sglang_tiered.dev.simulate import SimReq
from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

PAGE = 4


def _probed_and_left(cache, rid: str, tokens: list, tenant: str) -> None:
    """``rid`` matched (T1 hit probed) and never admitted or released."""
    req = SimReq(rid, tokens, cache_salt=tenant)
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(req.origin_input_ids, None, cache_salt=tenant), req=req))
    assert m.host_hit_length == 3 * PAGE


def _alice_in_t1_only():
    cache = TieredRadixCache.create_simulated(16 * PAGE, PAGE, host_pages=32, verify_kv=True)
    a = list(range(100, 100 + 3 * PAGE)) + [1]
    cache.driver.run(a, tenant="alice")
    cache.evict(EvictParams(num_tokens=16 * PAGE))  # alice's run lives in T1 only
    return cache, a


def test_a_left_probe_is_never_another_requests_prefix():
    cache, a = _alice_in_t1_only()
    _probed_and_left(cache, "sim-2", a, "alice")
    cache.driver._n = 1  # the driver's next request is "sim-2": bob reuses the rid
    b = list(range(500, 500 + 3 * PAGE)) + [2]
    out = cache.driver.run(b, tenant="bob")  # verify_kv: every hit equals recomputation
    assert out.cached_len == 0
    cache.check_invariants()


def test_an_aborted_request_leaves_no_probe():
    cache, a = _alice_in_t1_only()
    _probed_and_left(cache, "r-1", a, "alice")
    assert "r-1" in cache.t1.pending
    cache.finish(CacheRequestHandle(rid="r-1", attempt_id=0), CacheRequestOutcome.ABORT)
    assert "r-1" not in cache.t1.pending
    assert cache.driver.run(a, tenant="alice").cached_len == 3 * PAGE  # alice's own pages still load
