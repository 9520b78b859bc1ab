"""A trace with prompts longer than the device pool (a helper's adversarial search, session 32;
its reproducer, kept as it was found). Page 16, a pool of 20 pages (320 tokens):

- A: 1,000 requests, 3 hot 4-page prompts alternating with fresh 4-page fillers; every 80th a
  21-page + 1-token prompt, longer than the pool (12 in all);
- B: 300 requests, 4 hot 2-page prompts (Zipf) against fresh 10-page scans;
- C: 1,229 requests of a seeded mix (a loop over 32 documents, growing conversations, scans,
  sub-page requests, 4 tenants in turn; requests over 19 pages dropped).

With the replay driver evicting for a prompt it then dropped, the tiered cache ended 0.87 points
below SGLang's lru (tests/test_review32.py)."""

import random
from array import array

from sglang_tiered.dev.workloads import Request

TLO, THI, PAGE, CAP = 16, 2000, 16, 20


def R(t, tenant=None):
    return Request(array("q", t), tenant)


def toks(rng, n):
    return [rng.randrange(TLO, THI) for _ in range(max(1, n))]


def phase_ab(giants=True, cap=CAP, page=PAGE, nA=1000, m=80, hotA=3, hotA_pages=4, fillA=4, nB=300, nH=4, H_pages=2, scanB=10):
    rng = random.Random(0)
    reqs = []
    HA = [toks(rng, hotA_pages * page) for _ in range(hotA)]
    for i in range(nA):
        if i % m == m - 1:
            g = toks(rng, (cap + 1) * page + 1)  # longer than the pool: unserved
            if giants:
                reqs.append(R(g))
            continue
        reqs.append(R(HA[(i // 2) % hotA] if i % 2 == 0 else toks(rng, fillA * page)))
    H = [toks(rng, H_pages * page) for _ in range(nH)]
    for i in range(nB):
        reqs.append(R(H[min(int(rng.paretovariate(1.0)) - 1, nH - 1)] if i % 2 == 0 else toks(rng, scanB * page)))
    return reqs


P = {'seed': 8, 'page': 16, 'n': 2000, 'n_hot': 15, 'hot_len': 172, 'zipf': 0.4034763257717663, 'suffix': 35,
     'n_docs': 32, 'doc_len': 318, 'scan_len': 618, 'tenants': 4, 'tenant_mode': 'rr', 'tenants_dup': 6,
     'conv0': 50, 'step': 6, 'new_conv': 0.10411538415312332, 'max_convs': 7, 'conv_mix': 0.5291416239127708,
     'conv_max': 1189, 'phase_period': 0,
     'w': [{'hot': 0.0, 'scan': 0.08461123011684255, 'loop': 0.10024367596196486, 'conv': 0.1531382806269917,
            'tiny': 0.14611345053236327, 'dup': 0.0},
           {'hot': 0.0, 'scan': 0.9226327533628688, 'loop': 0.0, 'conv': 0.5820274478408944,
            'tiny': 0.4780671029513338, 'dup': 0.0}]}


def phase_c(p):
    p = dict(p)
    rng = random.Random(p["seed"])
    page = p["page"]
    hot = [toks(rng, p["hot_len"]) for _ in range(p["n_hot"])]
    docs = [toks(rng, p["doc_len"]) for _ in range(p["n_docs"])]
    tenants = [None] + [f"t{i}" for i in range(1, p["tenants"])]
    convs, out = [], []
    for i in range(p["n"]):
        w = p["w"][0]
        kind = rng.choices(list(w.keys()), weights=list(w.values()))[0]
        ten = rng.choice(tenants) if p["tenant_mode"] == "rand" else tenants[i % len(tenants)]
        if kind == "hot":
            k = min(int(rng.paretovariate(p["zipf"])) - 1, len(hot) - 1)
            t = hot[k] + toks(rng, p["suffix"]) if p["suffix"] else list(hot[k])
        elif kind == "scan":
            t = toks(rng, p["scan_len"])
        elif kind == "loop":
            t = docs[p.setdefault("_lc", 0) % len(docs)] + (toks(rng, p["suffix"]) if p["suffix"] else [])
            p["_lc"] += 1
        elif kind == "conv":
            if not convs or rng.random() < p["new_conv"]:
                convs.append(toks(rng, p["conv0"]))
                if len(convs) > p["max_convs"]:
                    convs.pop(0)
            j = rng.randrange(len(convs)) if rng.random() < p["conv_mix"] else len(convs) - 1
            convs[j] = convs[j] + toks(rng, p["step"])
            if len(convs[j]) > p["conv_max"]:
                convs[j] = convs[j][: p["conv0"]]
            t = list(convs[j])
        elif kind == "tiny":
            t = toks(rng, rng.randint(1, max(1, page - 1)))
        elif kind == "dup":
            k = rng.randrange(len(hot))
            t = list(hot[k])
            ten = f"d{rng.randrange(p['tenants_dup'])}"
        out.append(R(t, ten))
    return [r for r in out if len(r.tokens) <= (CAP - 1) * PAGE]




def unserved_trace(giants: bool = True) -> list:
    """The whole trace (A + B + C); ``giants`` False leaves the prompts longer than the pool out."""
    return phase_ab(giants) + phase_c(P)
