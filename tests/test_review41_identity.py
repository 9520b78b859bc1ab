"""The cache identity, hunted through SGLang 0.5.23's request fields, weight-memory calls and
server args (a helper's hunt, session 41).

* Compute settings besides the attention backend changed the KV for the same weights and tokens
  and were not in the identity: ``--model-impl`` (Transformers' modeling code), the
  batch-invariant kernels of ``--enable-deterministic-inference``, ``--rl-on-policy-target``,
  ``--enable-tf32-matmul``, ... Two servers that differ in one shared KV through T2 or a named T1.
* ``--modelopt-checkpoint-restore-path``: ModelOpt's quantized weights come from that checkpoint;
  only the method was named.
* ``/resume_memory_occupation`` of weights released without ``--enable-weights-cpu-backup``:
  the weights are fresh memory until the next weight update, and KV computed in between was kept
  under the old identity (T1, and T2 for every server on those weights).
"""

from __future__ import annotations

import types
from types import SimpleNamespace as NS

import pytest

from sglang_tiered.core.keys import CacheKey
from sglang_tiered.integration.identity import cache_key_from_context
from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache
from tests.test_identity_hardening import _ctx
from tests.test_review37 import _model


def test_compute_settings_change_the_key_and_defaults_leave_it(tmp_path, monkeypatch):
    model = _model(tmp_path, monkeypatch)
    plain = cache_key_from_context(_ctx(model))
    defaults = dict(model_impl="auto", enable_deterministic_inference=False, enable_tf32_matmul=False,
                    enable_fused_qk_norm_rope=False, triton_attention_reduce_in_fp32=False,
                    rl_on_policy_target=None, mm_attention_backend="fa3")  # fmt: skip
    same = [cache_key_from_context(_ctx(model, **defaults)),
            cache_key_from_context(_ctx(model, **{**defaults, "model_impl": "sglang"}))]  # fmt: skip
    assert {k.seed() for k in same} == {plain.seed()}  # (mm-attn: a text-only model has no encoder)
    assert plain.compute is None
    others = [cache_key_from_context(_ctx(model, model_impl="transformers")),
              cache_key_from_context(_ctx(model, enable_deterministic_inference=True)),
              cache_key_from_context(_ctx(model, enable_tf32_matmul=True)),
              cache_key_from_context(_ctx(model, enable_fused_qk_norm_rope=True)),
              cache_key_from_context(_ctx(model, triton_attention_reduce_in_fp32=True)),
              cache_key_from_context(_ctx(model, rl_on_policy_target="fsdp")),
              cache_key_from_context(_ctx(model, enable_deterministic_inference=True, enable_tf32_matmul=True))]  # fmt: skip
    seeds = {k.namespace_seed(None, None) for k in others}
    assert len(seeds) == len(others) and plain.namespace_seed(None, None) not in seeds


def test_the_resolved_model_impl_is_what_counts():
    """``auto`` that SGLang resolved to Transformers' code (no SGLang implementation of the
    architecture) is Transformers' code; ``sglang`` and ``auto`` on SGLang's code are one."""
    from sglang.srt.configs.model_config import ModelImpl

    from sglang_tiered.integration.identity import compute_of

    sa = NS(model_impl="auto")
    assert compute_of(sa, NS(_resolved_model_impl=ModelImpl.SGLANG)) is None
    tf = compute_of(sa, NS(_resolved_model_impl=ModelImpl.TRANSFORMERS))
    assert tf is not None and tf.startswith("impl=transformers@")  # (with Transformers' version)
    assert compute_of(NS(model_impl="sglang"), NS(_resolved_model_impl=ModelImpl.SGLANG)) is None
    # the vision encoder's attention, on a multimodal model only
    mm = NS(model_impl="auto", mm_attention_backend="sdpa")
    assert compute_of(mm, NS(_resolved_model_impl=ModelImpl.SGLANG, is_multimodal=False)) is None
    assert compute_of(mm, NS(_resolved_model_impl=ModelImpl.SGLANG, is_multimodal=True)) == "mm-attn=sdpa"


def test_the_compute_field_round_trips_through_the_published_key():
    import json
    from dataclasses import asdict

    k = CacheKey(model_id="m", weights_digest="w", compute="deterministic")
    back = CacheKey(**json.loads(json.dumps(asdict(k))))
    assert back.namespace_seed("t", None) == k.namespace_seed("t", None)
    assert k.seed() != CacheKey(model_id="m", weights_digest="w").seed()


def test_the_modelopt_restore_checkpoint_is_in_the_identity(tmp_path, monkeypatch):
    model = _model(tmp_path, monkeypatch)
    ckpts = []
    for i in range(2):
        c = tmp_path / f"ckpt{i}"
        c.mkdir()
        (c / "modelopt_state.pth").write_bytes(bytes([i]) * 64)
        ckpts.append(str(c))
    calibrated = cache_key_from_context(_ctx(model, modelopt_quant="fp8"))
    a = cache_key_from_context(_ctx(model, modelopt_quant="fp8", modelopt_checkpoint_restore_path=ckpts[0]))
    b = cache_key_from_context(_ctx(model, modelopt_quant="fp8", modelopt_checkpoint_restore_path=ckpts[1]))
    assert len({calibrated.seed(), a.seed(), b.seed()}) == 3
    # the same checkpoint: the same identity (another server restoring it shares its pages)
    again = cache_key_from_context(_ctx(model, modelopt_quant="fp8", modelopt_checkpoint_restore_path=ckpts[0]))
    assert again.seed() == a.seed()
    # without ModelOpt the path is not read by SGLang: no change
    plain = cache_key_from_context(_ctx(model))
    assert cache_key_from_context(_ctx(model, modelopt_checkpoint_restore_path=ckpts[0])).seed() == plain.seed()


def _cycle(backup: bool, tags):
    from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput, ResumeMemoryOccupationReqInput

    from sglang_tiered.integration import hooks

    cache = TieredRadixCache.create_simulated(256, page_size=1, host_pages=256, verify_kv=True, debug_checks=True)
    manager = types.SimpleNamespace(scheduler=types.SimpleNamespace(
        tree_cache=cache, server_args=types.SimpleNamespace(enable_weights_cpu_backup=backup)))  # fmt: skip
    old = list(range(1, 41))
    cache.driver.run(old + [99])
    cache.persist_to_host()  # T1 holds the prompt
    cache.driver.run(list(range(500, 540)) + [99])  # on the device only
    seed = cache.hashes.seed(None, None)
    hooks._before_release_memory(manager, ReleaseMemoryOccupationReqInput(tags=tags))
    if not tags or "kv_cache" in tags:
        cache.reset()  # SGLang's flush at a release of the KV pool (weight_updater.py:366)
    hooks._after_resume_memory(None, manager, ResumeMemoryOccupationReqInput(tags=tags))
    return cache, old, seed


@pytest.mark.parametrize("tags", [None, ["kv_cache", "weights"]])
def test_weights_resumed_without_a_backup_are_a_weight_update(tags):
    """Fresh weight memory: nothing in T1 is served, and the identity is the server's own."""
    cache, old, seed = _cycle(False, tags)
    assert cache.hashes.seed(None, None) != seed
    assert "+update:" in cache.cache_key.weights_digest
    assert cache.driver.run(old + [7]).cached_len == 0
    cache.check_invariants()


def test_weights_alone_resumed_without_a_backup_pause_t1_until_the_flush():
    """The device tree was not flushed (no KV tag): it keeps the KV computed before the release,
    as SGLang's own tree does, while T1 and T2 are paused and the new identity waits for the
    weight update's flush."""
    cache, old, seed = _cycle(False, ["weights"])
    assert cache.t1.paused and cache._pending_key is not None
    assert cache.t1.drop_all() == 0  # T1's pages of the old weights were dropped
    cache.reset()  # the weight update's flush
    assert cache.hashes.seed(None, None) != seed and not cache.t1.paused
    assert cache.driver.run(old + [7]).cached_len == 0
    cache.check_invariants()


@pytest.mark.parametrize("tags", [None, ["weights"]])
def test_weights_resumed_from_a_backup_keep_the_identity_and_t1(tags):
    cache, old, seed = _cycle(True, tags)
    assert cache.hashes.seed(None, None) == seed
    assert cache.driver.run(old + [7]).cached_len == 40


def test_a_kv_only_cycle_keeps_the_identity_and_t1():
    cache, old, seed = _cycle(False, ["kv_cache"])
    assert cache.hashes.seed(None, None) == seed
    assert cache.driver.run(old + [7]).cached_len == 40


# ---------------------------------------------------------------- live: a named T1 across restarts
@pytest.mark.server
def test_a_named_t1_is_not_served_to_another_model_implementation(tiny_model_path, tmp_path):
    """Live (the tiny model): a server on SGLang's model code leaves a prompt's KV in a named T1
    (``/flush_cache`` demotes it); the next server on that T1 runs ``--model-impl transformers``.
    Before session 41 the two had one identity, and the second was served the first's KV as a T1
    hit (``cached_tokens`` 304 of 320) where it computes the KV with other code."""
    import json

    from sglang_tiered.dev.server import Server, ServerSpec
    from sglang_tiered.tier.host_pool import SHM_DIR

    name = f"r41impl{tmp_path.name[-6:]}".replace("_", "")
    ids = [(j * 37) % 1900 + 10 for j in range(320)]
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
    env = {"SGLANG_TIERED_HOST": "on", "SGLANG_TIERED_HOST_RATIO": "4", "SGLANG_TIERED_HOST_NAME": name}
    try:
        first = ServerSpec(model_path=tiny_model_path, max_total_tokens=2048, dtype="float32", env=env)
        with Server(first, tmp_path / "sglang.log") as server:
            assert server.generate(body)["meta_info"]["cached_tokens"] == 0
            assert server.request("POST", "/flush_cache")[0] == 200  # into T1
        other = ServerSpec(model_path=tiny_model_path, max_total_tokens=2048, dtype="float32", env=env,
                           extra_args=["--model-impl", "transformers"])  # fmt: skip
        with Server(other, tmp_path / "transformers.log") as server:
            out = server.generate(body)
            assert out["meta_info"]["cached_tokens"] == 0, json.dumps(out["meta_info"])
            # (its own KV is its own: the same prompt again is a device hit)
            assert server.generate(body)["meta_info"]["cached_tokens"] >= 304
    finally:
        for p in SHM_DIR.glob(f"sglang-tiered-{name}*"):
            p.unlink()
