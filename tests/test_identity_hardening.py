"""Cache identity hardening.

A. After a weight update no KV computed with the old weights is served from T1 or T2: SGLang's own
   weight-update path (``SchedulerWeightUpdaterManager.update_weights_from_disk``, which flushes
   the cache) runs wrapped in our hook over a simulated cache; the "model" of the simulator is
   switched to the new weights, so ``verify_kv`` fails on any old-weights hit.
B. The ``CacheKey`` covers online quantization, the compute dtype and the revision, and leaves the
   seeds and page hashes of a key without them exactly as they were.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from types import SimpleNamespace as NS

import pytest
from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager

from sglang_tiered.core.keys import CacheKey, chain_page_hashes
from sglang_tiered.dev import simulate
from sglang_tiered.integration import hooks
from sglang_tiered.integration.identity import cache_key_from_context
from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache
from tests.test_t2 import ByteStore  # the dict-backed store T2 calls (faults off)

PAGE = 16


# ---------------------------------------------------------------------------------- B: the key
def test_default_seeds_and_hashes_are_unchanged():
    """Values recorded before the optional fields were added (decision digests depend on them)."""
    k = CacheKey()
    assert k.seed().hex() == "6b914b732e3d8ce9b906bacede98ab65"
    assert k.namespace_seed(None, None).hex() == "c230933f02656bec3ee1e043d8076dee"
    assert k.namespace_seed("acme", "lora1").hex() == "02fa562097ddb6150ba07a93e318969c"
    pages = chain_page_hashes(k.namespace_seed(None, None), list(range(32)))
    assert pages[1].hex() == "15dcb763ffa0540ec2a414a7dda5bbc8"
    k2 = CacheKey(tenant="t", model_id="m", weights_digest="w", kv_dtype="auto:torch.bfloat16", rope_hash="r",
                  attn_impl="fa3")  # fmt: skip
    assert k2.seed().hex() == "087d5fb03b578924af8b7b4a910bfd97"
    assert k2.namespace_seed("s", None).hex() == "145291a1010286c2e2e2aae2c34b446f"


def test_quantization_dtype_and_revision_change_the_key():
    base = CacheKey(model_id="m", weights_digest="w", kv_dtype="fp8_e4m3")
    variants = [base, CacheKey(model_id="m", weights_digest="w", kv_dtype="fp8_e4m3", quantization="fp8"),
                CacheKey(model_id="m", weights_digest="w", kv_dtype="fp8_e4m3", model_dtype="torch.float16"),
                CacheKey(model_id="m", weights_digest="w", kv_dtype="fp8_e4m3", model_dtype="torch.bfloat16"),
                CacheKey(model_id="m", weights_digest="w", kv_dtype="fp8_e4m3", revision="abc123")]  # fmt: skip
    seeds = {v.seed() for v in variants}
    ns = {v.namespace_seed("acme", None) for v in variants}
    assert len(seeds) == len(ns) == len(variants)
    q = variants[1]
    assert q.for_tenant("acme").quantization == "fp8" and q.for_tenant(None).tenant == "default"
    # the index publishes asdict() as JSON and routers rebuild the key from it: same seeds
    for v in variants:
        back = CacheKey(**json.loads(json.dumps(asdict(v), sort_keys=True)))
        assert back.namespace_seed("acme", "x") == v.namespace_seed("acme", "x")


def _ctx(model_dir, *, mc_dtype="torch.bfloat16", **sa):
    base = dict(model_path=str(model_dir), served_model_name=None, kv_cache_dtype="auto", attention_backend="fa3",
                quantization=None, dtype="auto", revision=None, modelopt_quant=None,
                quantization_param_path=None)  # fmt: skip
    base.update(sa)
    hf = NS(rope_theta=10000.0, rope_scaling=None, max_position_embeddings=4096)
    return NS(server_args=NS(**base), model_config=NS(hf_text_config=hf, dtype=mc_dtype, quantization=None))


def test_identity_covers_quantization_dtype_revision(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_TIERED_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"w" * 64)
    plain = cache_key_from_context(_ctx(model))
    assert plain.model_dtype == "torch.bfloat16" and plain.quantization is None
    assert cache_key_from_context(_ctx(model)).seed() == plain.seed()  # deterministic
    others = [cache_key_from_context(_ctx(model, quantization="fp8")),
              cache_key_from_context(_ctx(model, modelopt_quant="fp8")),
              cache_key_from_context(_ctx(model, revision="v2"))]  # fmt: skip
    assert len({plain.seed(), *(k.seed() for k in others)}) == 4
    # explicit KV dtype: the compute dtype no longer shows in kv_dtype, but still in the key
    f16 = cache_key_from_context(_ctx(model, mc_dtype="torch.float16", kv_cache_dtype="fp8_e4m3"))
    bf16 = cache_key_from_context(_ctx(model, mc_dtype="torch.bfloat16", kv_cache_dtype="fp8_e4m3"))
    assert f16.kv_dtype == bf16.kv_dtype and f16.seed() != bf16.seed()
    # KV scales: the file's content is in the key
    scales = tmp_path / "scales.json"
    scales.write_text('{"k": 1.0}')
    s1 = cache_key_from_context(_ctx(model, quantization_param_path=str(scales)))
    scales.write_text('{"k": 2.0}')
    s2 = cache_key_from_context(_ctx(model, quantization_param_path=str(scales)))
    assert len({plain.seed(), s1.seed(), s2.seed()}) == 3


# ------------------------------------------------------------------------- A: weight updates
def prompt(i: int, pages: int = 4) -> list:
    return [1000 * (i + 1) + j for j in range(pages * PAGE)]


@pytest.fixture
def new_weights(monkeypatch):
    """Call it to switch the simulator's "model" to new weights: recomputation gives other KV."""
    old = simulate.expected_kv

    def switch():
        monkeypatch.setattr(simulate, "expected_kv", lambda *a, **k: old(*a, **k) + 4096.0)

    return switch


class FakeScheduler:
    """What ``SchedulerWeightUpdaterManager`` calls back on the scheduler: ``flush_cache``
    (managers/scheduler.py:5518-5523: tree_cache.reset + allocator clear) and
    ``record_weight_version_change`` (with our AFTER hook applied, as HookRegistry would)."""

    def __init__(self, cache):
        self.tree_cache = cache
        self.flushes = 0

    def flush_cache(self, empty_cache: bool = True) -> bool:
        self.tree_cache.reset()
        alloc = self.tree_cache.driver.allocator
        alloc.free_pages = list(range(alloc.num_pages, 0, -1))  # token_to_kv_pool_allocator.clear()
        self.flushes += 1
        return True

    def record_weight_version_change(self, new_version=None) -> None:
        hooks._after_weight_version_change(None, self, new_version=new_version)


def update_weights(cache, *, flush: bool = True, version="v2", method="update_weights_from_disk"):
    """SGLang's own ``update_weights_from_disk`` (weight_updater.py:138-166), wrapped in our AROUND
    hook, on a manager whose runner 'loads' the new weights."""
    sched = FakeScheduler(cache)
    runner = NS(weight_updater=NS(update_weights_from_disk=lambda *a, **k: (True, "loaded")))
    mgr = object.__new__(SchedulerWeightUpdaterManager)  # (skips __post_init__: no TP group here)
    mgr.tp_worker = NS(weight_update_runners=lambda: [("target", runner)])
    mgr.draft_worker = None
    mgr.scheduler = sched
    mgr.flush_cache = sched.flush_cache
    mgr.metrics_collector = None
    req = NS(model_path="/new", load_format=None, recapture_cuda_graph=False, weight_version=version,
             flush_cache=flush, torch_empty_cache=False)  # fmt: skip
    out = hooks.weight_update_hook(method)(SchedulerWeightUpdaterManager.update_weights_from_disk, mgr, req)
    assert out.success, out.message
    assert sched.flushes == int(flush)
    return out


def fill(cache, ids) -> None:
    for i in ids:
        assert cache.driver.run(prompt(i)).served


def test_weight_update_never_serves_old_kv_from_t1(new_weights):
    cache = TieredRadixCache.create_simulated(8 * PAGE, PAGE, host_pages=32, verify_kv=True, debug_checks=True)
    fill(cache, range(4))  # 16 pages into an 8-page device: prompts 0 and 1 demoted to T1
    before = cache.driver.host_loaded_tokens
    assert cache.driver.run(prompt(0)).cached_len == 4 * PAGE
    assert cache.driver.host_loaded_tokens - before == 4 * PAGE  # T1 serves (same weights)
    fill(cache, range(1, 4))
    assert cache.host.pool.resident > 0
    old_hashes = page_hashes(cache, prompt(3))

    update_weights(cache, flush=True, version="v2")
    new_weights()
    assert cache.host.pool.resident == 0 and cache.evictable_size_ == 0
    assert cache.cache_key != cache.base_key and cache.t1.paused is None
    loaded = cache.driver.host_loaded_tokens
    for i in range(4):  # every prompt: a miss, recomputed (verify_kv checks each hit against it)
        out = cache.driver.run(prompt(i))
        assert out.cached_len == 0, i
    assert cache.driver.host_loaded_tokens == loaded
    # T1 works again, under the new identity, with new-weights KV only (verify_kv)
    assert cache.driver.run(prompt(0)).cached_len == 4 * PAGE
    assert cache.driver.host_loaded_tokens > loaded
    assert not set(old_hashes) & set(page_hashes(cache, prompt(3)))  # T2 objects of the old ones never match
    cache.check_invariants()


def page_hashes(cache, ids) -> list:
    """The page hashes the cache gives ``ids`` now (what T1 and T2 are asked for)."""
    return chain_page_hashes(cache.hashes.seed(None, None), ids, PAGE)


def test_each_update_gets_a_new_identity():
    cache = TieredRadixCache.create_simulated(8 * PAGE, PAGE, host_pages=8)
    seeds = {cache.cache_key.seed()}
    for method in ("update_weights_from_disk", "end_weight_update"):
        update_weights(cache, version="v2", method=method)  # same version label twice
        seeds.add(cache.cache_key.seed())
    assert len(seeds) == 3
    other = TieredRadixCache.create_simulated(8 * PAGE, PAGE, host_pages=8)
    other.lifetime_tag = "another-server"
    update_weights(other, version="v2")
    assert other.cache_key.seed() not in seeds  # another server (or restart) never shares it


def test_update_without_flush_pauses_t1_until_the_tree_is_empty():
    cache = TieredRadixCache.create_simulated(8 * PAGE, PAGE, host_pages=32, verify_kv=True, debug_checks=True)
    fill(cache, range(4))
    assert cache.host.pool.resident > 0
    update_weights(cache, flush=False, version="v2")  # SGLang keeps the device tree (its choice)
    assert cache.host.pool.resident == 0 and cache.t1.paused
    assert cache.cache_key == cache.base_key  # re-seeding waits for the old tree to go
    loaded = cache.driver.host_loaded_tokens
    fill(cache, range(4, 8))  # evictions: nothing demoted, nothing probed
    assert cache.host.pool.resident == 0 and cache.driver.host_loaded_tokens == loaded
    cache.check_invariants()
    FakeScheduler(cache).flush_cache()  # the operator's /flush_cache
    assert cache.t1.paused is None and cache.cache_key != cache.base_key
    fill(cache, range(4))
    assert cache.host.pool.resident > 0  # T1 back, under the new identity
    cache.check_invariants()

    # the tree emptied another way (every node evicted): re-seeded at the next batch end
    cache2 = TieredRadixCache.create_simulated(8 * PAGE, PAGE, host_pages=32, debug_checks=True)
    fill(cache2, range(2))
    update_weights(cache2, flush=False)
    assert cache2.t1.paused
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cache2.evict(EvictParams(num_tokens=cache2.evictable_size_))
    cache2.flush_pending_backups()
    assert cache2.t1.paused is None and cache2.cache_key != cache2.base_key
    cache2.check_invariants()


def test_version_change_hook_and_targets():
    cache = TieredRadixCache.create_simulated(8 * PAGE, PAGE, host_pages=8)
    cache.weight_version = "v1"
    sched = FakeScheduler(cache)
    sched.record_weight_version_change("v1")  # unchanged: nothing happens
    sched.record_weight_version_change(None)
    assert cache.weight_updates == 0
    sched.record_weight_version_change("v3")  # /update_weight_version or an update's record
    assert cache.weight_updates == 1 and cache.weight_version == "v3"
    assert cache.invalidation.versions["weight_version"] == "v3"
    assert hooks.missing_weight_hook_targets() == []  # every hooked method exists in this SGLang


def test_plain_flush_demotes_to_t1_and_persist_demotes():
    """A plain /flush_cache (no weight update) keeps its warm-restart behaviour: the device tree
    goes to T1 and is served from there, under the same identity."""
    cache = TieredRadixCache.create_simulated(8 * PAGE, PAGE, host_pages=32, verify_kv=True, debug_checks=True)
    fill(cache, range(2))
    assert cache.persist_to_host() == 8 * PAGE and cache.host.pool.resident == 8  # device -> T1
    assert cache.driver.run(prompt(0)).cached_len == 4 * PAGE  # from T1
    FakeScheduler(cache).flush_cache()  # the device tree into T1, then emptied
    assert not cache.root_node.children and cache.cache_key == cache.base_key
    assert cache.driver.run(prompt(1)).cached_len == 4 * PAGE  # from T1
    cache.check_invariants()
    # the control-plane key SGLang's /set_internal_state carries (hooks.PERSIST_KEY)
    from sglang.srt.managers.scheduler_components.internal_state import UpdateRejected

    handler = hooks._after_update_handlers({}, NS(scheduler=NS(tree_cache=cache)))[hooks.PERSIST_KEY]
    for bad in (0, 2, True, "1"):
        with pytest.raises(UpdateRejected):
            handler.validate(hooks.PERSIST_KEY, bad)
    handler.validate(hooks.PERSIST_KEY, 1)
    assert handler.apply(hooks.PERSIST_KEY, 1) is None
    assert cache.host.pool.resident == 8 and cache.evictable_size_ == 0  # prompt(1) demoted again
    cache.check_invariants()


# ---------------------------------------------------------------------------------- T2


def test_weight_update_never_serves_old_kv_from_t2(new_weights):
    from sglang_tiered.core.store_queue import StoreQueue
    from sglang_tiered.tier.t2 import T2Tier
    from sglang_tiered.tier.t2_config import T2Config

    cache = TieredRadixCache.create_simulated(8 * PAGE, PAGE, host_pages=8, verify_kv=True, debug_checks=True)
    cfg = T2Config(master="127.0.0.1:1", queue_pages=64, max_run_pages=8, timeout_ms=30_000, lease_ms=0)
    t2 = T2Tier(ByteStore(), cache.host.pool, cache.host.lock, cfg=cfg, model_tag="m")
    t2.start()
    t2.queue.close()
    t2.queue = StoreQueue(cfg.queue_pages, t2._put_job, threaded=False)
    t2.MISS_MEMO_S = 0.0  # (the fill's misses must not hide what T2 holds afterwards)
    cache.host.t2 = t2
    try:
        fill(cache, range(6))  # device: 4-5, T1: 2-3, T2: 0-1 (T1's victims)
        t2.flush()
        t2.queue.drain()
        assert t2.stats.stored_pages >= 8
        FakeScheduler(cache).flush_cache()  # same weights: T1 dropped, T2 kept and still valid
        loaded = cache.driver.host_loaded_tokens
        assert cache.driver.run(prompt(0)).cached_len == 4 * PAGE  # from T2 (verify_kv: same weights)
        assert cache.driver.host_loaded_tokens - loaded == 4 * PAGE

        update_weights(cache, flush=True)
        new_weights()
        loaded = cache.driver.host_loaded_tokens
        for i in range(6):  # T2 holds 0-1 (and more) under the old identity: never served
            assert cache.driver.run(prompt(i)).cached_len == 0, i
        assert cache.driver.host_loaded_tokens == loaded
        cache.check_invariants()
    finally:
        t2.close()


def test_lifetime_id_is_inherited(monkeypatch):
    from sglang_tiered.config import LIFETIME_ENV, lifetime_id

    monkeypatch.delenv(LIFETIME_ENV, raising=False)
    a = lifetime_id()
    assert lifetime_id() == a  # set once per process tree (plugin.register, in the launcher)
    import os
    import subprocess
    import sys

    got = subprocess.run([sys.executable, "-c", f"import os; print(os.environ[{LIFETIME_ENV!r}])"],
                         capture_output=True, text=True, env=dict(os.environ), check=True).stdout.strip()  # fmt: skip
    assert got == a



def test_hooks_wrap_the_weight_update_methods():
    """In a scheduler process (fresh interpreter: HookRegistry patches classes for good)."""
    import subprocess
    import sys

    code = """
import multiprocessing
multiprocessing.current_process().name = "scheduler-0"
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang_tiered.integration.hooks import register_hooks, WEIGHT_UPDATE_METHODS
register_hooks()
HookRegistry.apply_hooks()
from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager as M
from sglang.srt.managers.scheduler import Scheduler
wrapped = [getattr(getattr(M, m), "__wrapped__", None) is not None for m in WEIGHT_UPDATE_METHODS]
print(all(wrapped), getattr(Scheduler.record_weight_version_change, "__wrapped__", None) is not None)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "True True"
