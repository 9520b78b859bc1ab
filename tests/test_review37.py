"""Review, session 37: a CI run lost a TP=2 server's HTTP port to another process in the seconds
between picking it (bind(0), i.e. the kernel's ephemeral range, where outgoing connections and
gloo's listeners take ports too) and SGLang binding it after the model loaded; uvicorn logged the
bind error and hung in shutdown, so the test waited 240 s and failed (stop 45)."""

from __future__ import annotations

import socket
import sys
import textwrap
import time

import pytest

from sglang_tiered.dev import server as S


def test_free_ports_lie_under_the_ephemeral_range_and_off_sglangs_own_pick():
    low = S._ephemeral_low()
    ports = [S.free_port() for _ in range(50)]
    assert len(set(ports)) == 50  # never the same port twice in one process
    assert all(S.PORT_LOW <= p <= min(S.PORT_HIGH, low - 1) for p in ports)
    assert all(not 22000 <= p <= 29999 for p in ports)  # SGLang's torch.distributed port range


def _fake_sglang(tmp_path, bind_error_first: bool):
    """An 'interpreter' that stands in for ``python -m sglang.launch_server``: it serves
    /model_info on --port and logs SGLang's ready line (``Server.wait_ready`` waits for it since
    session 43), or (first run only) logs uvicorn's bind error and hangs."""
    marker = tmp_path / "ran-once"
    script = tmp_path / "fake_python"
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import http.server, pathlib, sys, time
        port = int(sys.argv[sys.argv.index("--port") + 1])
        marker = pathlib.Path({str(marker)!r})
        if {bind_error_first!r} and not marker.exists():
            marker.write_text("x")
            print(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {{port}}): "
                  "address already in use", flush=True)
            time.sleep(600)
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200); self.end_headers(); self.wfile.write(b"{{}}")
            def log_message(self, *a):
                pass
        srv = http.server.HTTPServer(("127.0.0.1", port), H)
        print("The server is fired up and ready to roll!", flush=True)  # (SGLang's, after its warmup)
        srv.serve_forever()
        """))
    script.chmod(0o755)
    return str(script)


def test_a_server_whose_port_was_taken_before_start_moves_to_another(tmp_path):
    srv = S.Server(S.ServerSpec(model_path=str(tmp_path), python=_fake_sglang(tmp_path, False)), tmp_path / "log")
    first = srv.spec.port
    with socket.socket() as sk:  # another process takes the port between pick and start
        sk.bind(("127.0.0.1", first))
        sk.listen()
        with srv.start(timeout_s=30):
            assert srv.spec.port != first
            assert srv.request("GET", "/model_info")[0] == 200


def test_a_server_that_fails_to_bind_is_not_waited_out_and_is_restarted_on_another_port(tmp_path):
    srv = S.Server(S.ServerSpec(model_path=str(tmp_path), python=_fake_sglang(tmp_path, True)), tmp_path / "log")
    first = srv.spec.port
    t0 = time.monotonic()
    with srv.start(timeout_s=60):
        assert srv.spec.port != first
        assert srv.request("GET", "/model_info")[0] == 200
    assert time.monotonic() - t0 < 20  # (not the 60 s timeout)


def test_a_port_the_caller_chose_is_not_changed(tmp_path):
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        sk.listen()
        port = sk.getsockname()[1]
        srv = S.Server(S.ServerSpec(model_path=str(tmp_path), port=port, python=_fake_sglang(tmp_path, False)),
                       tmp_path / "log")  # fmt: skip
        with pytest.raises(S.PortTaken, match="in use"):
            srv.start(timeout_s=5)
    srv = S.Server(S.ServerSpec(model_path=str(tmp_path), port=S.free_port(), python=_fake_sglang(tmp_path, True)),
                   tmp_path / "log2")  # fmt: skip
    t0 = time.monotonic()
    with pytest.raises(S.PortTaken, match="could not bind"):
        srv.start(timeout_s=60)
    assert time.monotonic() - t0 < 20


# ---------------------------------------------------------------------- --load-format in the identity
from types import SimpleNamespace as NS  # noqa: E402

PAGE = 16


def _ctx(model_dir, **sa):
    base = dict(model_path=str(model_dir), served_model_name=None, kv_cache_dtype="auto", attention_backend="fa3",
                quantization=None, dtype="auto", revision=None, modelopt_quant=None,
                quantization_param_path=None, load_format="auto", port=30000, nccl_port=None)  # fmt: skip
    base.update(sa)
    hf = NS(rope_theta=10000.0, rope_scaling=None, max_position_embeddings=4096)
    return NS(server_args=NS(**base), model_config=NS(hf_text_config=hf, dtype="torch.bfloat16", quantization=None))


def _model(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_TIERED_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"w" * 64)
    return model


def test_the_load_format_is_part_of_the_identity(tmp_path, monkeypatch):
    """A helper's audit (session 37): ``--load-format dummy`` (random weights) or
    ``remote_instance`` (a peer's weights, maybe updated since) on the same folder had the folder's
    weights digest, so one identity with a server on the real weights: each was served the
    other's KV through T2 and a named T1."""
    from sglang_tiered.config import LIFETIME_ENV
    from sglang_tiered.integration.identity import cache_key_from_context

    model = _model(tmp_path, monkeypatch)
    monkeypatch.setenv(LIFETIME_ENV, "life-1")
    real = cache_key_from_context(_ctx(model)).seed()
    assert cache_key_from_context(_ctx(model, load_format="auto")).seed() == real  # (unchanged: the default)
    seeds = {fmt: cache_key_from_context(_ctx(model, load_format=fmt)).seed()
             for fmt in ("pt", "safetensors", "dummy", "remote_instance", "remote", "sharded_state")}  # fmt: skip
    assert real not in seeds.values() and len(set(seeds.values())) == len(seeds)
    # a file format is one identity across servers and restarts; the others are this server's own:
    # the same on its TP ranks (one lifetime id, one port), another on the next start
    monkeypatch.setenv(LIFETIME_ENV, "life-2")
    assert cache_key_from_context(_ctx(model, load_format="pt")).seed() == seeds["pt"]
    assert cache_key_from_context(_ctx(model, load_format="dummy")).seed() != seeds["dummy"]
    monkeypatch.setenv(LIFETIME_ENV, "life-1")
    assert cache_key_from_context(_ctx(model, load_format="dummy")).seed() == seeds["dummy"]
    assert cache_key_from_context(_ctx(model, load_format="dummy", port=30001)).seed() != seeds["dummy"]


def test_a_server_on_dummy_weights_is_not_served_the_real_weights_kv_through_t2(tmp_path, monkeypatch):
    """The audit's reproducer: server A (the folder's weights) fills a shared T2; server B (same
    folder, ``--load-format dummy``, whose recomputation differs) asks it for the same prompt."""
    from sglang_tiered.core.store_queue import StoreQueue
    from sglang_tiered.dev import simulate
    from sglang_tiered.integration.identity import cache_key_from_context
    from sglang_tiered.integration.t2_setup import model_tag
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache
    from sglang_tiered.tier.t2 import T2Tier
    from sglang_tiered.tier.t2_config import T2Config
    from tests.test_t2 import ByteStore

    def cache_with_t2(key, store):
        cache = TieredRadixCache.create_simulated(8 * PAGE, PAGE, host_pages=8, verify_kv=True, cache_key=key)
        cfg = T2Config(master="127.0.0.1:1", queue_pages=64, max_run_pages=8, timeout_ms=30_000, lease_ms=0)
        t2 = T2Tier(store, cache.host.pool, cache.host.lock, cfg=cfg, model_tag=model_tag(key))
        t2.start()
        t2.queue.close()
        t2.queue = StoreQueue(cfg.queue_pages, t2._put_job, threaded=False)
        t2.MISS_MEMO_S = 0.0
        cache.host.t2 = t2
        return cache, t2

    def prompt(i: int) -> list:
        return [1000 * (i + 1) + j for j in range(4 * PAGE)]

    model = _model(tmp_path, monkeypatch)
    store = ByteStore()  # one Mooncake Store shared by the fleet
    a, ta = cache_with_t2(cache_key_from_context(_ctx(model)), store)
    try:
        for i in range(6):  # device: 4-5, T1: 2-3, T2: 0-1
            assert a.driver.run(prompt(i)).served
        ta.flush()
        ta.queue.drain()
        assert ta.stats.stored_pages >= 8
        assert a.driver.run(prompt(0)).cached_len > 0  # (A itself is served them back)
    finally:
        ta.close()
    old = simulate.expected_kv
    monkeypatch.setattr(simulate, "expected_kv", lambda *a_, **k: old(*a_, **k) + 4096.0)  # B's weights
    b, tb = cache_with_t2(cache_key_from_context(_ctx(model, load_format="dummy")), store)
    try:
        assert b.driver.run(prompt(0)).cached_len == 0  # (verify_kv would also fail a wrong hit)
    finally:
        tb.close()
