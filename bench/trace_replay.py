"""Trace-replay benchmark: token hit rate of ``TieredRadixCache`` against every eviction policy of
SGLang's own ``RadixCache`` (driven through the real classes, same call order, same run), the
offline optimum (Belady with bypass, page granularity) and the infinite-cache bound.

    .venv/bin/python bench/trace_replay.py                    # both workloads, 7 capacities
    .venv/bin/python bench/trace_replay.py --workload mooncake --fractions 0.01 0.05 --limit 3000
    .venv/bin/python bench/trace_replay.py --workload multitenant --seed 1 --name heldout   # held out

Writes bench/results/trace_replay.{csv,json,png} with the machine, versions and git sha.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import heapq
import json
import os
import pathlib
import platform
import random
import subprocess
import sys
import time
from array import array

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sglang_tiered.core.keys import chain_page_hashes  # noqa: E402
from sglang_tiered.dev.workloads import load_mooncake, multi_tenant  # noqa: E402

PAGE = 16
SGLANG_POLICIES = ["lru", "lfu", "slru", "fifo", "priority"]
SKIPPED = {"tlru": "needs UnifiedRadixCache (sglang/srt/mem_cache/registry.py:262-271); RadixCache "
                   "would silently fall back to LRU order"}  # fmt: skip


def capacity_pages(unique: int, max_req: int, frac: float, page: int) -> int:
    """A cell's cache: ``frac`` of the workload's unique pages, and never less than its longest
    request plus a page (every benchmark sizes its cells so)."""
    return max(int(unique * frac), -(-max_req // page) + 1)


def page_ids(reqs):
    """Per request, the list of page ids (tenant-scoped prefix chains), as small ints."""
    ids: dict[bytes, int] = {}
    out = []
    for r in reqs:  # the one chain-hash implementation (core/keys.py), seeded by the tenant
        seed = hashlib.blake2b((r.tenant or "").encode(), digest_size=16).digest()
        out.append([ids.setdefault(h, len(ids)) for h in chain_page_hashes(seed, r.tokens, PAGE)])
    return out, len(ids)


def infinite_hits(pages) -> int:
    seen: set[int] = set()
    hits = 0
    for row in pages:
        k = 0
        while k < len(row) and row[k] in seen:
            k += 1
        hits += k * PAGE
        seen.update(row)
    return hits


def belady_hits(pages, capacity_pages: int) -> int:
    """Belady with bypass at page granularity: after each request keep the pages whose next use
    is soonest (ties: deeper first evicted), so a child never outlives its parent."""
    INF = 1 << 60
    nxt: list[list[int]] = [None] * len(pages)  # type: ignore[list-item]
    last: dict[int, int] = {}
    for i in range(len(pages) - 1, -1, -1):
        nxt[i] = [last.get(p, INF) for p in pages[i]]
        for p in pages[i]:
            last[p] = i
    cur: dict[int, int] = {}  # page -> its current next use
    depth: dict[int, int] = {}
    heap: list[tuple[int, int, int]] = []
    hits = 0
    for i, row in enumerate(pages):
        k = 0
        while k < len(row) and row[k] in cur:
            k += 1
        hits += k * PAGE
        for j, p in enumerate(row):
            cur[p] = nxt[i][j]
            depth[p] = j
            heapq.heappush(heap, (-nxt[i][j], -j, p))
        while len(cur) > capacity_pages:
            neg_nu, _, p = heapq.heappop(heap)
            if cur.get(p) == -neg_nu:
                del cur[p]
    return hits


def sglang_driver(capacity_tokens: int, policy: str):
    """A ``CacheDriver`` over SGLang's own ``RadixCache`` with eviction policy ``policy``."""
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from sglang_tiered.dev.simulate import CacheDriver, make_params

    params, alloc, pool = make_params(capacity_tokens, PAGE, 1 << 17, eviction_policy=policy)
    return CacheDriver(RadixCache(params), alloc, pool)


def replay_sglang(reqs, capacity_tokens: int, policy: str, output_tokens: int = 0):
    return _replay(sglang_driver(capacity_tokens, policy), reqs, output_tokens)


def replay_tiered(reqs, capacity_tokens: int, policy_config=None, output_tokens: int = 0):
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

    cache = TieredRadixCache.create_simulated(capacity_tokens, PAGE, policy_config=policy_config)
    res = _replay(cache.driver, reqs, output_tokens)
    res["policy_state"] = cache.policy.snapshot()
    return res


def timed_pair(reqs, capacity_tokens: int, runs: int):
    """µs/request of SGLang lru and of tiered, each the minimum over ``runs`` interleaved replays
    (the usual way to take machine noise out of a timing; both sides get the same treatment)."""
    lru, tiered = [], []
    for _ in range(runs):
        lru.append(replay_sglang(reqs, capacity_tokens, "lru")["us_per_req"])
        tiered.append(replay_tiered(reqs, capacity_tokens)["us_per_req"])
    return min(lru), min(tiered)


def generated_ids(tokens, tenant, n: int) -> list[int]:
    """``n`` output tokens for a prompt, a function of the prompt and tenant as greedy decoding's
    are (the same prompt, the same output), in the workloads' token range."""
    from sglang_tiered.dev.workloads import TOKEN_HI, TOKEN_LO

    d = hashlib.blake2b(repr(tenant).encode() + bytes(memoryview(array("q", tokens))), digest_size=16).digest()
    rng = random.Random(d)
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]


def _replay(driver, reqs, output_tokens: int = 0):
    """Each request through ``driver``. ``output_tokens`` 0 (the default): each finishes at its
    prefill, its whole prompt matchable (the recorded digests); n > 0: as a live server runs it
    with ``max_new_tokens`` n and ``ignore_eos`` (the match stops a token short of the prompt,
    ``_compute_max_prefix_len``; n tokens decoded and all but the last left in the tree,
    ``CacheDriver.decode``), the outputs ``generated_ids`` (a trace's next turns never repeat them:
    the pages they fill serve no later request, and take the pool from those that would)."""
    hit = tot = 0
    spent = 0.0
    unserved = 0
    per_request = []
    for r in reqs:
        if output_tokens:
            o = driver.run(r.tokens, tenant=r.tenant, max_prefix_len=len(r.tokens) - 1,
                           output_ids=generated_ids(r.tokens, r.tenant, output_tokens))  # fmt: skip
        else:
            o = driver.run(r.tokens, tenant=r.tenant)
        hit += o.cached_len
        tot += o.prompt_len
        spent += o.seconds
        unserved += not o.served
        per_request.append(o.cached_len)
    return {"hit_tokens": hit, "prompt_tokens": tot, "us_per_req": spent / len(reqs) * 1e6,
            "unserved": unserved, "per_request": per_request}  # fmt: skip


def environment() -> dict:
    def run(*cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT).stdout.strip()
        except OSError:
            return ""

    import torch
    from importlib.metadata import version

    from sglang_tiered.core.keys import HASH_IMPL, KEYS_IMPL
    from sglang_tiered.core.miniature import MINI_IMPL
    from sglang_tiered.core.sketch import SKETCH_IMPL

    return {
        "git_sha": run("git", "rev-parse", "--short", "HEAD"),
        # os.cpu_count(), not nproc: nproc reports OMP_NUM_THREADS when that is set
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores".strip(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "sglang": version("sglang"),
        # chain_page_hashes' path: "c" (the optional extension) or "python" (session 41)
        "page_hash_impl": HASH_IMPL,
        # chain_page_keys' path: what a tree without T1 or the fleet index keys its pages by
        # (session 46; a build from before it has no C keys: "python" where hashing says "c")
        "page_keys_impl": KEYS_IMPL,
        # the admission duel's miniatures and the TinyLFU sketch: "c" or "python" (session 42)
        "mini_impl": MINI_IMPL,
        "sketch_impl": SKETCH_IMPL,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def check_fractions(ap, fractions) -> None:
    """``--fractions``: shares of the unique pages, each in (0, 1] (NaN fails both tests)."""
    if not fractions or not all(0 < f <= 1 for f in fractions):
        ap.error(f"--fractions are shares of the unique pages, each in (0, 1], got {fractions}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["mooncake", "multitenant", "both"], default="both")
    ap.add_argument("--fractions", type=float, nargs="+",
                    default=[0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2])  # fmt: skip
    ap.add_argument("--limit", type=int, default=None, help="first N requests only")
    ap.add_argument("--seed", type=int, default=0, help="multi-tenant generator seed")
    ap.add_argument("--mooncake-from", type=float, default=0.0,
                    help="replay the Mooncake trace from this fraction on (0.5: its second half only)")
    ap.add_argument("--timing-runs", type=int, default=2,
                    help="extra interleaved lru/tiered replays for the overhead ratio (min is kept)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--name", default="trace_replay")
    args = ap.parse_args(argv)
    # bad arguments stop with a usage message, not a traceback mid-run (a helper's hunt, session 32)
    check_fractions(ap, args.fractions)
    if args.limit is not None and args.limit < 1:
        ap.error(f"--limit must be >= 1, got {args.limit}")
    if not 0 <= args.mooncake_from < 1:
        ap.error(f"--mooncake-from is a fraction of the trace in [0, 1), got {args.mooncake_from}")
    if args.timing_runs < 0:
        ap.error(f"--timing-runs must be >= 0, got {args.timing_runs}")

    workloads = {}
    if args.workload in ("mooncake", "both"):
        mc = load_mooncake(ROOT / "bench" / "data" / "mooncake_conversation_trace.jsonl.gz", limit=args.limit)
        workloads["mooncake"] = mc[int(len(mc) * args.mooncake_from):]
    if args.workload in ("multitenant", "both"):
        workloads["multitenant"] = multi_tenant(n_requests=args.limit or 4000, seed=args.seed)

    rows = []
    for wname, reqs in workloads.items():
        pages, unique = page_ids(reqs)
        inf = infinite_hits(pages)
        total = sum(len(r.tokens) for r in reqs)
        max_req = max(len(r.tokens) for r in reqs)
        print(f"[{wname}] {len(reqs)} requests, {total} prompt tokens, {unique} unique pages, "
              f"infinite-cache hit rate {inf / total:.4f}", flush=True)  # fmt: skip
        for frac in args.fractions:
            cap_pages = capacity_pages(unique, max_req, frac, PAGE)
            cap = cap_pages * PAGE
            row = {"workload": wname, "fraction": frac, "capacity_pages": cap_pages,
                   "infinite": inf / total}  # fmt: skip
            t0 = time.time()
            row["belady"] = belady_hits(pages, cap_pages) / total
            for pol in SGLANG_POLICIES:
                r = replay_sglang(reqs, cap, pol)
                row[pol] = r["hit_tokens"] / total
                row[f"us_{pol}"] = r["us_per_req"]
            r = replay_tiered(reqs, cap)
            row["tiered"] = r["hit_tokens"] / total
            row["us_tiered"] = r["us_per_req"]
            ps = r["policy_state"]
            row["mode_at_end"] = ps["mode"]
            row["protection_k_at_end"] = ps["protection_k"]
            row["cold_age_c_at_end"] = ps["cold_age_c"]
            if args.timing_runs:
                us_lru, us_tiered = timed_pair(reqs, cap, args.timing_runs)
                row["us_lru"] = min(row["us_lru"], us_lru)
                row["us_tiered"] = min(row["us_tiered"], us_tiered)
            best = max(SGLANG_POLICIES, key=lambda p: row[p])
            row["best_sglang"], row["best_sglang_policy"] = row[best], best
            gap = row["belady"] - row["lru"]
            row["gap_closed_vs_lru"] = (row["tiered"] - row["lru"]) / gap if gap > 0 else 0.0
            row["overhead_vs_lru"] = row["us_tiered"] / row["us_lru"]
            row["beats_best"] = row["tiered"] >= row["best_sglang"]
            rows.append(row)
            print(f"  cap {frac:6.1%} ({cap_pages:6d} pages): tiered {row['tiered']:.4f}  "
                  f"best sglang {row['best_sglang']:.4f} ({best})  lru {row['lru']:.4f}  "
                  f"belady {row['belady']:.4f}  gap closed {row['gap_closed_vs_lru']:.1%}  "
                  f"overhead x{row['overhead_vs_lru']:.2f}  ({row['mode_at_end']}, k={row['protection_k_at_end']}, "
                  f"c={row['cold_age_c_at_end']})  [{time.time() - t0:.0f}s]", flush=True)  # fmt: skip

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    with open(out / f"{args.name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    (out / f"{args.name}.json").write_text(
        json.dumps({"environment": env, "page_size": PAGE, "skipped_policies": SKIPPED,
                    "multitenant_seed": args.seed, "mooncake_from": args.mooncake_from,
                    "timing": f"min of {args.timing_runs + 1} replays each",
                    "rows": rows}, indent=2))  # fmt: skip
    _plot(rows, out / f"{args.name}.png", env)
    ok = all(r["beats_best"] for r in rows)
    worst = max(r["overhead_vs_lru"] for r in rows)
    print(f"tiered >= best SGLang policy at every point: {ok}; worst overhead vs lru x{worst:.2f}; "
          f"wrote {out}/{args.name}.*")  # fmt: skip
    return 0


def _plot(rows, path, env) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wl = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, len(wl), figsize=(6.5 * len(wl), 4.5), squeeze=False)
    for ax, w in zip(axes[0], wl):
        rs = [r for r in rows if r["workload"] == w]
        x = [r["fraction"] * 100 for r in rs]
        for key, style in [("belady", "k--"), ("infinite", "k:"), ("tiered", "r-o")] + [
            (p, "-") for p in SGLANG_POLICIES
        ]:
            ax.plot(x, [r[key] for r in rs], style, label=key, linewidth=2.2 if key == "tiered" else 1)
        ax.set_xscale("log")
        ax.set_xlabel("device capacity, % of unique pages")
        ax.set_ylabel("token hit rate")
        ax.set_title(w)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"sglang-tiered vs SGLang {env['sglang']} RadixCache policies (git {env['git_sha']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
