"""The benchmarks run end to end (small sizes) and write their artifacts."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_trace_replay_small(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "trace_replay.py"), "--limit", "300", "--fractions", "0.05",
         "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads((tmp_path / "trace_replay.json").read_text())
    assert {r["workload"] for r in doc["rows"]} == {"mooncake", "multitenant"}
    assert all(0 <= r["tiered"] <= r["infinite"] + 1e-9 and r["belady"] <= r["infinite"] + 1e-9 for r in doc["rows"])
    assert (tmp_path / "trace_replay.png").stat().st_size > 0


def test_recheck_cells_replays_the_recorded_cells(tmp_path):
    """bench/recheck_cells.py replays exactly the recorded cells over its filter: a recorded
    family row (made here from the same replay) comes back with the same hit rates."""
    sys.path.insert(0, str(ROOT / "bench"))
    import trace_replay

    from sglang_tiered.dev import workload_family as wf

    reqs = wf.generate(wf.draw(21))
    total = sum(len(r.tokens) for r in reqs)
    rows = []
    for pages in (40, 200):
        lru = trace_replay.replay_sglang(reqs, pages * 16, "lru")["hit_tokens"] / total
        tiered = trace_replay.replay_tiered(reqs, pages * 16)["hit_tokens"] / total
        rows.append({"workload": "family-021", "fraction": pages / 1000, "capacity_pages": pages, "lru": lru,
                     "tiered": tiered, "best_sglang": max(lru, tiered), "bookkeeping_vs_lru": 1.0})  # fmt: skip
    src = tmp_path / "family.json"
    src.write_text(json.dumps({"page_size": 16, "rows": rows}))
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "recheck_cells.py"), str(src), "--page-size", "16",
                          "--min-pages", "100", "--name", "re", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads((tmp_path / "re.json").read_text())
    assert [r["capacity_pages"] for r in doc["rows"]] == [200]
    assert doc["summary"]["hit_rate_changed"] == 0 and doc["summary"]["lru_changed"] == 0
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "recheck_cells.py"), str(src), "--page-size", "1",
                          "--name", "re", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert bad.returncode != 0 and "page size 16" in bad.stderr


def test_family_runs_an_operators_trace_file(tmp_path):
    """``workload_family.py --trace-file``: a Mooncake-format trace (hash_ids, tenants) and a
    token-id trace run through every policy like the named traces; a bad line fails fast with
    its file and line (exit 2), before any replay."""
    import random

    rng = random.Random(1)
    mc, tok = tmp_path / "mine.jsonl", tmp_path / "tokens.jsonl"
    with open(mc, "w") as f:
        for i in range(200):
            doc = rng.randrange(10)
            ids = [1000 * doc + j for j in range(rng.randrange(2, 10))] + [10**6 + i]
            f.write(json.dumps({"timestamp": i, "input_length": 512 * (len(ids) - 1) + 9, "hash_ids": ids,
                                "tenant": f"t{doc % 3}"}) + "\n")  # fmt: skip
    with open(tok, "w") as f:
        for i in range(100):
            f.write(json.dumps({"input_ids": list(range(64 * (1 + i % 3))) + [rng.randrange(9000) for _ in range(40)]}) + "\n")
    cmd = [sys.executable, str(ROOT / "bench" / "workload_family.py"), "--n", "0", "--no-traces", "--fractions", "0.05",
           "0.2", "--workers", "1", "--no-belady", "--out", str(tmp_path), "--name", "mine"]  # fmt: skip
    out = subprocess.run(cmd + ["--trace-file", str(mc), str(tok)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads((tmp_path / "mine.json").read_text())
    assert {r["workload"] for r in doc["rows"]} == {"mine", "tokens"} and len(doc["rows"]) == 4
    assert set(doc["summary"]["traces"]) == {"mine", "tokens"}
    assert all(r["tiered"] >= r["lru"] - 0.002 for r in doc["rows"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2]}\n{"hash_ids": []}\n')
    out = subprocess.run(cmd + ["--trace-file", str(bad)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and "bad.jsonl:2: hash_ids must be a non-empty list" in out.stderr, out.stderr


def test_load_trace_shapes_and_errors(tmp_path):
    from sglang_tiered.dev.workloads import load_mooncake, load_trace

    src = ROOT / "bench" / "data" / "mooncake_conversation_trace.jsonl.gz"
    a, b = load_mooncake(src, limit=50), load_trace(src, limit=50, kind="mooncake")
    assert [(r.tokens, r.tenant, r.arrival_s) for r in a] == [(r.tokens, r.tenant, r.arrival_s) for r in b]
    p = tmp_path / "t.jsonl"
    p.write_text('{"hash_ids": [7, 8], "input_length": 600, "cache_salt": "x"}\n\n{"tokens": [3, 4, 5]}\n')
    r = load_trace(p, tokens_per_block=4, block_size=512)
    assert [len(q.tokens) for q in r] == [5, 3] and [q.tenant for q in r] == ["x", None]
    for line, msg in [("[1]", "JSON object"), ("{}", "needs hash_ids"), ('{"input_ids": [1.5]}', "non-negative"),
                      ('{"input_ids": [1], "tenant": 3}', "tenant must be a string"), ("{", "not JSON"),
                      ('{"hash_ids": [1], "input_length": 0}', "input_length"),
                      # read but not replayed: still a bad line, not silently taken (session 30)
                      ('{"input_ids": [1], "timestamp": NaN}', "timestamp"), ('{"input_ids": [1], "timestamp": -1}', "timestamp"),
                      ('{"input_ids": [1], "output_length": -5}', "output_length"),
                      ('{"input_ids": [1], "output_length": true}', "output_length")]:  # fmt: skip
        p.write_text(line + "\n")
        with pytest.raises(ValueError, match=msg):
            load_trace(p)
    p.write_text("\n")
    with pytest.raises(ValueError, match="no requests"):
        load_trace(p)
    # session 32 (a helper's hunt): these were tracebacks, or messages without the line
    import gzip

    good = b'{"input_ids": [1, 2, 3]}\n'
    for data, msg in [(good + b'{"input_ids": [1], "tenant": "\xff"}\n', r"t.jsonl:2: not UTF-8"),
                      (good + b"[" * 100_000 + b"\n", r"t.jsonl:2: not JSON"),
                      (good + b'{"input_ids": [' + b"9" * 5000 + b"]}\n", r"t.jsonl:2: not JSON"),
                      (good + b'{"input_ids": [1], "tenant": "\\ud800"}\n', r"t.jsonl:2: tenant must be"),
                      (good + b'{"hash_ids": ["\\ud800"]}\n', r"t.jsonl:2: hash_ids holds")]:  # fmt: skip
        p.write_bytes(data)
        with pytest.raises(ValueError, match=msg):
            load_trace(p)
    z = tmp_path / "t.jsonl.gz"
    whole = gzip.compress(good * 500)
    for data in (whole[:-30], whole[:20] + b"\0" * 10 + whole[30:]):  # cut short; corrupt
        z.write_bytes(data)
        with pytest.raises(ValueError, match=r"t.jsonl.gz:\d+: cannot read the file on"):
            load_trace(z)


def test_kernel_bench_cpu(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_bench.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "scatter_d2d_gbps" in out.stdout
    assert "scatter_d2d_gbps" in json.loads((tmp_path / "kernel_bench_cpu.json").read_text())


@pytest.mark.server
def test_live_trace_against_a_server(tiered_server, tmp_path):
    csv_path = tmp_path / "live.csv"
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "live_trace.py"), "--url", tiered_server.url, "--limit", "30",
         "--time-scale", "1000", "--out", str(csv_path)], capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = csv_path.read_text().splitlines()
    assert len(rows) == 31 and rows[0].startswith("i,trace_arrival_s")
    assert any(int(r.split(",")[4]) > 0 for r in rows[1:])  # the shared system prompt hits


@pytest.mark.server
def test_demo_small(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "live_compare.py"), "--requests", "40", "--out", str(tmp_path),
         "--long-prefix-tokens", "512", "--long-prefix-reps", "3"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = json.loads((tmp_path / "demo.json").read_text())
    assert doc["table"]["tiered"]["outputs_match_reference"] and doc["table"]["stock"]["outputs_match_reference"]
    assert (tmp_path / "demo.png").stat().st_size > 0
    lp = doc["long_prefix"]
    assert lp["all_from_t1"] and lp["outputs_equal"] and lp["t1_ttft_ms_p50"] < lp["recompute_ttft_ms_p50"]


def test_gpu_check_dry_run():
    """bench/gpu_check.py runs on a machine without a GPU in its dry mode: every path (device
    scatter/gather, torch reference, staging) checked equal to the reference at TP 1/2/4/8."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run"],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "paths checked equal to the reference" in out.stdout


def test_gpu_correctness_dry_run():
    """bench/gpu_correctness.py (the CUDA check of T1's real path) runs its checks on CPU in its dry
    mode: page movers against the reference, HostTier round trips (private and named T1), and the
    store fenced by the ready event, directly and through the threaded store queue."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_correctness.py"), "--dry-run"],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok none (dry run)")


def test_fleet_live_compare_reads_a_result(tmp_path):
    """bench/fleet_live_compare.py on a made-up fleet_live result: the router whose every TTFT is
    lower wins every round, and its bootstrap interval lies below 0."""
    sys.path.insert(0, str(ROOT / "bench"))
    import fleet_live_compare as flc

    fields = ["worker", "prompt_tokens", "cached_tokens", "ttft_s"]
    blocks = []
    for rnd in range(3):
        for name, scale, cached in (("ours", 1.0, 50), ("smg-round_robin", 1.5, 20)):
            rows = [["w", 100, cached, scale * (0.1 + 0.001 * i)] for i in range(100)]
            blocks.append({"router": name, "round": rnd, "requests": json.dumps(rows)})
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"per_request_fields": fields, "per_request": blocks}))
    (c,) = flc.compare(flc.load(str(path)), "ours", resamples=200)
    assert c["p90_lower_rounds"] == 3 and c["hit_higher_rounds"] == 3
    assert c["p90_diff_ms"] == -95.0 and c["p90_diff_ci95_ms"][1] < 0
    assert flc.main([str(path)]) == 0
