"""Replay SGLang's lru and tiered again on the cells of a recorded ``workload_family.py`` run that
match a capacity filter, interleaved in one process, and compare with the recorded hit rates: a
change that should move only some cells (e.g. the large caches) is checked on exactly those, in
minutes instead of a whole family run.

    .venv/bin/python bench/recheck_cells.py bench/results/workload_family_page1_08728b8.json \
        --page-size 1 --min-pages 32768 --name recheck_page1_large

Writes ``bench/results/<name>.json`` (rows: recorded and new hit rates, lru's, the best SGLang
policy's, µs per request of both, the bookkeeping ratio now and as recorded) with the
environment; prints the summary.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import trace_replay  # noqa: E402


def _requests(name: str):
    if name == "mooncake":
        from sglang_tiered.dev.workloads import load_mooncake

        return load_mooncake(ROOT / "bench" / "data" / "mooncake_conversation_trace.jsonl.gz")
    if name == "multitenant":
        from sglang_tiered.dev.workloads import multi_tenant

        return multi_tenant(n_requests=4000, seed=0)
    from sglang_tiered.dev import workload_family as wf

    return wf.generate(wf.draw(int(name.split("-")[1])))


def main(argv=None) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="a workload_family.py JSON")
    ap.add_argument("--page-size", type=int, required=True, help="the page size that run used")
    ap.add_argument("--min-pages", type=int, default=0, help="only cells of more pages than this")
    ap.add_argument("--name", required=True)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--git-sha", help="record this sha (when run from an exported copy)")
    args = ap.parse_args(argv)
    recorded = json.loads(pathlib.Path(args.results).read_text())
    if recorded.get("page_size", 16) != args.page_size:
        raise SystemExit(f"{args.results} was run at page size {recorded.get('page_size')}, not {args.page_size}")
    trace_replay.PAGE = args.page_size
    cells = [r for r in recorded["rows"] if r["capacity_pages"] > args.min_pages]
    t0 = time.time()
    rows, loaded = [], {}
    for r in cells:
        name = r["workload"]
        if name not in loaded:
            loaded = {name: _requests(name)}
        reqs = loaded[name]
        total = sum(len(q.tokens) for q in reqs)
        cap = r["capacity_pages"] * args.page_size
        lru = trace_replay.replay_sglang(reqs, cap, "lru")
        tiered = trace_replay.replay_tiered(reqs, cap)
        row = {"workload": name, "fraction": r["fraction"], "capacity_pages": r["capacity_pages"],
               "lru": lru["hit_tokens"] / total, "lru_recorded": r["lru"],
               "tiered": tiered["hit_tokens"] / total, "tiered_recorded": r["tiered"],
               "best_sglang": r["best_sglang"], "us_lru": lru["us_per_req"], "us_tiered": tiered["us_per_req"],
               "bookkeeping_vs_lru": tiered["us_per_req"] / lru["us_per_req"],
               "bookkeeping_vs_lru_recorded": r["bookkeeping_vs_lru"]}  # fmt: skip
        rows.append(row)
        print(f"{name:14s} {r['fraction']:<6} {r['capacity_pages']:8d} pages  tiered {row['tiered']:.4f} "
              f"(was {r['tiered']:.4f}) lru {row['lru']:.4f}  bookkeeping {row['bookkeeping_vs_lru']:.2f}x "
              f"(was {r['bookkeeping_vs_lru']:.2f}x)", flush=True)  # fmt: skip
    if not rows:
        raise SystemExit("no cell matches")
    summary = {
        "cells": len(rows),
        "hit_rate_changed": sum(abs(x["tiered"] - x["tiered_recorded"]) > 1e-12 for x in rows),
        "lru_changed": sum(abs(x["lru"] - x["lru_recorded"]) > 1e-12 for x in rows),
        "cells_below_lru_bar": sum(x["tiered"] < x["lru"] - 0.002 for x in rows),
        "worst_vs_lru_points": 100 * min(x["tiered"] - x["lru"] for x in rows),
        "bookkeeping_median": statistics.median(x["bookkeeping_vs_lru"] for x in rows),
        "bookkeeping_max": max(x["bookkeeping_vs_lru"] for x in rows),
        "bookkeeping_median_recorded": statistics.median(x["bookkeeping_vs_lru_recorded"] for x in rows),
        "bookkeeping_max_recorded": max(x["bookkeeping_vs_lru_recorded"] for x in rows),
    }
    out = pathlib.Path(args.out) / f"{args.name}.json"
    env = trace_replay.environment()
    if args.git_sha:
        env["git_sha"] = args.git_sha
    out.write_text(json.dumps({"environment": env, "source": pathlib.Path(args.results).name,
                               "page_size": args.page_size, "min_pages": args.min_pages,
                               "wall_s": round(time.time() - t0), "summary": summary, "rows": rows}, indent=1))  # fmt: skip
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
