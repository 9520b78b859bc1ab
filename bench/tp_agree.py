"""Latency of ``HostTier.agree``'s all-reduce (MIN of one int64) over a 2-rank gloo group on
loopback, the cost TP > 1 pays per T1 transfer since session 23.

    .venv/bin/python bench/tp_agree.py
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, n, _):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "29613"
    dist.init_process_group("gloo", rank=rank, world_size=2)
    t = torch.tensor([1], dtype=torch.int64)
    for _ in range(200):
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        ts.append(time.perf_counter() - t0)
    ts.sort()
    if rank == 0:
        print(f"gloo all_reduce MIN int64, 2 ranks, loopback, {n} calls: p50 {ts[len(ts)//2]*1e6:.1f} us, "
              f"p90 {ts[int(len(ts)*0.9)]*1e6:.1f} us, p99 {ts[int(len(ts)*0.99)]*1e6:.1f} us", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    import argparse

    # (before session 39 --help ran the benchmark)
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    mp.spawn(run, args=(5000, None), nprocs=2, join=True)
