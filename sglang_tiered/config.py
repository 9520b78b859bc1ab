"""sglang-tiered options (environment variables, validated before the model loads).

SGLang's launcher has no hook for plugin CLI flags, so the options are environment variables with
units in their names; the plugin validates them in the launcher process at registration and stops
the launch with a clear message if one is bad.

| variable | default | meaning |
|---|---|---|
| SGLANG_TIERED_HOST | auto | T1 host tier: on, off, or auto (on only where the start-up measurement says a host->device copy beats recomputing) |
| SGLANG_TIERED_HOST_RATIO | 4.0 | T1 size as a multiple of the device KV pool (ignored when HOST_GB is set) |
| SGLANG_TIERED_HOST_GB | unset | T1 size in GB (1e9 bytes) |
| SGLANG_TIERED_HOST_NAME | unset | name of the shared-memory segment; set it to keep T1 across restarts (also at another TP degree) |
| SGLANG_TIERED_TENANT_HEADER | unset | trusted request header that sets the tenant (e.g. x-tenant-id) |
| SGLANG_TIERED_DEBUG | 0 | 1: check tree and tier invariants after every operation |
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass


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


def _float(env, name, default):
    v = env.get(name)
    if v is None or v == "":
        return default
    try:
        f = float(v)
    except ValueError:
        raise ConfigError(f"{name}={v!r}: expected a number") from None
    if not f > 0:
        raise ConfigError(f"{name}={v!r}: must be > 0")
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
    return TieredConfig(
        host_mode=mode,
        host_ratio=_float(env, "SGLANG_TIERED_HOST_RATIO", 4.0),
        host_gb=_float(env, "SGLANG_TIERED_HOST_GB", None),
        host_name=name,
        tenant_header=header,
        debug=debug == "1",
    )
