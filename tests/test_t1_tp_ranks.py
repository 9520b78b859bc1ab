"""TP ranks and T1 (review, session 18). The ranks of one server run the same operations but not in
lock step between forward passes, so a rank must never decide from shared state another rank may
already have changed, and a restart must never serve a slot whose heads hold different pages."""

from __future__ import annotations

import types

import pytest
import torch

import sglang_tiered.tier.host_pool as hp
from sglang_tiered.tier.host_pool import HostPoolError, PoolLayout
from sglang_tiered.tier.host_tier import HostTier

L, H, PS, D, P = 1, 2, 2, 4, 2
LAYOUT = PoolLayout(P, L, H, PS, D, "float32")
PAGE = {n: bytes([n]) * 16 for n in (1, 2, 3, 4)}


@pytest.fixture(autouse=True)
def shm(tmp_path, monkeypatch):
    monkeypatch.setattr(hp, "SHM_DIR", tmp_path)
    yield
    for name in list(hp._owned):
        hp.release_owner(name)


def page_kv(n: int, heads: range) -> torch.Tensor:
    """The true K of logical page ``n`` for ``heads`` (V is its negative)."""
    g = torch.Generator().manual_seed(n)
    return torch.randn(PS, H, D, generator=g)[:, heads.start : heads.stop]


def rank(r: int, tp: int = 2, name: str | None = "t1") -> HostTier:
    heads = hp.heads_for_rank(H, tp, r)
    kv = types.SimpleNamespace(k_buffer=[torch.zeros(4 * PS, len(heads), D)], v_buffer=[torch.zeros(4 * PS, len(heads), D)])
    return HostTier.build(kv, page_size=PS, total_kv_heads=H, tp_size=tp, tp_rank=r, capacity_pages=P, name=name)


def demote(tier: HostTier, n: int) -> None:
    tier.k_buffers[0][:PS] = page_kv(n, tier.heads)
    tier.v_buffers[0][:PS] = -page_kv(n, tier.heads)
    tier.demote(torch.tensor([0]), [PAGE[n]])


def loaded(tier: HostTier, n: int) -> bool:
    """Load page ``n`` into device page 1; True when it loaded and is exactly page ``n``'s KV."""
    if not tier.load([PAGE[n]], torch.tensor([1])):
        return False
    k, v = tier.k_buffers[0][PS : 2 * PS], tier.v_buffers[0][PS : 2 * PS]
    assert torch.equal(k, page_kv(n, tier.heads)) and torch.equal(v, -page_kv(n, tier.heads)), "wrong KV served"
    return True


def state(tier: HostTier):
    p = tier.pool
    p.check_invariants()
    return dict(p.slot_of), list(p.lru), sorted(p.free)


def run_streams(r0: HostTier, r1: HostTier, ops, schedule) -> list:
    """Both ranks run the same operation stream ``ops`` (("d", n): demote page n; ("l", n): load
    page n), interleaved as ``schedule`` says (a rank index per step). Returns each rank's loads."""
    ranks, pos, out = (r0, r1), [0, 0], ([], [])
    for r in schedule:
        if pos[r] == len(ops):
            continue
        op, n = ops[pos[r]]
        pos[r] += 1
        if op == "d":
            demote(ranks[r], n)
        else:
            out[r].append(loaded(ranks[r], n))
    for r in (0, 1):  # the rest, rank by rank
        for op, n in ops[pos[r] :]:
            demote(ranks[r], n) if op == "d" else out[r].append(loaded(ranks[r], n))
    return list(out)


def test_a_lagging_rank_keeps_the_same_books_as_the_leading_one():
    """Rank 0 reuses page 1's slot for page 3 before rank 1 evicts page 1. Rank 1 used to read the
    victim's hash from the shared index (page 3 by then), kept page 1 in its dict, and the ranks
    disagreed on hits from then on."""
    r0, r1 = rank(0), rank(1)
    ops = [("d", 1), ("d", 2), ("d", 3), ("l", 2), ("l", 3), ("l", 1)]
    got = run_streams(r0, r1, ops, [0, 1, 0, 1, 0, 0, 0, 0])  # rank 0 ends its stream first
    assert got[0] == got[1] == [True, True, False]
    assert state(r0) == state(r1)


def test_same_operations_out_of_step_same_decisions():
    """Random streams of demotions and loads, randomly interleaved: both ranks load the same pages
    (exactly their KV: ``loaded`` checks) and end with the same books."""
    import random

    for seed in range(30):
        rng = random.Random(seed)
        ops = [(rng.choice("dddl"), rng.randint(1, 4)) for _ in range(14)]
        r0, r1 = rank(0, name=f"t1-{seed}"), rank(1, name=f"t1-{seed}")
        got = run_streams(r0, r1, ops, [rng.randint(0, 1) for _ in range(2 * len(ops))])
        assert got[0] == got[1], (seed, ops)
        assert state(r0) == state(r1), (seed, ops)


def test_restart_after_a_half_written_slot_serves_no_mixed_kv():
    """Rank 0 wrote page 3 into page 1's slot and the server died before rank 1 did: the slot's
    heads hold pages 3 and 1. A restart (here at TP 1) must not serve it as page 3 (nor page 1)."""
    r0, r1 = rank(0), rank(1)
    for n in (1, 2):
        demote(r0, n)
        demote(r1, n)
    demote(r0, 3)
    hp.release_owner("t1")
    t = rank(0, tp=1)
    assert t.pool.attached
    assert not loaded(t, 3) and not loaded(t, 1)
    assert loaded(t, 2)  # whole in both heads
    t.pool.check_invariants()


def test_without_a_name_each_tp_rank_keeps_a_private_t1_of_its_heads(tmp_path):
    r0, r1 = rank(0, name=None), rank(1, name=None)
    assert not list(tmp_path.iterdir())  # no shared file
    for t in (r0, r1):
        assert t.pool.layout.kv_heads == 1 and t.h0 == 0
        for n in (1, 2, 3):
            demote(t, n)
        assert loaded(t, 3) and loaded(t, 2) and not loaded(t, 1)


def test_a_named_t1_refuses_ranks_that_replicate_heads():
    with pytest.raises(HostPoolError, match="replicate"):
        rank(0, tp=4)
    t = rank(3, tp=4, name=None)  # private: each replica its own copy
    demote(t, 1)
    assert loaded(t, 1)


def test_a_failed_copy_on_one_rank_leaves_the_slot_unserved_after_restart(monkeypatch):
    """A copy that raised on rank 1 only: rank 1 aborts, rank 0 committed. The slot is never whole."""
    r0, r1 = rank(0), rank(1)
    demote(r0, 1)
    import sglang_tiered.tier.host_tier as ht

    def boom(*a, **k):
        raise RuntimeError("copy failed")

    with monkeypatch.context() as m:
        m.setattr(ht, "move_pages_all", boom)
        demote(r1, 1)
    assert r1.stats.failed_demotions == 1
    hp.release_owner("t1")
    t = rank(0, tp=1)
    assert t.pool.attached and t.pool.resident == 0 and not loaded(t, 1)
