"""T2 benchmark (issue #14): fleet hit rate with and without T2 when tenants move between servers,
and T2 transfer GB/s next to raw Mooncake, on a real mooncake_master in a loopback-only network
namespace (the script re-runs itself under ``unshare -n``; needs root). No model.

    .venv/bin/python bench/t2_fleet.py                 # both parts (~5 min on 2 cores)
    .venv/bin/python bench/t2_fleet.py --requests 600  # quicker

Part 1, hit rate: N simulated servers (``TieredRadixCache.create_simulated``: device + T1, real
page bytes) replay the multi-tenant workload and the Mooncake conversation trace. Routings:
round robin without T2, round robin with T2 (one shared master), and tenant affinity (rendezvous
hashing by tenant) without T2 as the reference for "the cache sees its tenants". Fleet token hit
rate = sum of cached tokens / sum of prompt tokens, per server too; every served prefix is checked
against recomputation (``verify_kv``).

Part 2, transfer: runs of 1/16/64 pages of 128 KiB and 512 KiB (16-token pages of a 4-layer fp32
model with 4 KV heads of 64, and of an 8-layer bf16 model with 8 KV heads of 128), written and read (a) through T2's own paths (the store
worker's staging copy + ``batch_put_from``; ``fetch``: ``batch_is_exist`` + ``batch_get_into`` +
header checks + the copy into T1 slots) and (b) with the raw Mooncake calls on a registered buffer,
same keys and sizes. Median of 5; GB/s of payload.

Writes bench/results/t2_fleet.{json,csv,png} with machine, versions and git sha.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PAGE = 16
PORT = 50091


def _in_netns() -> None:
    """Re-run this script inside a fresh loopback-only network namespace (Mooncake listens on
    every interface whatever it is told)."""
    if os.environ.get("SGLANG_TIERED_IN_NETNS") == "1":
        return
    env = dict(os.environ, SGLANG_TIERED_IN_NETNS="1")
    cmd = ["unshare", "-n", "bash", "-c", 'ip link set lo up && exec "$@"', "netns", sys.executable, *sys.argv]
    sys.exit(subprocess.call(cmd, env=env))


def _rendezvous(tenant: str, n: int) -> int:
    return max(range(n), key=lambda i: hashlib.blake2b(f"{tenant}|{i}".encode(), digest_size=8).digest())


def hit_rates(workload: str, reqs, n_servers: int, device: int, host_ratio: float, url: str) -> list[dict]:
    from sglang_tiered.core.keys import CacheKey
    from sglang_tiered.integration.t2_setup import attach_t2
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache
    from sglang_tiered.tier.t2_config import parse_t2_url

    rows = []
    runs = [("round_robin", "rr", False), ("round_robin+T2", "rr", True)]
    if any(t for _, t in reqs):  # affinity needs tenants (the Mooncake trace has none)
        runs.append(("tenant_affinity", "aff", False))
    for label, route, with_t2 in runs:
        key = CacheKey(model_id=f"bench-{workload}", weights_digest=f"{label}-{time.time_ns()}", kv_dtype="float32")
        servers = []
        for _ in range(n_servers):
            c = TieredRadixCache.create_simulated(device, page_size=PAGE, cache_key=key, verify_kv=True,
                                                  host_pages=int(device * host_ratio) // PAGE,
                                                  max_request_tokens=16384)  # fmt: skip
            if with_t2:
                attach_t2(c, parse_t2_url(url))
            servers.append(c)
        per = [[0, 0] for _ in servers]
        t0 = time.perf_counter()
        for i, (tokens, tenant) in enumerate(reqs):
            s = i % n_servers if route == "rr" else _rendezvous(tenant or "", n_servers)
            out = servers[s].driver.run(tokens, tenant=tenant)
            per[s][0] += out.prompt_len
            per[s][1] += out.cached_len
            if with_t2 and i % 50 == 49:  # let the store worker keep up, as between batches
                for c in servers:
                    c.t1.host.t2.wait_idle(5)
        prompt, cached = sum(p for p, _ in per), sum(c for _, c in per)
        row = {"part": "hit_rate", "workload": workload, "routing": label, "servers": n_servers,
               "device_tokens_per_server": device, "t1_pages_per_server": int(device * host_ratio) // PAGE,
               "requests": len(reqs), "prompt_tokens": prompt, "cached_tokens": cached,
               "fleet_hit_rate": round(cached / prompt, 4), "seconds": round(time.perf_counter() - t0, 1),
               "per_server_hit_rate": [round(c / p, 4) if p else 0 for p, c in per]}  # fmt: skip
        if with_t2:
            snaps = [c.t1.host.t2.snapshot() for c in servers]
            row["t2_fetched_pages"] = sum(s["fetched_pages"] for s in snaps)
            row["t2_stored_pages"] = sum(s["stored_pages"] for s in snaps)
            row["t2_dropped_pages"] = sum(s["dropped_pages"] for s in snaps)
            row["t2_failures"] = sum(s["failures"] for s in snaps)
            for c in servers:
                c.t1.host.t2.close()
        rows.append(row)
        print(f"[t2] {workload:12s} {label:16s} hit {row['fleet_hit_rate']:.3f}  ({row['seconds']} s)", flush=True)
    return rows


def transfer(url: str, reps: int = 5) -> list[dict]:
    import threading

    import torch

    from sglang_tiered.core.store_queue import StoreJob
    from sglang_tiered.tier.host_pool import HostPool, PoolLayout
    from sglang_tiered.tier.t2 import T2Tier
    from sglang_tiered.tier.t2_client import MooncakeClient
    from sglang_tiered.tier.t2_config import parse_t2_url

    cfg = parse_t2_url(url)
    rows = []
    # (layers, heads, head_dim, dtype): 128 KiB and 512 KiB pages of 16 tokens
    for layers, heads, dim, dtype in ((4, 4, 64, "float32"), (8, 8, 128, "bfloat16")):
        lay = PoolLayout(num_pages=80, layers=layers, kv_heads=heads, page_size=PAGE, head_dim=dim, dtype=dtype)
        pool = HostPool(lay)
        client = MooncakeClient(cfg)
        t2 = T2Tier(client, pool, threading.RLock(), cfg=cfg, model_tag=f"xfer{time.time_ns() % 10**9}")
        ob = t2.obj_bytes
        raw = torch.zeros(64 * ob, dtype=torch.uint8)
        raw.random_(0, 255)
        client.register(raw)
        for n in (1, 16, 64):
            res = {"t2_write": [], "t2_read": [], "raw_write": [], "raw_read": []}
            for r in range(reps):
                tag = f"{n}-{r}-{time.time_ns()}"
                hashes = [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest() for i in range(n)]
                data = torch.zeros((n, 2, layers, heads, PAGE, dim), dtype=lay.torch_dtype)
                job = StoreJob(0, 1.0, list(hashes), list(hashes), 7, data)
                t0 = time.perf_counter()
                t2._put_job(job)
                res["t2_write"].append(time.perf_counter() - t0)
                pool.clear()
                t0 = time.perf_counter()
                got = t2.fetch(hashes, 7)
                res["t2_read"].append(time.perf_counter() - t0)
                assert got == n, f"fetched {got} of {n}"
                keys = [f"sgt/raw/{tag}/{i}" for i in range(n)]
                ptrs = [raw.data_ptr() + i * ob for i in range(n)]
                t0 = time.perf_counter()
                assert all(x == 0 for x in client.put(keys, ptrs, [ob] * n))
                res["raw_write"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                assert all(x == ob for x in client.get(keys, ptrs, [ob] * n))
                res["raw_read"].append(time.perf_counter() - t0)
            for k, v in res.items():
                med = statistics.median(v)
                rows.append({"part": "transfer", "path": k, "page_bytes": lay.page_bytes, "run_pages": n,
                             "median_ms": round(med * 1e3, 3), "gbps": round(n * lay.page_bytes / med / 1e9, 3)})  # fmt: skip
            print(f"[t2] page {lay.page_bytes >> 10} KiB x {n:3d}: " + ", ".join(
                f"{r['path']} {r['gbps']:.2f} GB/s" for r in rows[-4:]), flush=True)  # fmt: skip
        t2.close()
        client.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--servers", type=int, default=3)
    ap.add_argument("--device-tokens", type=int, default=4096, help="per server")
    ap.add_argument("--host-ratio", type=float, default=1.0, help="T1 size / device size, per server")
    ap.add_argument("--part", choices=["all", "hit_rate", "transfer"], default="all")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "t2_fleet"))
    args = ap.parse_args()
    _in_netns()
    from sglang_tiered.dev.workloads import load_mooncake, multi_tenant
    from tests.netns import start_master

    tmp = pathlib.Path(tempfile.mkdtemp())
    master = start_master(PORT, tmp / "master.log")
    url = f"mooncake://127.0.0.1:{PORT}?segment_mb=512&buffer_mb=64&mode=on&timeout_ms=2000&max_run_pages=64"
    rows: list[dict] = []
    try:
        if args.part in ("all", "hit_rate"):
            wl = {
                "multitenant": [(r.tokens, r.tenant) for r in multi_tenant(args.requests, seed=3, n_tenants=12, scale=0.25)],
                "mooncake": [(r.tokens, r.tenant) for r in load_mooncake(
                    ROOT / "bench" / "data" / "mooncake_conversation_trace.jsonl.gz", limit=args.requests)],
            }  # fmt: skip
            for name, reqs in wl.items():
                rows += hit_rates(name, reqs, args.servers, args.device_tokens, args.host_ratio, url)
        if args.part in ("all", "transfer"):
            rows += transfer(url)
    finally:
        master.kill()
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    import torch

    try:
        from importlib.metadata import version

        mc = version("mooncake-transfer-engine-non-cuda")
    except Exception:  # noqa: BLE001
        mc = "?"
    meta = {"machine": f"{platform.machine()} {os.cpu_count()} cores", "python": platform.python_version(),
            "torch": torch.__version__, "mooncake": mc, "git_sha": sha,
            "args": {**vars(args), "out": os.path.relpath(args.out, ROOT)},
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    keys = sorted({k for r in rows for k in r})
    with out.with_suffix(".csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in keys})
    _plot(rows, meta, out.with_suffix(".png"))
    print(f"[t2] wrote {out.with_suffix('.json')}")


def _plot(rows, meta, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    hr = [r for r in rows if r["part"] == "hit_rate"]
    if hr:
        wls = sorted({r["workload"] for r in hr})
        routes = ["round_robin", "round_robin+T2", "tenant_affinity"]
        for j, route in enumerate(routes):
            vals = [next((r["fleet_hit_rate"] for r in hr if r["workload"] == w and r["routing"] == route), 0) for w in wls]
            axes[0].bar([i + j * 0.27 for i in range(len(wls))], vals, width=0.27, label=route)
        axes[0].set_xticks([i + 0.27 for i in range(len(wls))], wls)
        axes[0].set_ylabel("fleet token hit rate")
        axes[0].set_title(f"{hr[0]['servers']} servers, tenants moving (round robin)")
        axes[0].legend()
    tr = [r for r in rows if r["part"] == "transfer"]
    for path_name in ("t2_write", "raw_write", "t2_read", "raw_read"):
        for pb in sorted({r["page_bytes"] for r in tr}):
            pts = [(r["run_pages"], r["gbps"]) for r in tr if r["path"] == path_name and r["page_bytes"] == pb]
            if pts:
                axes[1].plot(*zip(*pts), marker="o", label=f"{path_name} {pb >> 10} KiB",
                             linestyle="-" if path_name.startswith("t2") else "--")  # fmt: skip
    axes[1].set_xscale("log")
    axes[1].set_xlabel("pages per run")
    axes[1].set_ylabel("GB/s (loopback TCP)")
    axes[1].set_title("T2 paths vs raw Mooncake")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"T2 on Mooncake Store ({meta['machine']}, git {meta['git_sha']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
