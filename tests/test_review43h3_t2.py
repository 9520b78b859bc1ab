"""The T2 start-up probe's retry (review of session 43's change, helper h3): a put answered with
as many codes as keys, all refusals or some, is a refusal and tried again; an answer of another
length (or not a list of codes) is no store's answer for those keys and failed the probe only after
the whole retry window (15 s at start-up), saying ``[0]``: it now fails at once, saying so."""

from __future__ import annotations

import time

import pytest

from sglang_tiered.integration import t2_setup
from sglang_tiered.integration.t2_setup import measure_t2_gbps
from tests.test_review41_t2 import _tier
from tests.test_t2 import ByteStore


class OddStore(ByteStore):
    def __init__(self, answer):
        super().__init__()
        self.answer, self.puts = answer, 0

    def put(self, keys, ptrs, sizes):
        self.puts += 1
        res = super().put(keys, ptrs, sizes)
        return self.answer(res)


@pytest.mark.parametrize("answer", [lambda r: r[:-1], lambda r: r + [0], lambda r: []])
def test_a_put_answer_of_another_length_fails_the_probe_at_once(monkeypatch, answer):
    monkeypatch.setattr(t2_setup, "PROBE_RETRY_PAUSE_S", 0.05)
    store = OddStore(answer)
    t2 = _tier(store)
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"probe put failed: \d+ codes for \d+ keys"):
            measure_t2_gbps(t2, retry_s=3)
        assert time.monotonic() - t0 < 1 and store.puts == 1
    finally:
        t2.close()
