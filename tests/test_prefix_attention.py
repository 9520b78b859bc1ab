"""The prefix-aware torch_native extend (integration/prefix_attention.py) against SGLang's own
``TorchNativeAttnBackend._run_sdpa_forward_extend``, on one mixed batch at a time: requests
without a prefix are bitwise SGLang's, requests with one agree to float rounding (the CPU SDPA
kernel blocks a different number of query rows differently), in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_tiered.integration.prefix_attention import _backend_class, prefix_rows_attention


def _batch(reqs, heads=8, kv_heads=4, dim=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    total_kv = sum(p + n for p, n in reqs) + 8
    k_cache = torch.randn(total_kv, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(total_kv, kv_heads, dim, generator=g).to(dtype)
    perm = torch.randperm(total_kv, generator=g)  # each request's tokens scattered over the pool
    max_len = max(p + n for p, n in reqs)
    req_to_token = torch.zeros(len(reqs), max_len, dtype=torch.int64)
    at = 0
    for i, (p, n) in enumerate(reqs):
        req_to_token[i, : p + n] = perm[at : at + p + n]
        at += p + n
    n_q = sum(n for _, n in reqs)
    query = torch.randn(n_q, heads, dim, generator=g).to(dtype)
    args = dict(
        k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token,
        req_pool_indices=torch.arange(len(reqs)), seq_lens=torch.tensor([p + n for p, n in reqs]),
        extend_prefix_lens=torch.tensor([p for p, _ in reqs]), extend_seq_lens=torch.tensor([n for _, n in reqs]),
        scaling=dim**-0.5, enable_gqa=heads != kv_heads, causal=True,
    )  # fmt: skip
    return query, args


def _run(method_owner, query, args):
    out = torch.empty_like(query)
    backend = object.__new__(method_owner)  # the extend uses no backend state on this path
    return method_owner._run_sdpa_forward_extend(backend, query, out, **args)


def _stock_and_ours(reqs, dtype, seed=0):
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    query, args = _batch(reqs, dtype=dtype, seed=seed)
    return _run(TorchNativeAttnBackend, query, args), _run(_backend_class(), query, args)


def _rows(reqs, i):
    start = sum(n for _, n in reqs[:i])
    return slice(start, start + reqs[i][1])


@settings(max_examples=40, deadline=None)
@given(reqs=st.lists(st.tuples(st.integers(0, 300), st.integers(1, 40)), min_size=1, max_size=4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))  # fmt: skip
def test_extend_matches_sglang(reqs, dtype, seed):
    stock, ours = _stock_and_ours(reqs, dtype, seed)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (prefix, _) in enumerate(reqs):
        a, b = stock[_rows(reqs, i)].float(), ours[_rows(reqs, i)].float()
        if prefix == 0 or all(p == 0 for p, _ in reqs):
            assert torch.equal(a, b), "a request without a prefix must be SGLang's computation, bitwise"
        else:
            torch.testing.assert_close(b, a, atol=tol, rtol=tol)


def test_long_prefix_rows_equal_full_causal_rows():
    """2,048 cached tokens + 16 new, as the demo's long-prefix scenario: same rows as the padded
    full causal attention."""
    stock, ours = _stock_and_ours([(2048, 16)], torch.float32)
    torch.testing.assert_close(ours, stock, atol=1e-6, rtol=1e-5)


def test_mask_shape_is_checked():
    q, kv = torch.zeros(2, 3, 4), torch.zeros(2, 10, 4)
    with pytest.raises(ValueError, match="prefix"):
        prefix_rows_attention(q, kv, kv, prefix=5)
