"""Pure-torch CPU stand-in for ``sgl_kernel`` (SGLang 0.5.23, CPU mode only).

Why: with ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports two ops from ``sgl_kernel``:

* ``assign_req_to_token_pool_cpu``  (sglang/srt/mem_cache/allocation.py:45-46, called at :746)
* ``copy_all_layer_kv_cache_cpu``   (sglang/kernels/ops/kvcache/cache_move.py:9-10, called at :191)

PyPI's ``sglang-kernel==0.4.10`` is CUDA-only (``ImportError: libnvrtc.so.13``), and the CPU build
is not on PyPI. This module implements those two ops in plain torch with the same semantics as the
Triton kernels they replace. Any other attribute raises ``NotImplementedError`` when *called*, so an
import that SGLang never uses on CPU does not break start-up, and one it does use fails loudly.
"""

from __future__ import annotations

import ctypes

import torch

__version__ = "0.0.0+cpu-shim"
IS_SGLANG_TIERED_SHIM = True


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = the i-th run of out_cache_loc."""
    del pool_len  # row length is implied by req_to_token's shape
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def _byte_view(ptr: int, nbytes: int) -> torch.Tensor:
    buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """For every buffer b (a raw pointer with row stride strides[b] bytes): row tgt[i] = row src[i].

    Reads all source rows before writing, like the tiled Triton kernel, so overlaps are safe.
    """
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.to(torch.int64)
    src = src_loc.to(torch.int64)
    rows = int(max(tgt.max().item(), src.max().item())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        view = _byte_view(int(ptr), rows * int(stride)).view(rows, int(stride))
        view[tgt] = view[src].clone()


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def _missing(*_args, **_kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not provided by the sglang-tiered CPU shim "
            "(only assign_req_to_token_pool_cpu and copy_all_layer_kv_cache_cpu are)."
        )

    _missing.__name__ = name
    return _missing
