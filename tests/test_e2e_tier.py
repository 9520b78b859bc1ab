"""T1 end to end on CPU servers: promotions under a small device pool, and a warm restart across a
TP change (float32, exact), and a restart with changed weights (no hits)."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.test_e2e_server import make_prompt

pytestmark = pytest.mark.server


def _gen(server, prompts, n=6):
    return [server.generate({"text": p, "sampling_params": {"temperature": 0, "max_new_tokens": n}}) for p in prompts]


def test_t1_promotions_match_no_cache(tiny_model_path, reference_server, tmp_path):
    """Also with the prefix-aware extend attention on (integration/prefix_attention.py): promoted
    and device-cached prefixes give the reference's greedy outputs (float32)."""
    from sglang_tiered.dev.server import Server, ServerSpec

    prompts = [make_prompt(700 + i, 420) for i in range(8)]  # ~3.4k tokens > 2,048-token pool
    rounds = prompts + prompts[:4] + prompts[::-1]
    spec = ServerSpec(model_path=tiny_model_path, max_total_tokens=2048,
                      env={"SGLANG_TIERED_HOST": "on", "SGLANG_TIERED_HOST_RATIO": "4", "SGLANG_TIERED_DEBUG": "1",
                           "SGLANG_TIERED_PREFIX_ATTENTION": "on"})  # fmt: skip
    with Server(spec, tmp_path / "t1.log") as server:
        got = _gen(server, rounds)
        status, stats = server.request("GET", "/cache/stats")
        assert "extend attention computes only new rows" in server.log_tail(10_000)
    host = next(t for t in stats["tiers"] if t["name"] == "host")
    assert host["enabled"] and host["demotions"] > 0 and host["promotions"] > 0
    assert stats["totals"]["promoted_pages"] == host["promotions"]
    # cached_tokens counts promoted tokens: the pool cannot hold round 2 on device alone.
    assert sum(g["meta_info"]["cached_tokens"] for g in got[8:]) > 2048 * 2
    want = {p: o["output_ids"] for p, o in zip(prompts, _gen(reference_server, prompts))}
    for p, g in zip(rounds, got):
        assert g["output_ids"] == want[p]


def test_warm_restart_across_tp_change_and_changed_weights(tiny_model_path, tmp_path):
    from sglang_tiered.dev.server import Server, ServerSpec

    name = f"warm-{os.getpid()}"
    common = dict(max_total_tokens=2048, dtype="float32", extra_args=["--served-model-name", "tiny"])
    env = {"SGLANG_TIERED_HOST": "on", "SGLANG_TIERED_HOST_NAME": name, "SGLANG_TIERED_HOST_RATIO": "8"}
    prompts = [make_prompt(800 + i, 300) for i in range(5)]
    try:
        with Server(ServerSpec(model_path=tiny_model_path, env=env, **common), tmp_path / "tp1.log") as s1:
            first = _gen(s1, prompts)
            assert all(o["meta_info"]["cached_tokens"] == 0 for o in first)
            assert s1.request("POST", "/flush_cache?timeout=30")[0] == 200  # device pages -> T1 (waits until idle)
            t1 = next(t for t in s1.request("GET", "/cache/stats")[1]["tiers"] if t["name"] == "host")
            assert t1["resident_pages"] >= sum(o["meta_info"]["prompt_tokens"] // 16 for o in first) - 5
        with Server(ServerSpec(model_path=tiny_model_path, tp=2, env=env, **common), tmp_path / "tp2.log") as s2:
            warm = _gen(s2, prompts)
            log = (tmp_path / "tp2.log").read_text()
        assert "pages restored" in log
        assert "the 2 TP ranks agree on every transfer" in log  # (review, session 23)
        assert all(o["meta_info"]["cached_tokens"] >= o["meta_info"]["prompt_tokens"] - 16 for o in warm)
        ref_spec = ServerSpec(model_path=tiny_model_path, tp=2, backend=None, disable_radix_cache=True, **common)
        with Server(ref_spec, tmp_path / "tp2ref.log") as ref:
            want = _gen(ref, prompts)
        for w, r in zip(warm, want):  # float32: KV stored at TP=1, served at TP=2, exact
            assert w["output_ids"] == r["output_ids"]
        # Same shapes, one weight byte changed: the digest differs, so T1 must not serve anything.
        changed = tmp_path / "changed-model"
        shutil.copytree(tiny_model_path, changed)
        data = bytearray((changed / "model.safetensors").read_bytes())
        data[-1] ^= 0x01
        (changed / "model.safetensors").write_bytes(bytes(data))
        with Server(ServerSpec(model_path=str(changed), env=env, **common), tmp_path / "changed.log") as s3:
            cold = _gen(s3, prompts)
        assert all(o["meta_info"]["cached_tokens"] == 0 for o in cold)
        # Same folder, --load-format dummy (random weights, not the files the digest reads): its
        # identity is its own lifetime's, so the real weights' pages in T1 are not served to it
        # (before, it was served all of them: a helper's audit, session 37)
        dummy = dict(common, extra_args=common["extra_args"] + ["--load-format", "dummy"])
        with Server(ServerSpec(model_path=tiny_model_path, env=env, **dummy), tmp_path / "dummy.log") as s4:
            cold = _gen(s4, prompts)
        assert all(o["meta_info"]["cached_tokens"] == 0 for o in cold)
        assert "--load-format dummy does not load the model's files" in (tmp_path / "dummy.log").read_text()
    finally:
        from sglang_tiered.tier.host_pool import SHM_DIR

        for p in SHM_DIR.glob(f"sglang-tiered-{name}*"):
            p.unlink()
