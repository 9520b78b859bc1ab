"""Session 42 (issue #11, bookkeeping): ``tree_ops.checkpoint`` writes into a request's row only
the part of ``[cache_protected_len, key_len)`` that can change, ``[cache_protected_len,
prefix_len)`` (pages another request inserted meanwhile), and a node its insert creates takes the
checkpoint's fresh copy of the indices without SGLang's second clone. SGLang writes the whole
range; the nodes the insert created hold the row's own indices there, so the row must come out
the same: the tree's indices along the request's path, with requests in flight together
(duplicates inserted by the first to finish), chunked prefills, decodes (the prompt-boundary
split) and real KV bytes checked on every hit (``verify_kv``)."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

PAGE = 4
PREFIXES = [list(range(100, 100 + 3 * PAGE)), list(range(200, 200 + 5 * PAGE + 2)), []]


def _row_is_tree_path(cache, f) -> None:
    req = f.req
    cpl = req.kv.cache_protected_len
    row = cache.driver.req_pool.req_to_token[f.row, :cpl]
    assert torch.equal(row, cache.path_device_indices(req.last_node)), (req.rid, cpl)


requests = st.lists(
    st.tuples(st.sampled_from(range(len(PREFIXES))), st.integers(0, 3), st.integers(0, 2 * PAGE + 1),
              st.integers(0, 6), st.booleans()),
    min_size=1, max_size=25,
)  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests, data=st.data(), in_flight=st.sampled_from([1, 4]))
def test_checkpoint_row_is_the_trees_indices(reqs, data, in_flight):
    cache = TieredRadixCache.create_simulated(64 * PAGE, PAGE, verify_kv=True, max_in_flight=in_flight)
    drv = cache.driver
    flying = []
    for p, tail_seed, tail_len, decode, chunk in reqs:
        toks = PREFIXES[p] + [1000 + tail_seed * 50 + i for i in range(tail_len)]
        if not toks:
            toks = [7]
        f = drv.begin(toks)
        if not hasattr(f, "req"):  # (not served: too big for the pool now)
            continue
        if chunk and f.n > PAGE:
            drv.checkpoint_chunk(f, f.n // 2)
            _row_is_tree_path(cache, f)
        if decode:
            drv.decode(f, [3000 + i for i in range(decode)])
            _row_is_tree_path(cache, f)
        flying.append(f)
        # finish some of those in flight, in any order (later ones meet what earlier ones stored)
        while flying and data.draw(st.booleans()):
            g = flying.pop(data.draw(st.integers(0, len(flying) - 1)))
            cpl_before = g.req.kv.cache_protected_len
            cache.checkpoint(g.req, up_to=g.kv_len or g.n)
            assert g.req.kv.cache_protected_len >= cpl_before
            _row_is_tree_path(cache, g)
            drv.end(g)
            cache.check_invariants()
    for g in flying:
        drv.end(g)
    cache.check_invariants()
