"""A helper's audit of README/ARCHITECTURE against the code, and of the client-side policy
(``sglang_tiered.client``), session 41. Each test failed on the code before its fix."""

from __future__ import annotations

import copy
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_tiered.client import REUSE_HEAVY_ROLES, KVCacheLayeringPolicy, fold_kv_hint

POLICY = KVCacheLayeringPolicy(enabled=True, min_prefix_tokens=1024, min_context_tokens=2048,
                               min_history_turns=1, chars_per_token=4.0)  # fmt: skip


def test_client_prompt_given_as_content_parts_counts_its_text():
    """A ``user_prompt`` or ``system_prompt`` of OpenAI content parts counts its text, as the same
    parts in ``message_history`` do (before: its repr; a 100 KB image's data URL was a 'large
    context' of 25,000 tokens)."""
    text = [{"type": "text", "text": "a" * 400}]
    assert POLICY.decide(user_prompt=text).signals["context_tokens"] == 100  # (was 107)
    assert POLICY.decide(system_prompt=text).signals["prefix_tokens"] == 100
    image = [{"type": "text", "text": "What is this?"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 100_000}}]  # fmt: skip
    d = POLICY.decide(user_prompt=image)
    assert d.skip_save and not d.signals["large_context"], d.reasons
    in_history = POLICY.decide(message_history=[{"role": "assistant", "content": image}])
    assert d.signals["context_tokens"] == in_history.signals["context_tokens"]


def test_client_role_tips_a_borderline_history_too():
    """'a reuse-heavy role only tips a borderline execution (a signal at half its threshold)':
    prior turns are a signal too (before: 2 of 4 turns with role 'agent' was 'a clear one-off')."""
    p = KVCacheLayeringPolicy(min_history_turns=4)
    hist = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}] * 2
    d = p.decide(user_prompt="hi", message_history=hist, role="agent")
    assert d.cache_worthy and "tipped" in d.reasons[-1], d.reasons
    assert p.decide(user_prompt="hi", message_history=hist).skip_save  # no role: still skipped
    assert p.decide(user_prompt="hi", message_history=hist[:2], role="agent").skip_save  # 1 of 4


_part = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=400)})
_content = st.none() | st.text(max_size=2000) | st.lists(_part, max_size=3)
_msg = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool"]), "content": _content})


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(sys_p=st.none() | st.text(max_size=5000), user=_content, hist=st.none() | st.lists(_msg, max_size=6),
       rag=st.none() | st.text(max_size=9000) | st.lists(st.text(max_size=3000), max_size=4),
       role=st.none() | st.sampled_from(sorted(REUSE_HEAVY_ROLES) + ["user", "AGENT", ""]))  # fmt: skip
def test_client_decisions_are_deterministic_monotone_and_json_safe(sys_p, user, hist, rag, role):
    """What the module states: a decision is a function of its inputs (no state kept between
    calls: bounded memory), skip_save is not cache_worthy, more shared prefix never turns a store
    into a skip, and the folded hint is JSON holding only ``kv_transfer_params`` beside the
    caller's keys, untouched (a key SGLang ignores, and our middleware turns into custom_params)."""
    kw = dict(system_prompt=sys_p, user_prompt=user, message_history=hist, rag_context=rag, role=role)
    d1, d2 = POLICY.decide(**kw), POLICY.decide(**kw)
    assert (d1.cache_worthy, d1.score, d1.reasons, d1.signals) == (d2.cache_worthy, d2.score, d2.reasons, d2.signals)
    assert d1.attach and d1.skip_save == (not d1.cache_worthy)
    if d1.cache_worthy:
        assert POLICY.decide(**{**kw, "system_prompt": (sys_p or "") + "x" * 400}).cache_worthy
    assert POLICY.decide(**{**kw, "system_prompt": (sys_p or "") + "x" * 4096}).cache_worthy
    assert not vars(POLICY).keys() - {"_enabled", "_min_prefix", "_min_context", "_min_turns", "_cpt"}
    body = {"cache_salt": "acme", "kv_transfer_params": {"other": 1}, "temperature": 0.1}
    before = copy.deepcopy(body)
    out = fold_kv_hint(body, d1)
    assert body == before and json.loads(json.dumps(out)) == out
    assert out == {**before, "kv_transfer_params": {"other": 1, "lmcache.skip_save": d1.skip_save}}


def test_client_rag_context_of_another_shape_is_a_clear_error():
    """``rag_context`` is a string or a list of documents, as ``message_history`` is a list:
    before, a number raised "'int' object is not iterable", a mapping counted its keys (9,000
    characters under "text" were 1 token) and bytes the digits of their byte values."""
    import pytest

    for bad in (1, 2.5, {"text": "x" * 9000}, b"x" * 9000):
        with pytest.raises(TypeError, match="rag_context"):
            POLICY.decide(user_prompt="hi", rag_context=bad)
    assert POLICY.decide(rag_context=("x" * 9000,)).signals["rag_tokens"] == 2250  # any sequence
    assert POLICY.decide(rag_context=iter(["x" * 400])).signals["rag_tokens"] == 100
