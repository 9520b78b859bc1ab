"""Session 27: request bodies stock SGLang 0.5.23 breaks on, found by a hunt with the sampling-field
fuzz (``make soak``) against a stock server and ours, refused by the request middleware
(``integration/http.py``) with a 400. Each fails on the code before it."""

from __future__ import annotations

import json

import pytest

from sglang_tiered.integration.http import MAX_N, BadRequest, rewrite_body
from tests.test_review26 import _app


def _refused(body: dict, path: str, says: str) -> None:
    for tenant in (None, "acme"):
        with pytest.raises(BadRequest) as exc:
            rewrite_body(json.dumps(body).encode(), path, tenant)
        assert says in str(exc.value) and exc.value.status == 400, str(exc.value)


def _passes(body: dict, path: str) -> None:
    for tenant in (None, "acme"):
        assert rewrite_body(json.dumps(body).encode(), path, tenant) is not None


# ---------------------------------------------------------------- a list rid for one prompt
@pytest.mark.parametrize("body", [
    {"text": "a", "rid": ["x"], "stream": True},  # a 200 cut off after its headers (IncompleteRead)
    {"text": "a", "rid": []},  # a 500 (TypeError: unhashable type: 'list')
    {"input_ids": [5, 6], "rid": ["x", "y"]},
    {"text": "a", "rid": ["x", "y"], "sampling_params": {"n": 2, "beam_width": 2}},  # beam search: one request
])  # fmt: skip
def test_a_list_rid_for_one_prompt_is_refused(body):
    _refused(body, "/generate", "rid is a list but the request is one prompt")


@pytest.mark.parametrize("body", [
    {"text": ["a", "b"], "rid": ["x", "y"]},  # a batch: SGLang checks its length itself
    {"input_ids": [[5], [6]], "rid": ["x", "y"]},
    {"text": "a", "rid": ["x", "y"], "sampling_params": {"n": 2}},  # n > 1 fans one prompt out
    {"text": "a", "rid": "x", "stream": True},
])  # fmt: skip
def test_a_list_rid_that_sglang_serves_passes(body):
    _passes(body, "/generate")


# ---------------------------------------------------------------- logit_bias and n
@pytest.mark.parametrize("value", [1e39, -1e39, 1e31, "1e39", float("nan"), float("inf"), float("-inf")])
def test_a_logit_bias_that_overflows_is_refused(value):
    """``{"logit_bias": {"500": 1e39}, "top_k": 5}`` killed stock SGLang's scheduler (an inf in
    the probabilities, torch.multinomial); 1e34 with a temperature of 1e-5 did too."""
    _refused({"text": "v", "sampling_params": {"max_new_tokens": 1, "logit_bias": {"500": value}, "top_k": 5}},
             "/generate", "logit_bias['500']")  # fmt: skip
    _refused({"text": ["v"], "sampling_params": [{"logit_bias": {"500": value}}]}, "/generate", "logit_bias")
    for path in ("/v1/completions", "/v1/chat/completions"):
        _refused({"model": "m", "prompt": "v", "messages": [], "logit_bias": {"500": value}}, path, "logit_bias")


@pytest.mark.parametrize("value", [-100, 100, 1e30, -1e30, 0.5, "7", "x", None])
def test_a_logit_bias_within_range_passes(value):
    _passes({"text": "v", "sampling_params": {"logit_bias": {"500": value}}}, "/generate")
    _passes({"model": "m", "messages": [], "logit_bias": {"500": value}}, "/v1/chat/completions")


def test_n_and_best_of_are_bounded():
    """An ``n`` of 858,808 grew a server by 9 GB in two minutes (no bound anywhere in SGLang)."""
    _refused({"text": "v", "sampling_params": {"n": 858808}}, "/generate", "n is 858808")
    _refused({"text": "v", "sampling_params": {"n": 1e300}}, "/generate", "at most")
    _refused({"model": "m", "prompt": "v", "n": MAX_N + 1}, "/v1/completions", "n is")
    _refused({"model": "m", "prompt": "v", "best_of": 10**6}, "/v1/completions", "best_of is")
    _refused({"model": "m", "messages": [], "n": "5000"}, "/v1/chat/completions", "n is")
    _passes({"text": "v", "sampling_params": {"n": 4}}, "/generate")
    # n < 1 on the OpenAI routes: streamed with include_usage, a 200 cut off (SGLang's usage)
    for n in (0, -1, "0"):
        _refused({"model": "m", "messages": [], "n": n, "stream": True, "stream_options": {"include_usage": True}},
                 "/v1/chat/completions", "it must be at least 1")  # fmt: skip
        _refused({"model": "m", "prompt": "v", "n": n, "stream": True}, "/v1/completions", "it must be at least 1")
    _passes({"text": "v", "sampling_params": {"n": 0}}, "/generate")  # SGLang serves it as n = 1
    _passes({"model": "m", "messages": [], "n": MAX_N}, "/v1/chat/completions")


def test_a_plain_server_parses_chat_bodies_with_these_fields():
    """Without a tenant header the middleware parses a chat body only when a byte check says it
    may need it: ``logit_bias``, ``"n"`` and ``best_of`` are among those checks now."""
    c = _app()
    for extra in ({"logit_bias": {"5": 1e39}}, {"n": 10**6}, {"best_of": 10**6}):
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": [], **extra})
        assert r.status_code == 400, (extra, r.status_code, r.text[:200])
    r = c.post("/v1/chat/completions", json={"model": "m", "messages": [], "n": 2, "logit_bias": {"5": -100}})
    assert r.status_code == 200


# ---------------------------------------------------------------- per-prompt fields given as lists
@pytest.mark.parametrize("body, says", [
    ({"text": "a", "return_logprob": True, "top_logprobs_num": []}, "top_logprobs_num is a list"),  # kills
    ({"text": "a", "return_logprob": True, "top_logprobs_num": [1]}, "top_logprobs_num is a list"),  # kills
    ({"input_ids": [5], "return_logprob": True, "logprob_start_len": [0]}, "logprob_start_len is a list"),  # kills
    ({"text": ["a", "b"], "return_logprob": [True], "stream": True}, "1 values for a batch of 2"),  # a cut stream
    ({"text": ["a", "b"], "return_logprob": True, "logprob_start_len": []}, "0 values for a batch of 2"),  # a 500
    ({"input_ids": [[5], [6]], "return_logprob": True, "token_ids_logprob": [[5]]}, "token_ids_logprob has 1"),
    ({"text": "9O", "return_hidden_states": []}, "return_hidden_states is a list"),  # kills
    ({"text": "9O", "return_hidden_states": [True]}, "return_hidden_states is a list"),  # kills with hidden states on
    ({"input_ids": list(range(50, 61)), "return_logprob": True, "logprob_start_len": -3}, "logprob_start_len is -3"),  # kills
    ({"text": ["a", "b"], "return_logprob": True, "logprob_start_len": [0, -2]}, "logprob_start_len is -2"),
])  # fmt: skip
def test_per_prompt_lists_that_break_the_server_are_refused(body, says):
    _refused(body, "/generate", says)


@pytest.mark.parametrize("body", [
    {"text": ["a", "b"], "return_logprob": True, "top_logprobs_num": [1, 2]},
    {"text": ["a", "b"], "return_logprob": [True, False], "logprob_start_len": 0},
    {"text": ["a", "b"], "return_logprob": True, "top_logprobs_num": [1, 2, 3]},  # (SGLang ignores the extra)
    {"text": "a", "return_logprob": [True]},  # SGLang serves it (a truthy list)
    {"text": "a", "return_logprob": True, "token_ids_logprob": [5, 6]},  # one prompt: a flat list of ids
    {"input_ids": [[5], [6]], "return_logprob": True, "token_ids_logprob": [5, 6]},  # the same ids for each
    {"text": "a", "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0},
    {"text": "a", "return_logprob": True, "logprob_start_len": -1},
    {"text": "a", "return_hidden_states": "last"},
    {"text": ["a", "b"], "return_hidden_states": [True, False]},
])  # fmt: skip
def test_per_prompt_values_sglang_serves_pass(body):
    _passes(body, "/generate")


# ---------------------------------------------------------------- fields a client cannot use safely
@pytest.mark.parametrize("body, says", [
    ({"text": "hi", "lora_id": [None]}, "lora_id is set by the server"),  # kills
    ({"text": "hi", "lora_id": "0123456789abcdef0123456789abcdef"}, "lora_id is set by the server"),  # an adapter's namespace
    ({"text": "hi", "positional_embed_overrides": {}}, "positional_embed_overrides"),  # kills
    ({"text": ["a", "b"], "positional_embed_overrides": [0, 0]}, "positional_embed_overrides"),
    ({"input_ids": [19, 1541, 1590], "sampling_params": {"max_new_tokens": 0, "ebnf": 'root ::= "a"'},
      "token_indices_to_pool": [-1]}, "token_indices_to_pool cannot be combined"),  # kills
    ({"text": ["a", "b"], "bootstrap_room": [], "stream": True}, "bootstrap_room has 0 values"),  # a cut stream
    ({"text": ["a", "b"], "custom_logit_processor": ["x"]}, "custom_logit_processor has 1 values"),
    ({"text": ["a", "b"], "lora_path": ["x"]}, "lora_path has 1 values"),
])  # fmt: skip
def test_fields_that_break_the_server_are_refused(body, says):
    _refused(body, "/generate", says)


@pytest.mark.parametrize("body", [
    {"text": "hi", "lora_path": "adapter-a"},
    {"text": ["a", "b"], "lora_path": ["adapter-a", None]},
    {"text": "hi", "token_indices_to_pool": [0, 1]},
    {"text": ["a", "b"], "bootstrap_room": [1, 2]},
    {"text": "hi", "lora_id": None, "positional_embed_overrides": None},
])  # fmt: skip
def test_fields_sglang_serves_pass(body):
    _passes(body, "/generate")


# ---------------------------------------------------------------- a stop_regex that backtracks exponentially
@pytest.mark.parametrize("pattern", ["(a+)+b", "(.+)+\u0001", "(a|aa)*x", "(a*)*", "(x+x+)+y"])
def test_a_stop_regex_with_nested_repeats_is_refused(pattern):
    """``"stop_regex": "(a+)+b"`` hung stock SGLang's scheduler (``re.search`` over the whole output
    at every decode step): a probe sent afterwards timed out at 60 s."""
    _refused({"text": "hi", "sampling_params": {"stop_regex": pattern}}, "/generate", "nests a repeat")
    _refused({"text": "hi", "sampling_params": {"stop_regex": ["\n", pattern]}}, "/generate", "nests a repeat")
    for path in ("/v1/completions", "/v1/chat/completions"):
        _refused({"model": "m", "prompt": "v", "messages": [], "stop_regex": pattern}, path, "nests a repeat")


@pytest.mark.parametrize("pattern", ["\n\n", r"Answer: \d+", "END.*", r"[0-9]{1,3}\.", "(foo|bar)", "(ab)+",
                                     r"\bSTOP\b", r"\d+\.\d+", "(?:a|b)+c", "(", "a{2,5}b+"])  # fmt: skip
def test_a_plain_stop_regex_passes(pattern):
    _passes({"text": "hi", "sampling_params": {"stop_regex": pattern}}, "/generate")
    _passes({"model": "m", "messages": [], "stop_regex": [pattern]}, "/v1/chat/completions")


# ---------------------------------------------------------------- no body makes the checks raise
_FIELDS = ("text", "input_ids", "input_embeds", "rid", "sampling_params", "stream", "return_logprob",
           "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_hidden_states",
           "return_sampling_mask", "sampling_logprobs_mode", "lora_id", "lora_path", "bootstrap_room",
           "positional_embed_overrides", "token_indices_to_pool", "custom_logit_processor", "n", "best_of",
           "logit_bias", "stop_regex", "prompt", "messages", "logprobs", "top_logprobs", "session_params")  # fmt: skip


def test_the_checks_raise_nothing_but_a_400():
    """A check of this session raised a TypeError (a 500) on ``{"text": 5}`` (``len`` of the
    batch): CI's HTTP fuzz found it before it landed. Any JSON in any of these fields, at the top
    level or in ``sampling_params``, gives a body or a ``BadRequest``, never another exception."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(), st.text(max_size=6))
    value = st.recursive(leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                         max_leaves=8)  # fmt: skip
    fields = st.dictionaries(st.sampled_from(_FIELDS), value, max_size=5)

    @settings(max_examples=3000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(["/generate", "/v1/completions", "/v1/chat/completions", "/invocations"]), fields, fields)
    def check(path, body, sp):
        if sp:
            body = {**body, "sampling_params": sp}
        for tenant in (None, "acme"):
            try:
                rewrite_body(json.dumps(body).encode(), path, tenant)
            except BadRequest:
                pass

    check()
