"""Prefix-aware extend attention for SGLang's ``torch_native`` backend (opt-in:
``SGLANG_TIERED_PREFIX_ATTENTION=on``).

Why: SGLang 0.5.23's ``TorchNativeAttnBackend._run_sdpa_forward_extend``
(sglang/srt/layers/attention/torch_native_backend.py:61-174) pads every request's new query rows
to the *whole* sequence (``per_req_query_redudant``, :128-134) and runs causal SDPA over
``seq_len x seq_len``, then keeps the new rows. A request whose 2,048-token prefix is already
cached (on the device or promoted from T1) therefore still pays the full quadratic attention of a
recompute: on the CPU server (where ``torch_native`` is the attention backend) a device hit of a
2k prefix measured 0.52x the TTFT of recomputing it (bench/results/demo.json, tiny 16-layer
model), so the cache saves prefill FLOPs in the MLPs but almost no time.

What: the same backend with one method replaced. A request with a cached prefix computes SDPA
for its new rows only, against the whole key/value sequence, with the causal mask shifted by the
prefix (row ``i`` sees keys ``<= prefix + i``): ``new x seq_len`` instead of ``seq_len^2``. A
request without a prefix, a sliding window, or an encoder takes SGLang's own code unchanged.

Exactness: the new rows are the same function of the same cached KV; the result equals the
stock computation up to floating-point summation order (PyTorch's CPU flash kernel blocks the
query differently for a different row count: bitwise equal in most shapes, else within a few
ulps, tests/test_prefix_attention.py). That is why it is opt-in: SGLang's own GPU backends
differ between extend and prefill in the same way, but our differential tests demand bitwise
equal greedy outputs from the stock backend.

It is installed through SGLang's attention-backend registry
(``register_attention_backend``, sglang/srt/layers/attention/attention_registry.py:47-50), under
the name ``torch_native`` itself, so every check SGLang makes on that name (CUDA graphs off,
no Triton dispatch) still holds.
"""

from __future__ import annotations

import logging

import torch
from torch.nn.functional import scaled_dot_product_attention

logger = logging.getLogger(__name__)

_INSTALLED = False


def prefix_rows_attention(query, key, value, prefix: int, scaling=None, enable_gqa: bool = False):
    """Causal attention of ``query`` ([heads, new, dim], the rows at positions ``prefix ..
    prefix+new-1``) over ``key``/``value`` ([kv_heads, prefix+new, dim]): [heads, new, dim]."""
    new, total = query.shape[-2], key.shape[-2]
    if total != prefix + new:
        raise ValueError(f"key length {total} != prefix {prefix} + new rows {new}")
    mask = torch.ones((new, total), dtype=torch.bool, device=query.device).tril_(diagonal=prefix)
    return scaled_dot_product_attention(
        query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0),
        attn_mask=mask, scale=scaling, enable_gqa=enable_gqa,
    ).squeeze(0)  # fmt: skip


def _backend_class():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    class PrefixRowsTorchNativeAttnBackend(TorchNativeAttnBackend):
        """SGLang's torch_native backend; extend computes only the new rows of a request with a
        cached prefix (module docstring)."""

        def _run_sdpa_forward_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                                     seq_lens, extend_prefix_lens, extend_seq_lens, encoder_lens=None, scaling=None,
                                     enable_gqa=False, causal=False, is_cross_attn=False, sliding_window_size=None):  # fmt: skip
            stock = (not causal or encoder_lens is not None or is_cross_attn
                     or (sliding_window_size is not None and sliding_window_size > -1)
                     or not bool((extend_prefix_lens > 0).any()))  # fmt: skip
            if stock:
                return super()._run_sdpa_forward_extend(
                    query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_prefix_lens,
                    extend_seq_lens, encoder_lens=encoder_lens, scaling=scaling, enable_gqa=enable_gqa,
                    causal=causal, is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size,
                )  # fmt: skip
            q_all = query.movedim(0, query.dim() - 2)  # [heads, tokens, dim]
            prefixes, news, lens = extend_prefix_lens.tolist(), extend_seq_lens.tolist(), seq_lens.tolist()
            start_q = 0
            for i, (prefix, new, total) in enumerate(zip(prefixes, news, lens)):
                end_q = start_q + new
                tokens = req_to_token[req_pool_indices[i], :total]
                k = k_cache[tokens].movedim(0, query.dim() - 2)
                v = v_cache[tokens].movedim(0, query.dim() - 2)
                q = q_all[:, start_q:end_q, :]
                if not (q.dtype == k.dtype == v.dtype):
                    k, v = k.to(q.dtype), v.to(q.dtype)
                if prefix == 0:  # SGLang's own computation (bitwise what a recompute does)
                    out = scaled_dot_product_attention(
                        q.contiguous().unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                        enable_gqa=enable_gqa, scale=scaling, is_causal=True,
                    ).squeeze(0)  # fmt: skip
                else:
                    out = prefix_rows_attention(q, k, v, prefix, scaling=scaling, enable_gqa=enable_gqa)
                output[start_q:end_q, :, :] = out.movedim(query.dim() - 2, 0)
                start_q = end_q
            return output

    return PrefixRowsTorchNativeAttnBackend


def install() -> None:
    """Register the prefix-aware backend under ``torch_native`` (once per process)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from sglang.srt.layers.attention import attention_registry
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    from sglang_tiered.integration.protocol import BACKEND_NAME

    cls = _backend_class()
    sglangs = attention_registry.ATTENTION_BACKENDS.get("torch_native")

    @register_attention_backend("torch_native")
    def create_prefix_rows_torch_native_backend(runner):
        sa = getattr(runner, "server_args", None)
        if sglangs is not None and getattr(sa, "radix_cache_backend", None) != BACKEND_NAME:
            return sglangs(runner)  # a stock server keeps SGLang's own (review, session 23)
        # logged here, not at install: the plugin loads before SGLang configures its logging
        logger.info("sglang-tiered: torch_native extend attention computes only new rows "
                    "(SGLANG_TIERED_PREFIX_ATTENTION=on)")  # fmt: skip
        return cls(runner)

    _INSTALLED = True
