"""Build the T1 host tier for a running server, and decide whether it pays off (seed R1).

With ``SGLANG_TIERED_HOST=auto`` a short shadow measurement at start-up compares this machine's
host->device copy bandwidth with the break-even bandwidth of this model (KV bytes per token per
rank over the measured recompute time per token); T1 is enabled only where it wins. Every TP rank
measures, and they agree on the most conservative answer (all-reduce MIN), so all ranks keep
identical trees. ``on``/``off`` override the measurement. The decision is logged and reported in
``/cache/stats`` (tiers[].decision).
"""

from __future__ import annotations

import logging
import time

import torch

from sglang_tiered.config import pd_decode_radix
from sglang_tiered.core.planner import estimate_params, recompute_s_per_token_of
from sglang_tiered.tier.host_pool import HostPoolError, PoolLayout
from sglang_tiered.tier.host_tier import HostTier

logger = logging.getLogger("sglang_tiered")


def measure_copy_gbps(device: torch.device, nbytes: int = 64 << 20, reps: int = 3) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src)  # warm up
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=device.type == "cuda")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def measure_flops(device: torch.device, dtype: torch.dtype, n: int = 512, reps: int = 3) -> float:
    # a generator of its own: the default one is SGLang's sampling RNG, seeded by --random-seed
    # before the cache is built (drawing from it shifted every sampled token of the server)
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    a = torch.randn(n, n, device=device, generator=gen).to(dtype)
    b = torch.randn(n, n, device=device, generator=gen).to(dtype)
    (a @ b).sum().item()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        (a @ b).sum().item()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def _agree(value: int, group) -> int:
    if group is None:
        return value
    try:
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return int(t.item())
    except Exception:  # noqa: BLE001 - no process group: single rank
        return value


def tp_agreement(group):
    """``HostTier.agree`` for a TP group: True when every rank says True (None without a group)."""
    if group is None:
        return None
    return lambda ok: _agree(1 if ok else 0, group) == 1


def break_even_gbps(ctx, kv, k0) -> tuple[float | None, str]:
    """Bandwidth above which loading a token's KV (this rank's bytes) beats recomputing it on this
    device (seed section 6, as in plan()); (None, why) when the model size is unknown. Shared by
    T1 (host->device copy) and T2 (the fleet store's round trip, integration/t2_setup.py)."""
    hf = ctx.model_config.hf_config
    hf_dict = hf.to_dict() if hasattr(hf, "to_dict") else dict(vars(hf))
    try:
        params = estimate_params(hf_dict)
    except KeyError:
        params = None
    if not params:
        return None, "model size unknown"
    flops = measure_flops(k0.device, k0.dtype if k0.dtype.is_floating_point else torch.bfloat16)
    kv_bytes = 2 * len(kv.k_buffer) * k0.shape[1] * k0.shape[2] * k0.element_size()  # this rank
    recompute_s = recompute_s_per_token_of(params, flops, max(1, ctx.tp_size))
    return kv_bytes / recompute_s / 1e9, (f"recompute {recompute_s * 1e6:.1f} us/token at "
                                          f"{flops / 1e9:.0f} GFLOP/s, {kv_bytes} KV bytes/token/rank")  # fmt: skip


def _auto_decision(ctx, kv, k0) -> tuple[bool, str]:
    """SGLANG_TIERED_HOST=auto: measure host->device copy bandwidth against this model's
    break-even bandwidth (seed R1); every TP rank agrees on the most conservative answer."""
    on = True
    gbps = measure_copy_gbps(k0.device)
    be, why = break_even_gbps(ctx, kv, k0)
    if be is not None:
        on = gbps > be
        decision = f"{'on' if on else 'off'}: measured copy {gbps:.1f} GB/s vs break-even {be:.2f} GB/s ({why})"
    else:
        decision = f"on: measured copy {gbps:.1f} GB/s; {why}, assuming T1 wins"
    agreed = _agree(1 if on else 0, getattr(ctx.params, "tp_cache_group", None))
    if agreed != (1 if on else 0):
        on = bool(agreed)
        decision += f" (overridden by another TP rank: {'on' if on else 'off'})"
    return on, decision


def store_queue_pages(cfg, device_pages: int) -> int:
    """The store queue's bound (``SGLANG_TIERED_STORE_QUEUE_PAGES``; default: the device pool: a
    pending page is a device page, so it binds only when half the pool waits for T1, and then
    one-shots are filtered and value-drop runs)."""
    return cfg.store_queue_pages or max(64, device_pages)


def staging_pages(cfg, device_pages: int, t1_pages: int) -> int:
    """Slots beyond T1's capacity for write-ahead copies (``HostPool.reserve_staging``): with the
    store queue, the queue's bound or a sixteenth of T1 (at least 64 pages), whichever is less,
    and never more than a quarter of T1 (a small ``SGLANG_TIERED_HOST_GB`` budget keeps most of
    its pages for T1); none with the synchronous store."""
    if cfg.store != "async":
        return 0
    return min(store_queue_pages(cfg, device_pages), max(64, t1_pages // 16), t1_pages // 4)


BIGRAM_OFF = "off: EAGLE-style speculative decoding keys the tree by bigrams, which T1 cannot serve"
PD_DECODE_OFF = ("off: a PD decode server's radix cache (SGLang promises prefill the host hits, which only its "
                 "HiCache loads back)")
DRAFT_KV_OFF = "off: the speculative draft model keeps KV of its own at the target's slots, which T1 does not move"


def draft_kv(server_args) -> bool:
    """Whether this server's speculative algorithm runs a draft model whose KV sits at the target's
    slots in a pool of its own (STANDALONE, DFLASH, DSPARK, UNO, EAGLE-style ones, a plugin's;
    not NGRAM, which has no draft model). T1 moves the target's KV only (SGLang's HiCache moves
    the draft's too: ``hicache_draft_plan``, mem_cache/kv_cache_builder.py:427-461), so a page
    promoted from T1 left the draft reading another sequence's KV at those slots (review,
    session 39). An unknown name is SGLang's to refuse."""
    algo = speculative_algorithm(server_args)
    return algo is not None and bool(algo.is_speculative()) and not bool(getattr(algo, "is_ngram", lambda: False)())


def speculative_algorithm(server_args):
    """SGLang's ``SpeculativeAlgorithm`` of ``--speculative-algorithm``; None without one, or for
    a name SGLang does not know (SGLang's to refuse)."""
    name = getattr(server_args, "speculative_algorithm", None)
    if not name:
        return None
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    try:
        return SpeculativeAlgorithm.from_string(name)
    except ValueError:
        return None


def t1_share(ctx) -> int:
    """How many private T1s the server's ``SGLANG_TIERED_HOST_GB`` is split over: one per GPU
    process, i.e. ``--tp-size`` under ``--enable-dp-attention`` (its TP ranks are all the
    processes) and ``--tp-size`` x ``--dp-size`` otherwise (each data-parallel replica runs
    ``--tp-size`` ranks). Before session 39 the split was over ``--tp-size`` only: ``--dp-size 8``
    took eight times the budget (each replica checked the memory it found free alone)."""
    sa = getattr(ctx, "server_args", None)
    tp = max(1, int(ctx.tp_size or 1))
    if getattr(sa, "enable_dp_attention", False):
        return tp
    return tp * max(1, int(getattr(sa, "dp_size", 1) or 1))


def build_host_tier(cache, ctx, cfg):
    """Return (HostTier or None, decision text)."""
    if cfg.host_mode == "off":
        return None, "off: SGLANG_TIERED_HOST=off"
    if cache.is_eagle:
        # EAGLE-style speculative decoding keys the tree by bigrams (SGLang's match_prefix turns the
        # key into a bigram view in place), which T1's probe and load-back do not build: T1 was
        # written (every eviction copied its pages) and never read (review, session 25)
        return None, BIGRAM_OFF
    sa = getattr(ctx, "server_args", None)
    if pd_decode_radix(sa):
        # SGLang's decode queue promises prefill a T1 hit it never loads (config.pd_decode_radix):
        # decode ran on unwritten KV (review, session 39)
        return None, PD_DECODE_OFF
    if draft_kv(sa):
        return None, DRAFT_KV_OFF
    kv = cache.token_to_kv_pool_allocator.get_kvcache()
    if not hasattr(kv, "k_buffer") or not hasattr(kv, "v_buffer"):
        return None, f"off: unsupported KV pool {type(kv).__name__} (MHA pools only)"
    scales = ("k_scale_buffer", "v_scale_buffer", "native_k_scale_buffer", "native_v_scale_buffer")
    if any(getattr(kv, a, None) is not None for a in scales):
        # quantized KV with per-token scales beside the data (e.g. --kv-cache-dtype mxfp8): T1
        # moves the data only, so a promoted page would meet another page's scales (review,
        # session 18)
        return None, f"off: KV pool {type(kv).__name__} keeps scales beside the data (not moved by T1)"
    k0 = kv.k_buffer[0]
    if k0.dim() != 3:
        return None, f"off: KV pool {type(kv).__name__} has {k0.dim()}-D buffers ([token, head, dim] only)"
    ps = cache.page_size
    total_heads = ctx.model_config.get_total_num_kv_heads()
    name = cfg.host_name
    # A named T1 is one file of every head for all ranks; without a name each TP rank keeps a
    # private T1 of its own heads (HostTier.build), and SGLANG_TIERED_HOST_GB is the server's
    # total, split evenly over the ranks (``t1_share``).
    rank_heads = total_heads if (name or cache.tp_size == 1) else k0.shape[1]
    share = 1 if name else t1_share(ctx)
    layout = PoolLayout(1, len(kv.k_buffer), rank_heads, ps, k0.shape[2], str(k0.dtype).replace("torch.", ""))
    device_pages = cache.capacity_tokens // ps
    pages = int(cfg.host_gb * 1e9 / share // layout.page_bytes) if cfg.host_gb else int(device_pages * cfg.host_ratio)
    staging = staging_pages(cfg, device_pages, pages)
    if cfg.host_gb:  # the memory budget holds the staging slots too
        pages -= staging
    if pages <= 0:
        if cfg.host_mode == "on":  # asked for explicitly: fail before serving, not silently off
            from sglang_tiered.config import ConfigError

            raise ConfigError(f"SGLANG_TIERED_HOST=on but T1 rounds to zero pages of {layout.page_bytes} bytes "
                              f"(SGLANG_TIERED_HOST_GB={cfg.host_gb}, SGLANG_TIERED_HOST_RATIO={cfg.host_ratio} "
                              f"of {device_pages} device pages): give it more, or SGLANG_TIERED_HOST=auto")
        return None, "off: host tier size rounds to zero pages"

    decision = "on: SGLANG_TIERED_HOST=on"
    on = True
    if cfg.host_mode == "auto":
        on, decision = _auto_decision(ctx, kv, k0)
    if not on:
        logger.info("sglang-tiered: T1 %s", decision)
        return None, decision

    dp = int(getattr(getattr(ctx, "server_args", None), "dp_size", 1) or 1)
    pp = int(getattr(getattr(ctx, "server_args", None), "pp_size", 1) or 1)
    if pp > 1:
        # Each pipeline stage runs its own tree, store queue and T1, and no vote spans the stages:
        # stages holding different T1 pages would prefill different lengths of one request and
        # hand on hidden states of the wrong shape (review, session 22; a named T1 would also be
        # mapped by every stage with a layout of its own layers: session 18).
        decision = f"off: --pp-size {pp} is not supported (pipeline stages would decide T1 hits separately)"
        logger.warning("sglang-tiered: T1 %s", decision)
        return None, decision
    if dp > 1 and name:
        # Data-parallel ranks run independent trees; one shared T1 would have several writers
        # that do not see each other's slot choices (a slot could be overwritten mid-read).
        decision = f"off: --dp-size {dp} with a named (shared) T1 is not supported"
        logger.warning("sglang-tiered: T1 %s", decision)
        return None, decision
    fence = fs = None
    if k0.is_cuda:
        fs = ctx.tp_worker.model_runner.forward_stream
        fence = fs.synchronize
    try:
        # the ranks that share this tree split its KV heads (build.tree_ranks: attention TP under
        # DP attention)
        tier = HostTier.build(kv, page_size=ps, total_kv_heads=total_heads, tp_size=cache.tp_size,
                              tp_rank=cache.tp_rank, capacity_pages=pages, name=name, stream_fence=fence,
                              staging_pages=staging)  # fmt: skip
    except (HostPoolError, ValueError) as exc:
        logger.warning("sglang-tiered: T1 disabled: %s", exc)
        return None, f"off: {exc}"
    tier.forward_stream = fs  # the stream whose kernels write the KV (T1Tier._ready_event)
    restored = tier.pool.resident
    decision += f"; {pages} pages ({pages * layout.page_bytes / 1e9:.2f} GB)"
    if name:
        decision += f" in shared memory {tier.pool.path}" + (f", {restored} pages restored" if restored else "")
    logger.info("sglang-tiered: T1 %s", decision)
    tier.decision = decision
    return tier, decision
