"""sglang-tiered options: one frozen, validated ``TieredConfig``, and the only reader of the environment.

SGLang's launcher has no hook for plugin CLI flags, so the options are environment variables with
units in their names; the plugin validates them in the launcher process at registration and stops
the launch with a clear message if one is bad (``ConfigError``). ``load_config()`` parses the
environment; ``TieredConfig.__post_init__`` validates every field, so a config built in code
(tests, benchmarks) is held to the same rules.

| variable | field | default |
|---|---|---|
| SGLANG_TIERED_HOST | ``host_mode`` | auto |
| SGLANG_TIERED_HOST_RATIO | ``host_ratio`` | 4.0 |
| SGLANG_TIERED_HOST_GB | ``host_gb`` | unset |
| SGLANG_TIERED_HOST_NAME | ``host_name`` | unset |
| SGLANG_TIERED_TENANT_HEADER | ``tenant_header`` | unset |
| SGLANG_TIERED_TENANT_LABELS | ``tenant_labels`` (hashed/raw) | hashed without a tenant header, else raw |
| SGLANG_TIERED_IDENTITY_VERSIONS | ``identity_versions`` (on/off) | on |
| SGLANG_TIERED_DEBUG | ``debug`` | 0 |
| SGLANG_TIERED_STORE | ``store`` | async |
| SGLANG_TIERED_STORE_QUEUE_PAGES | ``store_queue_pages`` | unset |
| SGLANG_TIERED_INDEX_URL | ``index_url`` | unset |
| SGLANG_TIERED_SERVER_ID | ``server_id`` | unset |
| SGLANG_TIERED_INDEX_TTL_S | ``index_ttl_s`` | 30 |
| SGLANG_TIERED_PREFIX_ATTENTION | ``prefix_attention`` (on/off) | off |
| SGLANG_TIERED_GUARANTEE | ``guarantee`` (lru/budget/strict/leader) | strict |
| SGLANG_TIERED_LRU_TREE_PAGES | ``lru_tree_pages`` | unset (2^21) |
| SGLANG_TIERED_T2 | ``t2`` (``tier/t2_config.py``: mooncake://MASTER_HOST:PORT?options) | unset |
| SGLANG_TIERED_SHM_DIR | ``shm_dir()`` (named T1 segments and their locks) | /dev/shm |
| SGLANG_TIERED_CACHE, XDG_CACHE_HOME | ``cache_root()`` (tiny models, weight digests) | ~/.cache/sglang-tiered |

Not configuration, and so not here: ``SGLANG_TIERED_T1_OWNER`` (tier/host_pool.py), the token a
launcher hands its own scheduler processes to prove it owns a named T1; and the client library's
``KV_CACHE_*`` knobs (client.py), read in the client's process, not the server's.

Fail fast (``load_config``): any other ``SGLANG_TIERED_*`` name is refused with the nearest known
one (a mistyped ``SGLANG_TIERED_HOST_GBS`` would otherwise leave T1 at its default size, silently),
and so is an option that does nothing in the chosen setup: ``SERVER_ID`` or ``INDEX_TTL_S``
without ``INDEX_URL``, ``STORE_QUEUE_PAGES`` with ``STORE=sync``, a T1 size, name or store with
``HOST=off``, and ``HOST_RATIO`` beside ``HOST_GB`` (which overrides it). An option set to an
empty or blank value is the same as one left unset, for every option (``SGLANG_TIERED_X= cmd``).
"""

from __future__ import annotations

import math
import os
import pathlib
import re
from typing import Literal, Optional

import msgspec

from sglang_tiered.tier.t2_config import T2Config, T2ConfigError, parse_t2_url


class ConfigError(ValueError):
    pass


# Upper bounds that catch typos and absurd values at launch (a T1 bigger than these is not a
# configuration any machine can honour; the real fit is checked again against free memory when
# T1 is built, where a T1 that does not fit is turned off with one warning).
MAX_HOST_RATIO = 1024.0
MAX_HOST_GB = 1e6  # 1 PB
MAX_STORE_QUEUE_PAGES = 1 << 30
MAX_INDEX_TTL_S = 86400.0
MAX_LRU_TREE_PAGES = 1 << 26  # about 10 GB of host memory for lru's tree and its page sets

ENV = {  # field -> environment variable
    "host_mode": "SGLANG_TIERED_HOST",
    "host_ratio": "SGLANG_TIERED_HOST_RATIO",
    "host_gb": "SGLANG_TIERED_HOST_GB",
    "host_name": "SGLANG_TIERED_HOST_NAME",
    "tenant_header": "SGLANG_TIERED_TENANT_HEADER",
    "tenant_labels": "SGLANG_TIERED_TENANT_LABELS",
    "identity_versions": "SGLANG_TIERED_IDENTITY_VERSIONS",
    "debug": "SGLANG_TIERED_DEBUG",
    "store": "SGLANG_TIERED_STORE",
    "store_queue_pages": "SGLANG_TIERED_STORE_QUEUE_PAGES",
    "index_url": "SGLANG_TIERED_INDEX_URL",
    "server_id": "SGLANG_TIERED_SERVER_ID",
    "index_ttl_s": "SGLANG_TIERED_INDEX_TTL_S",
    "t2": "SGLANG_TIERED_T2",
    "prefix_attention": "SGLANG_TIERED_PREFIX_ATTENTION",
    "guarantee": "SGLANG_TIERED_GUARANTEE",
    "lru_tree_pages": "SGLANG_TIERED_LRU_TREE_PAGES",
}


# Names of the SGLANG_TIERED_ namespace that are not options of this table but are read elsewhere
# (the launcher's own tokens, file locations, the test and benchmark harnesses); anything else in
# the namespace is a mistake and stops the launch.
OTHER_NAMES = {
    "SGLANG_TIERED_SHM_DIR": "shm_dir()",
    "SGLANG_TIERED_CACHE": "cache_root()",
    "SGLANG_TIERED_T1_OWNER": "tier/host_pool.py: the launcher's ownership token",
    "SGLANG_TIERED_LIFETIME_ID": "lifetime_id(): one server's run",
    "SGLANG_TIERED_SOAK_REQUESTS": "tests/test_e2e_hardening.py (make soak)",
    "SGLANG_TIERED_FUZZ_REQUESTS": "tests/test_e2e_hardening.py (make soak)",
    "SGLANG_TIERED_FUZZ_SAMPLING": "tests/test_e2e_hardening.py (make soak)",
    "SGLANG_TIERED_IN_NETNS": "bench/t2_fleet.py: set inside its loopback-only namespace",
    "SGLANG_TIERED_WORKER_API_KEY": "sglang-tiered route --worker-api-key (the router's, not a server's)",
    "SGLANG_TIERED_ROUTER_ADMIN_KEY": "sglang-tiered route --admin-api-key (the router's, not a server's)",
    "SGLANG_TIERED_PURE_PYTHON": "core/keys.py: 1 runs the pure-Python references, not the optional C extensions (page hashes, the duel's miniatures, the sketch, the tree shadows)",
}
PREFIX = "SGLANG_TIERED_"
HEADER_NAME = re.compile(r"[A-Za-z0-9-]{1,64}")  # a tenant header's name (the servers' and the router's)
RESERVED_HEADERS = frozenset((
    "authorization", "proxy-authorization", "cookie", "set-cookie", "host", "content-length", "content-type",
    "content-encoding", "transfer-encoding", "connection", "keep-alive", "upgrade", "te", "trailer", "expect",
    "x-api-key", "api-key", "accept", "accept-encoding", "user-agent", "origin", "referer",
))  # fmt: skip


class TieredConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Every option of the backend. Frozen; validated on construction (``ConfigError``)."""

    # T1 host tier. "auto": on only where the start-up measurement says a host->device copy beats
    # recomputing (integration/host_setup.py); "on"/"off" override it. Recommended: auto.
    host_mode: Literal["auto", "on", "off"] = "auto"
    # T1 size as a multiple of the device KV pool (pages), when host_gb is unset. Finite, (0, 1024].
    # Sizing: T1 is a victim buffer; 2-8x the device pool covers the reuse distances of the
    # Mooncake trace (bench/results/trace_replay.csv). Recommended: 4.
    host_ratio: float = 4.0
    # T1 size in GB (1e9 bytes); overrides host_ratio. Finite, > 0, at most the machine's memory
    # (checked by load_config). Recommended: what the host can spare after the model's own RAM.
    host_gb: Optional[float] = None
    # Name of the shared-memory segment holding T1 (1-64 of [A-Za-z0-9_.-]). Set it to keep T1
    # across restarts (also at another TP degree). Default: unnamed (private to this server).
    host_name: Optional[str] = None
    # Trusted request header that sets the tenant (e.g. x-tenant-id); unset: clients' cache_salt.
    tenant_header: Optional[str] = None
    # How stats and metrics name a tenant. "hashed": a digest of its cache_salt (``salt~`` and 16
    # hex digits; ``core.tenants.salt_label``): a client's salt is its secret, and /metrics and
    # /cache/stats must not hand it to whoever reads them (review, session 22). "raw": the salt
    # itself. Default (None): hashed without a tenant header; raw with one (the names are then
    # the gateway's, not secrets). Recommended: the default.
    tenant_labels: Optional[Literal["hashed", "raw"]] = None
    # Whether the cache identity holds the software that computed the KV: the versions of sglang,
    # torch and sglang-tiered (``integration/identity.py``). On, a named T1 kept across an upgrade
    # or a T2 shared during a rolling upgrade never serves KV computed by other code. Off, servers
    # of different versions share pages (only if their kernels' numerics are known to agree).
    # Recommended: on.
    identity_versions: bool = True
    # Check tree and tier invariants after every operation (slow: O(tree) per call). Default off.
    debug: bool = False
    # T1 writes: "async" (a value-ordered store queue, off the request path) or "sync" (copy at
    # eviction). Recommended: async.
    store: Literal["async", "sync"] = "async"
    # Pending-write bound of the store queue, in pages, [1, 2^30]. Default (None): the device
    # pool's pages, at least 64 (a pending page is a device page, so more can never be pending).
    store_queue_pages: Optional[int] = None
    # Fleet hint index, redis://HOST:PORT[/DB]; rank 0 publishes the page hashes it holds.
    index_url: Optional[str] = None
    # This server's id in the index (the URL routers reach it at); required with index_url.
    server_id: Optional[str] = None
    # Seconds until a silent server's index entries are ignored (heartbeat) and expire, [1, 86400].
    # Sizing: a few heartbeats (one per ttl/3); too short drops live servers under load.
    index_ttl_s: float = 30.0
    # T2, the fleet DRAM tier behind T1 on Mooncake Store (tier/t2.py): parsed and validated from
    # mooncake://MASTER_HOST:PORT?options by tier/t2_config.py (each option with unit, default and
    # bounds there). Unset: no T2.
    t2: Optional[T2Config] = None
    # torch_native extend attention over new rows only for requests with a cached prefix
    # (integration/prefix_attention.py): SGLang's own computes seq_len^2 attention per request, so a
    # cached 2k prefix still costs a recompute's attention on CPU. Equal up to summation order,
    # not bitwise, hence off by default. Recommended: on for CPU servers with long shared prefixes.
    prefix_attention: bool = False
    # The policy's bound against SGLang's lru (core/policy.py, the safety duel). "strict" (the
    # default): the loss budget and the divergence cap, which prices every page of lru's cache the
    # real cache drops at a whole hit (PolicyConfig.guard_div_cap): the bound holds up to a
    # counted overshoot (README, "The strict guarantee"). "budget": the loss budget with a priced
    # switch back only (wins about twice as much over lru, and on the family's tiny caches has
    # lost up to 0.26 points). "leader": no bound; follow whichever of SGLang's orders has hit most
    # (PolicyConfig.guard_leader): the most wins over lru and the most losses (README, "Follow the
    # leader"). "lru": SGLang's lru order itself, request for request, whatever the traffic (no
    # learned policy; T1, T2, the identity and the control plane as ever). "strict" is that too on
    # a server that may run more than one request at once (PolicyConfig.max_in_flight, from
    # SGLang's request pool): a burst of copies there makes any divergence's loss unbounded
    # (README, "Requests in flight together"; session 34).
    guarantee: Literal["lru", "budget", "strict", "leader"] = "strict"
    # The largest device pool, in pages, beside which the policy keeps SGLang lru's tree itself
    # (PolicyConfig.lru_tree_pages): the strict guarantee's yardstick. Above it the duel runs on
    # sampled page models and the strict guarantee is off (the stats say so). [0, 2^26]; None: the
    # policy's default, 2^21 pages (about 300 MB of host memory at that size, 150 bytes a page).
    lru_tree_pages: Optional[int] = None

    def __post_init__(self) -> None:
        if self.host_mode not in ("auto", "on", "off"):
            _bad("host_mode", self.host_mode, "expected auto, on or off")
        _positive("host_ratio", self.host_ratio, MAX_HOST_RATIO)
        if self.host_gb is not None:
            _positive("host_gb", self.host_gb, MAX_HOST_GB)
        if self.host_name is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.host_name):
            _bad("host_name", self.host_name, "use 1-64 letters, digits, '.', '_' or '-'")
        if self.host_name is not None and self.host_name.endswith((".json", ".lock", ".init")):
            # T1 "x" keeps its layout, owner and open lock in "x.json", "x.lock" and "x.init"
            _bad("host_name", self.host_name, "a name ending in .json, .lock or .init is another T1's file")
        if self.tenant_header is not None and not HEADER_NAME.fullmatch(self.tenant_header):
            _bad("tenant_header", self.tenant_header, "not a valid header name")
        if self.tenant_header is not None and self.tenant_header.lower() in RESERVED_HEADERS:
            # its values would be tenant names in stats and metrics (an API key, a cookie), or it
            # means something else to every hop (a helper's audit, session 37)
            _bad("tenant_header", self.tenant_header, "a standard HTTP header, not a tenant's name")
        if self.tenant_labels not in (None, "hashed", "raw"):
            _bad("tenant_labels", self.tenant_labels, "expected hashed or raw")
        if not isinstance(self.identity_versions, bool):
            _bad("identity_versions", self.identity_versions, "expected on or off")
        if self.store not in ("async", "sync"):
            _bad("store", self.store, "expected async or sync")
        _whole("store_queue_pages", self.store_queue_pages, 1, MAX_STORE_QUEUE_PAGES)
        if not isinstance(self.prefix_attention, bool):
            _bad("prefix_attention", self.prefix_attention, "expected on or off")
        if self.guarantee not in ("lru", "budget", "strict", "leader"):
            _bad("guarantee", self.guarantee, "expected lru, budget, strict or leader")
        _whole("lru_tree_pages", self.lru_tree_pages, 0, MAX_LRU_TREE_PAGES)
        if self.t2 is not None and self.host_mode == "off":  # T2 pages are staged in T1
            _bad("host_mode", self.host_mode, "SGLANG_TIERED_T2 is set and T2 needs T1: unset one of them")
        self._check_index()

    def _check_index(self) -> None:
        if self.index_url is not None:
            if not re.fullmatch(r"rediss?://[A-Za-z0-9_.\[\]:@%-]+(/[0-9]{1,2})?", self.index_url):
                _bad("index_url", self.index_url, "expected redis://HOST:PORT[/DB]")
            from urllib.parse import urlsplit

            try:  # what redis-py will read (review, session 21: a bad port failed on every publish)
                parts = urlsplit(self.index_url)
                port = parts.port
            except ValueError as exc:
                _bad("index_url", self.index_url, f"expected redis://HOST:PORT[/DB] ({exc})")
            if not parts.hostname:
                _bad("index_url", self.index_url, "no host: expected redis://HOST:PORT[/DB]")
            if port is not None and not 1 <= port <= 65535:
                _bad("index_url", self.index_url, "the port must be in [1, 65535]")
            if self.server_id is None:
                raise ConfigError("SGLANG_TIERED_INDEX_URL is set but SGLANG_TIERED_SERVER_ID is not")
        if self.server_id is not None and not re.fullmatch(r"[A-Za-z0-9_.:/\[\]-]{1,200}", self.server_id):
            _bad("server_id", self.server_id, "use up to 200 URL-safe characters")
        _positive("index_ttl_s", self.index_ttl_s, MAX_INDEX_TTL_S)
        if self.index_ttl_s < 1:
            _bad("index_ttl_s", self.index_ttl_s, "must be >= 1")


def _bad(field: str, value, why: str):
    raise ConfigError(f"{ENV[field]}={value!r}: {why}")


def _whole_why(lo: int, hi: int) -> str:
    return f"expected a whole number of pages in [{lo}, 2^{hi.bit_length() - 1}]"


def _whole(field: str, value, lo: int, hi: int) -> None:
    """An optional whole number of pages in [lo, hi] (hi a power of two)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi):
        _bad(field, value, _whole_why(lo, hi))


def _given(env, field: str) -> Optional[str]:
    """``field``'s variable, stripped; None when unset, empty or blank. One rule for every option:
    ``SGLANG_TIERED_X= cmd`` is the same as leaving X unset (some options took an empty value as
    unset and others refused it; a helper's hunt, session 32)."""
    v = env.get(ENV[field])
    return (v.strip() or None) if v is not None else None


def _pages(env, field: str, lo: int, hi: int) -> Optional[int]:
    v = _given(env, field) or ""
    if v and not (v.isascii() and v.isdigit()):  # (str.isdigit takes "²", which int() refuses)
        raise ConfigError(f"{ENV[field]}={v!r}: {_whole_why(lo, hi)}")
    return int(v) if v else None


def _positive(field: str, value, upper: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _bad(field, value, "expected a number")
    if not math.isfinite(value):
        _bad(field, value, "must be a finite number")
    if not value > 0:
        _bad(field, value, "must be > 0")
    if value > upper:
        _bad(field, value, f"must be <= {upper:g}")


def _physical_gb() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        return None


def _float(env, field: str) -> Optional[float]:
    v = _given(env, field)
    if v is None:
        return None
    try:
        return float(v)
    except ValueError:
        raise ConfigError(f"{ENV[field]}={v!r}: expected a number") from None


def _text(env, field: str) -> Optional[str]:
    return _given(env, field)


def _on_off(env, field: str, default: str) -> bool:
    v = (_given(env, field) or default).lower()
    if v not in ("on", "off"):
        raise ConfigError(f"{ENV[field]}={v!r}: expected on or off")
    return v == "on"


def _t2(env) -> Optional[T2Config]:
    url = _given(env, "t2") or ""
    if not url:
        return None
    try:
        return parse_t2_url(url)
    except T2ConfigError as exc:
        raise ConfigError(str(exc)) from None


def load_config(env=None) -> TieredConfig:
    """Parse the environment (``os.environ`` unless given) into a validated ``TieredConfig``."""
    env = os.environ if env is None else env
    _check_names(env)
    debug = _given(env, "debug") or "0"
    if debug not in ("0", "1"):
        raise ConfigError(f"SGLANG_TIERED_DEBUG={debug!r}: expected 0 or 1")
    labels = (_given(env, "tenant_labels") or "").lower() or None
    fields = {
        "host_mode": (_given(env, "host_mode") or "auto").lower(),
        "host_ratio": _float(env, "host_ratio"),
        "host_gb": _float(env, "host_gb"),
        "host_name": _text(env, "host_name"),
        "tenant_header": _text(env, "tenant_header"),
        "tenant_labels": labels,
        "identity_versions": _on_off(env, "identity_versions", "on"),
        "debug": debug == "1",
        "store": (_given(env, "store") or "async").lower(),
        "store_queue_pages": _pages(env, "store_queue_pages", 1, MAX_STORE_QUEUE_PAGES),
        "index_url": _text(env, "index_url"),
        "server_id": _text(env, "server_id"),
        "index_ttl_s": _float(env, "index_ttl_s"),
        "t2": _t2(env),
        "prefix_attention": _on_off(env, "prefix_attention", "off"),
        "guarantee": (_given(env, "guarantee") or "strict").lower(),
        "lru_tree_pages": _pages(env, "lru_tree_pages", 0, MAX_LRU_TREE_PAGES),
    }
    cfg = TieredConfig(**{k: v for k, v in fields.items() if v is not None or k in ("host_gb", "tenant_labels")})
    phys = _physical_gb()
    if cfg.host_gb is not None and phys and cfg.host_gb > phys:
        raise ConfigError(f"SGLANG_TIERED_HOST_GB={cfg.host_gb:g}: more than this machine's memory ({phys:.1f} GB)")
    return cfg


def _check_names(env) -> None:
    """Every ``SGLANG_TIERED_*`` name set is known, and every option set does something."""
    import difflib

    known = set(ENV.values()) | set(OTHER_NAMES)
    for name in sorted(k for k in env if k.startswith(PREFIX) and k not in known):
        # (matched on what follows the prefix, which every name shares)
        near = difflib.get_close_matches(name[len(PREFIX):], sorted(k[len(PREFIX):] for k in known), n=1, cutoff=0.6)
        hint = f" (did you mean {PREFIX}{near[0]}?)" if near else ""
        raise ConfigError(f"{name} is not an sglang-tiered option{hint}; the options: {', '.join(ENV.values())}")

    def given(field: str) -> bool:
        return _given(env, field) is not None

    def value(field: str, default: str) -> str:
        return (_given(env, field) or default).lower()

    useless = []
    if not given("index_url"):
        useless += [(f, "SGLANG_TIERED_INDEX_URL is not set (no fleet index)") for f in ("server_id", "index_ttl_s")]
    if value("store", "async") == "sync":
        useless.append(("store_queue_pages", "SGLANG_TIERED_STORE=sync has no store queue"))
    if value("host_mode", "auto") == "off":
        # (STORE and STORE_QUEUE_PAGES say how T1 is written: review, session 39)
        useless += [(f, "SGLANG_TIERED_HOST=off (no T1)")
                    for f in ("host_ratio", "host_gb", "host_name", "store", "store_queue_pages")]  # fmt: skip
    elif given("host_gb"):
        useless.append(("host_ratio", "SGLANG_TIERED_HOST_GB sets T1's size and overrides it: set one"))
    for field, why in useless:
        if given(field):
            raise ConfigError(f"{ENV[field]}={env[ENV[field]]!r} does nothing here: {why}")


def check_server_args(cfg: TieredConfig, server_args, bigram_keys: bool = False, draft_kv: bool = False) -> None:
    """What the environment cannot tell alone: options that SGLang's own arguments make unusable
    (``server_args``: SGLang's ``ServerArgs``, read by attribute; ``bigram_keys``: its speculative
    algorithm keys the radix tree by bigrams, EAGLE-style, as SGLang's ``is_eagle`` says). Called in
    the launcher before any scheduler starts (integration/hooks.py), so these fail before the model
    loads instead of being turned off with a warning in every scheduler. ``draft_kv``: its
    speculative algorithm runs a draft model with KV of its own (integration/host_setup.py
    ``draft_kv``)."""
    def arg(name: str) -> int:
        return int(getattr(server_args, name, 1) or 1)

    tp, pp, dp = arg("tp_size"), arg("pp_size"), arg("dp_size")
    # SGLang options this backend does not take: before, each stopped a scheduler after the model
    # loaded (the last) or was ignored without a word (the first: a 1,001-token prefix at priority
    # 10 stayed in stock SGLang's cache and not in ours; a helper's hunt, session 32)
    policy = getattr(server_args, "radix_eviction_policy", None) or "lru"
    if policy != "lru" and not getattr(server_args, "_radix_eviction_policy_explicitly_set", True):
        # a model's own serving default (SGLang sets priority for Qwen3-VL on large Hopper GPUs,
        # unless the flag was given): the launch goes on, and says which order it keeps
        import logging

        logging.getLogger("sglang_tiered").warning(
            "sglang-tiered: SGLang's model defaults chose --radix-eviction-policy %s; the tiered backend "
            "keeps its own eviction order (give --radix-eviction-policy lru to silence this)", policy)
    elif policy != "lru":
        raise ConfigError(f"--radix-eviction-policy {policy} is not supported with --radix-cache-backend tiered, "
                          "which brings its own eviction order (never below SGLang's lru by more than noise; "
                          "README, 'The strict guarantee'): drop the flag, or set SGLANG_TIERED_GUARANTEE=leader "
                          "to follow whichever of SGLang's lru, slru and lfu leads, or use SGLang's own backend")  # fmt: skip
    if getattr(server_args, "enable_hierarchical_cache", False):
        raise ConfigError("--radix-cache-backend tiered brings its own host tier (T1): drop "
                          "--enable-hierarchical-cache (SGLANG_TIERED_HOST sizes T1)")  # fmt: skip
    if getattr(server_args, "enable_streaming_session", False):
        raise ConfigError("--enable-streaming-session is not supported with --radix-cache-backend tiered (SGLang "
                          "runs streaming sessions on its own UnifiedRadixCache only): drop it; sessions without "
                          "it work")  # fmt: skip
    # SGLang's own host/storage tiers and session cache: its registry hands a named backend the
    # build alone, so with ours LMCache and FlexKV were never built, and under these flags its
    # scheduler calls HiCache methods of the tree cache that a RadixCache lacks
    # (``check_hicache_events`` on every loop, scheduler.py:3883-3889; ``is_backuped`` for every
    # request, :3342-3365): the server started and its scheduler died after the model loaded
    # (lmcache, flexkv) or on the first request (a storage backend); SGLang's create_tree_cache
    # refuses a session radix cache on any tree but its UnifiedRadixCache, after the model loaded
    # (review, session 39)
    for name, flag in (("enable_lmcache", "--enable-lmcache"), ("enable_flexkv", "--enable-flexkv"),
                       ("enable_session_radix_cache", "--enable-session-radix-cache")):  # fmt: skip
        if getattr(server_args, name, False):
            raise ConfigError(f"{flag} is not supported with --radix-cache-backend tiered, which brings its own "
                              "host tier (T1) and fleet store (T2): drop it, or use SGLang's own backend")  # fmt: skip
    storage = getattr(server_args, "hicache_storage_backend", None)
    if storage:
        raise ConfigError(f"--hicache-storage-backend {storage} is not supported with --radix-cache-backend tiered "
                          "(it is HiCache's storage tier; T2, SGLANG_TIERED_T2, is this backend's): drop it")  # fmt: skip
    if cfg.prefix_attention:
        # the prefix-aware extend attention replaces SGLang's torch_native backend only
        # (integration/prefix_attention.py): beside another one (intel_amx, SGLang's CPU default
        # on x86) the option did nothing, in silence
        attn = getattr(server_args, "prefill_attention_backend", None) or getattr(server_args, "attention_backend", None)
        if attn is not None and attn != "torch_native":
            _bad("prefix_attention", "on", f"it replaces the torch_native attention backend, and this server's "
                 f"prefill runs on {attn}: add --attention-backend torch_native or unset it")  # fmt: skip
    t1 = cfg.host_mode != "off"
    algo = getattr(server_args, "speculative_algorithm", None)
    for why, off in ((f"--speculative-algorithm {algo}", not bigram_keys and draft_kv),
                     ("a PD decode server with --disaggregation-decode-enable-radix-cache", pd_decode_radix(server_args))):  # fmt: skip
        if not off:
            continue
        # T1 would serve wrong KV there (integration/host_setup.py turns it off under auto)
        if cfg.host_mode == "on":
            what = f"T1 with {why}" if why.startswith("--") else f"T1 on {why}"
            _bad("host_mode", cfg.host_mode, f"{what} is not supported: use SGLANG_TIERED_HOST=auto or off")
        if cfg.t2 is not None:
            raise ConfigError(f"SGLANG_TIERED_T2 is set and T2 (which stages pages in T1) is not supported with "
                              f"{why}: unset it")  # fmt: skip
    if t1 and cfg.host_name is not None:
        for size, flag, why in ((pp, "--pp-size", "every pipeline stage would map the one segment with its own layers"),
                                (dp, "--dp-size", "data-parallel ranks would write one segment unseen by each other")):
            if size > 1:
                _bad("host_name", cfg.host_name, f"a named (shared) T1 with {flag} {size} is not supported ({why}); "
                     "unset it for a private T1 per rank")  # fmt: skip
    if cfg.host_mode == "on" and pp > 1:
        # each stage decides its own T1 hits (its own tree, store queue and T1): stages that hold
        # different pages prefill different lengths and hand on hidden states of the wrong shape
        # (review, session 22); with auto, T1 is turned off for PP (integration/host_setup.py)
        _bad("host_mode", cfg.host_mode, f"T1 with --pp-size {pp} is not supported (pipeline stages would "
             "decide T1 hits separately): use SGLANG_TIERED_HOST=auto or off")  # fmt: skip
    if bigram_keys:
        # T1 cannot serve a bigram-keyed tree (integration/host_setup.py turns it off under auto)
        algo = getattr(server_args, "speculative_algorithm", None)
        if cfg.host_mode == "on":
            _bad("host_mode", cfg.host_mode, f"T1 with --speculative-algorithm {algo} is not supported (the tree's "
                 "keys are bigrams, which T1 cannot serve): use SGLANG_TIERED_HOST=auto or off")  # fmt: skip
        if cfg.t2 is not None:
            raise ConfigError(f"SGLANG_TIERED_T2 is set and T2 (which stages pages in T1) is not supported with "
                              f"--speculative-algorithm {algo}: unset it")  # fmt: skip
    if cfg.t2 is not None:
        for size, flag in ((tp, "--tp-size"), (pp, "--pp-size")):
            if size > 1:
                raise ConfigError(f"SGLANG_TIERED_T2 is set and T2 supports {flag} 1 only (got {size}): unset it")
    if cfg.tenant_header is not None and arg("tokenizer_worker_num") > 1:
        _bad("tenant_header", cfg.tenant_header, "--tokenizer-worker-num > 1 serves HTTP from worker processes "
             "without the tenant-header middleware (tenant isolation would be off)")  # fmt: skip
    # requests that reach the scheduler past the HTTP middleware: SGLang's native gRPC server (no
    # cache_salt field: every caller in one namespace, token ids unchecked), and the legacy SMG
    # gRPC mode (no HTTP server at all); a helper's audit, session 37
    grpc = getattr(server_args, "grpc_port", None) or os.environ.get("SGLANG_GRPC_PORT")
    if cfg.tenant_header is not None and (grpc or getattr(server_args, "smg_grpc_mode", False)
                                          or getattr(server_args, "grpc_mode", False)):  # fmt: skip
        _bad("tenant_header", cfg.tenant_header, "SGLang's gRPC server (--grpc-port, SGLANG_GRPC_PORT, "
             "--smg-grpc-mode) serves requests without the tenant-header middleware (tenant isolation would be off)")


def pd_decode_radix(server_args) -> bool:
    """Whether this server runs (or may switch to, ``--enable-pd-role-switch``) the PD decode role
    with its radix cache. Its decode queue takes a match's ``host_hit_length`` as part of the prefix
    it promises prefill (``decode_prefix_len``, disaggregation/decode.py:1512), which only decode
    HiCache loads back (scheduler.py:520-523, decode.py:2780-2880): a T1 hit there is never
    loaded, prefill skips those tokens (prefill.py:437-441) and decode reads unwritten slots."""
    if not getattr(server_args, "disaggregation_decode_enable_radix_cache", False):
        return False
    mode = str(getattr(server_args, "disaggregation_mode", None) or "null")
    return mode == "decode" or bool(getattr(server_args, "enable_pd_role_switch", False))


def hashed_tenant_labels(cfg: TieredConfig) -> bool:
    """Whether stats and metrics name tenants by a digest of their ``cache_salt``
    (``tenant_labels``; by default: when no trusted tenant header sets the tenant)."""
    if cfg.tenant_labels is None:
        return cfg.tenant_header is None
    return cfg.tenant_labels == "hashed"


def policy_config(cfg: TieredConfig):
    """The policy's configuration for ``cfg`` (None: the defaults)."""
    kw = {} if cfg.lru_tree_pages is None else {"lru_tree_pages": cfg.lru_tree_pages}
    if cfg.guarantee == "lru":
        kw.update(force_mode="all+lru")
    elif cfg.guarantee == "leader":
        kw.update(guard_leader=0.999, guard_div_cap=False)
    elif cfg.guarantee == "budget":
        kw.update(guard_div_cap=False)
    if not kw:
        return None
    from sglang_tiered.core.policy import PolicyConfig

    return PolicyConfig(**kw)


def cache_root(env=None) -> pathlib.Path:
    """Where sglang-tiered keeps files between runs (built tiny models, weight digests):
    ``SGLANG_TIERED_CACHE``, else ``$XDG_CACHE_HOME/sglang-tiered``, else ``~/.cache/sglang-tiered``."""
    env = os.environ if env is None else env
    base = env.get("SGLANG_TIERED_CACHE") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sglang-tiered"
    )
    return pathlib.Path(base)


def worker_api_key(env=None) -> Optional[str]:
    """The key the router sends on its own calls to workers started with ``--api-key``
    (``SGLANG_TIERED_WORKER_API_KEY``; ``sglang-tiered route --worker-api-key`` overrides)."""
    env = os.environ if env is None else env
    return env.get("SGLANG_TIERED_WORKER_API_KEY") or None


def router_admin_key(env=None) -> Optional[str]:
    """The key the router's own routes (/router/stats, /router/metrics, /router/decisions) require
    (``SGLANG_TIERED_ROUTER_ADMIN_KEY``; ``sglang-tiered route --admin-api-key`` overrides)."""
    env = os.environ if env is None else env
    return env.get("SGLANG_TIERED_ROUTER_ADMIN_KEY") or None


def shm_dir(env=None) -> pathlib.Path:
    """Directory of named T1 segments and their lock files (a tmpfs): ``SGLANG_TIERED_SHM_DIR``,
    default /dev/shm. Read once, when tier/host_pool.py is imported."""
    env = os.environ if env is None else env
    return pathlib.Path((env.get("SGLANG_TIERED_SHM_DIR") or "").strip() or "/dev/shm")


# Routes SGLang lets the operator rename (sglang/srt/entrypoints/http_server.py: Vertex's predict
# route and the Ollama routes): (variable, SGLang's default name).
SGLANG_RENAMABLE_ROUTES = (("AIP_PREDICT_ROUTE", "/vertex_generate"), ("SGLANG_OLLAMA_CHAT_ROUTE", "/api/chat"),
                           ("SGLANG_OLLAMA_GENERATE_ROUTE", "/api/generate"))  # fmt: skip


def sglang_route_names(env=None) -> frozenset:
    """The names SGLang's server gives its renamable routes in this environment."""
    env = os.environ if env is None else env
    return frozenset(env.get(var, default) for var, default in SGLANG_RENAMABLE_ROUTES)


def vertex_route(env=None) -> str:
    """The path of Vertex AI's predict route on SGLang's server in this environment."""
    env = os.environ if env is None else env
    return env.get("AIP_PREDICT_ROUTE", dict(SGLANG_RENAMABLE_ROUTES)["AIP_PREDICT_ROUTE"])


LIFETIME_ENV = "SGLANG_TIERED_LIFETIME_ID"


def lifetime_id() -> str:
    """A random id of this server's lifetime, the same in all its processes: the plugin sets it
    in the launcher (plugin.register) before the schedulers start, and they inherit it. Part of
    the identity after a weight update (``TieredRadixCache.on_weights_updated``)."""
    import uuid

    return os.environ.setdefault(LIFETIME_ENV, uuid.uuid4().hex)
