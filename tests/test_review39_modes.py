"""SGLang server modes that change how the tree cache is built or called (review, session 39).

1. PD disaggregation, decode side with its radix cache (``--disaggregation-mode decode
   --disaggregation-decode-enable-radix-cache``): SGLang's decode queue takes the match's
   ``host_hit_length`` as part of the prefix it promises prefill (``decode_prefix_len``,
   disaggregation/decode.py:1512 and decode_hicache_mixin.py:73-110), and only decode HiCache
   (``enable_decode_hicache``, scheduler.py:520-523) ever loads that span back
   (decode.py:2780-2880). T1's probe set it, so prefill skipped those tokens
   (prefill.py:437-441: ``start_send_idx = decode_prefix_len``) and decode ran on the never
   written slots of ``[l1, l1 + T1 hit)``: wrong KV. T1 (and T2 behind it) is now off there.
2. ``--enable-lmcache``, ``--enable-flexkv`` and ``--hicache-storage-backend``: SGLang's scheduler
   then calls HiCache/storage methods of the tree cache that a ``RadixCache`` lacks
   (``check_hicache_events`` every loop, scheduler.py:3883-3889; ``is_backuped`` for every request,
   :3342-3365). The server started and its scheduler died (after the model loaded, or on the
   first request). The launch now stops on them.
3. Speculative algorithms whose draft model keeps its own KV at the target's slots (STANDALONE,
   DFLASH, DSPARK, UNO; EAGLE-style ones already turn T1 off): T1 moves the target's KV only
   (SGLang's HiCache moves the draft's too: ``hicache_draft_plan``, kv_cache_builder.py:427-461),
   so a promoted page left the draft reading another sequence's draft KV at those slots.
"""

from __future__ import annotations

import types

import pytest

from sglang_tiered.config import ConfigError, check_server_args, load_config


def _args(**kw):
    return types.SimpleNamespace(**{"tp_size": 1, "pp_size": 1, "dp_size": 1, "tokenizer_worker_num": 1, **kw})


DECODE_RADIX = {"disaggregation_mode": "decode", "disaggregation_decode_enable_radix_cache": True}


# --- 1. PD decode with its radix cache ---------------------------------------------------------

def test_a_t1_hit_on_a_pd_decode_server_becomes_a_promise_to_prefill():
    """The mechanism, with SGLang's own decode-queue code: a T1 hit is counted in
    ``decode_prefix_len`` (what prefill is told decode already holds) although decode HiCache,
    the only thing that loads ``[l1, decode_prefix_len)``, is off."""
    from sglang.srt.disaggregation.decode_hicache_mixin import DecodeHiCachePreallocMixin
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sglang_tiered.dev.simulate import SimReq
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

    ps = 4
    cache = TieredRadixCache.create_simulated(16 * ps, ps, host_pages=32, verify_kv=True)
    prompt = list(range(1, 8 * ps + 2))
    cache.driver.run(prompt)
    cache.evict(EvictParams(num_tokens=16 * ps))  # the device tree's pages go to T1
    assert not cache.root_node.children and cache.host.pool.resident > 0

    req = SimReq("decode-1", prompt)
    # as match_kv_cache (mem_cache/common.py:221-268) does it for the decode queue (decode.py:867)
    result = cache.match_prefix(MatchPrefixParams(key=RadixKey(req.origin_input_ids, None), req=req))
    req.prefix_len, req.last_node = result.device_prefix_len, result.last_device_node
    queue = types.SimpleNamespace(tree_cache=cache, scheduler=types.SimpleNamespace(enable_decode_hicache=False))
    pm = DecodeHiCachePreallocMixin._build_decode_prefix_match(queue, req, result)
    # what decode.py:1512 sends prefill as decode_prefix_len, with nothing to fill the gap
    assert pm.l1_prefix_len == 0 and pm.decode_prefix_len == result.host_hit_length > 0


@pytest.mark.parametrize("sa", [
    DECODE_RADIX,
    # a prefill server that may switch to the decode role (role_switch.py) with the decode radix cache
    {"disaggregation_mode": "prefill", "enable_pd_role_switch": True, "disaggregation_decode_enable_radix_cache": True},
])  # fmt: skip
def test_pd_decode_with_its_radix_cache_turns_t1_off(sa):
    from sglang_tiered.integration.host_setup import PD_DECODE_OFF, build_host_tier

    cache = types.SimpleNamespace(is_eagle=False)  # nothing else is read before the decision
    ctx = types.SimpleNamespace(server_args=types.SimpleNamespace(speculative_algorithm=None, **sa))
    for mode in ("auto", "on"):
        assert build_host_tier(cache, ctx, load_config({"SGLANG_TIERED_HOST": mode})) == (None, PD_DECODE_OFF)


@pytest.mark.parametrize("env,says", [
    ({"SGLANG_TIERED_HOST": "on"}, "T1 on a PD decode server"),
    ({"SGLANG_TIERED_T2": "mooncake://127.0.0.1:50051"}, "T2 .* PD decode server"),
])  # fmt: skip
def test_pd_decode_with_t1_on_or_t2_stops_the_launch(env, says):
    with pytest.raises(ConfigError, match=says):
        check_server_args(load_config(env), _args(**DECODE_RADIX))
    check_server_args(load_config({}), _args(**DECODE_RADIX))  # auto: T1 turned off, nothing to stop
    # the decode radix cache off (SGLang's default: its own disabled cache), or a plain prefill server
    check_server_args(load_config(env), _args(disaggregation_mode="decode"))
    check_server_args(load_config(env), _args(disaggregation_mode="prefill",
                                              disaggregation_decode_enable_radix_cache=True))


# --- 2. SGLang's own storage tiers ------------------------------------------------------------

@pytest.mark.parametrize("sa,says", [
    ({"enable_lmcache": True}, "--enable-lmcache"),
    ({"enable_flexkv": True}, "--enable-flexkv"),
    ({"hicache_storage_backend": "file"}, "--hicache-storage-backend file"),
])  # fmt: skip
def test_sglangs_storage_tiers_stop_the_launch(sa, says):
    """Live before the fix (CPU, the tiny model): ``--enable-lmcache`` killed the scheduler on its
    first loop (``BasePrefixCache.check_hicache_events``: NotImplementedError) and
    ``--hicache-storage-backend file`` on the first request (``'TieredRadixCache' object has no
    attribute 'is_backuped'``)."""
    with pytest.raises(ConfigError, match=says):
        check_server_args(load_config({}), _args(**sa))
    check_server_args(load_config({}), _args(enable_lmcache=False, enable_flexkv=False, hicache_storage_backend=None))


def test_the_scheduler_calls_hicache_methods_a_radix_cache_lacks():
    """Why they cannot run: the methods SGLang's scheduler calls under these flags."""
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache

    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

    assert TieredRadixCache.check_hicache_events is BasePrefixCache.check_hicache_events  # raises
    assert not hasattr(TieredRadixCache, "is_backuped")


# --- 3. draft models with KV of their own -------------------------------------------------------

@pytest.mark.parametrize("algo", ["STANDALONE", "DFLASH", "DSPARK", "UNO"])
def test_a_draft_model_with_its_own_kv_turns_t1_off(algo):
    from sglang_tiered.integration.host_setup import DRAFT_KV_OFF, build_host_tier

    cache = types.SimpleNamespace(is_eagle=False)
    ctx = types.SimpleNamespace(server_args=types.SimpleNamespace(speculative_algorithm=algo))
    for mode in ("auto", "on"):
        assert build_host_tier(cache, ctx, load_config({"SGLANG_TIERED_HOST": mode})) == (None, DRAFT_KV_OFF)


@pytest.mark.parametrize("env,says", [
    ({"SGLANG_TIERED_HOST": "on"}, "T1 with --speculative-algorithm STANDALONE is not supported"),
    ({"SGLANG_TIERED_T2": "mooncake://127.0.0.1:50051"}, "T2 .* --speculative-algorithm STANDALONE"),
])  # fmt: skip
def test_a_draft_model_with_t1_on_or_t2_stops_the_launch(env, says):
    from sglang_tiered.integration.host_setup import draft_kv

    sa = _args(speculative_algorithm="STANDALONE")
    with pytest.raises(ConfigError, match=says):
        check_server_args(load_config(env), sa, draft_kv=draft_kv(sa))
    check_server_args(load_config({}), sa, draft_kv=draft_kv(sa))  # auto: T1 off
    for name in ("NGRAM", None):  # no draft model: no draft KV
        assert not draft_kv(_args(speculative_algorithm=name))
        check_server_args(load_config(env), _args(speculative_algorithm=name), draft_kv=False)


# --- 4. DP attention: the ranks that keep a tree are the attention-TP group --------------------

def test_dp_attention_ranks_keep_t1(monkeypatch):
    """``--tp 2 --dp 2 --enable-dp-attention`` (live on CPU, the tiny model, SGLANG_TIERED_HOST=on):
    each DP rank runs its own batch and tree on all 4 KV heads (attention TP 1), and every rank
    logged ``T1 disabled: rank 1 holds 4 KV heads, expected 2``: the cache took the global TP rank
    and size for the ranks that share its tree. SGLang's ``tp_cache_group`` is that group
    (``get_dp_tp_group``)."""
    import torch.distributed as dist

    from sglang_tiered.integration import build
    from sglang_tiered.integration.host_setup import build_host_tier
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

    group = object()  # DP rank 1's attention-TP group: one rank
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda g=None: 0 if g is group else 1)
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: 1 if g is group else 2)
    cache = TieredRadixCache.create_simulated(64, 4, verify_kv=True)  # 2 KV heads, all on this rank
    ctx = types.SimpleNamespace(tp_rank=1, tp_size=2, params=types.SimpleNamespace(tp_cache_group=group),
                                server_args=types.SimpleNamespace(pp_size=1, dp_size=2, speculative_algorithm=None),
                                model_config=types.SimpleNamespace(get_total_num_kv_heads=lambda: 2))  # fmt: skip
    assert build.tree_ranks(ctx) == (0, 1)
    cache.tp_rank, cache.tp_size = build.tree_ranks(ctx)  # as from_build_context builds it
    tier, decision = build_host_tier(cache, ctx, load_config({"SGLANG_TIERED_HOST": "on"}))
    assert tier is not None, decision
    assert tier.heads == range(0, 2)
    # without a process group (one rank, tests): the context's TP rank and size
    assert build.tree_ranks(types.SimpleNamespace(tp_rank=0, tp_size=1, params=types.SimpleNamespace())) == (0, 1)


def test_host_gb_is_the_servers_total_over_data_parallel_replicas():
    """SGLANG_TIERED_HOST_GB is the server's total: with --dp-size each replica's TP ranks keep a
    private T1 each, so the budget is split over tp x dp processes (under DP attention the TP ranks
    are all of them). Before session 39 it was split over --tp-size only: --dp-size 4 took four
    times the budget."""
    from types import SimpleNamespace as NS

    from sglang_tiered.integration.host_setup import t1_share

    def ctx(tp, dp, dpa=False):
        return NS(tp_size=tp, server_args=NS(dp_size=dp, enable_dp_attention=dpa))

    assert t1_share(ctx(1, 1)) == 1 and t1_share(ctx(2, 1)) == 2
    assert t1_share(ctx(2, 4)) == 8 and t1_share(ctx(1, 4)) == 4
    assert t1_share(ctx(4, 4, dpa=True)) == 4  # DP attention: tp ranks, each its own tree and T1
    assert t1_share(NS(tp_size=2, server_args=None)) == 2
