"""The one checker (integration/invariants.py) is what SGLang's ``sanity_check`` and debug mode
run, and it is never a stub: a corrupted counter, lock or hash is caught."""

from __future__ import annotations

import pytest

from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

PAGE = 4


def _cache(**kw) -> TieredRadixCache:
    cache = TieredRadixCache.create_simulated(16 * PAGE, PAGE, host_pages=32, store_queue_pages=16, **kw)
    for i in range(12):
        cache.driver.run([1, 2, 3, 4] * 2 + [100 + i] * (2 * PAGE + 1))
    return cache


def test_sanity_check_passes_on_a_consistent_cache():
    _cache().sanity_check()


def test_sanity_check_catches_device_accounting_drift():
    cache = _cache()
    cache.evictable_size_ += PAGE
    with pytest.raises(AssertionError, match="T2 violated"):
        cache.sanity_check()


def test_sanity_check_catches_stale_page_hashes():
    cache = _cache()
    node = next(iter(cache.root_node.children.values()))
    node.tiered_hashes = [b"\0" * 16] * len(node.tiered_hashes)
    with pytest.raises(AssertionError, match="H1 violated"):
        cache.sanity_check()


def test_sanity_check_catches_a_lost_victim_queue_entry():
    cache = _cache()
    leaf = next(iter(cache.evictable_leaves))
    leaf.tiered_entry = None
    with pytest.raises(AssertionError, match="I1 violated"):
        cache.sanity_check()


def test_debug_mode_checks_after_every_operation():
    cache = _cache(debug_checks=True)
    cache.evictable_size_ += PAGE  # corrupt; the next operation's check must notice
    with pytest.raises(AssertionError):
        cache.driver.run([7] * (3 * PAGE))
