"""Findings of the session-22 review (cache identity and T1's CUDA path), each with the test that
failed before its fix."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from sglang_tiered.core.keys import client_extra_key
from sglang_tiered.integration.http import rewrite_body

HEX32 = st.text("0123456789abcdef", min_size=32, max_size=32)


@given(base=st.text(min_size=1), mine=st.one_of(st.just(""), st.text(min_size=1)), lora=HEX32)
def test_a_client_extra_key_never_equals_a_lora_requests_key(base, mine, lora):
    """SGLang's Req: extra_key = (extra_key or "") + lora_id. A base-model request with
    extra_key = an adapter's id (computable from /v1/models) shared the adapter's namespace and
    wrote base-model KV into it; the client's key is now rewritten so that cannot happen."""
    adapter_request = (client_extra_key(mine) if mine else "") + lora
    assert client_extra_key(base) != adapter_request


@given(a=st.text(min_size=1), b=st.text(min_size=1))
def test_client_extra_keys_stay_apart(a, b):
    assert (client_extra_key(a) == client_extra_key(b)) == (a == b)


def test_the_middleware_rewrites_extra_key_on_every_route_that_carries_it():
    lora = "0" * 32
    for path in ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/invocations"):
        out = json.loads(rewrite_body(json.dumps({"text": "hi", "extra_key": lora}).encode(), path, None))
        assert out["extra_key"] == f"client:{lora}:"
    out = json.loads(rewrite_body(json.dumps({"text": ["a", "b"], "extra_key": ["k", ""]}).encode(), "/generate", None))
    assert out["extra_key"] == ["client:k:", ""]
    raw = json.dumps({"text": "hi", "extra_key": ""}).encode()
    assert rewrite_body(raw, "/generate", None) == raw  # empty: SGLang's None, left alone
    raw = json.dumps({"text": "hi", "extra_key": 5}).encode()
    assert rewrite_body(raw, "/generate", None) == raw  # not a string: SGLang refuses it
