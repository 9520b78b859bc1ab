"""sglang-tiered options (environment variables, validated before the model loads).

SGLang's launcher has no hook for plugin CLI flags, so the options are environment variables with
units in their names; the plugin validates them in the launcher process at registration and stops
the launch with a clear message if one is bad.

| variable | default | meaning |
|---|---|---|
| SGLANG_TIERED_HOST | auto | T1 host tier: on, off, or auto (on only where the start-up measurement says a host->device copy beats recomputing) |
| SGLANG_TIERED_HOST_RATIO | 4.0 | T1 size as a multiple of the device KV pool (ignored when HOST_GB is set); finite, (0, 1024] |
| SGLANG_TIERED_HOST_GB | unset | T1 size in GB (1e9 bytes); finite, > 0, at most the machine's physical memory |
| SGLANG_TIERED_HOST_NAME | unset | name of the shared-memory segment; set it to keep T1 across restarts (also at another TP degree) |
| SGLANG_TIERED_TENANT_HEADER | unset | trusted request header that sets the tenant (e.g. x-tenant-id) |
| SGLANG_TIERED_DEBUG | 0 | 1: check tree and tier invariants after every operation |
| SGLANG_TIERED_STORE | async | T1 writes: async (a value-ordered store queue drained by a worker thread, off the request path) or sync (copy at eviction) |
| SGLANG_TIERED_STORE_QUEUE_PAGES | unset | pending-write bound of the store queue, in pages (default: the device pool's pages, at least 64) |
| SGLANG_TIERED_INDEX_URL | unset | fleet hint index: redis://HOST:PORT/DB; rank 0 publishes the page hashes it holds |
| SGLANG_TIERED_SERVER_ID | unset | this server's id in the index (required with INDEX_URL): the URL routers reach it at |
| SGLANG_TIERED_INDEX_TTL_S | 30 | seconds until a silent server's entries are ignored (heartbeat) and expire; finite, [1, 86400] |
| SGLANG_TIERED_T2 | unset | fleet DRAM tier behind T1: mooncake://MASTER_HOST:PORT?options (segment_mb, mode=auto/on/off, min_freq, queue_pages, max_run_pages, timeout_ms, protocol, device, local_hostname, metadata; sglang_tiered/tier/t2_config.py) |
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from sglang_tiered.tier.t2_config import T2Config, T2ConfigError, parse_t2_url


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class TieredConfig:
    host_mode: str = "auto"
    host_ratio: float = 4.0
    host_gb: float | None = None
    host_name: str | None = None
    tenant_header: str | None = None
    debug: bool = False
    store: str = "async"
    store_queue_pages: int | None = None
    index_url: str | None = None
    server_id: str | None = None
    index_ttl_s: float = 30.0
    t2: T2Config | None = None


# Upper bounds that catch typos and absurd values at launch (a T1 bigger than these is not a
# configuration any machine can honour; the real fit is checked again against free memory when
# T1 is built, where a T1 that does not fit is turned off with one warning).
MAX_HOST_RATIO = 1024.0
MAX_HOST_GB = 1e6  # 1 PB


def _physical_gb() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        return None


def _float(env, name, default, upper):
    v = env.get(name)
    if v is None or v.strip() == "":
        return default
    try:
        f = float(v)
    except ValueError:
        raise ConfigError(f"{name}={v!r}: expected a number") from None
    if not math.isfinite(f):
        raise ConfigError(f"{name}={v!r}: must be a finite number")
    if not f > 0:
        raise ConfigError(f"{name}={v!r}: must be > 0")
    if f > upper:
        raise ConfigError(f"{name}={v!r}: must be <= {upper:g}")
    return f


def load_config(env=None) -> TieredConfig:
    env = os.environ if env is None else env
    mode = env.get("SGLANG_TIERED_HOST", "auto").strip().lower()
    if mode not in ("auto", "on", "off"):
        raise ConfigError(f"SGLANG_TIERED_HOST={mode!r}: expected auto, on or off")
    name = env.get("SGLANG_TIERED_HOST_NAME") or None
    if name is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        raise ConfigError(f"SGLANG_TIERED_HOST_NAME={name!r}: use 1-64 letters, digits, '.', '_' or '-'")
    header = env.get("SGLANG_TIERED_TENANT_HEADER") or None
    if header is not None and not re.fullmatch(r"[A-Za-z0-9-]{1,64}", header):
        raise ConfigError(f"SGLANG_TIERED_TENANT_HEADER={header!r}: not a valid header name")
    debug = env.get("SGLANG_TIERED_DEBUG", "0").strip()
    if debug not in ("0", "1"):
        raise ConfigError(f"SGLANG_TIERED_DEBUG={debug!r}: expected 0 or 1")
    store = env.get("SGLANG_TIERED_STORE", "async").strip().lower()
    if store not in ("async", "sync"):
        raise ConfigError(f"SGLANG_TIERED_STORE={store!r}: expected async or sync")
    qp = env.get("SGLANG_TIERED_STORE_QUEUE_PAGES", "").strip()
    if qp and not (qp.isdigit() and 1 <= int(qp) <= 1 << 30):
        raise ConfigError(f"SGLANG_TIERED_STORE_QUEUE_PAGES={qp!r}: expected a whole number of pages in [1, 2^30]")
    host_gb = _float(env, "SGLANG_TIERED_HOST_GB", None, MAX_HOST_GB)
    phys = _physical_gb()
    if host_gb is not None and phys and host_gb > phys:
        raise ConfigError(f"SGLANG_TIERED_HOST_GB={host_gb:g}: more than this machine's memory ({phys:.1f} GB)")
    index_url = env.get("SGLANG_TIERED_INDEX_URL") or None
    server_id = env.get("SGLANG_TIERED_SERVER_ID") or None
    if index_url is not None:
        if not re.fullmatch(r"rediss?://[A-Za-z0-9_.\[\]:@%-]+(/[0-9]{1,2})?", index_url):
            raise ConfigError(f"SGLANG_TIERED_INDEX_URL={index_url!r}: expected redis://HOST:PORT[/DB]")
        if server_id is None:
            raise ConfigError("SGLANG_TIERED_INDEX_URL is set but SGLANG_TIERED_SERVER_ID is not")
    if server_id is not None and not re.fullmatch(r"[A-Za-z0-9_.:/\[\]-]{1,200}", server_id):
        raise ConfigError(f"SGLANG_TIERED_SERVER_ID={server_id!r}: use up to 200 URL-safe characters")
    ttl = _float(env, "SGLANG_TIERED_INDEX_TTL_S", 30.0, 86400.0)
    if ttl < 1:
        raise ConfigError(f"SGLANG_TIERED_INDEX_TTL_S={ttl:g}: must be >= 1")
    t2 = None
    t2_url = (env.get("SGLANG_TIERED_T2") or "").strip()
    if t2_url:
        try:
            t2 = parse_t2_url(t2_url)
        except T2ConfigError as exc:
            raise ConfigError(str(exc)) from None
    return TieredConfig(
        t2=t2,
        host_mode=mode,
        host_ratio=_float(env, "SGLANG_TIERED_HOST_RATIO", 4.0, MAX_HOST_RATIO),
        host_gb=host_gb,
        host_name=name,
        tenant_header=header,
        debug=debug == "1",
        store=store,
        store_queue_pages=int(qp) if qp else None,
        index_url=index_url,
        server_id=server_id,
        index_ttl_s=ttl,
    )
