"""Replay the Mooncake trace against any running SGLang server through ``/generate`` with token ids.

    .venv/bin/python bench/live_trace.py --url http://127.0.0.1:30000 --limit 300 --time-scale 60

Each 512-token hash block becomes ``--tokens-per-block`` deterministic token ids (prefix chaining
preserved; always ids, never text, so block boundaries stay put). Arrival times are compressed by
``--time-scale`` (60: one trace minute per second). Records per-request cached_tokens, TTFT and
latency to CSV. Works against stock SGLang or sglang-tiered, on CPU or a GPU deployment (use
``--tokens-per-block 512`` there for the real lengths; token ids stay below ``--vocab``).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import csv
import pathlib
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.live_compare import stream_generate  # noqa: E402
from sglang_tiered.dev.workloads import load_mooncake  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--trace", default=str(ROOT / "bench" / "data" / "mooncake_conversation_trace.jsonl.gz"),
                    help="trace JSONL(.gz) (default: the bundled Mooncake conversation trace)")
    ap.add_argument("--limit", type=int, default=300)
    ap.add_argument("--tokens-per-block", type=int, default=16)
    ap.add_argument("--time-scale", type=float, default=60.0, help="arrival compression factor")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--max-workers", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "live_trace.csv"))
    args = ap.parse_args(argv)

    reqs = load_mooncake(args.trace, tokens_per_block=args.tokens_per_block, limit=args.limit)
    t_first = reqs[0].arrival_s
    rows, lock = [], threading.Lock()
    start = time.perf_counter()

    def fire(i, r):
        delay = (r.arrival_s - t_first) / args.time_scale - (time.perf_counter() - start)
        if delay > 0:
            time.sleep(delay)
        sent = time.perf_counter() - start
        out = stream_generate(args.url, {"input_ids": list(r.tokens),
                                         "sampling_params": {"temperature": 0, "max_new_tokens": args.max_new_tokens,
                                                             "ignore_eos": True}})  # fmt: skip
        with lock:
            rows.append([i, f"{r.arrival_s:.3f}", f"{sent:.3f}", out["prompt_tokens"], out["cached_tokens"],
                         f"{out['ttft_s']:.6f}", f"{out['latency_s']:.6f}"])  # fmt: skip
            if len(rows) % 25 == 0:
                print(f"  {len(rows)}/{len(reqs)} done", flush=True)

    with cf.ThreadPoolExecutor(args.max_workers) as ex:
        list(ex.map(lambda ir: fire(*ir), enumerate(reqs)))
    rows.sort()
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["i", "trace_arrival_s", "sent_s", "prompt_tokens", "cached_tokens", "ttft_s", "latency_s"])
        w.writerows(rows)
    prompt = sum(r[3] for r in rows)
    cached = sum(r[4] for r in rows)
    print(f"{len(rows)} requests, token hit rate {cached / max(1, prompt):.3f}, wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
