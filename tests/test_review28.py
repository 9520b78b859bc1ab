"""Session 28: a grammar that allows no token (the one server killer session 27 left open).

Stock SGLang 0.5.23 masks every logit of such a row to ``-inf``; with top-p, top-k or min-p its
torch sampler draws from NaN probabilities and ``torch.multinomial`` kills the scheduler
(sampler.py:838). The plugin's AFTER hook on ``Sampler._preprocess_logits`` gives such a row
logit 0 at token 0 (what SGLang's greedy path picks), the grammar refuses it and SGLang aborts that
request alone. The live check is ``test_a_grammar_that_allows_no_token_is_that_requests_error``
in tests/test_e2e_hardening.py.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sglang_tiered.integration import hooks  # noqa: E402

NEG = float("-inf")


class _Info:
    def __init__(self, grammars):
        self.grammars = grammars


@pytest.fixture
def ours(monkeypatch):
    monkeypatch.setattr(hooks, "_OURS", [True])


def test_a_row_with_no_token_left_gets_token_0_and_the_others_are_untouched(ours):
    logits = torch.randn(3, 10)
    logits[1] = NEG
    logits[2, 3:] = NEG
    before = logits.clone()
    assert hooks._after_sampler_preprocess(logits, None, logits, _Info([object(), object(), None])) is None
    assert logits[1, 0] == 0 and torch.isneginf(logits[1, 1:]).all()
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    # what SGLang's sampler then does with the row: finite probabilities, token 0 drawn
    probs = torch.softmax(logits, dim=-1)
    assert not probs.isnan().any()
    assert torch.multinomial(probs[1:2], 1).item() == 0


def test_a_batch_without_a_grammar_is_not_touched(ours):
    logits = torch.full((2, 5), NEG)
    hooks._after_sampler_preprocess(logits, None, logits, _Info(None))
    assert torch.isneginf(logits).all()
    hooks._after_sampler_preprocess(logits, None, logits, sampling_info=_Info([]))
    assert torch.isneginf(logits).all()


def test_sglangs_own_backend_is_not_touched(monkeypatch):
    monkeypatch.setattr(hooks, "_OURS", [False])
    logits = torch.full((2, 5), NEG)
    hooks._after_sampler_preprocess(logits, None, logits, _Info([object()]))
    assert torch.isneginf(logits).all()


def test_the_backend_is_read_once_and_only_when_known(monkeypatch):
    import sglang.srt.runtime_context as rc

    monkeypatch.setattr(hooks, "_OURS", [])
    monkeypatch.setattr(rc, "get_server_args", lambda: None)
    assert hooks._serves_our_backend() is False and hooks._OURS == []  # not known yet: asked again later

    class Args:
        radix_cache_backend = "tiered"

    monkeypatch.setattr(rc, "get_server_args", lambda: Args())
    assert hooks._serves_our_backend() is True and hooks._OURS == [True]


def test_the_hooked_sampler_method_exists_and_is_wrapped(ours):
    """The target resolves in the installed SGLang (HookRegistry would skip it with a log line), and
    SGLang's HookRegistry, applied as its plugin loader does, runs the hook on a real ``Sampler``
    method: an all ``-inf`` row comes out of ``_preprocess_logits`` with a finite token."""
    import pkgutil

    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    assert hooks.hook_resolves(hooks._SAMPLER_PREPROCESS) and hooks.hook_resolves(hooks._GRAMMAR_SET_CACHE)
    cls = pkgutil.resolve_name(hooks._SAMPLER_PREPROCESS.rsplit(".", 1)[0])
    wrapped = _wrap_fn(cls._preprocess_logits, hooks._after_sampler_preprocess, HookType.AFTER)

    class Info(_Info):
        has_custom_logit_processor = False

    sampler = object.__new__(cls)  # (no process group needed: _preprocess_logits reads none)
    logits = torch.full((2, 6), NEG)
    logits[0, 2] = 1.0
    out = wrapped(sampler, logits, Info([object(), object()]))
    assert out[1, 0] == 0 and out[0, 2] == 1.0 and torch.isneginf(out[0, [0, 1, 3, 4, 5]]).all()


# ---------------------------------------------------------------- grammar patterns (session 28)
import json  # noqa: E402

from sglang_tiered.integration.http import (MAX_PATTERN_DEPTH, MAX_QUANTIFIER_RUN, BadRequest,  # noqa: E402
                                            _regex_shape, rewrite_body)

DEEP = "(" * (MAX_PATTERN_DEPTH + 1) + "a" + ")" * (MAX_PATTERN_DEPTH + 1)
STARS = "a" + "*" * (MAX_QUANTIFIER_RUN + 1)


def _schema_bodies(pattern):
    """Every place a helper's hunt reached xgrammar's JSON-schema compiler with a pattern (each
    killed a stock 0.5.23 server with 400,000 nested groups)."""
    s = {"type": "string", "pattern": pattern}
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    return [
        ("/generate", {"text": "a", "sampling_params": {"json_schema": json.dumps(s)}}),
        ("/generate", {"text": ["a", "b"], "sampling_params": [{}, {"json_schema": json.dumps(s)}]}),
        ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema",
                                                              "json_schema": {"name": "x", "schema": s}}}),
        ("/generate", {"text": "a", "sampling_params": {"structural_tag": json.dumps(
            {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": s}})}}),
        ("/v1/chat/completions", {**chat, "response_format": {"type": "structural_tag", "triggers": ["<a"],
                                                              "structures": [{"begin": "<a>", "schema": s, "end": "</a>"}]}}),
        ("/v1/completions", {"model": "default", "prompt": "a", "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": s}}}),
        ("/generate", {"text": "a", "sampling_params": {"json_schema": json.dumps(
            {"type": "object", "propertyNames": {"pattern": pattern}})}}),
        ("/generate", {"text": "a", "sampling_params": {"json_schema": json.dumps(
            {"type": "object", "$defs": {"x": {"patternProperties": {pattern: {}}}}})}}),
        ("/v1/chat/completions", {**chat, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"a": s}}}}]}),
    ]  # fmt: skip


@pytest.mark.parametrize("pattern", [DEEP, STARS])
@pytest.mark.parametrize("i", range(9))
def test_a_pattern_that_overflows_xgrammars_compiler_is_refused(pattern, i):
    path, body = _schema_bodies(pattern)[i]
    for tenant_mode in (False, True):
        with pytest.raises(BadRequest, match="pattern"):
            rewrite_body(json.dumps(body).encode(), path, "t" if tenant_mode else None, tenant_mode)


@pytest.mark.parametrize("pattern", ["^[a-z]+(-[a-z]+)*$", r"^\d{3}-\d{4}$", "a*?b++c{2,3}?", "[(((((]",
                                     "(" * MAX_PATTERN_DEPTH + ")" * MAX_PATTERN_DEPTH])
def test_ordinary_patterns_pass(pattern):
    for path, body in _schema_bodies(pattern):
        raw = json.dumps(body).encode()
        assert rewrite_body(raw, path, None, False) is raw


def test_regex_shape():
    assert _regex_shape("(a(b)c)") == (2, 0)
    assert _regex_shape(r"\(\(\(") == (0, 0)  # escaped
    assert _regex_shape("[(((]") == (0, 0)  # in a class
    assert _regex_shape("a{2,3}?") == (0, 2) and _regex_shape("a{2") == (0, 0)
    assert _regex_shape("a*" + "b" + "+" * 5) == (0, 5)


def test_an_escaped_pattern_key_is_found_in_plain_mode():
    """The middleware parses a body in plain mode only on a byte trigger; a key written with JSON
    escapes (``\\u0070attern``) is found too (``\\u`` triggers the parse)."""
    raw = json.dumps({"text": "a", "sampling_params": {"json_schema": json.dumps({"type": "string", "pattern": DEEP})}})
    raw = raw.replace("pattern", "\\\\u0070attern").encode()
    assert b"pattern" not in raw.replace(b"\\\\u0070", b"")
    with pytest.raises(BadRequest):
        rewrite_body(raw, "/generate", None, False)


# -------------------------------------------------------- grammar timeouts are not cached (session 28)
def test_a_grammar_compile_that_timed_out_is_not_cached(ours):
    from sglang.srt.constrained.base_grammar_backend import BaseGrammarBackend, InvalidGrammarObject
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    set_cache = _wrap_fn(BaseGrammarBackend.set_cache, hooks._around_grammar_set_cache, HookType.AROUND)
    backend = BaseGrammarBackend()
    set_cache(backend, ("regex", "ab"), InvalidGrammarObject(hooks.GRAMMAR_TIMEOUT))
    assert ("regex", "ab") not in backend.cache  # the next request compiles it again
    bad = InvalidGrammarObject("Unsupported regex")
    set_cache(backend, ("regex", "(?<=a)"), bad)
    assert backend.cache[("regex", "(?<=a)")] is bad  # a grammar that does not compile stays cached
    backend.executor.shutdown()


def test_the_timeout_message_is_sglangs():
    """The hook matches SGLang's own message, where grammar_manager.py writes it."""
    import inspect

    from sglang.srt.constrained import grammar_manager

    assert f'InvalidGrammarObject("{hooks.GRAMMAR_TIMEOUT}")' in inspect.getsource(grammar_manager)


def test_the_grammar_check_raises_nothing_but_a_400():
    """Any JSON in any of the schema fields, as text or as a value, on the routes that take them:
    the check answers a 400 or lets the body through, never another exception (a 500)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from sglang_tiered.integration.http import SCHEMA_FIELDS, _check_grammar_specs

    leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(
        alphabet="()[]{}*+?\\\\,0123a^$|", max_size=30)
    value = st.recursive(leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(
        st.sampled_from(["pattern", "patternProperties", "type", "items", "x"]) | st.text(max_size=5), c, max_size=4),
        max_leaves=20)

    @settings(max_examples=1500, deadline=None)
    @given(st.sampled_from(SCHEMA_FIELDS), value, st.booleans(),
           st.sampled_from(["/generate", "/v1/chat/completions", "/v1/completions"]))
    def check(field, v, as_text, path):
        spec = json.dumps(v) if as_text else v
        body = {"sampling_params": {field: spec}} if path == "/generate" else {field: spec}
        try:
            _check_grammar_specs(body, path)
        except BadRequest:
            pass

    check()
