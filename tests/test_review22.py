"""Findings of the session-22 review (cache identity and T1's CUDA path), each with the test that
failed before its fix."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from sglang_tiered.core.keys import client_extra_key
from sglang_tiered.integration.http import rewrite_body

HEX32 = st.text("0123456789abcdef", min_size=32, max_size=32)


@given(base=st.text(min_size=1), mine=st.one_of(st.just(""), st.text(min_size=1)), lora=HEX32)
def test_a_client_extra_key_never_equals_a_lora_requests_key(base, mine, lora):
    """SGLang's Req: extra_key = (extra_key or "") + lora_id. A base-model request with
    extra_key = an adapter's id (computable from /v1/models) shared the adapter's namespace and
    wrote base-model KV into it; the client's key is now rewritten so that cannot happen."""
    adapter_request = (client_extra_key(mine) if mine else "") + lora
    assert client_extra_key(base) != adapter_request


@given(a=st.text(min_size=1), b=st.text(min_size=1))
def test_client_extra_keys_stay_apart(a, b):
    assert (client_extra_key(a) == client_extra_key(b)) == (a == b)


def test_the_middleware_rewrites_extra_key_on_every_route_that_carries_it():
    lora = "0" * 32
    for path in ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/invocations"):
        out = json.loads(rewrite_body(json.dumps({"text": "hi", "extra_key": lora}).encode(), path, None))
        assert out["extra_key"] == f"client:{lora}:"
    out = json.loads(rewrite_body(json.dumps({"text": ["a", "b"], "extra_key": ["k", ""]}).encode(), "/generate", None))
    assert out["extra_key"] == ["client:k:", ""]
    raw = json.dumps({"text": "hi", "extra_key": ""}).encode()
    assert rewrite_body(raw, "/generate", None) == raw  # empty: SGLang's None, left alone
    raw = json.dumps({"text": "hi", "extra_key": 5}).encode()
    assert rewrite_body(raw, "/generate", None) == raw  # not a string: SGLang refuses it


def _t2_server(store, page):
    from sglang_tiered.core.store_queue import StoreQueue
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache
    from sglang_tiered.tier.t2 import T2Tier
    from sglang_tiered.tier.t2_config import T2Config

    c = TieredRadixCache.create_simulated(8 * page, page, host_pages=8, verify_kv=True, debug_checks=True)
    cfg = T2Config(master="127.0.0.1:1", queue_pages=64, max_run_pages=8, timeout_ms=30_000, lease_ms=0)
    t2 = T2Tier(store, c.host.pool, c.host.lock, cfg=cfg, model_tag="m")
    t2.start()
    t2.queue.close()
    t2.queue = StoreQueue(cfg.queue_pages, t2._put_job, threaded=False)
    t2.MISS_MEMO_S = 0.0
    c.host.t2 = t2
    return c, t2


def test_kv_of_a_weight_update_session_never_reaches_t1_or_t2(monkeypatch):
    """Between begin_weight_update and end_weight_update the weights change with no load call
    (P2P/RDMA writes). KV computed then was stored under the old identity and evicted into T2,
    where a peer still on the old weights was served it. The session now pauses T1/T2."""
    from types import SimpleNamespace as NS

    from sglang_tiered.dev import simulate
    from sglang_tiered.integration import hooks
    from tests.test_t2 import ByteStore

    page = 16
    store = ByteStore()
    a, ta = _t2_server(store, page)
    prompt = lambda i: [1000 * (i + 1) + j for j in range(4 * page)]  # noqa: E731
    manager = NS(scheduler=NS(tree_cache=a))
    hooks._before_begin_weight_update(manager, NS(selector=None))
    assert a.t1.paused and a.weight_session
    old = simulate.expected_kv
    monkeypatch.setattr(simulate, "expected_kv", lambda *x, **k: old(*x, **k) + 4096.0)  # new weights
    for i in range(6):  # served during the session: device evictions, nothing to T1 or T2
        a.driver.run(prompt(i))
    ta.flush()
    ta.queue.drain()
    assert ta.stats.stored_pages == 0 and a.host.pool.resident == 0
    hooks.weight_update_hook("end_weight_update")(lambda m, r: None, manager, NS(weight_version=None))
    assert a.weight_session is None and a.t1.paused  # the device tree still holds session KV
    monkeypatch.setattr(simulate, "expected_kv", old)  # a peer on the old weights, same identity
    b, _ = _t2_server(store, page)
    assert b.driver.run(prompt(0)).cached_len == 0  # (verify_kv: any hit is checked against recompute)
    # an update inside the session (a load call) does not resume T1 before the session ends
    c, _ = _t2_server(ByteStore(), page)
    manager_c = NS(scheduler=NS(tree_cache=c))
    hooks._before_begin_weight_update(manager_c, NS(selector=None))
    hooks.weight_update_hook("update_weights_from_disk")(lambda m, r: None, manager_c, NS(weight_version=None))
    assert c.t1.paused and c.weight_session
    hooks.weight_update_hook("end_weight_update")(lambda m, r: None, manager_c, NS(weight_version=None))
    assert c.t1.paused is None and c.weight_session is None  # empty tree: re-seeded and resumed
    c.check_invariants()


def test_t1_is_off_with_pipeline_parallelism_even_when_private():
    """Each PP stage decides its own T1 hits: a private T1 per stage was allowed, and stages that
    held different pages would prefill different lengths of one request."""
    import types

    from sglang_tiered.config import load_config
    from sglang_tiered.integration.host_setup import build_host_tier
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

    cache = TieredRadixCache.create_simulated(8 * 4, 4, host_pages=8)
    ctx = types.SimpleNamespace(tp_size=1, tp_rank=0, server_args=types.SimpleNamespace(pp_size=2),
                                model_config=types.SimpleNamespace(get_total_num_kv_heads=lambda: 2))  # fmt: skip
    tier, decision = build_host_tier(cache, ctx, load_config({"SGLANG_TIERED_HOST": "on"}))
    assert tier is None and decision.startswith("off: --pp-size 2")


def _tier(heads=2, d=8, ps=4, layers=2, v_d=None):
    from types import SimpleNamespace

    import torch

    from sglang_tiered.tier.host_tier import HostTier

    kvc = SimpleNamespace(k_buffer=[torch.randn(10 * ps, heads, d) for _ in range(layers)],
                          v_buffer=[torch.randn(10 * ps, heads, v_d or d) for _ in range(layers)])  # fmt: skip
    tier = HostTier.build(kvc, page_size=ps, total_kv_heads=heads, tp_size=1, tp_rank=0, capacity_pages=8, name=None)
    return tier, kvc


def test_out_of_range_ids_are_a_clean_miss_not_a_write_into_the_next_plane():
    """The kernels do not check bounds: on the Triton path a page id one past the K plane wrote
    into the V plane (review, session 22). Ids are checked before every transfer."""
    import torch

    tier, kvc = _tier()
    assert tier.demote(torch.tensor([1]), [b"a" * 16]) == 1
    before = [t.clone() for t in kvc.k_buffer + kvc.v_buffer]
    assert not tier.load([b"a" * 16], torch.tensor([10]))  # one past the last device page
    assert tier.stats.failed_promotions == 1
    assert all(torch.equal(a, b) for a, b in zip(before, kvc.k_buffer + kvc.v_buffer))
    assert tier.demote(torch.tensor([12]), [b"b" * 16]) == 0 and tier.stats.failed_demotions == 1
    assert not tier.pool.contains(b"b" * 16)
    tier.pool.check_invariants()


def test_a_pool_t1_cannot_move_is_refused_at_build():
    """V planes shaped unlike K (SGLang's MHA pool allows v_head_dim != head_dim) passed set-up
    and then failed every transfer with T1 reported on."""
    import pytest

    with pytest.raises(ValueError, match="share"):
        _tier(v_d=4)


def test_t1_follows_sglang_replacing_its_buffer_lists():
    """SGLang reallocates by assigning new lists (memory_pool.py); T1 kept the old tensors."""
    import torch

    tier, kvc = _tier()
    assert tier.demote(torch.tensor([1]), [b"a" * 16]) == 1
    kvc.k_buffer = [torch.zeros_like(t) for t in kvc.k_buffer]
    kvc.v_buffer = [torch.zeros_like(t) for t in kvc.v_buffer]
    assert tier.load([b"a" * 16], torch.tensor([3]))
    assert kvc.k_buffer[0][12:16].abs().sum() > 0 and kvc.v_buffer[1][12:16].abs().sum() > 0


def test_an_invalidated_tenant_is_not_put_into_t2_by_a_racing_store():
    """T1.invalidate cancelled T2's queue before dropping the tenant's T1 pages: a store running
    for another tenant in between evicted one of them into T2's queue, after the cancel."""
    import torch

    from sglang_tiered.core.tenants import name_hash
    from tests.test_t2 import ByteStore

    page = 16
    store = ByteStore()
    a, t2 = _t2_server(store, page)
    acme = name_hash("acme")
    prompt = lambda i: [1000 * (i + 1) + j for j in range(4 * page)]  # noqa: E731
    for i in range(5):  # 20 pages through an 8-page device: acme's pages fill T1 (8 pages)
        a.driver.run(prompt(i), tenant="acme")
    host = a.host
    assert host.pool.tenant_pages().get(acme, 0) > 0
    real_drop = host.drop_tenant

    def racing_drop(tenant):  # the other tenant's store runs just before the drop
        other = [bytes([9, i]) * 8 for i in range(4)]
        host.demote(torch.tensor([1, 2, 3, 4]), other, tenant=name_hash("other"))
        return real_drop(tenant)

    host.drop_tenant = racing_drop
    a.t1.invalidate(acme, everything=False)
    t2.flush()
    t2.queue.drain()
    prefix = f"{acme & (2**64 - 1):016x}/"
    assert not [k for k in store.objects if prefix in k], "an invalidated tenant's page reached T2"
