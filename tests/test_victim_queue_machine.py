"""Hypothesis state machine: ``core.eviction.VictimQueue`` against a sorted-list model.

The model keeps every evictable leaf as ``(tick, id)`` in one sorted list per class (unprotected,
protected); the victim is the head of one of them by ``unprotected_first``. The queue must pop
exactly the model's victim after any mix of new leaves, uses (tick changes), re-classing (hit
counts), removals (locked or deleted leaves) and rebuilds, with its own checker as the invariant.
Pure Python: no torch, no sglang.
"""

from __future__ import annotations

import itertools

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sglang_tiered.core.eviction import VictimQueue, is_reused, unprotected_first


class Leaf:
    __slots__ = ("id", "hit_count", "tiered_tick", "tiered_entry")

    def __init__(self, node_id: int, tick: float):
        self.id, self.hit_count, self.tiered_tick, self.tiered_entry = node_id, 1, tick, None


def model_victim(leaves, boost: float):
    """The victim by the rule, from plain sorted lists."""
    prob = sorted((n.tiered_tick, n.id) for n in leaves if not is_reused(n.hit_count))
    prot = sorted((n.tiered_tick, n.id) for n in leaves if is_reused(n.hit_count))
    if not prob and not prot:
        return None
    if not prot or (prob and unprotected_first(prob[0], prot[0], boost)):
        return prob[0][1]
    return prot[0][1]


class VictimQueueMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.leaves: set = set()
        self.queue = VictimQueue(self.leaves)
        self.ids = itertools.count()
        self.by_id: dict[int, Leaf] = {}
        self.now = 0.0  # logical time only moves forward (as the adapter's clock does)

    def _tick(self, step: int) -> float:
        self.now += step
        return self.now

    @rule(step=st.integers(0, 3))
    def add_leaf(self, step):
        n = Leaf(next(self.ids), self._tick(step))
        self.by_id[n.id] = n
        self.leaves.add(n)
        self.queue.offer(n)

    @precondition(lambda self: self.leaves)
    @rule(data=st.data(), step=st.integers(0, 3))
    def use(self, data, step):
        n = data.draw(st.sampled_from(sorted(self.leaves, key=lambda x: x.id)))
        n.tiered_tick = self._tick(step)
        if data.draw(st.booleans()):
            n.hit_count += 1  # reuse is counted up, never down
        if data.draw(st.booleans()):  # match_prefix stamps without offering: the entry goes stale
            self.queue.offer(n)

    @precondition(lambda self: self.leaves)
    @rule(data=st.data())
    def lock_or_delete(self, data):
        n = data.draw(st.sampled_from(sorted(self.leaves, key=lambda x: x.id)))
        self.leaves.discard(n)

    @precondition(lambda self: self.by_id)
    @rule(data=st.data())
    def unlock(self, data):
        n = self.by_id[data.draw(st.sampled_from(sorted(self.by_id)))]
        if n not in self.leaves:
            self.leaves.add(n)
            self.queue.offer(n)

    @rule()
    def rebuild(self):
        """A rebuild (past ``4 x leaves + 1024`` entries; forced here) while leaves are locked or
        have children: one back later at its old tick and class must be queued again (session
        45, a helper's differential test: its entry was dropped and its ``tiered_entry`` kept,
        so ``offer`` saw it current and it was never evicted again until its next use)."""
        self.queue._rebuild()

    @rule(boost=st.sampled_from([0.0, 0.5, 3.0, 100.0, float("inf")]))
    def pop(self, boost):
        want = model_victim(self.leaves, boost)
        got = self.queue.pop(boost)
        assert (got.id if got is not None else None) == want
        if got is not None:
            self.leaves.discard(got)

    @rule(boost=st.sampled_from([0.0, 2.0, float("inf")]))
    def peek_changes_nothing(self, boost):
        want = model_victim(self.leaves, boost)
        got, _ = self.queue.peek(boost)
        assert (got.id if got is not None else None) == want
        assert model_victim(self.leaves, boost) == want

    @rule(boost=st.sampled_from([0.0, 0.5, 3.0, float("inf")]))
    def ordered_is_the_pop_order(self, boost):
        """``ordered`` (the store queue's write-ahead walk) lists the leaves exactly in the order
        successive pops would take them, and changes nothing (the pop rule checks afterwards)."""
        rest, want = set(self.leaves), []
        while (v := model_victim(rest, boost)) is not None:
            want.append(v)
            rest.discard(self.by_id[v])
        assert [n.id for n in self.queue.ordered(boost)] == want

    @invariant()
    def checker(self):
        self.queue.check_invariants()


TestVictimQueue = VictimQueueMachine.TestCase


def test_pop_order_exact_scenario():
    """Scripted: unprotected by age, protected aged by the boost, ties to the smaller id."""
    leaves: set = set()
    q = VictimQueue(leaves)
    a, b, c, d = Leaf(0, 5.0), Leaf(1, 1.0), Leaf(2, 3.0), Leaf(3, 3.0)  # ids = creation order
    b.hit_count = 2  # protected, oldest
    for n in (a, b, c, d):
        leaves.add(n)
        q.offer(n)
    order = []
    while (n := q.pop(boost=3.0)) is not None:  # b counts as tick 4: after c, d (3), before a (5)
        leaves.discard(n)
        order.append(n.id)
    assert order == [2, 3, 1, 0]


def test_rebuilt_queue_ordered_is_the_pop_order_and_changes_nothing():
    """The fixed orders' queue (safety duel): ``ordered`` lists what successive pops return."""
    from sglang_tiered.core.eviction import RebuiltQueue

    leaves = [Leaf(i, float(t)) for i, t in enumerate([5, 1, 3, 3, 9, 0])]
    prio = lambda n: (0, n.tiered_tick)  # noqa: E731
    q = RebuiltQueue([(prio(n), n.id, n) for n in leaves], prio)
    before = list(q.heap)
    walked = [n.id for n in q.ordered(0.0)]
    assert q.heap == before
    popped = []
    while (n := q.pop(0.0)) is not None:
        popped.append(n.id)
    assert walked == popped == [5, 1, 2, 3, 0, 4]


def test_leaf_back_after_a_rebuild_is_queued():
    """Scripted (the machine's ``rebuild`` rule): a leaf locked (or given a child) over a rebuild,
    then back at the same tick and class, is queued again and evicted."""
    leaves: set = set()
    q = VictimQueue(leaves)
    a, b = Leaf(0, 1.0), Leaf(1, 2.0)
    for n in (a, b):
        leaves.add(n)
        q.offer(n)
    leaves.discard(a)  # locked: out of the evictable leaves, its entry left in the heap
    q._rebuild()  # (the heaps past their bound)
    leaves.add(a)  # unlocked, untouched: the same tick and class
    q.offer(a)
    q.check_invariants()
    assert q.pop(0.0) is a
