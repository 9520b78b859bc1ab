"""T2 review (session 42): a foreign object larger than a page's object turned T2 off fleet-wide.

Mooncake answers a read of an object larger than the buffer it is read into with -600 ("Buffer too
small for key", nothing written; measured on the real store, ``tests/t2_review42_scenario.py``).
T2 took any error code on the first key but "not found" for a failed call, and tripped its circuit
breaker: one such object under a key this server asks for (another build's, or a stray put) turned
T2 off for every key, 1 s doubling to 60 s each time a request asked for it again. Now it is a miss
for that key alone (``oversized_pages``, ``bad_pages``), never partial KV, and it is removed once
our read's lease is over (every object of ours is exactly ``object_bytes``).
"""

from __future__ import annotations

import json
import sys

import torch

from tests.test_review41_t2 import _evict_into_t2, _tier
from tests.test_t2 import H, page_data


def test_an_oversized_foreign_object_is_a_miss_for_its_key_alone():
    t2 = _tier()
    store = t2.client
    try:
        _evict_into_t2(t2, [H(0), H(1), H(10), H(11)], 7)
        assert t2.wait_idle(10)
        k0 = t2.key(H(0), 7)
        assert k0 in store.objects and t2.stats.stored_pages >= 4
        store.objects[k0] = b"\x01" * (t2.obj_bytes + 64)  # a foreign object under the key
        assert t2.fetch([H(0), H(1)], 7) == 0
        # before: the breaker tripped (T2 down for every key for 1 s, then 2, 4, ... 60)
        assert t2.up and t2.stats.failures == 0, (t2.up, t2.stats)
        assert t2.stats.oversized_pages == 1 and t2.stats.bad_pages == 2, t2.stats
        assert t2.fetch([H(10), H(11)], 7) == 2  # another key, right after
        with t2.lock:  # (their KV, whole)
            for h in (H(10), H(11)):
                assert torch.equal(t2.pool.data[:, :, :, t2.pool.slot_of[h]], page_data(h, 7))
        # the foreign object is removed (no lease here: at once), and the key can hold ours again
        assert t2.wait_removals()
        assert k0 not in store.objects
        assert t2.stats.failures == 0 and t2.up
    finally:
        t2.close()


def test_an_oversized_object_past_the_first_key_ends_the_run_there():
    """Mid-run it ends the leading run (the pages before it land), as a short read does; no trip."""
    t2 = _tier()
    store = t2.client
    try:
        _evict_into_t2(t2, [H(0), H(1), H(2)], 7)
        assert t2.wait_idle(10)
        store.objects[t2.key(H(1), 7)] = b"\x01" * (2 * t2.obj_bytes)
        assert t2.fetch([H(0), H(1), H(2)], 7) == 1
        assert t2.up and t2.stats.failures == 0 and t2.stats.oversized_pages == 1
    finally:
        t2.close()


def test_an_oversized_object_on_a_real_mooncake_store_is_a_miss_and_removed(tmp_path):
    """The same on a real ``mooncake_master`` (loopback-only namespace): a foreign object twice a
    page's object under the first key. The read answers -600; T2 stays up, the other run is read
    right after, and the object is gone once the read's lease is over."""
    from tests.netns import run_in_netns
    from tests.test_t2 import _need_netns

    _need_netns()
    out = tmp_path / "r.json"
    r = run_in_netns([sys.executable, "-m", "tests.t2_review42_scenario", str(out)], timeout=300)
    assert out.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["foreign_put"] == 0 and rep["get_code"] == -600, rep
    assert rep["fetched_foreign"] == 0 and rep["up_after"] and rep["failures"] == 0, rep
    assert rep["oversized_pages"] == 1 and rep["fetched_other"] == 2, rep
    assert rep["left_after_lease"] == 0, rep


def test_a_master_stopped_after_the_probe_fails_the_setup_in_its_bound(tmp_path):
    """The master answers the start-up probe and stops (SIGSTOP) before the real setup: the store
    client's start fails within its bound (``SETUP_ENV``: two tries of 5 s, plus the probe's time)
    and the launch goes on (``build_t2`` turns T2 off with the reason). Before: the setup held the
    GIL and retried the stopped master for about 10 minutes (cut off here after 90 s)."""
    from tests.netns import run_master_scenario
    from tests.test_t2 import _need_netns

    _need_netns()
    out = tmp_path / "r.json"
    r, rep = run_master_scenario("tests.t2_review42_master_scenario", out)
    assert r.returncode == 0 and "took_s" in rep, f"stalled or failed: {rep} {r.stderr[-2000:]}"
    assert rep["error"] and "setup failed" in rep["error"], rep
    assert rep["took_s"] < 40, rep


def test_the_setup_bound_keeps_an_operators_own_values(monkeypatch):
    """``SETUP_ENV`` is in the environment during the setup only, and never over an operator's value."""
    import os

    from sglang_tiered.tier import t2_client

    monkeypatch.setenv("MC_RPC_TIMEOUT_MS", "1234")
    monkeypatch.delenv("MC_STORE_CLIENT_SETUP_RETRIES", raising=False)
    with t2_client._setup_env():
        assert os.environ["MC_RPC_TIMEOUT_MS"] == "1234"
        assert os.environ["MC_STORE_CLIENT_SETUP_RETRIES"] == t2_client.SETUP_ENV["MC_STORE_CLIENT_SETUP_RETRIES"]
    assert os.environ["MC_RPC_TIMEOUT_MS"] == "1234" and "MC_STORE_CLIENT_SETUP_RETRIES" not in os.environ
