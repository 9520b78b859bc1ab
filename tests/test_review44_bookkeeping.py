"""Session 44's bookkeeping trims (issue #11) change no result:

* ``_pagehash.chain_list`` packs a list of token ids in C (where ``struct.pack`` took a quarter of
  the hashing time): the same hashes as the pure-Python reference for every int64 token, and the
  reference's ``struct.error`` through ``keys._chain_page_hashes_c`` for a token it cannot pack; a
  token that is no int (its ``__index__`` may mutate the list) is left to the reference's packing.
* ``DivergencePy._apply``'s two-pass add (pages ``mine`` holds none of): the same counts as the
  general four passes, duplicates and all.
* ``div_spared``, eviction's one question to the divergence cap, answers as the rule it replaced
  (``cost = div_cost(hashes)``; held iff ``cost and cost > room``, else ``room -= cost``) for
  every room: negative, zero, fractional, NaN, past the leaf's length.
"""

from __future__ import annotations

import os
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_tiered.core import keys
from sglang_tiered.core.policy import AdaptivePolicy
from sglang_tiered.core.shadows import Divergence, DivergencePy

try:
    from sglang_tiered.core import _pagehash
except ImportError:  # pragma: no cover - depends on the build
    _pagehash = None

needs_c = pytest.mark.skipif(
    _pagehash is None or not hasattr(_pagehash, "chain_list"),
    reason="C extension sglang_tiered.core._pagehash not built (python setup.py build_ext --inplace)",
)
INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)


@needs_c
@settings(max_examples=400, deadline=None)
@given(prev=st.binary(max_size=40), tokens=st.lists(st.one_of(INT64, st.integers(0, 300_000)), max_size=200),
       page_size=st.integers(1, 32), overlap=st.sampled_from([0, 1]))  # fmt: skip
def test_chain_list_equals_the_reference(prev, tokens, page_size, overlap):
    want = keys._chain_page_hashes_py(prev, tokens, page_size, overlap)
    assert _pagehash.chain_list(prev, tokens, page_size, overlap) == want
    assert keys._chain_page_hashes_c(prev, tokens, page_size, overlap) == want
    assert keys._chain_page_hashes_c(prev, [bool(t & 1) for t in tokens], page_size, overlap) == \
        keys._chain_page_hashes_py(prev, [bool(t & 1) for t in tokens], page_size, overlap)  # fmt: skip


@needs_c
def test_chain_list_refuses_what_the_packing_refuses():
    for bad in ([2**63] * 16, [-(2**63) - 1] * 16, [1.5] * 16, [0] * 20 + [2**64], ["7"] * 16):
        with pytest.raises((OverflowError, TypeError)):
            _pagehash.chain_list(b"x" * 16, bad, 16, 0)
        with pytest.raises(struct.error):
            keys._chain_page_hashes_c(b"x" * 16, bad, 16)
    with pytest.raises(ValueError, match="page_size"):
        _pagehash.chain_list(b"x" * 16, list(range(32)), 0, 0)
    with pytest.raises(ValueError, match="overlap"):
        _pagehash.chain_list(b"x" * 16, list(range(32)), 16, 2)
    with pytest.raises(TypeError):
        _pagehash.chain_list(b"x" * 16, tuple(range(32)), 16, 0)
    with pytest.raises(TypeError):  # prev: bytes-like, as chain's
        keys._chain_page_hashes_c("not bytes", list(range(32)), 16)


def _evil_tokens(kind: str):
    """81 tokens, the 41st an object whose ``__index__`` (returning 5) mutates the list; and the
    calls it got."""
    tokens: list = []
    calls: list = []

    class Evil:
        def __index__(self):
            calls.append(kind)
            if kind == "clear":
                tokens.clear()
            elif kind == "replace":
                tokens[41:] = [7] * 40
            elif kind == "grow":
                tokens.extend(range(100))
            return 5

    tokens.extend(list(range(40)) + [Evil()] + list(range(40)))
    return tokens, calls


@needs_c
@pytest.mark.parametrize("kind", ["clear", "replace", "grow", "none"])
def test_a_token_that_mutates_the_list_hashes_as_the_reference(kind):
    """A token's ``__index__`` runs Python code. ``struct.pack(*tokens)`` (the reference's, and
    this path's before session 44) packs a snapshot of the list; ``chain_list`` copying the list
    token by token hashed 5 pages instead of 10 where the token cleared the list, and other
    pages where it replaced the rest (review, session 44). ``chain_list`` now refuses such a
    token before calling it, and keys.py packs the list as the reference does: the same hashes,
    ``__index__`` called once each."""
    ref_tokens, ref_calls = _evil_tokens(kind)
    want = keys._chain_page_hashes_py(b"s" * 16, ref_tokens, 8, 0)
    assert len(want) == 10
    tokens, calls = _evil_tokens(kind)
    assert keys._chain_page_hashes_c(b"s" * 16, tokens, 8, 0) == want
    assert calls == ref_calls == [kind]
    tokens, calls = _evil_tokens(kind)
    with pytest.raises(TypeError, match="not an int"):
        _pagehash.chain_list(b"s" * 16, tokens, 8, 0)
    assert calls == [] and len(tokens) == 81  # (refused before its __index__ ran)


@needs_c
def test_a_refused_list_calls_each_index_once_as_the_reference():
    """A list the packing refuses (here its last token, a str) after tokens with ``__index__``:
    the reference's struct.error with each ``__index__`` called once (the C path had called
    them once in C and again in the fallback: twice)."""
    counts = []

    class Tok:
        def __index__(self):
            counts.append(1)
            return 3

    for f in (keys._chain_page_hashes_py, keys._chain_page_hashes_c):
        counts.clear()
        with pytest.raises(struct.error):
            f(b"s" * 16, [Tok() for _ in range(16)] + ["7"], 16, 0)
        assert len(counts) == 16, f.__name__


@needs_c
def test_chain_list_takes_int_subclasses_without_calling_them():
    """bool and int subclasses are ints: read by value (no ``__index__`` call), as struct.pack
    reads them."""

    class MyInt(int):
        def __index__(self):  # pragma: no cover - must not be called
            raise AssertionError("called")

    tokens = [MyInt(i * 7) for i in range(33)] + [True, False] * 8
    want = keys._chain_page_hashes_py(b"s" * 16, tokens, 16, 1)
    assert _pagehash.chain_list(b"s" * 16, tokens, 16, 1) == want
    assert keys._chain_page_hashes_c(b"s" * 16, tokens, 16, 1) == want


def _apply_reference(pages, mine: set, other: set, add: bool) -> tuple:
    """The general four-pass ``_apply`` (before session 44)."""
    changed = set(pages)
    if add:
        changed -= mine
        mine |= changed
    else:
        changed &= mine
        mine -= changed
    shared = len(changed & other)
    return shared, len(changed) - shared


PAGE = st.sampled_from([os.urandom(16) for _ in range(24)])


@settings(max_examples=400, deadline=None)
@given(mine=st.sets(PAGE), other=st.sets(PAGE), pages=st.lists(PAGE, max_size=30), add=st.booleans())
def test_apply_equals_the_general_case(mine, other, pages, add):
    a, b = set(mine), set(mine)
    assert DivergencePy._apply(pages, a, other, add) == _apply_reference(pages, b, other, add)
    assert a == b


@settings(max_examples=500, deadline=None)
@given(lru=st.sets(PAGE), leaf=st.lists(PAGE, unique=True, max_size=24),
       room=st.one_of(st.integers(-5, 30), st.floats(-3.0, 30.0), st.just(float("nan")), st.just(float("inf"))))  # fmt: skip
def test_div_spared_answers_as_the_rule_it_replaced(lru, leaf, room):
    pol = AdaptivePolicy.__new__(AdaptivePolicy)  # (div_spared reads the divergence alone)
    pol._div = Divergence()
    pol._div.L = set(lru)
    cost = pol.div_cost(leaf)
    got = pol.div_spared(leaf, room)
    if cost and cost > room:
        assert got == -1
    else:
        assert got == cost
