"""T1's host pool on its own (sglang_tiered/tier/host_pool.py) against a plain model: reserve /
commit / abort / drop / drop by tenant / clear, with LRU replacement when full, write-through
(cold) copies and write-ahead copies in the staging slots. After every step: free + resident +
staged == slots, the index equals the model (in LRU order), every resident slot's stored hash and
tenant tag equal what was committed, and its data is what was written. The model of a victim's
reserve is a store without copies: the batch's pages T1 held (not cold) are used first, then
the others in the batch's order, whether copied now or adopted from a cold or staged copy."""

from __future__ import annotations

from collections import OrderedDict

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sglang_tiered.tier.host_pool import HostPool, PoolLayout

CAP = 6
STAGE = 3
HASHES = [bytes([i]) * 16 for i in range(12)]


class HostPoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = HostPool(PoolLayout(CAP + STAGE, 1, 2, 2, 2, "float32"), staging=STAGE)
        self.model: OrderedDict = OrderedDict()  # hash -> tenant, least recent first
        self.cold: set = set()  # write-through copies not used since
        self.staged: OrderedDict = OrderedDict()  # hash -> tenant, oldest first
        self.pending: list = []  # reserved, not yet committed
        self.renew: list = []  # the batch's pages, re-ordered at commit
        self.kind = None

    def _evict_lru(self):
        h, _ = self.model.popitem(last=False)
        self.cold.discard(h)

    @precondition(lambda self: not self.pending)
    @rule(hs=st.lists(st.sampled_from(HASHES), min_size=1, max_size=4, unique=True), evict=st.booleans(),
          cold=st.booleans())  # fmt: skip
    def reserve(self, hs, evict, cold):
        """``cold``: a write-through copy (free room only, no touch, committed at the LRU end)."""
        evict = evict and not cold
        pairs = self.pool.reserve(hs, evict=evict, touch=not cold)
        want, self.renew = [], []
        if not cold:
            for h in hs:  # resident pages of the batch count as used first
                if h in self.model and h not in self.cold:
                    self.model.move_to_end(h)
            for h in hs:  # then its write-through copies, adopted
                if h in self.cold:
                    self.cold.discard(h)
                    self.model.move_to_end(h)
                    self.renew.append(h)
        for h in hs:
            if h in self.model or (cold and h in self.staged):
                continue
            if len(self.model) + len(want) >= CAP:
                if not evict or not self.model:
                    break
                self._evict_lru()
            if not cold and h in self.staged:  # written ahead: adopted as is
                self.model[h] = self.staged.pop(h)
            else:
                want.append(h)
            if not cold:
                self.renew.append(h)
        assert [h for h, _ in pairs] == want
        for h, slot in pairs:
            self.pool.data[0, 0, :, slot] = float(h[0])
        self.pending = pairs
        self.kind = "cold" if cold else "victim"

    @precondition(lambda self: not self.pending)
    @rule(hs=st.lists(st.sampled_from(HASHES), min_size=1, max_size=4, unique=True))
    def reserve_staging(self, hs):
        pairs = self.pool.reserve_staging(hs)
        want = []
        for h in hs:
            if h in self.model or h in self.staged:
                continue
            while len(self.staged) + len(want) >= STAGE and self.staged:
                self.staged.popitem(last=False)  # the oldest staged page makes room
            if len(want) >= STAGE:
                break  # a batch larger than the staging area: its head only
            want.append(h)
        assert [h for h, _ in pairs] == want
        for h, slot in pairs:
            self.pool.data[0, 0, :, slot] = float(h[0])
        self.pending, self.renew, self.kind = pairs, [], "staged"

    @precondition(lambda self: self.pending or self.renew)
    @rule(tenant=st.integers(0, 2), ok=st.booleans())
    def commit_or_abort(self, tenant, ok):
        if ok:
            self.pool.commit(self.pending, tenant, cold=self.kind == "cold", staged=self.kind == "staged")
            for h, _ in self.pending:
                if self.kind == "staged":
                    self.staged[h] = tenant
                    continue
                self.model[h] = tenant
                if self.kind == "cold":  # each goes to the least recently used end, in turn
                    self.model.move_to_end(h, last=False)
                    self.cold.add(h)
        else:
            self.pool.abort(self.pending)
        for h in self.renew:  # the batch's pages T1 did not hold (not cold), in the batch's order
            if h in self.model:
                self.model.move_to_end(h)
        self.pending, self.renew = [], []

    @precondition(lambda self: not self.pending)
    @rule(hs=st.lists(st.sampled_from(HASHES), max_size=3, unique=True))
    def touch(self, hs):
        hs = [h for h in hs if h in self.model]
        self.pool.slots_for(hs, touch=True)
        for h in hs:
            self.model.move_to_end(h)
            self.cold.discard(h)

    @precondition(lambda self: not self.pending)
    @rule(hs=st.lists(st.sampled_from(HASHES), max_size=3, unique=True))
    def drop(self, hs):
        assert self.pool.drop(hs) == sum(h in self.model for h in hs)
        for h in hs:
            self.model.pop(h, None)
            self.staged.pop(h, None)
            self.cold.discard(h)

    @precondition(lambda self: not self.pending)
    @rule(tenant=st.integers(0, 2))
    def drop_tenant(self, tenant):
        n = self.pool.drop_slots(self.pool.slots_of_tenant(tenant))
        gone = [h for h, t in self.model.items() if t == tenant]
        assert n == len(gone)
        for h in gone:
            del self.model[h]
            self.cold.discard(h)
        for h in [h for h, t in self.staged.items() if t == tenant]:
            del self.staged[h]

    @precondition(lambda self: not self.pending)
    @rule()
    def clear(self):
        assert self.pool.clear() == len(self.model)
        self.model.clear()
        self.staged.clear()
        self.cold.clear()

    @invariant()
    def agrees(self):
        pool = self.pool
        if not self.pending:
            pool.check_invariants()
            assert set(pool.slot_of) == set(self.model)
            assert [bytes(pool.index_hashes[s].numpy()) for s in pool.lru] == list(self.model)  # same LRU order
            assert {bytes(pool.index_hashes[s].numpy()) for s in pool.cold} == self.cold
            assert list(pool.staged) == list(self.staged)
            for h, tenant in self.staged.items():  # written, tagged, not valid (never served)
                s = pool.staged[h]
                assert h not in pool.slot_of and not int(pool.index_valid[s]) and int(pool.index_tenant[s]) == tenant
                assert torch.all(pool.data[0, 0, :, s] == float(h[0]))
        for h, tenant in self.model.items():
            s = pool.slot_of[h]
            assert pool.verify([h], [s]) and int(pool.index_tenant[s]) == tenant
            assert torch.all(pool.data[0, 0, :, s] == float(h[0]))


TestHostPoolMachine = HostPoolMachine.TestCase
TestHostPoolMachine.settings = settings(max_examples=120, stateful_step_count=30, deadline=None)
