"""T2 (fleet store on Mooncake): option validation, a Hypothesis state machine of the tier over an
in-process byte store with injected faults (late, failing, lying), and the real thing: simulated
caches and two CPU servers sharing one ``mooncake_master`` in a loopback-only network namespace."""

from __future__ import annotations

import ctypes
import json
import re
import sys
import time

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from sglang_tiered.config import ConfigError, load_config
from sglang_tiered.tier.host_pool import HostPool, PoolLayout
from sglang_tiered.tier.t2 import HEADER_BYTES, T2Tier
from sglang_tiered.tier.t2_config import T2ConfigError, parse_t2_url
from tests.netns import mooncake_available, netns_available, run_in_netns


# ---------------------------------------------------------------------- option validation
def test_t2_url_is_validated():
    cfg = parse_t2_url("mooncake://127.0.0.1:50051?segment_mb=128&mode=on&min_freq=2&timeout_ms=50")
    assert (cfg.master, cfg.segment_mb, cfg.mode, cfg.min_freq, cfg.timeout_ms) == ("127.0.0.1:50051", 128, "on", 2, 50.0)
    for bad in ("redis://127.0.0.1:1", "mooncake://127.0.0.1", "mooncake://:50051", "mooncake://h:1?mode=maybe",
                "mooncake://h:1?segment_mb=1", "mooncake://h:1?timeout_ms=nan", "mooncake://h:1?nope=1",
                "mooncake://h:1?min_freq=2&min_freq=3", "mooncake://h:1?queue_pages=x"):  # fmt: skip
        with pytest.raises(T2ConfigError):
            parse_t2_url(bad)
    with pytest.raises(ConfigError, match="SGLANG_TIERED_T2"):
        load_config({"SGLANG_TIERED_T2": "mooncake://127.0.0.1:50051?mode=sometimes"})
    assert load_config({}).t2 is None


# ---------------------------------------------------------------------- state machine
class ByteStore:
    """The five calls T2 makes, over a dict, with faults: ``late`` (answers after the deadline,
    then still writes the caller's buffer), ``fail`` (raises), ``lie`` (returns another page's
    bytes under the asked key), ``tear`` (the asked object's first half, another's second: a put
    that overtook the read)."""

    def __init__(self):
        self.objects: dict[str, bytes] = {}
        self.fault = None

    def register(self, t):
        pass

    def _maybe_fault(self):
        if self.fault == "fail":
            raise ConnectionError("store down")
        if self.fault == "late":
            time.sleep(0.15)  # far past the 20 ms deadline, also on a loaded machine

    def exists(self, keys):
        self._maybe_fault()
        return [1 if k in self.objects else 0 for k in keys]

    def put(self, keys, ptrs, sizes):
        self._maybe_fault()
        for k, p, n in zip(keys, ptrs, sizes):
            self.objects.setdefault(k, ctypes.string_at(p, n))
        return [0] * len(keys)

    def get(self, keys, ptrs, sizes):
        self._maybe_fault()
        out = []
        others = list(self.objects.values())
        for k, p, n in zip(keys, ptrs, sizes):
            data = self.objects.get(k)
            if data is None:
                out.append(-704)
                continue
            if self.fault == "lie" and len(others) > 1:
                data = next(o for o in others if o != data)
            elif self.fault == "tear" and len(others) > 1:  # a put overtook the read: another object's tail
                other = next(o for o in others if o != data)
                data = data[: len(data) // 2] + other[len(data) // 2 :]
            if len(data) > n:  # (Mooncake: -600, "Buffer too small for key", nothing written)
                out.append(-600)
                continue
            ctypes.memmove(p, data, len(data))
            out.append(len(data))
        return out

    def remove_regex(self, pattern):
        rx = re.compile(pattern)
        gone = [k for k in self.objects if rx.search(k)]
        for k in gone:
            del self.objects[k]
        return len(gone)


LAYOUT = PoolLayout(num_pages=6, layers=2, kv_heads=2, page_size=4, head_dim=4, dtype="float32")
PAGE_SHAPE = (2, LAYOUT.layers, LAYOUT.kv_heads, LAYOUT.page_size, LAYOUT.head_dim)


def page_data(h: bytes, tenant: int) -> torch.Tensor:
    """What recomputation gives for page ``h`` of ``tenant`` (distinct per tenant)."""
    base = int.from_bytes(h[:2], "little") + 1000.0 * tenant
    return base + torch.arange(torch.Size(PAGE_SHAPE).numel(), dtype=torch.float32).view(PAGE_SHAPE) * 0.5


def H(i: int) -> bytes:
    return i.to_bytes(2, "little") * 8


@settings(max_examples=40, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
class T2Machine(RuleBasedStateMachine):
    """Model: the set of (tenant, page) the store may hold. Checked: every page T1 holds has its own
    tenant's recomputed data (whatever the faults), T2 never serves a page it was not given for that
    tenant, and the tier's structures keep their invariants."""

    def __init__(self):
        super().__init__()
        self.pool = HostPool(LAYOUT)
        self.store = ByteStore()
        import threading

        from sglang_tiered.tier.t2_config import T2Config

        cfg = T2Config(master="127.0.0.1:1", queue_pages=8, max_run_pages=4, timeout_ms=20, min_gbps=1e4, lease_ms=0)
        self.t2 = T2Tier(self.store, self.pool, threading.RLock(), cfg=cfg, model_tag="m")
        self.t2.start()
        self.t2.breaker.backoff = 0.0  # no breaker pauses inside a test step (still counted as failures)
        # Deterministic writes for Hypothesis replays: the queue drains when a rule says so
        # (the tier's worker thread is exercised by the Mooncake tests below).
        from sglang_tiered.core.store_queue import StoreQueue

        self.t2.queue.close()
        self.t2.queue = StoreQueue(cfg.queue_pages, self.t2._put_job, threaded=False)
        self.given: set = set()  # (tenant, page) ever offered to T2
        self.tenant_of: dict = {}  # T1 page hash -> tenant written with

    def teardown(self):
        self.t2.close()

    def _write_t1(self, hashes, tenant):
        pairs = self.pool.reserve(hashes, evict=True)
        for h, slot in pairs:
            self.pool.data[:, :, :, slot] = page_data(h, tenant)
            self.tenant_of[h] = tenant
        self.pool.commit(pairs, tenant)
        self.t2.flush()

    @rule(first=st.integers(0, 11), n=st.integers(1, 4), tenant=st.sampled_from([1, 2]))
    def demote(self, first, n, tenant):
        hashes = [H(first + i) for i in range(n) if not self.pool.contains(H(first + i))]
        for h in self.pool.slot_of:  # pages about to be victims were offered for their own tenant
            self.given.add((self.tenant_of[h], h))
        self._write_t1(hashes, tenant)

    @rule()
    def drain(self):
        self.t2.flush()
        self.t2.queue.drain()

    @rule(first=st.integers(0, 11), n=st.integers(1, 4), tenant=st.sampled_from([1, 2]))
    def fetch(self, first, n, tenant):
        hashes = [H(first + i) for i in range(n)]
        if any(self.pool.contains(h) for h in hashes):
            return
        for h in self.pool.slot_of:  # T1's victims of the fetch are offered to T2 too (for their
            self.given.add((self.tenant_of[h], h))  # tenant, also after that tenant's invalidation)
        self.t2._missed.clear()
        got = self.t2.fetch(hashes, tenant)
        assert 0 <= got <= n
        for h in hashes[:got]:
            assert (tenant, h) in self.given, "T2 served a page it was never given for this tenant"
            self.tenant_of[h] = tenant

    @rule(pick=st.integers(0, 1 << 16), n=st.integers(1, 3))
    def fetch_known(self, pick, n):
        if not self.given:  # (the draw above does not depend on the state: replays stay consistent)
            return
        tenant, h = sorted(self.given)[pick % len(self.given)]
        self.drain()
        self.fetch(int.from_bytes(h[:2], "little"), n, tenant)

    @rule(fault=st.sampled_from([None, None, "fail", "late", "lie", "tear"]))
    def set_fault(self, fault):
        self.store.fault = fault
        self.t2.breaker.until = 0.0

    @rule(tenant=st.sampled_from([1, 2]))
    def invalidate(self, tenant):
        self.store.fault = None
        self.t2.breaker.until = 0.0
        self.t2.invalidate(tenant=tenant)
        self.given = {g for g in self.given if g[0] != tenant}

    @invariant()
    def t1_holds_only_correct_pages(self):
        for h, slot in self.pool.slot_of.items():
            assert torch.equal(self.pool.data[:, :, :, slot], page_data(h, self.tenant_of[h])), "wrong KV in T1"
        self.pool.check_invariants()
        self.t2.check_invariants()
        for k, obj in list(self.store.objects.items()):
            assert len(obj) == self.t2.obj_bytes and obj[:4] == b"SGT2"


TestT2Machine = T2Machine.TestCase


def test_header_names_page_tenant_and_layout():
    t2 = T2Tier(ByteStore(), HostPool(LAYOUT), None, cfg=parse_t2_url("mooncake://h:1"), model_tag="m")
    a, b = t2._headers([H(1)], 1), t2._headers([H(1)], 2)
    assert a.shape == (1, HEADER_BYTES) and not torch.equal(a, b)
    assert t2.key(H(1), 1) != t2.key(H(1), 2) and t2.key(H(1), 1).startswith("sgt/v3/m/")
    from sglang_tiered.stats import T2TierStats

    assert set(t2.snapshot()) == set(T2TierStats.__struct_fields__)  # the snapshot is the schema
    t2.close()


# ---------------------------------------------------------------------- real Mooncake, loopback only
def _need_netns():
    why = netns_available() or mooncake_available()
    if why:
        pytest.skip(why)


def test_t2_simulated_caches_share_pages_through_mooncake(tmp_path):
    """Library level, real mooncake_master + clients in a loopback-only namespace; KV checked."""
    _need_netns()
    out = tmp_path / "report.json"
    r = run_in_netns([sys.executable, "-m", "tests.t2_sim_scenario", str(out)], timeout=300)
    assert out.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["ok"], rep
    assert rep["a_t2"]["stored_pages"] > 0
    assert rep["b_same_tenant"]["from_t1"] > 0 and rep["b_t2"]["fetched_pages"] > 0  # KV verified by the driver
    assert rep["c_other_tenant"]["cached"] == 0
    assert rep["d_changed_weights"]["cached"] == 0
    assert rep["invalidate_removed"] > 0 and rep["e_after_invalidate"]["cached"] == 0
    assert rep["b_master_down"]["cached"] == 0 and rep["b_t2_down"]["failures"] >= 1
    assert rep["b_master_down_s"] < 10  # bounded by the deadline and the breaker, not Mooncake's retries


@pytest.mark.server
def test_t2_two_servers_share_pages_through_mooncake(tiny_model_path, tmp_path):
    """Two CPU servers on one master (loopback-only namespace): B hits on A's prefixes with outputs
    identical to a no-cache server; another tenant gets zero cached tokens; master killed -> every
    request still succeeds with identical outputs."""
    _need_netns()
    out = tmp_path / "report.json"
    r = run_in_netns([sys.executable, "-m", "tests.t2_server_scenario", str(out), tiny_model_path,
                      str(tmp_path / "logs")], timeout=1200)  # fmt: skip
    assert out.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["ok"], (rep, r.stderr[-3000:])
    assert rep["a_outputs_equal"] and rep["b_outputs_equal"] and rep["globex_outputs_equal"], rep
    assert rep["b_t2"]["fetched_pages"] > 0 and rep["b_cached_tokens"] > 0, rep
    assert rep["globex_cached_tokens"] == 0, rep
    assert rep["down_statuses"] == [200] * len(rep["down_statuses"]) and rep["down_outputs_equal"], rep
