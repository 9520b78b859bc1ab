"""Live comparison on real servers (the demo): stock SGLang (RadixCache lru) vs sglang-tiered (with
T1) on the same device pool and the same seeded multi-tenant workload, plus a no-cache reference
server for output equality.

    .venv/bin/python bench/live_compare.py                     # `make demo`
    .venv/bin/python bench/live_compare.py --requests 300 --pool-tokens 4096 --concurrency 2

Reports token hit rate by tier, prefill tokens recomputed, TTFT p50/p90, requests/s, and whether
every greedy output matched the no-cache reference; then the long-prefix scenario (TTFT of a
2,048-token prefix promoted from T1 vs recomputed, same request, same server), with SGLang's
torch_native extend and with the prefix-aware one (SGLANG_TIERED_PREFIX_ATTENTION=on); writes
JSON, CSV and a PNG under --out.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import csv
import json
import pathlib
import statistics
import sys
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.trace_replay import environment  # noqa: E402
from sglang_tiered.dev.server import Server, ServerSpec, add_threads_option, use_server_threads  # noqa: E402
from sglang_tiered.dev.workloads import multi_tenant  # noqa: E402


def stream_generate(url: str, payload: dict, timeout: float = 600.0, headers: dict | None = None,
                    worker_headers: tuple = ()) -> dict:  # fmt: skip
    """POST /generate with stream=true; returns ttft_s, latency_s, output_ids, cached/prompt tokens
    and, with ``worker_headers``, ``worker``: the first of those response headers present (which
    worker a router says served the request)."""
    body = json.dumps({**payload, "stream": True}).encode()
    req = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json", **(headers or {})})
    t0 = time.perf_counter()
    ttft = None
    last = None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        worker = next((r.headers.get(h) for h in worker_headers if r.headers.get(h)), None)
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            if ttft is None:
                ttft = time.perf_counter() - t0
            last = json.loads(data)
    latency = time.perf_counter() - t0
    meta = last["meta_info"]
    return {"ttft_s": ttft, "latency_s": latency, "output_ids": last.get("output_ids"),
            "prompt_tokens": meta["prompt_tokens"], "cached_tokens": meta.get("cached_tokens", 0),
            **({"worker": worker} if worker_headers else {})}  # fmt: skip


def replay(server: Server, reqs, concurrency: int, label: str) -> tuple[list[dict], float]:
    from tqdm import tqdm

    def one(i_r):
        i, r = i_r
        payload = {"input_ids": list(r.tokens), "sampling_params": {"temperature": 0, "max_new_tokens": r.max_new_tokens}}
        if r.tenant:
            payload["cache_salt"] = r.tenant
        out = stream_generate(server.url, payload)
        out["i"], out["tenant"], out["kind"] = i, r.tenant, r.kind
        return out

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as ex:
        results = list(tqdm(ex.map(one, enumerate(reqs)), total=len(reqs), desc=label, ncols=90))
    return sorted(results, key=lambda x: x["i"]), time.perf_counter() - t0


def long_prefix_ttft(server: Server, reps: int = 7, prefix_tokens: int = 2048, seed: int = 7) -> dict:
    """The user-visible win of T1: TTFT of a request whose ``prefix_tokens``-token prefix is
    recomputed, then of the same request once that prefix has been pushed to T1 (POST
    /flush_cache demotes the device tree) and is promoted back. Median over ``reps`` fresh
    prefixes, same server."""
    import random

    rng = random.Random(seed)
    warm = {"input_ids": [rng.randrange(10, 2000) for _ in range(64)], "sampling_params": {"max_new_tokens": 1}}
    stream_generate(server.url, warm)
    rows = []
    for _ in range(reps):
        ids = [rng.randrange(10, 2000) for _ in range(prefix_tokens + 16)]
        payload = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
        cold = stream_generate(server.url, payload)
        assert server.request("POST", "/flush_cache?timeout=30")[0] == 200
        hot = stream_generate(server.url, payload)
        dev = stream_generate(server.url, payload)  # now on the device: a device hit, for reference
        rows.append({"recompute_ttft_ms": cold["ttft_s"] * 1e3, "t1_ttft_ms": hot["ttft_s"] * 1e3,
                     "device_hit_ttft_ms": dev["ttft_s"] * 1e3,
                     "t1_cached_tokens": hot["cached_tokens"], "same_output": hot["output_ids"] == cold["output_ids"]})  # fmt: skip
        assert server.request("POST", "/flush_cache?timeout=30")[0] == 200  # next prefix starts equal
    rec = statistics.median(r["recompute_ttft_ms"] for r in rows)
    hot = statistics.median(r["t1_ttft_ms"] for r in rows)
    return {"prefix_tokens": prefix_tokens, "reps": reps, "recompute_ttft_ms_p50": rec, "t1_ttft_ms_p50": hot,
            "device_hit_ttft_ms_p50": statistics.median(r["device_hit_ttft_ms"] for r in rows),
            "ratio": hot / rec, "all_from_t1": all(r["t1_cached_tokens"] >= prefix_tokens for r in rows),
            "outputs_equal": all(r["same_output"] for r in rows), "runs": rows}  # fmt: skip


def summarize(results, wall_s) -> dict:
    prompt = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["cached_tokens"] for r in results)
    ttfts = sorted(r["ttft_s"] for r in results)
    q = statistics.quantiles(ttfts, n=10) if len(ttfts) >= 10 else [ttfts[len(ttfts) // 2]] * 9
    return {
        "requests": len(results),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "token_hit_rate": cached / prompt if prompt else 0.0,
        "recomputed_tokens": prompt - cached,
        "ttft_p50_ms": statistics.median(ttfts) * 1e3,
        "ttft_p90_ms": q[8] * 1e3,
        "requests_per_s": len(results) / wall_s,
        "wall_s": wall_s,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--pool-tokens", type=int, default=4096, help="device KV pool of both servers")
    ap.add_argument("--host-ratio", type=float, default=8.0, help="T1 size as a multiple of the pool")
    ap.add_argument("--scale", type=float, default=0.2, help="prompt length scale of the generator")
    ap.add_argument("--concurrency", type=int, default=1,
                    help="requests in flight; >1 batches requests differently per server, and bf16 "
                         "batch shapes can flip greedy tokens even without a cache")  # fmt: skip
    ap.add_argument("--layers", type=int, default=16,
                    help="layers of the built-in model variant (more layers: prefill dominates TTFT)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32",
                    help="serving dtype; in bf16, prefill over a cached prefix rounds differently from a "
                         "full recompute and flips some greedy tokens of a random model (stock SGLang too)")
    ap.add_argument("--model", help="model folder (default: the built-in tiny model)")
    ap.add_argument("--long-prefix-tokens", type=int, default=2048,
                    help="prefix length of the long-prefix scenario (T1 hit vs recompute, same request)")
    ap.add_argument("--long-prefix-reps", type=int, default=5, help="fresh prefixes in the long-prefix scenario")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--name", default="demo")
    add_threads_option(ap)
    args = ap.parse_args(argv)
    use_server_threads(args.threads)

    from sglang_tiered.dev.tiny_model import build_model

    from sglang_tiered.dev.tiny_model import TinyModelSpec

    model = args.model or str(build_model(TinyModelSpec(num_layers=args.layers)))
    reqs = multi_tenant(n_requests=args.requests, seed=args.seed, scale=args.scale)
    for r in reqs:
        r.max_new_tokens = 8
    total = sum(len(r.tokens) for r in reqs)
    print(f"workload: {len(reqs)} requests, {total} prompt tokens, device pool {args.pool_tokens} tokens, "
          f"T1 {args.host_ratio:g}x pool", flush=True)  # fmt: skip
    logs = pathlib.Path(args.out) / "logs"
    runs = {}
    specs = {
        "stock": ServerSpec(model_path=model, backend=None, max_total_tokens=args.pool_tokens, dtype=args.dtype),
        "tiered": ServerSpec(model_path=model, backend="tiered", max_total_tokens=args.pool_tokens, dtype=args.dtype,
                             env={"SGLANG_TIERED_HOST": "on", "SGLANG_TIERED_HOST_RATIO": str(args.host_ratio)}),
        "reference": ServerSpec(model_path=model, backend=None, disable_radix_cache=True,
                                max_total_tokens=args.pool_tokens, dtype=args.dtype),
    }  # fmt: skip
    tier_stats = None
    for name, spec in specs.items():  # one server at a time: 2 cores
        print(f"[{name}] starting server ...", flush=True)
        with Server(spec, logs / f"{args.name}-{name}.log") as server:
            results, wall = replay(server, reqs, args.concurrency, name)
            if name == "tiered":
                tier_stats = server.request("GET", "/cache/stats")[1]
                print("[tiered] long-prefix TTFT: recompute vs from T1 ...", flush=True)
                long_prefix_tiny = long_prefix_ttft(server, reps=args.long_prefix_reps, prefix_tokens=args.long_prefix_tokens)
        runs[name] = (results, wall)
    # The same scenario with the prefix-aware extend attention (SGLANG_TIERED_PREFIX_ATTENTION=on,
    # integration/prefix_attention.py): SGLang's torch_native backend (the CPU one) computes
    # attention over the whole sequence on every extend, so above even a device hit of a 2k prefix
    # costs half a recompute; with it on, a request with a cached prefix computes its new rows only.
    print("[long-prefix] tiered + T1, prefix-aware extend attention: recompute vs from T1 ...", flush=True)
    pa_spec = ServerSpec(model_path=model, backend="tiered", max_total_tokens=args.pool_tokens, dtype=args.dtype,
                         env={"SGLANG_TIERED_HOST": "on", "SGLANG_TIERED_HOST_RATIO": str(args.host_ratio),
                              "SGLANG_TIERED_PREFIX_ATTENTION": "on"})  # fmt: skip
    with Server(pa_spec, logs / f"{args.name}-long-prefix.log") as server:
        long_prefix = long_prefix_ttft(server, reps=args.long_prefix_reps, prefix_tokens=args.long_prefix_tokens)
    spec_txt = pathlib.Path(model).name if args.model else f"{args.layers} layers, hidden 256, FFN 512 (the demo's model)"
    long_prefix["model"] = f"{spec_txt}; SGLANG_TIERED_PREFIX_ATTENTION=on"
    long_prefix_tiny["model"] = f"{spec_txt}; SGLang's torch_native extend (the tiered server above)"

    ref = [r["output_ids"] for r in runs["reference"][0]]
    table = {}
    for name in ("stock", "tiered"):
        res, wall = runs[name]
        s = summarize(res, wall)
        s["outputs_match_reference"] = all(r["output_ids"] == o for r, o in zip(res, ref))
        s["mismatches"] = sum(r["output_ids"] != o for r, o in zip(res, ref))
        table[name] = s
    host_tokens = tier_stats["totals"]["promoted_pages"] * tier_stats["page_size"]
    table["tiered"]["host_hit_tokens"] = host_tokens
    table["tiered"]["device_hit_tokens"] = table["tiered"]["cached_tokens"] - host_tokens
    table["stock"]["host_hit_tokens"] = 0
    table["stock"]["device_hit_tokens"] = table["stock"]["cached_tokens"]
    st, ti = table["stock"], table["tiered"]
    ratios = {
        "recomputed_tokens": ti["recomputed_tokens"] / max(1, st["recomputed_tokens"]),
        "ttft_p50": ti["ttft_p50_ms"] / st["ttft_p50_ms"],
        "ttft_p90": ti["ttft_p90_ms"] / st["ttft_p90_ms"],
        "requests_per_s": ti["requests_per_s"] / st["requests_per_s"],
    }
    rows = [
        ("token hit rate (all tiers)", f"{st['token_hit_rate']:.1%}", f"{ti['token_hit_rate']:.1%}"),
        ("  from device", f"{st['device_hit_tokens'] / st['prompt_tokens']:.1%}", f"{ti['device_hit_tokens'] / ti['prompt_tokens']:.1%}"),
        ("  from host (T1)", "-", f"{ti['host_hit_tokens'] / ti['prompt_tokens']:.1%}"),
        ("prefill tokens recomputed", f"{st['recomputed_tokens']}", f"{ti['recomputed_tokens']}  (x{ratios['recomputed_tokens']:.2f})"),
        ("TTFT p50 ms", f"{st['ttft_p50_ms']:.1f}", f"{ti['ttft_p50_ms']:.1f}  (x{ratios['ttft_p50']:.2f})"),
        ("TTFT p90 ms", f"{st['ttft_p90_ms']:.1f}", f"{ti['ttft_p90_ms']:.1f}  (x{ratios['ttft_p90']:.2f})"),
        ("requests/s", f"{st['requests_per_s']:.2f}", f"{ti['requests_per_s']:.2f}  (x{ratios['requests_per_s']:.2f})"),
        ("outputs == no-cache reference", str(st["outputs_match_reference"]), str(ti["outputs_match_reference"])),
    ]  # fmt: skip
    print(f"\n{'':32}{'stock SGLang (lru)':>20}   {'sglang-tiered + T1':<28}")
    for label, a, b in rows:
        print(f"{label:32}{a:>20}   {b:<28}")
    for lp in (long_prefix, long_prefix_tiny):
        print(f"\nlong prefix ({lp['prefix_tokens']} tokens, same request, median of {lp['reps']}; {lp['model']}):\n"
              f"  TTFT recomputed {lp['recompute_ttft_ms_p50']:.0f} ms, prefix from T1 {lp['t1_ttft_ms_p50']:.0f} ms "
              f"(x{lp['ratio']:.2f}), device hit {lp['device_hit_ttft_ms_p50']:.0f} ms; all from T1: "
              f"{lp['all_from_t1']}, outputs equal: {lp['outputs_equal']}")  # fmt: skip

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    # No machine paths in results: folders by name only.
    shown_args = {**vars(args), "out": pathlib.Path(args.out).name, "model": pathlib.Path(model).name}
    doc = {"environment": env, "args": shown_args, "table": table, "ratios_tiered_over_stock": ratios,
           "tiered_cache_stats": tier_stats, "long_prefix": long_prefix,
           "long_prefix_stock_attention": long_prefix_tiny}  # fmt: skip
    (out / f"{args.name}.json").write_text(json.dumps(doc, indent=2))
    with open(out / f"{args.name}.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["server", *table["stock"].keys()])
        for name in ("stock", "tiered"):
            w.writerow([name, *table[name].values()])
    with open(out / f"{args.name}-requests.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["server", "i", "tenant", "kind", "prompt_tokens", "cached_tokens", "ttft_s", "latency_s"])
        for name in ("stock", "tiered"):
            for r in runs[name][0]:
                w.writerow([name, r["i"], r["tenant"], r["kind"], r["prompt_tokens"], r["cached_tokens"],
                            f"{r['ttft_s']:.6f}", f"{r['latency_s']:.6f}"])  # fmt: skip
    _plot(table, runs, out / f"{args.name}.png", env)
    print(f"\nwrote {out}/{args.name}.json, .csv, -requests.csv and .png")
    ok = (ti["outputs_match_reference"] and st["outputs_match_reference"] and long_prefix["outputs_equal"]
          and long_prefix_tiny["outputs_equal"])
    return 0 if ok else 1


def _plot(table, runs, path, env) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = ["stock", "tiered"]
    dev = [table[n]["device_hit_tokens"] / table[n]["prompt_tokens"] for n in names]
    host = [table[n]["host_hit_tokens"] / table[n]["prompt_tokens"] for n in names]
    a1.bar(names, dev, label="device hits", color="tab:blue")
    a1.bar(names, host, bottom=dev, label="host (T1) hits", color="tab:orange")
    a1.set_ylabel("token hit rate")
    a1.set_title("prefix-cache token hit rate by tier")
    a1.legend()
    for n, c in zip(names, ("tab:blue", "tab:red")):
        t = sorted(r["ttft_s"] * 1e3 for r in runs[n][0])
        a2.plot(t, [i / len(t) for i in range(len(t))], label=n, color=c)
    a2.set_xscale("log")
    a2.set_xlabel("TTFT ms")
    a2.set_ylabel("fraction of requests")
    a2.set_title("TTFT CDF")
    a2.legend()
    fig.suptitle(f"sglang-tiered demo, same device pool (git {env['git_sha']}, sglang {env['sglang']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
