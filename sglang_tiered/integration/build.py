"""Construction of a ``TieredRadixCache``: from SGLang's build context (a server), or simulated.

The adapter's classmethods delegate here, so the adapter holds SGLang's overrides only.
"""

from __future__ import annotations

import logging
from typing import Optional

from sglang_tiered.core.keys import CacheKey
from sglang_tiered.core.policy import PolicyConfig

logger = logging.getLogger("sglang_tiered")


def from_build_context(cls, ctx):
    """The cache SGLang's ``create_tree_cache`` builds for ``--radix-cache-backend tiered``."""
    from sglang_tiered.config import hashed_tenant_labels, load_config, policy_config
    from sglang_tiered.integration.identity import cache_key_from_context, lifetime_tag

    cfg = load_config()
    key = cache_key_from_context(ctx, versions=cfg.identity_versions, tenant_header=cfg.tenant_header,
                                prefix_attention=cfg.prefix_attention)
    tp_rank, tp_size = tree_ranks(ctx)
    cache = cls(ctx.params, cache_key=key, tp_rank=tp_rank, tp_size=tp_size, debug_checks=cfg.debug,
                policy_config=policy_config(cfg))
    # stats and metrics name a tenant by its salt's digest unless a trusted header names it
    cache.tenants.hashed = hashed_tenant_labels(cfg)
    if cfg.index_url:
        # the index reads identity hashes; only each tree's first rank publishes (below), but
        # every rank keys its pages alike: keys of another kind would sample other estimates and
        # the ranks' trees would decide apart (T1 is on for every rank or none: setup_host_tier)
        cache.use_identity("the fleet index")
    setup_host_tier(cache, ctx, cfg)
    rank = hint_rank(ctx, tp_rank, tp_size)
    if cfg.index_url and rank is not None:  # a tree's ranks are identical: its first publishes
        from sglang_tiered.fleet.publisher import IndexPublisher

        from sglang_tiered.integration.identity import startup_adapters

        cache.attach_index(IndexPublisher.from_config(cfg, key, adapters=startup_adapters(ctx.server_args), rank=rank))
    sa = ctx.server_args
    cache.weight_version = str(getattr(sa, "weight_version", "") or "")
    # after a weight update the identity names this server's lifetime (on_weights_updated): the
    # same on every TP rank (one launcher), unique per start, and apart for engines of one process
    cache.lifetime_tag = lifetime_tag(sa)
    cache.invalidation.versions = {
        "model_id": key.model_id,
        "weights_digest": key.weights_digest,
        "weight_version": cache.weight_version,
    }
    return cache


def tree_ranks(ctx) -> tuple[int, int]:
    """(rank, size) among the ranks that keep this tree: SGLang's ``tp_cache_group``
    (``get_dp_tp_group``, kv_cache_builder.py:402 and layers/dp_attention.py:502-509: the
    attention-TP group under DP attention, else the TP group). Under ``--enable-dp-attention`` each
    DP rank runs its own batch and tree, and its KV heads are split over the attention-TP ranks
    only; with the global TP rank and size, T1 expected ``heads / tp`` heads on a rank holding
    ``heads / attn_tp`` and was turned off even with SGLANG_TIERED_HOST=on, and only DP rank 0
    published metrics (review, session 39). ``ctx``'s TP rank and size without a group."""
    group = getattr(getattr(ctx, "params", None), "tp_cache_group", None)
    if group is not None:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                return dist.get_rank(group), dist.get_world_size(group)
        except Exception:  # noqa: BLE001 - no usable group: the TP rank and size
            pass
    return ctx.tp_rank, ctx.tp_size


def hint_rank(ctx, tree_rank: int, tree_size: int) -> Optional[str]:
    """Which of the server's trees this rank publishes the hint index for (``holder_field``): ""
    for its first, ``dp<replica>.<attention DP rank>`` for another; None when this rank is not
    its tree's first (its tree's first publishes). Each DP rank under DP attention, and each
    data-parallel replica, keeps a tree of its own; before session 40 only the global TP rank 0
    published (DP attention: only DP rank 0's pages were in the index), and each replica's TP
    rank 0 under one field, withdrawing and clearing each other's claims."""
    if tree_rank != 0:
        return None
    attn_dp = int(ctx.tp_rank) // max(1, int(tree_size))  # (SGLang's rank layout: attention TP fastest)
    replica = 0
    try:
        from sglang.srt.runtime_context import get_parallel

        replica = int(get_parallel().dp_rank or 0)
    except Exception:  # noqa: BLE001 - no data-parallel controller (or another SGLang): one replica
        replica = 0
    return f"dp{replica}.{attn_dp}" if replica or attn_dp else ""


def setup_host_tier(cache, ctx, cfg) -> None:
    """Build T1 where it pays off (host_setup.py) and its store queue."""
    from sglang_tiered.integration.host_setup import build_host_tier, store_queue_pages
    from sglang_tiered.integration.t1 import make_store_queue

    host, cache.host_decision = build_host_tier(cache, ctx, cfg)
    if cache.tp_size > 1:
        # every rank has T1, or none: a rank that could not build it (its memory check, a named
        # T1's owner lock taken by another rank) left the ranks deciding T1 hits apart (review,
        # session 23). Every rank gets here, whatever it decided (all decide alike but for errors).
        from sglang_tiered.integration.host_setup import tp_agreement

        agree = tp_agreement(getattr(ctx.params, "tp_cache_group", None))
        if agree is not None and not agree(host is not None) and host is not None:
            host.pool.close()
            host = None
            cache.host_decision = "off: another TP rank could not build T1"
            logger.warning("sglang-tiered: T1 %s", cache.host_decision)
        if host is not None and agree is not None:
            host.agree = agree
            logger.info("sglang-tiered: T1: the %d TP ranks agree on every transfer's outcome", cache.tp_size)
    if host is None:
        if cfg.t2 is not None:  # (T2 stages its pages in T1: review, session 18, it said "unset")
            cache.t2_decision = f"off: T2 needs T1 (T1 {cache.host_decision})"
            logger.warning("sglang-tiered: T2 %s", cache.t2_decision)
        return
    store = None
    if cfg.store == "async":
        pages = store_queue_pages(cfg, cache.capacity_tokens // cache.page_size)
        # TP ranks' T1s (one named file, or a private one each) must make identical slot and
        # drop decisions, so with TP > 1
        # the queue drains at the end of every batch in the scheduler thread (same point on
        # every rank) instead of on a free-running worker whose timing differs per rank.
        # On CPU a worker thread only competes with the forward pass for the GIL and the cores
        # (measured: TTFT p50 x1.6 on the demo workload), so there the queue drains at the
        # end of each batch too; the worker thread is for CUDA, where the copy runs on a side
        # stream while the forward pass runs.
        threaded = cache.tp_size == 1 and host.k_buffers[0].is_cuda
        store = make_store_queue(host, pages, threaded=threaded)
    cache.attach_host(host, store)
    if cfg.t2 is not None:  # T2 (fleet store) behind T1: integration/t2_setup.py
        from sglang_tiered.integration.t2_setup import build_t2

        cache.t2_decision = build_t2(cache, ctx, cfg.t2)


def create_simulated(cls, capacity_tokens: int, page_size: int = 16, policy_config: Optional[PolicyConfig] = None,
                     cache_key: Optional[CacheKey] = None, max_request_tokens: int = 1 << 17,
                     debug_checks: bool = False, host_pages: int = 0, verify_kv: bool = False,
                     store_queue_pages: int = 0, max_in_flight: int = 1):  # fmt: skip
    """See ``TieredRadixCache.create_simulated``."""
    from sglang_tiered.dev.simulate import CacheDriver, make_params

    params, alloc, pool = make_params(capacity_tokens, page_size, max_request_tokens,
                                      with_kv=bool(host_pages or verify_kv))  # fmt: skip
    cache = cls(params, cache_key=cache_key, policy_config=policy_config,
                capacity_tokens=alloc.size, debug_checks=debug_checks, max_in_flight=max_in_flight)  # fmt: skip
    if host_pages:
        from sglang_tiered.integration.t1 import make_store_queue
        from sglang_tiered.tier.host_tier import HostTier

        kv = alloc.get_kvcache()
        host = HostTier.build(kv, page_size=page_size, total_kv_heads=kv.head_num, tp_size=1, tp_rank=0,
                              capacity_pages=host_pages, name=None, staging_pages=store_queue_pages)  # fmt: skip
        cache.host_decision = host.decision = "on: simulated"
        # written by drain() after every request (deterministic)
        store = make_store_queue(host, store_queue_pages, threaded=False) if store_queue_pages else None
        cache.attach_host(host, store)
    cache.driver = CacheDriver(cache, alloc, pool, verify_kv=verify_kv)
    return cache
