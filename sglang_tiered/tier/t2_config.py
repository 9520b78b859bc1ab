"""The T2 option, parsed and validated without torch (the launcher checks it before the model
loads; see sglang_tiered/tier/t2.py for the tier itself)."""

from __future__ import annotations

import math
import urllib.parse
from dataclasses import dataclass


class T2ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class T2Config:
    """``SGLANG_TIERED_T2=mooncake://MASTER_HOST:PORT?key=value&...`` (validated at launch)."""

    master: str  # host:port of mooncake_master
    metadata: str = "P2PHANDSHAKE"  # Mooncake metadata server ("P2PHANDSHAKE": none needed)
    protocol: str = "tcp"  # "tcp" or "rdma"
    device: str = ""  # RDMA device name(s); empty for tcp
    local_hostname: str = "127.0.0.1"  # the address peers reach this client's segment on
    segment_mb: int = 1024  # DRAM this server contributes to the fleet store (MiB)
    buffer_mb: int = 64  # Mooncake client's local transfer buffer (MiB)
    mode: str = "auto"  # auto: on only where measured T2 bandwidth beats recompute; on; off
    min_freq: int = 1  # T1 victims go to T2 only with sketch frequency >= this
    queue_pages: int = 1024  # pages waiting to be written (bounded, value-ordered)
    max_run_pages: int = 256  # pages per batched transfer (and per fetch)
    timeout_ms: float = 200.0  # per store call, plus the transfer time at min_gbps
    min_gbps: float = 0.1
    lease_ms: int = 10_000  # the master's default_kv_lease_ttl: a read object cannot be removed for this long

    @property
    def url(self) -> str:
        return f"mooncake://{self.master}"


_INT_FIELDS = {"segment_mb": (16, 1 << 22), "buffer_mb": (1, 1 << 16), "min_freq": (0, 1 << 20),
               "queue_pages": (1, 1 << 24), "max_run_pages": (1, 1 << 16), "lease_ms": (0, 3_600_000)}  # fmt: skip
_FLOAT_FIELDS = {"timeout_ms": (1.0, 600_000.0), "min_gbps": (1e-4, 1e4)}


def _number(k: str, v: str, cast):
    lo, hi = (_INT_FIELDS if cast is int else _FLOAT_FIELDS)[k]
    try:
        x = cast(v)
    except ValueError:
        raise T2ConfigError(f"SGLANG_TIERED_T2 option {k}={v!r}: not {'an integer' if cast is int else 'a number'}") from None
    if not (math.isfinite(x) and lo <= x <= hi):
        raise T2ConfigError(f"SGLANG_TIERED_T2 option {k}={v}: must be in [{lo}, {hi}]")
    return x


def parse_t2_url(url: str) -> T2Config:
    """Parse and validate the T2 option; raises ``T2ConfigError`` with what is wrong."""
    try:
        u = urllib.parse.urlsplit(url)
        port = u.port  # raises on a port out of range or not a number
    except ValueError as exc:
        raise T2ConfigError(f"SGLANG_TIERED_T2 {url!r}: {exc}") from None
    if u.scheme != "mooncake":
        raise T2ConfigError(f"SGLANG_TIERED_T2 must be mooncake://HOST:PORT[?options], got {url!r}")
    if not u.hostname or not port:
        raise T2ConfigError(f"SGLANG_TIERED_T2 needs the master's host and port: {url!r}")
    # what Mooncake would never see: the URL names the master and options only (before session 39
    # a path, credentials or a fragment were dropped without a word)
    for part, given in (("a path", u.path not in ("", "/")), ("user credentials", "@" in u.netloc),
                        ("a fragment", bool(u.fragment))):  # fmt: skip
        if given:
            raise T2ConfigError(f"SGLANG_TIERED_T2 {url!r}: {part} is not part of mooncake://HOST:PORT[?options] "
                                "(Mooncake's master takes no user and no path)")
    host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname  # IPv6 keeps its brackets
    kw: dict = {"master": f"{host}:{port}"}
    for k, vs in urllib.parse.parse_qs(u.query, keep_blank_values=True).items():
        if len(vs) != 1:
            raise T2ConfigError(f"SGLANG_TIERED_T2 option {k!r} given {len(vs)} times")
        v = vs[0]
        if k in _INT_FIELDS or k in _FLOAT_FIELDS:
            kw[k] = _number(k, v, int if k in _INT_FIELDS else float)
        elif k == "mode":
            if v not in ("auto", "on", "off"):
                raise T2ConfigError(f"SGLANG_TIERED_T2 option mode={v!r}: use auto, on or off")
            kw[k] = v
        elif k == "protocol":
            if v not in ("tcp", "rdma"):
                raise T2ConfigError(f"SGLANG_TIERED_T2 option protocol={v!r}: use tcp or rdma")
            kw[k] = v
        elif k in ("metadata", "device", "local_hostname"):
            kw[k] = v
        else:
            raise T2ConfigError(f"SGLANG_TIERED_T2: unknown option {k!r} (known: {', '.join(T2Config.__dataclass_fields__)})")
    cfg = T2Config(**kw)
    if not cfg.timeout_ms < cfg.lease_ms / 2:
        # a read must end while its object is leased: once the lease is over the store may remove
        # the object and a put reuse its memory while the read still copies it, and the footer
        # catches only a tear that reaches it (Mooncake moves a transfer in parallel slices).
        # Session 30: timeout_ms=5000&lease_ms=500 was taken, and then no read was covered.
        raise T2ConfigError(f"SGLANG_TIERED_T2 option timeout_ms={cfg.timeout_ms:g} must be below half of "
                            f"lease_ms={cfg.lease_ms} (the master's --default_kv_lease_ttl): a read that outlives "
                            "its object's lease can copy a page a put is overwriting")  # fmt: skip
    if cfg.queue_pages < cfg.max_run_pages:  # the queue refuses a run larger than itself
        raise T2ConfigError(f"SGLANG_TIERED_T2 option queue_pages={cfg.queue_pages} must be at least "
                            f"max_run_pages={cfg.max_run_pages} (an eviction's run would never be stored)")  # fmt: skip
    return cfg
