"""Review findings of session 30 (a new operator following the README on a fresh clone), each test
failing on the code before its fix:

- ``make serve`` stopped with Ctrl-C (or SIGTERM) ended in ``make: *** [serve] Error 247``: SGLang's
  launcher ends itself with SIGKILL when told to stop, and ``sglang-tiered serve`` passed that -9 on
  as its exit status;
- a trace line with a NaN or negative ``timestamp`` or a negative ``output_length`` was taken
  silently, though the README says a bad line stops the run (``tests/test_bench.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from sglang_tiered.dev.server import free_port


@pytest.mark.server
def test_serve_stopped_by_the_operator_exits_0(tiny_model_path, tmp_path):
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    log = tmp_path / "serve.out"
    with open(log, "wb") as out:
        p = subprocess.Popen([sys.executable, "-m", "sglang_tiered.cli", "serve", "--model", tiny_model_path,
                              "--port", str(port), "--max-total-tokens", "2048", "--log", str(tmp_path / "s.log")],
                             stdout=out, stderr=subprocess.STDOUT, env=env)  # fmt: skip
    try:
        deadline = time.time() + 300
        while b"is serving" not in log.read_bytes():
            assert p.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=90) == 0, log.read_text()[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
