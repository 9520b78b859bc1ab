"""Live checks of a helper's audit of the server's HTTP layer (session 37), on one server with
SGLang's user key, a trusted tenant header, no admin key (a tenant's own calls are confined to
it) and ``--fastapi-root-path`` (under which the middleware used to match no route at all)."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.server

USER = {"Authorization": "Bearer user-key"}
BOB_PROMPT = "bob's confidential system prompt. " * 20


@pytest.fixture(scope="module")
def scoped_server(tiny_model_path):
    from sglang_tiered.dev.server import ServerSpec

    from tests.conftest import _start

    server = _start(
        ServerSpec(model_path=tiny_model_path, backend="tiered", page_size=16, max_total_tokens=4096,
                   extra_args=["--api-key", "user-key", "--fastapi-root-path", "/sglang"],
                   env={"SGLANG_TIERED_TENANT_HEADER": "x-tenant-id"}),
        "review37_scoped",
    )  # fmt: skip
    yield server
    server.stop()


def _gen(server, tenant, text, **extra):
    payload = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 1}, **extra}
    status, out = server.request("POST", "/generate", payload, headers={**USER, "x-tenant-id": tenant})
    assert status == 200, out
    return out["meta_info"]["cached_tokens"]


def _tiered_states(body):
    return [s["sglang_tiered"] for s in body.get("internal_states", []) if isinstance(s, dict) and "sglang_tiered" in s]


def test_server_info_carries_no_cache_stats(scoped_server, admin_server):
    """SGLang's /server_info (NORMAL: the user key, or no key with only --admin-api-key) returned
    every rank's get_internal_state reply, our stats in it: every tenant's name and counters."""
    _gen(scoped_server, "bob", BOB_PROMPT)
    for server, headers in ((scoped_server, {**USER, "x-tenant-id": "alice"}), (admin_server, USER)):
        for path in ("/server_info", "/get_server_info"):
            status, body = server.request("GET", path, headers=headers)
            assert status == 200 and body["internal_states"] and not _tiered_states(body), (path, body)
    assert admin_server.request("GET", "/cache/stats", headers=USER)[0] == 401  # (the admin key's)


def test_a_tenants_own_stats_show_its_own_totals(scoped_server):
    _gen(scoped_server, "bob", BOB_PROMPT)
    _gen(scoped_server, "alice", "alice's own short prompt " * 5)
    alice = {**USER, "x-tenant-id": "alice"}
    status, body = scoped_server.request("GET", "/cache/stats", headers=alice)
    assert status == 200 and set(body["tenants"]) == {"alice"}
    own, totals = body["tenants"]["alice"], body["totals"]
    assert (totals["requests"], totals["prompt_tokens"]) == (own["requests"], own["prompt_tokens"])
    assert body["tiers"] == [] and body["policy"] == []  # (server-wide: the operator's view)
    assert scoped_server.request("GET", "/cache/stats?tenant=bob", headers=alice)[0] == 403
    status, body = scoped_server.request("GET", "/cache/stats", headers=USER)  # the operator (no header)
    assert status == 200 and {"alice", "bob"} <= set(body["tenants"]) and body["tiers"]


def test_a_tenant_cannot_invalidate_through_set_internal_state(scoped_server):
    assert _gen(scoped_server, "bob", BOB_PROMPT) > 0
    alice = {**USER, "x-tenant-id": "alice"}
    assert scoped_server.request("POST", "/cache/invalidate", {"all": True}, headers=alice)[0] == 403
    status, out = scoped_server.request("POST", "/set_internal_state",
                                        {"server_args": {"sglang_tiered_invalidate_all": 1}}, headers=alice)  # fmt: skip
    assert status == 403, out
    assert _gen(scoped_server, "bob", BOB_PROMPT) > 0  # (before: answered 200, bob's cache gone)


def test_a_tenant_cannot_use_sglangs_admin_routes(scoped_server):
    """Session 38: with no --admin-api-key SGLang let the user key call its admin routes, so
    any tenant flushed every tenant's cache or aborted every request."""
    assert _gen(scoped_server, "bob", BOB_PROMPT) > 0
    alice = {**USER, "x-tenant-id": "alice"}
    for method, path, body in (("POST", "/flush_cache", None), ("GET", "/flush_cache", None),
                               ("POST", "/abort_request", {"abort_all": True})):  # fmt: skip
        status, out = scoped_server.request(method, path, body, headers=alice)
        assert status == 403, (path, status, out)
    assert _gen(scoped_server, "bob", BOB_PROMPT) > 0  # (before: flushed)
    status, out = scoped_server.request("POST", "/flush_cache", headers=USER)  # the operator (no header)
    assert status == 200, out


def test_under_a_root_path_the_header_names_the_tenant_and_ids_are_checked(scoped_server):
    _gen(scoped_server, "carol", "hello " * 40, cache_salt="dave")  # the body's salt: not the tenant
    status, body = scoped_server.request("GET", "/cache/stats", headers=USER)
    assert status == 200 and body["tenants"]["carol"]["requests"] == 1 and "dave" not in body["tenants"], body
    status, out = scoped_server.request("POST", "/generate", {"input_ids": [1, 2, 10**6], "sampling_params":
                                        {"max_new_tokens": 1}}, headers={**USER, "x-tenant-id": "carol"})  # fmt: skip
    assert status == 400, out  # (before: the scheduler died on the id)
    time.sleep(1)
    assert scoped_server.proc.poll() is None
    _gen(scoped_server, "carol", "still serving " * 10)  # (the scheduler lives)


SECRET = [101, 202, 303, 404, 505, 606, 707, 808, 909, 1001, 1102, 1203, 1304, 1405, 1506, 1607, 1708, 1809]


def test_a_tenant_cannot_continue_or_close_another_tenants_session(scoped_server):
    """Session 38 (a helper's audit): SGLang keys sessions by id alone. Tenant B, naming tenant A's
    session (by the id A chose or the one the server handed A), continued it: B's prompt was A's
    prompt + A's output + B's tokens, and B read A's prompt back through prompt logprobs. Now a
    tenant's ids are scoped to it; A still continues its own session by either id."""
    a, b = {**USER, "x-tenant-id": "A"}, {**USER, "x-tenant-id": "B"}
    s = scoped_server
    status, sid = s.request("POST", "/open_session", {"capacity_of_str_len": 100000, "session_id": "chat-1"}, headers=a)
    assert status == 200 and isinstance(sid, str), sid
    status, out = s.request("POST", "/generate", {"input_ids": SECRET, "rid": "a-turn-1", "session_params": {"id": "chat-1"},
                                                  "sampling_params": {"temperature": 0, "max_new_tokens": 2}}, headers=a)  # fmt: skip
    assert status == 200, out

    def seen_by(headers, name):
        status, out = s.request("POST", "/generate", {"input_ids": [7, 8], "session_params": {"id": name, "rid": "a-turn-1"},
                                                      "return_logprob": True, "logprob_start_len": 0,
                                                      "sampling_params": {"temperature": 0, "max_new_tokens": 1}},
                                headers=headers)  # fmt: skip
        return {t[1] for t in out["meta_info"]["input_token_logprobs"]} if status == 200 else set()

    for name in ("chat-1", sid):
        assert not set(SECRET) <= seen_by(b, name), name  # (before: B's prompt began with A's)
    for method in ("POST", "GET"):  # (SGLang serves the route on GET with a body too)
        for name in ("chat-1", sid):
            s.request(method, "/close_session", {"session_id": name}, headers=b)
    for name in ("chat-1", sid):  # A's session is still A's (B's closes named other ids)
        assert set(SECRET) <= seen_by(a, name), name
    assert s.request("POST", "/close_session", {"session_id": "chat-1"}, headers=a)[0] == 200
