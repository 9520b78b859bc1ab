"""Salt mode (no tenant header): a client's ``cache_salt`` literally named ``default`` or
``__other__`` (a helper's audit, session 40). Its KV was always its own (the chain seed keeps
salt ``"default"`` apart from no salt), but its stats row was the untagged tenant's (raw labels)
or the folded tenants' ``__other__`` row, and its T1 pages carried the untagged tenant's tier tag,
so T1 pages one of them lost to an invalidation were counted on the other's row."""

from __future__ import annotations

import pytest

from sglang_tiered.core.tenants import DEFAULT, OTHER, TenantTable, name_hash, tenant_tag


def _sim(page, hashed):
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

    cache = TieredRadixCache.create_simulated(24 * page, page, host_pages=64, debug_checks=True)
    cache.tenants.hashed = hashed
    return cache


@pytest.mark.parametrize("hashed", [False, True])
def test_reserved_salts_have_rows_of_their_own(hashed):
    table = TenantTable(max_tenants=2, hashed=hashed)
    untagged, salted = table.for_salt(None), table.for_salt(DEFAULT)
    assert untagged is not salted, "salt 'default' shares the untagged tenant's row"
    assert table.label(None) == DEFAULT and table.label(DEFAULT) != DEFAULT
    table.for_salt("a")  # the table is full: later tenants fold into __other__
    folded = table.for_salt("b")
    assert folded is table.by_name[OTHER]
    table2 = TenantTable(max_tenants=4, hashed=hashed)
    assert table2.label(OTHER) != OTHER, "salt '__other__' is labelled like the folded tenants' row"
    assert table2.for_salt(OTHER) is not table2.get(OTHER)


def test_a_reserved_salt_has_a_tier_tag_of_its_own():
    assert tenant_tag(None) == tenant_tag("") == name_hash(DEFAULT)
    assert tenant_tag(DEFAULT) != name_hash(DEFAULT)
    assert tenant_tag("acme") == name_hash("acme") and tenant_tag(OTHER) == name_hash(OTHER)


@pytest.mark.parametrize("hashed", [False, True])
def test_salt_default_and_untagged_share_no_kv_and_keep_their_counts_apart(hashed):
    page = 16
    cache = _sim(page, hashed)
    prompt = list(range(6 * page))
    cache.driver.run(prompt, tenant=None)
    assert cache.driver.run(prompt, tenant=DEFAULT).cached_len == 0, "salt 'default' hit untagged KV"
    assert cache.driver.run(prompt, tenant=None).cached_len > 0
    for i in range(40):  # push both into T1
        for t in (None, DEFAULT):
            cache.driver.run([1000 * (i % 20) + j for j in range(6 * page)], tenant=t)
    untagged, salted = cache.tenant(None), cache.tenant(DEFAULT)
    assert untagged is not salted
    host = cache.host.tenant_pages()
    assert host.get(tenant_tag(None), 0) > 0 and host.get(tenant_tag(DEFAULT), 0) > 0
    before = (untagged.invalidated_pages, salted.invalidated_pages)
    tree = {t: sum(len(c.key) for c in cache.root_node.children.values() if (c.key.cache_salt or None) == t)
            for t in (None, DEFAULT)}  # fmt: skip
    # {"tenant": "default"} names the untagged requests and a salt literally 'default' alike:
    # both are dropped (never fewer: an operator meaning either must not keep stale KV)
    res = cache.invalidate(tenant_hash=name_hash(DEFAULT))
    got_u = untagged.invalidated_pages - before[0]
    got_s = salted.invalidated_pages - before[1]
    assert got_u * page == host[tenant_tag(None)] * page + tree[None]
    assert got_s * page == host[tenant_tag(DEFAULT)] * page + tree[DEFAULT]
    assert (got_u + got_s) * page == res["dropped_tokens"]
    assert cache.host.tenant_pages() == {}
    assert cache.driver.run(prompt, tenant=None).cached_len == 0
    assert cache.driver.run(prompt, tenant=DEFAULT).cached_len == 0


def test_another_tenants_invalidation_spares_both():
    page = 16
    cache = _sim(page, True)
    prompt = list(range(6 * page))
    for t in (None, DEFAULT, "acme"):
        cache.driver.run(prompt, tenant=t)
    cache.invalidate(tenant_hash=name_hash("acme"))
    assert cache.driver.run(prompt, tenant=None).cached_len > 0
    assert cache.driver.run(prompt, tenant=DEFAULT).cached_len > 0
    assert cache.driver.run(prompt, tenant="acme").cached_len == 0
