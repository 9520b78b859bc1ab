"""Fleet simulator: N simulated servers (``TieredRadixCache.create_simulated``, device + T1) behind
each routing policy, on the Mooncake conversation trace and the multi-tenant workload. No model.

    .venv/bin/python bench/fleet_sim.py                       # both workloads, N = 1..44
    .venv/bin/python bench/fleet_sim.py --workload multitenant --ns 8 44 --limit 2000
    .venv/bin/python bench/fleet_sim.py --workload family-many-0 family-huge-0 --ns 1 8 44   # generated shapes
    .venv/bin/python bench/fleet_sim.py --workload live --limit 360 --ns 1 3 --clients 6 --host-ratio 0

``live`` is the live bench's workload (bench/fleet_live.py: 12 tenants, scale 0.2, prompts cut at 700
tokens, 3 x 6,144 device tokens, T1 off); ``live-long`` is its long-prompt form (``--scale 1
--prompt-tokens 2048``, 3 x 30,720 device tokens). With ``--clients 6`` the load model is its
closed loop (6 clients; load = requests in flight) instead of evenly spaced arrivals.

The total cache is fixed per workload (device tokens, T1 = --host-ratio x device) and split evenly
over the N servers, so N = 1 is "one server with the same total cache". Reports, per policy and
N: fleet token hit rate, load imbalance (work_imbalance, the acceptance's load metric: max/mean
over servers of work done = uncached prompt tokens + 32 per request, i.e. busy time; beside it
max/mean of requests routed), spill rate, mean queueing delay and a TTFT proxy (queueing delay +
the request's own uncached prefill at c_tok; its mean and p90). Writes bench/results/<name>.{json,csv,png}.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import pathlib
import platform
import subprocess
import sys
import time
from array import array

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sglang_tiered.core.keys import CacheKey, chain_page_hashes  # noqa: E402
from sglang_tiered.fleet.routing import POLICIES, AffinityCachePolicy  # noqa: E402
from sglang_tiered.fleet.sim import simulate  # noqa: E402
from sglang_tiered.dev.workloads import load_mooncake, multi_tenant  # noqa: E402

PAGE = 16
# The policy before fresh placement (git 1ba9086..fdb913f), for before/after in the same run:
# new content went to its key's homes (least loaded of 2), index matches from 5 % of the prompt.
EXTRA = {"ours_prev": lambda: AffinityCachePolicy(fresh=False, warm_frac=0.05, name="ours_prev"),
         "ours_priced": lambda: AffinityCachePolicy(warm_over_hatch=True, name="ours_priced"),
         # before the warm cap (session 22): a warm worker over the hatch never takes the request
         "ours_nocap": lambda: AffinityCachePolicy(warm_cap=0.0, name="ours_nocap"),
         # before the hatch read the policy's own work share (it read FleetView.load: live, requests in flight)
         "ours_view": lambda: AffinityCachePolicy(hatch_load="view", name="ours_view"),
         "ours_share": lambda: AffinityCachePolicy(hatch_load="share", name="ours_share"),
         "ours_both": lambda: AffinityCachePolicy(hatch_load="both", name="ours_both"),
         # without the routing memory: what a router that has just started (or one of several
         # routers) gets from the index alone; its gap to "ours" is the index's disagreement with
         # what the servers serve (see --diagnose's index_missed)
         "ours_nomem": lambda: AffinityCachePolicy(memory_pages=0, name="ours_nomem"),
         # before the hatch's work share left out the routing memory's credit (git dae6791)
         "ours_memshare": lambda: AffinityCachePolicy(share_by_index=False, name="ours_memshare"),
         # new content placed by the work queued ahead, not by cache inflow (live: ours-fq)
         "ours_fq": lambda: AffinityCachePolicy(fresh_by="queue", name="ours_fq"),
         # the policy before session 31: the warm cap only as leave for a warm worker over the hatch
         "ours_warmcap": lambda: AffinityCachePolicy(cap_all=False, name="ours_warmcap")}
ALL = {**POLICIES, **EXTRA}
# Total device tokens per workload: at N = 44 each server still fits the workload's longest prompt.
TOTAL_DEVICE = {"mooncake": 176_000, "multitenant": 44_000, "live": 3 * 6144, "live-long": 3 * 30720}


class SimServer:
    def __init__(self, capacity: int, host_ratio: float):
        from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

        host_pages = int(capacity * host_ratio) // PAGE
        self.cache = TieredRadixCache.create_simulated(capacity, page_size=PAGE, host_pages=host_pages,
                                                       max_request_tokens=8192)  # fmt: skip
        self.unserved = 0

    def attach_index(self, listener):
        self.cache.attach_index(listener)

    def run(self, tokens, tenant):
        out = self.cache.driver.run(tokens, tenant=tenant)
        self.unserved += not out.served
        if self.log is not None:
            self.log.append((out.prompt_len, out.cached_len))
        return out.prompt_len, out.cached_len

    log = None  # a list: (prompt, cached) per request served here, in order (--diagnose)


class Probe:
    """--diagnose: wraps a policy and records, per request, the longest prefix any server held
    (by the index), what the index said the chosen server held, and the policy's reason."""

    def __init__(self, policy):
        self.policy, self.name, self.rows = policy, policy.name, []

    def route(self, req, view):
        d = self.policy.route(req, view)
        m = view.matched or {}
        self.rows.append((max(m.values(), default=0), d.reason or ("spill" if d.spill else ""), m.get(d.worker, 0)))
        return d


def diagnose(single_log, probe, served) -> dict:
    """Where a fleet policy lost tokens against one server with the same total cache, per request:
    *routing loss*: a server held a longer prefix than the one the request was sent to (by
    reason); *capacity loss*: no server held what the single server had (the cache split into N
    parts); *capacity gain*: the reverse; *index missed*: tokens the chosen server served from its
    cache that the index did not say it held (the index should agree with the server exactly in
    the simulator: it has no latency). Fractions of all prompt tokens."""
    total = sum(p for p, _ in served)
    route: dict = {}
    cap_loss = cap_gain = missed = 0
    for (p1, c1), (best, reason, told), (p, c) in zip(single_log, probe.rows, served):
        missed += max(0, c - told)
        if best > c:
            route[reason] = route.get(reason, 0) + best - c
        d = c1 - max(best, c)
        cap_loss += max(0, d)
        cap_gain += max(0, -d)
    return {"routing_loss": round(sum(route.values()) / total, 4),
            "routing_loss_by_reason": {k: round(v / total, 4) for k, v in sorted(route.items())},
            "capacity_loss": round(cap_loss / total, 4), "capacity_gain": round(cap_gain / total, 4),
            "index_missed": round(missed / total, 4)}  # fmt: skip


# Generated shapes (sglang_tiered.dev.workload_family, other knobs drawn from the seed): so that the
# policy is not tuned to two traces. tenants / tenant Zipf skew overridden per shape.
SHAPES = {"many": (64, 0.6), "skewed": (32, 1.2), "huge": (16, 2.5), "single": (1, 1.0)}


# A generated shape's length in the recorded runs: about 27 requests per server at N = 44, where
# even round robin's work max/mean is 1.2-1.3 (--shape-requests sets it).
SHAPE_REQUESTS = 1200


def family_workload(name: str, limit: int, shape_requests: int = SHAPE_REQUESTS):
    """``family-<shape>-<seed>``: a generated workload with a fleet-relevant tenant shape, of at most
    ``shape_requests`` requests."""
    from sglang_tiered.dev.workload_family import draw, generate

    _, shape, seed = name.split("-")
    p = draw(int(seed))
    p.tenants, p.tenant_zipf = SHAPES[shape]
    p.n_requests = min(limit, shape_requests)
    return generate(p)


def total_device_tokens(name: str, reqs) -> int:
    """Fixed per workload; for generated ones, 3 % of the prompt tokens, and at N = 44 every server
    still fits 1.25 x the longest prompt."""
    if name in TOTAL_DEVICE:
        return TOTAL_DEVICE[name]
    longest = max(len(t) for t, _ in reqs)
    return max(44 * int(1.25 * longest), int(0.03 * sum(len(t) for t, _ in reqs))) // PAGE * PAGE


def load_workload(name: str, limit: int, seed: int, shape_requests: int = SHAPE_REQUESTS):
    if name.startswith("family-"):
        return [(r.tokens, r.tenant) for r in family_workload(name, limit, shape_requests)]
    if name in ("live", "live-long"):  # bench/fleet_live.py's workload, as the servers tokenize its text prompts
        from transformers import AutoTokenizer

        from bench.fleet_live import build_workload
        from sglang_tiered.dev.tiny_model import build_model

        model = str(build_model())
        tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
        lengths = (1.0, 2048) if name == "live-long" else (0.2, 700)  # (its --scale 1 --prompt-tokens 2048)
        return [(array("q", tok.encode(w["text"])), w["tenant"]) for w in build_workload(limit, 12, seed, model, *lengths)]
    if name == "mooncake":
        data = ROOT / "bench" / "data" / "mooncake_conversation_trace.jsonl.gz"
        reqs = load_mooncake(data, limit=limit)
    else:
        reqs = multi_tenant(limit, seed=seed, n_tenants=88, scale=0.25)
    return [(r.tokens, r.tenant) for r in reqs]


def run_one(workload, reqs, n, policy_name, host_ratio, rho, single_log=None, clients=0, trace=None):
    key = CacheKey()
    seeds: dict = {}

    def hashes_of(tokens, tenant):
        s = seeds.get(tenant)
        if s is None:
            s = seeds[tenant] = key.namespace_seed(tenant, None)
        return chain_page_hashes(s, tokens, PAGE)

    per = total_device_tokens(workload, reqs) // n // PAGE * PAGE
    servers = {f"s{i}": SimServer(per, host_ratio) for i in range(n)}
    pol = ALL[policy_name]()
    served: list = []  # (prompt, cached) per request in trace order, whichever server served it
    for s in servers.values():
        s.log = served
    probe = Probe(pol) if single_log is not None else pol
    t0 = time.perf_counter()
    on_route = None
    if trace is not None:  # --trace: one row per request (where it went, why, what the index said)
        def on_route(i, req, view, d, prompt, cached):
            trace.append({"n": n, "policy": pol.name, "i": i, "tenant": req.tenant, "worker": d.worker,
                          "reason": d.reason, "spill": d.spill, "prompt": prompt, "cached": cached,
                          "matched": dict(view.matched or {}), "load": dict(view.load)})  # fmt: skip
    res = simulate(reqs, servers, probe, hashes_of, page_size=PAGE, rho=rho, clients=clients, on_route=on_route)
    res.unserved = sum(s.unserved for s in servers.values())
    d = res.as_dict()
    d.update(workload=workload, device_tokens_per_server=per, seconds=round(time.perf_counter() - t0, 1))
    if single_log is not None and n > 1:
        d.update(diagnose(single_log, probe, served))
    return d, served


SEEDED = ("multitenant", "live", "live-long")  # workloads that --seed(s) change; the others are one trace each


def _exact(row) -> float:
    """The hit rate unrounded (a one-page difference must not read as a tie)."""
    return row["cached_tokens"] / row["prompt_tokens"] if row.get("prompt_tokens") else row["hit_rate"]


def bar(rows) -> list:
    """The acceptance per cell (workload, seed, N > 1): ours >= 0.9 x the single server of the
    same total cache, above every alternative (not our own variants, ``ours_*``), and work
    max/mean <= 1.3. Margins in points of token hit rate."""
    out = []
    cells = dict.fromkeys((r["workload"], r.get("seed", 0), r["n"]) for r in rows if r["n"] > 1)
    for wl, seed, n in cells:
        at = {r["policy"]: r for r in rows if (r["workload"], r.get("seed", 0), r["n"]) == (wl, seed, n)}
        single = [r["hit_rate"] for r in rows if (r["workload"], r.get("seed", 0), r["n"]) == (wl, seed, 1)]
        ours = at.get("ours")
        if ours is None:
            continue
        alts = {k: _exact(r) for k, r in at.items() if not k.startswith("ours")}
        worst = min(alts, key=lambda k: _exact(ours) - alts[k]) if alts else None
        margin = round(100 * (_exact(ours) - alts[worst]), 3) if worst else None
        ratio = round(ours["hit_rate"] / single[0], 4) if single and single[0] else None
        # a part of the bar the run cannot judge (no N = 1, no alternative) is not met
        ok = ratio is not None and ratio >= 0.9 and margin is not None and margin > 0 and ours["work_imbalance"] <= 1.3
        out.append({"workload": wl, "seed": seed, "n": n, "ours": ours["hit_rate"], "x_single": ratio,
                    "closest": worst, "margin_points": margin, "work_imbalance": ours["work_imbalance"],
                    "met": ok})  # fmt: skip
    return out


def meta() -> dict:
    import sglang
    import torch

    try:
        sha = subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        sha = "unknown"
    return {"machine": platform.platform(), "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version(), "sglang": sglang.__version__, "torch": torch.__version__,
            "git_sha": sha, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = {}  # with --seeds: each workload's first seed only
    for r in rows:
        first.setdefault(r["workload"], r.get("seed", 0))
    rows = [r for r in rows if r.get("seed", 0) == first[r["workload"]]]
    wls = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(2, len(wls), figsize=(6 * len(wls), 8), squeeze=False)
    for j, wl in enumerate(wls):
        for pol in dict.fromkeys(r["policy"] for r in rows if r["policy"] != "single"):
            pts = sorted((r["n"], r["hit_rate"], r["work_imbalance"]) for r in rows
                         if r["workload"] == wl and r["policy"] == pol)  # fmt: skip
            if not pts:
                continue
            axes[0][j].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=pol)
            axes[1][j].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=pol)
        single = [r["hit_rate"] for r in rows if r["workload"] == wl and r["n"] == 1]
        if single:
            axes[0][j].axhline(single[0], color="k", ls="--", lw=0.8, label="1 server, same total cache")
            axes[0][j].axhline(0.9 * single[0], color="k", ls=":", lw=0.8, label="0.9 x that")
        axes[0][j].set_title(f"{wl}: fleet token hit rate")
        axes[1][j].set_title(f"{wl}: load imbalance (max/mean work per server)")
        axes[1][j].axhline(1.3, color="r", ls=":", lw=0.8)
        for a in axes[:, j]:
            a.set_xscale("log")
            a.set_xlabel("servers N")
        axes[0][j].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_workload(wl: str, seed: int, args, trace) -> list:
    """Every N and policy on one workload (one seed); N = 1 is the single server."""
    reqs = load_workload(wl, args.limit, seed, args.shape_requests)
    rows, single_log = [], None
    for n in args.ns:
        for pol in (["round_robin"] if n == 1 else args.policies):
            d, served = run_one(wl, reqs, n, pol, args.host_ratio, args.rho, single_log, args.clients, trace)
            if n == 1:
                d["policy"] = "single"
                single_log = served if args.diagnose else None
            d["seed"] = seed
            rows.append(d)
            diag = (f"  loss: routing {d['routing_loss']} {d['routing_loss_by_reason']} capacity {d['capacity_loss']}"
                    f" (gain {d['capacity_gain']}) index missed {d['index_missed']}") if "routing_loss" in d else ""  # fmt: skip
            print(f"{wl:12s} s{seed} N={n:<3d} {d['policy']:18s} hit {d['hit_rate']:.4f}  work-imb {d['work_imbalance']:.2f}"
                  f"  req-imb {d['load_imbalance']:.2f}  q {d['mean_queue_ms']}ms  ttft {d['mean_ttft_ms']}ms p90 {d['p90_ttft_ms']}ms  spill {d['spill_rate']:.3f}  ({d['seconds']}s){diag}", flush=True)
    return rows


def _check_args(ap, args) -> None:
    """Bad arguments stop with a usage message, not a traceback mid-run (a helper's hunt, session 32:
    --ns 0 and --rho 0 were tracebacks)."""
    known = ("both", "mooncake", "multitenant", "live", "live-long")
    for w in args.workload:
        parts = w.split("-")
        family = len(parts) == 3 and parts[0] == "family" and parts[1] in SHAPES and parts[2].isdigit()
        if w not in known and not family:
            ap.error(f"--workload {w!r}: expected one of {', '.join(known)} or family-<shape>-<seed> "
                     f"(shapes: {', '.join(SHAPES)}; seed a whole number)")  # fmt: skip
    if not args.ns or min(args.ns) < 1:
        ap.error(f"--ns: server counts must be >= 1, got {args.ns}")
    if args.limit < 1 or args.shape_requests < 1:
        ap.error(f"--limit and --shape-requests must be >= 1, got {args.limit} and {args.shape_requests}")
    if not (math.isfinite(args.rho) and args.rho > 0):
        ap.error(f"--rho is a utilisation, finite and > 0, got {args.rho}")
    if not (math.isfinite(args.host_ratio) and args.host_ratio >= 0):
        ap.error(f"--host-ratio is T1 pages per device page, finite and >= 0, got {args.host_ratio}")
    if args.clients < 0:
        ap.error(f"--clients must be >= 0 (0: open loop), got {args.clients}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", nargs="+", default=["both"],
                    help="mooncake, multitenant, both, or family-<shape>-<seed> (shapes: " + ", ".join(SHAPES) + ")")
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 2, 4, 8, 16, 44])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(ALL),
                    help="default: every policy in routing.POLICIES; also: " + ", ".join(EXTRA))
    ap.add_argument("--limit", type=int, default=4000, help="requests per workload (subsample: first N)")
    ap.add_argument("--shape-requests", type=int, default=SHAPE_REQUESTS,
                    help="requests of a generated shape (family-*), at most --limit")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, nargs="+", help="several seeds in one run (multitenant, live); overrides --seed")
    ap.add_argument("--host-ratio", type=float, default=2.0, help="T1 pages per device page")
    ap.add_argument("--rho", type=float, default=0.9, help="fleet utilisation if nothing were cached")
    ap.add_argument("--clients", type=int, default=0,
                    help="closed loop with this many clients (load = requests in flight, as live); 0: open loop at --rho")
    ap.add_argument("--trace", action="store_true", help="also write <name>.trace.jsonl: one row per request and policy")
    ap.add_argument("--name", default="fleet_sim")
    ap.add_argument("--diagnose", action="store_true",
                    help="per request, against the single server (run N = 1 first): routing vs capacity loss")
    args = ap.parse_args(argv)
    _check_args(ap, args)
    wls = [w for x in args.workload for w in (["mooncake", "multitenant"] if x == "both" else [x])]
    rows, trace = [], ([] if args.trace else None)
    for wl in wls:
        for seed in (args.seeds or [args.seed]) if wl in SEEDED else [args.seed]:
            rows += run_workload(wl, seed, args, trace)
    cells = bar(rows)
    for c in cells:
        # a run without N = 1 has no single-server ratio, one with only ours no margin
        vs = "no alternative run" if c["closest"] is None else f"vs closest ({c['closest']}) {c['margin_points']:+.3f} points"
        print(f"bar {c['workload']:12s} seed {c['seed']} N={c['n']:<3d} ours {c['ours']:.4f} ="
              f" {'?' if c['x_single'] is None else c['x_single']} x single; {vs}; work max/mean {c['work_imbalance']:.2f}:"
              f" {'met' if c['met'] else 'NOT met'}")  # fmt: skip
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    doc = {"meta": meta(), "args": vars(args), "total_device_tokens": TOTAL_DEVICE, "bar": cells,
           "load_metric": "work_imbalance: max/mean over servers of work done (uncached prompt tokens + 32 per request = busy time); load_imbalance: of requests routed",
           "rows": rows}  # fmt: skip
    (out / f"{args.name}.json").write_text(json.dumps(doc, indent=1))
    with open(out / f"{args.name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        w.writeheader()
        w.writerows(rows)
    if trace is not None:
        with open(out / f"{args.name}.trace.jsonl", "w") as f:
            for r in trace:
                f.write(json.dumps(r) + "\n")
    plot(rows, out / f"{args.name}.png")
    print(f"wrote {out / args.name}.{{json,csv,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
