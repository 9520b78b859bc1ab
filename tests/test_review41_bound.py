"""The bound against SGLang's lru on decoding replays (session 41, a helper's hunt).

The simulator decodes (``CacheDriver.decode``, ``bench/trace_replay.py`` ``output_tokens``):
SGLang's extend evicts for a page more than the prompt's tokens (page size over 1), each decode
step evicts until a page is free while the prompt's path is locked, and the release inserts the
decoded tokens' full pages. The duel's lru tree shadow replayed none of it: it evicted only for
the decoded pages, at the release, in one go, so on decoding replays it held pages SGLang's lru
had evicted, and the budget's books, kept against it, showed losses that were not there (the
real cache pinned to lru, exactly SGLang's lru: margin -48 pages on family 105 at 5 % with 256
output tokens, -17 on family 15 at 2 % with 128; page size 16). ``TreeShadow.run`` now replays
them (``reserve``, ``decode``), fed by the admission (``_decide``) at the request's prefill and
release; the digests of prefill-only replays (tests/test_bookkeeping_digest.py) are unchanged.
"""

from __future__ import annotations

import hashlib

import pytest

from sglang_tiered.core.keys import chain_page_hashes
from sglang_tiered.core.shadows import TreeShadow


def _family(seed, frac, out, page, n=300):
    from sglang_tiered.dev import workload_family as wf

    reqs = wf.generate(wf.draw(seed))[:n]
    seeds = {r.tenant: hashlib.blake2b((r.tenant or "").encode(), digest_size=16).digest() for r in reqs}
    pages = {h for r in reqs for h in chain_page_hashes(seeds[r.tenant], r.tokens, page)}
    cap = max(int(len(pages) * frac), max(-(-(len(r.tokens) + out) // page) for r in reqs) + 2)
    return reqs, seeds, cap


@pytest.mark.parametrize("seed,frac,out,page", [(105, 0.05, 256, 16), (15, 0.02, 128, 16), (72, 0.005, 100, 16),
                                                (60, 0.01, 64, 1)])  # fmt: skip
def test_tree_shadow_is_sglangs_lru_on_decoding_replays(seed, frac, out, page):
    """Per request, the lru tree shadow fed as the admission feeds it (the prompt at its prefill,
    ``reserve`` 1 at page size over 1, then the release's ``decode``) hits what SGLang's lru
    RadixCache hits, driven with ``output_ids`` (``CacheDriver.decode``)."""
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from bench.trace_replay import generated_ids
    from sglang_tiered.dev.simulate import CacheDriver, make_params

    reqs, seeds, cap = _family(seed, frac, out, page)
    params, alloc, pool = make_params(cap * page, page, 1 << 17, eviction_policy="lru")
    drv = CacheDriver(RadixCache(params), alloc, pool)
    sh = TreeShadow(cap, "lru")
    diff = []
    for i, r in enumerate(reqs):
        outs = generated_ids(r.tokens, r.tenant, out)
        want = drv.run(r.tokens, tenant=r.tenant, max_prefix_len=len(r.tokens) - 1, output_ids=outs).cached_len // page
        n = len(r.tokens)
        prompt = chain_page_hashes(seeds[r.tenant], r.tokens, page)
        got = sh.run(prompt, tail=int(n % page > 0), limit=(n - 1) // page, reserve=int(page > 1))
        k = len(outs) - 1
        whole = chain_page_hashes(seeds[r.tenant], list(r.tokens) + outs[:k], page)
        sh.run(whole, start=len(prompt), decode=(n, k, page))
        sh.check()
        if got != want:
            diff.append((i, want, got))
    assert not diff, diff[:5]


@pytest.mark.parametrize("seed,frac,out", [(105, 0.05, 256), (15, 0.02, 128)])
def test_books_are_exact_while_the_real_cache_is_lru_on_decoding_replays(seed, frac, out):
    """The real tiered cache kept on lru (no room ever earned) is SGLang's lru on a decoding
    replay, and so is the lru tree shadow: the budget's margin and the lru bias stay exactly 0
    (before session 41: -48 and -17 pages, the shadow's missed decode evictions)."""
    from bench.trace_replay import generated_ids, sglang_driver
    from sglang_tiered.core.policy import PolicyConfig
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

    page = 16
    reqs, _, cap = _family(seed, frac, out, page)
    cfg = PolicyConfig(guard_entry_room=1e12, guard_order_room=1e12)
    cache = TieredRadixCache.create_simulated(cap * page, page, policy_config=cfg)
    lru = sglang_driver(cap * page, "lru")
    pol = cache.policy
    assert pol._tree
    for r in reqs:
        kw = dict(tenant=r.tenant, max_prefix_len=len(r.tokens) - 1, output_ids=generated_ids(r.tokens, r.tenant, out))
        assert cache.driver.run(r.tokens, **kw).cached_len == lru.run(r.tokens, **kw).cached_len
    assert pol.following == "lru" and pol._refs > 0
    assert pol._margin == 0.0 and pol._bias["lru"][0] == 0.0, (pol._margin, pol._bias["lru"])
    pol.check_invariants()
    cache.check_invariants()
