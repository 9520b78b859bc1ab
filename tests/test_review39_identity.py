"""The cache identity names the attention code that computed the KV (session 39).

``--prefill-attention-backend`` and ``--decode-attention-backend`` override
``--attention-backend`` for extend (the prompt's KV) and decode (the output's, which later
requests reuse). The identity held ``--attention-backend`` only: two servers computing KV with
different backends shared it through T2 or a named T1. The prefix-aware extend
(``SGLANG_TIERED_PREFIX_ATTENTION=on``), equal to the stock one only up to summation order, is
named too."""

from __future__ import annotations

from sglang_tiered.integration.identity import cache_key_from_context
from tests.test_identity_hardening import _ctx
from tests.test_review37 import _model


def test_prefill_and_decode_backends_are_in_the_identity(tmp_path, monkeypatch):
    model = _model(tmp_path, monkeypatch)
    plain = cache_key_from_context(_ctx(model))
    same = [cache_key_from_context(_ctx(model, prefill_attention_backend=None, decode_attention_backend=None)),
            cache_key_from_context(_ctx(model, prefill_attention_backend="fa3", decode_attention_backend="fa3"))]
    assert {k.seed() for k in same} == {plain.seed()}  # the same code: the same identity as before
    others = [cache_key_from_context(_ctx(model, prefill_attention_backend="flashinfer")),
              cache_key_from_context(_ctx(model, decode_attention_backend="flashinfer")),
              cache_key_from_context(_ctx(model, prefill_attention_backend="flashinfer",
                                          decode_attention_backend="flashinfer")),
              cache_key_from_context(_ctx(model), prefix_attention=True)]  # fmt: skip
    seeds = {k.seed() for k in others}
    assert len(seeds) == len(others) and plain.seed() not in seeds
    assert others[0].attn_impl == "fa3+prefill:flashinfer"
