"""Review, session 40: the simulator against a live server. Served one at a time (greedy,
``max_new_tokens`` 8, ``ignore_eos``), a live SGLang 0.5.23 server's per-request cached tokens
differed from ``CacheDriver``'s on 14 of 200 requests (family-29's first 200, page 16, a pool of
1,024 tokens: 44.3 % live, 50.0 % simulated, lru and tiered alike): the driver finished every
request at its prefill, and a live server decodes, keeps what it decoded in the tree
(``release_kv_cache`` checkpoints the prompt and every output token but the last), evicts for a
free page at every decode step (``alloc_paged_token_slots_decode``) and a page more at the extend
(``alloc_paged_token_slots_extend``), and stops a match a token short of the prompt
(``_compute_max_prefix_len``). ``CacheDriver.run(output_ids=...)`` now runs a request so, and
replays the recorded servers' hits request for request."""

from __future__ import annotations

import json
from array import array
import pathlib
import sys

import pytest
from sglang.srt.mem_cache.radix_cache import RadixCache

from sglang_tiered.dev.simulate import CacheDriver, make_params

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "live_serial_hits.json"


def _lru(capacity: int, page: int) -> CacheDriver:
    params, alloc, pool = make_params(capacity, page, 1 << 12, eviction_policy="lru")
    return CacheDriver(RadixCache(params), alloc, pool)


def _tiered(capacity: int, page: int) -> CacheDriver:
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

    return TieredRadixCache.create_simulated(capacity, page).driver


@pytest.mark.parametrize("make", [_lru, _tiered], ids=["lru", "tiered"])
@pytest.mark.parametrize("page", [1, 16])
def test_decoded_tokens_stay_in_the_tree_but_the_last(make, page):
    d = make(256, page)
    prompt = list(range(100, 140))  # 40 tokens
    out = list(range(1000, 1008))  # max_new_tokens 8: the KV of 7 of them is computed
    d.run(prompt, output_ids=out)
    # as release_kv_cache leaves it: prompt + 7 outputs, the partial page freed
    kept = (40 + 7) // page * page
    assert d.cache.evictable_size() + d.cache.protected_size() == kept
    assert d.allocator.available_size() == d.allocator.size - kept
    # a later turn that extends the prompt (not this model's output) hits the prompt's pages
    o = d.run(prompt + list(range(500, 520)), max_prefix_len=59, output_ids=out[:1])
    assert o.cached_len == 40 // page * page
    # the same prompt and its output again: the match stops a token short of the prompt
    o = d.run(prompt + out[:7], max_prefix_len=46)
    assert o.cached_len == 46 // page * page


def _cached(d: CacheDriver, toks) -> int:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return d.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", toks), None))).device_prefix_len


def test_the_extend_and_each_decode_step_evict_for_a_free_page():
    """At page size 16 the extend evicts for its tokens and a page more, and a decode step until a
    page is free (``alloc_paged_token_slots_decode``), where the old driver evicted nothing here."""
    d = _lru(64, 16)  # 4 pages
    a, b, c = (list(range(100 + 16 * i, 116 + 16 * i)) for i in range(3))
    for toks in (a, b, c):
        d.run(toks)
    assert d.allocator.available_size() == 16  # one page free
    # 15 uncached tokens fit the free page; the extend evicts a's page for the page more, and the
    # third decode step (its second output page was taken by the second) evicts b's
    d.run(list(range(300, 315)), output_ids=[7, 8, 9, 10])
    assert (_cached(d, a), _cached(d, b), _cached(d, c)) == (0, 0, 16)
    old = _lru(64, 16)
    for toks in (a, b, c, list(range(300, 315))):
        old.run(toks)
    assert (_cached(old, a), _cached(old, b), _cached(old, c)) == (16, 16, 16)


def test_finished_at_prefill_is_the_replays_request():
    """``output_ids`` of one token (``max_new_tokens`` 1): nothing decoded, nothing more kept (a
    pool nothing is evicted from: the extend's page more is the only other difference)."""
    a, b = _lru(1024, 16), _lru(1024, 16)
    for i in range(6):
        toks = list(range(100 + 37 * i, 160 + 37 * i))
        assert a.run(toks).cached_len == b.run(toks, output_ids=[1]).cached_len
        assert a.device_accounting() == b.device_accounting()


def _recorded():
    return json.loads(DATA.read_text())


@pytest.mark.parametrize("run", _recorded()["runs"],
                         ids=lambda r: f"{r['workload']}-p{r['page']}-{r['backend']}-{r['guarantee'] or 'stock'}")
def test_replays_a_live_servers_hits(run):
    """The recorded runs (bench/live_fidelity.py): a live server's cached tokens, request for
    request, from the driver given the outputs that server generated; stock SGLang's, and the
    tiered server's (T1 off) at the strict default and following the leader (which left lru's
    order four times on this trace: 48.7 % where lru cached 44.3 %; 49.4 % since the lru shadow replays decode evictions, session 41: re-recorded)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from live_fidelity import load_workload, replay

    reqs = load_workload(run["workload"])
    guarantee = run["guarantee"] or "strict"
    hits = replay(reqs, run["backend"], run["page"], run["pool"], run["outputs"], guarantee)
    assert hits == run["cached"]
    # before, the driver's replay (every request finished at its prefill) did not
    assert replay(reqs, run["backend"], run["page"], run["pool"], None, guarantee) != run["cached"]
