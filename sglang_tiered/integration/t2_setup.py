"""Build the T2 tier (Mooncake Store) behind a server's T1, and decide whether it pays off.

``mode=auto`` (default) measures this server's T2 round trip at start-up (a batched put and get of
``max_run_pages`` pages of this model's page size through the real store) and enables T2 only where
the slower direction beats the break-even bandwidth of recomputing (the same arithmetic as T1's:
KV bytes per token over the measured recompute time per token). ``on`` skips the comparison (the
measurement still runs and is reported), ``off`` disables it. T2 needs T1 (pages are staged
there) and TP = 1 (see sglang_tiered/tier/t2.py, Limits).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import re
import time

import torch

from sglang_tiered.integration.host_setup import break_even_gbps
from sglang_tiered.tier.host_pool import _mem_available
from sglang_tiered.tier.t2 import KEY_ROOT, T2Tier, t2_host_bytes
from sglang_tiered.tier.t2_client import MooncakeClient
from sglang_tiered.tier.t2_config import T2Config

logger = logging.getLogger("sglang_tiered")


# How long the start-up probe retries a put the store refused (review, session 43). A refused
# put is not a store that is down: Mooncake hands out replicas on every mounted segment, and a
# peer that died without unmounting (a server crashed and restarting, its old segment still
# listed) fails each transfer to it with -800 until the master drops it, 10 s later at its default
# (client_live_ttl_sec). The first probe put landed there and turned T2 off for the server's life
# (CI, twice: two servers starting together). A put that got no answer is not retried.
PROBE_RETRY_S = 15.0
PROBE_RETRY_PAUSE_S = 1.0


def measure_t2_gbps(t2: T2Tier, pages: int | None = None, *, retry_s: float = PROBE_RETRY_S) -> tuple[float, float]:
    """(write GB/s, read GB/s) of one batched run through the store, on throwaway keys. A put the
    store refused (any key) is tried again on fresh keys for up to ``retry_s``."""
    n = min(pages or t2.run, t2.run)
    ob = t2.obj_bytes
    tag = f"{KEY_ROOT}/probe/{os.getpid()}-{time.monotonic_ns()}"
    w, r = t2._write, t2._read[0]
    gen = torch.Generator()  # not the default one: SGLang's sampling RNG, seeded by --random-seed
    gen.manual_seed(0)
    w.buf[:n].random_(0, 255, generator=gen)
    pattern = f"^{re.escape(tag)}/"
    # through the tier's helpers, with its deadlines (review, session 41: called directly, a store
    # that accepted and did not answer held the launch for as long as Mooncake's own RPCs wait)
    size = n * ob
    end = time.monotonic() + retry_s
    try:
        for attempt in itertools.count():
            keys = [f"{tag}/{attempt}/{i}" for i in range(n)]  # (fresh: a refused put may have stored some)
            t0 = time.perf_counter()
            res = t2._call("probe put", t2.client.put, keys, [w.ptr + i * ob for i in range(n)], [ob] * n,
                           nbytes=size, staging=w)  # fmt: skip
            tw = time.perf_counter() - t0
            if res is not None and len(res) == n and all(x == 0 for x in res):
                break
            if res is not None and len(res) != n:  # (no store's answer for these keys: not a refusal)
                raise RuntimeError(f"T2 probe put failed: {len(res)} codes for {n} keys")
            why = "no answer" if res is None else sorted(set(res))
            if res is None or time.monotonic() + PROBE_RETRY_PAUSE_S > end:
                raise RuntimeError(f"T2 probe put failed: {why}" + (f" ({attempt + 1} tries)" if attempt else ""))
            logger.warning("sglang-tiered: T2 probe put refused (%s); trying again", why)
            time.sleep(PROBE_RETRY_PAUSE_S)
        t0 = time.perf_counter()
        got = t2._call("probe get", t2.client.get, keys, [r.ptr + i * ob for i in range(n)], [ob] * n,
                       nbytes=size, staging=r)  # fmt: skip
        tr = time.perf_counter() - t0
        if got is None:
            raise RuntimeError("T2 probe get failed: no answer")
        if any(x != ob for x in got) or not torch.equal(r.buf[:n], w.buf[:n]):
            raise RuntimeError("T2 probe read back other bytes than written")
    finally:
        # off this thread too; once more after the lease the get just took on them (Mooncake
        # refuses to remove them before: review, session 41, they stayed in the fleet's store, a
        # run of this model's objects per server start, until the master evicted them)
        t2._remove_async(pattern)
        t2.remove_after_lease(pattern, ("probe", tag))
    return n * ob / tw / 1e9, n * ob / tr / 1e9


def model_tag(cache_key) -> str:
    """Short hex naming the model identity in T2 keys (invalidation patterns); the page hash
    itself carries the full identity."""
    ident = f"{cache_key.model_id}|{cache_key.weights_digest}|{cache_key.kv_dtype}"
    return hashlib.blake2b(ident.encode(), digest_size=6).hexdigest()


def attach_t2(cache, cfg: T2Config, *, attach: bool = True) -> T2Tier:
    """A T2Tier over a real Mooncake client behind ``cache.t1.host`` (also for simulated caches)."""
    from sglang_tiered.config import cache_root

    tag = model_tag(cache.cache_key)
    t2 = T2Tier(MooncakeClient(cfg), cache.t1.host.pool, cache.t1.host.lock, cfg=cfg, model_tag=tag,
                value_of=cache.policy.counted_frequency, state_path=cache_root() / "t2" / f"{tag}.json")  # fmt: skip
    if attach:
        cache.t1.host.t2 = t2
        t2.start()
    return t2


def build_t2(cache, ctx, cfg: T2Config) -> str:
    """Attach a T2Tier to ``cache.t1.host``; returns the decision text (also in /cache/stats)."""
    if cfg.mode == "off":
        return "off: mode=off"
    if cache.t1 is None:
        return f"off: T2 needs T1 (T1 {cache.host_decision})"
    if ctx.tp_size > 1:
        decision = f"off: TP {ctx.tp_size} (T2 supports TP = 1; ranks would have to agree on every probe)"
        logger.warning("sglang-tiered: T2 %s", decision)
        return decision
    pp = int(getattr(getattr(ctx, "server_args", None), "pp_size", 1) or 1)
    if pp > 1:
        # each pipeline stage holds its own layers, and keys and headers name no stage: one
        # stage would take another's layers as its own (review, session 18)
        decision = f"off: --pp-size {pp} (T2 keys name no pipeline stage)"
        logger.warning("sglang-tiered: T2 %s", decision)
        return decision
    from sglang_tiered.tier.t2 import fetch_pages, object_bytes

    layout = cache.t1.host.pool.layout
    if fetch_pages(cfg, layout) < 1:
        # even one page's read (timeout_ms + its bytes at min_gbps) outlives half the lease: no
        # read would be covered by it (session 30: T2 then read one page at a time, unprotected)
        decision = (f"off: one page's read (timeout_ms={cfg.timeout_ms:g} + {object_bytes(layout)} bytes at "
                    f"min_gbps={cfg.min_gbps:g}) does not end within half of lease_ms={cfg.lease_ms}")  # fmt: skip
        logger.warning("sglang-tiered: T2 %s", decision)
        return decision
    need = t2_host_bytes(layout, cfg)
    avail = _mem_available()
    if avail is not None and need > 0.9 * avail:  # (T1's own rule, host_pool.py)
        decision = (f"off: T2 needs {need / 1e9:.2f} GB of host memory beside T1 (staging and store "
                    f"queue: max_run_pages={cfg.max_run_pages}, queue_pages={cfg.queue_pages}) but only "
                    f"{avail / 1e9:.2f} GB is available")  # fmt: skip
        logger.warning("sglang-tiered: T2 %s", decision)
        return decision
    t2 = None
    try:
        t2 = attach_t2(cache, cfg, attach=False)
        w_gbps, r_gbps = measure_t2_gbps(t2)
    except Exception as exc:  # noqa: BLE001 - T2 is an optimisation: serve without it
        if t2 is not None:
            t2.close(after_s=t2._lease_s())  # (once the probe's objects can be removed)
        decision = f"off: {cfg.url} unavailable ({exc})"
        logger.warning("sglang-tiered: T2 %s", decision)
        return decision
    k0 = cache.t1.host.k_buffers[0]
    be, why = break_even_gbps(ctx, cache.token_to_kv_pool_allocator.get_kvcache(), k0)
    slower = min(w_gbps, r_gbps)
    on = cfg.mode == "on" or be is None or slower > be
    decision = (f"{'on' if on else 'off'}: {cfg.url}, measured write {w_gbps:.2f} / read {r_gbps:.2f} GB/s"
                + (f" vs break-even {be:.2f} GB/s ({why})" if be is not None else f" ({why})")
                + (" [mode=on]" if cfg.mode == "on" else ""))  # fmt: skip
    if not on:
        t2.close(after_s=t2._lease_s())  # (once the probe's objects can be removed)
        logger.info("sglang-tiered: T2 %s", decision)
        return decision
    t2.decision = decision
    cache.t1.host.t2 = t2
    t2.start()
    logger.info("sglang-tiered: T2 %s", decision)
    return decision
