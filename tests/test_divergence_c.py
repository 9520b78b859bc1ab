"""The C divergence (``core/_bookkeeping.c`` ``Divergence``, issue #11, session 45) against the
pure-Python reference it accelerates (``core/shadows.py`` ``DivergencePy``): random streams of
``l_add``/``l_remove``/``r_add``/``r_remove``/``r_clear``/``start``/``stop`` and assignments of a
side, with and without sources (lazy), pages repeated within a call and removals of absent pages,
drive both side by side; after every step the sets, counts, ``counting``, ``held`` and the safety
duel's queries (``l_run``, ``l_count``, ``l_only``, ``l_spared`` at random rooms: negative,
fractional, NaN, infinite, past the pages' length, ints and floats) are equal, and both ``check``.
Keys are 16-byte page hashes, ints, tuples and a NaN (equal to itself by identity alone, as in a
set). The C TreeShadow tells a C divergence directly (``ts_tell``): the same pages and counts as
the reference pair. Skipped where the extension is not built; the selection (``DIVERGENCE_IMPL``)
is tested either way."""

from __future__ import annotations

import gc
import hashlib
import math
import os
import subprocess
import sys
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from sglang_tiered.core import shadows
from sglang_tiered.core.shadows import DivergencePy, TreeShadowPy

try:
    from sglang_tiered.core import _bookkeeping as C
except ImportError:
    C = None

needs_c = pytest.mark.skipif(C is None or not hasattr(C, "Divergence"), reason="the extension is not built")

NAN = float("nan")
KEYS = [os.urandom(16) for _ in range(10)] + list(range(8)) + [("p", 1), ("p", 2), NAN, -1.5]
key_st = st.sampled_from(KEYS)
# int keys made anew (compared by value), bytes copies (compared by content)
fresh_st = st.one_of(key_st, st.integers(0, 7).map(lambda i: int(str(i))),
                     st.sampled_from(KEYS[:10]).map(lambda b: bytes(bytearray(b))))  # fmt: skip
pages_st = st.lists(fresh_st, max_size=8)
room_st = st.one_of(st.integers(-4, 12), st.floats(-3.0, 12.0), st.sampled_from([NAN, math.inf, -math.inf, 0.0, -0.0]),
                    st.just(10**30), st.just(-(10**30)))  # fmt: skip


def _key(x):
    """A canonical name of a key (NaN by identity: there is one NaN object in KEYS)."""
    return repr(x) if x is not NAN else "NAN"


def _names(s) -> list:
    return sorted(map(_key, s))


class DivergenceDuel(RuleBasedStateMachine):
    """The C divergence and the reference, the same calls, compared after each."""

    def __init__(self):
        super().__init__()
        self.L: set = set()  # the sources' sides (lazy): what lru's tree and the real cache hold
        self.R: set = set()

    @initialize(lazy=st.booleans())
    def make(self, lazy):
        src = (lambda: set(self.L), lambda: set(self.R)) if lazy else ()
        self.c, self.p = C.Divergence(*src), DivergencePy(*src)

    def both(self, name, *args):
        outs = []
        for d in (self.c, self.p):
            try:
                outs.append(("ok", getattr(d, name)(*args)))
            except Exception as e:  # noqa: BLE001 - the same exception type either way
                outs.append(("err", type(e)))
        assert outs[0] == outs[1], (name, args, outs)
        return outs[0][1]

    @rule(p=pages_st)
    def l_add(self, p):
        self.L.update(p)
        self.both("l_add", p)

    @rule(p=pages_st)
    def l_remove(self, p):
        self.L.difference_update(p)
        self.both("l_remove", p)

    @rule(p=pages_st, as_tuple=st.booleans())
    def r_add(self, p, as_tuple):
        self.R.update(p)
        self.both("r_add", tuple(p) if as_tuple else p)

    @rule(p=pages_st)
    def r_remove(self, p):
        self.R.difference_update(p)
        self.both("r_remove", p)

    @rule()
    def r_clear(self):
        self.R.clear()
        self.both("r_clear")

    @rule()
    def start(self):
        self.both("start")

    @rule()
    def stop(self):
        self.both("stop")

    @rule(p=pages_st, side=st.sampled_from("LR"))
    def assign(self, p, side):
        if self.p.lazy or self.p.counting:
            return  # (only tests assign a side, of an eager divergence not counting: the
            # reference's counts would go stale, the C's are kept)
        setattr(self.c, side, set(p))
        setattr(self.p, side, set(p))
        getattr(self, side).clear()
        getattr(self, side).update(p)

    @rule(p=pages_st, room=room_st)
    def queries(self, p, room):
        if self.p.counting:  # (restorable asks only then)
            self.both("l_run", p)
        self.both("l_count", p)
        self.both("l_only", p)
        self.both("l_spared", p, room)

    @invariant()
    def agrees(self):
        c, p = self.c, self.p
        assert (c.counting, c.only_l, c.only_r, c.held(), c.lazy) == (p.counting, p.only_l, p.only_r, p.held(), p.lazy)
        assert _names(c.L) == _names(p.L) and _names(c.R) == _names(p.R)
        if c.held():
            assert _names(c.L) == _names(self.L) and _names(c.R) == _names(self.R)
        c.check()
        p.check()


if C is not None and hasattr(C, "Divergence"):
    TestDivergenceDuel = DivergenceDuel.TestCase
    TestDivergenceDuel.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)


@needs_c
@settings(max_examples=300, deadline=None)
@given(lru=st.lists(fresh_st), real=st.lists(fresh_st), leaf=pages_st, room=room_st, counting=st.booleans())
def test_queries_same_as_python(lru, real, leaf, room, counting):
    """Each query on the same sides, eager, as the safety duel asks them (``l_run`` while counting)."""
    c, p = C.Divergence(), DivergencePy()
    for d in (c, p):
        d.l_add(lru)
        d.r_add(real)
        if counting:
            d.start()
    assert c.l_count(leaf) == p.l_count(leaf)
    assert c.l_only(leaf) == p.l_only(leaf)
    assert c.l_run(leaf) == p.l_run(leaf)
    assert c.l_spared(leaf, room) == p.l_spared(leaf, room)


@needs_c
def test_selection():
    """``Divergence`` is the C one unless SGLANG_TIERED_PURE_PYTHON=1 (the reference then)."""
    assert shadows.DIVERGENCE_IMPL == ("python" if shadows.PURE_PYTHON else "c")
    code = "from sglang_tiered.core import shadows as s; print(s.DIVERGENCE_IMPL, s.Divergence.__name__)"
    for env, want in (("1", "python DivergencePy"), ("0", "c Divergence")):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "SGLANG_TIERED_PURE_PYTHON": env},
                             capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
        assert " ".join(out) == want


@needs_c
@pytest.mark.parametrize("order", ["lru"])
def test_c_tree_tells_the_c_divergence_as_the_reference_pair(order):
    """The C TreeShadow with the C divergence as its track (``ts_tell``'s direct call) against the
    reference pair, the real side stored and dropped between requests, through episodes started
    and stopped, lazy and eager: the same ``L``, counts and queries on every request."""
    from sglang_tiered.core.keys import chain_page_hashes
    from sglang_tiered.dev import workload_family as wf

    reqs = wf.generate(wf.draw(72))[:260]
    paged = [chain_page_hashes(hashlib.blake2b((r.tenant or "").encode(), digest_size=16).digest(), r.tokens, 16)
             for r in reqs]  # fmt: skip
    cap = max(len({h for p in paged for h in p}) // 40, max(map(len, paged)) + 2)
    for lazy in (False, True):
        c, p = C.TreeShadow(cap, order), TreeShadowPy(cap, order)
        real: set = set()
        if lazy:
            c.track, p.track = C.Divergence(c.pages, lambda: set(real)), DivergencePy(p.pages, lambda: set(real))
        else:
            c.track, p.track = C.Divergence(), DivergencePy()
        for i, pages in enumerate(paged):
            if i % 50 == 20:
                c.track.start()
                p.track.start()
            elif i % 50 == 45:
                c.track.stop()
                p.track.stop()
            assert c.run(pages) == p.run(pages), i
            stored = pages[: (i * 7) % (len(pages) + 1)]
            dropped = paged[i // 2][::3]
            real.update(stored)
            real.difference_update(dropped)
            for d in (c.track, p.track):
                d.r_add(stored)
                d.r_remove(dropped)
            assert (c.track.only_l, c.track.only_r, c.track.counting) == (p.track.only_l, p.track.only_r,
                                                                          p.track.counting), i  # fmt: skip
            assert c.track.L == p.track.L, i
            assert c.track.l_count(pages) == p.track.l_count(pages)
            assert c.track.l_spared(pages, i % 5 - 1) == p.track.l_spared(pages, i % 5 - 1)
            c.check()
            p.check()


class _Colliding:
    """A key whose hashes all collide (one probe run: every lookup compares the keys before it),
    equal by value, that runs ``_hook(other)`` on each comparison (the re-entry tests' keys)."""

    def __init__(self, v):
        self.v = v

    def __hash__(self):
        return 7

    def __eq__(self, other):
        self._hook(other)
        return isinstance(other, type(self)) and other.v == self.v

    def _hook(self, other):
        pass


@needs_c
def test_refuses_reentry_and_keeps_state():
    """A key's ``__eq__`` that changes the divergence mid-update is refused (RuntimeError), as a
    TreeShadow refuses re-entry; reads from there are allowed; the divergence stays consistent."""
    d = C.Divergence()

    calls: list = []  # what a compared key does (the table's key is asked: ``held == new``)

    class K(_Colliding):
        def _hook(self, other):
            for f in calls:
                f()

    d.l_add([K(1)])
    reads = []
    calls[:] = [lambda: reads.append(len(d.R))]
    d.l_add([K(2)])  # a read from __eq__: allowed
    assert reads and len(d.L) == 2
    calls[:] = [lambda: d.r_add([5])]
    with pytest.raises(RuntimeError):
        d.l_add([K(3)])
    calls.clear()
    d.check()
    assert d.R == set()
    with pytest.raises(TypeError):
        d.l_add([[1]])  # unhashable, as a set refuses it
    d.start()
    d.check()
    with pytest.raises(AssertionError, match="both sources"):
        C.Divergence(lambda: set(), None)

    class Bad(bytes):
        def __eq__(self, o):
            d.stop()  # a mutation from a key compared during the tree's call
            return bytes.__eq__(self, o)

        __hash__ = bytes.__hash__

    t = C.TreeShadow(4)
    t.track = d
    d.l_add([Bad(b"k" * 16)])
    with pytest.raises(RuntimeError):
        t.run([b"k" * 16])  # (ts_tell's direct call: the divergence refuses it as from Python)
    assert d.counting
    d.check()


@pytest.mark.parametrize("impl", ["c", "python"])
def test_a_query_from_a_key_of_another_counts_as_alone(impl):
    """A read is allowed from a key's ``__eq__`` (``test_refuses_reentry_and_keeps_state``); a
    distinct-count query (``l_count``, ``l_only``) run there while another counts gives the same
    answers as run alone, both of them. The C marks the pages a query has counted in the table
    (a page listed twice counts once): the inner query took the outer's marks for its own and
    skipped those pages (2 held pages counted 0; review, session 45)."""
    if impl == "c" and (C is None or not hasattr(C, "Divergence")):
        pytest.skip("the extension is not built")
    cls = C.Divergence if impl == "c" else DivergencePy
    hooks: list = []

    class K(_Colliding):
        def _hook(self, other):
            if other is trigger:  # (the outer query's third page: a and b counted by then)
                while hooks:
                    hooks.pop()()

    a, b, c = K(1), K(2), K(3)
    trigger = K(3)
    d = cls()
    d.l_add([a, b, c])
    d.r_add([c])
    d.start()
    inner = []
    for query, want_outer, want_inner in ((d.l_count, 3, 2), (d.l_only, 2, 2)):
        hooks[:] = [lambda q=query: inner.append(q([a, b]))]  # run while the outer's a, b are counted
        assert query([a, b, trigger, b, a]) == want_outer
        assert inner.pop() == want_inner
        assert query([a, b]) == want_inner  # (alone)
    d.check()


@needs_c
def test_the_collector_frees_a_cycle_through_its_keys():
    """A key that holds the divergence (a tuple: no tp_clear of its own to break the cycle) is
    freed with it by the garbage collector, as a set holding such a key is: the C's tp_clear
    dropped only the sources and kept the table, so the cycle outlived every collection (review,
    session 45)."""

    class Marker:  # (counted among the collector's objects: a weak reference is cleared first)
        __hash__ = object.__hash__

    live = lambda: sum(type(o) is Marker for o in gc.get_objects())  # noqa: E731
    for cls in (C.Divergence, DivergencePy):
        for side in ("l_add", "r_add"):
            d = cls()
            getattr(d, side)([b"k" * 16, (d, Marker())])
            del d
            gc.collect()
            assert live() == 0, (cls, side)


@needs_c
def test_frees_its_keys_and_the_lazy_cycle():
    """A reference per key held, given back when a key leaves both sides and when the divergence
    goes, also through the cycle with lru's tree (the garbage collector frees it); no memory grows
    over 100,000 updates."""
    keys = [os.urandom(16) for _ in range(12)]
    refs = lambda: [sys.getrefcount(x) for x in keys]  # noqa: E731
    before = refs()
    d = C.Divergence()
    d.l_add(keys[:8])
    d.r_add(keys[4:])
    assert sum(a - b for a, b in zip(refs(), before)) == 12
    d.start()
    d.l_remove(keys[:6])
    d.r_clear()
    assert sum(a - b for a, b in zip(refs(), before)) == 2
    d.L = keys
    assert sum(a - b for a, b in zip(refs(), before)) == 12
    del d
    assert refs() == before
    t = C.TreeShadow(8)
    t.track = C.Divergence(t.pages, lambda: set())
    t.run(keys[:6])
    t.track.start()
    t.run(keys[6:])
    assert t.track.only_l == 6
    del t
    gc.collect()
    assert refs() == before

    pool = [os.urandom(16) for _ in range(4000)]
    d = C.Divergence()
    d.start()

    def churn(n):
        for i in range(n):
            j = (i * 37) % 3900
            d.l_add(pool[j : j + 50])
            d.r_add(pool[j + 20 : j + 70])
            d.l_remove(pool[j + 10 : j + 60])
            d.r_remove(pool[j : j + 40])
            d.l_count(pool[j : j + 30])
            d.l_spared(pool[j : j + 30], 3.5)

    churn(2000)
    tracemalloc.start()
    m0 = tracemalloc.get_traced_memory()[0]
    churn(25000)  # 100,000 updates
    m1 = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert m1 - m0 < 256 * 1024, (m0, m1)
    d.check()
