"""One-shot GPU check of the T1 page movers (needs torch and triton only; no sglang).

On a CUDA machine it measures, for the canonical layout ``[kv][layer][head][page][token][dim]``:

* ceilings: device-to-device ``copy_``, pinned host-to-device and device-to-host ``copy_``;
* gather/scatter between a device pool and a device-resident canonical plane (Triton) against
  the device copy ceiling (target >= 90 %);
* promotion (host -> device) and demotion (device -> host) of runs of 1/16/256 pages at TP 1/2/4/8
  head slices, three ways: the Triton kernel reading/writing pinned host memory directly through
  unified addressing (``zero_copy``), the torch reference (``torch_ref``: index on one side, one
  copy), and one pinned staging buffer per batch (``staging``: host gather into pinned staging, one
  ``copy_``, device scatter); against the pinned copy ceiling (target >= 85 %).

Every path's result is checked equal to the reference before it is timed.

    python bench/gpu_check.py                 # on a GPU: writes bench/results/gpu_check.csv
    python bench/gpu_check.py --dry-run       # anywhere: small shapes, correctness only (CI)
"""

from __future__ import annotations

import argparse
import csv
import pathlib
import platform
import subprocess
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
try:
    from sglang_tiered.kernels.kv_pages import gather_pages, scatter_pages
except ImportError:  # a checkout without the package installed: the top-level folder is the package
    sys.path.insert(0, str(ROOT))
    import kernels
    import kernels.kv_pages
    from kernels.kv_pages import gather_pages, scatter_pages  # type: ignore

    sys.modules["sglang_tiered.kernels"] = kernels
    sys.modules["sglang_tiered.kernels.kv_pages"] = kernels.kv_pages


def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def bench(fn, reps: int, cuda: bool) -> float:
    fn()
    if cuda:
        torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def ceilings(dev, nbytes: int, reps: int, cuda: bool) -> dict:
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    out = {"d2d": nbytes / bench(lambda: b.copy_(a), reps, cuda) / 1e9}
    out["h2d"] = nbytes / bench(lambda: a.copy_(h, non_blocking=cuda), reps, cuda) / 1e9
    out["d2h"] = nbytes / bench(lambda: h.copy_(a, non_blocking=cuda), reps, cuda) / 1e9
    return out


def run(args) -> list[dict]:
    cuda = torch.cuda.is_available() and not args.dry_run
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    H, D, ps = args.kv_heads, args.head_dim, args.page_size
    P = max(args.pages) * 2  # host slots and device pages per plane
    reps = 1 if args.dry_run else args.reps
    rows: list[dict] = []
    ceil = ceilings(dev, 4 << 20 if args.dry_run else args.ceiling_mb << 20, reps, cuda)
    elem = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(0)
    for tp in args.tp:
        hr = H // tp
        head0 = (tp - 1) * hr if tp > 1 else 0  # the last rank's slice (exercises the head offset)
        pool = torch.randn(P * ps, hr, D, generator=g).to(dtype).to(dev)  # one (kv, layer) plane
        host = torch.zeros(H, P, ps, D, dtype=dtype, pin_memory=cuda)
        host_dev = torch.zeros(H, P, ps, D, dtype=dtype, device=dev)  # device-resident canonical
        for n in args.pages:
            src = torch.randperm(P, generator=g)[:n].to(torch.int64)
            dst = torch.randperm(P, generator=g)[:n].to(torch.int64)
            nbytes = n * ps * hr * D * elem

            def check(fn_out, what):
                want = torch.zeros(H, P, ps, D, dtype=dtype)
                scatter_pages(pool.cpu(), src, want, dst, head0, ps, force_ref=True)
                got = fn_out.cpu() if fn_out.is_cuda else fn_out
                if not torch.equal(got[head0 : head0 + hr, dst], want[head0 : head0 + hr, dst]):
                    raise AssertionError(f"{what} tp={tp} pages={n}: result differs from the reference")

            paths = {
                "scatter_device": (lambda: scatter_pages(pool, src.to(dev), host_dev, dst.to(dev), head0, ps), host_dev, "d2d"),
                "demote_torch_ref": (lambda: scatter_pages(pool, src.to(dev), host, dst, head0, ps, force_ref=True), host, "d2h"),
                "demote_zero_copy": (lambda: scatter_pages(pool, src.to(dev), host, dst.to(dev), head0, ps), host, "d2h"),
                "demote_staging": (lambda: _demote_staging(pool, src, host, dst, head0, ps, cuda), host, "d2h"),
            }  # fmt: skip
            for name, (fn, target, ceiling) in paths.items():
                if name == "demote_zero_copy" and not cuda:
                    continue  # the same call as scatter on CPU
                try:
                    target.zero_()
                    fn()
                    if cuda:
                        torch.cuda.synchronize()
                    check(target, name)
                    secs = bench(fn, reps, cuda)
                except Exception as exc:  # noqa: BLE001 - on a GPU, report a failing path and go on
                    if args.dry_run:
                        raise
                    rows.append({**_row(name, tp, n, nbytes, float("inf"), ceil[ceiling], ceiling), "error": repr(exc)[:200]})
                    continue
                rows.append(_row(name, tp, n, nbytes, secs, ceil[ceiling], ceiling))
            # promotions read what the scatter wrote into the canonical planes
            scatter_pages(pool, src.to(dev), host_dev, dst.to(dev), head0, ps)
            scatter_pages(pool.cpu(), src, host, dst, head0, ps, force_ref=True)
            back = torch.empty_like(pool)
            gpaths = {
                "gather_device": (lambda: gather_pages(host_dev, dst.to(dev), back, src.to(dev), head0, ps), "d2d"),
                "promote_torch_ref": (lambda: gather_pages(host, dst, back, src.to(dev), head0, ps, force_ref=True), "h2d"),
                "promote_zero_copy": (lambda: gather_pages(host, dst.to(dev), back, src.to(dev), head0, ps), "h2d"),
                "promote_staging": (lambda: _promote_staging(host, dst, back, src, head0, ps, cuda), "h2d"),
            }  # fmt: skip
            for name, (fn, ceiling) in gpaths.items():
                if name == "promote_zero_copy" and not cuda:
                    continue
                try:
                    back.zero_()
                    fn()
                    if cuda:
                        torch.cuda.synchronize()
                    rows_idx = (src[:, None] * ps + torch.arange(ps)).reshape(-1).to(dev)
                    if not torch.equal(back[rows_idx], pool[rows_idx]):
                        raise AssertionError(f"{name} tp={tp} pages={n}: result differs from the source pages")
                    secs = bench(fn, reps, cuda)
                except Exception as exc:  # noqa: BLE001
                    if args.dry_run:
                        raise
                    rows.append({**_row(name, tp, n, nbytes, float("inf"), ceil[ceiling], ceiling), "error": repr(exc)[:200]})
                    continue
                rows.append(_row(name, tp, n, nbytes, secs, ceil[ceiling], ceiling))
    return rows


def t1_transfers(args, ceil: dict) -> list[dict]:
    """A whole T1 transfer as the server makes it: every (K|V, layer) plane of ``--layers`` layers.
    ``per_plane``: one launch per plane, the ids moved and checked for duplicates per call (the
    path before ``move_pages_all``); ``one_launch``: ``move_pages_all`` (ids moved once);
    ``host_tier``: ``HostTier.demote`` / ``load`` end to end (index work included)."""
    from types import SimpleNamespace

    from sglang_tiered.kernels.kv_pages import PoolPlanes, move_pages_all
    from sglang_tiered.tier.host_tier import HostTier

    cuda = torch.cuda.is_available() and not args.dry_run
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    L, H, D, ps = args.layers, args.kv_heads, args.head_dim, args.page_size
    pages_list = [n for n in args.pages if n <= 256] or [min(args.pages)]
    P = 2 * max(pages_list)
    reps = 1 if args.dry_run else args.reps
    g = torch.Generator().manual_seed(1)
    kvc = SimpleNamespace(k_buffer=[torch.randn((P + 1) * ps, H, D, generator=g).to(dtype).to(dev) for _ in range(L)],
                          v_buffer=[torch.randn((P + 1) * ps, H, D, generator=g).to(dtype).to(dev) for _ in range(L)])  # fmt: skip
    tier = HostTier.build(kvc, page_size=ps, total_kv_heads=H, tp_size=1, tp_rank=0, capacity_pages=P, name=None)
    data, planes = tier.pool.data, PoolPlanes(kvc.k_buffer, kvc.v_buffer)
    elem = torch.empty((), dtype=dtype).element_size()
    rows = []
    seq = iter(range(1 << 40))
    for n in pages_list:
        src = torch.randperm(P, generator=g)[:n].to(torch.int64)
        dst = torch.randperm(P, generator=g)[:n].to(torch.int64)
        nbytes = n * ps * H * D * elem * 2 * L

        def per_plane(to_host):
            ids = dst.to(dev) if cuda else dst
            for kv_, bufs in enumerate((kvc.k_buffer, kvc.v_buffer)):
                for layer, buf in enumerate(bufs):
                    if to_host:
                        scatter_pages(buf, src.to(dev), data[kv_, layer], ids, 0, ps)
                    else:
                        gather_pages(data[kv_, layer], ids, buf, src.to(dev), 0, ps)
            if cuda:
                torch.cuda.current_stream().synchronize()

        def one_launch(to_host):
            ids = torch.tensor(dst.tolist(), dtype=torch.int64)
            move_pages_all(planes, data, src.to(dev), ids.to(dev) if cuda else ids, 0, ps, to_host=to_host,
                           unique_checked=True)  # fmt: skip
            if cuda:
                torch.cuda.current_stream().synchronize()

        def tier_demote():
            tier.demote(src, [next(seq).to_bytes(16, "little") for _ in range(n)])

        hashes = [next(seq).to_bytes(16, "little") for _ in range(n)]

        def tier_load():
            if not tier.load(hashes, src.to(dev)):
                raise AssertionError("load failed")

        cases = (("per_plane", lambda: per_plane(True), True), ("one_launch", lambda: one_launch(True), True),
                 ("host_tier", tier_demote, True), ("per_plane", lambda: per_plane(False), False),
                 ("one_launch", lambda: one_launch(False), False), ("host_tier", tier_load, False))  # fmt: skip
        for name, fn, to_host in cases:
            if name == "host_tier" and not to_host:
                tier.demote(src, hashes)  # what the promotions read
            secs = bench(fn, reps, cuda)
            c = "d2h" if to_host else "h2d"
            row = _row(f"{'demote' if to_host else 'promote'}_{name}", 1, n, nbytes, secs, ceil[c], c)
            row["us_per_call"] = secs * 1e6
            row["layers"] = L
            rows.append(row)
    return rows


def plot_t1(csv_path: pathlib.Path, png_path: pathlib.Path) -> None:
    """Per-transfer time and fraction of the pinned copy ceiling of ``t1_transfers``' rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(open(csv_path)))
    fig, axs = plt.subplots(1, 2, figsize=(11, 4))
    for path in sorted({r["path"] for r in rows}):
        rs = [r for r in rows if r["path"] == path]
        x = [int(r["pages"]) for r in rs]
        axs[0].plot(x, [float(r["us_per_call"]) for r in rs], marker="o", label=path)
        axs[1].plot(x, [100 * float(r["fraction_of_ceiling"]) for r in rs], marker="o", label=path)
    r0 = rows[0]
    for ax in axs:
        ax.set_xscale("log")
        ax.set_xlabel(f"pages per transfer ({r0['layers']} layers)")
    axs[0].set_yscale("log")
    axs[0].set_ylabel("us per transfer")
    axs[1].set_ylabel("% of the pinned copy ceiling")
    axs[0].legend(fontsize=7)
    fig.suptitle(f"T1 transfers on {r0['gpu']} (git {r0['git_sha']}): one launch for every plane vs one per plane")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


def _demote_staging(pool, src, host, dst, head0, ps, cuda):
    """Device pages -> one contiguous device buffer (Triton/torch gather on the device) -> one
    copy into pinned staging -> host index_copy into the canonical slots."""
    n, hr, D = src.numel(), pool.shape[1], pool.shape[2]
    tok = (src.to(pool.device)[:, None] * ps + torch.arange(ps, device=pool.device)).reshape(-1)
    dev_buf = pool[tok].view(n, ps, hr, D).permute(2, 0, 1, 3).contiguous()
    stage = torch.empty(dev_buf.shape, dtype=dev_buf.dtype, pin_memory=cuda)
    stage.copy_(dev_buf)
    host[head0 : head0 + hr].index_copy_(1, dst, stage)


def _promote_staging(host, dst, pool, src, head0, ps, cuda):
    hr = pool.shape[1]
    stage = host[head0 : head0 + hr].index_select(1, dst)
    if cuda:
        stage = stage.pin_memory()
    buf = stage.to(pool.device, non_blocking=cuda)
    tok = (src.to(pool.device)[:, None] * ps + torch.arange(ps, device=pool.device)).reshape(-1)
    pool[tok] = buf.permute(1, 2, 0, 3).reshape(-1, hr, pool.shape[2])


def _row(path, tp, pages, nbytes, secs, ceiling_gbps, ceiling) -> dict:
    gbps = nbytes / secs / 1e9
    return {"path": path, "tp": tp, "pages": pages, "bytes": nbytes, "seconds": secs, "GBps": gbps,
            "ceiling": ceiling, "ceiling_GBps": ceiling_gbps, "fraction_of_ceiling": gbps / ceiling_gbps,
            "error": ""}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="small shapes on CPU, correctness only")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pages", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--ceiling-mb", type=int, default=256)
    ap.add_argument("--layers", type=int, default=32, help="layers of the whole-transfer table (t1_transfers)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_check.csv"))
    args = ap.parse_args(argv)
    if args.dry_run:
        args.kv_heads, args.head_dim, args.pages, args.dtype = 8, 16, [1, 3, 8], "float32"
    rows = run(args)
    cuda = torch.cuda.is_available() and not args.dry_run
    ceil = ceilings(torch.device("cuda" if cuda else "cpu"), 4 << 20 if args.dry_run else args.ceiling_mb << 20,
                    1 if args.dry_run else args.reps, cuda)  # fmt: skip
    if args.dry_run:
        args.layers = 3
    t1_rows = t1_transfers(args, ceil)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.dry_run else "none (dry run)"
    meta = {"gpu": gpu, "torch": torch.__version__, "triton": triton_version, "git_sha": git_sha(),
            "machine": platform.machine(), "dry_run": args.dry_run}  # fmt: skip
    for r in rows:
        print(f"{r['path']:18} tp={r['tp']} pages={r['pages']:4} {r['GBps']:8.2f} GB/s "
              f"({r['fraction_of_ceiling']:.0%} of {r['ceiling']} {r['ceiling_GBps']:.1f})")  # fmt: skip
    for r in t1_rows:
        print(f"{r['path']:20} layers={r['layers']} pages={r['pages']:4} {r['us_per_call']:9.1f} us "
              f"{r['GBps']:8.2f} GB/s ({r['fraction_of_ceiling']:.0%} of {r['ceiling']} {r['ceiling_GBps']:.1f})")  # fmt: skip
    if not args.dry_run:
        out = pathlib.Path(args.out)
        t1_out = out.with_name(out.stem + "_t1.csv")
        for path, table in ((t1_out, t1_rows), (out, rows)):
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=[*meta, *table[0]])
                w.writeheader()
                for r in table:
                    w.writerow({**meta, **r})
            print(f"wrote {path}")
        try:
            plot_t1(t1_out, t1_out.with_suffix(".png"))
        except ImportError:
            pass
    print(f"ok: {len(rows)} paths checked equal to the reference ({meta['gpu']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
