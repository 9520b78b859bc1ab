"""``Server.wait_ready``'s wait for SGLang's ready line (review of session 43's change, helper h3).

1. A server whose warmup request fails logs "Initialization failed. warmup error" and kills its
   own process tree (``http_server.py`` ``_execute_server_warmup``): the wait for the ready line
   ended on the exit and ``wait_ready`` returned as if the server were ready; it now raises
   ServerStartError with the log's tail.
2. A server started at a log level above info (``extra_args``: ``--log-level warning``) never logs
   the line: every start waited WARMUP_WAIT_S (60 s) more; it is not waited for then.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from sglang_tiered.dev import server as server_mod
from sglang_tiered.dev.server import Server, ServerSpec, ServerStartError

_STAND_IN = """
import http.server, os, sys, threading, time
port, log, exit_after = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("content-length", "2"); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *a): pass
srv = http.server.HTTPServer(("127.0.0.1", port), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
if exit_after >= 0:
    time.sleep(exit_after)
    with open(log, "ab") as f:
        f.write(b"[x] Initialization failed. warmup error: boom\\n")
    os._exit(1)
time.sleep(60)
"""


def _stand_in(tmp_path, exit_after: float, extra_args=()) -> Server:
    s = Server(ServerSpec(model_path="unused", extra_args=list(extra_args)), tmp_path / "s.log")
    s.log_path.write_bytes(b"")
    s.proc = subprocess.Popen([sys.executable, "-c", _STAND_IN, str(s.spec.port), str(s.log_path), str(exit_after)],
                              start_new_session=True)  # fmt: skip
    return s


def test_a_server_whose_warmup_failed_is_not_returned_as_ready(tmp_path):
    s = _stand_in(tmp_path, 1.0)
    try:
        with pytest.raises(ServerStartError, match="warmup error"):
            s.wait_ready(30)
    finally:
        s.stop()


@pytest.mark.parametrize("args", [["--log-level", "warning"], ["--log-level=error"],
                                  ["--log-level", "info", "--log-level", "warning"]])  # fmt: skip
def test_a_server_that_logs_no_info_line_is_not_waited_for(tmp_path, monkeypatch, args):
    monkeypatch.setattr(server_mod, "WARMUP_WAIT_S", 5.0)
    s = _stand_in(tmp_path, -1, args)
    try:
        t0 = time.monotonic()
        s.wait_ready(30)
        assert time.monotonic() - t0 < 3
    finally:
        s.stop()
