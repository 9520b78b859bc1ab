"""Issue #10 findings at library level (no server): T1 ownership and verified promotions, T1
namespaces, middleware input handling, bounded tables, config validation. The server-level half
is tests/test_e2e_hardening.py."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch

from sglang_tiered.core.keys import CacheKey
from sglang_tiered.integration.page_hashes import SEED_TABLE_MAX
from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

PAGE = 16


# ---------------------------------------------------------------- finding 4: T1 namespaces
# (salt, extra_key) pairs that a text join merged: salt "default" vs none, "a|x" vs (a, x),
# "default|k" vs (none, k); plus LoRA-style extra keys and an empty salt (SGLang: empty = none).
NAMESPACES = [
    (None, None), ("default", None), ("acme|x", None), ("acme", "x"), ("default|k", None), (None, "k"),
    ("default", "k"), ("acme", None), (None, "lora-1"), (None, "lora-2"), ("acme", "lora-1"),
    ("", "lora-1"), ("|", None), (None, "|"), ("null", None), ("None", None), ('["a", null]', None),
]  # fmt: skip


def _norm(ns):
    return (ns[0] or None, ns[1])


def test_namespace_seeds_are_distinct_exactly_where_sglang_tree_is():
    key = CacheKey(model_id="m", weights_digest="w")
    seeds = {}
    for ns in NAMESPACES:
        seeds.setdefault(_norm(ns), set()).add(key.namespace_seed(*ns))
    assert all(len(v) == 1 for v in seeds.values())  # "" and None are one namespace, as in SGLang
    flat = [next(iter(v)) for v in seeds.values()]
    assert len(set(flat)) == len(flat)  # every other pair stays apart
    # and the model identity still separates everything
    other = CacheKey(model_id="m", weights_digest="w2")
    assert not set(flat) & {other.namespace_seed(*ns) for ns in NAMESPACES}


def test_t1_never_serves_another_namespace():
    """Demote a prompt from every namespace's device tree to T1 (the device is tiny), then ask for
    the same tokens in every other namespace: no T1 hit crosses, and every hit equals
    recomputation for its own namespace (verify_kv)."""
    cache = TieredRadixCache.create_simulated(capacity_tokens=6 * PAGE, page_size=PAGE, host_pages=256,
                                              verify_kv=True, debug_checks=True)  # fmt: skip
    toks = list(range(1000, 1000 + 5 * PAGE + 3))
    spaces = sorted({_norm(ns) for ns in NAMESPACES}, key=repr)
    filler = list(range(5000, 5000 + 6 * PAGE))
    for salt, ek in spaces:
        cache.driver.run(toks, tenant=salt, extra_key=ek)
        cache.driver.run(filler, tenant="filler")  # pushes the prompt out of the device into T1
    host = cache.host.stats.promoted_pages
    for i, (salt, ek) in enumerate(spaces):
        out = cache.driver.run(toks, tenant=salt, extra_key=ek)  # its own namespace: hit from T1
        assert out.cached_len == 5 * PAGE
        cache.driver.run(filler, tenant="filler")
    assert cache.host.stats.promoted_pages > host
    # a namespace that never stored the prompt finds nothing anywhere
    for salt, ek in [("fresh", None), (None, "lora-9"), ("default", "x")]:
        assert cache.driver.run(toks, tenant=salt, extra_key=ek).cached_len == 0


# ---------------------------------------------------------------- finding 1: one writer per T1
def test_named_t1_has_one_owner(tmp_path, monkeypatch):
    import sglang_tiered.tier.host_pool as hp

    monkeypatch.setattr(hp, "SHM_DIR", tmp_path)
    layout = hp.PoolLayout(8, 1, 2, 4, 4, "float32")
    pool = hp.HostPool(layout, name="own")  # this process owns it now
    script = (
        "import pathlib, sys\n"
        "import sglang_tiered.tier.host_pool as hp\n"
        f"hp.SHM_DIR = pathlib.Path({str(tmp_path)!r})\n"
        "try:\n"
        f"    hp.HostPool(hp.PoolLayout(8, 1, 2, 4, 4, 'float32'), name='own')\n"
        "except hp.HostPoolError as e:\n"
        "    print('REFUSED', e); sys.exit(3)\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3 and "in use by another live server" in r.stdout, r.stdout + r.stderr
    # a process of the owning server (launcher token in its environment) may attach
    env_ok = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**__import__("os").environ, hp.OWNER_ENV: f"own:{hp._owned['own'][1]}"})  # fmt: skip
    assert env_ok.returncode == 0, env_ok.stdout + env_ok.stderr
    # a forged token is refused
    forged = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**__import__("os").environ, hp.OWNER_ENV: "own:pid=1 token=0"})  # fmt: skip
    assert forged.returncode == 3
    hp.release_owner("own")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr  # the owner left: the next server attaches
    pool.close(unlink=True)


def test_promotion_checks_the_slot_hash():
    """Another writer overwrote a slot behind this process's back: promotion is a clean miss."""
    cache = TieredRadixCache.create_simulated(capacity_tokens=6 * PAGE, page_size=PAGE, host_pages=64,
                                              verify_kv=True)  # fmt: skip
    toks = list(range(1, 1 + 4 * PAGE + 1))
    cache.driver.run(toks)
    cache.driver.run(list(range(7000, 7000 + 6 * PAGE)))  # demote toks to T1
    pool = cache.host.pool
    slot = next(iter(pool.lru))
    pool.index_heads[slot] = torch.full((pool.layout.kv_heads, 16), 7, dtype=torch.uint8)  # the "other server" wrote here
    failed = cache.host.stats.failed_promotions
    out = cache.driver.run(toks)  # verify_kv would catch foreign KV; the check refuses it first
    assert cache.host.stats.foreign_slots >= 1 and cache.host.stats.failed_promotions > failed
    assert out.cached_len < len(toks)  # recomputed (whatever the device still had is fine)


# ---------------------------------------------------------------- finding 2: tmpfs too small
def test_named_t1_larger_than_its_filesystem_is_refused_not_sigbus(tmp_path, monkeypatch):
    import sglang_tiered.tier.host_pool as hp

    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        monkeypatch.setattr(hp, "SHM_DIR", mnt)
        with pytest.raises(hp.HostPoolError, match="too small"):
            hp.HostPool(hp.PoolLayout(64, 4, 4, 16, 64, "float32"), name="big")  # 16 MB > 1 MB
        assert not (mnt / "sglang-tiered-big").exists()
        hp.release_owner("big")
    finally:
        subprocess.run(["umount", str(mnt)])


# ---------------------------------------------------------------- finding 5: middleware input
@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("cp", [[1], "abc", True, 3])
def test_hint_with_wrong_custom_params_type_is_a_400(path, cp):
    from sglang_tiered.integration.http import BadRequest, rewrite_body

    body = {"kv_transfer_params": {"lmcache.skip_save": True}}
    if path == "/generate":
        body["sampling_params"] = {"custom_params": cp}
    else:
        body["custom_params"] = cp
    with pytest.raises(BadRequest, match="custom_params must be a JSON object"):
        rewrite_body(json.dumps(body).encode(), path, None)


def test_tenant_mode_parses_everything_or_refuses():
    from sglang_tiered.integration.http import BadRequest, rewrite_body

    deep = b"[" * 5000 + b"]" * 5000
    for raw in (deep, b'{"a": ' + deep + b"}", b"\xff\xfe", b"", b"[1]", b'"x"'):
        with pytest.raises(BadRequest):
            rewrite_body(raw, "/generate", "acme", tenant_mode=True)
        if raw in (b"\xff\xfe", b""):
            assert rewrite_body(raw, "/generate", None) is raw  # not JSON, no tenant header: SGLang judges
        else:  # too deep or not an object: stock SGLang answers a 500 (session 26), so refused here too
            with pytest.raises(BadRequest):
                rewrite_body(raw, "/generate", None)
    out = json.loads(rewrite_body(b'{"text": "x", "cache_salt": "victim"}', "/generate", "acme", True))
    assert out["cache_salt"] == "acme"
    out = json.loads(rewrite_body(b'{"text": "x", "cache_salt": "victim"}', "/generate", None, True))
    assert "cache_salt" not in out  # header absent: a client's salt never passes


# ---------------------------------------------------------------- finding 6: bounded state
def test_tables_stay_bounded_with_many_salts():
    """10,000 requests from 5,000 distinct (long) salts, T1 on: every per-salt, per-tenant,
    per-request and per-slot table stays within its stated bound, and so does the stats size."""
    rng = random.Random(0)
    cache = TieredRadixCache.create_simulated(capacity_tokens=64 * PAGE, page_size=PAGE, host_pages=256)
    shared = list(range(1, 1 + 3 * PAGE))
    for i in range(10_000):
        salt = f"tenant-{i % 5000:05d}-" + "x" * 2000
        toks = shared + [rng.randrange(10_000) for _ in range(rng.randrange(1, 5 * PAGE))]
        cache.driver.run(toks, tenant=salt)
    assert cache.hashes.seeds_held <= SEED_TABLE_MAX
    assert len(cache.tenants.by_name) <= cache.tenants.max_tenants + 1
    assert all(len(name) <= 81 for name in cache.tenants.by_name)
    assert cache.open_requests() == 0
    assert not hasattr(cache.host, "tenant_of")  # tenant tags live in the pool's per-slot index
    assert cache.host.pool.resident <= cache.host.pool.capacity
    size = len(json.dumps(cache.stats_snapshot()))
    assert size < 200_000, size
    # sums still conserve: per-tenant requests add up to all requests
    assert sum(c.requests for c in cache.tenants.by_name.values()) == 10_000


# ---------------------------------------------------------------- finding 7: config
@pytest.mark.parametrize("var,value", [
    ("SGLANG_TIERED_HOST_GB", "inf"), ("SGLANG_TIERED_HOST_GB", "1e400"), ("SGLANG_TIERED_HOST_GB", "nan"),
    ("SGLANG_TIERED_HOST_GB", "1e9"), ("SGLANG_TIERED_HOST_RATIO", "1e400"), ("SGLANG_TIERED_HOST_RATIO", "inf"),
    ("SGLANG_TIERED_HOST_RATIO", "-inf"), ("SGLANG_TIERED_HOST_RATIO", "5000"),
])  # fmt: skip
def test_config_rejects_non_finite_and_absurd_sizes(var, value):
    from sglang_tiered.config import ConfigError, load_config

    with pytest.raises(ConfigError):
        load_config({var: value})


# ---------------------------------------------------------------- session 17 review findings
def _tenant_app(monkeypatch, **env):
    """An ASGI app with SGLang's route shapes (POST and PUT where SGLang serves both) behind the
    hint middleware in tenant-header mode; each route echoes the salt it received."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from sglang_tiered.integration.http import HintMiddleware

    for k, v in env.items():
        monkeypatch.setenv(k, v)

    async def echo(request):
        body = await request.json() if request.method != "GET" else {}
        return JSONResponse({"salt": body.get("cache_salt", (body.get("parameters") or {}).get("cache_salt"))})

    routes = [Route("/generate", echo, methods=["GET", "POST", "PUT"]),  # sglang http_server.py:930
              Route("/encode", echo, methods=["POST", "PUT"]),  # :993
              Route("/predict", echo, methods=["POST"])]  # Vertex's route, renamed (:2215)  # fmt: skip
    return TestClient(Starlette(routes=routes, middleware=[Middleware(HintMiddleware, tenant_header="x-tenant-id")]))


def test_tenant_header_holds_for_every_method_and_renamed_route(monkeypatch):
    """PUT reaches the same routes as POST: the header's tenant replaces the client's salt there
    too, routes without a salt are refused on PUT as on POST, and so are the routes SGLang lets
    the operator rename (AIP_PREDICT_ROUTE)."""
    c = _tenant_app(monkeypatch, AIP_PREDICT_ROUTE="/predict")
    hdr = {"x-tenant-id": "acme"}
    for method in ("POST", "PUT"):
        r = c.request(method, "/generate", json={"text": "hi", "cache_salt": "victim"}, headers=hdr)
        assert r.status_code == 200 and r.json() == {"salt": "acme"}, (method, r.text)
        r = c.request(method, "/generate", json={"text": "hi", "cache_salt": "victim"})
        assert r.status_code == 200 and r.json() == {"salt": None}, (method, r.text)
        r = c.request(method, "/encode", json={"text": "hi"}, headers=hdr)
        assert r.status_code == 403 and "tenant" in r.json()["error"]["message"], (method, r.text)
    r = c.post("/predict", json={"instances": [{"text": "hi"}], "parameters": {"cache_salt": "victim"}}, headers=hdr)
    assert r.status_code == 403, r.text
    assert c.get("/generate", headers=hdr).status_code != 403  # bodyless methods pass as before


def test_surrogate_salt_never_raises_in_the_scheduler():
    """JSON allows lone surrogates, and SGLang hands a client's cache_salt to the scheduler as
    it came: eviction into T1 and tenant invalidation must hash it, not raise (an exception in
    the scheduler takes the server down)."""
    from sglang_tiered.core.tenants import name_hash

    salt = "\ud800bad"
    cache = TieredRadixCache.create_simulated(capacity_tokens=8 * PAGE, page_size=PAGE, host_pages=64)
    for i in range(6):
        cache.driver.run(list(range(i * 100, i * 100 + 3 * PAGE)), tenant=salt)  # evicts into T1
    res = cache.invalidate(tenant_hash=name_hash(salt))
    assert res["dropped_tokens"] > 0
    assert cache.driver.run(list(range(500, 500 + 3 * PAGE)), tenant=salt).cached_len == 0


def test_invalidation_key_without_nonce_is_applied_not_raised():
    """SGLang's own /set_internal_state can send our invalidation key alone (no nonce first)."""
    cache = TieredRadixCache.create_simulated(capacity_tokens=1024, page_size=PAGE)
    cache.driver.run(list(range(64)), tenant="t")
    cache.apply_invalidation_key("sglang_tiered_invalidate_all", 1)
    assert cache.invalidation.last["dropped_tokens"] == 64 and cache.invalidation.last["nonce"] is None
    assert cache.evictable_size_ == 0
    cache.apply_invalidation_key("sglang_tiered_invalidate_nonce", 7)
    assert cache.invalidation.last == {"nonce": 7, "dropped_tokens": 0, "deferred_tokens": 0}


@pytest.mark.parametrize("value", ["²", "١٢", "12\u00b3"])
def test_config_page_counts_take_ascii_digits_only(value):
    from sglang_tiered.config import ConfigError, load_config

    for var in ("SGLANG_TIERED_STORE_QUEUE_PAGES", "SGLANG_TIERED_LRU_TREE_PAGES"):
        with pytest.raises(ConfigError, match="whole number"):
            load_config({var: value})
