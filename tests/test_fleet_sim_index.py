"""The fleet simulator's measurement: the hint index against what a server serves, and the
acceptance summary of bench/fleet_sim.py."""

from __future__ import annotations


from sglang_tiered.core.keys import CacheKey, chain_page_hashes
from sglang_tiered.dev.workloads import multi_tenant
from sglang_tiered.fleet.sim import SimIndex


def _replay_index_vs_served(n_requests: int):
    """One simulated server with T1 behind an exact index; per request, what the index said the
    server held of the prompt (before it ran) and what the server served from its cache."""
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

    page = 16
    cache = TieredRadixCache.create_simulated(4096, page_size=page, host_pages=512, max_request_tokens=8192)
    idx = SimIndex()
    cache.attach_index(idx.listener("s0"))
    key, seeds, out = CacheKey(), {}, []
    for r in multi_tenant(n_requests, seed=0, n_tenants=12, scale=0.25):
        seed = seeds.get(r.tenant) or seeds.setdefault(r.tenant, key.namespace_seed(r.tenant, None))
        told = idx.matched(chain_page_hashes(seed, r.tokens, page), page, ["s0"]).get("s0", 0)
        served = cache.driver.run(r.tokens, tenant=r.tenant)
        out.append((told, served.cached_len))
        if len(out) % 50 == 0:
            cache.check_invariants()  # incl. I1 of index_hints.py (the device set is the tree's)
    return out, cache


def test_index_replay_exercises_device_and_t1_churn():
    rows, cache = _replay_index_vs_served(300)
    # the replay hits, from the device and from T1, so the comparison below means something
    assert sum(c for _, c in rows) > 0 and cache.driver.host_loaded_tokens > 0


def test_index_reports_every_page_the_server_serves():
    # (the other direction is allowed: a T1 hit the server cannot load back is served as a miss)
    rows, _ = _replay_index_vs_served(300)
    missed = [(i, t, c) for i, (t, c) in enumerate(rows) if c > t]
    assert not missed, f"{len(missed)} of {len(rows)} requests served more than the index said (first: {missed[:3]})"


def test_bar_summary_needs_every_alternative_beaten_and_the_load_bound():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.fleet_sim import bar

    def row(policy, n, hit, imb=1.0, seed=0):
        return {"workload": "w", "seed": seed, "n": n, "policy": policy, "hit_rate": hit, "work_imbalance": imb}

    rows = [row("single", 1, 0.50), row("cache_aware", 8, 0.44), row("ours", 8, 0.45), row("ours_nomem", 8, 0.46),
            row("cache_aware", 44, 0.45), row("ours", 44, 0.45),  # a tie is not "above"
            row("single", 1, 0.50, seed=1), row("cache_aware", 8, 0.40, seed=1), row("ours", 8, 0.46, 1.31, seed=1)]
    got = {(c["seed"], c["n"]): c for c in bar(rows)}
    assert got[(0, 8)]["met"] and got[(0, 8)]["closest"] == "cache_aware"  # our own variants do not count
    assert got[(0, 8)]["margin_points"] == 1.0 and got[(0, 8)]["x_single"] == 0.9
    assert not got[(0, 44)]["met"]
    assert not got[(1, 8)]["met"]  # load above 1.3


def test_bar_summary_of_a_partial_run_prints_and_is_not_met(capsys, tmp_path, monkeypatch):
    # a run without N = 1 (no single-server ratio) or with ours alone (no margin) crashed on
    # formatting None; such a cell cannot be judged, so it is not met
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import bench.fleet_sim as fs

    rows = [{"workload": "w", "seed": 0, "n": 8, "policy": "ours", "hit_rate": 0.5, "work_imbalance": 1.0}]
    (cell,) = fs.bar(rows)
    assert cell["x_single"] is None and cell["margin_points"] is None and not cell["met"]
    monkeypatch.setattr(fs, "run_workload", lambda wl, seed, args, trace: rows)
    monkeypatch.setattr(fs, "ROOT", tmp_path)
    monkeypatch.setattr(fs, "meta", lambda: {})
    monkeypatch.setattr(fs, "plot", lambda rows, path: None)
    assert fs.main(["--workload", "family-single-0", "--ns", "8", "--policies", "ours", "--name", "t"]) == 0
    assert "? x single; no alternative run" in capsys.readouterr().out


def test_shape_requests_sets_a_generated_shapes_length():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.fleet_sim import family_workload

    assert len(family_workload("family-single-0", 4000)) == 1200  # the recorded runs' length
    assert len(family_workload("family-single-0", 4000, shape_requests=1500)) == 1500
    assert len(family_workload("family-single-0", 300, shape_requests=1500)) == 300  # --limit still caps it
