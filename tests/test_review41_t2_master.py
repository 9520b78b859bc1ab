"""T2 start-up with a stopped Mooncake master (session 41).

``MooncakeDistributedStore.setup`` holds the GIL while it retries a master that accepts and does not
answer (SIGSTOP: 20 tries of 30 s), so no deadline in the server's process fires and the launch
stalled for about 10 minutes. Now a store client first has the master take a setup in a child
process with a deadline (``t2_client.probe_master``, MASTER_PROBE_S); one that does not answer is a
failed client start, which ``build_t2`` turns into T2 off with its reason (logged, and the decision
in /cache/stats), as for any unreachable master; the launch goes on."""

from __future__ import annotations


def test_a_stopped_master_fails_a_store_clients_start_within_the_probe_deadline(tmp_path):
    from sglang_tiered.tier import t2_client
    from tests.netns import run_master_scenario
    from tests.test_t2 import _need_netns

    _need_netns()
    out = tmp_path / "r.json"
    r, rep = run_master_scenario("tests.t2_review41_master_scenario", out)
    assert r.returncode == 0, f"stalled or failed: {rep} {r.stderr[-2000:]}"
    assert rep["healthy_s"] < t2_client.MASTER_PROBE_S, rep
    assert rep["stopped_error"] and "did not answer" in rep["stopped_error"], rep
    assert rep["stopped_s"] < t2_client.MASTER_PROBE_S + 5, rep


def test_a_master_that_does_not_answer_turns_t2_off_with_its_reason(monkeypatch):
    """``build_t2`` over a client whose master probe fails: T2 off, the reason in the decision, no tier attached."""
    import types

    from sglang_tiered.integration import t2_setup as t2s
    from sglang_tiered.tier import t2_client
    from sglang_tiered.tier.t2_config import parse_t2_url
    from tests.test_review18 import _cache

    monkeypatch.setattr(t2_client, "probe_master", lambda cfg, timeout_s: f"master {cfg.master} did not answer")
    cache = _cache()
    decision = t2s.build_t2(cache, types.SimpleNamespace(tp_size=1), parse_t2_url("mooncake://127.0.0.1:1?mode=on"))
    assert decision.startswith("off: mooncake://127.0.0.1:1 unavailable") and "did not answer" in decision, decision
    assert cache.t1.host.t2 is None and cache.t1.host.pool.victim_listener is None
