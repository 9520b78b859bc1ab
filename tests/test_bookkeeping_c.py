"""The C bookkeeping (``core/_bookkeeping.c``: the duel's miniatures and the TinyLFU sketch, issue
#11, session 42) against the pure-Python references it accelerates (``MiniCachePy``,
``FrequencySketchPy``), decision for decision: the same hits, the same segments in the same order
with the same ticks, the same float ``age`` bit for bit, the same sketch counters, doorkeeper and
aging points, on random page streams with repeats. Skipped where the extension is not built;
the selection (``MINI_IMPL``, ``SKETCH_IMPL``, ``SGLANG_TIERED_PURE_PYTHON``) is tested either way."""

from __future__ import annotations

import gc
import hashlib
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_tiered.core import miniature, sketch
from sglang_tiered.core.miniature import MiniCachePy
from sglang_tiered.core.sketch import FrequencySketchPy, _select_py

try:
    from sglang_tiered.core import _bookkeeping as C
except ImportError:
    C = None

needs_c = pytest.mark.skipif(C is None, reason="the _bookkeeping extension is not built")


def _page(chain: int, j: int) -> bytes:
    return hashlib.blake2b(f"{chain}:{j}".encode(), digest_size=16).digest()


# a request: the first `depth` pages of one of a few chains, every `step`-th one (a sample), or
# a few random pages (misses that never repeat)
request_st = st.one_of(
    st.tuples(st.integers(0, 6), st.integers(0, 16), st.integers(1, 3)).map(
        lambda r: [_page(r[0], j) for j in range(0, r[1], r[2])]),
    st.lists(st.binary(min_size=16, max_size=16), max_size=4),
)
requests_st = st.lists(request_st, min_size=1, max_size=60)


def _sketch_state(s):
    return ([bytes(r) for r in s.rows], bytes(s.door), s.additions, s.resets, s.width, s.mask, s.door_bits,
            s.sample_size)  # fmt: skip


@needs_c
@settings(max_examples=200, deadline=None)
@given(reqs=requests_st, capacity=st.sampled_from([1, 16, 20, 64]), factor=st.integers(1, 3),
       shift=st.integers(0, 2), mask=st.sampled_from([0, 1, 3, 7]),
       how=st.lists(st.sampled_from(["all", "each", "masked", "age"]), min_size=1))  # fmt: skip
def test_sketch_c_same_as_python(reqs, capacity, factor, shift, mask, how):
    """Counters, doorkeeper, additions and resets after every request, and every estimate, equal;
    the sample is small (64-192 increments) so aging happens within a run, mid-request too."""
    c, p = C.FrequencySketch(capacity, factor, shift), FrequencySketchPy(capacity, factor, shift)
    assert _sketch_state(c) == _sketch_state(p)
    for i, pages in enumerate(reqs):
        op = how[i % len(how)]
        if op == "all":
            c.increment_all(pages)
            p.increment_all(list(pages))
        elif op == "each":
            for h in pages:
                c.increment(h)
                p.increment(h)
        elif op == "masked":
            c.increment_masked(pages, mask)
            p.increment_masked(pages, mask)
        else:
            c.age()
            p.age()
        assert _sketch_state(c) == _sketch_state(p)
        for h in pages + [_page(0, 0), _page(9, 9)]:
            assert c.estimate(h) == p.estimate(h)


@needs_c
def test_sketch_c_reads_every_bit_of_the_key():
    """Row indices from bits 0/32/64/96 and the doorkeeper's from bits 16/80, for keys of any
    length (shorter ones zero-extended, as int.from_bytes does) and a wide sketch."""
    c, p = C.FrequencySketch(1 << 20), FrequencySketchPy(1 << 20)
    keys = [os.urandom(n) for n in (16, 16, 16, 8, 1, 0, 20, 32)] * 3
    for k in keys:
        c.increment(k)
        p.increment(k)
        assert c.estimate(k) == p.estimate(k)
    assert _sketch_state(c) == _sketch_state(p)


@needs_c
@settings(max_examples=300, deadline=None)
@given(reqs=requests_st, cap=st.integers(1, 16),
       k=st.one_of(st.sampled_from([0.0, 0.5, 2.0, float("inf")]), st.floats(0.0, 50.0)),
       tinylfu=st.booleans(), est_kind=st.sampled_from(["c", "py", "lambda"]),
       gaps=st.lists(st.integers(1, 7), min_size=1))  # fmt: skip
def test_miniature_c_same_as_python(reqs, cap, k, tinylfu, est_kind, gaps):
    """Hits, both segments (order and ticks) and ``age`` (bit for bit) equal after every request,
    with TinyLFU on and off, the estimate from the C sketch (called in C), the Python sketch or
    any callable, and a sketch counting every page (aging crossing its sample size)."""
    c, p = C.MiniCache(tinylfu, cap), MiniCachePy(tinylfu, cap)
    sk = C.FrequencySketch(16, 1) if est_kind == "c" else FrequencySketchPy(16, 1)
    est = sk.estimate if est_kind != "lambda" else (lambda h: h[1] % 5)
    tick = 0
    for i, pages in enumerate(reqs):
        tick += gaps[i % len(gaps)]
        assert c.run(pages, tick, k, est) == p.run(list(pages), tick, k, est)
        assert list(c.prob.items()) == list(p.prob.items())
        assert list(c.prot.items()) == list(p.prot.items())
        assert c.age.hex() == p.age.hex()
        assert c.full() == p.full()
        c.check()
        p.check()
        sk.increment_all(pages)


@needs_c
def test_miniature_c_age_rounds_as_python():
    """Long runs of evictions at irregular ticks and odd ``k``: ``age`` is updated one rounding
    at a time as Python does (no fused multiply-add), so the victims and the age never drift."""
    c, p = C.MiniCache(False, 7), MiniCachePy(False, 7)
    tick = 0
    for i in range(5000):
        tick += 1 + (i * 7919) % 13
        pages = [_page(i % 37, j) for j in range(i % 5)] + [_page(1000 + i, 0)]
        assert c.run(pages, tick, 1.0 / 3.0, None) == p.run(pages, tick, 1.0 / 3.0, None)
        assert c.age.hex() == p.age.hex()
    assert list(c.prot.items()) == list(p.prot.items()) and list(c.prob.items()) == list(p.prob.items())


@needs_c
def test_miniature_c_keeps_whole_keys_and_frees_them():
    """Keys are stored whole (two keys equal in 15 bytes are two pages) and referenced: the
    miniature holds one reference per page it keeps, and gives every one back when freed."""
    a = bytes(16)
    b = bytes(15) + b"\x01"
    c = C.MiniCache(False, 4)
    assert c.run([a, b], 1, 0.0, None) == 0
    assert c.run([b, a], 2, 0.0, None) == 2 and list(c.prot) == [b, a]
    keys = [os.urandom(16) for _ in range(8)]
    refs = lambda: [sys.getrefcount(x) for x in keys]  # noqa: E731
    before = refs()
    m = C.MiniCache(False, 5)
    m.run(keys, 1, 0.0, None)  # 5 kept, 3 evicted
    assert [a - b for a, b in zip(refs(), before)] == [0, 0, 0, 1, 1, 1, 1, 1]
    del m
    gc.collect()
    assert refs() == before


@needs_c
def test_c_rejects_what_the_reference_cannot_run():
    with pytest.raises(ValueError):
        C.MiniCache(False, 0)
    with pytest.raises(TypeError):
        C.MiniCache(False, 4).run(["not bytes"], 1, 0.0, None)
    s = C.FrequencySketch(16)
    s.rows[0].extend(b"x")  # the live row resized: the C refuses rather than read past it
    with pytest.raises(ValueError):
        s.estimate(bytes(16))


@needs_c
@settings(max_examples=100, deadline=None)
@given(reqs=requests_st, mask=st.sampled_from([0, 1, 3, 7, 255]))
def test_select_c_same_as_python(reqs, mask):
    for pages in reqs:
        assert C.select(pages, mask) == _select_py(pages, mask)


def test_selection_follows_pure_python_env():
    """The C classes where built, the references under SGLANG_TIERED_PURE_PYTHON=1 (or unbuilt)."""
    want = "c" if C is not None and os.environ.get("SGLANG_TIERED_PURE_PYTHON") != "1" else "python"
    assert miniature.MINI_IMPL == sketch.SKETCH_IMPL == want
    assert (miniature.MiniCache is MiniCachePy) == (want == "python")
    assert (sketch.FrequencySketch is FrequencySketchPy) == (want == "python")
    code = ("from sglang_tiered.core import miniature, sketch; "
            "print(miniature.MINI_IMPL, sketch.SKETCH_IMPL, miniature.MiniCache.__name__, "
            "sketch.FrequencySketch.__name__, sketch.select.__name__)")  # fmt: skip
    env = dict(os.environ, SGLANG_TIERED_PURE_PYTHON="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["python", "python", "MiniCachePy", "FrequencySketchPy", "_select_py"]


_MUTATING_EST = r"""
import os, sys
from sglang_tiered.core._bookkeeping import MiniCache
from sglang_tiered.core.miniature import MiniCachePy

def run(cls, how):
    m = cls(True, 4)
    m.run([bytes([i]) * 16 for i in range(4)], 1, 1.0, lambda h: 0)
    pages = [bytes([100 + i]) * 16 for i in range(64)]
    calls = [0]
    def est(h):
        calls[0] += 1
        if calls[0] == 1:
            if how == "clear":
                pages.clear()
            else:
                pages.append(bytes([7]) * 16)
                pages[1:] = []
        return 5 if calls[0] % 2 else 0
    hits = m.run(pages, 2, 1.0, est)
    return hits, list(m.prob.items()), list(m.prot.items()), m.age, calls[0]

for how in ("clear", "shrink"):
    assert run(MiniCache, how) == run(MiniCachePy, how), how
print("ok")
"""


@needs_c
def test_miniature_c_survives_est_mutating_the_pages():
    """An ``est`` callback (any callable: the reference's contract) that empties or shrinks the
    request's page list mid-run: the C holds the page it is placing and reads the list's length
    each step, as the reference's ``for h in pages`` does (before: a borrowed page freed under it
    and indices past the list's end, a segfault)."""
    out = subprocess.run([sys.executable, "-c", _MUTATING_EST], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["ok"], (out.returncode, out.stderr[-2000:])


def _colliding_keys(n: int) -> list:
    """16-byte keys the C miniature's fixed (unkeyed) mixer of session 42 put in one table slot:
    page hashes a client can search for offline (its prompts' pages), as a hash-flooding attack."""
    m64 = (1 << 64) - 1
    k1, k2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
    c = 0x9E3779B97F4A7C15 ^ 16
    out = []
    for r in range(n):
        w0 = int.from_bytes(os.urandom(8), "little")
        h1 = ((w0 ^ c) * k1) & m64
        h2 = ((r + 1) << 49) & m64  # (h2 ^ h2 >> 29: its low 20 bits are 0, one slot for all)
        w1 = ((h2 * pow(k2, -1, 1 << 64)) & m64) ^ h1 ^ (h1 >> 31)
        out.append(w0.to_bytes(8, "little") + w1.to_bytes(8, "little"))
    return out


@needs_c
def test_miniature_c_placement_is_not_predictable():
    """The reference's OrderedDict places pages by Python's keyed bytes hash (SipHash, a secret per
    process); the C's table used a fixed mixer, so keys searched for it all took one slot and its
    linear probing went quadratic: 2 x 16384 such pages took ~1 s of scheduler time, ~100 x
    random pages (measured, session 42). Placement by the bytes' own (cached) hash: the same."""
    import time

    n = 1 << 14

    def took(keys) -> float:
        m = C.MiniCache(False, n)
        t = time.perf_counter()
        m.run(keys, 1, 0.0, None)
        assert m.run(keys, 2, 0.0, None) == n
        return time.perf_counter() - t

    plain = min(took([os.urandom(16) for _ in range(n)]) for _ in range(3))
    crafted = min(took(_colliding_keys(n)) for _ in range(3))
    assert crafted < 10 * plain + 0.05, (crafted, plain)
