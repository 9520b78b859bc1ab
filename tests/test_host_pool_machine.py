"""T1's host pool on its own (sglang_tiered/tier/host_pool.py) against a plain model: reserve /
commit / abort / drop / drop by tenant / clear / reattach, with LRU replacement when full. After
every step: free + resident == capacity, the index equals the model, every resident slot's stored
hash and tenant tag equal what was committed, and its data is what was written."""

from __future__ import annotations

from collections import OrderedDict

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sglang_tiered.tier.host_pool import HostPool, PoolLayout

CAP = 6
HASHES = [bytes([i]) * 16 for i in range(12)]


class HostPoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = HostPool(PoolLayout(CAP, 1, 2, 2, 2, "float32"))
        self.model: OrderedDict = OrderedDict()  # hash -> tenant, least recent first
        self.pending: list = []  # reserved, not yet committed

    @precondition(lambda self: not self.pending)
    @rule(hs=st.lists(st.sampled_from(HASHES), min_size=1, max_size=4, unique=True), evict=st.booleans(),
          cold=st.booleans())  # fmt: skip
    def reserve(self, hs, evict, cold):
        """``cold``: a write-through copy (free slots only, no touch, committed at the LRU end)."""
        evict = evict and not cold
        pairs = self.pool.reserve(hs, evict=evict, touch=not cold)
        for h in hs if not cold else ():  # resident pages of the batch count as used first
            if h in self.model:
                self.model.move_to_end(h)
        want = [h for h in hs if h not in self.model]
        room = CAP - len(self.model)
        if not evict:
            want = want[:room]
        else:
            for _ in range(max(0, len(want) - room)):
                self.model.popitem(last=False)  # LRU replacement
        assert [h for h, _ in pairs] == want
        for h, slot in pairs:
            self.pool.data[0, 0, :, slot] = float(h[0])
        self.pending = pairs
        self.cold = cold

    @precondition(lambda self: self.pending)
    @rule(tenant=st.integers(0, 2), ok=st.booleans())
    def commit_or_abort(self, tenant, ok):
        if ok:
            self.pool.commit(self.pending, tenant, cold=self.cold)
            for h, _ in self.pending:
                self.model[h] = tenant
                if self.cold:  # each goes to the least recently used end, in turn
                    self.model.move_to_end(h, last=False)
        else:
            self.pool.abort(self.pending)
        self.pending = []

    @precondition(lambda self: not self.pending)
    @rule(hs=st.lists(st.sampled_from(HASHES), max_size=3, unique=True))
    def touch(self, hs):
        hs = [h for h in hs if h in self.model]
        self.pool.slots_for(hs, touch=True)
        for h in hs:
            self.model.move_to_end(h)

    @precondition(lambda self: not self.pending)
    @rule(hs=st.lists(st.sampled_from(HASHES), max_size=3, unique=True))
    def drop(self, hs):
        assert self.pool.drop(hs) == sum(h in self.model for h in hs)
        for h in hs:
            self.model.pop(h, None)

    @precondition(lambda self: not self.pending)
    @rule(tenant=st.integers(0, 2))
    def drop_tenant(self, tenant):
        n = self.pool.drop_slots(self.pool.slots_of_tenant(tenant))
        gone = [h for h, t in self.model.items() if t == tenant]
        assert n == len(gone)
        for h in gone:
            del self.model[h]

    @precondition(lambda self: not self.pending)
    @rule()
    def clear(self):
        assert self.pool.clear() == len(self.model)
        self.model.clear()

    @invariant()
    def agrees(self):
        pool = self.pool
        if not self.pending:
            pool.check_invariants()
            assert set(pool.slot_of) == set(self.model)
            assert [bytes(pool.index_hashes[s].numpy()) for s in pool.lru] == list(self.model)  # same LRU order
        for h, tenant in self.model.items():
            s = pool.slot_of[h]
            assert pool.verify([h], [s]) and int(pool.index_tenant[s]) == tenant
            assert torch.all(pool.data[0, 0, :, s] == float(h[0]))


TestHostPoolMachine = HostPoolMachine.TestCase
TestHostPoolMachine.settings = settings(max_examples=120, stateful_step_count=30, deadline=None)
