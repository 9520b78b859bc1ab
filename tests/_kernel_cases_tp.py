"""Kernel cases run under TRITON_INTERPRET=1 (see test_kernels.py; review, session 40): the
canonical T1 layout is the same bytes whichever TP degree wrote it. Page sizes 1, 16 and 64;
TP 1, 2, 4 over 4 KV heads and TP 3 over 6; every dtype a KV pool stores, fp8 as itself and as
uint8; each rank's planes strided views of wider tensors (rows not packed); page ids out of
order, the pool's last page, a repeated source page. The Triton path and the torch reference
both equal a plain per-element copy, scattered by every rank of a degree into one host pool,
and gathered back into each rank's heads."""

import itertools
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from sglang_tiered.kernels.kv_pages import PoolPlanes, move_pages_all  # noqa: E402
from sglang_tiered.tier.host_pool import heads_for_rank  # noqa: E402

g = torch.Generator().manual_seed(0)
L, D, NPAGES, SLOTS = 2, 4, 6, 5


def rand(shape, dtype):
    if dtype.itemsize == 1:  # uint8 and fp8: any byte
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def same(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


n = 0
for dtype, ps, (htot, tp) in itertools.product(
    [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.float8_e4m3fn],
    [1, 16, 64],
    [(4, 1), (4, 2), (4, 4), (6, 3)],
):
    full = [rand((NPAGES * ps, htot, D), dtype) for _ in range(2 * L)]  # what TP 1 holds
    pages, slots = [NPAGES - 1, 2, 2, 0], [3, 0, 4, 1]  # out of order, the last page, page 2 twice
    want = rand((2, L, htot, SLOTS, ps, D), dtype)
    for i, (p, s) in enumerate(zip(pages, slots)):  # the plain copy: canonical [kv][layer][head][slot][t][d]
        for kv, layer in itertools.product(range(2), range(L)):
            want[kv, layer, :, s] = full[kv * L + layer][p * ps : (p + 1) * ps].transpose(0, 1)
    pp, hs = torch.tensor(pages), torch.tensor(slots)
    for force in (False, True):
        host = want.clone()
        host[:, :, :, slots] = rand(host[:, :, :, slots].shape, dtype)  # garbage where the pages go
        ranks = []
        for rank in range(tp):
            heads = heads_for_rank(htot, tp, rank)
            wide = [rand((NPAGES * ps, len(heads) + 2, D), dtype) for _ in range(2 * L)]
            for w, f in zip(wide, full):
                w[:, 1 : 1 + len(heads)] = f[:, heads.start : heads.stop]
            planes = [w[:, 1 : 1 + len(heads)] for w in wide]  # strided: rows are not packed
            assert not planes[0].is_contiguous()
            ranks.append((heads, planes))
            move_pages_all(PoolPlanes(planes[:L], planes[L:]), host, pp, hs, heads.start, ps, to_host=True,
                           force_ref=force)  # fmt: skip
        assert same(host, want), ("scatter", dtype, ps, htot, tp, force)
        for heads, planes in ranks:  # ...and back into each rank's heads, at other device pages
            back = [torch.zeros_like(t) for t in planes]
            dst = torch.tensor([0, 5, 3, 1])
            move_pages_all(PoolPlanes(back[:L], back[L:]), host, dst, hs, heads.start, ps, to_host=False,
                           force_ref=force)  # fmt: skip
            for b, t in zip(back, planes):
                for p, q in zip(pages, dst.tolist()):
                    assert same(b[q * ps : (q + 1) * ps], t[p * ps : (p + 1) * ps]), ("gather", dtype, ps, tp, force)
    n += 1
print(f"ok {n} tp cases")
