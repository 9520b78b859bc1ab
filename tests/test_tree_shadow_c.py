"""The C tree shadow (``core/_bookkeeping.c`` ``TreeShadow``, issue #11, session 43) against the
pure-Python reference it accelerates (``core/shadows.py`` ``TreeShadowPy``), step for step: random
request streams (shared prefixes, splits, limits, tails, starts, reserves, decodes, touches, forks
to every order, small capacities so that eviction is constant) drive both side by side, and after
every step the return values, the pages held, every node's last page with its touch and creation
order (``lasts``: the node splits and touches), ``used``, ``clock``, ``seq``, ``stamps`` (the heap
filings), ``full`` and the recorded ``track`` calls (pages and order) are equal, and both ``check``.
Keys are 16-byte page hashes, or ints and tuples (compared by ``==``, repeated across nodes).
Skipped where the extension is not built; the selection (``TREE_IMPL``) is tested either way."""

from __future__ import annotations

import gc
import hashlib
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_tiered.core import shadows
from sglang_tiered.core.shadows import FIXED_ORDERS, Divergence, TreeShadowPy

try:
    from sglang_tiered.core import _bookkeeping as C
except ImportError:
    C = None

needs_c = pytest.mark.skipif(C is None, reason="the _bookkeeping extension is not built")


class Recorder:
    """A ``track``: every call in order, and the pages held (``L``) for ``check``."""

    def __init__(self, unique: bool = True):
        self.calls: list = []
        self.L: set = set()
        self.unique = unique  # a page is in one node at most (chained hashes): L is the pages held

    def l_add(self, pages):
        self.calls.append(("add", list(pages)))
        self.L.update(pages)

    def l_remove(self, pages):
        self.calls.append(("remove", list(pages)))
        self.L.difference_update(pages)

    def held(self) -> bool:
        return self.unique

    def check(self) -> None:
        pass


def _pages(kind: str, stem: int, branch: int, depth: int, cut: int) -> list:
    """A request's pages: a stem shared by many requests, then a branch (so nodes split where the
    branches part); bytes chained (a page names its whole prefix, as page hashes do), or ints /
    tuples that repeat across nodes (new int objects each time: compared by value, not identity)."""
    out, h = [], b""
    for j in range(depth):
        b = stem if j < cut else branch
        if kind == "bytes":
            h = hashlib.blake2b(h + bytes([j < cut, b]), digest_size=16).digest()
            out.append(h)
        elif kind == "int":
            out.append(int(str(10**20 + (b if j < cut else b + 7) * 3 + j % 3)))
        else:
            out.append(("p", b, j % 4))
    return out


step_st = st.one_of(
    st.tuples(st.just("run"), st.integers(0, 3), st.integers(0, 4), st.integers(0, 9), st.integers(0, 9),
              st.integers(0, 1), st.integers(0, 4), st.one_of(st.none(), st.integers(-1, 9)), st.integers(0, 1)),
    st.tuples(st.just("decode"), st.integers(0, 3), st.integers(0, 4), st.integers(0, 9), st.integers(0, 6),
              st.integers(0, 15), st.integers(0, 60), st.sampled_from([1, 2, 4, 16])),
    st.tuples(st.just("touch"), st.integers(0, 3), st.integers(0, 4), st.integers(0, 9), st.integers(0, 9)),
    st.tuples(st.just("fork"), st.sampled_from(FIXED_ORDERS)),
    st.tuples(st.just("track"), st.booleans()),
)  # fmt: skip


def _state(t, rec):
    return (sorted(map(repr, t.pages())), sorted((repr(k), v) for k, v in t.lasts().items()),
            sorted(map(repr, t.bounds())), t.used, t.clock, t.seq, t.stamps, t.full, t.cap, t.order,
            None if rec is None else rec.calls)  # fmt: skip


@needs_c
@settings(max_examples=300, deadline=None)
@given(order=st.sampled_from(FIXED_ORDERS), cap=st.integers(1, 24), kind=st.sampled_from(["bytes", "int", "tuple"]),
       steps=st.lists(step_st, min_size=1, max_size=60))  # fmt: skip
def test_tree_shadow_c_same_as_python(order, cap, kind, steps):
    c, p = C.TreeShadow(cap, order), TreeShadowPy(cap, order)
    rc, rp = Recorder(kind == "bytes"), Recorder(kind == "bytes")
    c.track, p.track = rc, rp
    for s in steps:
        op = s[0]
        if op == "run":
            _, stem, branch, depth, cut, tail, start, limit, reserve = s
            pages = _pages(kind, stem, branch, depth, cut)
            args = (tail, start, limit, reserve)
            assert c.run(list(pages), *args) == p.run(list(pages), *args)
        elif op == "decode":
            _, stem, branch, cut, start, r, steps_n, page = s
            # a prompt of `start` full pages (and a partial one), and decoded tokens that fit the
            # pool (a request SGLang holds does): the request's pages are its first (n + steps) // page
            n = start * page + r % page
            steps_n = min(steps_n, max(0, (cap - 1) * page - n))
            pages = _pages(kind, stem, branch, (n + steps_n) // page, cut)
            dec = (n, steps_n, page)
            assert c.run(pages, 0, start, None, 0, dec) == p.run(pages, 0, start, None, 0, dec) == 0
        elif op == "touch":
            pages = _pages(kind, *s[1:])
            assert c.touch(pages) == p.touch(pages)
        elif op == "fork":
            c, p = c.fork(s[1]), p.fork(s[1])
            assert type(c) is C.TreeShadow and c.track is None and p.track is None
            rc = rp = None
        else:
            rc, rp = (Recorder(kind == "bytes"), Recorder(kind == "bytes")) if s[1] else (None, None)
            if rc is not None:
                rc.L, rp.L = c.pages(), p.pages()
            c.track, p.track = rc, rp
        assert _state(c, rc) == _state(p, rp), s
        c.check()
        p.check()


@needs_c
@pytest.mark.parametrize("order", FIXED_ORDERS)
def test_tree_shadow_c_on_a_workload_same_as_python(order):
    """A generated family workload at a small capacity (hundreds of evictions), with a lazy
    ``Divergence`` as the track (as core/safety.py sets it), the same hits on every request."""
    from sglang_tiered.core.keys import chain_page_hashes
    from sglang_tiered.dev import workload_family as wf

    reqs = wf.generate(wf.draw(72))[:300]
    paged = [chain_page_hashes(hashlib.blake2b((r.tenant or "").encode(), digest_size=16).digest(), r.tokens, 16)
             for r in reqs]  # fmt: skip
    cap = max(len({h for p in paged for h in p}) // 50, max(map(len, paged)) + 2)
    c, p = C.TreeShadow(cap, order), TreeShadowPy(cap, order)
    c.track = Divergence(c.pages, lambda: set())
    p.track = Divergence(p.pages, lambda: set())
    for i, pages in enumerate(paged):
        if i == 100:
            c.track.start()
            p.track.start()
        assert c.run(pages, i % 2, 0, len(pages) - 1 if i % 3 else None, i % 2) == p.run(
            pages, i % 2, 0, len(pages) - 1 if i % 3 else None, i % 2), i
        assert (c.used, c.clock, c.full, c.track.only_l) == (p.used, p.clock, p.full, p.track.only_l), i
    assert c.pages() == p.pages() and c.lasts() == p.lasts() and c.full
    c.check()
    p.check()


@needs_c
def test_tree_shadow_c_frees_its_pages_and_its_cycle():
    """A reference per page held (split nodes pass theirs on), every one given back when the shadow
    goes, also through the cycle a lazy ``Divergence`` makes (its source is the shadow's bound
    ``pages``): the garbage collector frees it."""
    keys = [os.urandom(16) for _ in range(12)]
    refs = lambda: [sys.getrefcount(x) for x in keys]  # noqa: E731
    before = refs()
    t = C.TreeShadow(8, "lfu")
    t.run(keys[:6])
    t.run(keys[:3] + keys[6:9])  # split at 3
    t.run(keys[9:12])  # evicts
    assert sum(a - b for a, b in zip(refs(), before)) == t.used
    f = t.fork("slru")
    assert f.pages() == t.pages()
    del f
    t.track = Divergence(t.pages, lambda: set())
    t.track.start()
    del t
    gc.collect()
    assert refs() == before


@needs_c
def test_tree_shadow_c_refuses_reentry_and_bad_orders():
    t = C.TreeShadow(4)

    class Back(Recorder):
        def l_add(self, pages):
            t.run([b"y" * 16])

    t.track = Back()
    with pytest.raises(RuntimeError):
        t.run([b"x" * 16])
    t.track = None
    assert t.run([b"z" * 16]) == 0  # usable after the refused call
    with pytest.raises(ValueError, match="order must be one of"):
        C.TreeShadow(4, "fifo")
    with pytest.raises(ValueError, match="order must be one of"):
        t.fork("fifo")
    with pytest.raises(TypeError):
        t.run([[1]])  # unhashable, as the reference's dict lookup
    with pytest.raises(AttributeError):
        t.used = 3  # read-only: nothing outside writes it


def test_tree_selection_follows_pure_python_env():
    """The C class where built, the reference under SGLANG_TIERED_PURE_PYTHON=1 (or unbuilt)."""
    want = "c" if C is not None and os.environ.get("SGLANG_TIERED_PURE_PYTHON") != "1" else "python"
    assert shadows.TREE_IMPL == want
    assert (shadows.TreeShadow is TreeShadowPy) == (want == "python")
    code = "from sglang_tiered.core import shadows; print(shadows.TREE_IMPL, shadows.TreeShadow.__name__)"
    env = dict(os.environ, SGLANG_TIERED_PURE_PYTHON="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["python", "TreeShadowPy"]


@needs_c
def test_tree_shadow_c_equal_priority_leaves_pop_by_creation_order():
    """Two evictable leaves with the same priority pop in creation order (``seq``), not filing order
    (``stamp``): a split's lower part that still has a child is touched at the tick of the insert
    that makes a new leaf beside it; evicting its child files it again later, with the same ``last``
    as the newer leaf. The reference's heap entries ``(priority, seq, stamp, node)`` pop the older
    node first. (The random streams of the test above rarely build this: the C ordering equal
    priorities by stamp alone passed them.)"""
    A, B, Cp, D, E, F, G, H, I = (bytes([65 + i]) * 16 for i in range(9))
    far = [bytes([i]) * 16 for i in range(1, 7)]
    steps = [
        ([A, B, Cp], 0, 0, None, 0, (1, 13, 4)),  # a decode's release inserts [A B C]
        ([A, B, Cp, D], 1, 2, 1, 0),  # match capped at A: split, [B C] gets the child [D]
        ([A, B, E, F, G], 0, 1, 1, 0),  # the insert splits [B C] at B: [C] (seq 1) and [E F G] both at tick 9
        ([H, I] + far, 1, 3, 1, 0),  # evicts [D] (tick 6), then [C] (seq 1) before [E F G] (seq 5)
    ]
    calls = {}
    for order in FIXED_ORDERS:
        c, p = C.TreeShadow(14, order), TreeShadowPy(14, order)
        rc, rp = Recorder(), Recorder()
        c.track, p.track = rc, rp
        for s in steps:
            assert c.run(*s) == p.run(*s)
            assert _state(c, rc) == _state(p, rp), (order, s)
            c.check()
            p.check()
        calls[order] = rc.calls
    assert calls["lru"][-3:-1] == [("remove", [D]), ("remove", [Cp])]  # [C] and [E F G]: both last touched at 9


@needs_c
def test_tree_shadow_c_reinit_gives_keys_back_after_emptying():
    """Re-initializing gives every key back; a key's ``__del__`` that calls the shadow then finds it
    empty and uninitialized (a RuntimeError), not half freed (it read a freed key: a segfault). In
    a subprocess: the failure was a crash."""
    code = """if True:
        from sglang_tiered.core._bookkeeping import TreeShadow
        t = TreeShadow(16)
        seen, on = [], []
        class K(int):
            def __del__(self):
                for f in (t.lasts, t.pages, t.check, lambda: t.run([1]), lambda: t.touch([1])) if on else ():
                    try:
                        seen.append(f())
                    except RuntimeError as e:
                        seen.append(str(e))
        t.run([K(1), K(2), K(3)])
        t.run([K(1), K(5)])  # a split: two nodes hold keys
        on.append(1)
        t.__init__(8)
        on.clear()
        assert t.lasts() == {} and t.cap == 8 and t.used == 0
        assert len(seen) == 20 and set(seen) == {"TreeShadow not initialized"}, seen
        t.run([K(7)])
        del t  # dealloc: a __del__ cannot reach the shadow (no reference left): NameError, ignored
        print("ok")
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["ok"], (out.returncode, out.stdout, out.stderr[-2000:])


@needs_c
def test_tree_shadow_c_refuses_counts_that_would_overflow():
    """``tail``, ``start``, ``reserve`` and decode's counts near ``sys.maxsize`` overflowed the C's
    sums (a tail of sys.maxsize "fit" and its pages were inserted; the reference, with unbounded
    ints, inserts nothing): past an eighth of the range the C refuses them (OverflowError) and is
    unchanged; within it, it decides as the reference."""
    big = sys.maxsize
    cases = [dict(tail=big), dict(reserve=big), dict(tail=1, reserve=big - 1), dict(start=-big - 1),
             dict(tail=-big - 1),
             dict(decode=(big - 5, 3, 4)), dict(decode=(0, big, 1 << 40)), dict(decode=(1, 2, big))]  # fmt: skip
    for kw in cases:
        c, p = C.TreeShadow(8), TreeShadowPy(8)
        for t in (c, p):
            t.run([b"a" * 16, b"b" * 16])
        before = _state(c, None)
        pages = [b"x" * 16, b"y" * 16]
        try:
            got = c.run(pages, **kw)
        except OverflowError:
            assert _state(c, None) == before, kw
            continue
        if "decode" not in kw:  # (the reference's decode loop is as long as the counts: not run)
            assert got == p.run(pages, **kw) and _state(c, None) == _state(p, None), kw
        else:
            raise AssertionError(f"{kw}: accepted ({got})")
    m = sys.maxsize // 8
    for kw in (dict(tail=m), dict(reserve=m), dict(start=-m), dict(tail=-m), dict(start=m)):
        c, p = C.TreeShadow(8), TreeShadowPy(8)
        assert c.run([b"x" * 16], **kw) == p.run([b"x" * 16], **kw) and _state(c, None) == _state(p, None), kw


@needs_c
def test_tree_shadow_c_splits_at_a_page_unequal_to_itself_as_the_reference():
    """The reference compares a partly matched node's pages as lists (an identical item is equal),
    then, where they differ, counts the match with ``==`` alone, which a NaN page (the same object)
    stops: it splits there, and so does the C (it took the identical NaN as matched: one split fewer)."""
    nan = float("nan")
    for steps in ([[1, nan, 3], [1, nan, 4]], [[1, 2, nan, 5, 6], [1, 2, nan, 5, 7]], [[nan, nan, 1], [nan, nan, 2]]):
        c, p = C.TreeShadow(12), TreeShadowPy(12)
        for pages in steps:
            assert c.run(pages) == p.run(pages)
            got = [(t.used, t.seq, t.stamps, t.clock, sorted(map(repr, t.lasts().items()))) for t in (c, p)]
            assert got[0] == got[1], got
            c.check()  # (the reference's check asks a node's first page == its dict key: a NaN is not)


def _trie_pages(path: list) -> list:
    """A request's pages as a path in a small trie: page j names the choices up to j (chained, as
    page hashes are), so requests share prefixes of any length and part at any depth."""
    return [hashlib.blake2b(bytes(path[: j + 1]), digest_size=16).digest() for j in range(len(path))]


trie_step_st = st.one_of(
    st.tuples(st.just("run"), st.lists(st.integers(0, 2), max_size=9), st.integers(0, 1), st.integers(0, 4),
              st.one_of(st.none(), st.integers(0, 9)), st.integers(0, 1)),
    st.tuples(st.just("decode"), st.lists(st.integers(0, 2), max_size=9), st.integers(0, 9), st.integers(0, 3),
              st.sampled_from([1, 2, 4])),
    st.tuples(st.just("touch"), st.lists(st.integers(0, 2), max_size=9)),
    st.tuples(st.just("fork"), st.sampled_from(FIXED_ORDERS)),
)  # fmt: skip


@needs_c
@settings(max_examples=300, deadline=None)
@given(order=st.sampled_from(FIXED_ORDERS), cap=st.integers(1, 16),
       steps=st.lists(trie_step_st, min_size=1, max_size=40))  # fmt: skip
def test_tree_shadow_c_same_as_python_on_trie_paths(order, cap, steps):
    """The side-by-side test on requests that part at any depth (the streams above part them once,
    after a stem): splits below splits, capped matches whose insert splits further down. (It does
    not find the equal-priority case of test_tree_shadow_c_equal_priority_leaves_pop_by_creation_order
    either, in 5,000 examples: that one is pinned by hand.)"""
    c, p = C.TreeShadow(cap, order), TreeShadowPy(cap, order)
    rc, rp = Recorder(), Recorder()
    c.track, p.track = rc, rp
    for s in steps:
        if s[0] == "run":
            pages, args = _trie_pages(s[1]), s[2:]
            assert c.run(pages, *args) == p.run(pages, *args)
        elif s[0] == "decode":
            _, path, start, r, page = s
            start = min(start, len(path))
            n = start * page + r % page
            steps_n = max(0, min(len(path) * page, (cap - 1) * page) - n)  # (fits the pool, as held requests do)
            pages = _trie_pages(path)[: (n + steps_n) // page]
            dec = (n, steps_n, page)
            assert c.run(pages, 0, start, None, 0, dec) == p.run(pages, 0, start, None, 0, dec)
        elif s[0] == "touch":
            pages = _trie_pages(s[1])
            assert c.touch(pages) == p.touch(pages)
        else:
            c, p = c.fork(s[1]), p.fork(s[1])
            rc = rp = None
        assert _state(c, rc) == _state(p, rp), s
        c.check()
        p.check()


@needs_c
def test_tree_shadow_c_reads_refuse_a_key_that_calls_back():
    """``pages``, ``lasts`` and ``bounds`` hash the pages they return: a page's ``__hash__`` that
    re-initializes (or runs) the shadow freed the nodes under the walk (a segfault); the reads hold
    the shadow busy, as a run does, and the call back is refused (RuntimeError). In a subprocess:
    the failure was a crash."""
    code = """if True:
        from sglang_tiered.core._bookkeeping import TreeShadow
        t = TreeShadow(200)
        arm, refused = [], []
        class K:
            def __init__(self, v):
                self.v = v
            def __hash__(self):
                if arm:
                    arm.clear()
                    for f in (lambda: t.__init__(200), lambda: t.run([K(-1)]), lambda: t.touch([K(-2)])):
                        try:
                            f()
                        except RuntimeError:
                            refused.append(1)
                return hash(self.v)
            def __eq__(self, o):
                return isinstance(o, K) and o.v == self.v
        for i in range(40):
            t.run([K(i), K(100 + i), K(200 + i)])
        for name, want in (("lasts", 40), ("pages", 120), ("bounds", 40)):
            arm.append(1)
            assert len(getattr(t, name)()) == want, name
            assert len(refused) == 3, (name, refused)
            refused.clear()
        t.check()
        assert t.run([K(0), K(100), K(7)]) == 2  # usable after
        print("ok")
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["ok"], (out.returncode, out.stdout, out.stderr[-2000:])
