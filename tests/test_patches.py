"""Each patch in patches/ must still apply to the pinned upstream, and do what it claims."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_torchvision_guard_is_applied_and_torchvision_imports():
    out = subprocess.run(
        [sys.executable, str(ROOT / "patches" / "torchvision_meta_guard.py"), "--check"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "already applied" in out.stdout
    import torchvision  # noqa: F401  (fails without the guard on a CPU torch build)


def test_torchvision_guard_still_patches_pristine_upstream_text():
    sys.path.insert(0, str(ROOT / "patches"))
    try:
        import torchvision_meta_guard as guard
    finally:
        sys.path.pop(0)
    pristine = (
        "import torch\n\nfrom x import y\n\n\n"
        '@torch.library.register_fake("torchvision::nms")\ndef meta_nms(): pass\n\n\n'
        '@torch.library.register_fake("torchvision::qnms")\ndef meta_qnms(): pass\n'
    )
    patched = guard.patched_text(pristine)
    assert patched.count("_sglang_tiered_guarded_register_fake(") == 3
    assert guard.patched_text(patched) == patched  # idempotent


def test_sgl_kernel_is_our_shim():
    import sgl_kernel

    assert getattr(sgl_kernel, "IS_SGLANG_TIERED_SHIM", False)


def test_assign_req_to_token_pool_cpu_matches_reference():
    from sgl_kernel import assign_req_to_token_pool_cpu

    req_to_token = torch.zeros((4, 16), dtype=torch.int32)
    rows = torch.tensor([2, 0, 3])
    start = torch.tensor([1, 0, 5])
    end = torch.tensor([4, 2, 5])
    out = torch.arange(100, 105, dtype=torch.int64)
    assign_req_to_token_pool_cpu(rows, req_to_token, start, end, out, 16)
    assert req_to_token[2, 1:4].tolist() == [100, 101, 102]
    assert req_to_token[0, 0:2].tolist() == [103, 104]
    assert req_to_token[3].sum() == 0 and req_to_token[1].sum() == 0


def test_copy_all_layer_kv_cache_cpu_copies_rows_in_every_buffer():
    from sgl_kernel import copy_all_layer_kv_cache_cpu

    bufs = [torch.arange(8 * 6, dtype=torch.float32).view(8, 6).clone() for _ in range(3)]
    before = [b.clone() for b in bufs]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs], dtype=torch.int64)
    tgt, src = torch.tensor([1, 2, 7]), torch.tensor([2, 5, 1])  # overlapping: 2 is src and tgt
    copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, b0 in zip(bufs, before):
        expect = b0.clone()
        expect[tgt] = b0[src]
        assert torch.equal(b, expect)


def test_shim_unknown_op_fails_loudly_when_called():
    import pytest
    import sgl_kernel

    fn = sgl_kernel.some_cuda_only_op
    with pytest.raises(NotImplementedError, match="some_cuda_only_op"):
        fn()
