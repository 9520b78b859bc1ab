"""Review, session 41: the scheduler's rare paths, live. A helper's hunt (session 41) ran the tiered
backend with T1 on and the debug invariants on against the no-cache server under forced and real
retraction, aborts mid-prefill (client disconnects, ``/abort_request``, ``abort_all``) with the
prefix reused right behind them, chunked prefill of 64 over prompts at and one token past page
boundaries, ``--enable-mixed-chunk``, ``lpm``, priority preemption and page size 1, and found no
wrong output. No test ran a server whose decode retracts requests while T1 promotes their prefixes
(the soak's pools never retract): this one does, with SGLang's own switch for it
(``SGLANG_TEST_RETRACT``: a retraction every third forward, scheduler.py:4477), so a retracted
request is released, re-queued, matched again (its probe and admission state dropped at release)
and re-admitted through a T1 load-back of pages other requests promoted or demoted meanwhile.

The reference runs first and is stopped before the tiered server starts (one server at a time)."""

from __future__ import annotations

import random
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.server

PAGE = 16


def _workload(seed: int = 41):
    """Four shared documents (some at a page boundary or one token past it), four requests on
    each, and one-off prompts that push the documents out of the 2,048-token pool into T1."""
    rng = random.Random(seed)
    tok = lambda k: [rng.randrange(10, 2000) for _ in range(k)]  # noqa: E731
    docs = [tok(n) for n in (256, 257, 320, 400)]
    shared = [(f"d{i}.{j}", d + tok(rng.randrange(1, 24)), 48) for i, d in enumerate(docs) for j in range(4)]
    flood = [(f"f{i}", tok(rng.randrange(300, 500)), 2) for i in range(6)]
    return shared, flood


def _gen(server, ids, max_new):
    from sglang_tiered.dev.greedy import LOGPROBS

    return server.generate({"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new}, **LOGPROBS},
                           timeout=600)  # fmt: skip


def test_retracted_requests_reloaded_from_t1_serve_what_recomputation_gives(tiny_model_path, tmp_path):
    from sglang_tiered.dev.greedy import compare
    from sglang_tiered.dev.server import Server, ServerSpec

    shared, flood = _workload()
    ref_spec = ServerSpec(model_path=tiny_model_path, backend=None, disable_radix_cache=True, page_size=PAGE,
                          dtype="float32")  # fmt: skip
    with Server(ref_spec, tmp_path / "ref.log") as ref:
        with ThreadPoolExecutor(4) as ex:
            expected = dict(zip([n for n, _, _ in shared], ex.map(lambda r: _gen(ref, r[1], r[2]), shared)))

    spec = ServerSpec(model_path=tiny_model_path, page_size=PAGE, max_total_tokens=2048, dtype="float32",
                      extra_args=["--max-running-requests", "16"],
                      env={"SGLANG_TIERED_HOST": "on", "SGLANG_TIERED_HOST_RATIO": "8", "SGLANG_TIERED_DEBUG": "1",
                           "SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "3"})  # fmt: skip
    log = tmp_path / "tiered.log"
    bad = []
    with Server(spec, log) as server:
        rng = random.Random(0)
        for _ in range(2):  # the second round finds the documents in T1 (the flood pushed them out)
            order = shared[:]
            rng.shuffle(order)
            with ThreadPoolExecutor(16) as ex:
                outs = list(ex.map(lambda r: (r[0], _gen(server, r[1], r[2])), order))
            for name, got in outs:
                verdict, why = compare(expected[name], got)
                if verdict == "differ":
                    bad.append((name, why, got["meta_info"].get("cached_tokens")))
            with ThreadPoolExecutor(4) as ex:
                list(ex.map(lambda r: _gen(server, r[1], r[2]), flood))
        status, stats = server.request("GET", "/cache/stats")
    assert status == 200, stats
    text = log.read_text(errors="replace")
    assert not bad, bad
    assert "Traceback" not in text, text[text.index("Traceback") :][:3000]
    retracted = sum(int(m) for m in re.findall(r"#retracted_reqs: (\d+)", text))
    host = next(t for t in stats["tiers"] if t["name"] == "host")
    assert retracted > 0 and host["promotions"] > 0, (retracted, host)  # both paths ran
