"""``Server.wait_ready`` waits for SGLang's warmup request (review, session 43).

SGLang binds its port and answers its routes before its warmup request has run
(``http_server.py`` ``_wait_and_warmup``: one generate request, then "The server is fired up and
ready to roll!"). ``wait_ready`` returned on the first ``/model_info`` answer, so a test's first
call could meet the warmup running: in CI (a loaded machine) the operator's ``/flush_cache`` in
``tests/test_e2e_http_review37.py`` was refused with "Cache not flushed because there are pending
requests" (400). A stand-in server process (no model) answers ``/model_info`` at once and logs the
ready line later.
"""

from __future__ import annotations

import subprocess
import sys
import time

from sglang_tiered.dev import server as server_mod
from sglang_tiered.dev.server import READY_LINE, Server, ServerSpec

_STAND_IN = """
import http.server, os, sys, threading, time
port, log, delay, line, exits = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4], sys.argv[5] == "1"
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("content-length", "2"); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *a): pass
srv = http.server.HTTPServer(("127.0.0.1", port), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
if delay >= 0:
    time.sleep(delay)
    with open(log, "ab") as f:
        f.write(b"[x] %s\\n" % line.encode())
    if exits:
        os._exit(1)
time.sleep(60)
"""


def stand_in(tmp_path, delay: float, line: str = READY_LINE.decode(), exits: bool = False, extra_args=()) -> Server:
    """A stand-in server process (no model) that serves at once and, ``delay`` seconds later (never
    if negative), logs ``line`` (SGLang's ready line by default), then exits with 1 if ``exits``
    (also tests/test_review43h3_server_ready.py's)."""
    s = Server(ServerSpec(model_path="unused", extra_args=list(extra_args)), tmp_path / "s.log")
    s.log_path.write_bytes(b"")
    s.proc = subprocess.Popen([sys.executable, "-c", _STAND_IN, str(s.spec.port), str(s.log_path), str(delay), line,
                               "1" if exits else "0"], start_new_session=True)  # fmt: skip
    return s


def test_wait_ready_returns_once_the_warmup_ran(tmp_path):
    s = stand_in(tmp_path, 1.5)
    try:
        t0 = time.monotonic()
        s.wait_ready(30)
        took = time.monotonic() - t0
        assert READY_LINE in s.log_path.read_bytes() and took >= 1.4, took  # (before: at once)
    finally:
        s.stop()


def test_a_server_that_never_logs_it_is_returned_after_the_bound(tmp_path, monkeypatch):
    """At another log level SGLang never logs the line: ready after WARMUP_WAIT_S, as before."""
    monkeypatch.setattr(server_mod, "WARMUP_WAIT_S", 1.0)
    s = stand_in(tmp_path, -1)
    try:
        t0 = time.monotonic()
        s.wait_ready(30)
        assert 0.9 <= time.monotonic() - t0 < 10
    finally:
        s.stop()
