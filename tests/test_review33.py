"""Session 33: what the hunts of session 32 left out, and what this session's hunts found."""

import logging
import pathlib

import pytest

from sglang_tiered import config
from sglang_tiered.config import ENV, load_config


@pytest.mark.parametrize("field", sorted(ENV))
@pytest.mark.parametrize("blank", ["", "  ", "\t"])
def test_an_empty_option_is_the_same_as_an_unset_one(field, blank):
    # one rule for every option (some took "" as unset, others refused it: SGLANG_TIERED_DEBUG=,
    # SGLANG_TIERED_HOST=, SGLANG_TIERED_STORE=, SGLANG_TIERED_GUARANTEE=, the on/off options)
    assert load_config({ENV[field]: blank}) == load_config({})


def test_an_empty_option_beside_its_overrider_is_not_called_useless():
    # HOST_RATIO= beside HOST_GB, SERVER_ID= without an index: set to nothing, they do nothing
    load_config({ENV["host_gb"]: "1", ENV["host_ratio"]: ""})
    load_config({ENV["server_id"]: " "})


def test_a_blank_shm_dir_is_the_default():
    assert config.shm_dir({"SGLANG_TIERED_SHM_DIR": "  "}) == pathlib.Path("/dev/shm")


def test_the_filesystem_of_a_path_is_its_longest_mount_point(tmp_path):
    from sglang_tiered.tier.host_pool import filesystem_type

    mounts = tmp_path / "mounts"
    mounts.write_text("overlay / overlay rw 0 0\n"
                      "tmpfs /dev/shm tmpfs rw 0 0\n"
                      "/dev/sda1 /dev/shm/disk ext4 rw 0 0\n"
                      "tmpfs /mnt/with\\040space tmpfs rw 0 0\n"
                      "short\n")  # fmt: skip
    assert filesystem_type(pathlib.Path("/dev/shm"), str(mounts)) == "tmpfs"
    assert filesystem_type(pathlib.Path("/dev/shm/x"), str(mounts)) == "tmpfs"
    assert filesystem_type(pathlib.Path("/dev/shm/disk/y"), str(mounts)) == "ext4"
    assert filesystem_type(pathlib.Path("/dev/shmx"), str(mounts)) == "overlay"
    assert filesystem_type(pathlib.Path("/mnt/with space/t1"), str(mounts)) == "tmpfs"
    assert filesystem_type(pathlib.Path("/"), str(tmp_path / "absent")) is None


def test_a_named_t1_on_a_disk_filesystem_is_said_once(tmp_path, monkeypatch, caplog):
    from sglang_tiered.tier import host_pool as hp

    kinds = {tmp_path / "disk": "ext4", tmp_path / "mem": "tmpfs"}
    monkeypatch.setattr(hp, "filesystem_type", lambda p, mounts="/proc/mounts": kinds[p])
    monkeypatch.setattr(hp, "_warned_fs", set())
    with caplog.at_level(logging.WARNING, logger="sglang_tiered"):
        hp.warn_unless_memory(tmp_path / "mem")
        assert not caplog.records
        hp.warn_unless_memory(tmp_path / "disk")
        hp.warn_unless_memory(tmp_path / "disk")
    assert len(caplog.records) == 1
    assert "ext4" in caplog.text and "SGLANG_TIERED_SHM_DIR" in caplog.text


@pytest.mark.parametrize("args", [["--ns", "0"], ["--rho", "0"], ["--rho", "nan"], ["--host-ratio", "-1"],
                                  ["--limit", "0"], ["--clients", "-2"], ["--workload", "mooncak"],
                                  ["--workload", "family-many-x"], ["--workload", "family-tiny-1"]])  # fmt: skip
def test_fleet_sim_refuses_bad_arguments_before_running(args, capsys):
    import bench.fleet_sim as fs

    with pytest.raises(SystemExit) as e:
        fs.main(args)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--fractions", "0"], ["--fractions", "nan"], ["--fractions", "1.5"],
                                  ["--limit", "0"], ["--mooncake-from", "1"], ["--timing-runs", "-1"]])  # fmt: skip
def test_trace_replay_refuses_bad_arguments_before_running(args, capsys):
    import bench.trace_replay as tr

    with pytest.raises(SystemExit) as e:
        tr.main(args)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_the_routers_index_hits_are_the_index_s_alone():
    """With no index, requests that go back to the worker the router's own memory says holds their
    prefix are warm routes, not index hits (index_hits counted both: it read as the index working
    with Redis down)."""
    import asyncio

    import aiohttp

    from tests.test_fleet_hardening import _echo_router

    async def main():
        hits: list = []
        body = {"input_ids": list(range(1000, 1064))}
        async with _echo_router(hits) as (router, r_url), aiohttp.ClientSession() as s:
            for _ in range(3):
                async with s.post(r_url + "/generate", json=body) as resp:
                    assert resp.status == 200
            async with s.get(r_url + "/router/stats") as resp:
                st = await resp.json()
            async with s.get(r_url + "/router/metrics") as resp:
                text = await resp.text()
        assert router.stats.requests == 3
        assert st["index_hit_rate"] == 0 and st["index_matched_token_rate"] == 0, st
        assert st["warm_route_rate"] > 0 and st["matched_token_rate"] > 0, st
        lines = text.splitlines()
        assert "sglang_tiered_router_index_hits_total 0.0" in lines
        assert f"sglang_tiered_router_warm_routes_total {float(router.stats.warm_routes)!r}" in lines

    asyncio.run(main())


def test_evictions_the_lru_shadow_never_sees_are_not_credited():
    """The bound assumes the lru tree shadow sees every eviction the real cache makes. Evictions it
    does not see (here: the session-32 driver's, everything evictable emptied before each prompt
    longer than the pool, in both caches) made the shadow count more hits than the real cache
    while lru was followed; that "bias" was credited to the books, and the adaptive policy ended
    0.87 points below SGLang's lru (9,248 against 10,608 hit tokens of 156,556). An exact tree
    shadow's positive bias is no longer credited (``core/safety.py`` ``_credited_bias``)."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from sglang_tiered.dev.simulate import CacheDriver, make_params
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache
    from tests.unserved_trace import CAP, PAGE, unserved_trace

    def run(driver, reqs):
        hit = tot = 0
        for r in reqs:
            if len(r.tokens) > CAP * PAGE:  # what the old driver did for it, unseen by the shadow
                driver.cache.evict(EvictParams(num_tokens=driver.cache.evictable_size()))
            o = driver.run(r.tokens, tenant=r.tenant)
            hit, tot = hit + o.cached_len, tot + o.prompt_len
        return hit, tot

    reqs = unserved_trace()
    params, alloc, pool = make_params(CAP * PAGE, PAGE, 1 << 17)
    lru, tot = run(CacheDriver(RadixCache(params), alloc, pool), reqs)
    cache = TieredRadixCache.create_simulated(CAP * PAGE, PAGE)
    tiered, _ = run(cache.driver, reqs)
    assert (tiered - lru) / tot >= -0.002, (tiered, lru, tot)
    assert cache.policy.snapshot()["lru_model_bias"] > 0  # the unseen evictions, measured


@pytest.mark.parametrize("identity", [True, False], ids=["identity", "keys"])
@pytest.mark.parametrize("shape", [{}, {"burst": 2, "batch": 2}, "dups"], ids=["found", "pairs", "dups"])
def test_an_episode_cut_short_by_an_overlap_pays_its_switch_back(shape, identity):
    """Serial phases cut by bursts of requests in flight together (tests/burst_trace.py). Each
    burst sent the real cache back to lru (``guard_serial``) while the books were not kept, so the
    switch back was lost unbooked; the serial phases' gains kept the budget growing and each
    episode diverged further: 0.94 points below SGLang's lru. The divergence is now charged when
    an overlap cuts an episode (``core/safety.py`` ``_charge_cut_episode``), each diverged page
    counted once per request seen in flight together (copies of one prompt in flight all miss
    it: a second hunt took the charge at one hit per page to 1.75 points below lru).
    "pairs": bursts of 2 requests, 2 in flight, which do cut episodes (charged) with the tree's
    pages keyed by their identity hashes (as with T1; the shape was found so); keyed by the policy
    keys (session 46) the sampled estimates differ and no episode is open at a cut: the bound is
    asserted for both kinds."""
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from sglang_tiered.dev.simulate import CacheDriver, make_params
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache
    from tests.burst_trace import Q, build, replay

    from tests.burst_trace import DUPS

    q = dict(Q, **(DUPS if shape == "dups" else shape))
    reqs, segs = build(q)
    page, cap = q["page"], q["cap"]
    total = sum(len(t) for t, _ in reqs)
    params, alloc, pool = make_params(cap * page, page, 1 << 17)
    lru = sum(o.cached_len for o in replay(CacheDriver(RadixCache(params), alloc, pool), reqs, segs))
    cache = TieredRadixCache.create_simulated(cap * page, page, debug_checks=True)
    if identity:
        cache.use_identity("a test")
    tiered = sum(o.cached_len for o in replay(cache.driver, reqs, segs))
    snap = cache.policy.snapshot()
    assert (tiered - lru) / total >= -0.002, (tiered, lru, total, snap)
    assert snap["overlapped_requests"] > 0, snap
    assert snap["overlap_cut_pages"] > 0 or shape != {"burst": 2, "batch": 2} or not identity, snap


@pytest.mark.xfail(strict=True, reason="a cache told it runs one request at a time, run with 64 in flight: "
                   "no charge after the cut can undo the cascade, and no order but lru's can bound it "
                   "(tests/test_review34.py); a server's request pool tells the cache, and it is lru's order")  # fmt: skip
def test_the_first_burst_after_a_serial_episode_stays_within_the_bound():
    """A third hunt (session 33, tests/first_burst_trace.py): a serial warm-up in which the policy
    leaves lru, then the run's first burst (256 copies of the last 8 scans, 64 in flight). The
    charge at the cut is 2 x 23 diverged pages; the burst loses 4,757 pages: 15.1 points below
    SGLang's lru. Here the cache is told it runs one request at a time (``max_in_flight`` 1, a
    server with --max-running-requests 1, where this schedule cannot happen), so only the serial
    guard's defence stands, and it cannot hold: SGLang's lru itself, without one of the burst's
    prompts, loses up to 17.7 points (tests/test_review34.py). Told 64, as a server's request pool
    tells it, the strict default is lru's order and equals SGLang's lru here (session 34).
    The trace was found with the tree's pages keyed by their identity hashes (a server with T1 or
    the fleet index), and is replayed so: keyed by the policy keys (session 46) the policy's
    sampled estimates differ and this trace happens to stay within the bound."""
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from sglang_tiered.dev.simulate import CacheDriver, make_params
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache
    from tests.first_burst_trace import Q, build, replay

    reqs, segs = build()
    page, cap = Q["page"], Q["cap"]
    total = sum(len(t) for t, _ in reqs)
    params, alloc, pool = make_params(cap * page, page, 1 << 17)
    lru = sum(o.cached_len for o in replay(CacheDriver(RadixCache(params), alloc, pool), reqs, segs))
    cache = TieredRadixCache.create_simulated(cap * page, page)
    cache.use_identity("a test")
    tiered = sum(o.cached_len for o in replay(cache.driver, reqs, segs))
    assert (tiered - lru) / total >= -0.002, (tiered, lru, total)


def test_the_lru_guarantee_is_sglangs_lru_request_for_request():
    """``SGLANG_TIERED_GUARANTEE=lru``: SGLang's lru order itself, on the trace the strict default
    does not cover yet (the first burst after a serial episode) and under a serial replay."""
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from sglang_tiered.config import policy_config
    from sglang_tiered.dev.simulate import CacheDriver, make_params
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache
    from tests.first_burst_trace import Q, build, replay

    pc = policy_config(load_config({"SGLANG_TIERED_GUARANTEE": "lru"}))
    assert pc.force_mode == "all+lru"
    reqs, segs = build()
    cap = Q["cap"] * Q["page"]
    serial = [(a, b, 1, 0, 1) for a, b, *_ in segs]
    for schedule in (segs, serial):
        params, alloc, pool = make_params(cap, Q["page"], 1 << 17)
        lru = [o.cached_len for o in replay(CacheDriver(RadixCache(params), alloc, pool), reqs, schedule)]
        cache = TieredRadixCache.create_simulated(cap, Q["page"], policy_config=pc)
        assert [o.cached_len for o in replay(cache.driver, reqs, schedule)] == lru
