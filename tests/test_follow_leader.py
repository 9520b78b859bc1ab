"""Follow the leader (``SGLANG_TIERED_GUARANTEE=leader``, ``PolicyConfig.guard_leader``): after
every request the real cache follows, exactly, whichever of SGLang's orders (lru, slru, lfu) its
tree shadow has hit most (decayed per request), switching at once. Checked here: request for
request it is a reference follower built from SGLang's tree replayed (``TreeShadow``, itself
checked against ``RadixCache`` in tests/test_shadows_tree.py) that switches by forking its tree
under the leading order; it keeps the wins that the budget's gates give up on a short trace; the
option parses and the stats say what it did. It has no bound against lru (README, "Follow the
leader"), so nothing here asserts one."""

from __future__ import annotations

import pathlib
import sys
from types import SimpleNamespace

import pytest

from sglang_tiered.config import load_config, policy_config
from sglang_tiered.core.policy import PolicyConfig
from sglang_tiered.core.shadows import FIXED_ORDERS, TreeShadow
from tests.test_guarantee import PAGE, _hot_set_under_scans, _returning_scan, _run
from tests.test_strict_guarantee import _family_cell

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
from trace_replay import page_ids  # noqa: E402  (bench/: the benchmarks' tenant-scoped page ids)

DECAY = 0.999
LEADER = PolicyConfig(guard_leader=DECAY)


def _reference(reqs, cap_pages: int) -> list[int]:
    """Pages hit per request by a follower written from the definition: three SGLang trees (one
    per order) scored by decayed hits, and a fourth that switches to the leading order (strictly
    ahead of the one it follows; ties go to lru) by forking itself under it between requests."""
    shadows = {o: TreeShadow(cap_pages, o) for o in FIXED_ORDERS}
    score = dict.fromkeys(FIXED_ORDERS, 0.0)
    follower = TreeShadow(cap_pages, "lru")
    out = []
    rows, _ = page_ids([SimpleNamespace(tokens=t, tenant=tenant) for t, tenant in reqs])
    for (toks, _), pages in zip(reqs, rows):
        tail = 1 if len(toks) % PAGE else 0
        out.append(follower.run(pages, tail))
        for o in FIXED_ORDERS:
            score[o] = score[o] * DECAY + shadows[o].run(pages, tail)
        lead = max(FIXED_ORDERS, key=score.__getitem__)
        if score[lead] > score[follower.order]:
            follower = follower.fork(lead)
    return out


# slru leads; slru then lru; lru is best (a switch loses); requests shorter than a page (their
# partial page's slot evicts in SGLang: the shadows must see them too, or the leader drifts)
CELLS = [(16, 0.02), (0, 0.01), (78, 0.1), (158, 0.005)]


@pytest.mark.parametrize("seed,fraction", CELLS)
def test_leader_is_the_reference_follower_request_for_request(seed, fraction):
    reqs, cap_pages = _family_cell(seed, fraction)
    _, per_req, cache = _run(reqs, cap_pages, None, LEADER)
    assert [c // PAGE for c in per_req] == _reference(reqs, cap_pages)
    snap = cache.policy.snapshot()
    assert snap["follow_leader"] is True and snap["following"] in FIXED_ORDERS
    cache.policy.check_invariants()


@pytest.mark.parametrize("build", [_returning_scan, _hot_set_under_scans])
def test_leader_is_the_reference_follower_on_adversarial_traffic(build):
    reqs, cap_pages = build()
    _, per_req, cache = _run(reqs, cap_pages, None, LEADER)
    assert [c // PAGE for c in per_req] == _reference(reqs, cap_pages)
    cache.policy.check_invariants()


def test_leader_keeps_the_win_the_budget_gives_up():
    """family-16 at 2 % (bench/results/workload_family_c479b78.csv): slru beats lru by 6.8 points
    and the default, which waits for budget before it leaves lru, is lru exactly. Following the
    leader switches to slru early and ends above slru itself (the switch keeps lru's content of
    the first requests)."""
    reqs, cap_pages = _family_cell(16, 0.02)
    lru, _, _ = _run(reqs, cap_pages, "lru")
    slru, _, _ = _run(reqs, cap_pages, "slru")
    default, _, _ = _run(reqs, cap_pages, None, None)
    leader, _, cache = _run(reqs, cap_pages, None, LEADER)
    assert slru > lru + 0.05 and abs(default - lru) < 0.002, (lru, slru, default)
    assert leader >= slru - 0.005, (leader, slru)
    assert cache.policy.snapshot()["leader_switches"] >= 1


def test_leader_option_parses_and_reaches_the_policy():
    cfg = load_config({"SGLANG_TIERED_GUARANTEE": "leader"})
    assert cfg.guarantee == "leader"
    pc = policy_config(cfg)
    assert pc.guard_leader == DECAY and pc.guard_div_cap is False
    assert PolicyConfig().guard_leader == 0.0  # off by default


@pytest.mark.server
def test_leader_on_a_live_server(tiny_model_path, reference_server):
    """``SGLANG_TIERED_GUARANTEE=leader`` on a live tiered server (a 2,048-token pool, so it
    evicts and the shadows' orders differ): every greedy output equals the no-cache server's or,
    where SGLang's own extend over a cached prefix rounds otherwise than a recompute, stock
    SGLang's with its radix cache on the same requests; prefixes hit, and the policy reports the
    mode it runs.

    (Session 34: in a fresh environment request 16, with 112 tokens cached, gave ' Model& open'
    against the no-cache server's ' Model cache'; its first token's logprob was -4.684929 against
    -4.699766. Stock SGLang's radix cache, 112 tokens cached too, served the same -4.684929 and
    the same text, and so did the code of session 33: SGLang's CPU extend path, not the cache's
    KV. So a difference from the no-cache server is accepted only where stock SGLang's cache gives
    the same text, and only for a few requests.)"""
    from sglang_tiered.dev.server import ServerSpec
    from tests.conftest import _start
    from tests.test_e2e_control_plane import stats
    from tests.test_e2e_server import greedy, make_prompt

    server = _start(
        ServerSpec(model_path=tiny_model_path, backend="tiered", page_size=16, max_total_tokens=2048,
                   env={"SGLANG_TIERED_GUARANTEE": "leader"}),
        "leader",
    )  # fmt: skip
    stock = None
    try:
        stock = _start(ServerSpec(model_path=tiny_model_path, backend=None, page_size=16, max_total_tokens=2048),
                       "stock-leader")  # fmt: skip
        docs = [make_prompt(900 + d, 120) for d in range(6)]
        rounded = []
        for k in range(36):  # a few hot documents, a colder tail and one-shot scans
            text = make_prompt(5000 + k, 150) if k % 5 == 4 else docs[(0, 0, 1, 0, 2, 3, 1, 4, 5)[k % 9]]
            text += f" question {k % 7}"
            got, want, sglang = (greedy(s, text, 4)["text"] for s in (server, reference_server, stock))
            if got != want:
                assert got == sglang, (k, got, want, sglang)
                rounded.append(k)
        assert len(rounded) <= 3, rounded
        body = stats(server)
        assert body["totals"]["cached_tokens"] > 0, body["totals"]
        pol = body["policy"][0]
        assert pol["follow_leader"] is True and pol["strict_guarantee"] is False, pol
        assert pol["following"] in FIXED_ORDERS, pol
    finally:
        server.stop()
        if stock is not None:
            stock.stop()
