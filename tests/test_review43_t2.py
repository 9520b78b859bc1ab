"""T2 review (session 43): the start-up probe turned T2 off for a server's life on a store that
was up.

Mooncake hands out replicas on every mounted segment; a peer that died without unmounting its own
(a crashed server restarting, or the master probe's child killed before its close) fails every
transfer to it with -800 until the master drops it (10 s at its default). The probe's one put
landed there and T2 was off until the next restart (CI, stop 50: two servers starting together,
``T2 probe put failed: [-800, -704, 0]``, and the second server fetched nothing). Now a refused
probe put is tried again on fresh keys for up to ``PROBE_RETRY_S``; one that got no answer is not
(a hung master still fails the probe at once: tests/test_review41_t2.py). And the master probe's
child mounts no segment (it only asks whether the master takes a setup).
"""

from __future__ import annotations

import json
import sys
import time

import pytest

from sglang_tiered.integration import t2_setup
from sglang_tiered.integration.t2_setup import measure_t2_gbps
from tests.test_review41_t2 import _tier
from tests.test_t2 import ByteStore


class RefusingStore(ByteStore):
    """Its first ``refuse`` puts fail every other key with -800 (the others stored)."""

    def __init__(self, refuse: int):
        super().__init__()
        self.refuse = refuse
        self.puts: list[list[str]] = []
        self.kept: list[str] = []  # keys a refused put stored

    def put(self, keys, ptrs, sizes):
        self.puts.append(list(keys))
        res = super().put(keys, ptrs, sizes)
        if len(self.puts) <= self.refuse:
            for i in range(0, len(keys), 2):
                self.objects.pop(keys[i], None)
                res[i] = -800
            self.kept += [k for k in keys if k in self.objects]
        return res


def test_a_refused_probe_put_is_tried_again_on_fresh_keys(monkeypatch):
    monkeypatch.setattr(t2_setup, "PROBE_RETRY_PAUSE_S", 0.01)
    store = RefusingStore(refuse=2)
    t2 = _tier(store)
    try:
        w, r = measure_t2_gbps(t2, retry_s=5)
        assert w > 0 and r > 0
        assert len(store.puts) == 3
        tries = [set(k) for k in store.puts]
        assert not (tries[0] & tries[1]) and not (tries[1] & tries[2]), "a retry reused keys"
    finally:
        t2.close()


def test_a_store_that_keeps_refusing_fails_the_probe_within_its_window(monkeypatch):
    monkeypatch.setattr(t2_setup, "PROBE_RETRY_PAUSE_S", 0.05)
    store = RefusingStore(refuse=10**6)
    t2 = _tier(store)
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"probe put failed: \[-800, 0\] \(\d+ tries\)"):
            measure_t2_gbps(t2, retry_s=0.5)
        assert time.monotonic() - t0 < 2
        assert 2 <= len(store.puts) <= 12
    finally:
        t2.close()


def test_the_probe_removes_every_try_s_objects():
    """The removal covers the keys of every try (a refused one stored some of them)."""
    store = RefusingStore(refuse=1)
    t2 = _tier(store)
    try:
        measure_t2_gbps(t2, retry_s=5)
        assert t2.wait_removals()
        assert store.kept, "the refused try stored nothing"
        assert not [k for k in store.objects if k.startswith("sgt/probe/")], "probe objects left"
    finally:
        t2.close()


def test_the_master_probe_child_mounts_no_segment():
    from sglang_tiered.tier import t2_client

    assert "s.setup(host, metadata, 0," in t2_client._PROBE_CHILD


@pytest.mark.server
def test_a_dead_peer_does_not_turn_t2_off_at_start_up(tmp_path):
    """Real master, loopback-only namespace: right after a peer dies holding a mounted segment,
    a plain put gets -800 and the start-up probe still measures the store (before: T2 off)."""
    from tests.netns import run_in_netns
    from tests.test_t2 import _need_netns

    _need_netns()
    out = tmp_path / "r.json"
    r = run_in_netns([sys.executable, "-m", "tests.t2_review43_scenario", str(out)], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert -800 in rep["dead_peer_codes"], rep  # (the condition the test is about arose)
    assert rep["probe"] == "ok", rep
