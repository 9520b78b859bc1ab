"""Findings of the session-18 review of T1's storage and T2, each with the test that failed before
its fix (TP ranks and T1: tests/test_t1_tp_ranks.py)."""

from __future__ import annotations

import random
import types

import pytest
import torch

import sglang_tiered.integration.t2_setup as t2s
from sglang_tiered.core.keys import CacheKey
from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache
from sglang_tiered.tier.t2_config import T2ConfigError, parse_t2_url
from tests.test_t2 import ByteStore

PAGE = 16


def _cache(host_pages=16):
    return TieredRadixCache.create_simulated(256, page_size=PAGE, cache_key=CacheKey(model_id="m", weights_digest="w"),
                                             host_pages=host_pages, verify_kv=True)  # fmt: skip


def _traffic(cache, n=30):
    rng = random.Random(0)
    for _ in range(n):
        cache.driver.run([rng.randrange(1, 30000) for _ in range(160)], tenant="acme")


@pytest.mark.parametrize("case", ["slow", "error"])
def test_t2_refused_at_start_takes_no_victims(case, monkeypatch):
    """A T2 tier built for the start-up measurement and then refused (slower than recompute, or
    the probe failed) used to stay T1's victim listener: it copied every valued victim into a
    queue nobody drained (or, after a failed probe, kept writing while the stats said off)."""
    store = ByteStore()
    monkeypatch.setattr(t2s, "MooncakeClient", lambda cfg: store)
    if case == "slow":
        monkeypatch.setattr(t2s, "break_even_gbps", lambda ctx, kv, k0: (1e9, "forced"))
    else:
        monkeypatch.setattr(store, "put", lambda k, p, s: [-1] * len(k))
    cache = _cache()
    decision = t2s.build_t2(cache, types.SimpleNamespace(tp_size=1), parse_t2_url("mooncake://127.0.0.1:1?max_run_pages=4&queue_pages=64"))
    assert decision.startswith("off")
    pool = cache.t1.host.pool
    assert cache.t1.host.t2 is None and pool.victim_listener is None
    _traffic(cache)
    assert pool.victim_listener is None and cache.t1.host.stats.demoted_pages > 0


def test_t2_and_a_named_t1_refuse_pipeline_stages(monkeypatch):
    """Pipeline stages hold different layers under the same keys (T2) or file (named T1)."""
    monkeypatch.setattr(t2s, "MooncakeClient", lambda cfg: ByteStore())
    cache = _cache()
    ctx = types.SimpleNamespace(tp_size=1, server_args=types.SimpleNamespace(pp_size=2))
    assert t2s.build_t2(cache, ctx, parse_t2_url("mooncake://127.0.0.1:1")).startswith("off: --pp-size 2")
    assert cache.t1.host.pool.victim_listener is None

    from sglang_tiered.integration.host_setup import build_host_tier

    from sglang_tiered.config import load_config

    cfg = load_config({"SGLANG_TIERED_HOST": "on", "SGLANG_TIERED_HOST_NAME": "stage"})
    tier, decision = build_host_tier(cache, types.SimpleNamespace(tp_size=1, tp_rank=0, server_args=ctx.server_args,
                                                                  model_config=types.SimpleNamespace(
                                                                      get_total_num_kv_heads=lambda: 1)), cfg)  # fmt: skip
    assert tier is None and "--pp-size 2" in decision


def test_t1_refuses_a_kv_pool_with_scales_beside_the_data():
    """--kv-cache-dtype mxfp8: per-block scales beside the fp8 data; T1 moves the data only, so a
    promoted page would meet the scales of whatever used the device slots last."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPoolMXFP8

    from sglang_tiered.integration.host_setup import build_host_tier

    kv = MHATokenToKVPoolMXFP8(size=8 * 4, page_size=4, dtype=torch.float8_e4m3fn, head_num=2, head_dim=32,
                               layer_num=2, device="cpu", enable_memory_saver=False)  # fmt: skip
    cache = types.SimpleNamespace(token_to_kv_pool_allocator=types.SimpleNamespace(get_kvcache=lambda: kv), is_eagle=False)
    tier, decision = build_host_tier(cache, None, types.SimpleNamespace(host_mode="on"))
    assert tier is None and "scales" in decision


def test_t2_fetch_never_evicts_the_t1_run_it_extends(monkeypatch):
    """T1 (8 pages) holds the first 6 pages of a prompt, T2 all 10: the fetch made room in T1 by
    evicting the very run it extends, the promotion then failed, and the request recomputed
    everything (0 tokens, where T1 alone serves 96)."""
    from sglang_tiered.core.keys import chain_page_hashes

    store = ByteStore()
    monkeypatch.setattr(t2s, "MooncakeClient", lambda cfg: store)
    cfg = parse_t2_url("mooncake://127.0.0.1:1?mode=on&max_run_pages=16&timeout_ms=2000")
    key = CacheKey(model_id="m", weights_digest="w", kv_dtype="float32")
    rng = random.Random(1)
    p, q = ([rng.randrange(1, 30000) for _ in range(10 * PAGE + 1)] for _ in range(2))

    def cache(host_pages, with_t2=True):
        c = TieredRadixCache.create_simulated(1024, page_size=PAGE, cache_key=key, host_pages=host_pages, verify_kv=True)
        if with_t2:
            t2s.attach_t2(c, cfg)
        return c

    b = cache(10)  # B puts all of p's pages into T2 (p demoted to B's T1, pushed out by q)
    for prompt in (p, q):
        b.driver.run(prompt, tenant="acme")
        b.persist_to_host()
    assert b.t1.host.t2.wait_idle(10)

    def served(with_t2):
        a = cache(8, with_t2)
        a.driver.run(p, tenant="acme")
        a.persist_to_host()
        ph = chain_page_hashes(a.hashes.seed(None, "acme"), p, PAGE)
        a.t1.host.pool.drop(ph[6:8])  # A's T1: p's pages 0-5 only, 2 slots free
        out = a.driver.run(p, tenant="acme")
        assert a.t1.host.stats.failed_promotions == 0
        return out.cached_len

    assert served(False) == 6 * PAGE
    assert served(True) >= 6 * PAGE


@pytest.mark.parametrize("url, why", [
    ("mooncake://127.0.0.1:99999", "out of range"),
    ("mooncake://127.0.0.1:50o51", "Port"),
    ("mooncake://[::1:50051", "IPv6"),
    ("mooncake://127.0.0.1:1?queue_pages=4&max_run_pages=16", "at least max_run_pages"),
])  # fmt: skip
def test_bad_t2_urls_are_config_errors(url, why):
    with pytest.raises(T2ConfigError, match=why):
        parse_t2_url(url)


def test_ipv6_master_keeps_its_brackets():
    assert parse_t2_url("mooncake://[::1]:50051").master == "[::1]:50051"


def test_an_invalidated_tenants_t2_pages_stay_refused_while_a_peer_keeps_them_leased(tmp_path):
    """Mooncake refuses to remove an object under lease, and a peer that keeps reading it renews
    the lease: both removals missed it, and once the read pause ended the invalidating server
    served the tenant's pages from T2 again. Session 18 refused objects written before the
    invalidation; session 23's review found that a peer not told of it re-writes the old KV with a
    new write time (which passed), and that the refusal was lost on a restart. Now an invalidation
    moves the tenant to a new generation, in every key the server reads from then on (and kept in
    a file): nothing written under the old one is read again, by whom- and whenever written."""
    import re
    import threading
    import time

    from sglang_tiered.tier.host_pool import HostPool, PoolLayout
    from sglang_tiered.tier.t2 import T2Tier

    lease = 0.3

    class LeaseStore(ByteStore):
        """Mooncake's rule: a read leases the object; removal skips leased objects."""

        def __init__(self):
            super().__init__()
            self.until = {}

        def get(self, keys, ptrs, sizes):
            for k in keys:  # (a peer reading it all along keeps renewing it: as one long lease)
                self.until[k] = time.monotonic() + 60
            return super().get(keys, ptrs, sizes)

        def remove_regex(self, pattern):
            rx, now = re.compile(pattern), time.monotonic()
            gone = [k for k in self.objects if rx.search(k) and self.until.get(k, 0) <= now]
            for k in gone:
                del self.objects[k]
            return len(gone)

    lay = PoolLayout(num_pages=8, layers=2, kv_heads=2, page_size=4, head_dim=4, dtype="float32")
    cfg = parse_t2_url(f"mooncake://127.0.0.1:1?lease_ms={int(lease * 1000)}&max_run_pages=4&queue_pages=64&timeout_ms=50")
    store = LeaseStore()
    state = tmp_path / "a-generations.json"

    def server(state_path=None):
        pool = HostPool(lay)
        t2 = T2Tier(store, pool, threading.RLock(), cfg=cfg, model_tag="m", state_path=state_path)
        t2.start()
        t2.MISS_MEMO_S = 0.0
        return pool, t2

    (pa, a), (pb, b) = server(state), server()
    acme, h = 42, bytes(range(16))

    def put_from(pool, t2, value):
        pr = pool.reserve([h])
        pool.data[:, :, :, pr[0][1]] = value
        pool.commit(pr, acme)
        for i in range(8):  # pushed out of T1: a victim, written to T2
            pr = pool.reserve([bytes([100 + i]) * 16])
            pool.commit(pr, 1)
        t2.flush()
        assert t2.wait_idle(5)

    put_from(pa, a, 1.0)
    old_key = a.key(h, acme)
    assert old_key in store.objects
    try:
        assert b.fetch([h], acme) == 1  # the peer reads it: leased
        a.invalidate(tenant=acme)
        time.sleep(lease + 1.2)  # past the retried removal
        a.wait_removals()
        assert old_key in store.objects  # the removals missed it
        assert a.fetch([h], acme) == 0  # never read again: another key
        # the review's scenario: B, not told, evicts the tenant's old page from its T1 again
        pb.drop([h])
        put_from(pb, b, 1.0)
        assert b.key(h, acme) == old_key and a.key(h, acme) != old_key
        assert a.fetch([h], acme) == 0 and not pa.contains(h)
        # A restarts: the generation is read back from its file
        a.close()
        pa, a = server(state)
        assert a.key(h, acme) != old_key and a.fetch([h], acme) == 0
        # written after the invalidation, by A: served
        put_from(pa, a, 2.0)
        pa.drop([h])
        assert a.fetch([h], acme) == 1
        # B told the same generation shares the tenant's pages with A again
        b.invalidate(tenant=acme, generation=a.generation(acme))
        assert b.key(h, acme) == a.key(h, acme)
        pb.drop([h])
        assert b.fetch([h], acme) == 1
    finally:
        a.close()
        b.close()


def test_a_flush_after_the_kv_pool_is_released_reads_nothing_from_it():
    """SGLang's release_memory_occupation pauses the KV pool, then flushes the cache: the flush
    used to demote every device page into T1 from unmapped memory, and after the resume T1 served
    that as a hit. Now the hooks tell the cache first: the flush drops the device tree, T1 keeps
    what it held, and nothing read from the released pool is ever served (verify_kv)."""
    from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput, ResumeMemoryOccupationReqInput

    from sglang_tiered.integration import hooks

    cache = TieredRadixCache.create_simulated(256, page_size=1, host_pages=256, verify_kv=True, debug_checks=True)
    manager = types.SimpleNamespace(scheduler=types.SimpleNamespace(tree_cache=cache))
    old = list(range(1, 41))
    cache.driver.run(old + [99])
    cache.persist_to_host()  # (T1 holds them too: it keeps them through the release)
    new = list(range(500, 540))
    cache.driver.run(new + [99])  # on the device only
    kv = cache.driver.allocator.get_kvcache()
    hooks._before_release_memory(manager, ReleaseMemoryOccupationReqInput(tags=None))
    for b in kv.k_buffer + kv.v_buffer:  # the pause: its contents are gone
        b.fill_(float("nan"))
    cache.reset()  # SGLang's flush_cache
    for b in kv.k_buffer + kv.v_buffer:  # the resume: fresh memory
        b.zero_()
    hooks._after_resume_memory(None, manager, ResumeMemoryOccupationReqInput(tags=["kv_cache"]))
    assert not cache.kv_released
    assert cache.driver.run(new + [7]).cached_len == 0  # recomputed, never the released pages
    assert cache.driver.run(old + [7]).cached_len == 40  # T1 kept its pages (verify_kv: exact)
    cache.check_invariants()


def test_release_without_the_kv_tag_flushes_as_before():
    from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

    from sglang_tiered.integration import hooks

    cache = TieredRadixCache.create_simulated(256, page_size=1, host_pages=256, verify_kv=True)
    hooks._before_release_memory(types.SimpleNamespace(scheduler=types.SimpleNamespace(tree_cache=cache)),
                                 ReleaseMemoryOccupationReqInput(tags=["weights"]))  # fmt: skip
    assert not cache.kv_released
    assert hooks.missing_weight_hook_targets() == []


def test_identity_covers_model_overrides_lora_adapters_and_a_single_gguf_file(tmp_path, monkeypatch):
    """--json-model-override-args can change any layer's KV; a retrained LoRA adapter at the same
    path kept its page hashes (SGLang names it by name and path); a GGUF model given as one file
    was identified by its path. Each now changes the key; the default key is unchanged."""
    import time

    from sglang_tiered.integration.identity import cache_key_from_context
    from sglang_tiered.weights_digest import weights_digest
    from tests.test_identity_hardening import _ctx

    monkeypatch.setenv("SGLANG_TIERED_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"w" * 64)
    plain = cache_key_from_context(_ctx(model))
    assert plain.model_overrides is None and plain.lora is None
    assert cache_key_from_context(_ctx(model, json_model_override_args="{}")).seed() == plain.seed()
    eps = cache_key_from_context(_ctx(model, json_model_override_args='{"rms_norm_eps": 0.5}'))
    act = cache_key_from_context(_ctx(model, json_model_override_args='{"hidden_act": "gelu"}'))
    assert len({plain.seed(), eps.seed(), act.seed()}) == 3

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"A" * 256)
    keys = []
    for form in ([f"customer-a={adapter}"], [{"lora_name": "customer-a", "lora_path": str(adapter)}]):
        keys.append(cache_key_from_context(_ctx(model, lora_paths=form)).seed())
    assert keys[0] == keys[1] != plain.seed()
    time.sleep(0.01)
    (adapter / "adapter_model.safetensors").write_bytes(b"B" * 256)  # retrained, same path
    assert cache_key_from_context(_ctx(model, lora_paths=[f"customer-a={adapter}"])).seed() != keys[0]
    (adapter / "adapter_config.json").write_text('{"r": 16}')
    assert cache_key_from_context(_ctx(model, lora_paths=[f"customer-a={adapter}"])).seed() != keys[0]

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"v1" * 64)
    d1 = weights_digest(str(gguf))
    gguf.write_bytes(b"v2" * 64)
    assert not d1.startswith("name:") and weights_digest(str(gguf)) != d1


def test_t2_without_t1_is_refused_or_reported():
    """SGLANG_TIERED_T2 with SGLANG_TIERED_HOST=off was accepted and the stats said T2 was unset."""
    from sglang_tiered.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="T2 needs T1"):
        load_config({"SGLANG_TIERED_HOST": "off", "SGLANG_TIERED_T2": "mooncake://127.0.0.1:50051"})
    from sglang_tiered.integration import build

    cfg = load_config({"SGLANG_TIERED_HOST": "auto", "SGLANG_TIERED_HOST_RATIO": "1e-9",
                       "SGLANG_TIERED_T2": "mooncake://127.0.0.1:50051"})  # fmt: skip
    cache = _cache()
    cache.t1 = None
    build.setup_host_tier(cache, types.SimpleNamespace(tp_size=1, tp_rank=0, server_args=None, model_config=types.SimpleNamespace(
        get_total_num_kv_heads=lambda: 1)), cfg)  # fmt: skip
    assert cache.t2_decision.startswith("off: T2 needs T1 (T1 off")


@pytest.mark.parametrize("argv, why", [
    (["plan", "--model-config", "/nonexistent/config.json"], "No such file"),
    (["plan", "--model-config", "{cfg}", "--tp", "0"], "--tp"),
    (["plan", "--model-config", "{cfg}", "--tier", "host"], "NAME=GB/s"),
    (["plan", "--model-config", "{cfg}", "--tier", "host=-1"], "finite number > 0"),
    (["plan", "--model-config", "{cfg}", "--flops", "nan"], "finite number"),
    (["plan", "--model-config", "{empty}"], "lacks"),
    (["route", "--workers", "http://127.0.0.1:1", "--port", "70000"], "65535"),
    (["route", "--workers", "http://127.0.0.1:1", "--redis", "http://x"], "redis://"),
    (["route", "--workers", "http://127.0.0.1:1", "--load-poll-ms", "-1"], ">= 0"),
    (["route", "--workers", "http://127.0.0.1:1", "--page-size", "0"], "below 1"),
    (["serve", "--tp", "0"], "below 1"),
])  # fmt: skip
def test_cli_bad_input_is_a_message_and_exit_2(argv, why, tmp_path, capsys):
    """Bad CLI input was a traceback (missing or malformed config, --tier host, --tp 0), nonsense
    with exit 0 (negative tokens or bandwidth), or a router on another port than printed."""
    from sglang_tiered import cli

    cfg = tmp_path / "config.json"
    cfg.write_text('{"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "intermediate_size": 128, '
                   '"vocab_size": 100}')  # fmt: skip
    (tmp_path / "empty.json").write_text("{}")
    argv = [a.format(cfg=cfg, empty=tmp_path / "empty.json") for a in argv]
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert why in capsys.readouterr().err


def test_eviction_never_takes_a_node_twice_at_page_size_1():
    """family-096 at 0.5 % and page size 1 (found by the page-size-1 family run): the victim
    queue's rebuild re-queued a leaf the running eviction had already held back, the leaf was
    taken twice, and SGLang's tree asserted ("parent does not have child key")."""
    from sglang_tiered.dev import workload_family as wf

    reqs = wf.generate(wf.draw(96))
    cache = TieredRadixCache.create_simulated(1722, 1)
    for r in reqs[:420]:  # (the crash was at request 412)
        cache.driver.run(r.tokens, tenant=r.tenant)
    cache.check_invariants()
