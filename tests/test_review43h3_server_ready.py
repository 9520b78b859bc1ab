"""``Server.wait_ready``'s wait for SGLang's ready line (review of session 43's change, helper h3).

1. A server whose warmup request fails logs "Initialization failed. warmup error" and kills its
   own process tree (``http_server.py`` ``_execute_server_warmup``): the wait for the ready line
   ended on the exit and ``wait_ready`` returned as if the server were ready; it now raises
   ServerStartError with the log's tail.
2. A server started at a log level above info (``extra_args``: ``--log-level warning``) never logs
   the line: every start waited WARMUP_WAIT_S (60 s) more; it is not waited for then.
"""

from __future__ import annotations

import time

import pytest

from sglang_tiered.dev import server as server_mod
from sglang_tiered.dev.server import Server, ServerStartError
from tests.test_review43_server_ready import stand_in


def _stand_in(tmp_path, exit_after: float, extra_args=()) -> Server:
    """A stand-in whose warmup fails ``exit_after`` seconds in (never if negative): it logs SGLang's
    error line and exits with 1."""
    return stand_in(tmp_path, exit_after, "Initialization failed. warmup error: boom", True, extra_args)


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
