"""Client-side cache-worthiness policy (seeds/004): defaults, signals, env knobs, hint folding."""

from __future__ import annotations

import pytest

from sglang_tiered.client import DEFAULTS, KVCacheLayeringPolicy, fold_kv_hint


def test_defaults_match_the_seed():
    assert DEFAULTS == {
        "KV_CACHE_LAYERING": True,
        "KV_CACHE_MIN_PREFIX_TOKENS": 1024,
        "KV_CACHE_MIN_CONTEXT_TOKENS": 2048,
        "KV_CACHE_MIN_HISTORY_TURNS": 1,
        "KV_CACHE_CHARS_PER_TOKEN": 4.0,
    }
    p = KVCacheLayeringPolicy()
    assert (p.min_prefix_tokens, p.min_context_tokens, p.min_history_turns, p.chars_per_token) == (1024, 2048, 1, 4.0)


def test_one_off_short_prompt_skips_save():
    d = KVCacheLayeringPolicy().decide(user_prompt="what time is it?")
    assert not d.cache_worthy and d.skip_save and d.score == 0
    assert "one-off" in d.reasons[0]


def test_long_prefix_signal():
    d = KVCacheLayeringPolicy().decide(system_prompt="x" * 4096, user_prompt="hi")  # 1024 tokens
    assert d.cache_worthy and not d.skip_save and d.signals["long_prefix"]
    d = KVCacheLayeringPolicy().decide(system_prompt="x" * 4092, user_prompt="hi")  # 1023 tokens
    assert not d.signals["long_prefix"]


def test_multi_turn_signal():
    hist = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    d = KVCacheLayeringPolicy().decide(user_prompt="and then?", message_history=hist)
    assert d.cache_worthy and d.signals["history_turns"] == 1 and d.signals["multi_turn"]
    d = KVCacheLayeringPolicy().decide(user_prompt="and then?", message_history=[])
    assert not d.signals["multi_turn"]


def test_large_context_signal_counts_rag():
    d = KVCacheLayeringPolicy().decide(user_prompt="q", rag_context=["d" * 4000, "e" * 4200])
    assert d.cache_worthy and d.signals["large_context"] and d.signals["context_tokens"] >= 2048


def test_role_is_a_weak_prior_only():
    p = KVCacheLayeringPolicy()
    clear_one_off = p.decide(user_prompt="hi", role="agent")
    assert clear_one_off.skip_save and "ignored" in clear_one_off.reasons[-1]
    borderline = p.decide(system_prompt="x" * 2400, user_prompt="hi", role="agent")  # 600 tokens
    assert borderline.cache_worthy and "tipped" in borderline.reasons[-1]
    assert p.decide(system_prompt="x" * 2400, user_prompt="hi").skip_save  # no role: skip


def test_env_knobs_are_read_live(monkeypatch):
    p = KVCacheLayeringPolicy()
    monkeypatch.setenv("KV_CACHE_MIN_PREFIX_TOKENS", "10")
    assert p.decide(system_prompt="x" * 40).cache_worthy
    monkeypatch.setenv("KV_CACHE_CHARS_PER_TOKEN", "1")
    assert p.decide(system_prompt="x" * 10).signals["prefix_tokens"] == 10
    monkeypatch.setenv("KV_CACHE_LAYERING", "false")
    d = p.decide(user_prompt="hi")
    assert not d.attach and fold_kv_hint({"a": 1}, d) == {"a": 1}
    monkeypatch.setenv("KV_CACHE_MIN_HISTORY_TURNS", "many")
    monkeypatch.setenv("KV_CACHE_LAYERING", "true")
    with pytest.raises(ValueError, match="KV_CACHE_MIN_HISTORY_TURNS"):
        p.decide(user_prompt="hi")


def test_fold_kv_hint_keeps_other_keys():
    extra = {"reasoning_effort": "low", "kv_transfer_params": {"lmcache.other": 3}, "priority": 2}
    d = KVCacheLayeringPolicy().decide(user_prompt="hi")
    out = fold_kv_hint(extra, d)
    assert out == {"reasoning_effort": "low", "priority": 2,
                   "kv_transfer_params": {"lmcache.other": 3, "lmcache.skip_save": True}}  # fmt: skip
    assert extra["kv_transfer_params"] == {"lmcache.other": 3}  # input untouched
    assert fold_kv_hint(None, d) == {"kv_transfer_params": {"lmcache.skip_save": True}}


def test_rewrite_body_moves_hints_where_sglang_carries_them():
    import json

    from sglang_tiered.integration.http import rewrite_body

    raw = json.dumps({"text": "hi", "kv_transfer_params": {"lmcache.skip_save": True}}).encode()
    out = json.loads(rewrite_body(raw, "/generate", None))
    assert out == {"text": "hi", "sampling_params": {"custom_params": {"lmcache.skip_save": True}}}
    raw = json.dumps({"messages": [], "kv_transfer_params": {"lmcache.skip_save": False}}).encode()
    out = json.loads(rewrite_body(raw, "/v1/chat/completions", "acme"))
    assert out == {"messages": [], "custom_params": {"lmcache.skip_save": False}, "cache_salt": "acme"}
    assert rewrite_body(b"not json", "/generate", None) == b"not json"
    same = json.dumps({"text": "hi"}).encode()
    assert rewrite_body(same, "/generate", None) is same


def test_bad_input_is_text_or_a_clear_error(monkeypatch):
    """Review, session 18: null content parts and RAG items, a dict content, a non-dict
    kv_transfer_params were TypeErrors or miscounted; nan/inf/negative knobs were accepted."""
    p = KVCacheLayeringPolicy()
    d = p.decide(user_prompt=None, message_history=[{"role": "user", "content": [{"type": "text", "text": None}]},
                                                    {"role": "assistant", "content": None}],
                 rag_context=["doc", None])  # fmt: skip
    assert d.signals["rag_tokens"] == p.estimate_tokens("doc")
    d = p.decide(message_history=[{"role": "assistant", "content": {"type": "text", "text": "y" * 4000}}])
    assert d.signals["context_tokens"] == p.estimate_tokens("y" * 4000)
    assert fold_kv_hint({"kv_transfer_params": "x"}, p.decide(user_prompt="hi"))["kv_transfer_params"] == {
        "lmcache.skip_save": True}
    for name, value in (("KV_CACHE_CHARS_PER_TOKEN", "nan"), ("KV_CACHE_CHARS_PER_TOKEN", "inf"),
                        ("KV_CACHE_CHARS_PER_TOKEN", "0"), ("KV_CACHE_MIN_CONTEXT_TOKENS", "-1")):  # fmt: skip
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=name):
            p.decide(system_prompt="x" * 10)
        monkeypatch.delenv(name)
