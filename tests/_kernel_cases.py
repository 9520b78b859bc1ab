"""Kernel cases run under TRITON_INTERPRET=1 (see test_kernels.py): Triton vs torch ref, bit-exact."""

import itertools
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from sglang_tiered.kernels.kv_pages import gather_pages, scatter_pages  # noqa: E402

g = torch.Generator().manual_seed(0)


def rand(shape, dtype):
    if dtype == torch.uint8:  # fp8 pools are stored as uint8
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return torch.randn(shape, generator=g).to(dtype)


n = 0
for dtype, (ps, hr, htot, d), ids in itertools.product(
    [torch.float16, torch.bfloat16, torch.float32, torch.uint8],
    [(16, 2, 4, 32), (3, 1, 3, 5), (4, 3, 3, 7)],
    [[], [1], [5, 2, 7], [2, 2, 3]],
):
    pool_pages_n, host_pages_n = 9, 11
    pool = rand(((pool_pages_n + 1) * ps, hr, d), dtype)
    host = rand((htot, host_pages_n, ps, d), dtype)
    pp = torch.tensor(ids, dtype=torch.int64)
    hs = torch.tensor(list(range(len(ids)))[::-1], dtype=torch.int64) + 1
    off = htot - hr
    a, b = host.clone(), host.clone()
    scatter_pages(pool, pp, a, hs, off, ps)
    scatter_pages(pool, pp, b, hs, off, ps, force_ref=True)
    assert torch.equal(a, b), ("scatter", dtype, ps, hr, htot, d, ids)
    if len(set(ids)) == len(ids):
        p1, p2 = pool.clone(), pool.clone()
        gather_pages(a, hs, p1, pp, off, ps)
        gather_pages(a, hs, p2, pp, off, ps, force_ref=True)
        assert torch.equal(p1, p2), ("gather", dtype, ps, hr, htot, d, ids)
        # round trip: the gathered pages are exactly the scattered ones
        for i, p in enumerate(ids):
            assert torch.equal(p1[p * ps : (p + 1) * ps], pool[p * ps : (p + 1) * ps])
    n += 1
print(f"ok {n} cases")

# every (K|V, layer) plane in one launch (HostTier's path): against the per-plane reference
from sglang_tiered.kernels.kv_pages import PoolPlanes, move_pages_all  # noqa: E402

m = 0
for dtype, (ps, hr, htot, d, L) in itertools.product(
    [torch.float16, torch.bfloat16, torch.float32, torch.uint8], [(16, 2, 4, 32, 3), (3, 1, 3, 5, 2), (1, 4, 4, 8, 1)]
):
    k = [rand((20 * ps, hr, d), dtype) for _ in range(L)]
    v = [rand((20 * ps, hr, d), dtype) for _ in range(L)]
    host = rand((2, L, htot, 9, ps, d), dtype)
    want = host.clone()
    pp, hs, off = torch.tensor([5, 2, 7, 11]), torch.tensor([8, 0, 3, 4]), htot - hr
    move_pages_all(PoolPlanes(k, v), host, pp, hs, off, ps, to_host=True)
    move_pages_all(PoolPlanes(k, v), want, pp, hs, off, ps, to_host=True, force_ref=True)
    assert torch.equal(host, want), ("scatter all", dtype, ps)
    dst = torch.tensor([1, 3, 0, 19])
    k2, v2 = [t.clone() for t in k], [t.clone() for t in v]
    k3, v3 = [t.clone() for t in k], [t.clone() for t in v]
    move_pages_all(PoolPlanes(k2, v2), host, dst, hs, off, ps, to_host=False)
    move_pages_all(PoolPlanes(k3, v3), host, dst, hs, off, ps, to_host=False, force_ref=True)
    assert all(torch.equal(a, b) for a, b in zip(k2 + v2, k3 + v3)), ("gather all", dtype, ps)
    for a, b in zip(k2 + v2, k + v):  # the round trip
        for s_, t_ in zip(pp.tolist(), dst.tolist()):
            assert torch.equal(a[t_ * ps : (t_ + 1) * ps], b[s_ * ps : (s_ + 1) * ps])
    m += 1
print(f"ok {m} all-plane cases")
