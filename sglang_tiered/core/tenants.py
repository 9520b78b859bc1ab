"""Per-tenant counters with a bounded label set (pure Python).

At most ``max_tenants`` tenants are tracked by name; later ones are folded into ``__other__`` so a
client minting salts cannot blow up memory or metric cardinality; names are bounded in length
(``tenant_label``). Bounds: ``max_tenants + 1`` entries of at most 81 characters each.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

OTHER = "__other__"
DEFAULT = "default"


def tenant_of(cache_salt) -> str:
    return cache_salt or DEFAULT


MAX_LABEL_CHARS = 64


def tenant_label(tenant: str) -> str:
    """The tenant's name in stats and metrics, bounded in length: past ``MAX_LABEL_CHARS``
    characters (or with characters outside printable ASCII) it becomes a prefix plus a hash of
    the whole name, so 256 tenants of 100 KB names cost kilobytes, not megabytes."""
    if len(tenant) <= MAX_LABEL_CHARS and tenant.isascii() and tenant.isprintable():
        return tenant
    digest = hashlib.blake2b(tenant.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    head = "".join(c if c.isascii() and c.isprintable() else "?" for c in tenant[:32])
    return f"{head}~{digest}"


def name_hash(name: str) -> int:
    """A stable 62-bit integer for a tenant or version name (SGLang's set_internal_state carries
    numbers only). A client's ``cache_salt`` may hold lone surrogates (JSON allows them): they
    are hashed as they are (``surrogatepass``), never raised on in the scheduler."""
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little") >> 2


@dataclass
class TenantCounters:
    requests: int = 0
    requests_hit: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    admitted_pages: int = 0
    rejected_pages: int = 0
    evicted_pages: int = 0
    invalidated_pages: int = 0
    no_store_requests: int = 0
    resident_pages: int = 0
    promoted_pages: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


class TenantTable:
    def __init__(self, max_tenants: int = 256):
        self.max_tenants = max_tenants
        self.by_name: dict[str, TenantCounters] = {}

    def get(self, tenant: str) -> TenantCounters:
        tenant = tenant_label(tenant)
        c = self.by_name.get(tenant)
        if c is None:
            if len(self.by_name) >= self.max_tenants and tenant != OTHER:
                return self.get(OTHER)
            c = self.by_name[tenant] = TenantCounters()
        return c

    def totals(self) -> TenantCounters:
        t = TenantCounters()
        for c in self.by_name.values():
            for k, v in c.__dict__.items():
                setattr(t, k, getattr(t, k) + v)
        return t
