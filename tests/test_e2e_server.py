"""End to end against real SGLang server processes on CPU (tiny model, page size 16)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.server

PAGE = 16
WORDS = "the cache model token prefix page tier host device memory request server tenant policy".split()


def make_prompt(seed: int, n_words: int) -> str:
    state = seed * 7919 + 17
    out = []
    for _ in range(n_words):
        state = (state * 1103515245 + 12345) % (1 << 31)
        out.append(WORDS[state % len(WORDS)])
    return " ".join(out)


def greedy(server, text: str, max_new_tokens: int = 12, **extra) -> dict:
    payload = {
        "text": text,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
        **extra,
    }
    return server.generate(payload)


def test_log_names_our_class(tiered_server):
    log = tiered_server.log_path.read_text()
    assert "impl=TieredRadixCache" in log
    assert "source=registered('tiered')" in log


def test_second_identical_request_hits_down_to_page_boundary(tiered_server):
    text = make_prompt(1, 400)
    first = greedy(tiered_server, text)
    second = greedy(tiered_server, text)
    prompt_len = second["meta_info"]["prompt_tokens"]
    assert prompt_len > 300
    assert first["meta_info"]["cached_tokens"] < PAGE
    assert second["meta_info"]["cached_tokens"] >= prompt_len - PAGE
    assert second["meta_info"]["cached_tokens"] % PAGE == 0
    assert first["text"] == second["text"]


def test_greedy_outputs_match_no_cache_reference(tiered_server, reference_server):
    # Shared prefixes (so the tiered server really serves cached KV) plus unrelated prompts.
    base = make_prompt(2, 200)
    prompts = [base + " " + make_prompt(100 + i, 20 + 7 * i) for i in range(6)]
    prompts += [make_prompt(200 + i, 50 + 40 * i) for i in range(4)] + [base]
    got = [greedy(tiered_server, p) for p in prompts]
    want = [greedy(reference_server, p) for p in prompts]
    assert sum(g["meta_info"]["cached_tokens"] for g in got) > 5 * 190  # the prefix was reused
    assert all(w["meta_info"]["cached_tokens"] == 0 for w in want)
    for p, g, w in zip(prompts, got, want):
        assert g["output_ids"] == w["output_ids"], p[:60]


def test_backend_not_registered_when_plugin_excluded(tiny_model_path, tmp_path):
    from sglang_tiered.dev.server import Server, ServerSpec, ServerStartError

    spec = ServerSpec(model_path=tiny_model_path, backend="tiered", env={"SGLANG_PLUGINS": "none"})
    server = Server(spec, tmp_path / "excluded.log")
    with pytest.raises(ServerStartError) as err:
        server.start(timeout_s=180)
    server.stop()
    assert "--radix-cache-backend='tiered' is not registered" in str(err.value)


def test_tenants_never_share_entries(tiered_server):
    text = make_prompt(7, 300)
    a1 = greedy(tiered_server, text, cache_salt="tenant-a")
    a2 = greedy(tiered_server, text, cache_salt="tenant-a")
    b1 = greedy(tiered_server, text, cache_salt="tenant-b")
    assert a2["meta_info"]["cached_tokens"] >= a2["meta_info"]["prompt_tokens"] - PAGE
    assert b1["meta_info"]["cached_tokens"] == 0  # same prompt, other tenant: no hit
    assert a1["output_ids"] == b1["output_ids"]


def test_workload_larger_than_device_pool_matches_no_cache(tiered_server, reference_server):
    # ~14 prompts of 350-650 tokens, two rounds: ~2.5x the 4,096-token pool, with shared prefixes.
    shared = [make_prompt(300 + i, 150) for i in range(3)]
    prompts = [shared[i % 3] + " " + make_prompt(400 + i, 150 + 25 * (i % 5)) for i in range(14)]
    rounds = prompts + prompts[::-1]
    got = [greedy(tiered_server, p, max_new_tokens=8) for p in rounds]
    want = {p: greedy(reference_server, p, max_new_tokens=8)["output_ids"] for p in prompts}
    assert sum(len(p.split()) for p in rounds) > 2 * 4096
    assert sum(g["meta_info"]["cached_tokens"] for g in got) > 0
    for p, g in zip(rounds, got):
        assert g["output_ids"] == want[p], p[:50]


def test_edge_prompts_do_not_crash_or_leak(tiered_server):
    for text in ["a", "x y", make_prompt(9, 3000)]:
        out = greedy(tiered_server, text, max_new_tokens=2)
        assert out["meta_info"]["prompt_tokens"] >= 1
    out = greedy(tiered_server, make_prompt(10, 50), max_new_tokens=2, cache_salt="never-seen-tenant")
    assert out["meta_info"]["cached_tokens"] == 0
    status, body = tiered_server.request("POST", "/generate", {"text": "", "sampling_params": {"max_new_tokens": 2}})
    assert status in (200, 400), body
    # The server still answers normally afterwards (no leaked slots: SGLang's idle checker is on).
    assert greedy(tiered_server, make_prompt(1, 400))["meta_info"]["cached_tokens"] >= 0
    status, _ = tiered_server.request("GET", "/health")
    assert status == 200


def test_a_stock_server_beside_the_plugin_is_sglangs_own(reference_server):
    """The plugin is installed in this environment, but the reference server did not ask for the
    tiered backend: no /cache/* routes and no request middleware (review, session 23: both were
    mounted on every server)."""
    assert reference_server.request("GET", "/cache/stats")[0] == 404
    assert "mounted /cache/stats" not in reference_server.log_path.read_text(errors="replace")
