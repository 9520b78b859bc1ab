"""The strict default against SGLang's lru on a server that runs one request at a time while
clients queue: before each request, SGLang's scheduler refreshes the cached prefixes of the
waiting requests (``SchedulePolicy._touch_waiting_prefixes``: every ``--interval``-th scheduling
round, up to 128 waiting requests, the head last; on by default for fcfs + lru, every 32nd
round). Both caches get the same calls. Session 36 found that lru's tree shadow missed these
touches (the strict default lost 2.2-4.7 points on a built trace); this checks the fix over the
generated family, Mooncake and the multi-tenant workload.

    .venv/bin/python bench/refresh_bar.py --seeds 0 1 2 --fracs 0.01 0.05 --queue 8 --interval 1
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from array import array

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bookkeeping import capacity_tokens, load  # noqa: E402
from trace_replay import PAGE, sglang_driver  # noqa: E402


def replay(cache_driver, reqs, queue: int, interval: int) -> tuple[int, int]:
    """(hit tokens, prompt tokens): ``reqs`` served in order, ``queue`` of them waiting behind
    the one served, their prefixes refreshed (in reverse, the head last) every ``interval`` rounds."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    hit = tot = 0
    cache = cache_driver.cache
    for i, r in enumerate(reqs):
        if interval and i % interval == 0:
            for w in reversed(reqs[i : i + 1 + queue][:128]):  # the head (served next) last
                cache.touch_prefix(RadixKey(array("q", w.tokens), None, cache_salt=w.tenant or None))
        o = cache_driver.run(r.tokens, tenant=r.tenant)
        hit, tot = hit + o.cached_len, tot + o.prompt_len
    return hit, tot


def cell(name: str, frac: float, queue: int, interval: int) -> dict:
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

    reqs = load(name)[0]
    cap = capacity_tokens(name, frac)
    lru_hit, tot = replay(sglang_driver(cap, "lru"), reqs, queue, interval)
    cache = TieredRadixCache.create_simulated(cap, PAGE)
    hit, tot2 = replay(cache.driver, reqs, queue, interval)
    assert tot == tot2
    snap = cache.policy.snapshot()
    return {"workload": name, "frac": frac, "lru": lru_hit / tot, "tiered": hit / tot,
            "margin_points": (hit - lru_hit) / tot * 100, "replayed_touches": snap["replayed_touches"],
            "lru_model_bias": snap["lru_model_bias"]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="*", default=list(range(20)))
    ap.add_argument("--traces", action="store_true", help="also Mooncake and the multi-tenant workload")
    ap.add_argument("--fracs", type=float, nargs="+", default=[0.005, 0.02, 0.1])
    ap.add_argument("--queue", type=int, default=8, help="requests waiting behind the one served")
    ap.add_argument("--interval", type=int, default=32, help="refresh every this many rounds (SGLang: 32)")
    ap.add_argument("--name", default=None, help="write bench/results/<name>.json")
    a = ap.parse_args()
    names = [f"family-{s}" for s in a.seeds] + (["mooncake", "multitenant"] if a.traces else [])
    rows, t0 = [], time.time()
    for n in names:
        for f in a.fracs:
            rows.append(cell(n, f, a.queue, a.interval))
            r = rows[-1]
            print(f"{n:14s} {f:6.3f}  lru {r['lru']:.4f}  tiered {r['tiered']:.4f}  margin {r['margin_points']:+.3f}"
                  f"  touches {r['replayed_touches']}", flush=True)  # fmt: skip
    worst = min(rows, key=lambda r: r["margin_points"])
    below = sum(r["margin_points"] < -0.2 for r in rows)
    print(f"{len(rows)} cells, {below} below lru - 0.2 points; worst {worst['margin_points']:+.3f} "
          f"({worst['workload']} at {worst['frac']}); {time.time() - t0:.0f} s")
    if a.name:
        from trace_replay import environment

        out = ROOT / "bench" / "results" / f"{a.name}.json"
        out.write_text(json.dumps({"args": vars(a), "environment": environment(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
