"""Hypothesis state machine: ``core.sketch.FrequencySketch`` against an exact model.

Model per key (Caffeine's fuzzer model, with the doorkeeper made explicit): ``door`` (the first
sighting since the last reset was absorbed) and ``count`` (later sightings, capped at 15), both
halved / cleared whenever the sketch resets. A count-min sketch with conservative update and a
Bloom-filter doorkeeper only ever over-estimates, so ``count + door <= estimate <= 16`` must hold
for every key after every step. Pure Python: no torch, no sglang.
"""

from __future__ import annotations

import hashlib

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from sglang_tiered.core.sketch import MAX_COUNT, FrequencySketch

KEYS = [hashlib.blake2b(bytes([i]), digest_size=16).digest() for i in range(40)]  # 40 keys, width 16: collisions


class SketchMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.sketch = FrequencySketch(capacity=16, sample_factor=1)  # resets every 64 increments
        self.count = {k: 0 for k in KEYS}
        self.door = {k: False for k in KEYS}
        self.resets = 0

    def _sync_resets(self) -> None:
        while self.resets < self.sketch.resets:
            self.resets += 1
            self.count = {k: c >> 1 for k, c in self.count.items()}
            self.door = {k: False for k in KEYS}

    @rule(i=st.integers(0, len(KEYS) - 1))
    def increment(self, i):
        k = KEYS[i]
        if self.door[k]:
            self.count[k] = min(MAX_COUNT, self.count[k] + 1)
        else:
            self.door[k] = True
        self.sketch.increment(k)
        self._sync_resets()

    @rule()
    def age(self):
        self.sketch.age()
        self._sync_resets()

    @invariant()
    def estimates_bound_the_model(self):
        for k in KEYS:
            est = self.sketch.estimate(k)
            assert self.count[k] + self.door[k] <= est <= MAX_COUNT + 1, (k.hex(), self.count[k], self.door[k], est)


TestSketch = SketchMachine.TestCase


def test_estimate_counts_a_key_exactly_without_collisions():
    s = FrequencySketch(capacity=1 << 12)
    k = KEYS[0]
    assert s.estimate(k) == 0
    s.increment(k)
    assert s.estimate(k) == 1  # the doorkeeper absorbed the first sighting
    for _ in range(3):
        s.increment(k)
    assert s.estimate(k) == 4


def test_large_caches_sample_harder_and_age_per_reference():
    """Caches over ``scale_sample_pages`` count one hash bit fewer per doubling (session 20: at
    page size 1 a page is a token, and a 148k-page cache spent 20 % of its time in the sketch and
    the miniatures); below it the masks are the defaults. The miniatures' sample stays within the
    counted one, and the sketch ages after as many references as at the default sample."""
    import random

    from sglang_tiered.core.policy import AdaptivePolicy, PolicyConfig, sample_shift

    cfg = PolicyConfig()
    assert [sample_shift(c, cfg) for c in (1, 128, 1 << 15)] == [0, 0, 0]
    assert [sample_shift(c, cfg) for c in ((1 << 15) + 1, 1 << 16, (1 << 16) + 1, 1 << 30)] == [1, 1, 2, 5]
    base = AdaptivePolicy(1 << 15)
    assert (base._sketch_mask, base._duel_mask) == (3, 7)
    rng = random.Random(0)
    for cap in (40_000, 150_000, 1 << 21):
        pol = AdaptivePolicy(cap)
        x = sample_shift(cap, cfg)
        assert pol._sketch_mask == (4 << x) - 1 and pol._duel_mask == (8 << x) - 1 <= 255
        assert pol._sketch_mask & pol._duel_mask == pol._sketch_mask
        # aging: (10 x width) counted additions at the default 1-in-4, so 40 x width references
        assert pol.sketch.sample_size * (pol._sketch_mask + 1) == 10 * pol.sketch.width * 4
        assert pol._mini_cap == cap // (pol._duel_mask + 1)
        for _ in range(20):  # a few requests: the structures stay consistent
            pages = [rng.randbytes(16) for _ in range(rng.randrange(1, 300))]
            pol.begin_request()
            pol.observe(pages, 0)
        pol.check_invariants()
