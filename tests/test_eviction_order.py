"""Scripted eviction scenarios with exact expected order (vLLM ``test_prefill`` style), through
the adapter's public surface only: ``create_simulated``, ``driver.run``, ``match_prefix``,
``evict`` and ``eviction.next_victim``."""

from __future__ import annotations

from array import array

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from sglang_tiered.core.policy import PolicyConfig
from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

PAGE = 4
# Three prompts of two full pages (plus one token, so both pages can be matched), no shared prefix.
A, B, C = (array("q", [base + i for i in range(2 * PAGE + 1)]) for base in (100, 200, 300))


def make(mode: str, **cfg) -> TieredRadixCache:
    return TieredRadixCache.create_simulated(16 * PAGE, PAGE, PolicyConfig(force_mode=mode, **cfg), debug_checks=True)


def cached(cache, toks) -> int:
    """Tokens of ``toks`` the device holds (a match stamps recency, it never evicts)."""
    return cache.match_prefix(MatchPrefixParams(key=RadixKey(toks, None))).device_prefix_len


def evict_order(cache, prompts) -> list[str]:
    """Evict one prompt's worth (two pages) at a time; report which prompt went each time."""
    names = {id(p): n for n, p in zip("ABC", (A, B, C))}
    gone, order = set(), []
    for _ in prompts:
        cache.evict(EvictParams(num_tokens=2 * PAGE))
        # checked without touching the survivors' order: only prompts not yet gone are matched
        now = [p for p in prompts if id(p) not in gone and not _resident(cache, p)]
        assert len(now) == 1, f"expected exactly one prompt evicted, got {[names[id(p)] for p in now]}"
        gone.add(id(now[0]))
        order.append(names[id(now[0])])
    return order


def _resident(cache, toks) -> bool:
    node, key = cache.root_node, RadixKey(toks[: 2 * PAGE], None)
    return key.child_key(PAGE) in node.children


def test_evict_lru_takes_least_recently_used_first():
    cache = make("all+lru")
    for p in (A, B, C, A):
        cache.driver.run(p)
    assert cached(cache, A) == 2 * PAGE
    assert evict_order(cache, [A, B, C]) == ["B", "C", "A"]


def test_evict_slru_takes_reused_prompts_after_all_others():
    cache = make("all+slru")
    for p in (A, A, B, C):  # A is reused (2 requests), and now the least recently used
        cache.driver.run(p)
    assert evict_order(cache, [A, B, C]) == ["B", "C", "A"]


def test_evict_adaptive_takes_pinned_hot_prefix_last():
    cache = make("all+adaptive", pin_min_freq=2, pin_max_tokens=2 * PAGE, pin_budget_share=0.5)
    for p in (A, A, A, B, C):  # A: hot, short (within pin_max_tokens), least recently used
        cache.driver.run(p)
    victim = cache.eviction.next_victim()
    assert victim is not None and list(victim.key.token_ids[:1]) == [A[0]]  # first in LRU order ...
    assert evict_order(cache, [A, B, C]) == ["B", "C", "A"]  # ... but pinned: evicted last


def test_evict_adaptive_without_pinning_is_lru():
    cache = make("all+adaptive", pin_min_freq=99, pin_budget_share=0.5)
    for p in (A, A, A, B, C):
        cache.driver.run(p)
    assert evict_order(cache, [A, B, C]) == ["A", "B", "C"]
