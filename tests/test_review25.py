"""Session 25: fixed compute per server for the live fleet benchmark (``cpu_quota_group``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sglang_tiered.dev.server import cgroup_joiner, cpu_quota_group, remove_cgroup

BUSY = ("import resource, time\n"
        "t = time.time()\n"
        "while time.time() - t < 1.0: pass\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_utime + resource.getrusage(resource.RUSAGE_SELF).ru_stime)")


def test_cpu_quota_rejects_nonpositive_cores():
    with pytest.raises(ValueError, match="cores must be > 0"):
        cpu_quota_group("sglang-tiered-test-bad", 0)


def test_cpu_quota_caps_a_busy_child():
    """A busy process put in a group of 0.3 CPU gets at most about 0.3 s of CPU per second of
    wall time (where this machine lets us make groups; elsewhere the error says why)."""
    try:
        group = cpu_quota_group(f"sglang-tiered-test-{os.getpid()}", 0.3)
    except RuntimeError as exc:
        assert "cgroup" in str(exc)
        pytest.skip(f"no writable cgroup here: {exc}")
    try:
        try:
            out = subprocess.run([sys.executable, "-c", BUSY], preexec_fn=cgroup_joiner(group), capture_output=True,
                                 text=True, timeout=60, check=True)  # fmt: skip
        except subprocess.SubprocessError as exc:  # the group was made but this host refuses joining it
            pytest.skip(f"cannot join a cgroup here: {exc}")
        cpu = float(out.stdout.strip())
        assert cpu < 0.5, f"busy child got {cpu:.2f} s of CPU in 1 s under a 0.3 CPU quota"
    finally:
        remove_cgroup(group)
    assert not os.path.exists(group)


class _Counted:
    """Delegates to ``obj``, counting calls of its ``run`` (the shadows and miniatures use slots)."""

    def __init__(self, obj, counter, key):
        self._obj, self._counter, self._key = obj, counter, key

    def run(self, *a, **kw):
        self._counter[self._key] += 1
        return self._obj.run(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._obj, name)


def test_overlap_steps_only_lru_shadow_and_sketch():
    """While requests overlap the real cache follows lru whatever the shadows say (guard_serial),
    so slru's and lfu's shadows and the miniatures skip those requests (they were 1/4 of the
    cache's work in a concurrent replay); lru's shadow (the bound's yardstick) and the sketch
    (T1's and T2's page value) keep stepping, and serial traffic steps everything again."""
    from collections import Counter

    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

    cache = TieredRadixCache.create_simulated(64 * 16, 16)
    pol, drv = cache.policy, cache.driver
    assert pol._tree and pol._serial_guard
    calls: Counter = Counter()
    for o in ("lru", "slru", "lfu"):
        pol._shadows[o] = _Counted(pol._shadows[o], calls, o)
    pol._shadow = pol._shadows["lru"]
    pol._minis = [_Counted(m, calls, f"mini{i}") for i, m in enumerate(pol._minis)]
    toks = lambda s: list(range(s, s + 40))  # noqa: E731

    drv.run(toks(0))  # one at a time: everything steps
    assert all(calls[k] == 1 for k in ("lru", "slru", "lfu", "mini0", "mini1", "mini2")), calls
    calls.clear()
    a = drv.begin(toks(1000))
    b = drv.begin(toks(2000))  # starts while a is in flight
    drv.end(a)
    drv.end(b)
    assert calls["lru"] == 2 and not any(calls[k] for k in ("slru", "lfu", "mini0", "mini1", "mini2")), calls
    assert pol.stats.overlapped_requests == 1 and pol.following == "lru"
    # the sketch still counted both requests' pages
    for s in (1000, 2000):
        h = cache.hashes.chain(cache.hashes.seed(None, None), toks(s), 16)  # (the tree's page keys)
        assert pol.frequency(h[0]) >= 1
    calls.clear()
    drv.run(toks(3000))  # serial again: everything steps
    assert all(calls[k] == 1 for k in ("lru", "slru", "lfu", "mini0", "mini1", "mini2")), calls


# --- EAGLE: T1 was write-only (review, session 25) --------------------------------------------

def test_eagle_turns_t1_off_and_says_why():
    """SGLang's match_prefix turns an EAGLE server's key into a bigram view in place, so T1's probe
    never served a hit while every eviction still copied pages into T1. T1 is now off there."""
    import types

    from sglang_tiered.config import load_config
    from sglang_tiered.integration.host_setup import BIGRAM_OFF, build_host_tier

    cache = types.SimpleNamespace(is_eagle=True)  # nothing else is read before the decision
    for mode in ("auto", "on"):
        assert build_host_tier(cache, None, load_config({"SGLANG_TIERED_HOST": mode})) == (None, BIGRAM_OFF)


@pytest.mark.parametrize("env,says", [
    ({"SGLANG_TIERED_HOST": "on"}, "T1 with --speculative-algorithm EAGLE3 is not supported"),
    ({"SGLANG_TIERED_T2": "mooncake://127.0.0.1:50051"}, "T2 .* is not supported with --speculative-algorithm"),
])  # fmt: skip
def test_eagle_with_t1_on_or_t2_stops_the_launch(env, says):
    import types

    from sglang_tiered.config import ConfigError, check_server_args, load_config

    args = types.SimpleNamespace(tp_size=1, pp_size=1, dp_size=1, tokenizer_worker_num=1,
                                 speculative_algorithm="EAGLE3")  # fmt: skip
    with pytest.raises(ConfigError, match=says):
        check_server_args(load_config(env), args, bigram_keys=True)
    check_server_args(load_config({}), args, bigram_keys=True)  # auto: T1 turned off, nothing to stop
    check_server_args(load_config(env), args, bigram_keys=False)


@pytest.mark.parametrize("name,bigram", [(None, False), ("EAGLE", True), ("eagle3", True), ("NEXTN", True),
                                         ("NGRAM", False), ("no-such-algorithm", False)])  # fmt: skip
def test_bigram_keys_follow_sglangs_is_eagle(name, bigram):
    import types

    from sglang_tiered.integration.hooks import _bigram_keys

    assert _bigram_keys(types.SimpleNamespace(speculative_algorithm=name)) is bigram


def test_flush_with_a_load_back_whose_batch_never_ran_tells_the_index():
    """reset's persist branch demotes what it can, but a node locked by a load-back whose batch
    never ran stays on the device until super().reset() drops it: its pages were never reported
    gone, so the fleet index and the policy's record of device pages kept them (I1)."""
    import logging

    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams

    from sglang_tiered.integration.index_hints import tree_pages
    from tests.strict_sim import Req, Sim

    logging.disable(logging.WARNING)
    try:
        class Listener:
            removed: list = []

            def on_store(self, h):
                pass

            def on_remove(self, h):
                self.removed.extend(h)

            def on_clear(self):
                pass

        sim = Sim(64, 4, host_pages=16)
        c = sim.cache
        c.index.listener = Listener()
        toks = list(range(100, 117))
        a = Req(toks, rid="a")
        assert sim.admit(a)
        sim.release(a)
        c.evict(EvictParams(num_tokens=10**6))  # to T1
        b = Req(toks, rid="b")
        m = sim.match(b)
        lk = c.lock(b.last_node)
        loaded = c.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node,
                                                     host_hit_length=m.host_hit_length, req=b))  # fmt: skip
        c.unlock(lk)
        assert loaded and loaded[0] == 16 and c.t1.load_locks  # loaded back; its batch never runs
        held = tree_pages(c.root_node)
        c.reset()  # /flush_cache
        assert c.index.device == set() and not tree_pages(c.root_node)
        assert not set(Listener.removed) & held  # T1 still holds them: still on this server
        c.check_invariants()
    finally:
        logging.disable(logging.NOTSET)


@pytest.mark.parametrize("opts", [dict(cap=40, host=16), dict(cap=24, ps=4, host=8, fuzz=1), dict(eagle=1, ps=2)])
def test_random_scheduler_runs_with_the_checkpoint_after_prefill(opts):
    """tests/strict_sim.py's random runs with SGLang's checkpoint after an unfinished request's
    last prefill chunk (``checkpoint_kv_cache``), which the harness lacked (review, session 25)."""
    from tests import strict_sim

    for seed in range(30):
        strict_sim.run(seed, dict(opts, eagle=opts.get("eagle", 0), steps=250, postfill=1))
