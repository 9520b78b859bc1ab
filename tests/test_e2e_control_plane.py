"""Control plane against a live CPU server: stats, invalidation, no-store hints, 400s, metrics,
admin auth, the trusted tenant header and the OpenAI example."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import threading
import urllib.request

import pytest

from sglang_tiered.core.tenants import salt_label
from tests.test_e2e_server import greedy, make_prompt

pytestmark = pytest.mark.server
ROOT = pathlib.Path(__file__).resolve().parents[1]
COUNTERS = ["requests", "requests_hit", "prompt_tokens", "cached_tokens", "admitted_pages",
            "rejected_pages", "evicted_pages", "invalidated_pages", "no_store_requests", "resident_pages"]  # fmt: skip


def stats(server, tenant=None):
    status, body = server.request("GET", "/cache/stats" + (f"?tenant={tenant}" if tenant else ""))
    assert status == 200, body
    return body


def test_stats_before_and_after_a_workload(tiered_server):
    before = stats(tiered_server)
    assert before["schema_version"] == 1 and before["ranks"] == 1 and before["page_size"] == 16
    text = make_prompt(50, 250)
    for tenant in ("st-a", "st-a", "st-b"):
        greedy(tiered_server, text, max_new_tokens=2, cache_salt=tenant)
    after = stats(tiered_server)
    # without a tenant header a tenant is its salt, the client's secret: shown as its digest
    assert not any("st-" in name for name in after["tenants"])
    a, b = after["tenants"][salt_label("st-a")], after["tenants"][salt_label("st-b")]
    assert a["requests"] == 2 and a["requests_hit"] == 1 and a["cached_tokens"] > 200
    assert b["requests"] == 1 and b["cached_tokens"] == 0
    assert a["resident_pages"] > 0 and a["admitted_pages"] >= a["resident_pages"]
    for k in COUNTERS:  # per-tenant numbers add up to the totals
        assert sum(t[k] for t in after["tenants"].values()) == after["totals"][k], k
    assert after["totals"]["requests"] == before["totals"]["requests"] + 3
    only = stats(tiered_server, "st-a")
    assert list(only["tenants"]) == ["st-a"] and only["tenant"] == "st-a"
    assert {t["name"] for t in after["tiers"]} >= {"device"}
    assert after["policy"][0]["mode"]
    # the default server runs the strict guarantee (SGLANG_TIERED_GUARANTEE unset)
    assert all(p["strict_guarantee"] and not p["follow_leader"] for p in after["policy"]), after["policy"]
    # ... and the server may batch (its request pool has many rows): lru's order itself (session 34)
    assert all(p["burst_lru"] and p["max_in_flight"] > 1 for p in after["policy"]), after["policy"]


def test_invalidate_by_tenant_gives_zero_hits(tiered_server):
    text = make_prompt(51, 250)
    greedy(tiered_server, text, max_new_tokens=2, cache_salt="inv-a")
    assert greedy(tiered_server, text, max_new_tokens=2, cache_salt="inv-a")["meta_info"]["cached_tokens"] > 0
    greedy(tiered_server, text, max_new_tokens=2, cache_salt="inv-b")
    status, body = tiered_server.request("POST", "/cache/invalidate", {"tenant": "inv-a"})
    assert status == 202 and body["dropped_tokens"] > 0, body
    assert greedy(tiered_server, text, max_new_tokens=2, cache_salt="inv-a")["meta_info"]["cached_tokens"] == 0
    assert greedy(tiered_server, text, max_new_tokens=2, cache_salt="inv-b")["meta_info"]["cached_tokens"] > 0


def test_invalidate_while_a_request_is_in_flight(tiered_server):
    text = make_prompt(52, 300)
    greedy(tiered_server, text, max_new_tokens=2, cache_salt="inflight")
    result = {}

    def long_request():
        result["out"] = greedy(tiered_server, text, max_new_tokens=400, cache_salt="inflight")

    t = threading.Thread(target=long_request)
    t.start()
    import time

    time.sleep(1.0)  # the long request is decoding and holds its prefix
    status, body = tiered_server.request("POST", "/cache/invalidate", {"tenant": "inflight"})
    assert status == 202, body
    again = greedy(tiered_server, text, max_new_tokens=2, cache_salt="inflight")
    assert again["meta_info"]["cached_tokens"] == 0  # no hit on an invalidated entry, even held
    t.join(timeout=300)
    assert result["out"]["meta_info"]["cached_tokens"] > 0  # it started with a hit and finished
    assert result["out"]["meta_info"]["completion_tokens"] > 0


def test_invalidate_by_model_version_and_all(tiered_server):
    text = make_prompt(53, 200)
    greedy(tiered_server, text, max_new_tokens=2, cache_salt="ver")
    status, body = tiered_server.request("POST", "/cache/invalidate", {"model_version": "no-such-version"})
    assert status == 202 and body["dropped_tokens"] == 0
    assert greedy(tiered_server, text, max_new_tokens=2, cache_salt="ver")["meta_info"]["cached_tokens"] > 0
    status, body = tiered_server.request("POST", "/cache/invalidate", {"model_version": "default"})
    assert status == 202 and body["dropped_tokens"] > 0  # SGLang's weight_version
    assert greedy(tiered_server, text, max_new_tokens=2, cache_salt="ver")["meta_info"]["cached_tokens"] == 0
    status, body = tiered_server.request("POST", "/cache/invalidate", {"all": True})
    assert status == 202
    assert stats(tiered_server)["tiers"][0]["resident_pages"] == 0


@pytest.mark.parametrize(
    "raw, msg",
    [
        (b"", "empty body"),
        (b"not json", "not valid JSON"),
        (b"[1, 2]", "invalid payload"),
        (b'{"tenant": "a", "colour": "red"}', "unknown field"),
        (b'{"tenant": 5}', "Expected `str"),
        (b'{"all": "yes"}', "Expected `bool"),
        (b'{"all": false}', "'all' must be true"),
        (b"{}", "nothing to invalidate"),
        (b'{"tenant": "  "}', "non-empty"),
    ],
)
def test_bad_invalidate_payloads_get_400(tiered_server, raw, msg):
    status, body = tiered_server.request("POST", "/cache/invalidate", raw=raw)
    assert status == 400, body
    assert msg in body["error"]["message"]


def test_skip_save_leaves_no_trace_but_retrieval_works(tiered_server):
    text = make_prompt(54, 250)
    hint = {"kv_transfer_params": {"lmcache.skip_save": True}}
    for _ in range(2):
        out = greedy(tiered_server, text, max_new_tokens=2, cache_salt="nostore", **hint)
        assert out["meta_info"]["cached_tokens"] == 0  # nothing was stored by the first
    t = stats(tiered_server, "nostore")["tenants"]["nostore"]
    assert t["no_store_requests"] == 2 and t["admitted_pages"] == 0 and t["resident_pages"] == 0
    # Retrieval is unaffected: a stored prefix is still served to a no-store request.
    greedy(tiered_server, text, max_new_tokens=2, cache_salt="nostore2")
    out = greedy(tiered_server, text, max_new_tokens=2, cache_salt="nostore2", **hint)
    assert out["meta_info"]["cached_tokens"] > 0
    # OpenAI route, hint in extra_body.
    body = {"model": "default", "messages": [{"role": "user", "content": make_prompt(55, 250)}],
            "max_tokens": 2, "temperature": 0, "cache_salt": "nostore-oai", **hint}  # fmt: skip
    for _ in range(2):
        status, resp = tiered_server.request("POST", "/v1/chat/completions", body)
        assert status == 200, resp
    t = stats(tiered_server, "nostore-oai")["tenants"]["nostore-oai"]
    assert t["no_store_requests"] == 2 and t["resident_pages"] == 0 and t["cached_tokens"] == 0


def test_metrics_expose_counters(tiered_server):
    greedy(tiered_server, make_prompt(56, 100), max_new_tokens=2, cache_salt="metrics")
    greedy(tiered_server, make_prompt(56, 100), max_new_tokens=2, cache_salt="metrics")
    want = f'sglang_tiered_requests_total{{tenant="{salt_label("metrics")}"}} 2.0'
    # Metrics are published at the scheduler's batch end (flush_pending_backups); a request's
    # release can land after its own batch's publish, so it shows from the next batch on: poll,
    # and run an unrelated request to make one.
    for attempt in range(6):
        text = urllib.request.urlopen(tiered_server.url + "/metrics", timeout=30).read().decode()
        if want in text:
            break
        greedy(tiered_server, make_prompt(200 + attempt, 20), max_new_tokens=1, cache_salt="metrics-tick")
    for name in ("sglang_tiered_requests_total", "sglang_tiered_cached_tokens_total",
                 "sglang_tiered_resident_pages", "sglang_tiered_admission_filtering"):  # fmt: skip
        assert name in text, name
    assert want in text, [line for line in text.splitlines() if "requests_total" in line]
    assert 'tenant="metrics' not in text  # a salt is never a label


def test_admin_auth_and_trusted_tenant_header(admin_server):
    assert admin_server.request("GET", "/cache/stats")[0] == 401
    assert admin_server.request("GET", "/cache/stats", headers={"Authorization": "Bearer user-key"})[0] == 401
    admin = {"Authorization": "Bearer admin-key"}
    assert admin_server.request("GET", "/cache/stats", headers=admin)[0] == 200
    assert admin_server.request("POST", "/cache/invalidate", {"all": True})[0] == 401
    user = {"Authorization": "Bearer user-key"}
    text = make_prompt(57, 200)
    payload = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
    for _ in range(2):
        status, out = admin_server.request("POST", "/generate", payload, headers={**user, "x-tenant-id": "gw-1"})
        assert status == 200, out
    status, body = admin_server.request("GET", "/cache/stats?tenant=gw-1", headers=admin)
    assert body["tenants"]["gw-1"]["requests"] == 2 and body["tenants"]["gw-1"]["cached_tokens"] > 0
    # SGLANG_TIERED_GUARANTEE=budget reached the live server's policy (the cap is off; its counters
    # are still reported)
    assert all(not p["strict_guarantee"] and p["cap_over_pages"] == 0 for p in body["policy"]), body["policy"]
    # The header wins over a client-chosen salt.
    status, out = admin_server.request("POST", "/generate", {**payload, "cache_salt": "spoof"},
                                       headers={**user, "x-tenant-id": "gw-1"})  # fmt: skip
    assert out["meta_info"]["cached_tokens"] > 0
    assert admin_server.request("POST", "/cache/invalidate", {"tenant": "gw-1"}, headers=admin)[0] == 202


def test_openai_example_runs(tiered_server):
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "openai_client.py"), "--base-url", tiered_server.url + "/v1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3 and "skip_save=True" in lines[0] and "skip_save=False" in lines[1]
    t = stats(tiered_server, "example-tenant")["tenants"]["example-tenant"]
    assert t["no_store_requests"] >= 1 and t["cached_tokens"] > 0


def test_client_extra_key_is_its_own_namespace(tiered_server):
    """The middleware rewrites a client's extra_key (client:<key>:, review, session 22): requests
    with it are served, share a namespace with each other only, and none with no key."""
    text = make_prompt(53, 250)
    a = greedy(tiered_server, text, max_new_tokens=2, extra_key="ek-1")
    assert "meta_info" in a, a
    assert greedy(tiered_server, text, max_new_tokens=2, extra_key="ek-1")["meta_info"]["cached_tokens"] > 200
    assert greedy(tiered_server, text, max_new_tokens=2, extra_key="ek-2")["meta_info"]["cached_tokens"] == 0
    assert greedy(tiered_server, text, max_new_tokens=2)["meta_info"]["cached_tokens"] == 0
    # an adapter-shaped key (32 hex digits) is a client key like any other
    lora_like = "0123456789abcdef" * 2
    assert greedy(tiered_server, text, max_new_tokens=2, extra_key=lora_like)["meta_info"]["cached_tokens"] == 0
