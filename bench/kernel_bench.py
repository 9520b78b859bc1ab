"""Page-mover microbenchmark: GB/s of scatter (device pool -> canonical host) and gather (host ->
device pool) against the measured copy ceilings on this machine (device-to-device, and pinned
host-to-device on CUDA). On CPU the torch path is what the server uses; on CUDA the Triton kernels.

    .venv/bin/python bench/kernel_bench.py            # writes bench/results/kernel_bench_{cpu,cuda}.json
    .venv/bin/python bench/kernel_bench.py --out DIR  # elsewhere
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.trace_replay import environment  # noqa: E402
from sglang_tiered.kernels.kv_pages import gather_pages, scatter_pages  # noqa: E402


def timeit(fn, reps=5):
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    args = _args(argv)  # (before session 39 --help ran the benchmark and overwrote the results)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    ps, hr, htot, d, dtype = 16, 8, 8, 128, torch.bfloat16  # one layer plane of a Llama-8B-like pool
    n_pages = 2048 if cuda else 512
    pool = torch.randn((n_pages + 1) * ps, hr, d, device=dev).to(dtype)
    host = torch.zeros(htot, n_pages, ps, d, dtype=dtype, pin_memory=cuda)
    dev_host = torch.zeros(htot, n_pages, ps, d, dtype=dtype, device=dev)  # device-side canonical
    pages = torch.randperm(n_pages, device=dev)[: n_pages // 2].to(torch.int64) + 1
    slots = torch.arange(n_pages // 2, dtype=torch.int64)
    nbytes = pages.numel() * ps * hr * d * pool.element_size()
    results = {"environment": environment(), "device": str(dev), "bytes_per_call": nbytes, "dtype": str(dtype)}
    flat = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    results["copy_ceiling_d2d_gbps"] = nbytes / timeit(lambda: flat.copy_(torch.empty_like(flat))) / 1e9
    # scatter/gather within the device (canonical layout on device): vs the device copy ceiling
    s = timeit(lambda: scatter_pages(pool, pages, dev_host, slots.to(dev), 0, ps))
    g = timeit(lambda: gather_pages(dev_host, slots.to(dev), pool, pages, 0, ps))
    results["scatter_d2d_gbps"] = nbytes / s / 1e9
    results["gather_d2d_gbps"] = nbytes / g / 1e9
    if cuda:
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        results["copy_ceiling_h2d_pinned_gbps"] = nbytes / timeit(lambda: flat.copy_(src, non_blocking=True)) / 1e9
        gh = timeit(lambda: gather_pages(host, slots, pool, pages, 0, ps))
        results["gather_h2d_gbps"] = nbytes / gh / 1e9
        results["gather_h2d_ratio"] = results["gather_h2d_gbps"] / results["copy_ceiling_h2d_pinned_gbps"]
    results["scatter_ratio_vs_d2d"] = results["scatter_d2d_gbps"] / results["copy_ceiling_d2d_gbps"]
    results["gather_ratio_vs_d2d"] = results["gather_d2d_gbps"] / results["copy_ceiling_d2d_gbps"]
    out_dir = pathlib.Path(args.out) if args.out else ROOT / "bench" / "results"
    out = out_dir / ("kernel_bench_cuda.json" if cuda else "kernel_bench_cpu.json")
    out.write_text(json.dumps(results, indent=2))
    for k, v in results.items():
        if k != "environment":
            print(f"{k:32} {v:.3f}" if isinstance(v, float) else f"{k:32} {v}")
    return 0


def _args(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    return ap.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
