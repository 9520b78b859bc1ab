"""The control plane as a hostile or careless operator uses it (a helper's audit, session 40)."""

from __future__ import annotations

import pytest


@pytest.fixture
def guarded(monkeypatch):
    from sglang.srt.utils import auth

    from sglang_tiered.integration.http import guard_auth

    monkeypatch.setattr(auth, "decide_request_auth", auth.decide_request_auth)  # (restored after)
    guard_auth()
    guard_auth()  # (idempotent: one wrapper)
    assert getattr(auth.decide_request_auth, "__wrapped__", None) is not None
    assert not hasattr(auth.decide_request_auth.__wrapped__, "_tiered_ascii")
    return auth


@pytest.mark.parametrize("level", ["ADMIN_OPTIONAL", "ADMIN_FORCE", "NORMAL"])
def test_a_non_ascii_authorization_header_is_a_401_not_a_500(guarded, level):
    """Starlette decodes a header as Latin-1; SGLang's secrets.compare_digest raises TypeError on
    a non-ASCII string: a 500 on every route once any key is set (live: /cache/stats,
    /cache/invalidate and /generate)."""
    auth = guarded
    kw = dict(method="POST", path="/cache/invalidate", api_key="user-key", admin_api_key="admin-key",
              auth_level=getattr(auth.AuthLevel, level))  # fmt: skip
    for header in ("Bearer \xe9\xe9", "Bearer admin-key\xff", "\xff"):
        assert not auth.decide_request_auth(authorization_header=header, **kw).allowed
    key = "user-key" if level == "NORMAL" else "admin-key"
    assert auth.decide_request_auth(authorization_header=f"Bearer {key}", **kw).allowed
    open_kw = dict(kw, api_key=None, admin_api_key=None)
    if level != "ADMIN_FORCE":  # no key set: nothing to check, whatever the header
        assert auth.decide_request_auth(authorization_header="Bearer \xe9", **open_kw).allowed


@pytest.mark.parametrize("hashed", [False, True])
def test_a_confined_tenant_named_like_another_tenants_label_reads_only_its_own_row(hashed):
    """Tenant-header mode: a tenant's own /cache/stats is its row alone (``confined``). A tenant
    whose header value was another tenant's label (``salt~`` and the digest of its name, which
    anyone can compute: the digest is not keyed; or, with raw labels, the made label of a name
    with a '~') was given that tenant's row: ``_label_of`` takes a label as it is."""
    from sglang_tiered.core.tenants import TenantTable
    from sglang_tiered.stats import aggregate

    table = TenantTable(hashed=hashed)
    victim = "acme" if hashed else "salt~0123456789abcdef"
    table.for_salt(victim).requests = 5
    snoop = table.label(victim)  # what the snooping tenant names itself (its header value)
    assert snoop.startswith("salt~") and snoop != victim
    table.for_salt(snoop).requests = 1
    ranks = [{"page_size": 16, "tenants": {k: c.as_dict() for k, c in table.by_name.items()}}]
    own = aggregate(ranks, snoop, hashed, confined=True)
    assert own.totals.requests == 1 and own.tenants[snoop].requests == 1, own
    assert aggregate(ranks, victim, hashed, confined=True).totals.requests == 5
    # the operator's view may still name a row by its label
    assert aggregate(ranks, table.label(victim), hashed).tenants[table.label(victim)].requests == 5


def _client():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from sglang_tiered.integration.http import add_routes

    app = FastAPI()
    add_routes(app)
    return TestClient(app, raise_server_exceptions=False)


def test_a_huge_invalidation_body_is_a_413_and_a_bad_one_a_400():
    """A body of any size was read whole and its name echoed back in the 202 (live: a 64 MB
    tenant was accepted and sent back)."""
    from sglang_tiered.integration.http import INVALIDATE_BODY_MAX

    client = _client()
    huge = b'{"tenant": "' + b"a" * INVALIDATE_BODY_MAX + b'"}'
    r = client.post("/cache/invalidate", content=huge)
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"], r.text

    def chunks():  # (no content-length: read as it comes, stopped past the bound)
        yield b'{"tenant": "'
        for _ in range(64):
            yield b"a" * (INVALIDATE_BODY_MAX // 16)

    r = client.post("/cache/invalidate", content=chunks())
    assert r.status_code == 413, r.text
    bad = (b'{"tenant": NaN}', b'{"all": true, "generation": 1e400}', b"[" * 100_000, b'{"tenant": 1}',
           b'{"tenant": "a", "x": 1}', b"", b"\xff", b'{"all": false}', b'{"generation": -1, "all": true}')
    for body in bad:
        r = client.post("/cache/invalidate", content=body)
        assert r.status_code == 400 and r.json()["error"]["message"], (body[:30], r.status_code, r.text)


def test_invalidating_a_stats_label_is_a_400_not_a_silent_no_op(monkeypatch):
    """Without a tenant header /cache/stats shows a salt as ``salt~<digest>``; an operator who
    pasted that label into /cache/invalidate got a 202 that dropped nothing (it takes the salt):
    the tenant's KV was still served."""
    from sglang_tiered.core.tenants import salt_label

    monkeypatch.delenv("SGLANG_TIERED_TENANT_HEADER", raising=False)
    monkeypatch.delenv("SGLANG_TIERED_TENANT_LABELS", raising=False)
    r = _client().post("/cache/invalidate", json={"tenant": salt_label("acme")})
    assert r.status_code == 400 and "salt itself" in r.json()["error"]["message"], r.text
