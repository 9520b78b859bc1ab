"""The lru bar under concurrency: tiered against SGLang's own RadixCache policies with several
requests in flight and chunked prefill (``dev/simulate.py``'s ``replay_concurrent``), where the
other benchmarks replay one request at a time.

In a server, requests overlap: several hold locks while another evicts, a request matches while
the KV of an earlier one with the same prefix is not in the tree yet, both compute it and the
second's checkpoint finds it there, and chunked prefill checkpoints a request mid-prompt. The
strict guarantee (``core/safety.py``) keeps SGLang's lru tree beside the cache, driven by the
same calls; this checks that its bound holds for that call order too, against SGLang's own
classes driven through the same schedule in the same process.

    .venv/bin/python bench/concurrent_bar.py --n 30 --batch 8 --chunk 0 512 --name concurrent_bar

Per cell (workload, capacity, batch, chunk): token hit rate of tiered and of each SGLang policy
asked for, margins vs lru and vs the best of them, and requests that could not be served (too
big for the cache alone; the same for every cache). Writes bench/results/<name>.{csv,json,png}
with the machine, versions and git sha, and prints the worst cells.
"""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing as mp
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import trace_replay  # noqa: E402
from trace_replay import capacity_pages, environment, page_ids  # noqa: E402
from workload_family import FRACTIONS, LRU_MARGIN, _load  # noqa: E402


def replay(kind: str, reqs, cap: int, batch: int, chunk: int, policy_config=None, told_serial=False) -> dict:
    """One concurrent replay of ``reqs`` through tiered (``kind == "tiered"``, its
    ``policy_config``, None: the default) or SGLang's RadixCache with eviction policy ``kind``.
    Tiered is told it may run ``batch`` requests at once, as SGLang's request pool tells a server
    (the strict default is then lru's order itself); ``told_serial``: told 1, the cache a server
    with --max-running-requests 1 has, run concurrently anyway (the serial guard's defence)."""
    from sglang_tiered.dev.simulate import replay_concurrent
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

    page = trace_replay.PAGE
    if kind == "tiered":
        driver = TieredRadixCache.create_simulated(cap, page, policy_config=policy_config,
                                                   max_in_flight=1 if told_serial else batch).driver  # fmt: skip
    else:
        driver = trace_replay.sglang_driver(cap, kind)
    t0 = time.perf_counter()
    outs = replay_concurrent(driver, [(r.tokens, r.tenant) for r in reqs], batch=batch, chunk=chunk)
    return {
        "hit_tokens": sum(o.cached_len for o in outs),
        "unserved": sum(not o.served for o in outs),
        "seconds": time.perf_counter() - t0,
    }


def run_workload(task):
    spec, fractions, batches, chunks, policies, told_serial = task
    import warnings

    warnings.filterwarnings("ignore")
    name, reqs, _ = _load(spec)
    _, unique = page_ids(reqs)
    total = sum(len(r.tokens) for r in reqs)
    max_req = max(len(r.tokens) for r in reqs)
    page = trace_replay.PAGE
    rows = []
    for frac in fractions:
        cap_pages = capacity_pages(unique, max_req, frac, page)
        for batch in batches:
            for chunk in chunks:
                row = {"workload": name, "fraction": frac, "requests": len(reqs), "capacity_pages": cap_pages,
                       "batch": batch, "chunk": chunk}  # fmt: skip
                for kind in ["tiered", *policies]:
                    r = replay(kind, reqs, cap_pages * page, batch, chunk, told_serial=told_serial)
                    row[kind] = r["hit_tokens"] / total
                    row[f"unserved_{kind}"] = r["unserved"]
                best = max(policies, key=lambda p: row[p])
                row["best_sglang"], row["best_sglang_policy"] = row[best], best
                row["margin_vs_lru"] = row["tiered"] - row["lru"]
                row["margin_vs_best"] = row["tiered"] - row["best_sglang"]
                rows.append(row)
    return name, rows


def summarize(rows) -> dict:
    below = [r for r in rows if r["margin_vs_lru"] < LRU_MARGIN]
    worst = sorted(rows, key=lambda r: r["margin_vs_lru"])[:10]
    return {
        "cells": len(rows),
        "below_lru_bar": len(below),
        "worst_margin_vs_lru": min(r["margin_vs_lru"] for r in rows),
        "mean_margin_vs_lru": sum(r["margin_vs_lru"] for r in rows) / len(rows),
        "beat_best": sum(r["margin_vs_best"] > 0 for r in rows),
        "unserved_differs": sum(len({v for k, v in r.items() if k.startswith("unserved_")}) > 1 for r in rows),
        "worst_cells": [{k: r[k] for k in ("workload", "fraction", "batch", "chunk", "tiered", "lru", "margin_vs_lru")}
                        for r in worst],  # fmt: skip
    }


def _plot(rows, path, env, summary) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    keys = sorted({(r["batch"], r["chunk"]) for r in rows})
    for j, (b, c) in enumerate(keys):
        sel = [r for r in rows if (r["batch"], r["chunk"]) == (b, c)]
        xs = [r["fraction"] * 100 * (1 + 0.04 * (j - len(keys) / 2)) for r in sel]
        ax.scatter(xs, [100 * r["margin_vs_lru"] for r in sel], s=8, alpha=0.6, label=f"batch {b}, chunk {c or 'off'}")
    ax.axhline(100 * LRU_MARGIN, color="red", lw=1, ls="--", label="lru bar (-0.2 points)")
    ax.set_xscale("log")
    ax.set_xlabel("capacity (% of the workload's unique pages)")
    ax.set_ylabel("tiered - SGLang lru (hit-rate points)")
    ax.set_title(f"lru bar under concurrency: {summary['below_lru_bar']} of {summary['cells']} cells below "
                 f"(worst {100 * summary['worst_margin_vs_lru']:+.3f})\n{env['git_sha'][:8]}, page {trace_replay.PAGE}",
                 fontsize=9)  # fmt: skip
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=30, help="family workloads (default 30)")
    ap.add_argument("--start", type=int, default=0, help="first family seed")
    ap.add_argument("--traces", action="store_true", help="also the Mooncake trace and the multi-tenant workload")
    ap.add_argument("--fractions", type=float, nargs="+", default=FRACTIONS)
    ap.add_argument("--batch", type=int, nargs="+", default=[8], help="requests in flight (default 8)")
    ap.add_argument("--chunk", type=int, nargs="+", default=[0, 512], help="prefill chunk tokens, 0 = off")
    ap.add_argument("--policies", nargs="+", default=["lru", "slru", "lfu"], help="SGLang policies (lru first)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--told-serial", action="store_true",
                    help="tell tiered it runs one request at a time (as with --max-running-requests 1): "
                         "the serial guard's defence, measured; default: told BATCH, as a server is")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--name", default="concurrent_bar")
    ap.add_argument("--git-sha", default=None, help="record this sha (a run from an export)")
    a = ap.parse_args(argv)
    if a.policies[0] != "lru" or min(a.batch) < 1 or min(a.chunk) < 0 or a.n < 0:
        ap.error("--policies must start with lru; --batch >= 1; --chunk >= 0; --n >= 0")
    trace_replay.PAGE = a.page_size
    specs = [("family", s) for s in range(a.start, a.start + a.n)]
    if a.traces:
        specs += [("mooncake", None), ("multitenant", 2000)]
    tasks = [(s, a.fractions, a.batch, a.chunk, a.policies, a.told_serial) for s in specs]
    rows = []
    t0 = time.time()
    with mp.get_context("fork").Pool(a.workers) as pool:
        for name, rs in pool.imap_unordered(run_workload, tasks):
            rows += rs
            w = min(rs, key=lambda r: r["margin_vs_lru"])
            print(f"{name}: worst vs lru {100 * w['margin_vs_lru']:+.3f} points ({w['fraction']:.3f}, batch {w['batch']}, "
                  f"chunk {w['chunk']}) [{time.time() - t0:.0f} s]", flush=True)  # fmt: skip
    rows.sort(key=lambda r: (r["workload"], r["fraction"], r["batch"], r["chunk"]))
    env = environment()
    if a.git_sha:
        env["git_sha"] = a.git_sha
    env.update(page_size=a.page_size, seconds=round(time.time() - t0, 1), argv=sys.argv[1:])
    summary = summarize(rows)
    out = ROOT / "bench" / "results" / a.name
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{out}.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    pathlib.Path(f"{out}.json").write_text(json.dumps({"environment": env, "summary": summary, "rows": rows}, indent=1))
    _plot(rows, f"{out}.png", env, summary)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
