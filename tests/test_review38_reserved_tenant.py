"""Tenant-header mode: the header may not name the untagged namespace ('default') or the folded
tenants' stats row ('__other__'): a tenant so named shared their stats and invalidation scope
(live: hunt/default_alias.py)."""
import pytest

from sglang_tiered.integration.http import BadRequest, header_value


@pytest.mark.parametrize("value", [b"default", b" default ", b"__other__"])
def test_reserved_tenant_names_are_refused(value):
    with pytest.raises(BadRequest, match="reserved"):
        header_value({"headers": [(b"x-tenant-id", value)]}, b"x-tenant-id")


def test_other_names_pass():
    assert header_value({"headers": [(b"x-tenant-id", b" acme ")]}, b"x-tenant-id") == "acme"
    assert header_value({"headers": [(b"x-tenant-id", b"Default")]}, b"x-tenant-id") == "Default"
    assert header_value({"headers": []}, b"x-tenant-id") is None


def test_blank_header_is_not_confined_to_the_untagged_namespace(monkeypatch):
    from sglang_tiered.integration import http

    monkeypatch.setattr(http, "load_config", lambda: type("C", (), {"tenant_header": "x-tenant-id"})())
    req = type("R", (), {"scope": {"headers": [(b"x-tenant-id", b"  ")]}})()
    with pytest.raises(BadRequest, match="empty"):
        http.caller_tenant(req, None)
    req.scope = {"headers": [(b"x-tenant-id", b"acme")]}
    assert http.caller_tenant(req, None) == "acme"
