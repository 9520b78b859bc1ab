"""Issue #10 at server level: a differential soak (randomized multi-tenant traffic with churn,
concurrency, invalidations, no-store hints and T1, outputs compared with a no-cache server, stats
conservation), a Hypothesis fuzz of the HTTP surface (no 5xx, server still serving), and one test
per finding: shared named T1, a tmpfs too small for T1, tenant-header bypass, T1 namespace merges,
500s on bad input, bounded stats, non-finite config.

The soak's size is ``SGLANG_TIERED_SOAK_REQUESTS`` (default 500) and the fuzz's
``SGLANG_TIERED_FUZZ_REQUESTS`` (default 1000): raise them for a longer run."""

from __future__ import annotations

import http.client
import json
import os
import random
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.server

PAGE = 16
HEADER = "x-tenant-id"
SOAK_REQUESTS = int(os.environ.get("SGLANG_TIERED_SOAK_REQUESTS", "500"))
FUZZ_REQUESTS = int(os.environ.get("SGLANG_TIERED_FUZZ_REQUESTS", "1000"))
T1_NAME = f"soak-{os.getpid()}"


@pytest.fixture(scope="module")
def soak_server(tiny_model_path, tmp_path_factory):
    """float32 (exact comparisons), small device pool, T1 on in a named segment, debug invariants
    after every cache operation, tenants from a trusted header."""
    from sglang_tiered.dev.server import Server, ServerSpec
    from sglang_tiered.tier.host_pool import SHM_DIR

    spec = ServerSpec(model_path=tiny_model_path, page_size=PAGE, max_total_tokens=4096, dtype="float32",
                      extra_args=["--max-running-requests", "8"],
                      env={"SGLANG_TIERED_HOST": "on", "SGLANG_TIERED_HOST_RATIO": "4", "SGLANG_TIERED_HOST_NAME": T1_NAME,
                           "SGLANG_TIERED_DEBUG": "1", "SGLANG_TIERED_TENANT_HEADER": HEADER})  # fmt: skip
    server = Server(spec, tmp_path_factory.mktemp("soak") / "soak.log")
    server.start(timeout_s=300)
    yield server
    server.stop()
    for p in SHM_DIR.glob(f"sglang-tiered-{T1_NAME}*"):
        p.unlink()


@pytest.fixture(scope="module")
def reference32(tiny_model_path, tmp_path_factory):
    from sglang_tiered.dev.server import Server, ServerSpec

    spec = ServerSpec(model_path=tiny_model_path, backend=None, disable_radix_cache=True, page_size=PAGE,
                      dtype="float32", extra_args=["--max-running-requests", "8"])  # fmt: skip
    server = Server(spec, tmp_path_factory.mktemp("ref32") / "ref32.log")
    server.start(timeout_s=300)
    yield server
    server.stop()


def _raw(server, method, path, body: bytes = b"", headers=(), timeout=120):
    """A raw HTTP exchange (header values as bytes, repeated headers allowed). Returns (status, body)."""
    conn = http.client.HTTPConnection(server.spec.host, server.spec.port, timeout=timeout)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        names = {k.lower() for k, _ in headers}
        if "content-type" not in names:
            conn.putheader("Content-Type", "application/json")
        for k, v in headers:
            conn.putheader(k, v)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _gen(server, ids, tenant=None, max_new=4, extra=None, headers=()):
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new}, **(extra or {})}
    hdrs = list(headers) + ([(HEADER, tenant)] if tenant is not None else [])
    status, raw = _raw(server, "POST", "/generate", json.dumps(body).encode(), hdrs)
    return status, (json.loads(raw) if status == 200 else raw)


# ---------------------------------------------------------------- the differential soak
def _soak_workload(n: int, seed: int = 0):
    """Seeded multi-tenant traffic: per-tenant system prompts with multi-turn conversations,
    shared documents, exact repeats, one-shot prompts, sub-page and near-limit prompts, and
    no-store hints. Returns a list of (tenant or None, token ids, no_store)."""
    rng = random.Random(seed)
    tok = lambda k: [rng.randrange(10, 2000) for _ in range(k)]  # noqa: E731
    tenants = [None, "acme", "globex", "initech", "umbrella"]
    system = {t: tok(rng.randrange(60, 260)) for t in tenants}
    docs = [tok(rng.randrange(200, 700)) for _ in range(6)]
    convs: dict = {}
    out, seen = [], []
    for _ in range(n):
        t = rng.choice(tenants)
        r = rng.random()
        if r < 0.35:  # next turn of a conversation (history grows)
            key = (t, rng.randrange(3))
            hist = convs.get(key) or system[t] + tok(rng.randrange(8, 40))
            hist = hist + tok(rng.randrange(8, 60))
            if len(hist) > 2600:
                hist = system[t] + tok(20)
            convs[key] = hist
            ids = hist
        elif r < 0.55:
            ids = system[t] + rng.choice(docs) + tok(rng.randrange(1, 50))
        elif r < 0.70 and seen:
            t, ids = rng.choice(seen)  # an exact repeat
        elif r < 0.80:
            ids = tok(rng.randrange(1, PAGE))  # sub-page
        elif r < 0.85:
            ids = tok(rng.randrange(2900, 3300))  # near the 4,096-token device pool
        else:
            ids = tok(rng.randrange(100, 900))  # one-shot
        no_store = rng.random() < 0.08
        out.append((t, ids, no_store))
        seen.append((t, ids))
    return out


def _check_conservation(stats):
    tenants = stats["tenants"].values()
    for k in ("requests", "requests_hit", "prompt_tokens", "cached_tokens", "admitted_pages",
              "evicted_pages", "invalidated_pages", "no_store_requests", "resident_pages", "requeued_requests"):  # fmt: skip
        assert sum(t[k] for t in tenants) == stats["totals"][k], k
    assert stats["totals"]["resident_pages"] >= 0


def test_differential_soak(soak_server, reference32):
    """Outputs equal the no-cache server's, judged by ``dev.greedy.compare``: same tokens with
    logprobs within 1e-3, or a divergence exactly at a reference near-tie (float32 noise between
    batch shapes; CI at stop 19 saw one prompt with a 6.5e-5 margin flip twice)."""
    _run_soak(soak_server, reference32, SOAK_REQUESTS)


@pytest.fixture(scope="module")
def soak_server_page1(tiny_model_path, tmp_path_factory):
    """The soak server at page size 1 (SGLang's default), T1 private."""
    from sglang_tiered.dev.server import Server, ServerSpec

    spec = ServerSpec(model_path=tiny_model_path, page_size=1, max_total_tokens=4096, dtype="float32",
                      extra_args=["--max-running-requests", "8"],
                      env={"SGLANG_TIERED_HOST": "on", "SGLANG_TIERED_HOST_RATIO": "4",
                           "SGLANG_TIERED_DEBUG": "1", "SGLANG_TIERED_TENANT_HEADER": HEADER})  # fmt: skip
    server = Server(spec, tmp_path_factory.mktemp("soak1") / "soak1.log")
    server.start(timeout_s=300)
    yield server
    server.stop()


def test_differential_soak_at_page_size_1(soak_server_page1, reference32):
    """The soak at SGLang's default page size (every other end-to-end test runs at 16; session
    18): same outputs as no cache, both tiers used, invariants checked after every operation."""
    _run_soak(soak_server_page1, reference32, max(100, SOAK_REQUESTS // 3))


def _reference_outputs(reference, prompts) -> dict:
    """The no-cache server's greedy outputs, with ``LOGPROBS`` for ``dev.greedy.compare``:
    ``prompts`` is (token ids, max new tokens) pairs; returns {tuple(ids): output}."""
    from sglang_tiered.dev.greedy import LOGPROBS

    uniq = list({tuple(ids): mn for ids, mn in prompts}.items())
    want = {}
    with ThreadPoolExecutor(4) as pool:
        for (ids, _), (status, out) in zip(uniq, pool.map(lambda x: _gen(reference, list(x[0]), max_new=x[1],
                                                                          extra=LOGPROBS), uniq)):  # fmt: skip
            assert status == 200, out
            want[ids] = out
    return want


def _run_soak(soak_server, reference32, n: int):
    from sglang_tiered.dev.greedy import LOGPROBS, compare

    work = _soak_workload(n)
    want = _reference_outputs(reference32, [(ids, 4) for _, ids, _ in work])

    def one(item):
        t, ids, no_store = item
        extra = {"kv_transfer_params": {"lmcache.skip_save": True}} if no_store else {}
        return _gen(soak_server, ids, tenant=t, extra={**extra, **LOGPROBS})

    mismatches, ties, errors, cached, sent = [], [], [], 0, 0
    invalidations = [{"tenant": "acme"}, {"all": True}, {"tenant": "globex"}, {"model_version": "default"}]
    with ThreadPoolExecutor(6) as pool:
        for start in range(0, len(work), 100):
            chunk = work[start : start + 100]
            for (t, ids, _), (status, out) in zip(chunk, pool.map(one, chunk)):
                sent += 1
                if status != 200:
                    errors.append((status, out))
                    continue
                cached += out["meta_info"]["cached_tokens"]
                verdict, why = compare(want[tuple(ids)], out)
                if verdict != "equal":
                    (ties if verdict == "tie" else mismatches).append((t, len(ids), out["meta_info"]["cached_tokens"], why))
            status, stats = soak_server.request("GET", "/cache/stats")
            assert status == 200
            _check_conservation(stats)
            inv = invalidations[(start // 100) % len(invalidations)]
            status, body = soak_server.request("POST", "/cache/invalidate", inv)
            assert status == 202, body
    assert not errors, errors[:5]
    assert not mismatches, f"{len(mismatches)} of {sent} outputs differ from no-cache: {mismatches[:5]}"
    print(f"soak: {sent} requests, {len(ties)} diverged at a float32 near-tie of the reference: {ties[:5]}")
    assert len(ties) <= sent // 50, ties  # near-ties are rare; many would mean the tolerance hides a bug
    status, stats = soak_server.request("GET", "/cache/stats")
    _check_conservation(stats)
    host = next(t for t in stats["tiers"] if t["name"] == "host")
    assert host["promotions"] > 0 and cached > 0  # the soak exercised both tiers
    assert host["foreign_slots"] == 0
    assert "Traceback" not in soak_server.log_path.read_text()


# ---------------------------------------------------------------- fuzz of the HTTP surface
_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                       st.text(max_size=20))  # fmt: skip
_json = st.recursive(_json_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                     max_leaves=12)  # fmt: skip
_small = st.one_of(st.integers(0, 2), _json_leaf)
_text = st.text(st.characters(codec="utf-8"), max_size=60)
_valid = {  # field -> a valid value; each drawn field is valid 3 times in 4, else any JSON
    "/generate": {"text": _text, "input_ids": st.lists(st.integers(10, 2000), min_size=1, max_size=40),
                  "sampling_params": st.fixed_dictionaries({"max_new_tokens": st.integers(0, 2), "temperature": st.just(0)}),
                  "cache_salt": st.text(max_size=8), "extra_key": st.text(max_size=8), "stream": st.booleans()},
    "/v1/completions": {"model": st.just("default"), "prompt": _text, "max_tokens": st.integers(1, 2),
                        "cache_salt": st.text(max_size=8), "stream": st.booleans()},
    "/v1/chat/completions": {"model": st.just("default"), "max_tokens": st.integers(1, 2), "cache_salt": st.text(max_size=8),
                             "stream": st.booleans(),
                             "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                                                         "content": _text}), min_size=1, max_size=3)},
}  # fmt: skip
_required = {"/generate": ("text", "sampling_params"), "/v1/completions": ("model", "prompt", "max_tokens"),
             "/v1/chat/completions": ("model", "messages", "max_tokens")}  # fmt: skip
_limits = {"/generate": ("sampling_params", {"max_new_tokens": 2}), "/v1/completions": ("max_tokens", 2),
           "/v1/chat/completions": ("max_tokens", 2)}  # fmt: skip


def _field(draw, strategy):
    return draw(strategy) if draw(st.integers(0, 3)) else draw(_json)


@st.composite
def _requests(draw):
    path = draw(st.sampled_from(list(_valid) * 3 + ["/v1/responses", "/v1/embeddings", "/v1/messages", "/cache/invalidate"]))
    kind = draw(st.sampled_from(["fields"] * 6 + ["json", "bytes", "deep"]))
    if kind == "fields" and path in _valid:
        fields = _valid[path]
        names = set(_required[path]) | set(draw(st.lists(st.sampled_from(sorted(fields)), max_size=3)))
        body = {n: _field(draw, fields[n]) for n in sorted(names) if draw(st.integers(0, 9))}
        key, limit = _limits[path]
        body.setdefault(key, limit)  # bound generation when the field is absent
        if draw(st.booleans()):
            body["kv_transfer_params"] = _field(draw, st.fixed_dictionaries({"lmcache.skip_save": st.booleans()}))
        if path == "/generate" and draw(st.integers(0, 3)) == 0:
            sp = body.get("sampling_params")
            if isinstance(sp, dict):
                sp["custom_params"] = _field(draw, st.dictionaries(st.text(max_size=5), _json_leaf, max_size=2))
        raw = json.dumps(body).encode()
    elif kind == "fields" and path == "/cache/invalidate":
        raw = json.dumps(draw(st.dictionaries(st.sampled_from(["tenant", "model_version", "all", "x"]), _json_leaf,
                                              max_size=3))).encode()  # fmt: skip
    elif kind in ("fields", "json"):
        raw = json.dumps(draw(_json)).encode()
    elif kind == "bytes":
        raw = draw(st.binary(max_size=200))
    else:
        depth = draw(st.integers(900, 5000))
        inner = draw(st.sampled_from([b"[", b'{"a":']))
        close = b"]" if inner == b"[" else b"}"
        raw = inner * depth + close * depth
    headers = []
    tenant = draw(st.one_of(st.none(), st.text(st.characters(codec="ascii"), max_size=12).map(str.encode),
                            st.text(max_size=12).map(str.encode), st.binary(max_size=12)))  # fmt: skip
    if tenant is not None:
        tenant = tenant.replace(b"\r", b"").replace(b"\n", b"")  # not sendable as one header
        headers.append((HEADER, tenant.strip() or b"t"))
        if draw(st.integers(0, 9)) == 0:
            headers.append((HEADER, b"other"))
    if draw(st.integers(0, 4)) == 0:
        headers.append(("Content-Encoding", draw(st.sampled_from([b"gzip", b"identity", b"br", b"x"]))))
    if draw(st.integers(0, 9)) == 0:
        headers.append(("x-body-compressed", draw(st.sampled_from([b"gzip", b"zstd", b"nope"]))))
    return path, raw, headers


def _bad_field_value(v: bytes) -> bool:
    return any(c < 0x20 and c != 0x09 or c == 0x7F for c in v)


def test_fuzz_http_surface_never_5xx(soak_server):
    """Tenant mode (a trusted tenant header), T1 on, debug invariants."""
    _fuzz(soak_server, FUZZ_REQUESTS)


def test_fuzz_http_surface_never_5xx_without_a_tenant_header(tiny_model_path, tmp_path):
    """A plain server (its own: the fuzz's invalidations would reach the shared one): the
    middleware judges less there, so SGLang sees more of what the fuzz sends (session 26:
    non-object and too-deep JSON answered 500 here; in tenant mode they were refused)."""
    from sglang_tiered.dev.server import Server, ServerSpec

    spec = ServerSpec(model_path=tiny_model_path, page_size=PAGE, max_total_tokens=4096,
                      env={"SGLANG_TIERED_HOST": "on", "SGLANG_TIERED_DEBUG": "1"})  # fmt: skip
    with Server(spec, tmp_path / "plain.log") as server:
        _fuzz(server, FUZZ_REQUESTS // 2)


def _fuzz(server, n: int, requests=None, derandomize: bool = True, refuse_5xx: bool = True) -> None:
    """Send ``n`` drawn requests (default ``_requests()``) one at a time; fail when the server dies
    or breaks a response (naming the last requests), and on a 5xx when ``refuse_5xx``; then check
    the server still serves."""
    seen, recent = [], []

    @settings(max_examples=n, deadline=None, derandomize=derandomize, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(_requests() if requests is None else requests)
    def fuzz(req):
        path, raw, headers = req
        recent.append(req)
        del recent[:-3]
        try:
            status, body = _raw(server, "POST", path, raw, headers, timeout=300)
        except (ConnectionError, http.client.HTTPException) as exc:
            # A header value with control bytes is not HTTP (RFC 9110 field-value): uvicorn's h11
            # answers 400 and closes, and when the close beats the client's read the client sees
            # a reset instead of the 400 (CI, stop 19: seen once, not on the rerun). That is a
            # rejection, not a 5xx.
            if not isinstance(exc, ConnectionResetError) or not any(_bad_field_value(v) for _, v in headers):
                # the server died or broke a response: name the requests that did it (Hypothesis's
                # replay only meets a dead server; the CI failure of session 25 showed no more)
                raise AssertionError(f"{exc!r} after these requests (oldest first): {recent}") from None
            status, body = 400, b"connection closed on an invalid header"
        seen.append(status)
        assert status < 500 or not refuse_5xx, (path, raw[:200], headers, status, body[:300])

    fuzz()
    assert len(seen) >= n
    from collections import Counter

    print(f"fuzz: {len(seen)} requests, statuses {sorted(Counter(seen).items())}")
    status, out = _gen(server, list(range(100, 140)), tenant="after-fuzz")
    assert status == 200 and len(out["output_ids"]) == 4  # still serving


# ---------------------------------------------------------------- fuzz of sampling and logprob fields
# Sensible and extreme values of the sampling, logprob and grammar fields of the three main routes
# (session 26: it found two bodies that killed stock SGLang's scheduler, a top-k of logprobs past
# the vocabulary and a top_k past int32). SGLang answers some wrong types with a 500 itself
# (``"response_format": 1``), so this fuzz asks only that the server never dies and never breaks
# a response. ``SGLANG_TIERED_FUZZ_SAMPLING`` requests (0 in CI: ``make soak`` runs 3,000).
FUZZ_SAMPLING = int(os.environ.get("SGLANG_TIERED_FUZZ_SAMPLING", "0"))
_S_num = st.one_of(st.integers(-5, 5), st.integers(-10**6, 10**6), st.floats(allow_nan=True, allow_infinity=True),
                st.sampled_from([0, 1, 2, 2047, 2048, 2049, 4095, 4096, 4097, 10**5, -1]))
_S_anyv = st.one_of(_S_num, _json_leaf, st.lists(_S_num, max_size=3), st.dictionaries(st.text(max_size=4), _S_num, max_size=2))
_S_ids = st.lists(st.integers(-3, 2100), min_size=0, max_size=6)
_S_SP = {"n": st.integers(0, 4), "stop_token_ids": _S_ids, "logit_bias": st.dictionaries(st.integers(-5, 2100).map(str), _S_num, max_size=2),
      "min_new_tokens": st.integers(-2, 6), "max_new_tokens": st.integers(0, 3), "regex": st.sampled_from(["a+", "(", "[a-z]{2}", ""]),
      "json_schema": st.sampled_from(['{"type": "object"}', "{", '{"type": "string", "maxLength": 3}']),
      "ebnf": st.sampled_from(['root ::= "a"', "root ::="]), "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2)),
      "frequency_penalty": _S_num, "presence_penalty": _S_num, "repetition_penalty": _S_num, "top_k": _S_num, "top_p": _S_num, "min_p": _S_num,
      "temperature": _S_num, "ignore_eos": st.booleans(), "skip_special_tokens": st.booleans(), "no_stop_trim": st.booleans(),
      "sampling_seed": _S_num, "stream_interval": _S_num}
_S_GEN = {"return_logprob": st.booleans(), "logprob_start_len": _S_num, "top_logprobs_num": _S_num, "token_ids_logprob": _S_ids,
       "return_text_in_logprobs": st.booleans(), "stream": st.booleans(), "return_hidden_states": st.booleans(),
       "rid": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=3), max_size=2)), "priority": _S_num,
       "bootstrap_room": _S_num, "lora_path": st.text(max_size=3), "routed_dp_rank": _S_num, "custom_logit_processor": st.text(max_size=5),
       "input_embeds": st.one_of(st.just([]), st.just([[]]), st.lists(st.lists(st.floats(-1, 1), min_size=1, max_size=3), max_size=2))}
_S_COMP = {"logprobs": _S_num, "echo": st.booleans(), "n": st.integers(0, 4), "best_of": _S_num, "stop": _S_SP["stop"],
        "logit_bias": _S_SP["logit_bias"], "suffix": st.text(max_size=3), "seed": _S_num, "top_k": _S_num, "min_tokens": _S_num,
        "regex": _S_SP["regex"], "json_schema": _S_SP["json_schema"], "temperature": _S_num, "top_p": _S_num, "presence_penalty": _S_num,
        "frequency_penalty": _S_num, "stream": st.booleans(), "stream_options": st.sampled_from([None, {"include_usage": True}, {"x": 1}]),
        "response_format": st.sampled_from([{"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}, {"type": "bad"}]),
        "max_tokens": st.integers(0, 3), "rid": st.text(max_size=3), "ebnf": _S_SP["ebnf"], "no_stop_trim": st.booleans(),
        "return_hidden_states": st.booleans(), "lora_path": st.text(max_size=3)}
_S_CHAT = dict(_S_COMP, top_logprobs=_S_num, logprobs=st.one_of(st.booleans(), _S_num),
            tools=st.sampled_from([[], [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], [{"type": "x"}]]),
            tool_choice=st.sampled_from(["auto", "none", "required", {"type": "function", "function": {"name": "g"}}]),
            continue_final_message=st.booleans(), separate_reasoning=st.booleans(), max_completion_tokens=st.integers(0, 3),
            chat_template_kwargs=st.sampled_from([None, {"enable_thinking": True}, {"x": [1]}]))

def _sfield(draw, s):
    return draw(s) if draw(st.integers(0, 4)) else draw(_S_anyv)

@st.composite
def _sampling_requests(draw):
    path = draw(st.sampled_from(["/generate", "/v1/completions", "/v1/chat/completions"]))
    if path == "/generate":
        body = {"text": draw(st.text(max_size=20))} if draw(st.booleans()) else {"input_ids": draw(st.lists(st.integers(10, 2000), min_size=1, max_size=20))}
        sp = {"max_new_tokens": draw(st.integers(0, 3))}
        for k in draw(st.lists(st.sampled_from(sorted(_S_SP)), max_size=4, unique=True)):
            sp[k] = _sfield(draw, _S_SP[k])
        body["sampling_params"] = sp
        for k in draw(st.lists(st.sampled_from(sorted(_S_GEN)), max_size=4, unique=True)):
            body[k] = _sfield(draw, _S_GEN[k])
    else:
        body = {"model": "default", "max_tokens": 2}
        if path == "/v1/completions":
            body["prompt"] = draw(st.one_of(st.text(max_size=20), st.lists(st.integers(10, 2000), min_size=1, max_size=10)))
            menu = _S_COMP
        else:
            body["messages"] = [{"role": "user", "content": draw(st.text(max_size=20))}]
            menu = _S_CHAT
        for k in draw(st.lists(st.sampled_from(sorted(menu)), max_size=5, unique=True)):
            body[k] = _sfield(draw, menu[k])
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = 2
    try:
        raw = json.dumps(body).encode()
    except ValueError:
        raw = json.dumps(body, allow_nan=True).encode()
    return path, raw, []


@pytest.mark.skipif(FUZZ_SAMPLING <= 0, reason="SGLANG_TIERED_FUZZ_SAMPLING is 0 (make soak runs it)")
def test_fuzz_sampling_fields_never_kill_the_server(tiny_model_path, tmp_path):
    from sglang_tiered.dev.server import Server, ServerSpec

    spec = ServerSpec(model_path=tiny_model_path, page_size=PAGE, max_total_tokens=4096,
                      env={"SGLANG_TIERED_HOST": "on", "SGLANG_TIERED_DEBUG": "1"})  # fmt: skip
    with Server(spec, tmp_path / "sampling.log") as server:
        _fuzz(server, FUZZ_SAMPLING, _sampling_requests(), derandomize=False, refuse_5xx=False)
        assert server.proc.poll() is None and server.request("GET", "/health")[0] == 200


# ---------------------------------------------------------------- one test per finding
def test_second_server_on_the_same_named_t1_fails_fast(soak_server, tiny_model_path, tmp_path):
    """Finding 1: two live servers on one named T1 overwrote each other's slots."""
    from sglang_tiered.dev.server import Server, ServerSpec, ServerStartError

    spec = ServerSpec(model_path=tiny_model_path, max_total_tokens=2048,
                      env={"SGLANG_TIERED_HOST": "on", "SGLANG_TIERED_HOST_NAME": T1_NAME})  # fmt: skip
    with pytest.raises(ServerStartError, match="code 2"):
        Server(spec, tmp_path / "second.log").start(timeout_s=120)
    assert "in use by another live server" in (tmp_path / "second.log").read_text()
    assert _gen(soak_server, list(range(50, 90)))[0] == 200  # the owner serves on


def test_t1_bigger_than_its_tmpfs_turns_off_and_serves(tiny_model_path, tmp_path):
    """Finding 2: a named T1 larger than the tmpfs behind it crashed the scheduler with SIGBUS."""
    from sglang_tiered.dev.server import Server, ServerSpec

    mnt = tmp_path / "shm"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        spec = ServerSpec(model_path=tiny_model_path, max_total_tokens=2048,
                          env={"SGLANG_TIERED_HOST": "on", "SGLANG_TIERED_HOST_NAME": "small",
                               "SGLANG_TIERED_HOST_GB": "0.05", "SGLANG_TIERED_SHM_DIR": str(mnt)})  # fmt: skip
        with Server(spec, tmp_path / "small.log") as server:
            for i in range(12):  # more than the pool: evictions would demote into T1
                status, out = _gen(server, [(i * 37 + j) % 1900 + 10 for j in range(400)])
                assert status == 200
            host = next(t for t in server.request("GET", "/cache/stats")[1]["tiers"] if t["name"] == "host")
        assert not host["enabled"] and "too small" in host["decision"]
        assert (tmp_path / "small.log").read_text().count("T1 disabled") == 1
    finally:
        subprocess.run(["umount", str(mnt)])


@pytest.mark.parametrize("headers", [[("Content-Encoding", b"gzip")], [("Content-Encoding", b"identity")],
                                     [("Content-Encoding", b"br"), ("Content-Encoding", b"x")], []])  # fmt: skip
def test_tenant_header_cannot_be_bypassed(soak_server, headers):
    """Finding 3: with a Content-Encoding header the middleware skipped its rewrite while SGLang
    still parsed the body, so a client's cache_salt reached another tenant's entries."""
    rng = random.Random(repr(headers))  # a prompt of its own per case
    ids = [rng.randrange(10, 2000) for _ in range(320)]
    assert _gen(soak_server, ids, tenant="victim")[0] == 200
    assert _gen(soak_server, ids, tenant="victim")[1]["meta_info"]["cached_tokens"] >= 304
    for attacker in ("attacker", None):
        status, out = _gen(soak_server, ids, tenant=attacker, extra={"cache_salt": "victim"}, headers=headers)
        assert status == 415 or status < 300, out
        if status == 200:
            assert out["meta_info"]["cached_tokens"] == 0
    # a compressed body SGLang does not decompress is refused, not passed through
    status, _ = _raw(soak_server, "POST", "/generate", b"\x1f\x8b\x08\x00garbage", [(HEADER, b"attacker")])
    assert 400 <= status < 500


def test_unsalted_routes_are_refused_in_tenant_mode(soak_server):
    for path in ("/v1/embeddings", "/v1/messages", "/api/generate", "/encode"):
        status, body = _raw(soak_server, "POST", path, b"{}", [(HEADER, b"acme")])
        assert status == 403, (path, body)


def test_t1_keeps_namespaces_apart(soak_server):
    """Finding 4: salt "default" equalled no salt, salt "acme|x" equalled salt acme + extra key x,
    in T1 only (0 tokens from the device tree, 304 from T1). Since session 38 the tenant header
    may not name "default" at all (this server's tenant is its header: a 400)."""
    rng = random.Random(44)
    ids = [rng.randrange(10, 2000) for _ in range(330)]
    pairs = [((None, None), ("default", None)), (("acme|x", None), ("acme", "x")), (("default|k", None), (None, "k"))]
    for (salt_a, ek_a), (salt_b, ek_b) in pairs:
        ids = ids[1:] + ids[:1]  # a fresh prompt per pair
        if salt_b == "default":  # (session 38: the untagged requests' namespace, reserved in header mode)
            status, out = _gen(soak_server, ids, tenant=salt_b)
            assert status == 400 and b"reserved" in out, (status, out)
            continue
        assert _gen(soak_server, ids, tenant=salt_a, extra={"extra_key": ek_a} if ek_a else None)[0] == 200
        assert soak_server.request("POST", "/flush_cache?timeout=30")[0] == 200  # device -> T1 (waits until idle)
        status, out = _gen(soak_server, ids, tenant=salt_b, extra={"extra_key": ek_b} if ek_b else None)
        assert status == 200 and out["meta_info"]["cached_tokens"] == 0, (salt_a, ek_a, salt_b, ek_b)
        status, out = _gen(soak_server, ids, tenant=salt_a, extra={"extra_key": ek_a} if ek_a else None)
        assert out["meta_info"]["cached_tokens"] >= len(ids) - PAGE  # its own namespace: from T1


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
@pytest.mark.parametrize("cp", [[1], "abc", True])
def test_wrong_hint_types_are_4xx(tiered_server, soak_server, path, cp):
    """Finding 5: a no-store hint with custom_params of the wrong type was a 500."""
    if path == "/generate":
        body = {"text": "hello", "sampling_params": {"max_new_tokens": 1, "custom_params": cp}}
    else:
        body = {"model": "x", "prompt": "hello", "max_tokens": 1, "custom_params": cp}
    body["kv_transfer_params"] = {"lmcache.skip_save": True}
    for server, hdrs in ((tiered_server, []), (soak_server, [(HEADER, b"acme")])):
        status, raw = _raw(server, "POST", path, json.dumps(body).encode(), hdrs)
        assert 400 <= status < 500, (status, raw[:200])


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_deep_bodies_and_bad_headers_are_4xx(tiered_server, soak_server, path):
    """Finding 5: bodies nested past ~1,000 levels (RecursionError) and a non-UTF-8 tenant header."""
    deep = b'{"kv_transfer_params": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    for server, hdrs in ((tiered_server, []), (soak_server, [(HEADER, b"acme")])):
        for raw in (deep, b"[" * 3000 + b"]" * 3000):
            status, out = _raw(server, "POST", path, raw, hdrs)
            assert status < 500, (status, out[:200])
    status, out = _raw(soak_server, "POST", path, b'{"text": "x"}', [(HEADER, b"\xff\xfe\xc3")])
    assert status == 400 and b"UTF-8" in out
    status, out = _raw(soak_server, "POST", path, b'{"text": "x"}', [(HEADER, b"a"), (HEADER, b"b")])
    assert status == 400


def test_stats_stay_bounded_with_many_long_salts(tiered_server):
    """Finding 6: /cache/stats reached 25 MB with 256 salts of 100 KB each."""
    salt = "s" * 100_000
    for i in range(300):
        status, _ = _raw(tiered_server, "POST", "/generate",
                         json.dumps({"input_ids": [11, 12, 13], "cache_salt": f"{i}-{salt}",
                                     "sampling_params": {"max_new_tokens": 1}}).encode())  # fmt: skip
        assert status == 200
    status, raw = _raw(tiered_server, "GET", "/cache/stats")
    assert status == 200 and len(raw) < 200_000, len(raw)
    stats = json.loads(raw)
    assert len(stats["tenants"]) <= 257 and all(len(n) <= 81 for n in stats["tenants"])


@pytest.mark.parametrize("env,args,says", [
    ({"SGLANG_TIERED_HOST_GB": "inf"}, [], "finite"),
    ({"SGLANG_TIERED_HOST_RATIO": "1e400"}, [], "finite"),
    ({"SGLANG_TIERED_HOST_RATO": "2"}, [], "did you mean SGLANG_TIERED_HOST_RATIO"),
    ({"SGLANG_TIERED_HOST_NAME": "dp-t1"}, ["--dp-size", "2"], "named (shared) T1 with --dp-size 2"),
])  # fmt: skip
def test_bad_config_stops_the_launch(tiny_model_path, tmp_path, env, args, says):
    """Finding 7: the non-finite sizes passed validation and crashed the scheduler after the model
    loaded; a mistyped name was ignored, and a named T1 with --dp-size 2 was turned off in each
    scheduler after the model loaded (review, session 18: the launcher saw the environment only;
    now a hook on SGLang's own argument check sees its arguments too)."""
    from sglang_tiered.dev.server import Server, ServerSpec, ServerStartError

    log = tmp_path / "bad.log"
    spec = ServerSpec(model_path=tiny_model_path, env={"SGLANG_TIERED_HOST": "on", **env}, extra_args=args)
    with pytest.raises(ServerStartError, match="code 2"):
        Server(spec, log).start(timeout_s=120)
    text = log.read_text()
    assert "sglang-tiered: invalid configuration" in text and says in text
    assert "Load weight" not in text  # stopped before the model loaded


def test_tp2_without_a_name_keeps_a_private_t1_per_rank(tiny_model_path, tmp_path):
    """Without a name each TP rank keeps a private T1 of its own heads (session 18: a shared
    unnamed segment let a leading rank change what a lagging one read); both ranks turn it on,
    nothing is left in shared memory, and the second pass of the prompts hits T1."""
    from sglang_tiered.dev.server import Server, ServerSpec
    from sglang_tiered.tier.host_pool import SHM_DIR

    before = set(SHM_DIR.glob("sglang-tiered-*"))
    spec = ServerSpec(model_path=tiny_model_path, tp=2, max_total_tokens=2048, env={"SGLANG_TIERED_HOST": "on"})
    with Server(spec, tmp_path / "tp2.log") as server:
        prompts = [[(i * 31 + j) % 1900 + 10 for j in range(400)] for i in range(8)]
        first = [_gen(server, p) for p in prompts]
        second = [_gen(server, p) for p in prompts]
        assert all(s == 200 for s, _ in first + second)
        assert [o["text"] for _, o in first] == [o["text"] for _, o in second]
        host = next(t for t in server.request("GET", "/cache/stats")[1]["tiers"] if t["name"] == "host")
    log = (tmp_path / "tp2.log").read_text()
    assert log.count("sglang-tiered: T1 on") == 2 and "T1 disabled" not in log
    assert host["demotions"] > 0 and host["promotions"] > 0
    assert set(SHM_DIR.glob("sglang-tiered-*")) == before


def test_out_of_vocab_token_ids_are_400(tiered_server, soak_server):
    """Found by the HTTP fuzz: stock SGLang 0.5.23 passes a token id outside the vocabulary to the
    embedding and its scheduler dies (IndexError): one request took the server down. 400 instead,
    on a plain server and in tenant mode, and the server keeps serving."""
    cases = (("/generate", {"input_ids": [11, 5000], "sampling_params": {"max_new_tokens": 1}}),
             ("/generate", {"input_ids": [[11, 12], [-1]], "sampling_params": {"max_new_tokens": 1}}),
             ("/v1/completions", {"model": "default", "prompt": [11, 99999], "max_tokens": 1}))  # fmt: skip
    for server, hdrs in ((tiered_server, []), (soak_server, [(HEADER, b"acme")])):
        _wait_healthy(server)  # (a fresh server answers /health 503 until SGLang's warmup ends)
        for path, body in cases:
            status, got = _raw(server, "POST", path, json.dumps(body).encode(), hdrs)
            assert status == 400 and "token id" in str(got), (path, status, got)
        assert server.request("GET", "/health")[0] == 200


# Bodies that kill stock SGLang 0.5.23's scheduler (a forward over 0 tokens, an id outside the
# vocabulary on Vertex's route, a top-k of logprobs past the vocabulary) or answer 500 / break a stream (text and input_ids that disagree).
# The first was the CI failure of session 25 (the fuzz drew it; its server died, and every later
# test of this module could not connect); the rest were found by the fuzz with random seeds.
_SERVER_KILLERS = (
    ("/generate", {"input_ids": [], "text": "hello"}),
    ("/generate", {"input_ids": [], "text": "hello", "stream": True}),
    ("/generate", {"input_ids": [[5, 6], []]}),
    ("/generate", {"input_ids": [[]]}),
    ("/generate", {"input_ids": [[]], "text": ["a"]}),
    ("/generate", {"input_ids": [[5], [6]], "text": "hi"}),
    ("/generate", {"input_ids": [5, 6], "text": ["a", "b"], "stream": True}),
    ("/generate", {"input_ids": [[5]], "text": ["a", "b"]}),
    ("/v1/completions", {"model": "default", "prompt": [[5], []], "max_tokens": 1}),
    ("/vertex_generate", {"instances": [{"input_ids": [999999]}]}),
    # session 38: Vertex's parameters are /generate's fields (GenerateReqInput(**inputs, **parameters))
    ("/vertex_generate", {"instances": [{"image_data": None}], "parameters": {"input_ids": [999999]}}),
    ("/vertex_generate", {"instances": [{"text": "a"}], "parameters": {"return_logprob": True, "top_logprobs_num": 100000}}),
    ("/vertex_generate", {"instances": [{"text": "v"}], "parameters": {"sampling_params": {"logit_bias": {"500": 1e39}, "top_k": 5}}}),
    ("/generate", {"text": "a", "return_logprob": True, "top_logprobs_num": 100000}),  # a top-k past the vocabulary
    ("/v1/completions", {"model": "default", "prompt": "a", "max_tokens": 1, "logprobs": 100000}),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "a"}], "max_tokens": 1,
                              "logprobs": True, "top_logprobs": 100000}),
    ("/generate", {"text": "a", "sampling_params": {"top_k": 2**31}}),  # a top_k past int32
    ("/v1/completions", {"model": "default", "prompt": "a", "max_tokens": 1, "top_k": 10**16}),
    # session 27: a bias that overflows float32 (kills the scheduler), a list rid for one prompt
    # (a streamed 200 cut off after its headers), an n that grows the server by gigabytes
    ("/generate", {"text": "v", "sampling_params": {"logit_bias": {"500": 1e39}, "top_k": 5}}),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "a"}], "max_tokens": 1,
                              "logit_bias": {"500": 1e34}, "temperature": 1e-5}),
    ("/generate", {"text": "a", "rid": ["x"], "stream": True}),
    ("/generate", {"text": "a", "sampling_params": {"n": 858808}}),
    ("/generate", {"text": "a", "return_logprob": True, "top_logprobs_num": []}),  # a list for one prompt
    ("/generate", {"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": [0]}),
    ("/generate", {"text": ["a", "b"], "return_logprob": [True], "stream": True}),  # shorter than the batch
    ("/generate", {"text": "9O", "return_hidden_states": []}),
    ("/generate", {"input_ids": list(range(50, 61)), "return_logprob": True, "logprob_start_len": -3}),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": ""}], "max_tokens": 1,
                              "n": 0, "stream": True, "stream_options": {"include_usage": True}}),  # a cut stream
    ("/generate", {"text": "hi", "lora_id": [None]}),
    ("/generate", {"text": "hi", "positional_embed_overrides": {}}),
    ("/generate", {"input_ids": [19, 1541, 1590], "sampling_params": {"max_new_tokens": 0, "ebnf": 'root ::= "a"'},
                   "token_indices_to_pool": [-1]}),  # fmt: skip
    ("/generate", {"text": ["a", "b"], "bootstrap_room": [], "stream": True}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 40, "ignore_eos": True, "regex": "a+",
                                                      "stop_regex": "(a+)+b"}}),  # hangs the scheduler
)


def _wait_healthy(server) -> None:
    """Ready for ``/model_info`` comes before SGLang's warmup ends (``/health`` answers 503 until then)."""
    for _ in range(240):
        if server.request("GET", "/health")[0] == 200:
            return
        time.sleep(0.5)


def test_empty_and_disagreeing_prompts_are_400(tiered_server):
    _wait_healthy(tiered_server)
    for path, body in _SERVER_KILLERS:
        if path == "/generate":
            body = {**body, "sampling_params": {"max_new_tokens": 1, "temperature": 0, **body.get("sampling_params", {})}}
        status, got = _raw(tiered_server, "POST", path, json.dumps(body).encode())
        assert status == 400, (path, body, status, got[:300])
        assert tiered_server.request("GET", "/health")[0] == 200, (path, body)
    # what agrees still serves: SGLang reads input_ids when both are given
    for body in ({"input_ids": [5, 6], "text": "a"}, {"input_ids": [[5], [6, 7]], "text": ["a", "b"]}):
        status, got = _raw(tiered_server, "POST", "/generate",
                           json.dumps({**body, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).encode())  # fmt: skip
        assert status == 200, (body, got[:300])


# Grammars that leave a row no token (session 28): every logit is masked, and stock SGLang 0.5.23's
# top-p/top-k/min-p sampling dies on the NaN probabilities (sampler.py:838; greedy survived). The
# last: a regex that allows only EOS after "a" while min_new_tokens masks EOS.
_NO_TOKEN_LEFT = (
    {"ebnf": "root ::= root", "top_p": 0.9},
    {"ebnf": "root ::= root", "top_k": 5},
    {"ebnf": "root ::= root", "min_p": 0.1},
    {"ebnf": "root ::= root", "temperature": 0},
    {"regex": "a", "min_new_tokens": 3, "top_k": 5},
)


def test_a_grammar_that_allows_no_token_is_that_requests_error(tiered_server):
    """Each such request ends in SGLang's own abort for a token its grammar refuses (what stock
    SGLang's greedy path answers), streamed or not, while a request beside it is served; the
    server serves on."""
    _wait_healthy(tiered_server)
    good = {"text": "a", "sampling_params": {"max_new_tokens": 4, "ebnf": 'root ::= "ab" root', "top_p": 0.9}}
    for sp in _NO_TOKEN_LEFT:
        for stream in (False, True):
            body = {"text": "a", "stream": stream, "sampling_params": {"max_new_tokens": 4, **sp}}
            with ThreadPoolExecutor(2) as pool:
                dead = pool.submit(_raw, tiered_server, "POST", "/generate", json.dumps(body).encode())
                beside = pool.submit(_raw, tiered_server, "POST", "/generate", json.dumps(good).encode())
                (status, got), (good_status, good_got) = dead.result(), beside.result()
            assert b"Grammar accept_token failed" in got, (sp, stream, status, got[:300])
            assert good_status == 200 and b'"abab"' in good_got, good_got[:300]
            assert tiered_server.request("GET", "/health")[0] == 200, sp


def test_a_grammar_pattern_that_overflows_xgrammar_is_400(tiered_server):
    """A JSON-schema pattern of 400,000 nested groups killed stock SGLang 0.5.23's scheduler
    (SIGSEGV in xgrammar's regex visitor: a helper's hunt, session 28), from every route that
    takes a schema; each is a 400 here and the server serves on."""
    from tests.test_review28 import _schema_bodies

    _wait_healthy(tiered_server)
    deep = "(" * 400_000 + "a" + ")" * 400_000
    for path, body in _schema_bodies(deep):
        status, got = _raw(tiered_server, "POST", path, json.dumps(body).encode())
        assert status == 400 and b"pattern nests" in got, (path, status, got[:300])
    assert tiered_server.request("GET", "/health")[0] == 200


def _slow_schema(depth: int) -> str:
    """Arrays nested ``depth`` deep: xgrammar's compile time grows about as depth^3 (200: 0.4 s,
    350: about 2 s on the 2-core box); a second compile is a hit in xgrammar's own cache."""
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return json.dumps(schema)


def test_a_grammar_that_timed_out_is_compiled_again(tiny_model_path, tmp_path):
    """SGLang caches a compile that timed out as an invalid grammar for good (grammar_manager.py
    :319-327): a grammar that timed out once, e.g. behind other slow compiles, was refused to
    every later request (session 28's hunt). With the grammar timeout cut to a few polls here, a
    schema slow to compile times out once; its compile goes on and lands in xgrammar's own cache,
    and the same schema sent again is served (stock: refused at once, "Failed to compile ...
    Grammar preprocessing timed out")."""
    from sglang_tiered.dev.server import Server, ServerSpec

    spec = ServerSpec(model_path=str(tiny_model_path), page_size=PAGE, max_total_tokens=2048,
                      env={"SGLANG_GRAMMAR_MAX_POLL_ITERATIONS": "3"})  # fmt: skip
    schema = _slow_schema(int(os.environ.get("SGLANG_TIERED_SLOW_SCHEMA", "350")))
    body = json.dumps({"text": "a", "sampling_params": {"max_new_tokens": 2, "temperature": 0,
                                                        "json_schema": schema}}).encode()  # fmt: skip
    with Server(spec, tmp_path / "grammar.log") as server:
        _wait_healthy(server)
        status, got = _raw(server, "POST", "/generate", body)
        assert status == 400 and b"timed out" in got, (status, got[:300])
        for _ in range(60):  # until its compile, still going on, has landed in xgrammar's cache
            time.sleep(1.0)
            status, got = _raw(server, "POST", "/generate", body)
            if status == 200:
                break
            assert b"Failed to compile" not in got, got[:300]  # a cached timeout: refused at once
        assert status == 200, got[:300]


def test_a_prompt_with_no_tokens_is_400_with_a_tokenizer_without_bos(tiny_model_path, tmp_path):
    """With a tokenizer that adds no BOS token (as many do), ``{"text": ""}`` tokenizes to nothing
    and stock SGLang 0.5.23's scheduler dies on the 0-token prompt (checked in session 26 with
    this copy of the tiny model). On our backend it is a 400 and the server serves on."""
    import shutil

    from sglang_tiered.dev.server import Server, ServerSpec

    model = tmp_path / "nobos"
    shutil.copytree(tiny_model_path, model)
    tok = json.loads((model / "tokenizer.json").read_text())
    tok["post_processor"] = None  # (the template that prepends <|begin_of_text|>)
    (model / "tokenizer.json").write_text(json.dumps(tok))
    spec = ServerSpec(model_path=str(model), page_size=PAGE, max_total_tokens=2048)
    sp = {"max_new_tokens": 1, "temperature": 0}
    with Server(spec, tmp_path / "nobos.log") as server:
        _wait_healthy(server)
        for path, body in (("/generate", {"text": "", "sampling_params": sp}),
                           ("/generate", {"text": ["a", ""], "sampling_params": sp}),
                           ("/v1/completions", {"model": "default", "prompt": ["a", ""], "max_tokens": 1})):  # fmt: skip
            status, got = _raw(server, "POST", path, json.dumps(body).encode())
            assert status == 400 and b"no tokens" in got, (path, body, status, got[:300])
            assert server.request("GET", "/health")[0] == 200
        status, got = _raw(server, "POST", "/generate", json.dumps({"text": "a", "sampling_params": sp}).encode())
        assert status == 200, got[:300]


def _judge(want: dict, results, differ: list, ties: list) -> None:
    """Each (token ids, (status, output)) against the no-cache server's output (tie-aware):
    appends to ``differ`` and ``ties``."""
    from sglang_tiered.dev.greedy import compare

    for ids, (status, out) in results:
        assert status == 200, out
        verdict, why = compare(want[tuple(ids)], out)
        if verdict == "tie":
            ties.append(why)
        elif verdict == "differ":
            differ.append((len(ids), out["meta_info"]["cached_tokens"], why))


def _final_stats(server) -> dict:
    """The server's /cache/stats (per-tenant counts conserved); no Traceback in its log."""
    status, stats = server.request("GET", "/cache/stats")
    assert status == 200, stats
    _check_conservation(stats)
    assert "Traceback" not in server.log_path.read_text()
    return stats


def test_priority_preemption_serves_what_recomputation_gives(reference32, tiny_model_path, tmp_path):
    """SGLang's priority scheduling (session 29): with two running slots, a higher-priority request
    preempts a running one, which is released unfinished (no checkpoint) and prefilled again
    later, here in chunks of 48 tokens, with T1 on and the debug invariants after every cache
    operation. Every output equals the no-cache server's (tie-aware), and the cache counts the
    re-admissions (``requeued_requests``), so the preemption path really ran."""
    from sglang_tiered.dev.greedy import LOGPROBS
    from sglang_tiered.dev.server import Server, ServerSpec

    rng = random.Random(29)
    tok = lambda k: [rng.randrange(10, 2000) for _ in range(k)]  # noqa: E731
    systems = [tok(rng.randrange(40, 300)) for _ in range(3)]
    rounds = []
    for _ in range(12):  # two long low-priority requests, then two short urgent ones on the same prefix
        base = rng.choice(systems)
        rounds.append([(0, base + tok(rng.randrange(5, 200)), rng.choice([40, 64]), rng.choice([None, "acme"]))
                       for _ in range(2)] +
                      [(10, base + tok(rng.randrange(5, 200)), 8, rng.choice([None, "acme"])) for _ in range(2)])  # fmt: skip
    want = _reference_outputs(reference32, [(ids, mn) for r in rounds for _, ids, mn, _ in r])
    spec = ServerSpec(model_path=tiny_model_path, page_size=PAGE, max_total_tokens=4096, dtype="float32",
                      extra_args=["--enable-priority-scheduling", "--max-running-requests", "2",
                                  "--priority-scheduling-preemption-threshold", "0", "--chunked-prefill-size", "48"],
                      env={"SGLANG_TIERED_HOST": "on", "SGLANG_TIERED_DEBUG": "1", "SGLANG_TIERED_TENANT_HEADER": HEADER})  # fmt: skip
    differ, ties = [], []
    with Server(spec, tmp_path / "priority.log") as server:
        def one(item):
            prio, ids, mn, tenant = item
            if prio:
                time.sleep(0.4)  # the long ones are decoding by then
            return item, _gen(server, ids, tenant=tenant, max_new=mn, extra={"priority": prio, **LOGPROBS})

        for r in rounds:
            with ThreadPoolExecutor(4) as pool:
                _judge(want, [(ids, res) for (_, ids, _, _), res in pool.map(one, r)], differ, ties)
        stats = _final_stats(server)
    assert not differ, differ[:5]
    assert len(ties) <= 2, ties
    assert stats["totals"]["requeued_requests"] > 0, stats["totals"]  # preemptions happened


def test_a_body_cut_off_by_a_client_that_left_is_not_run(soak_server):
    """A client sends less than its ``Content-Length`` and goes away: nothing runs, as on stock
    SGLang (session 29: the part read ran unchecked; a token id past the vocabulary killed the
    scheduler, and the body's own ``cache_salt`` chose the tenant over the trusted header)."""
    import socket

    def cut_off(body: dict) -> None:
        raw = json.dumps(body).encode()
        with socket.create_connection((soak_server.spec.host, soak_server.spec.port), timeout=30) as s:
            s.sendall((f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{HEADER}: "
                       f"intruder\r\nContent-Length: {len(raw) + 16}\r\n\r\n").encode() + raw)  # fmt: skip
            time.sleep(1.0)  # the server has read what was sent

    sp = {"max_new_tokens": 1, "temperature": 0}
    cut_off({"input_ids": list(range(300, 364)), "cache_salt": "spoofed", "sampling_params": sp})
    cut_off({"input_ids": [5000, 5], "sampling_params": sp})
    time.sleep(3)
    status, out = _gen(soak_server, [5, 6, 7], tenant="acme", max_new=2)
    assert status == 200, out
    status, stats = soak_server.request("GET", "/cache/stats")
    assert "spoofed" not in stats["tenants"] and "intruder" not in stats["tenants"], sorted(stats["tenants"])


def test_a_server_running_one_request_at_a_time_serves_what_recomputation_gives(reference32, tiny_model_path,
                                                                                 tmp_path):  # fmt: skip
    """``--max-running-requests 1``: the only server where the adaptive policy runs (one that may
    batch runs lru's order itself). Clients send 8 at a time, so requests wait, and SGLang
    refreshes the waiting requests' cached prefixes (``touch_prefix``), which the policy's tree
    shadows replay (session 36). Shared system prompts across two tenants, one-shot scans that
    evict, a device pool of 2,048 tokens, the debug invariants after every cache operation:
    every output equals the no-cache server's (tie-aware), and the stats show the serial
    policy (not lru's order forced), no overlap, and the refreshes replayed."""
    from sglang_tiered.dev.greedy import LOGPROBS
    from sglang_tiered.dev.server import Server, ServerSpec

    rng = random.Random(36)
    tok = lambda k: [rng.randrange(10, 2000) for _ in range(k)]  # noqa: E731
    systems = [tok(rng.randrange(60, 200)) for _ in range(5)]
    items = [(rng.choice(systems) + tok(rng.randrange(3, 60)), rng.choice([None, "acme"])) for _ in range(60)]
    items += [(tok(rng.randrange(400, 700)), None) for _ in range(6)]  # one-shot scans: evictions
    rng.shuffle(items)
    want = _reference_outputs(reference32, [(ids, 4) for ids, _ in items])
    spec = ServerSpec(model_path=tiny_model_path, page_size=PAGE, max_total_tokens=2048, dtype="float32",
                      extra_args=["--max-running-requests", "1"],
                      env={"SGLANG_TIERED_DEBUG": "1", "SGLANG_TIERED_TENANT_HEADER": HEADER})  # fmt: skip
    differ, ties = [], []
    with Server(spec, tmp_path / "serial.log") as server:
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda it: _gen(server, it[0], tenant=it[1], extra=LOGPROBS), items))
        _judge(want, [(ids, res) for (ids, _), res in zip(items, outs)], differ, ties)
        stats = _final_stats(server)
    assert not differ, differ[:5]
    assert len(ties) <= 2, ties
    assert stats["totals"]["cached_tokens"] > 0
    pol = stats["policy"][0]
    assert pol["max_in_flight"] == 1 and pol["burst_lru"] is False and pol["strict_guarantee"] is True, pol
    assert pol["overlapped_requests"] == 0, pol
    assert pol["replayed_touches"] > 0, pol  # SGLang refreshed waiting prefixes and the shadows saw it
    assert pol["evicted_pages"] > 0, pol
