"""SGLang's own admin routes in tenant mode (session 38).

With a trusted tenant header and no ``--admin-api-key``, SGLang lets the user key (every tenant's,
through the gateway) call its admin routes: any tenant flushed every tenant's cache
(``/flush_cache``), aborted every request (``/abort_request`` with ``abort_all``), paused the
server or swapped the served weights (``/update_weights_from_disk``). Our own control routes
already confined a tenant's call to that tenant (session 21) and ``/set_internal_state`` was a 403
(session 37); now every route SGLang marks as an admin route is a 403 to a call carrying the
tenant header (the operator calls it without the header, from behind the gateway, or sets
``--admin-api-key``). Live: tests/test_e2e_http_review37.py. And /metrics, which SGLang serves to
anyone and which names every tenant, is a 403 to a tenant's call."""

from __future__ import annotations

import pytest


def _app(tenant_header="x-tenant-id"):
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from sglang_tiered.integration.http import HintMiddleware

    async def ok(request):
        return JSONResponse({"done": request.url.path})

    routes = [Route(p, ok, methods=["GET", "POST"]) for p in ("/flush_cache", "/abort_request",
                                                              "/update_weights_from_disk", "/generate", "/metrics")]  # fmt: skip
    return Starlette(routes=routes, middleware=[Middleware(HintMiddleware, tenant_header=tenant_header)])


def _call(app, method: str, path: str, headers: dict, body: dict | None = None):
    from tests.test_http_review37 import _call as call

    return call(app, path, body, headers, method=method)


@pytest.mark.parametrize("method,path,body", [("POST", "/flush_cache", None), ("GET", "/flush_cache", None),
                                              ("POST", "/abort_request", {"abort_all": True}),
                                              ("POST", "/update_weights_from_disk", {"model_path": "/elsewhere"})])  # fmt: skip
def test_a_tenants_call_to_an_admin_route_is_refused(method, path, body):
    status, out = _call(_app(), method, path, {"x-tenant-id": "alice"}, body)
    assert status == 403 and "admin" in out["error"]["message"], (status, out)
    # the operator (no header: from behind the gateway) is SGLang's to judge, as before
    assert _call(_app(), method, path, {}, body) == (200, {"done": path})


def test_with_an_admin_key_sglang_judges_the_call(monkeypatch):
    """With --admin-api-key set SGLang's own check (the admin key) decides: passed on."""
    from sglang_tiered.integration import http

    monkeypatch.setattr(http, "admin_key", lambda: "secret")
    assert _call(_app(), "POST", "/flush_cache", {"x-tenant-id": "alice"})[0] == 200


def test_without_a_tenant_header_nothing_changes():
    assert _call(_app(tenant_header=None), "POST", "/flush_cache", {"x-tenant-id": "alice"})[0] == 200
    assert _call(_app(), "POST", "/generate", {"x-tenant-id": "alice"}, {"text": "hi"})[0] == 200


def test_the_admin_routes_are_sglangs_own():
    """Read from SGLang's app (every route its ``@auth_level`` marks admin), less our own; the
    0.5.23 fallback list agrees (this fails when SGLang adds or drops one: update the list)."""
    from sglang_tiered.integration.http import OWN_ADMIN_PATHS, SGLANG_ADMIN_PATHS_0523, sglang_admin_paths

    got = sglang_admin_paths()
    assert got == SGLANG_ADMIN_PATHS_0523, sorted(got ^ SGLANG_ADMIN_PATHS_0523)
    assert {"/flush_cache", "/abort_request", "/update_weights_from_disk", "/pause_generation"} <= got
    assert not got & OWN_ADMIN_PATHS and "/generate" not in got


def test_a_tenants_call_cannot_read_the_metrics(monkeypatch):
    """SGLang serves /metrics to anyone (its auth lets it through, keys or not), and our series
    name every tenant and its traffic (in header mode the tenants' own names): a call carrying the
    tenant header gets a 403, with or without an admin key; the operator's scrape is served."""
    from sglang_tiered.integration import http

    status, out = _call(_app(), "GET", "/metrics", {"x-tenant-id": "alice"})
    assert status == 403 and "/metrics" in out["error"]["message"], (status, out)
    assert _call(_app(), "GET", "/metrics", {})[0] == 200
    assert _call(_app(tenant_header=None), "GET", "/metrics", {"x-tenant-id": "alice"})[0] == 200
    assert _call(_app(), "GET", "/metrics", {"x-tenant-id": "a", "X-Tenant-Id": "b"})[0] == 400
    monkeypatch.setattr(http, "admin_key", lambda: "secret")  # (SGLang checks no key on /metrics)
    assert _call(_app(), "GET", "/metrics", {"x-tenant-id": "alice"})[0] == 403
