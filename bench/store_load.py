"""Live load test of the T1 store queue: the same tiered server (small device pool, 8 concurrent
clients, the seeded multi-tenant workload) with T1 off, T1 with synchronous demotion at eviction
(``SGLANG_TIERED_STORE=sync``), T1 through the store queue (``async``, the default), and the
queue bounded to a few runs so that it fills and value-drop runs under live load; one run.

    .venv/bin/python bench/store_load.py                       # ~5 min on 2 cores
    .venv/bin/python bench/store_load.py --requests 400 --concurrency 8 --pool-tokens 2048
    .venv/bin/python bench/store_load.py --repeats 3 --threads 1   # 3 seeds' workloads, pooled
    .venv/bin/python bench/store_load.py --sim-only                # simulated sync vs queue only

Reports TTFT p50/p90, requests/s, token hit rate by tier and the queue's counters, with
ratios against T1 off; writes bench/results/store_load.{json,csv,png}.
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.live_compare import replay, summarize  # noqa: E402
from bench.trace_replay import environment  # noqa: E402
from sglang_tiered.dev.server import Server, ServerSpec, add_threads_option, use_server_threads  # noqa: E402
from sglang_tiered.dev.workloads import multi_tenant  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=320)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--pool-tokens", type=int, default=2048)
    ap.add_argument("--host-ratio", type=float, default=8.0)
    ap.add_argument("--scale", type=float, default=0.2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--name", default="store_load")
    ap.add_argument("--chunk", type=int, default=40, help="requests per interleaved chunk")
    ap.add_argument("--small-queue-pages", type=int, default=24, help="queue bound of the t1_async_small_queue config")
    ap.add_argument("--repeats", type=int, default=1,
                    help="replay this many seeds' workloads (seed, seed+1, ...) on the same servers, each from cold")
    ap.add_argument("--sim-seeds", type=int, default=8,
                    help="also replay this many seeded workloads in simulation (sync vs queue, deterministic)")
    ap.add_argument("--twin-sync", action="store_true",
                    help="also run a second synchronous server (how far two identical servers differ)")
    ap.add_argument("--sim-only", action="store_true", help="only the simulated comparison (no servers)")
    add_threads_option(ap)
    args = ap.parse_args(argv)
    use_server_threads(args.threads)
    sim = simulated_comparison(args) if args.sim_seeds else None
    if args.sim_only:
        _write_sim(args, sim)
        return 0

    from sglang_tiered.dev.tiny_model import TinyModelSpec, build_model

    model = str(build_model(TinyModelSpec(num_layers=args.layers)))
    configs = {
        "t1_off": {"SGLANG_TIERED_HOST": "off"},
        "t1_sync": {"SGLANG_TIERED_HOST": "on", "SGLANG_TIERED_STORE": "sync"},
        "t1_async": {"SGLANG_TIERED_HOST": "on", "SGLANG_TIERED_STORE": "async"},
        # the same queue bounded to a few runs: it fills, so value-drop runs under live load
        "t1_async_small_queue": {"SGLANG_TIERED_HOST": "on", "SGLANG_TIERED_STORE": "async",
                                 "SGLANG_TIERED_STORE_QUEUE_PAGES": str(args.small_queue_pages)},
    }
    if args.twin_sync:  # a second synchronous server: the run-to-run spread of one configuration
        configs["t1_sync_twin"] = dict(configs["t1_sync"])
    logs = pathlib.Path(args.out) / "logs"
    # All servers run at once and take the workload in interleaved chunks (rotating which
    # goes first), so background load on the machine falls on all of them alike. Each repeat
    # replays another seed's workload from a cold cache (device and T1 emptied).
    servers = {}
    counters = ("promoted_pages",)
    host_counters = ("stored_pages", "inline_pages", "value_dropped_pages", "filtered_pages", "demotions",
                     "ahead_offered_pages", "through_offered_pages", "staged_used_pages", "staged_dropped_pages")  # fmt: skip
    try:
        for name, env in configs.items():
            if env["SGLANG_TIERED_HOST"] != "off":  # (a T1 size with T1 off is refused)
                env = {**env, "SGLANG_TIERED_HOST_RATIO": str(args.host_ratio)}
            spec = ServerSpec(model_path=model, backend="tiered", max_total_tokens=args.pool_tokens,
                              dtype="float32", env=env)  # fmt: skip
            servers[name] = Server(spec, logs / f"{args.name}-{name}.log").start(timeout_s=300)
        names = list(servers)
        results = {name: [] for name in servers}
        walls = {name: 0.0 for name in servers}
        totals = {name: dict.fromkeys(counters + host_counters, 0) for name in servers}
        per_repeat = []
        for rep in range(args.repeats):
            reqs = multi_tenant(n_requests=args.requests, seed=args.seed + rep, scale=args.scale)
            for r in reqs:
                r.max_new_tokens = 4
            before = {}
            for name, server in servers.items():
                if rep == 0:
                    replay(server, reqs[:16], args.concurrency, f"{name} warm-up")
                _ok(server, "POST", "/flush_cache?timeout=30")
                _ok(server, "POST", "/cache/invalidate", {"all": True})  # T1 starts empty too
                before[name] = _counters(server, counters, host_counters)
            rep_results = {name: [] for name in servers}
            rep_walls = {name: 0.0 for name in servers}
            for k, start in enumerate(range(0, len(reqs), args.chunk)):
                chunk = reqs[start : start + args.chunk]
                for name in names[k % len(names) :] + names[: k % len(names)]:
                    res, wall = replay(servers[name], chunk, args.concurrency, f"{name} r{rep} {start}")
                    rep_results[name] += res
                    rep_walls[name] += wall
            row = {"seed": args.seed + rep}
            for name, server in servers.items():
                after = _counters(server, counters, host_counters)
                delta = {c: after[c] - before[name][c] for c in after}
                page = after["page_size"]
                s = summarize(rep_results[name], rep_walls[name])
                row[name] = {"token_hit_rate": s["token_hit_rate"], "ttft_p50_ms": s["ttft_p50_ms"],
                             "host_hit_rate": delta["promoted_pages"] * page / s["prompt_tokens"]}  # fmt: skip
                results[name] += rep_results[name]
                walls[name] += rep_walls[name]
                for c in counters + host_counters:
                    totals[name][c] += delta[c]
                totals[name]["page_size"] = page
            per_repeat.append(row)
        table = {}
        for name in servers:
            s = summarize(results[name], walls[name])
            s["host_hit_rate"] = totals[name]["promoted_pages"] * totals[name]["page_size"] / s["prompt_tokens"]
            for key in host_counters:
                s[key] = totals[name][key]
            table[name] = s
    finally:
        for server in servers.values():
            server.stop()
    base = table["t1_off"]
    for name, s in table.items():
        s["ttft_p50_vs_off"] = s["ttft_p50_ms"] / base["ttft_p50_ms"]
        s["ttft_p90_vs_off"] = s["ttft_p90_ms"] / base["ttft_p90_ms"]
    cols = ["token_hit_rate", "host_hit_rate", "ttft_p50_ms", "ttft_p90_ms", "ttft_p50_vs_off", "requests_per_s",
            "demotions", "stored_pages", "inline_pages", "value_dropped_pages", "filtered_pages"]  # fmt: skip
    print(f"\n{'':14}" + "".join(f"{c:>18}" for c in cols))
    for name, s in table.items():
        print(f"{name:14}" + "".join(f"{s[c]:>18.3f}" if isinstance(s[c], float) else f"{s[c]:>18}" for c in cols))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    for row in per_repeat:
        print(f"repeat seed {row['seed']}: " + ", ".join(
            f"{n} hit {row[n]['token_hit_rate']:.4f} T1 {row[n]['host_hit_rate']:.4f}" for n in table))  # fmt: skip
    doc = {"environment": env, "args": {**vars(args), "out": out.name}, "table": table, "per_repeat": per_repeat,
           "simulated": sim}  # fmt: skip
    (out / f"{args.name}.json").write_text(json.dumps(doc, indent=2))
    with open(out / f"{args.name}.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["config", *cols])
        for name, s in table.items():
            w.writerow([name, *(s[c] for c in cols)])
    _plot(table, out / f"{args.name}.png", env)
    print(f"\nwrote {out}/{args.name}.json, .csv and .png")
    return 0


def _ok(server, method: str, path: str, payload=None):
    """The body of a 2xx answer, retried for up to a minute (SGLang answers /flush_cache with 400
    while requests are still finishing, and the cache endpoints with an error meanwhile)."""
    import time

    for _ in range(60):
        status, body = server.request(method, path, payload)
        if 200 <= status < 300:
            return body
        time.sleep(1.0)
    raise RuntimeError(f"{method} {path} kept answering {status}: {body}")


def _counters(server, counters, host_counters) -> dict:
    """The server's cumulative counters now (totals and T1's), to take differences per repeat."""
    stats = _ok(server, "GET", "/cache/stats")
    host = next((t for t in stats["tiers"] if t["name"] == "host"), {})
    out = {c: stats["totals"].get(c, 0) for c in counters}
    out.update({c: host.get(c, 0) for c in host_counters})
    out["page_size"] = stats["page_size"]
    return out


def simulated_comparison(args) -> dict:
    """The same comparison without a model or timing: each seed's workload through a simulated
    server (``create_simulated``: the same device pool, T1 size and queue bound, one request at a
    time), synchronous store vs the store queue vs the small queue. Deterministic, so it isolates
    what the queue changes in T1's content from a live run's batch timing."""
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

    page = 16
    host_pages = int(args.pool_tokens * args.host_ratio) // page
    queues = {"t1_sync": 0, "t1_async": max(64, args.pool_tokens // page), "t1_async_small_queue": args.small_queue_pages}
    rows = []
    for seed in range(args.seed, args.seed + args.sim_seeds):
        reqs = multi_tenant(n_requests=args.requests, seed=seed, scale=args.scale)
        row = {"seed": seed}
        for name, q in queues.items():
            cache = TieredRadixCache.create_simulated(args.pool_tokens, page, host_pages=host_pages, store_queue_pages=q)
            hit = total = 0
            for r in reqs:
                o = cache.driver.run(list(r.tokens), tenant=r.tenant)
                hit, total = hit + o.cached_len, total + o.prompt_len
            row[f"{name}_token_hit"] = hit / total
            row[f"{name}_t1_hit"] = cache.driver.host_loaded_tokens / total
            if cache.store is not None:
                row[f"{name}_inline_pages"] = cache.store.stats.inline_pages
                row[f"{name}_stored_pages"] = cache.store.stats.stored_pages
        rows.append(row)
        print(f"simulated seed {seed}: T1 hit sync {row['t1_sync_t1_hit']:.4f} queue {row['t1_async_t1_hit']:.4f} "
              f"small queue {row['t1_async_small_queue_t1_hit']:.4f}")  # fmt: skip
    diffs = [r["t1_async_t1_hit"] - r["t1_sync_t1_hit"] for r in rows]
    return {"rows": rows, "queue_minus_sync_t1_hit_min": min(diffs), "queue_minus_sync_t1_hit_max": max(diffs),
            "seeds_queue_below_sync": sum(d < 0 for d in diffs)}  # fmt: skip


def _write_sim(args, sim) -> None:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"environment": environment(), "args": {**vars(args), "out": out.name}, "simulated": sim}
    (out / f"{args.name}_sim.json").write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}/{args.name}_sim.json")


def _plot(table, path, env) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(table)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"t1_off": "grey", "t1_sync": "tab:orange", "t1_sync_twin": "tab:orange", "t1_async": "tab:green"}
    a1.bar(names, [table[n]["ttft_p50_ms"] for n in names], color=[colors.get(n, "tab:olive") for n in names])
    a1.set_ylabel("TTFT p50 ms")
    a1.set_title("TTFT p50, 8 concurrent clients")
    a2.bar(names, [table[n]["token_hit_rate"] - table[n]["host_hit_rate"] for n in names], label="device")
    a2.bar(names, [table[n]["host_hit_rate"] for n in names], bottom=[table[n]["token_hit_rate"] - table[n]["host_hit_rate"]
                                                                       for n in names], label="T1")  # fmt: skip
    a2.set_ylabel("token hit rate")
    a2.legend()
    for a in (a1, a2):
        a.tick_params(axis="x", labelrotation=20)
    fig.suptitle(f"T1 store queue vs synchronous demotion vs T1 off (git {env['git_sha']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
