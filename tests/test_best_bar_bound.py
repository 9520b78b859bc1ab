"""No online policy is within 0.5 points of the best SGLang order on every workload (issue #11's
"best bar"), and none meets that and the lru bar together: a two-trace adversary, checked on
SGLang's own RadixCache and on every mode of the tiered policy.

The construction. ``M`` documents ``B`` of ``D`` pages each are read three times, then ``M`` other
documents ``A`` once; the cache holds ``M x D + D`` pages. Then one more pass, over ``A`` (trace
TA) or over ``B`` (trace TB). Up to that last pass the two traces are the same requests, so any
deterministic policy holds the same pages when it starts (randomised: the same distribution).
Each document of the last pass is read once, so its hits are at most the pages of that pass it
held when the pass began: hits(TA's pass) + hits(TB's pass) <= the capacity, ``M x D + D``. lru
holds ``A`` at that point and slru and lfu hold ``B`` (counted three times), so the best SGLang
order hits all ``M x D`` pages of the last pass on either trace, and in the common part no
policy hits more than they do (``B``'s second and third passes; ``A`` and ``B``'s first passes are
compulsory misses). On one of the two traces any policy therefore misses at least ``(M x D -
D) / 2`` of the ``5 x M x D`` pages: 8.75 points at ``M = 8``, whatever the policy. The bar allows
0.5. The same pair shows why the two bars cannot both hold: within 0.2 points of lru on TA means
holding ``A``, which is 20 points below slru and lfu on TB.

This is a bound on online policies, not on the family: the workload family's cells are not
adversarial, and there the leader mode meets the best bar in 879 of 1,212 cells (README, "Follow
the leader"). It is why no mode can promise the best bar "on any workload".
"""

from __future__ import annotations

import functools

import pytest

from sglang_tiered.core.policy import PolicyConfig
from tests.test_guarantee import PAGE, _run, _tok

M, D = 8, 4
CAP = M * D + D  # pages: room for the M documents lfu keeps and one more


def _common():
    reqs = []
    for _ in range(3):
        reqs += [(_tok(500 + k, D), None) for k in range(M)]  # B: read three times
    reqs += [(_tok(700 + k, D), None) for k in range(M)]  # A: read once, last
    return reqs


@functools.lru_cache(maxsize=None)
def _traces():
    common = _common()
    return {"TA": common + [(_tok(700 + k, D), None) for k in range(M)],
            "TB": common + [(_tok(500 + k, D), None) for k in range(M)]}  # fmt: skip


@functools.lru_cache(maxsize=None)
def _sglang(trace: str, order: str):
    """SGLang's RadixCache with ``order`` on one trace: (hit rate, per-request hits), run once."""
    hit_rate, per_req, _ = _run(_traces()[trace], CAP, order)
    return hit_rate, per_req


MODES = {"strict": None, "budget": PolicyConfig(guard_div_cap=False), "leader": PolicyConfig(guard_leader=0.999)}


def _last_pass_pages(per_req) -> int:
    return sum(per_req[-M:]) // PAGE


def test_the_best_sglang_order_differs_between_the_two_traces():
    pages = {(t, o): _last_pass_pages(_sglang(t, o)[1]) for t in _traces() for o in ("lru", "slru", "lfu")}
    assert pages["TA", "lru"] == M * D and pages["TB", "lru"] == 0
    assert pages["TB", "slru"] == pages["TB", "lfu"] == M * D
    assert pages["TA", "slru"] == pages["TA", "lfu"] == 0


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_misses_the_best_bar_on_one_of_the_two_traces(mode):
    traces = _traces()
    n_common = len(_common())
    total = {t: sum(len(x) for x, _ in reqs) for t, reqs in traces.items()}
    best = {t: max(_sglang(t, o)[0] for o in ("lru", "slru", "lfu")) for t in traces}
    runs = {t: _run(reqs, CAP, None, MODES[mode]) for t, reqs in traces.items()}
    # the same requests up to the last pass: the same hits, request for request
    assert runs["TA"][1][:n_common] == runs["TB"][1][:n_common]
    # the counting argument: the last pass hits at most what the cache held when it began
    assert sum(_last_pass_pages(r[1]) for r in runs.values()) <= CAP
    worst = min(runs[t][0] - best[t] for t in traces)
    bound = -(M * D - D) / 2 * PAGE / max(total.values())  # -(M D - D) / 2 pages of 5 M D
    assert worst <= bound + 1e-9 < -0.005  # below the best bar by far more than 0.5 points
