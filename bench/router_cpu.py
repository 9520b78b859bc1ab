"""The router's CPU per request, without SGLang: ``sglang-tiered route`` in front of stub workers.

    .venv/bin/python bench/router_cpu.py [--requests 240 --rounds 3 --baseline REF] [--profile]

Three stub workers (one process, aiohttp, 127.0.0.1) answer like SGLang: ``/generate`` streamed
(``max_new_tokens`` chunks of SGLang's shape, then ``data: [DONE]``), ``/health``, ``/v1/loads``,
``/model_info``; each publishes the pages of the prompts it served to a real ``redis-server``
through ``IndexPublisher`` (so the router's index lookups hit, as in the live fleet), and reports
``cached_tokens`` from what it served before. The workload is the live fleet bench's
(``bench/fleet_live.py``: multi-tenant, 12 tenants, text prompts of up to 700 tokens, tenant
header + ``cache_salt``, 6 concurrent clients, 4 new tokens).

The router runs in its own process; its CPU (user + system, /proc) over the measured requests,
divided by their number, is the figure ``bench/fleet_live.py`` reports as router_cpu_ms_per_req.
``--baseline REF`` also runs the router from git revision REF (``git archive`` into a temporary
folder), interleaved with this tree round by round (order reversed every other round), so the two
are compared under the same machine load. ``--profile`` runs each router under cProfile and
prints its top functions. Everything listens on 127.0.0.1; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import contextlib
import concurrent.futures as cf
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sglang_tiered.dev.server import free_port, start_redis  # noqa: E402

# ---------------------------------------------------------------------------- stub workers
STUB = r'''
import asyncio, json, sys, time
from aiohttp import web
from transformers import AutoTokenizer
from sglang_tiered.core.keys import CacheKey, chain_page_hashes
from sglang_tiered.fleet.publisher import IndexPublisher

model, redis_url, first_s, ports = sys.argv[1], sys.argv[2], float(sys.argv[3]), [int(p) for p in sys.argv[4:]]
tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
ck = CacheKey(model_id="stub-model", weights_digest="stub")

def make(port):
    sid = f"http://127.0.0.1:{port}"
    pub = IndexPublisher(redis_url, sid, 30.0, cache_key=ck)
    held, state = set(), {"running": 0}

    async def generate(request):
        body = await request.json()
        ids = body.get("input_ids") or tok.backend_tokenizer.encode(body.get("text", "")).ids
        hashes = chain_page_hashes(ck.namespace_seed(body.get("cache_salt"), None), ids, 16)
        cached = 0
        for h in hashes:
            if h not in held:
                break
            cached += 16
        held.update(hashes)
        pub.on_store(hashes)
        n_new = body.get("sampling_params", {}).get("max_new_tokens", 4)
        state["running"] += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            await asyncio.sleep(first_s)
            out = []
            for i in range(n_new):
                out.append(1000 + i)
                chunk = {"text": " tok" * len(out), "output_ids": out, "meta_info": {
                    "id": "0123456789abcdef0123456789abcdef", "finish_reason": None if i < n_new - 1 else
                    {"type": "length", "length": n_new}, "prompt_tokens": len(ids), "weight_version": "default",
                    "completion_tokens": len(out), "cached_tokens": cached, "e2e_latency": 0.01 * (i + 1)}}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                await asyncio.sleep(0.001)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        finally:
            state["running"] -= 1
        return resp

    async def loads(_):
        return web.json_response({"loads": [{"dp_rank": 0, "num_running_reqs": state["running"],
                                             "num_waiting_reqs": 0, "num_waiting_uncached_tokens": 0}]})

    async def health(_):
        return web.Response(text="")

    async def model_info(_):
        return web.json_response({"model_path": model})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/generate", generate)
    app.router.add_get("/v1/loads", loads)
    app.router.add_get("/health", health)
    app.router.add_get("/model_info", model_info)
    return app

async def main():
    for p in ports:
        runner = web.AppRunner(make(p), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", p).start()
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
'''

# ---------------------------------------------------------------------------- the router, from a tree
ROUTER = r'''
import cProfile, signal, sys
tree, profile_out = sys.argv[1], sys.argv[2]
sys.path.insert(0, tree)
import sglang_tiered.fleet.router as R
assert R.__file__.startswith(tree), R.__file__
prof = cProfile.Profile()
signal.signal(signal.SIGUSR1, lambda *_: prof.enable())  # the measured requests only
signal.signal(signal.SIGUSR2, lambda *_: (prof.disable(), prof.dump_stats(profile_out)))
R.serve(sys.argv[6:], sys.argv[3], host="127.0.0.1", port=int(sys.argv[4]), model_path=sys.argv[5],
        tenant_header="x-tenant-id")
'''



def wait_http(url: str, timeout: float = 120.0) -> None:
    t_end = time.time() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except Exception:  # noqa: BLE001
            if time.time() > t_end:
                raise
            time.sleep(0.1)


def cpu_s(pid: int) -> float:
    f = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def export_tree(ref: str, dest: pathlib.Path) -> pathlib.Path:
    """``sglang_tiered`` at git revision ``ref`` (git archive), for a before/after in one run."""
    dest.mkdir(parents=True, exist_ok=True)
    arch = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "sglang_tiered"], check=True,
                          capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(dest)], input=arch, check=True)
    return dest


def run_round(tree, work, args, redis_url, workers, model, profile_out) -> dict:
    from bench.live_compare import stream_generate

    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(tree)}
    proc = subprocess.Popen([sys.executable, "-c", ROUTER, str(tree), profile_out or "-", redis_url, str(port),
                             model, *workers], env=env, cwd=tree)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health")

        def one(i):
            w = work[i % len(work)]
            payload = {"text": w["text"], "cache_salt": w["tenant"],
                       "sampling_params": {"temperature": 0, "max_new_tokens": args.max_new_tokens}}  # fmt: skip
            return stream_generate(url, payload, headers={"x-tenant-id": w["tenant"], "x-request-id": str(i)})

        for i in range(args.warmup):  # tokenizer, connections, the index's CacheKey read
            one(len(work) - 1 - i)
        time.sleep(0.5)
        i0 = cpu_s(proc.pid)
        time.sleep(args.idle_s)  # no requests: the health checks and /v1/loads polls alone
        idle_cpu_ms_per_s = 1e3 * (cpu_s(proc.pid) - i0) / args.idle_s
        if profile_out:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(0.2)
        c0, t0 = cpu_s(proc.pid), time.perf_counter()
        with cf.ThreadPoolExecutor(args.concurrency) as ex:
            res = list(ex.map(one, range(len(work))))
        wall = time.perf_counter() - t0
        cpu = cpu_s(proc.pid) - c0
        if profile_out:
            proc.send_signal(signal.SIGUSR2)
            time.sleep(1.0)
        stats = json.loads(urllib.request.urlopen(url + "/router/stats").read())
        decisions = json.loads(urllib.request.urlopen(url + "/router/decisions").read())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    hit = sum(r["cached_tokens"] for r in res) / max(1, sum(r["prompt_tokens"] for r in res))
    return {"cpu_ms_per_req": 1e3 * cpu / len(work), "wall_s": wall, "req_per_s": len(work) / wall,
            "idle_cpu_ms_per_s": idle_cpu_ms_per_s,
            "cpu_ms_per_req_less_idle": (1e3 * cpu - idle_cpu_ms_per_s * wall) / len(work),
            "hit_rate": hit, "mean_route_ms": stats["mean_route_ms"], "reasons": stats["reasons"],
            "index_lookups": stats["index_lookups"], "index_unavailable": stats["index_unavailable"],
            "decisions": len(decisions)}  # fmt: skip


@contextlib.contextmanager
def fleet(model: str, first_token_ms: float):
    """A fresh redis-server and three stub workers; yields (redis URL, worker URLs)."""
    procs = []
    try:
        rport = free_port()
        redis_url = f"redis://127.0.0.1:{rport}/0"
        procs.append(start_redis(rport))
        ports = [free_port() for _ in range(3)]
        stub = subprocess.Popen([sys.executable, "-c", STUB, model, redis_url, str(first_token_ms / 1e3),
                                 *map(str, ports)], env={**os.environ, "PYTHONPATH": str(ROOT)},
                                stdout=subprocess.PIPE)  # fmt: skip
        procs.append(stub)
        assert stub.stdout.readline().strip() == b"ready", "stub workers did not start"
        yield redis_url, [f"http://127.0.0.1:{p}" for p in ports]
    finally:
        for p in procs[::-1]:
            p.terminate()
            p.wait(timeout=30)


def print_profile(path: str, top: int) -> None:
    import pstats

    print(f"--- {path}: top {top} by own time")
    pstats.Stats(path).sort_stats("tottime").print_stats(top)
    print(f"--- {path}: top {top} by cumulative time")
    pstats.Stats(path).sort_stats("cumulative").print_stats(top)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--tenants", type=int, default=12)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--first-token-ms", type=float, default=100.0,
                    help="stub time to first token: 100 ms gives the live bench's ~40 requests/s at 6 clients, "
                         "so the router's background polls weigh per request as they did there")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--idle-s", type=float, default=4.0, help="CPU of the idle router (polls only) over this long")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline", help="also run the router from this git revision, interleaved")
    ap.add_argument("--profile", action="store_true", help="cProfile each router; print its top functions")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    os.environ["HF_HUB_OFFLINE"] = "1"
    from bench.fleet_live import build_workload
    from sglang_tiered.dev.tiny_model import build_model

    model = str(build_model())
    work = build_workload(args.requests, args.tenants, args.seed, model)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="router_cpu_"))
    trees = {"this": ROOT}
    if args.baseline:
        trees = {args.baseline: export_tree(args.baseline, tmp / "baseline"), "this": ROOT}
    rows = []
    for rnd in range(args.rounds):
        names = list(trees) if rnd % 2 == 0 else list(trees)[::-1]
        for name in names:
            prof = str(tmp / f"{name.replace('/', '_')}-{rnd}.prof") if args.profile else None
            with fleet(model, args.first_token_ms) as (redis_url, workers):  # fresh caches and index
                row = {"round": rnd, "tree": name, **run_round(trees[name], work, args, redis_url, workers, model,
                                                               prof)}  # fmt: skip
            row["profile"] = prof
            rows.append(row)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    for name in trees:
        xs = [r["cpu_ms_per_req"] for r in rows if r["tree"] == name]
        ys = [r["cpu_ms_per_req_less_idle"] for r in rows if r["tree"] == name]
        zs = [r["idle_cpu_ms_per_s"] for r in rows if r["tree"] == name]
        print(f"{name}: router CPU ms/request mean {statistics.mean(xs):.3f} over {len(xs)} rounds "
              f"({', '.join(f'{x:.3f}' for x in xs)}); less the idle router's {statistics.mean(zs):.1f} ms/s "
              f"(polls): {statistics.mean(ys):.3f}")
    if args.profile:
        for name in trees:
            last = [r for r in rows if r["tree"] == name][-1]
            print_profile(last["profile"], args.top)
    if args.out:
        sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip()  # fmt: skip
        meta = {"git_sha": sha, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                "machine": f"{os.uname().machine} {os.cpu_count()} cores", "python": sys.version.split()[0]}
        pathlib.Path(args.out).write_text(json.dumps({"meta": meta, "args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
