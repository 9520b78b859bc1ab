"""Move whole KV pages between SGLang's device pool and the canonical T1 layout.

Per (K|V, layer), shapes are:
  device pool  ``pool[slots, H_rank, D]``            (SGLang MHATokenToKVPool NHD layout; a page's
                                                      ``page_size`` slots are contiguous)
  canonical    ``host[H_total, P, page_size, D]``    (one (kv, layer) plane of the host pool)

``scatter_pages``: host[head_offset + h, host_slots[i], t] = pool[pool_pages[i]*ps + t, h]
``gather_pages``:  pool[pool_pages[i]*ps + t, h] = host[head_offset + h, host_slots[i], t]

Each has a plain-torch ``*_ref`` here and a Triton kernel used when the device pool is on CUDA and
the canonical plane is either on CUDA or in pinned (page-locked) host memory: with unified
addressing a pinned host pointer is valid on the device, so the kernel reads and writes T1
directly (zero-copy, as HiCache's "kernel" IO backend does), with the page ids on the device.
SGLang disables Triton on CPU, so the server's CPU path is the torch one. Launchers assert dtype, shape, stride
and device contracts, never call ``.contiguous()`` on a pool, and use int64 offsets. A batch of
pages moves in one launch per plane, or with ``move_pages_all`` every plane of a transfer (all
layers, K and V) in one launch: whole runs, never page by page.
"""

from __future__ import annotations

import torch

try:  # Triton is optional (CPU-only installs may lack it)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def _check(pool: torch.Tensor, host: torch.Tensor, pool_pages: torch.Tensor, host_slots: torch.Tensor,
           head_offset: int, page_size: int) -> None:  # fmt: skip
    if pool.dtype != host.dtype:
        raise TypeError(f"dtype mismatch: pool {pool.dtype} vs host {host.dtype}")
    if pool.dim() != 3 or host.dim() != 4:
        raise ValueError(f"expected pool [slots, H, D] and host [H, P, ps, D], got {tuple(pool.shape)} and {tuple(host.shape)}")
    if pool.stride(2) != 1 or pool.stride(1) != pool.shape[2] and pool.shape[1] > 1:
        raise ValueError("pool rows must be contiguous [H, D] blocks (no .contiguous() copy is made)")
    if host.stride(3) != 1 or host.stride(2) != host.shape[3]:
        raise ValueError("host pages must be contiguous [page_size, D] blocks")
    if pool.shape[2] != host.shape[3]:
        raise ValueError(f"head_dim mismatch: {pool.shape[2]} vs {host.shape[3]}")
    if host.shape[2] != page_size:
        raise ValueError(f"host page_size {host.shape[2]} != {page_size}")
    if not 0 <= head_offset or head_offset + pool.shape[1] > host.shape[0]:
        raise ValueError(f"heads [{head_offset}, {head_offset + pool.shape[1]}) outside host's {host.shape[0]}")
    for name, ids in (("pool_pages", pool_pages), ("host_slots", host_slots)):
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise TypeError(f"{name} must be a 1-D int64 tensor")
    if pool_pages.numel() != host_slots.numel():
        raise ValueError("pool_pages and host_slots differ in length")
    zero_copy = pool.is_cuda and not host.is_cuda and host.is_pinned() and host_slots.is_cuda
    if not (pool.device == pool_pages.device and (host.device == host_slots.device or zero_copy)):
        raise ValueError("ids must live on the device of the tensor they index (host ids on the "
                         "device for a pinned host plane)")


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as uint8 (same bytes): torch has no CPU ``index_copy_`` or ``index_put_`` for
    them, so the reference failed every fp8 transfer the Triton path makes (review, session 40)."""
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


def scatter_pages_ref(pool, pool_pages, host, host_slots, head_offset: int, page_size: int) -> None:
    if pool_pages.numel() == 0:
        return
    pool, host = _as_bytes(pool), _as_bytes(host)
    hr = pool.shape[1]
    tok = (pool_pages.to(pool.device)[:, None] * page_size + torch.arange(page_size, device=pool.device)).reshape(-1)
    src = pool[tok].view(-1, page_size, hr, pool.shape[2]).permute(2, 0, 1, 3)  # [Hr, n, ps, D]
    host[head_offset : head_offset + hr].index_copy_(1, host_slots.to(host.device), src.to(host.device))


def gather_pages_ref(host, host_slots, pool, pool_pages, head_offset: int, page_size: int) -> None:
    if pool_pages.numel() == 0:
        return
    pool, host = _as_bytes(pool), _as_bytes(host)
    hr = pool.shape[1]
    src = host[head_offset : head_offset + hr].index_select(1, host_slots.to(host.device))  # [Hr, n, ps, D]
    rows = src.permute(1, 2, 0, 3).reshape(-1, hr, pool.shape[2]).to(pool.device)
    tok = (pool_pages.to(pool.device)[:, None] * page_size + torch.arange(page_size, device=pool.device)).reshape(-1)
    pool[tok] = rows


if triton is not None:

    @triton.jit
    def _page_copy_kernel(
        src_ptr, dst_ptr, src_pages_ptr, dst_pages_ptr,
        s_page, s_tok, s_head, d_page, d_tok, d_head, src_head0, dst_head0,
        PS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Copy one (page, head) tile of PS x D elements between two strided layouts."""
        i = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        sp = tl.load(src_pages_ptr + i).to(tl.int64)
        dp = tl.load(dst_pages_ptr + i).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        t = (offs // D).to(tl.int64)
        d = (offs % D).to(tl.int64)
        mask = offs < PS * D
        src = src_ptr + sp * s_page + t * s_tok + (src_head0 + h) * s_head + d
        dst = dst_ptr + dp * d_page + t * d_tok + (dst_head0 + h) * d_head + d
        tl.store(dst, tl.load(src, mask=mask), mask=mask)


if triton is not None:

    @triton.jit
    def _planes_copy_kernel(
        pool_table, host_ptr, pool_pages_ptr, host_slots_ptr,
        p_page, p_tok, p_head, h_plane, h_page, h_tok, h_head, head0,
        TO_HOST: tl.constexpr, PS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """One (page, head, plane) tile: every (K|V, layer) plane of a transfer in one launch. The
        device planes are separate tensors (``pool_table``: their addresses); the canonical planes
        are one tensor, ``plane`` elements apart."""
        i = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        pl = tl.program_id(2).to(tl.int64)
        pool_base = tl.load(pool_table + pl).to(host_ptr.dtype, bitcast=True)
        pp = tl.load(pool_pages_ptr + i).to(tl.int64)
        hs = tl.load(host_slots_ptr + i).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        t = (offs // D).to(tl.int64)
        d = (offs % D).to(tl.int64)
        mask = offs < PS * D
        p = pool_base + pp * p_page + t * p_tok + h * p_head + d
        q = host_ptr + pl * h_plane + hs * h_page + t * h_tok + (head0 + h) * h_head + d
        if TO_HOST:
            tl.store(q, tl.load(p, mask=mask), mask=mask)
        else:
            tl.store(p, tl.load(q, mask=mask), mask=mask)


def _launch(src, dst, src_pages, dst_pages, src_strides, dst_strides, src_head0, dst_head0, heads, ps, d):
    block = triton.next_power_of_2(ps * d)
    grid = (src_pages.numel(), heads)
    _page_copy_kernel[grid](src, dst, src_pages, dst_pages, *src_strides, *dst_strides,
                            src_head0, dst_head0, PS=ps, D=d, BLOCK=block)  # fmt: skip


def _use_triton(pool, host, host_ids=None) -> bool:
    import os

    if triton is None:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    if not pool.is_cuda:
        return False
    return host.is_cuda or (host.is_pinned() and host_ids is not None and host_ids.is_cuda)


def _pool_strides(pool, page_size: int) -> tuple[int, int, int]:
    """(page, token, head) element strides of the device pool: a page is ``page_size`` rows."""
    return page_size * pool.stride(0), pool.stride(0), pool.stride(1)


def _host_strides(host) -> tuple[int, int, int]:
    """(page, token, head) element strides of one canonical plane ``[H, P, ps, D]``."""
    return host.stride(1), host.stride(2), host.stride(0)


def pin_host_memory(t: torch.Tensor) -> bool:
    """Page-lock existing host memory (e.g. a shared-memory T1 mapping) with cudaHostRegister so
    copies and the zero-copy kernels can use it; False (and nothing changed) where that fails."""
    if not torch.cuda.is_available() or t.is_cuda or t.is_pinned():
        return t.is_pinned() if not t.is_cuda else False
    try:
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        return int(getattr(err, "value", err)) == 0 and t.is_pinned()
    except Exception:  # noqa: BLE001 - pinning is an optimisation
        return False


def unpin_host_memory(t: torch.Tensor) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    except Exception:  # noqa: BLE001
        pass


def _require_unique(ids: torch.Tensor, message: str) -> None:
    """The ids a copy writes to hold no duplicate (reads them back: on CUDA, a synchronisation)."""
    if len(set(ids.tolist())) != ids.numel():
        raise ValueError(message)


def scatter_pages(pool, pool_pages, host, host_slots, head_offset: int, page_size: int, *, force_ref=False,
                  unique_checked=False):  # fmt: skip
    """Device pool pages -> canonical host slots (see module doc). ``unique_checked``: the caller
    has checked that ``host_slots`` holds no duplicate (the check here reads the ids back: on CUDA,
    a synchronisation per call)."""
    _check(pool, host, pool_pages, host_slots, head_offset, page_size)
    if not unique_checked:
        _require_unique(host_slots, "duplicate host_slots: two pages would race for one slot")
    if pool_pages.numel() == 0:
        return
    if force_ref or not _use_triton(pool, host, host_slots):
        return scatter_pages_ref(pool, pool_pages, host, host_slots, head_offset, page_size)
    _launch(pool, host, pool_pages, host_slots, _pool_strides(pool, page_size), _host_strides(host),
            0, head_offset, pool.shape[1], page_size, pool.shape[2])  # fmt: skip


def gather_pages(host, host_slots, pool, pool_pages, head_offset: int, page_size: int, *, force_ref=False,
                 unique_checked=False):  # fmt: skip
    """Canonical host slots -> this rank's heads in the device pool (see module doc).
    ``unique_checked``: the caller has checked that ``pool_pages`` holds no duplicate."""
    _check(pool, host, pool_pages, host_slots, head_offset, page_size)
    if not unique_checked:
        _require_unique(pool_pages, "duplicate pool_pages: two host pages would race for one device page")
    if pool_pages.numel() == 0:
        return
    if force_ref or not _use_triton(pool, host, host_slots):
        return gather_pages_ref(host, host_slots, pool, pool_pages, head_offset, page_size)
    _launch(host, pool, host_slots, pool_pages, _host_strides(host), _pool_strides(pool, page_size),
            head_offset, 0, pool.shape[1], page_size, pool.shape[2])  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Every plane of a transfer in one launch (what T1 moves: all layers, K and V)

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class PoolPlanes:
    """A device KV pool's planes for one-launch transfers: SGLang's per-layer ``k_buffers`` and
    ``v_buffers`` (``[slots, H_rank, D]`` each, one dtype, shape and stride, one device), and
    ``table``, their addresses on that device in the canonical pool's ``[kv][layer]`` order (K
    planes, then V planes). SGLang allocates the buffers once, so the table is built once;
    ``current`` tells a caller when to build it again (new tensors or addresses)."""

    def __init__(self, k_buffers, v_buffers):
        planes = list(k_buffers) + list(v_buffers)
        if not k_buffers or len(k_buffers) != len(v_buffers):
            raise ValueError("expected as many K as V planes, at least one")
        p0 = planes[0]
        for t in planes:
            if t.dtype != p0.dtype or t.shape != p0.shape or t.stride() != p0.stride() or t.device != p0.device:
                raise ValueError("every plane must share dtype, shape, stride and device")
        self.k, self.v, self.first = list(k_buffers), list(v_buffers), p0
        self.layers = len(k_buffers)
        self.addresses = [t.data_ptr() for t in planes]
        self.table = torch.tensor(self.addresses, dtype=torch.int64, device=p0.device)

    def current(self, k_buffers, v_buffers) -> bool:
        """Whether these are still the planes the table holds (same tensors at the same addresses:
        a pool reallocated behind the table would be written through stale pointers)."""
        k, v = list(k_buffers), list(v_buffers)
        if len(k) != len(self.k) or len(v) != len(self.v):
            return False
        planes = k + v
        return (all(a is b for a, b in zip(planes, self.k + self.v))
                and [t.data_ptr() for t in planes] == self.addresses)  # fmt: skip


def _check_all(planes: PoolPlanes, host, pool_pages, host_slots, head_offset, page_size) -> None:
    if host.dim() != 6 or host.shape[0] != 2 or host.shape[1] != planes.layers:
        raise ValueError(f"expected a host pool [2, {planes.layers}, H, P, ps, D], got {tuple(host.shape)}")
    if host.stride(0) != planes.layers * host.stride(1):
        raise ValueError("the host pool's planes must be evenly spaced ([kv][layer] contiguous)")
    _check(planes.first, host[0, 0], pool_pages, host_slots, head_offset, page_size)


def move_pages_all(planes: PoolPlanes, host, pool_pages, host_slots, head_offset: int, page_size: int, *,
                   to_host: bool, force_ref=False, unique_checked=False) -> None:  # fmt: skip
    """``scatter_pages`` (``to_host``) or ``gather_pages`` for every (K|V, layer) plane: device
    ``planes`` <-> the canonical pool ``host[2, L, H, P, ps, D]``. One Triton launch for the whole
    transfer where the per-plane functions would use Triton (a launch and its Python costs once,
    not 2 x layers times); the per-plane path otherwise."""
    _check_all(planes, host, pool_pages, host_slots, head_offset, page_size)
    if not unique_checked:
        _require_unique(host_slots if to_host else pool_pages, "duplicate ids: two pages would race for one destination")
    if pool_pages.numel() == 0:
        return
    if force_ref or not _use_triton(planes.first, host, host_slots):
        for kv, bufs in enumerate((planes.k, planes.v)):
            for layer, buf in enumerate(bufs):
                if to_host:
                    scatter_pages(buf, pool_pages, host[kv, layer], host_slots, head_offset, page_size,
                                  force_ref=force_ref, unique_checked=True)  # fmt: skip
                else:
                    gather_pages(host[kv, layer], host_slots, buf, pool_pages, head_offset, page_size,
                                 force_ref=force_ref, unique_checked=True)  # fmt: skip
        return
    p0 = planes.first
    size = p0.element_size()
    hv = host.view(_INT_OF_SIZE[size])  # a copy moves bytes: fp8 and bf16 alike
    d = p0.shape[2]
    ps_, pt, ph = _pool_strides(p0, page_size)
    grid = (pool_pages.numel(), p0.shape[1], 2 * planes.layers)
    _planes_copy_kernel[grid](planes.table, hv, pool_pages, host_slots, ps_, pt, ph, host.stride(1),
                              host.stride(3), host.stride(4), host.stride(2), head_offset, TO_HOST=to_host,
                              PS=page_size, D=d, BLOCK=triton.next_power_of_2(page_size * d))  # fmt: skip
