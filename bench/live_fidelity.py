"""Fidelity of the simulator against live servers: a workload served one request at a time (greedy,
``max_new_tokens`` fixed, ``ignore_eos``) by stock SGLang (lru) and by sglang-tiered (T1 off,
``--max-running-requests 1``: the strict policy adapts), each request's cached tokens recorded;
then the same requests replayed by ``CacheDriver`` on the same pool and page size, with the
outputs each server generated, and compared request for request.

    .venv/bin/python bench/live_fidelity.py --workload family-29:200 --page-size 16 --pool 1024
    .venv/bin/python bench/live_fidelity.py --workload mooncake:80 --page-size 16 --pool 4096

Prints, per backend, the live and simulated hit rates and the requests that differ; ``--out``
writes the recorded runs (tests/test_review40_live_fidelity.py replays tests/data/live_serial_hits.json).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def load_workload(name: str):
    """``family-SEED:N`` (the first N requests of a generated family workload) or ``mooncake:N``
    (the Mooncake trace's first N, 16 tokens a block)."""
    from sglang_tiered.dev import workload_family as wf
    from sglang_tiered.dev.workloads import load_mooncake

    kind, n = name.rsplit(":", 1)
    if kind == "mooncake":
        return load_mooncake(ROOT / "bench" / "data" / "mooncake_conversation_trace.jsonl.gz", limit=int(n))
    if kind.startswith("family-"):
        return wf.generate(wf.draw(int(kind.split("-")[1])))[: int(n)]
    raise ValueError(f"unknown workload {name!r}: family-SEED:N or mooncake:N")


def replay(reqs, backend: str, page: int, pool: int, outputs, guarantee: str = "strict") -> list[int]:
    """Per-request cached tokens of the simulator: SGLang's ``RadixCache`` (``backend`` "lru") or
    ``TieredRadixCache`` (T1 off, the policy of ``SGLANG_TIERED_GUARANTEE`` = ``guarantee``),
    ``pool`` tokens at ``page``. ``outputs``: each request's generated tokens, run as a live
    server runs them (``CacheDriver.decode``, the match a token short of the prompt); None: the
    replays' request, finished at its prefill."""
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from sglang_tiered.config import TieredConfig, policy_config
    from sglang_tiered.dev.simulate import CacheDriver, make_params
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

    if backend == "lru":
        params, alloc, rpool = make_params(pool, page, 1 << 13, eviction_policy="lru")
        driver = CacheDriver(RadixCache(params), alloc, rpool)
    else:
        config = policy_config(TieredConfig(guarantee=guarantee))
        driver = TieredRadixCache.create_simulated(pool, page, config, max_request_tokens=1 << 13).driver
    hits = []
    for i, r in enumerate(reqs):
        if outputs is None:
            o = driver.run(r.tokens, tenant=r.tenant)
        else:
            o = driver.run(r.tokens, tenant=r.tenant, max_prefix_len=len(r.tokens) - 1, output_ids=outputs[i])
        hits.append(o.cached_len)
    return hits


def serve(reqs, backend: str, page: int, pool: int, max_new: int, log: pathlib.Path, guarantee: str = "strict") -> dict:
    """One live server (the built-in tiny model), the requests one at a time: cached tokens and
    output ids per request."""
    from sglang_tiered.dev.server import Server, ServerSpec
    from sglang_tiered.dev.tiny_model import build_model

    spec = ServerSpec(model_path=str(build_model()), backend="tiered" if backend == "tiered" else None,
                      page_size=page, max_total_tokens=pool,
                      extra_args=["--max-running-requests", "1", "--enable-cache-report"],
                      env={"SGLANG_TIERED_HOST": "off", "SGLANG_TIERED_GUARANTEE": guarantee})  # fmt: skip
    cached, outputs = [], []
    with Server(spec, log) as srv:
        for r in reqs:
            payload = {"input_ids": list(r.tokens),
                       "sampling_params": {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}}  # fmt: skip
            if r.tenant:
                payload["cache_salt"] = r.tenant
            body = srv.generate(payload, timeout=600)
            cached.append(body["meta_info"]["cached_tokens"])
            outputs.append(body["output_ids"])
    return {"cached": cached, "outputs": outputs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="family-29:200", help="family-SEED:N or mooncake:N")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pool", type=int, default=1024, help="--max-total-tokens of both servers and the simulator")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--backends", nargs="+", default=["lru", "tiered"], choices=["lru", "tiered"])
    ap.add_argument("--guarantee", default="strict", choices=["strict", "budget", "leader", "lru"],
                    help="SGLANG_TIERED_GUARANTEE of the tiered server (and its replay)")
    ap.add_argument("--out", default=None, help="write the recorded runs (JSON) here")
    args = ap.parse_args(argv)
    reqs = load_workload(args.workload)
    total = sum(len(r.tokens) for r in reqs)
    runs = []
    for be in args.backends:
        live = serve(reqs, be, args.page_size, args.pool, args.max_new_tokens,
                     ROOT / "logs" / f"live_fidelity_{be}.log", args.guarantee)  # fmt: skip
        sim = replay(reqs, be, args.page_size, args.pool, live["outputs"], args.guarantee)
        differ = [(i, s, c) for i, (s, c) in enumerate(zip(sim, live["cached"])) if s != c]
        print(f"{be:6s} live {sum(live['cached']) / total:.4f}  sim {sum(sim) / total:.4f}  "
              f"{len(differ)} requests differ {differ[:10]}", flush=True)  # fmt: skip
        runs.append({"workload": args.workload, "backend": be, "page": args.page_size, "pool": args.pool,
                     "guarantee": args.guarantee if be == "tiered" else None,
                     "cached": live["cached"], "outputs": live["outputs"]})  # fmt: skip
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"runs": runs}, separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
