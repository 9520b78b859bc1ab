"""Bookkeeping benchmark and decision digests: cache work per request of ``TieredRadixCache``
against SGLang's own ``RadixCache`` with lru (same process, interleaved, mean over one replay),
and a digest of every request's hit length (plus the policy's end snapshot) that proves a
speed-up changed no decision.

    .venv/bin/python bench/bookkeeping.py --digests            # print the digest of every cell
    .venv/bin/python bench/bookkeeping.py --time               # us/request, lru vs tiered, ratio
    .venv/bin/python bench/bookkeeping.py --time --cells mooncake:0.01 family-21:0.2
    .venv/bin/python bench/bookkeeping.py --time --batch 8 --cells mooncake:0.01   # 8 in flight

The timed region is ``CacheDriver.run``'s (match_prefix, init_load_back, lock, evict, alloc, then
checkpoint, free, unlock, on_release and the end-of-batch flush; not the forward pass), for
both caches alike.
tests/test_bookkeeping_digest.py holds the recorded digests (``DIGEST_CELLS``).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from trace_replay import PAGE, capacity_pages, page_ids, replay_sglang, replay_tiered  # noqa: E402

# (workload, capacity fraction): Mooncake, multi-tenant, and generated-family workloads at small
# and large capacities, including caches of <= 128 pages (full sampling) and tiny requests
DIGEST_CELLS = [("mooncake", 0.005), ("mooncake", 0.02), ("multitenant", 0.01), ("multitenant", 0.1)] + [
    (f"family-{s}", f) for s in (8, 14, 19, 21, 25, 28) for f in (0.005, 0.05, 0.2)
]
# the timing cells: Mooncake at four capacities and twelve family cells, small caches and
# small requests among them, and the worst ratios of a sweep of family-000..039 at 1 and 10 %
# (session 44: long prompts in a 1 % cache, family-33 and family-14, 1.5-1.7x lru's)
TIME_CELLS = [("mooncake", f) for f in (0.005, 0.01, 0.02, 0.1)] + [
    (f"family-{s}", f) for s, f in [(21, 0.005), (21, 0.2), (28, 0.005), (28, 0.05), (32, 0.01),
                                    (8, 0.005), (8, 0.2), (4, 0.05), (14, 0.02), (25, 0.01),
                                    (33, 0.01), (14, 0.01)]
]  # fmt: skip


@functools.lru_cache(maxsize=None)
def load(name: str):
    """The requests of a named workload and their (unique pages, longest request in tokens)."""
    from sglang_tiered.dev import workload_family as wf
    from sglang_tiered.dev.workloads import load_mooncake, multi_tenant

    if name == "mooncake":
        reqs = load_mooncake(ROOT / "bench" / "data" / "mooncake_conversation_trace.jsonl.gz")
    elif name == "multitenant":
        reqs = multi_tenant(n_requests=4000, seed=0)
    elif name.startswith("family-"):
        reqs = wf.generate(wf.draw(int(name.split("-")[1])))
    else:
        raise ValueError(f"unknown workload {name!r}: use mooncake, multitenant or family-<seed>")
    _, unique = page_ids(reqs)
    return reqs, unique, max(len(r.tokens) for r in reqs)


# the snapshot fields of modes (session 13: strict, the default since session 15; 14: leader),
# keyed by the mode's flag
MODE_FIELDS = {"strict_guarantee": ("strict_guarantee", "cap_spared", "cap_admitted", "cap_over_pages", "cap_over_kept"),
               "follow_leader": ("follow_leader", "leader_switches"),
               # requests one at a time (these replays) never overlap: 0, left out as a mode's are
               "overlapped_requests": ("overlapped_requests", "overlap_cut_pages"),
               # paths touched unstored (session 36): none where every prompt is served at once
               "replayed_touches": ("replayed_touches",)}  # fmt: skip
# a serial replay's values of the fields that say what the server may run at once (session 34):
# left out as a mode's are, so the digests recorded before them still hold
SERIAL_FIELDS = {"max_in_flight": 1, "burst_lru": False}
# counters added later that are 0 where the change they came with did not act: left out when 0,
# so a cell's digest changes only where it did (session 38: the real cache back at lru's pages
# in other nodes)
LATER_COUNTERS = ("unconverged_checks", "restored_pages")  # (session 40: no-store requests)


def capacity_tokens(name: str, frac: float) -> int:
    """The capacity of a cell, as bench/workload_family.py sizes it."""
    _, unique, max_req = load(name)
    return capacity_pages(unique, max_req, frac, PAGE) * PAGE


def digest(name: str, frac: float, config=None) -> dict:
    """sha256 (first 16 hex digits) of every request's cached length, and of the end snapshot
    (the policy's ``config``, None: the default)."""
    reqs = load(name)[0]
    r = replay_tiered(reqs, capacity_tokens(name, frac), config)
    hits = hashlib.sha256(json.dumps(r["per_request"]).encode()).hexdigest()[:16]
    state = dict(r["policy_state"])
    for flag, fields in MODE_FIELDS.items():
        # a mode's fields are constant with it off: left out, so the digests recorded before they
        # existed still prove that mode-off decisions are unchanged (the budget mode's)
        if not state.get(flag):
            for k in fields:
                assert state.pop(k) in (False, 0), k
    for k, v in SERIAL_FIELDS.items():
        assert state.pop(k) == v, k
    for k in LATER_COUNTERS:
        if state.get(k) == 0:
            del state[k]
    snap = hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()[:16]
    return {"hits": hits, "snapshot": snap, "hit_tokens": r["hit_tokens"]}


def time_cell(name: str, frac: float, runs: int, config=None, batch: int = 0) -> tuple[list, list]:
    """us/request (mean over one replay) of SGLang lru and tiered (its policy ``config``, None:
    the default), ``runs`` interleaved pairs. ``batch`` > 0: requests in flight together
    (``replay_concurrent``, up to ``batch`` at once, whole prompts), the whole replay timed for
    both (the simulated scheduler's own work included, the same for both)."""
    import gc

    reqs = load(name)[0]
    cap = capacity_tokens(name, frac)
    # the loaded traces (Mooncake: millions of token ints in lists) out of the collector's reach:
    # a full collection scanned them in whichever replay crossed its threshold (0.33 s, seen as
    # 5x lru's time on one cell and then on the other's, session 25)
    gc.collect()
    gc.freeze()
    lru, tiered = [], []
    for _ in range(runs):
        if batch:
            lru.append(concurrent_us(reqs, cap, batch, None))
            tiered.append(concurrent_us(reqs, cap, batch, config or False))
        else:
            lru.append(replay_sglang(reqs, cap, "lru")["us_per_req"])
            tiered.append(replay_tiered(reqs, cap, config)["us_per_req"])
    return lru, tiered


def concurrent_us(reqs, cap: int, batch: int, tiered) -> float:
    """us/request of one ``replay_concurrent`` (bench/concurrent_bar.py's replay) through SGLang's
    lru (``tiered`` None) or tiered (``tiered``: its PolicyConfig, or False for the default)."""
    from concurrent_bar import replay

    r = replay("lru", reqs, cap, batch, 0) if tiered is None else replay("tiered", reqs, cap, batch, 0, tiered or None)
    return r["seconds"] * 1e6 / len(reqs)


def _cell(s: str):
    name, frac = s.rsplit(":", 1)
    return name, float(frac)


def main(argv=None) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--digests", action="store_true", help="print the decision digest of every cell")
    ap.add_argument("--time", action="store_true", help="time lru vs tiered per cell")
    ap.add_argument("--cells", nargs="+", type=_cell, default=None, help="NAME:FRACTION, e.g. mooncake:0.01")
    ap.add_argument("--runs", type=int, default=2, help="interleaved lru/tiered pairs per cell")
    ap.add_argument("--batch", type=int, default=0,
                    help="--time with up to BATCH requests in flight together (replay_concurrent); 0: one at a time")
    ap.add_argument("--policy", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="PolicyConfig overrides for tiered's timing and digests, e.g. guard_leader=0.999")
    args = ap.parse_args(argv)
    from workload_family import _override, _policy_config

    config = _policy_config(dict(_override(kv) for kv in args.policy))
    if args.digests:
        for c in args.cells or DIGEST_CELLS:
            print(json.dumps([c[0], c[1], digest(*c, config)]), flush=True)
    if args.time:
        from sglang_tiered.core.keys import HASH_IMPL, KEYS_IMPL
        from sglang_tiered.core.miniature import MINI_IMPL
        from sglang_tiered.core.shadows import DIVERGENCE_IMPL, TREE_IMPL
        from sglang_tiered.core.sketch import SKETCH_IMPL

        # which chain_page_hashes ran: the C extension or the pure-Python reference (session 41);
        # likewise the duel's miniatures and the TinyLFU sketch (session 42), the tree shadows (43),
        # the divergence (45), the policy page keys a tree without T1 or the index runs (46)
        print(f"page hashing: {HASH_IMPL}, policy page keys: {KEYS_IMPL}, miniatures: {MINI_IMPL}, sketch: {SKETCH_IMPL}, tree shadows: {TREE_IMPL}, "
              f"divergence: {DIVERGENCE_IMPL}", flush=True)
        print(f"{'cell':24s} {'pages':>7s} {'lru us':>8s} {'tiered us':>9s} {'ratio':>6s}  (each pair; mean over one replay)")
        for c in args.cells or TIME_CELLS:
            lru, tiered = time_cell(*c, args.runs, config, args.batch)
            pairs = "  ".join(f"{a:.0f}/{b:.0f}={b / a:.2f}" for a, b in zip(lru, tiered))
            ratio = sum(tiered) / sum(lru)
            print(f"{c[0] + ':' + str(c[1]):24s} {capacity_tokens(*c) // PAGE:7d} {sum(lru) / len(lru):8.1f} "
                  f"{sum(tiered) / len(tiered):9.1f} {ratio:6.2f}  [{pairs}]", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
