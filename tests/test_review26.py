"""Session 26: request bodies that kill stock SGLang 0.5.23's scheduler or answer 500, refused by
the request middleware (``integration/http.py``) before SGLang parses them. The server-level
check of the same bodies is ``tests/test_e2e_hardening.py::test_empty_and_disagreeing_prompts_are_400``."""

from __future__ import annotations

import json

import pytest

from sglang_tiered.integration.http import BadRequest, rewrite_body

SP = {"max_new_tokens": 1}


def _body(**kw) -> bytes:
    return json.dumps({"sampling_params": SP, **kw}).encode()


@pytest.mark.parametrize(
    "body, says",
    [
        (dict(input_ids=[], text="hello"), "input_ids is empty"),
        (dict(input_ids=[[5, 6], []]), "input_ids[1] is empty"),
        (dict(input_ids=[[]]), "input_ids[0] is empty"),
        (dict(input_ids=[[]], text=["a"]), "input_ids[0] is empty"),
        (dict(input_ids=[[5], [6]], text="hi"), "text is one prompt"),
        (dict(input_ids=[5, 6], text=["a", "b"]), "batch of 2 but input_ids is one prompt"),
        (dict(input_ids=[[5]], text=["a", "b"]), "batch of 2 but input_ids is a batch of 1"),
    ],
)
def test_generate_bodies_that_kill_or_500_are_refused(body, says):
    for tenant in (None, "acme"):
        with pytest.raises(BadRequest) as exc:
            rewrite_body(_body(**body), "/generate", tenant)
        assert says in str(exc.value) and exc.value.status == 400


@pytest.mark.parametrize(
    "body",
    [
        dict(input_ids=[5, 6], text="a"),  # agreeing shapes: SGLang serves input_ids
        dict(input_ids=[[5], [6, 7]], text=["a", "b"]),
        dict(input_ids=[], text="a", session_params={"id": "s1"}),  # the session supplies the prompt
        dict(input_ids=[]),  # SGLang refuses it itself ("input_ids cannot be empty")
        dict(text=[]),  # an empty batch: SGLang answers it
        dict(input_ids=[5, []]),  # SGLang reads a single prompt and refuses the list inside
        dict(text="a"),
    ],
)
def test_generate_bodies_sglang_answers_pass(body):
    assert rewrite_body(_body(**body), "/generate", None) is not None


def test_completions_batch_with_an_empty_prompt_is_refused():
    raw = json.dumps({"model": "default", "prompt": [[5], []], "max_tokens": 1}).encode()
    with pytest.raises(BadRequest, match=r"prompt\[1\] is empty"):
        rewrite_body(raw, "/v1/completions", None)
    ok = json.dumps({"model": "default", "prompt": [[5], [6]], "max_tokens": 1}).encode()
    assert rewrite_body(ok, "/v1/completions", None) == ok


def test_vertex_route_ids_are_range_checked():
    raw = json.dumps({"instances": [{"input_ids": [5]}, {"input_ids": [-3]}]}).encode()
    with pytest.raises(BadRequest, match=r"instances\[1\]\.input_ids holds token id -3"):
        rewrite_body(raw, "/vertex_generate", None)
    ok = json.dumps({"instances": [{"input_ids": [5]}, {"text": "a"}, 7]}).encode()
    assert rewrite_body(ok, "/vertex_generate", None) == ok


def _app(tenant_header=None):
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from sglang_tiered.integration.http import HintMiddleware

    async def echo(request):
        return JSONResponse({"body": (await request.body()).decode("latin-1")})

    paths = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/audio/transcriptions",
             "/update_weights_from_disk")  # fmt: skip
    routes = [Route(p, echo, methods=["POST"]) for p in paths]
    return TestClient(Starlette(routes=routes, middleware=[Middleware(HintMiddleware, tenant_header=tenant_header)]))


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions", "/v1/embeddings"])
@pytest.mark.parametrize("raw", [b"[1]", b'"x"', b"false", b"null", b"-759", b"[" * 950 + b"]" * 950,
                                 b"[" * 5000 + b"]" * 5000, b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}"])  # fmt: skip
def test_bodies_that_are_not_objects_are_400_without_a_tenant_header(path, raw):
    """Stock SGLang 0.5.23 answers a JSON body that is not an object (``'list' object has no
    attribute 'get'``) or nests past Python's recursion limit with a 500 on its JSON routes; the
    HTTP fuzz with random seeds found them on a server without a tenant header (in tenant mode
    they were already refused)."""
    r = _app().post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, (r.status_code, r.text[:200])
    assert "JSON object" in r.text or "nested too deeply" in r.text


def test_objects_non_json_and_other_routes_pass_unchanged():
    c = _app()
    big = json.dumps({"model": "m", "messages": [{"role": "user", "content": "[" * 600}]}).encode()
    for path, raw, ctype in (
        ("/v1/chat/completions", big, "application/json"),  # many brackets inside a string: parsed, passed
        ("/v1/chat/completions", b"not json", "application/json"),  # SGLang's own 400
        ("/v1/embeddings", b'{"input": "a"}', "application/json"),
        ("/v1/audio/transcriptions", b"[1]", "multipart/form-data; boundary=x"),  # a form upload: unread
        ("/update_weights_from_disk", b"[1]", "application/json"),  # not a route that reaches the cache
    ):
        r = c.post(path, content=raw, headers={"content-type": ctype})
        assert r.status_code == 200 and r.json()["body"].encode("latin-1") == raw, (path, r.status_code)


# ---------------------------------------------------------------- a prompt with no tokens
def test_the_validation_hook_targets_sglangs_method():
    import inspect
    import pkgutil

    from sglang_tiered.integration import hooks

    fn = pkgutil.resolve_name(hooks._VALIDATE_REQUEST)
    assert list(inspect.signature(fn).parameters)[:3] == ["self", "obj", "input_ids"]


def test_a_prompt_with_no_tokens_is_refused_on_our_backend_only():
    from types import SimpleNamespace as NS

    from sglang_tiered.integration.hooks import _before_validate_one_request as hook
    from sglang_tiered.integration.protocol import BACKEND_NAME

    ours, stock = NS(server_args=NS(radix_cache_backend=BACKEND_NAME)), NS(server_args=NS(radix_cache_backend=None))
    plain = NS(input_embeds=None, session_params=None, session_id=None)
    with pytest.raises(ValueError, match="no tokens"):
        hook(ours, plain, [])
    with pytest.raises(ValueError, match="no tokens"):
        hook(ours, plain, input_ids=[])
    assert hook(stock, plain, []) is None  # SGLang's own server keeps its own behaviour
    assert hook(ours, plain, [5]) is None
    assert hook(ours, NS(input_embeds=[[0.1]], session_params=None), []) is None
    assert hook(ours, NS(input_embeds=None, session_params={"id": "s"}), []) is None  # the session's history
    assert hook(ours, NS(input_embeds=None, session_params=None, session_id="s"), []) is None


def test_the_validation_hook_is_applied_in_the_launcher():
    """In the launcher process, where SGLang's tokenizer manager runs (fresh interpreter:
    HookRegistry patches classes for good)."""
    import subprocess
    import sys

    code = """
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang_tiered.integration.hooks import register_hooks
register_hooks()
HookRegistry.apply_hooks()
from sglang.srt.managers.tokenizer_manager import TokenizerManager as T
print(getattr(T._validate_one_request, "__wrapped__", None) is not None)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "True"


# ---------------------------------------------------------------- a top-k past the vocabulary
@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/generate", {"text": "a", "return_logprob": True, "top_logprobs_num": 100000}, "top_logprobs_num"),
        ("/generate", {"text": ["a", "b"], "return_logprob": True, "top_logprobs_num": [1, 100000]}, "top_logprobs_num"),
        ("/v1/completions", {"model": "m", "prompt": "a", "logprobs": 100000}, "logprobs"),
        ("/v1/completions", {"model": "m", "prompt": "a", "logprobs": "100000"}, "logprobs"),  # pydantic reads 100000
        ("/v1/chat/completions", {"model": "m", "messages": [], "logprobs": True, "top_logprobs": 100000}, "top_logprobs"),
        ("/v1/responses", {"input": "a", "top_logprobs": 2049.0}, "top_logprobs"),
    ],
)
def test_a_top_k_past_the_vocabulary_is_400(monkeypatch, path, body, field):
    """Stock SGLang 0.5.23's scheduler dies on it (``selected index k out of range``)."""
    from sglang_tiered.integration import http

    monkeypatch.setattr(http, "_vocab", [2048])
    for tenant in (None, "acme"):
        with pytest.raises(BadRequest, match=f"{field} is .*vocabulary size \\(2048\\)"):
            rewrite_body(json.dumps(body).encode(), path, tenant)
    ok = {**body, field: 2048 if not isinstance(body[field], list) else [1, 2048]}
    assert rewrite_body(json.dumps(ok).encode(), path, None) is not None


def test_a_chat_body_with_a_top_k_is_parsed_on_a_plain_server(monkeypatch):
    from sglang_tiered.integration import http

    monkeypatch.setattr(http, "_vocab", [2048])
    r = _app().post("/v1/chat/completions", json={"model": "m", "messages": [], "logprobs": True, "top_logprobs": 5000})
    assert r.status_code == 400 and "top_logprobs" in r.text
    r = _app().post("/v1/chat/completions", json={"model": "m", "messages": [], "logprobs": True, "top_logprobs": 5})
    assert r.status_code == 200


@pytest.mark.parametrize("top_k", [2**31, 10**16, 1e16, float("inf"), float("nan"), -2, (1 << 30) + 1])
def test_a_top_k_past_int32_is_refused(top_k):
    """SGLang checks only top_k's lower bound; past int32 its scheduler dies building the batch's
    sampling tensors (``value cannot be converted to type int32 without overflow``)."""
    from types import SimpleNamespace as NS

    from sglang_tiered.integration.hooks import _before_validate_one_request as hook
    from sglang_tiered.integration.protocol import BACKEND_NAME

    ours = NS(server_args=NS(radix_cache_backend=BACKEND_NAME))
    obj = NS(input_embeds=None, session_params=None, session_id=None, sampling_params={"top_k": top_k})
    with pytest.raises(ValueError, match="top_k"):
        hook(ours, obj, [5])
    for fine in (-1, 1, 50, 1 << 30, None, True):
        assert hook(ours, NS(input_embeds=None, sampling_params={"top_k": fine}), [5]) is None


def test_top_k_all_is_sglangs():
    from sglang.srt.sampling.sampling_params import TOP_K_ALL

    from sglang_tiered.integration import hooks

    assert hooks.TOP_K_ALL == TOP_K_ALL


def test_a_session_id_lets_an_empty_input_ids_next_to_text_pass():
    """SGLang's newer ``session_id`` field supplies the prompt as ``session_params.id`` does."""
    assert rewrite_body(_body(input_ids=[], text="a", session_id="s1"), "/generate", None) is not None
