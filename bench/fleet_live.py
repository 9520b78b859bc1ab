"""Live loopback fleet benchmark (`make fleet-bench`): Redis + 3 CPU SGLang servers with the tiered
backend, behind our router and behind smg (round_robin, cache_aware, prefix_hash keyed by the
tenant header), same workload, one run; plus a no-cache server for output equality.

    .venv/bin/python bench/fleet_live.py [--requests 240 --tenants 12 --concurrency 6]

Between routers every server's cache is flushed (POST /flush_cache; T1 off) and Redis emptied, so
each router starts equal. Reports fleet token hit rate (sum cached_tokens / sum prompt tokens),
TTFT p50/p90, requests/s, spill rate (ours; smg does not report one), and whether every greedy
output equals the no-cache server's, each router's own CPU per request, hit rate by request kind;
the JSON keeps every request's worker, cached/prompt tokens and TTFT per router and round, and for
ours the router's decisions joined with what was cached (``explain``; the raw decisions go to
logs/fleet_live/decisions-*.json). ``--routers ours-view ...`` runs our router with other policy
settings (``VARIANTS``) in the same run. Writes bench/results/<name>.{json,csv,png}.
Everything listens on 127.0.0.1; nothing is downloaded (HF_HUB_OFFLINE=1, local model path).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import csv
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.fleet_live_compare import q as percentile  # noqa: E402
from bench.live_compare import stream_generate  # noqa: E402
from bench.trace_replay import environment  # noqa: E402
from sglang_tiered.dev.server import (Server, ServerSpec, add_threads_option, cpu_quota_group, free_port,  # noqa: E402
                                      remove_cgroup, start_redis, use_server_threads)
from sglang_tiered.dev.workloads import multi_tenant  # noqa: E402

LOGS = ROOT / "logs" / "fleet_live"
# Our router with other policy settings (AffinityCachePolicy fields), for before/after in one run.
VARIANTS: dict = {
    "ours-view": {"hatch_load": "view"},  # the hatch on requests in flight (before 2026-12-02)
    "ours-tenant": {"per_prefix": False},  # affinity unit = the tenant (prefix_hash's unit), not its prompt family
    "ours-calm": {"cold_over": 1e9},  # no "cold" moves off a home on in-flight counts (the hatch stays)
    "ours-noindex": {},  # no Redis: the routing memory only (what the index's round trips cost live)
    "ours-f2": {"followers": 2.0},  # a recompute delays 2 queued requests, not 9 (the mean in flight per worker here)
    "ours-fq": {"fresh_by": "queue"},  # new content to the worker with the least work queued ahead
    # strict homes, no balancing at all (what concentrating load does to TTFT on a shared-CPU host)
    "ours-nobalance": {"cold_over": 1e9, "overload": 1e9, "fresh": False, "new_choices": 1, "k_max": 1},
}


def server_ports(n: int, base: int = 62100) -> list[int]:
    """``n`` free ports above the kernel's ephemeral range (32768-60999 by default). A port picked
    free by binding port 0 can be taken by another process's outgoing or internal socket (the other
    servers open several while they start) before the server binds it: seen here, "address
    already in use", and that server then hung instead of exiting. Ports above the range are never
    handed out by the kernel."""
    import socket

    out, port = [], base
    while len(out) < n and port < 65535:
        with socket.socket() as sk:
            try:
                sk.bind(("127.0.0.1", port))
                out.append(port)
            except OSError:
                pass
        port += 1
    if len(out) < n:
        raise RuntimeError(f"no {n} free ports above {base}")
    return out


def wait_http(url, proc, timeout=120):
    t = time.time() + timeout
    while time.time() < t:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited")
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except Exception:  # noqa: BLE001
            time.sleep(0.2)
    raise RuntimeError(f"{url} not ready")


def post(url, payload=None):
    req = urllib.request.Request(url, data=json.dumps(payload or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read()


def flush(url, timeout=120):
    """POST /flush_cache until it succeeds (SGLang answers 400 while requests are pending)."""
    t_end = time.time() + timeout
    while True:
        try:
            return post(url + "/flush_cache")
        except Exception:  # noqa: BLE001
            if time.time() > t_end:
                raise
            time.sleep(1.0)


def build_workload(n, tenants, seed, model, scale=0.2, prompt_tokens=700):
    """The multi-tenant workload with its lengths times ``scale``, each prompt cut to its first
    ``prompt_tokens`` tokens (the defaults: short prompts, where a request's fixed cost dominates
    its TTFT; ``--scale 1 --prompt-tokens 2048``: the generator's own lengths, system prompts of
    320-1,280 tokens and documents of 300-900, where prefill does)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    reqs = multi_tenant(n, seed=seed, n_tenants=tenants, scale=scale)
    out = []
    for r in reqs:
        text = tok.decode(list(r.tokens)[:prompt_tokens], skip_special_tokens=True)
        out.append({"tenant": r.tenant, "text": text, "kind": r.kind})
    return out


WORKER_HEADERS = ("x-sglang-tiered-worker", "x-smg-routed-worker-id")
PER_REQUEST_FIELDS = ("worker", "prompt_tokens", "cached_tokens", "ttft_s")


def stream_one(url: str, payload: dict, headers: dict) -> dict:
    """``stream_generate``, also keeping which worker the router says served the request."""
    return stream_generate(url, payload, headers=headers, worker_headers=WORKER_HEADERS)


def run(url, work, concurrency, max_new):
    def one(iw):
        i, w = iw
        payload = {"text": w["text"], "cache_salt": w["tenant"],
                   "sampling_params": {"temperature": 0, "max_new_tokens": max_new}}  # fmt: skip
        for attempt in range(2):
            try:
                return stream_one(url, payload, {"x-tenant-id": w["tenant"], "x-request-id": str(i)})
            except Exception as exc:  # noqa: BLE001
                err = exc
        return {"error": str(err)}

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as ex:
        res = list(ex.map(one, enumerate(work)))
    return res, time.perf_counter() - t0


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc; 0 where unavailable)."""
    try:
        f = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def explain_ours(res, work, decisions) -> dict:
    """Our router's decisions joined with what the servers reported (by x-request-id): per reason,
    requests, hit rate, and how what the router believed the chosen worker held (index, routing
    memory) compares with what it had cached; plus each router's hit rate by request kind."""
    by_rid = {int(d["rid"]): d for d in decisions if d.get("rid") is not None}
    per_reason: dict = {}
    over = {"index": 0, "memory": 0}
    for i, r in enumerate(res):
        d = by_rid.get(i)
        if d is None or "error" in r:
            continue
        x = per_reason.setdefault(d["reason"], {"requests": 0, "prompt": 0, "cached": 0, "believed": 0,
                                                "believed_over_cached": 0})  # fmt: skip
        x["requests"] += 1
        x["prompt"] += r["prompt_tokens"]
        x["cached"] += r["cached_tokens"]
        x["believed"] += d["matched"]
        x["believed_over_cached"] += max(0, d["matched"] - r["cached_tokens"] - 16)  # a page of slack
        for src in over:
            m = (d.get(src) or {}).get(d["worker"], 0)
            over[src] += max(0, m - r["cached_tokens"] - 16)
    total = max(1, sum(r.get("prompt_tokens", 0) for r in res if "error" not in r))
    for x in per_reason.values():
        x["hit_rate"] = round(x["cached"] / max(1, x["prompt"]), 4)
    return {"per_reason": per_reason, "believed_not_cached_frac": {k: round(v / total, 4) for k, v in over.items()},
            "route_ms_mean": round(statistics.mean(d["route_ms"] for d in decisions), 3) if decisions else None}


def hit_by_kind(res, work) -> dict:
    out: dict = {}
    for r, w in zip(res, work):
        if "error" in r:
            continue
        x = out.setdefault(w["kind"], [0, 0])
        x[0] += r["cached_tokens"]
        x[1] += r["prompt_tokens"]
    return {k: round(c / max(1, p), 4) for k, (c, p) in sorted(out.items())}


def summarize(name, res, wall, ref, extra=None):
    ok = [r for r in res if "error" not in r]
    ttft = [r["ttft_s"] for r in ok]
    q = lambda p: percentile(ttft, p) if ttft else float("nan")  # noqa: E731
    same = sum(1 for r, g in zip(res, ref) if "error" not in r and r["output_ids"] == g["output_ids"])
    d = {"router": name, "requests": len(res), "errors": len(res) - len(ok),
         "hit_rate": round(sum(r["cached_tokens"] for r in ok) / max(1, sum(r["prompt_tokens"] for r in ok)), 4),
         "ttft_p50_ms": round(1e3 * q(0.5), 1), "ttft_p90_ms": round(1e3 * q(0.9), 1),
         "req_per_s": round(len(ok) / wall, 3), "outputs_equal_nocache": f"{same}/{len(res)}",
         "spill_rate": None}  # fmt: skip
    d.update(extra or {})
    return d


def summarize_rounds(rows, routers):
    """Per router, the mean over its rounds (TTFT percentiles: the mean of the per-round values)."""
    out = []
    for name in routers:
        rs = [r for r in rows if r["router"] == name]
        if not rs:
            continue
        d = {"router": name, "rounds": len(rs), "requests": sum(r["requests"] for r in rs),
             "errors": sum(r["errors"] for r in rs)}  # fmt: skip
        for k in ("hit_rate", "ttft_p50_ms", "ttft_p90_ms", "req_per_s", "router_cpu_ms_per_req"):
            if any(k not in r for r in rs):
                continue
            d[k] = round(statistics.mean(r[k] for r in rs), 4)
            d[k + "_per_round"] = [r[k] for r in rs]
        d["outputs_equal_nocache"] = " ".join(r["outputs_equal_nocache"] for r in rs)
        sp = [r["spill_rate"] for r in rs if r.get("spill_rate") is not None]
        d["spill_rate"] = round(statistics.mean(sp), 4) if sp else None
        out.append(d)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--tenants", type=int, default=12)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--pool-tokens", type=int, default=6144, help="device KV pool per server")
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--scale", type=float, default=0.2, help="the workload generator's lengths times this")
    ap.add_argument("--prompt-tokens", type=int, default=700, help="each prompt cut to its first N tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", help="serving dtype (bf16 prefill over a cached prefix rounds "
                    "differently from a full prefill, so output equality is checked in float32)")
    ap.add_argument("--routers", nargs="+", default=["ours", "smg-round_robin", "smg-cache_aware", "smg-prefix_hash"],
                    help="ours, smg-<policy>, or a variant of ours: " + (", ".join(VARIANTS) or "none"))
    ap.add_argument("--rounds", type=int, default=2, help="runs per router, order reversed every other round")
    ap.add_argument("--name", default="fleet_live")
    ap.add_argument("--server-cpus", type=float, default=None, metavar="CORES",
                    help="each tiered server in its own cgroup with a CPU quota of CORES (e.g. 0.5): fixed compute per "
                         "server, as on a fleet where each has its own accelerator; without it the servers share "
                         "this host's cores and one that gets more requests also gets more CPU (needs root)")
    ap.add_argument("--prefix-attention", action="store_true",
                    help="SGLANG_TIERED_PREFIX_ATTENTION=on on the three servers: an extend computes attention "
                         "for its new rows only, as SGLang's GPU backends do; SGLang's CPU backend recomputes the "
                         "whole sequence's attention, so without it a cached prefix still pays its attention "
                         "here (README, Long prefix); the no-cache reference stays SGLang's own")
    add_threads_option(ap)
    args = ap.parse_args(argv)
    use_server_threads(args.threads)
    groups = []
    if args.server_cpus is not None:  # fail before anything starts
        groups = [cpu_quota_group(f"sglang-tiered-fleet-{os.getpid()}-{i}", args.server_cpus) for i in range(3)]
    from sglang_tiered.dev.tiny_model import build_model

    model = str(build_model())
    os.environ["HF_HUB_OFFLINE"] = "1"
    LOGS.mkdir(parents=True, exist_ok=True)
    procs, servers = [], []
    try:
        rport = free_port()
        redis_url = f"redis://127.0.0.1:{rport}/0"
        procs.append(start_redis(rport))
        ports = server_ports(4)  # 3 tiered servers + the no-cache reference
        for i in range(3):
            port = ports[i]
            env = {"SGLANG_TIERED_INDEX_URL": redis_url, "SGLANG_TIERED_SERVER_ID": f"http://127.0.0.1:{port}",
                   "SGLANG_TIERED_INDEX_TTL_S": "30", "SGLANG_TIERED_HOST": "off"}  # fmt: skip
            if args.prefix_attention:
                env["SGLANG_TIERED_PREFIX_ATTENTION"] = "on"
            servers.append(Server(ServerSpec(model_path=model, port=port, max_total_tokens=args.pool_tokens, env=env,
                                             dtype=args.dtype, cgroup=groups[i] if groups else None),
                                  LOGS / f"server-{i}.log"))  # fmt: skip
        ref = Server(ServerSpec(model_path=model, backend=None, disable_radix_cache=True, dtype=args.dtype,
                                port=ports[3]),
                     LOGS / "reference.log")
        with cf.ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda s: s.start(timeout_s=600), servers + [ref]))
        work = build_workload(args.requests, args.tenants, args.seed, model, args.scale, args.prompt_tokens)
        print(f"workload: {len(work)} requests, {args.tenants} tenants; reference run ...", flush=True)
        ref_res, _ = run(ref.url, work, args.concurrency, args.max_new_tokens)
        ref.stop()
        urls = [s.url for s in servers]
        rows, per_request = [], []
        # Rounds alternate the router order (A B C D, then D C B A, ...): the other work on this
        # machine drifts over minutes, and reversing the order spreads that drift over all routers.
        schedule = [(rnd, name) for rnd in range(args.rounds)
                    for name in (args.routers if rnd % 2 == 0 else args.routers[::-1])]  # fmt: skip
        for rnd, name in schedule:
            for s in servers:
                flush(s.url)
            time.sleep(1.0)
            subprocess.run([shutil.which("redis-cli"), "-h", "127.0.0.1", "-p", str(rport), "flushall"],
                           stdout=subprocess.DEVNULL, check=False)  # fmt: skip
            port = free_port()
            log = open(LOGS / f"router-{name}.log", "wb")
            if name == "ours":
                argv = [sys.executable, "-m", "sglang_tiered.cli", "route", "--workers", *urls, "--redis", redis_url,
                        "--port", str(port), "--model", model, "--tenant-header", "x-tenant-id"]  # fmt: skip
            elif name in VARIANTS:  # the same router with other policy settings (before/after in one run)
                kw = dict(host="127.0.0.1", port=port, model_path=model, tenant_header="x-tenant-id",
                          policy_kw=VARIANTS[name])  # fmt: skip
                code = ("import json, sys; from sglang_tiered.fleet.router import serve; "
                        "serve(json.loads(sys.argv[1]), sys.argv[2], **json.loads(sys.argv[3]))")  # fmt: skip
                code = code.replace("sys.argv[2]", "(sys.argv[2] or None)")
                argv = [sys.executable, "-c", code, json.dumps(urls), "" if name == "ours-noindex" else redis_url,
                        json.dumps(kw)]  # fmt: skip
            else:
                pol = name.split("-", 1)[1]
                smg = shutil.which("smg") or str(pathlib.Path(sys.executable).parent / "smg")
                argv = [smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
                        "--policy", pol, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                        "--model-path", model, "--log-level", "warn"]  # fmt: skip
                if pol == "prefix_hash":
                    argv += ["--routing-key-headers", "x-tenant-id"]
            p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
            procs.append(p)
            wait_http(f"http://127.0.0.1:{port}/health", p, 120)
            # smg registers its workers asynchronously: probe until a request goes through, then
            # flush again so every router starts from empty caches
            t_end = time.time() + 120
            while True:
                try:
                    post(f"http://127.0.0.1:{port}/generate", {"text": "probe", "cache_salt": "probe",
                         "sampling_params": {"max_new_tokens": 1}})  # fmt: skip
                    break
                except Exception:  # noqa: BLE001
                    if time.time() > t_end:
                        raise
                    time.sleep(1.0)
            for s in servers:
                flush(s.url)
            time.sleep(1.0)
            cpu0, rcpu0 = cpu_s(p.pid), cpu_s(procs[0].pid)
            res, wall = run(f"http://127.0.0.1:{port}", work, args.concurrency, args.max_new_tokens)
            # the router's own CPU per request (2 cores shared with 3 servers: it is taken from them)
            extra = {"router_cpu_ms_per_req": round(1e3 * (cpu_s(p.pid) - cpu0) / len(work), 3),
                     "redis_cpu_ms_per_req": round(1e3 * (cpu_s(procs[0].pid) - rcpu0) / len(work), 3),
                     "hit_by_kind": hit_by_kind(res, work)}  # fmt: skip
            if name == "ours" or name in VARIANTS:
                st = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/router/stats").read())
                decisions = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/router/decisions").read())
                (LOGS / f"decisions-{name}-{rnd}.json").write_text(json.dumps(decisions))
                extra.update({"spill_rate": round(st["spill_rate"], 4), "index_hit_rate": round(st["index_hit_rate"], 4),
                              "per_worker": {w: v["routed"] for w, v in st["workers"].items()},
                              "reasons": st.get("reasons", {}), "load_polls": st.get("load_polls", 0),
                              "load_poll_errors": st.get("load_poll_errors", 0),
                              "mean_route_ms": round(st.get("mean_route_ms", 0.0), 3),
                              **{k: st.get(k) for k in ("index_lookups", "index_errors", "index_timeouts",
                                                        "index_unavailable", "retries", "failed", "client_gone")},
                              "explain": explain_ours(res, work, decisions)})  # fmt: skip
            per_request.append({"router": name, "round": rnd,  # one compact row per request: PER_REQUEST_FIELDS
                                "requests": json.dumps([[r.get(k) for k in PER_REQUEST_FIELDS] for r in res])})
            d = summarize(name, res, wall, ref_res, extra)
            d["round"] = rnd
            rows.append(d)
            print(json.dumps(d), flush=True)
            p.terminate()
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:  # a router that does not exit must not end the bench
                p.kill()
                p.wait(timeout=20)
        env = environment()
        try:
            from importlib.metadata import version

            env["smg"] = version("smg")
            env["redis_py"] = version("redis")
            env["redis_server"] = subprocess.run([shutil.which("redis-server"), "--version"], capture_output=True,
                                                 text=True).stdout.split()[2]  # fmt: skip
        except Exception:  # noqa: BLE001
            pass
        summary = summarize_rounds(rows, args.routers)
        for d in summary:
            print("mean over rounds:", json.dumps(d), flush=True)
        out = ROOT / "bench" / "results"
        doc = {"meta": env, "args": vars(args), "rows": rows, "summary": summary,
               "per_request_fields": PER_REQUEST_FIELDS, "per_request": per_request,
               "kinds": [w["kind"] for w in work], "tenants": [w["tenant"] for w in work],
               "note": "same 3 servers (tiered, T1 off), caches flushed and Redis emptied between routers"
                       + (f"; each server capped at {args.server_cpus} CPU (cgroup quota)" if groups else
                          "; the servers share the host's cores")
                       + ("; prefix attention on (new rows only)" if args.prefix_attention else "")}  # fmt: skip
        (out / f"{args.name}.json").write_text(json.dumps(doc, indent=1))
        with open(out / f"{args.name}.csv", "w", newline="") as f:
            keys = dict.fromkeys(k for r in rows for k in r if k not in ("per_worker", "round", "explain", "hit_by_kind"))
            w = csv.DictWriter(f, fieldnames=["round"] + list(keys),
                               extrasaction="ignore")  # fmt: skip
            w.writeheader()
            w.writerows(rows + [dict(d, round="mean") for d in summary])
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 3, figsize=(13, 4))
        rows = summary  # the plot shows the mean over rounds
        names = [r["router"] for r in rows]
        ax[0].bar(names, [r["hit_rate"] for r in rows]); ax[0].set_title("fleet token hit rate")
        ax[1].bar(names, [r["ttft_p50_ms"] for r in rows], label="p50")
        ax[1].bar(names, [r["ttft_p90_ms"] - r["ttft_p50_ms"] for r in rows], bottom=[r["ttft_p50_ms"] for r in rows],
                  label="p90", alpha=0.5); ax[1].set_title("TTFT ms"); ax[1].legend()
        ax[2].bar(names, [r["req_per_s"] for r in rows]); ax[2].set_title("requests/s")
        for a in ax:
            a.tick_params(axis="x", rotation=30, labelsize=8)
        cpus = f", {args.server_cpus} CPU per server" if groups else ", servers share the host's cores"
        cpus += ", prefix attention" if args.prefix_attention else ""
        fig.suptitle(f"3-server loopback fleet (git {env.get('git_sha')}, sglang {env.get('sglang')}{cpus})")
        fig.tight_layout()
        fig.savefig(out / f"{args.name}.png", dpi=110)
        print(f"wrote {out / args.name}.{{json,csv,png}}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for s in servers:
            s.stop()
        for g in groups:
            remove_cgroup(g)
    return 0


if __name__ == "__main__":
    sys.exit(main())
