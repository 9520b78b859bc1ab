"""Per-tenant counters with a bounded label set (pure Python).

At most ``max_tenants`` tenants are tracked by name; later ones are folded into ``__other__`` so a
client minting salts cannot blow up memory or metric cardinality; names are bounded in length
(``tenant_label``). Bounds: ``max_tenants + 1`` entries of at most 81 characters each.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

OTHER = "__other__"
DEFAULT = "default"


def tenant_of(cache_salt) -> str:
    return cache_salt or DEFAULT


MAX_LABEL_CHARS = 64


def tenant_label(tenant: str) -> str:
    """The tenant's name in stats and metrics, bounded in length: past ``MAX_LABEL_CHARS``
    characters (or with characters outside printable ASCII) it becomes a prefix plus a hash of
    the whole name, so 256 tenants of 100 KB names cost kilobytes, not megabytes. A name with a
    ``~`` is always hashed: every made label has one, and a tenant named like another's made
    label shared its stats row (a helper's audit, session 37)."""
    if len(tenant) <= MAX_LABEL_CHARS and tenant.isascii() and tenant.isprintable() and "~" not in tenant:
        return tenant
    return made_label(tenant)


def made_label(tenant: str) -> str:
    """``tenant``'s hashed label: a 32-character prefix, ``~`` and a digest of the whole name."""
    digest = hashlib.blake2b(tenant.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    head = "".join(c if c.isascii() and c.isprintable() else "?" for c in tenant[:32])
    return f"{head}~{digest}"


def scoped_session_id(tenant: str, sid: str) -> str:
    """An SGLang session id in ``tenant``'s namespace (tenant-header mode; SGLang keys sessions by
    id alone, so a tenant naming another's id continued it and read its history: a helper's audit,
    session 38). An id the tenant was handed back (already under its prefix) is kept; any other,
    another tenant's scoped id included, goes under its own prefix, a digest of its name. The
    servers' middleware and the router scope alike."""
    prefix = "t" + hashlib.blake2b(tenant.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest() + "~"
    return sid if sid.startswith(prefix) else prefix + sid


# SGLang's stored-response ids: serving_responses.py reads, continues and cancels no other (it
# stores a creation under any ``request_id``, where no route reaches it)
RESPONSE_ID_PREFIX = "resp_"


def scoped_response_id(tenant: str, rid: str) -> str:
    """A stored OpenAI Response's id in ``tenant``'s namespace (tenant-header mode, session 44):
    SGLang keeps one response store per server, keyed by id alone, so a tenant holding another's
    id read it (``GET /v1/responses/{id}``: the prompt and the answer), continued it
    (``previous_response_id``) or cancelled it, on a server reached directly (the router scoped
    only its own map). The scope goes after SGLang's ``resp_``, as ``scoped_session_id`` puts
    it: an id the tenant was handed back is kept, any other goes under its own prefix. An id
    without ``resp_`` is left as it is: SGLang refuses it on every route that reads a stored
    response, naming the id the client sent (a creation so named is stored where none reads it)."""
    if not rid.startswith(RESPONSE_ID_PREFIX):
        return rid
    return RESPONSE_ID_PREFIX + scoped_session_id(tenant, rid[len(RESPONSE_ID_PREFIX) :])


def response_not_found(rid: str) -> tuple[int, bytes]:
    """SGLang's answer for a stored response ``rid`` it does not hold, status and body byte for byte
    (``serving_responses.py`` ``_make_not_found_error``, and ``_make_invalid_id_error`` first for an
    id not ``resp_...``; compact JSON as its ``ORJSONResponse`` writes it, ``param`` ``response_id``
    for a ``previous_response_id`` too). The router answers it for another tenant's id, and a
    server's middleware answers it naming the id as the tenant sent it: one copy, so the two answers
    cannot tell ids apart (reviews, sessions 43 and 44)."""
    if rid.startswith(RESPONSE_ID_PREFIX):
        status, msg = 404, f"Response with id '{rid}' not found."
    else:
        status, msg = 400, f"Invalid 'response_id': '{rid}'. Expected an ID that begins with 'resp'."
    err = {"error": {"message": msg, "type": "invalid_request_error", "param": "response_id", "code": status}}
    return status, json.dumps(err, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")


SALT_PREFIX = "salt~"


def salt_label(cache_salt: str) -> str:
    """A client's ``cache_salt`` as stats and metrics name its tenant when labels are hashed
    (``config.hashed_tenant_labels``): ``salt~`` and 16 hex digits of a BLAKE2b digest. A salt is
    the client's secret (knowing it lets one share, and so probe, its namespace); before session
    23 /metrics and /cache/stats printed it. The digest is unkeyed, so the ranks of a server and
    the servers of a fleet agree on it, and the operator can compute it from a salt they know; a
    low-entropy salt (a user id) can be guessed from its digest, as from any timing probe."""
    digest = hashlib.blake2b(cache_salt.encode("utf-8", "surrogatepass"), digest_size=8, person=b"tiered-salt")
    return SALT_PREFIX + digest.hexdigest()


def name_hash(name: str) -> int:
    """A stable 62-bit integer for a tenant or version name (SGLang's set_internal_state carries
    numbers only). A client's ``cache_salt`` may hold lone surrogates (JSON allows them): they
    are hashed as they are (``surrogatepass``), never raised on in the scheduler."""
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little") >> 2


# a salt literally "default": a digest under its own person (no name's name_hash, bar a collision)
_DEFAULT_SALT_TAG = int.from_bytes(hashlib.blake2b(DEFAULT.encode(), digest_size=8, person=b"tiered-rsalt").digest(),
                                   "little") >> 2


def tenant_tag(cache_salt) -> int:
    """T1's and T2's tenant tag of a request or node with ``cache_salt``: ``name_hash`` of its
    tenant (``tenant_of``), but a salt literally ``default`` has one of its own: it shared the
    untagged requests' tag, so T1 pages either lost to an invalidation were counted on the other's
    stats row (a helper's audit, session 40; its KV was always its own). ``{"tenant": "default"}``
    still drops both (``Invalidation.invalidate``): one name for the two."""
    if cache_salt == DEFAULT:
        return _DEFAULT_SALT_TAG
    return name_hash(tenant_of(cache_salt))


def tenant_tags(tenant_hash: int) -> tuple[int, ...]:
    """The tier tags an invalidation of the tenant named by ``tenant_hash`` (``name_hash`` of the
    HTTP ``tenant``) drops: ``default`` names the untagged requests and a salt so named."""
    return (tenant_hash, _DEFAULT_SALT_TAG) if tenant_hash == name_hash(DEFAULT) else (tenant_hash,)


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
    requeued_requests: int = 0  # admitted again after SGLang released them unfinished

    def as_dict(self) -> dict:
        return asdict(self)


class TenantTable:
    """Counters by tenant label. ``hashed``: a request's ``cache_salt`` is shown as
    ``salt_label`` (its digest), never as itself; untagged requests are ``default``.
    ``by_hash`` maps each tracked tenant's ``name_hash`` (T1's and T2's tenant tag) to its label,
    so counts the tiers report by tenant hash land on the right row whatever the label."""

    def __init__(self, max_tenants: int = 256, hashed: bool = False):
        self.max_tenants = max_tenants
        self.hashed = hashed
        self.by_name: dict[str, TenantCounters] = {}
        self.by_hash: dict[int, str] = {}
        self._labels: dict = {}  # cache_salt -> label, bounded (cleared when full)

    def label(self, cache_salt) -> str:
        """The label of the tenant of a request or node with ``cache_salt``."""
        label = self._labels.get(cache_salt)
        if label is None:
            if len(self._labels) >= 4 * self.max_tenants + 4:
                self._labels.clear()
            if self.hashed and cache_salt:
                label = salt_label(cache_salt)
            elif cache_salt in (DEFAULT, OTHER):
                # a client's salt so named is not the untagged tenant nor the folded ones: before
                # session 40 (raw labels) it shared their rows; a made label has a '~', no salt's has
                label = made_label(cache_salt)
            else:
                label = tenant_label(tenant_of(cache_salt))
            self._labels[cache_salt] = label
        return label

    def for_salt(self, cache_salt) -> TenantCounters:
        """The counters of the tenant of ``cache_salt`` (``tenant_of`` names it in the tiers)."""
        label = self.label(cache_salt)
        c = self.by_name.get(label)
        if c is None:
            c = self.get(label)
            if label in self.by_name:  # tracked by name (not folded into __other__): bounded
                self.by_hash.setdefault(tenant_tag(cache_salt), label)
        return c

    def get(self, tenant: str) -> TenantCounters:
        """The counters of the tenant labelled ``tenant`` (a label ``label`` made: labelled again,
        a made label, which has a ``~``, would be hashed once more)."""
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
