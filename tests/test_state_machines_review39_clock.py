"""Hypothesis state machine (review, session 39): ``LogicalClock`` (integration/clock.py) against
its promise: every ``now()`` is later than every earlier one, whatever the policy's tick does
between calls and however many uses one tick holds (``MAX_SEQ_PER_TICK``, made small here so the
carry is reached), and a use in a later request tick is never stamped earlier than one before.

  K1 ``now()`` strictly increases; ``current`` is the last ``now()``;
  K2 the stamp's tick part never runs behind the policy's tick, and ahead of it by ``carried``
     at most (a tick of overflow carries into the next);
  K3 ``stamp`` gives the node and its ancestors ``current``, both orders (tick and lru) alike.
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import sglang_tiered.integration.clock as C

settings.register_profile("review39", max_examples=100, stateful_step_count=50, deadline=None)
settings.register_profile("review39-deep", max_examples=1500, stateful_step_count=80, deadline=None)
PROFILE = settings.get_profile(os.environ.get("REVIEW39_PROFILE", "review39"))


class Node(SimpleNamespace):
    pass


class ClockMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.saved = C.MAX_SEQ_PER_TICK
        C.MAX_SEQ_PER_TICK = 3
        self.policy = SimpleNamespace(tick=0)
        self.clock = C.LogicalClock(self.policy)
        self.last = -math.inf
        self.root = Node(parent=None, tiered_tick=0, tiered_lru=0)
        a = Node(parent=self.root, tiered_tick=0, tiered_lru=0)
        self.path = [a, Node(parent=a, tiered_tick=0, tiered_lru=0)]

    def teardown(self):
        C.MAX_SEQ_PER_TICK = self.saved

    @rule(n=st.integers(1, 8))
    def uses(self, n):
        for _ in range(n):
            t = self.clock.now()
            assert t > self.last, ("K1", t, self.last)
            assert self.clock.current == t
            whole = math.floor(t)
            assert self.policy.tick <= whole <= self.policy.tick + self.clock.carried, \
                ("K2", whole, self.policy.tick, self.clock.carried)
            self.last = t

    @rule(k=st.integers(1, 3))
    def next_request(self, k):
        self.policy.tick += k

    @rule(deep=st.booleans())
    def stamp(self, deep):
        node = self.path[-1] if deep else self.path[0]
        self.clock.stamp(node, self.root)
        n = node
        while n is not self.root:
            assert n.tiered_tick == n.tiered_lru == self.clock.current, "K3"
            n = n.parent

    @invariant()
    def carry_bounded(self):
        assert 0 <= self.clock.carried and 0 <= self.clock._seq <= C.MAX_SEQ_PER_TICK


ClockMachine.TestCase.settings = PROFILE
TestClock = ClockMachine.TestCase
