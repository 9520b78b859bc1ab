"""Review findings of session 30 (a new operator following the README on a fresh clone), each test
failing on the code before its fix:

- ``make serve`` stopped with Ctrl-C (or SIGTERM) ended in ``make: *** [serve] Error 247``: SGLang's
  launcher ends itself with SIGKILL when told to stop, and ``sglang-tiered serve`` passed that -9 on
  as its exit status;
- a trace line with a NaN or negative ``timestamp`` or a negative ``output_length`` was taken
  silently, though the README says a bad line stops the run (``tests/test_bench.py``).

And of a crash hunt on T2 (servers SIGKILLed while writing to Mooncake, peers reading after):
- T2 took ``timeout_ms`` at or above half of ``lease_ms`` (this repository's own server test had
  5000 and 500): every fetch then read one page, and no read was covered by its object's lease,
  which is what keeps a put from reusing the memory mid-read (the footer catches only a tear that
  reaches it);
- a read the store answered with an error code (-800: the object's replica is on a peer that died,
  until the master drops it, ~10 s) was counted as bad pages and nothing else: each such read
  waited ~1 s on the scheduler thread, and every admission attempt read it again."""

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


def test_t2_refuses_a_read_deadline_past_half_the_lease():
    from sglang_tiered.tier.t2_config import T2ConfigError, parse_t2_url

    for q in ("timeout_ms=5000&lease_ms=500", "timeout_ms=500&lease_ms=1000", "lease_ms=0", "timeout_ms=5000"):
        with pytest.raises(T2ConfigError, match="must be below half of lease_ms"):
            parse_t2_url(f"mooncake://127.0.0.1:1?{q}")
    assert parse_t2_url("mooncake://127.0.0.1:1?timeout_ms=499&lease_ms=1000").lease_ms == 1000


def test_t2_is_off_when_not_one_page_can_be_read_within_half_the_lease(monkeypatch):
    """The deadline also counts the bytes at min_gbps, known once the model is: a page whose
    transfer alone outlives half the lease keeps T2 off, with why in the stats."""
    import types

    import sglang_tiered.integration.t2_setup as t2s
    from sglang_tiered.tier.t2 import fetch_pages
    from sglang_tiered.tier.t2_config import parse_t2_url
    from tests.test_review18 import _cache
    from tests.test_t2 import ByteStore

    monkeypatch.setattr(t2s, "MooncakeClient", lambda cfg: ByteStore())
    cache = _cache()
    layout = cache.t1.host.pool.layout
    ok = parse_t2_url("mooncake://127.0.0.1:1?max_run_pages=4&queue_pages=64&timeout_ms=100&lease_ms=1000")
    # 1 ms left of half the lease, and one page takes longer than that at min_gbps
    slow = parse_t2_url("mooncake://127.0.0.1:1?max_run_pages=4&queue_pages=64&timeout_ms=499&lease_ms=1000"
                        "&min_gbps=0.0001")  # fmt: skip
    assert (2 * 64 + layout.page_bytes) / 1e5 > 1e-3
    assert fetch_pages(ok, layout) == 4 and fetch_pages(slow, layout) == 0
    decision = t2s.build_t2(cache, types.SimpleNamespace(tp_size=1), slow)
    assert decision.startswith("off: one page's read") and cache.t1.host.t2 is None


def test_a_t2_read_answered_with_an_error_code_is_a_failed_call():
    import threading

    from sglang_tiered.tier.host_pool import HostPool
    from sglang_tiered.tier.t2 import T2Tier
    from sglang_tiered.tier.t2_config import T2Config
    from tests.test_t2 import LAYOUT, H, ByteStore

    class DeadPeer(ByteStore):
        gets = 0

        def get(self, keys, ptrs, sizes):
            self.gets += 1
            return [-800] * len(keys)  # listed, but its replica's segment is gone

    store = DeadPeer()
    cfg = T2Config(master="127.0.0.1:1", queue_pages=8, max_run_pages=4, timeout_ms=20, min_gbps=1e4, lease_ms=1000)
    t2 = T2Tier(store, HostPool(LAYOUT), threading.RLock(), cfg=cfg, model_tag="m")
    try:
        key = t2.key(H(1), 0, t2.generation(0))
        store.objects[key] = b"x"  # (the existence check says it is there)
        assert t2.fetch([H(1)], 0) == 0
        assert t2.stats.failures == 1 and not t2.up  # the breaker is open: T2 skipped for a while
        t2.breaker.until = 0.0  # (closed again)
        assert t2.fetch([H(1)], 0) == 0 and store.gets == 1  # and the page is not read again right away
    finally:
        t2.close()


def test_tp_ranks_recreating_a_named_t1_map_one_file(tmp_path, monkeypatch):
    """Two TP ranks of one server open a named T1 whose layout changed. Both used to find the old
    layout, unlink and recreate the file, one after the other: the second unlinked the file the
    first had just created and mapped, so the ranks wrote different files (the one left on disk
    never held every head of a page: nothing survived a restart) and T1 took twice its memory.
    The open is now done under a lock, one rank at a time. Here the first rank is held between
    mapping its new file and writing its layout until the second has started (crash hunt, session
    30: 2 of 22 races of two processes split)."""
    import threading

    import sglang_tiered.tier.host_pool as hp

    monkeypatch.setattr(hp, "SHM_DIR", tmp_path)
    name = "race"
    hp.acquire_owner(name)
    try:
        hp.HostPool(hp.PoolLayout(64, 2, 2, 4, 4, "float32"), name=name)  # the old server's layout
        new = hp.PoolLayout(96, 2, 2, 4, 4, "float32")
        inside, go = threading.Event(), threading.Event()
        real = hp.torch.UntypedStorage.from_file

        def slow_first(*a, **k):  # the first rank has mapped the file it created, not yet said its layout
            storage = real(*a, **k)
            if not inside.is_set():
                inside.set()
                go.wait(10)
            return storage

        monkeypatch.setattr(hp.torch.UntypedStorage, "from_file", slow_first)
        pools = {}
        first = threading.Thread(target=lambda: pools.__setitem__(0, hp.HostPool(new, name=name)))
        second = threading.Thread(target=lambda: pools.__setitem__(1, hp.HostPool(new, name=name)))
        first.start()
        assert inside.wait(10)
        second.start()
        time.sleep(0.5)  # (the old code: the second rank unlinks and recreates the file meanwhile)
        go.set()
        first.join(20)
        second.join(20)
        a, b = pools[0], pools[1]
        a.raw[-1] = 7  # the same bytes: one file
        assert int(b.raw[-1]) == 7
        assert [x.attached for x in (a, b)] == [False, True]
    finally:
        hp.release_owner(name)


def test_named_t1s_whose_names_differ_after_a_dot_keep_their_own_layouts(tmp_path, monkeypatch):
    """The layout file was the data file's name with its suffix replaced: T1s named "v1.2" and
    "v1.3" (dots are allowed) shared "sglang-tiered-v1.json", so each start recreated the other's
    file as "another layout" and neither kept its pages across a restart."""
    import sglang_tiered.tier.host_pool as hp

    monkeypatch.setattr(hp, "SHM_DIR", tmp_path)
    a, b = hp.PoolLayout(64, 2, 2, 4, 4, "float32"), hp.PoolLayout(96, 2, 2, 4, 4, "float32")
    for name in ("v1.2", "v1.3"):
        hp.acquire_owner(name)
    try:
        hp.HostPool(a, name="v1.2")
        hp.HostPool(b, name="v1.3")
        assert hp.HostPool(a, name="v1.2").attached and hp.HostPool(b, name="v1.3").attached
    finally:
        for name in ("v1.2", "v1.3"):
            hp.release_owner(name)


def test_a_t1_name_that_is_another_t1s_file_is_refused():
    from sglang_tiered.config import load_config

    with pytest.raises(ValueError, match="another T1's file"):
        load_config({"SGLANG_TIERED_HOST": "on", "SGLANG_TIERED_HOST_NAME": "prod.json"})
    assert load_config({"SGLANG_TIERED_HOST": "on", "SGLANG_TIERED_HOST_NAME": "prod.v2"}).host_name == "prod.v2"
