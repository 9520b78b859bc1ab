"""A serial warm-up in which the tiered policy leaves lru, then the run's first burst: 256 copies
of the last 8 scans, 64 in flight (a helper's adversarial search, session 33; its reproducer, kept
as it was found, page 16, pool 400 pages). The first overlap cuts an episode that diverged 23
pages; every copy of a dropped scan admitted in the same tick misses and allocates its whole
prompt, those allocations evict (in lru's order, the real cache now following lru) the copies
that finished earlier, and the loss cascades: 4,757 pages, 15.1 points below SGLang's lru. Open
(README, "Requests in flight together"; tests/test_review33.py, xfail)."""

import random
from array import array

from tests.burst_trace import replay  # noqa: F401 (the same segments: start, end, batch, chunk, ticks)

Q = {"seed": 294180477, "page": 16, "cap": 400, "hot_pages": 1, "hot_ratio": 1.1, "n_hot": 130,
     "zipf": 0.31307405179181375, "p_hot": 0.17285001406309697, "scan_frac": 0.1, "warm_caps": 52.877883370890906,
     "bursts": 1, "burst_mult": 4, "batch0": 64, "grow": 1, "burst_back": 8, "ser_caps": 20, "chunk": 0, "dt": 8,
     "p_ret": 1.0}  # fmt: skip


def build(q=Q):
    """(requests as (tokens, tenant), segments as (start, end, batch, chunk, decode ticks))."""
    rng = random.Random(q["seed"])
    page, C = q["page"], q["cap"]

    def toks(n):
        return array("q", [rng.randrange(16, 30000) for _ in range(max(1, n))])

    hot = [toks(q["hot_pages"] * page) for _ in range(q["n_hot"])]
    slen = max(1, int(q["scan_frac"] * C)) * page
    reqs, segs, recent = [], [], []

    def serial(caps):
        a, refs = len(reqs), 0
        while refs < caps * C:
            if rng.random() < q["p_hot"]:
                t = hot[min(int(rng.paretovariate(q["zipf"])) - 1, q["n_hot"] - 1)]
            else:
                t = toks(slen)
                recent.append(t)
            reqs.append((t, None))
            refs += len(t) // page
        segs.append((a, len(reqs), 1, 0, 1))
    serial(q["warm_caps"])
    batch = q["batch0"]
    for b in range(q["bursts"]):
        a, back = len(reqs), recent[-q["burst_back"]:]
        for _ in range(batch * q["burst_mult"]):
            reqs.append((back[rng.randrange(len(back))] if rng.random() < q["p_ret"] else toks(slen), None))
        segs.append((a, len(reqs), batch, q["chunk"] * page, q["dt"]))
        batch = min(256, batch * q["grow"])
        if b < q["bursts"] - 1:
            serial(q["ser_caps"])
    return reqs, segs

