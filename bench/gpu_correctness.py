"""One-shot GPU correctness check of T1's real CUDA path (needs torch and triton only; no sglang).

What the CPU tests cannot show (they run the Triton kernels in the interpreter and T1 in plain
host memory), checked on a CUDA device, every result bit-exact against the torch reference:

* ``kernels``: ``scatter_pages`` / ``gather_pages`` compiled by Triton, for fp16 / bf16 / fp32 /
  fp8-as-uint8, odd shapes and page sizes 1 / 16 / 64, head offsets (a TP rank's slice), with the
  canonical plane in three kinds of memory: device memory, pinned host memory (zero-copy through
  unified addressing, the ids on the device), and a shared-memory mapping page-locked with
  ``cudaHostRegister`` (a named T1). Each case also asserts that the Triton launch ran.
* ``all_planes``: ``move_pages_all``, every (K|V, layer) plane of a transfer in one launch (the
  path ``HostTier`` takes), both directions, the same memory kinds, up to 32 layers.
* ``host_tier``: ``HostTier`` (the server's T1 object) over a CUDA KV pool, private (pinned) and
  named (registered shared memory): demote, clear the device pages, load into other pages, and
  compare every layer's K and V.
* ``fencing``: a store copies device pages that a forward pass on another stream is still
  writing. The forward stream sleeps, then writes new values and records the ready event; the
  store runs on a side stream (as the store queue's worker does). With the event the copy must see
  the new values; without it (the negative control) the race is reported, so the check has teeth.
  The same through the threaded ``StoreQueue`` with the worker on its own side stream.

    python bench/gpu_correctness.py --out results.json     # on a GPU
    python bench/gpu_correctness.py --dry-run              # anywhere: the same checks on CPU (CI)

Exit status 0 only when every check passed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import platform
import sys
import tempfile
import threading
import time
import traceback
from types import SimpleNamespace

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# gpu_check's import makes sglang_tiered.kernels importable from a bare checkout (the GPU machine)
from bench.gpu_check import git_sha  # noqa: E402

import sglang_tiered.kernels.kv_pages as kv  # noqa: E402


class Launches:
    """Counts Triton launches (``kv._launch``) so a case proves it ran the kernel."""

    def __init__(self):
        self.n = 0
        self._real = kv._launch

    def __enter__(self):
        def counted(*a, **k):
            self.n += 1
            return self._real(*a, **k)

        kv._launch = counted
        return self

    def __exit__(self, *exc):
        kv._launch = self._real


def rand(shape, dtype, g):
    if dtype == torch.uint8:  # fp8 pools are stored as uint8
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return torch.randn(shape, generator=g).to(dtype)


def host_plane(kind: str, shape, dtype, dev, keep: list):
    """A canonical plane in device memory, pinned host memory, or registered shared memory."""
    if kind == "device":
        return torch.zeros(shape, dtype=dtype, device=dev)
    if kind == "pinned":
        return torch.zeros(shape, dtype=dtype, pin_memory=dev.type == "cuda")
    # registered: a shared-memory file mapping, page-locked as HostTier.build does for a named T1
    n = int(torch.tensor(shape).prod()) * torch.empty((), dtype=dtype).element_size()
    fd, path = tempfile.mkstemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.close(fd)
    os.truncate(path, n)
    storage = torch.UntypedStorage.from_file(path, True, n)
    os.unlink(path)
    raw = torch.empty(0, dtype=torch.uint8).set_(storage)
    if dev.type == "cuda" and not kv.pin_host_memory(raw):
        raise RuntimeError("cudaHostRegister of a shared-memory mapping failed")
    keep.append(raw)
    t = raw.view(dtype).view(shape)
    t.zero_()
    return t


def _kernel_case(pool, base, pp, hs, off, ps, dtype, kind, dev, keep, g) -> bool:
    """Scatter into a plane of ``kind`` memory, gather back; both equal the torch reference."""
    cuda = dev.type == "cuda"
    want = base.clone()
    kv.scatter_pages(pool, pp, want, hs, off, ps, force_ref=True)
    host = host_plane(kind, base.shape, dtype, dev, keep)
    host.copy_(base)
    kv.scatter_pages(pool.to(dev), pp.to(dev), host, hs.to(dev), off, ps)
    if cuda:
        torch.cuda.synchronize()
    if not torch.equal(host.cpu(), want):
        return False
    if len(set(pp.tolist())) != pp.numel():
        return True  # (a gather into duplicate device pages is refused by contract)
    back = rand(tuple(pool.shape), dtype, g)
    want_back = back.clone()
    kv.gather_pages(want, hs, want_back, pp, off, ps, force_ref=True)
    dback = back.to(dev)
    kv.gather_pages(host, hs.to(dev), dback, pp.to(dev), off, ps)
    if cuda:
        torch.cuda.synchronize()
    got = dback.cpu()
    if not torch.equal(got, want_back):
        return False
    # the round trip: the gathered pages are exactly the scattered ones
    return all(torch.equal(got[p * ps : (p + 1) * ps], pool[p * ps : (p + 1) * ps]) for p in pp.tolist())


def check_kernels(dev, dry: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    cuda = dev.type == "cuda"
    kinds = ["device", "pinned", "registered"] if cuda else ["device"]
    dtypes = [torch.float16, torch.bfloat16, torch.float32, torch.uint8]
    # (page size, heads of this rank, heads in the plane, head dim)
    shapes = [(16, 2, 4, 32), (3, 1, 3, 5), (4, 3, 3, 7), (1, 8, 8, 128), (16, 4, 8, 128), (64, 1, 8, 64),
              (16, 2, 2, 256)]  # fmt: skip
    if dry:
        shapes = shapes[:3]
    cases = fails = launches = 0
    failed: list = []
    keep: list = []
    for dtype, (ps, hr, htot, d), kind in itertools.product(dtypes, shapes, kinds):
        for ids in ([], [1], [5, 2, 7], [2, 2, 3], list(range(40, 0, -3))):
            pool = rand((49 * ps, hr, d), dtype, g)
            base = rand((htot, 50, ps, d), dtype, g)
            pp = torch.tensor(ids, dtype=torch.int64)
            hs = torch.tensor(list(range(len(ids)))[::-1], dtype=torch.int64) + 1
            off = htot - hr  # the last rank's heads
            with Launches() as lc:
                try:
                    ok = _kernel_case(pool, base, pp, hs, off, ps, dtype, kind, dev, keep, g)
                    err = "" if ok else "differs from the reference"
                except Exception as exc:  # noqa: BLE001 - report and go on
                    ok, err = False, repr(exc)[:300]
            if ok and ids and (cuda or os.environ.get("TRITON_INTERPRET") == "1") and lc.n == 0:
                ok, err = False, "Triton did not run"
            if not ok:
                failed.append({"case": [str(dtype), ps, hr, htot, d, kind, ids[:5]], "error": err})
            cases += 1
            fails += not ok
            launches += lc.n
    for raw in keep:
        if cuda:
            kv.unpin_host_memory(raw)
    return {"cases": cases, "failed": fails, "triton_launches": launches, "memory_kinds": kinds,
            "failures": failed[:20], "ok": fails == 0}  # fmt: skip


def check_all_planes(dev, dry: bool) -> dict:
    """``move_pages_all`` (every plane in one launch, HostTier's path) against the per-plane torch
    reference, both directions, with the canonical pool in each kind of memory."""
    g = torch.Generator().manual_seed(3)
    cuda = dev.type == "cuda"
    kinds = ["device", "pinned", "registered"] if cuda else ["device"]
    cases = fails = launches = 0
    failed: list = []
    keep: list = []
    for dtype, (ps, hr, htot, d, L), kind in itertools.product(
        [torch.float16, torch.bfloat16, torch.float32, torch.uint8],
        [(16, 2, 4, 32, 3), (3, 1, 3, 5, 2), (1, 8, 8, 128, 4), (16, 4, 8, 128, 32), (64, 1, 2, 64, 2)],
        kinds,
    ):
        k = [rand((60 * ps, hr, d), dtype, g) for _ in range(L)]
        v = [rand((60 * ps, hr, d), dtype, g) for _ in range(L)]
        base = rand((2, L, htot, 50, ps, d), dtype, g)
        pp = torch.tensor([5, 2, 7, 11, 40, 0], dtype=torch.int64)
        hs = torch.tensor([8, 0, 3, 4, 49, 21], dtype=torch.int64)
        dst = torch.tensor([1, 3, 0, 59, 30, 31], dtype=torch.int64)
        off = htot - hr
        try:
            want = base.clone()
            kv.move_pages_all(kv.PoolPlanes(k, v), want, pp, hs, off, ps, to_host=True, force_ref=True)
            host = host_plane(kind, base.shape, dtype, dev, keep)
            host.copy_(base)
            kd, vd = [t.to(dev) for t in k], [t.to(dev) for t in v]
            with Launches() as lc, _AllLaunches() as la:
                kv.move_pages_all(kv.PoolPlanes(kd, vd), host, pp.to(dev), hs.to(dev), off, ps, to_host=True)
                if cuda:
                    torch.cuda.synchronize()
                ok = torch.equal(host.cpu(), want)
                k2, v2 = [t.clone() for t in kd], [t.clone() for t in vd]
                kv.move_pages_all(kv.PoolPlanes(k2, v2), host, dst.to(dev), hs.to(dev), off, ps, to_host=False)
                if cuda:
                    torch.cuda.synchronize()
            k3, v3 = [t.clone() for t in k], [t.clone() for t in v]
            kv.move_pages_all(kv.PoolPlanes(k3, v3), want, dst, hs, off, ps, to_host=False, force_ref=True)
            ok = ok and all(torch.equal(a.cpu(), b) for a, b in zip(k2 + v2, k3 + v3))
            err = "" if ok else "differs from the reference"
            if ok and cuda and (la.n != 2 or lc.n != 0):
                ok, err = False, f"expected 2 one-launch transfers, saw {la.n} (+{lc.n} per-plane launches)"
        except Exception as exc:  # noqa: BLE001
            ok, err = False, repr(exc)[:300]
        if not ok:
            failed.append({"case": [str(dtype), ps, hr, htot, d, L, kind], "error": err})
        cases += 1
        fails += not ok
        launches += la.n if ok else 0
    for raw in keep:
        if cuda:
            kv.unpin_host_memory(raw)
    return {"cases": cases, "failed": fails, "one_launch_transfers": launches, "memory_kinds": kinds,
            "failures": failed[:20], "ok": fails == 0}  # fmt: skip


class _AllLaunches:
    """Counts launches of the all-plane kernel."""

    def __init__(self):
        self.n = 0

    def __enter__(self):
        if getattr(kv, "_planes_copy_kernel", None) is None:
            return self
        real = self._real = kv._planes_copy_kernel
        outer = self

        class Counted:
            def __getitem__(self, grid):
                outer.n += 1
                return real[grid]

        kv._planes_copy_kernel = Counted()
        return self

    def __exit__(self, *exc):
        if hasattr(self, "_real"):
            kv._planes_copy_kernel = self._real


def _kvcache(dev, layers, slots, heads, d, dtype, g):
    k = [rand((slots, heads, d), dtype, g).to(dev) for _ in range(layers)]
    v = [rand((slots, heads, d), dtype, g).to(dev) for _ in range(layers)]
    return SimpleNamespace(k_buffer=k, v_buffer=v)


def check_host_tier(dev, dry: bool) -> dict:
    from sglang_tiered.tier import host_pool as hp
    from sglang_tiered.tier.host_tier import HostTier

    g = torch.Generator().manual_seed(1)
    out = {}
    ok_all = True
    for named, dtype in itertools.product([False, True], [torch.bfloat16, torch.uint8]):
        label = f"{'named' if named else 'private'}-{str(dtype).replace('torch.', '')}"
        try:
            ps, layers, heads, d, slots = 16, 4, 8, 128, 64 * 16
            kvc = _kvcache(dev, layers, slots, heads, d, dtype, g)
            name = f"gpucheck{os.getpid()}{int(named)}{dtype.itemsize}" if named else None
            if name:
                hp.acquire_owner(name)
            tier = HostTier.build(kvc, page_size=ps, total_kv_heads=heads, tp_size=1, tp_rank=0,
                                  capacity_pages=32, name=name)  # fmt: skip
            pinned = tier.pool.raw.is_pinned()
            counter = _AllLaunches().__enter__()
            src = torch.tensor([3, 9, 10, 11, 40, 2], dtype=torch.int64)
            hashes = [bytes([i]) * 16 for i in range(len(src))]
            orig = [(kb.clone(), vb.clone()) for kb, vb in zip(kvc.k_buffer, kvc.v_buffer)]
            n = tier.demote(src, hashes)
            dst = torch.tensor([50, 51, 20, 21, 5, 60], dtype=torch.int64)
            for kb, vb in zip(kvc.k_buffer, kvc.v_buffer):
                for p in dst.tolist():
                    kb[p * ps : (p + 1) * ps] = 0
                    vb[p * ps : (p + 1) * ps] = 0
            loaded = tier.load(hashes, dst)
            counter.__exit__()
            same = loaded and n == len(src)
            if dev.type == "cuda" and pinned:  # zero-copy: one launch each way
                same = same and counter.n == 2
            for (k0, v0), kb, vb in zip(orig, kvc.k_buffer, kvc.v_buffer):
                for s, t in zip(src.tolist(), dst.tolist()):
                    same = same and torch.equal(kb[t * ps : (t + 1) * ps], k0[s * ps : (s + 1) * ps])
                    same = same and torch.equal(vb[t * ps : (t + 1) * ps], v0[s * ps : (s + 1) * ps])
            tier.pool.check_invariants()
            out[label] = {"ok": bool(same), "demoted": n, "loaded": bool(loaded), "t1_pinned": bool(pinned),
                          "one_launch_transfers": counter.n,
                          "failed_demotions": tier.stats.failed_demotions,
                          "failed_promotions": tier.stats.failed_promotions}  # fmt: skip
            if named:
                if dev.type == "cuda":
                    kv.unpin_host_memory(tier.pool.raw)
                tier.pool.close(unlink=True)
                hp.release_owner(name)
            ok_all = ok_all and same and (pinned or dev.type != "cuda")
        except Exception as exc:  # noqa: BLE001
            out[label] = {"ok": False, "error": traceback.format_exc()[-600:]}
            ok_all = False
    return {"ok": ok_all, **out}


def _fence_case(dev, use_event: bool, via_queue: bool, sleep_cycles: int) -> dict:
    """Forward stream: sleep, then write value 7 into the pages, record ``ready``. The store copies
    on a side stream, waiting for ``ready`` or not. Returns what T1 got."""
    from sglang_tiered.core.store_queue import StoreQueue
    from sglang_tiered.tier.host_tier import THROUGH, HostTier

    g = torch.Generator().manual_seed(2)
    ps, layers, heads, d, slots = 16, 2, 8, 128, 512 * 16
    kvc = _kvcache(dev, layers, slots, heads, d, torch.float16, g)
    for kb, vb in zip(kvc.k_buffer, kvc.v_buffer):
        kb.fill_(1)
        vb.fill_(1)
    tier = HostTier.build(kvc, page_size=ps, total_kv_heads=heads, tp_size=1, tp_rank=0, capacity_pages=512,
                          name=None)  # fmt: skip
    cuda = dev.type == "cuda"
    pages = torch.arange(0, 256, dtype=torch.int64)
    hashes = [i.to_bytes(16, "little") for i in range(len(pages))]
    fwd = torch.cuda.Stream(device=dev) if cuda else None
    side = torch.cuda.Stream(device=dev) if cuda else None
    if cuda:
        torch.cuda.synchronize()
        with torch.cuda.stream(fwd):
            torch.cuda._sleep(sleep_cycles)
            for kb, vb in zip(kvc.k_buffer, kvc.v_buffer):
                kb[: len(pages) * ps].fill_(7)
                vb[: len(pages) * ps].fill_(7)
        ready = torch.cuda.Event()
        ready.record(fwd)
    else:
        for kb, vb in zip(kvc.k_buffer, kvc.v_buffer):
            kb[: len(pages) * ps].fill_(7)
            vb[: len(pages) * ps].fill_(7)
        ready = None
    ev = None
    if use_event and cuda:  # as T1Tier._ready_event: the forward stream's event and the current one's
        cur = torch.cuda.Event()
        cur.record(torch.cuda.current_stream())
        ev = (ready, cur)
    t0 = time.perf_counter()
    if via_queue:

        def write(job) -> None:  # integration/t1.py make_store_queue's write, as the server runs it
            pg = torch.tensor(job.pages, dtype=torch.int64)
            rdy, kind = job.ctx
            if side is None:
                tier.demote(pg, job.hashes, job.tenant, kind=kind)
                return
            with torch.cuda.stream(side):
                tier.demote(pg, job.hashes, job.tenant, ready=rdy, kind=kind)

        q = StoreQueue(1024, write, threaded=True)
        for i in range(0, len(pages), 32):  # one job per node of 32 pages
            q.offer(pages[i : i + 32].tolist(), hashes[i : i + 32], 64.0, ctx=(ev, THROUGH))
        deadline = time.monotonic() + 60
        while q.pending and time.monotonic() < deadline:  # the worker thread writes them
            time.sleep(0.001)
        q.close()
    elif cuda:
        with torch.cuda.stream(side):
            tier.demote(pages, hashes, ready=ev)
    else:
        tier.demote(pages, hashes, ready=None)
    secs = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize()
    slots = tier.pool.slots_for(hashes, touch=False) if all(tier.pool.contains(h) for h in hashes) else []
    got = tier.pool.data[:, :, :, slots] if slots else None
    stale = int((got != 7).sum()) if got is not None else -1
    return {"pages": len(pages), "stored": len(slots), "stale_elements": stale, "store_seconds": round(secs, 4)}


_WARM_SCRIPT = r"""
import json, sys, time, torch
sys.path.insert(0, sys.argv[1])
import bench.gpu_correctness  # noqa: F401  (the kernels' import fallback)
from types import SimpleNamespace
from sglang_tiered.tier.host_tier import HostTier
kvc = SimpleNamespace(k_buffer=[torch.randn(64 * 16, 8, 128, device="cuda").half() for _ in range(4)],
                      v_buffer=[torch.randn(64 * 16, 8, 128, device="cuda").half() for _ in range(4)])
t0 = time.perf_counter()
tier = HostTier.build(kvc, page_size=16, total_kv_heads=8, tp_size=1, tp_rank=0, capacity_pages=32, name=None)
build_s = time.perf_counter() - t0
t0 = time.perf_counter()
n = tier.demote(torch.tensor([3, 4]), [b"a" * 16, b"b" * 16])
demote_s = time.perf_counter() - t0
t0 = time.perf_counter()
ok = tier.load([b"a" * 16, b"b" * 16], torch.tensor([7, 8], device="cuda"))
load_s = time.perf_counter() - t0
same = ok and all(torch.equal(k[7 * 16 : 9 * 16], k[3 * 16 : 5 * 16]) for k in kvc.k_buffer + kvc.v_buffer)
print(json.dumps({"build_ms": round(build_s * 1e3, 1), "first_demote_ms": round(demote_s * 1e3, 2),
                  "first_load_ms": round(load_s * 1e3, 2), "ok": bool(same and n == 2)}))
"""


def check_warm_up(dev, dry: bool) -> dict:
    """HostTier.build compiles the page movers (empty Triton cache, fresh process): the first
    transfers after it must not pay the compile (it took 1.25 s before the warm-up)."""
    if dev.type != "cuda":
        return {"ok": True, "skipped": "no CUDA"}
    import subprocess

    with tempfile.TemporaryDirectory() as cache_dir:
        env = dict(os.environ, TRITON_CACHE_DIR=cache_dir)
        out = subprocess.run([sys.executable, "-c", _WARM_SCRIPT, str(ROOT)], env=env, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
    try:
        res = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"ok": False, "error": (out.stdout + out.stderr)[-800:]}
    res["ok"] = bool(res.get("ok")) and res["first_demote_ms"] < 100 and res["first_load_ms"] < 100
    return res


def check_fencing(dev, dry: bool) -> dict:
    cycles = 0 if dev.type != "cuda" else 200_000_000  # about 0.1 s at the H200's clock
    out = {}
    ok = True
    for via_queue in (False, True):
        tag = "store_queue" if via_queue else "side_stream"
        try:
            good = _fence_case(dev, True, via_queue, cycles)
            good["ok"] = good["stored"] == good["pages"] and good["stale_elements"] == 0
            ok = ok and good["ok"]
            out[f"{tag}_with_event"] = good
            if dev.type == "cuda":  # negative control: the same copy not ordered after the writes
                bad = _fence_case(dev, False, via_queue, cycles)
                bad["race_observed"] = bad["stale_elements"] > 0
                out[f"{tag}_without_event (control)"] = bad
        except Exception:  # noqa: BLE001
            out[tag] = {"ok": False, "error": traceback.format_exc()[-800:]}
            ok = False
    return {"ok": ok, **out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="on CPU: the same checks, torch path")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    dev = torch.device("cuda" if cuda else "cpu")
    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = "none"
    res = {"meta": {"gpu": torch.cuda.get_device_name(0) if cuda else "none (dry run)", "torch": torch.__version__,
                    "triton": tv, "machine": platform.machine(), "python": platform.python_version(),
                    "git_sha": git_sha()}}  # fmt: skip
    checks = (("kernels", check_kernels), ("all_planes", check_all_planes), ("host_tier", check_host_tier),
              ("fencing", check_fencing), ("warm_up", check_warm_up))  # fmt: skip
    for name, fn in checks:
        t0 = time.perf_counter()
        try:
            res[name] = fn(dev, args.dry_run)
        except Exception:  # noqa: BLE001
            res[name] = {"ok": False, "error": traceback.format_exc()[-1000:]}
        res[name]["seconds"] = round(time.perf_counter() - t0, 2)
        print(name, json.dumps(res[name], default=str)[:1500], flush=True)
    ok = all(res[k]["ok"] for k, _ in checks)
    res["ok"] = ok
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    print("ok" if ok else "FAILED", res["meta"]["gpu"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
