"""Serial traffic cut by short bursts of requests in flight together (a helper's adversarial
search, session 33; its reproducer, kept as it was found). Page 16, a pool of 400 pages: cycles of
200 serial requests (one of 3 hot 4-page prompts, Zipf, with probability 0.26; else a fresh
32-page scan), then a burst of 16 requests with 8 in flight (a recent scan again with probability
0.70, else a fresh one). The tiered policy ended 0.94 points below SGLang's lru: each burst cut an
adaptive episode short, and the switch back to lru, lost while the books were not kept, was never
charged (tests/test_review33.py)."""

import random
from array import array

Q = {"seed": 467271685, "page": 16, "cap": 400, "hot_pages": 4, "n_hot": 3, "zipf": 1.0556999286224364,
     "p_hot": 0.2567607703671136, "scan_pages": 32, "cycles": 16, "serial": 200, "burst": 16, "burst_back": 8,
     "p_ret": 0.7025814916605987, "batch": 8, "chunk_pages": 0, "decode_ticks": 2}  # fmt: skip
# A second hunt's shape against the first fix (a cut episode charged one hit per diverged page):
# bursts of 32 copies of the last 4 scans, 16 in flight, prefill in 2-page chunks, pool 128 pages:
# every in-flight copy missed the pages the episode had dropped; 1.75 points below lru.
DUPS = {"cap": 128, "cycles": 8, "serial": 150, "burst": 32, "burst_back": 4, "p_ret": 1.0, "batch": 16,
        "chunk_pages": 2}  # fmt: skip


def build(q=Q):
    """(requests as (tokens, tenant), segments as (start, end, batch, chunk tokens)): batch 1 is
    serial."""
    rng = random.Random(q["seed"])
    page = q["page"]

    def toks(n):
        return array("q", [rng.randrange(16, 2000) for _ in range(max(1, n))])

    hot = [toks(q["hot_pages"] * page) for _ in range(q["n_hot"])]
    reqs, segs, recent = [], [], []
    for _ in range(q["cycles"]):
        a = len(reqs)
        for _ in range(q["serial"]):
            if rng.random() < q["p_hot"]:
                reqs.append((hot[min(int(rng.paretovariate(q["zipf"])) - 1, q["n_hot"] - 1)] + toks(0), None))
            else:
                t = toks(q["scan_pages"] * page)
                reqs.append((t, None))
                recent.append(t)
        segs.append((a, len(reqs), 1, 0))
        a = len(reqs)
        back = recent[-q["burst_back"]:]
        for _ in range(q["burst"]):
            reqs.append((back[rng.randrange(len(back))] if rng.random() < q["p_ret"] else toks(q["scan_pages"] * page), None))
        segs.append((a, len(reqs), q["batch"], q["chunk_pages"] * page))
    return reqs, segs


def replay(driver, reqs, segs, decode_ticks=Q["decode_ticks"]):
    """Each segment (start, end, batch, chunk tokens[, decode ticks]) one at a time (batch 1, no
    chunks) or through ``replay_concurrent`` (also tests/first_burst_trace.py's)."""
    from sglang_tiered.dev.simulate import replay_concurrent

    outs = []
    for a, b, batch, chunk, *ticks in segs:
        if batch <= 1 and chunk <= 0:
            outs += [driver.run(t, tenant=ten) for t, ten in reqs[a:b]]
        else:
            outs += replay_concurrent(driver, reqs[a:b], batch=batch, chunk=chunk,
                                      decode_ticks=ticks[0] if ticks else decode_ticks)  # fmt: skip
    return outs
