"""Round-by-round comparison of the routers in a ``bench/fleet_live.py`` result (its JSON keeps every
request's TTFT and cached tokens per router and round):

    .venv/bin/python bench/fleet_live_compare.py bench/results/fleet_live_long_pa.json [--base ours]

Per round and on the mean of the rounds: token hit rate, TTFT p50 and p90 (the bench's own
percentile: the sorted TTFTs at ``int(q x n)``). Then, for the base router against each other:
the rounds in which its p90 is lower and its hit rate higher, and a 95 % bootstrap interval of the
difference of the mean-over-rounds p90 (each round's requests resampled within that round, 2,000
resamples, seed 0). An interval that excludes 0 says the p90 difference is larger than what the
requests' own spread gives; it does not cover drift of the machine between rounds, which is why
the bench alternates the routers' order.
"""

from __future__ import annotations

import argparse
import json
import random


def q(xs, p: float) -> float:
    """The ``p`` quantile as the bench reports it (``bench/fleet_live.py`` uses this one)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def load(path: str) -> dict:
    """router -> round -> (TTFTs in ms, hit rate)."""
    doc = json.load(open(path))
    fields = doc["per_request_fields"]
    it, ic, ip = fields.index("ttft_s"), fields.index("cached_tokens"), fields.index("prompt_tokens")
    runs: dict = {}
    for blk in doc["per_request"]:
        rows = blk["requests"]
        rows = json.loads(rows) if isinstance(rows, str) else rows
        ok = [r for r in rows if r[it] is not None]
        hit = sum(r[ic] for r in ok) / max(1, sum(r[ip] for r in ok))
        runs.setdefault(blk["router"], {})[blk["round"]] = ([1e3 * r[it] for r in ok], hit)
    return runs


def compare(runs: dict, base: str, resamples: int = 2000, seed: int = 0) -> list[dict]:
    rounds = sorted(runs[base])
    rng = random.Random(seed)
    out = []
    for other in runs:
        if other == base:
            continue
        both = [k for k in rounds if k in runs[other]]
        diffs = []
        for _ in range(resamples):
            a = [q(rng.choices(runs[base][k][0], k=len(runs[base][k][0])), 0.9) for k in both]
            b = [q(rng.choices(runs[other][k][0], k=len(runs[other][k][0])), 0.9) for k in both]
            diffs.append(sum(a) / len(a) - sum(b) / len(b))
        diffs.sort()
        point = sum(q(runs[base][k][0], 0.9) - q(runs[other][k][0], 0.9) for k in both) / len(both)
        out.append({"other": other, "rounds": len(both),
                    "p90_lower_rounds": sum(q(runs[base][k][0], 0.9) < q(runs[other][k][0], 0.9) for k in both),
                    "hit_higher_rounds": sum(runs[base][k][1] > runs[other][k][1] for k in both),
                    "p90_diff_ms": round(point, 1),
                    "p90_diff_ci95_ms": [round(diffs[int(0.025 * resamples)], 1), round(diffs[int(0.975 * resamples)], 1)]})  # fmt: skip
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", help="a bench/fleet_live.py JSON")
    ap.add_argument("--base", default="ours")
    args = ap.parse_args(argv)
    runs = load(args.result)
    if args.base not in runs:
        ap.error(f"no router {args.base!r} in {args.result} (has {', '.join(runs)})")
    routers = list(runs)
    print("round  " + "  ".join(f"{r:>24s}" for r in routers) + "   (hit rate / p50 / p90 ms)")
    rounds = sorted(runs[args.base])
    for k in rounds:
        cells = [runs[r].get(k) for r in routers]
        print(f"{k:5d}  " + "  ".join(f"{c[1]:.4f} {q(c[0], 0.5):6.1f} {q(c[0], 0.9):7.1f}" if c else f"{'-':>24s}"
                                      for c in cells))  # fmt: skip
    mean = lambda r, f: sum(f(runs[r][k]) for k in runs[r]) / len(runs[r])  # noqa: E731
    print("mean   " + "  ".join(f"{mean(r, lambda c: c[1]):.4f} {mean(r, lambda c: q(c[0], 0.5)):6.1f} "
                                f"{mean(r, lambda c: q(c[0], 0.9)):7.1f}" for r in routers))  # fmt: skip
    for c in compare(runs, args.base):
        print(f"{args.base} vs {c['other']}: p90 lower in {c['p90_lower_rounds']}/{c['rounds']} rounds, hit rate higher "
              f"in {c['hit_higher_rounds']}/{c['rounds']}; mean p90 difference {c['p90_diff_ms']:+.1f} ms, 95 % "
              f"bootstrap interval [{c['p90_diff_ci95_ms'][0]:+.1f}, {c['p90_diff_ci95_ms'][1]:+.1f}]")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
