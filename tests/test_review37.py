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
    /model_info on --port, or (first run only) logs uvicorn's bind error and hangs."""
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
        http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
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
