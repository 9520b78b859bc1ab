"""Session 44's bookkeeping trims (issue #11) change no result:

* ``_pagehash.chain_list`` packs a list of token ids in C (where ``struct.pack`` took a quarter of
  the hashing time): the same hashes as the pure-Python reference for every int64 token, and the
  reference's ``struct.error`` through ``keys._chain_page_hashes_c`` for a token it cannot pack; a
  token whose ``__index__`` empties the list mid-copy is no crash.
* ``Divergence._apply``'s two-pass add (pages ``mine`` holds none of): the same counts as the
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
from sglang_tiered.core.shadows import Divergence

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


@needs_c
def test_chain_list_survives_a_token_that_empties_the_list():
    """A token's ``__index__`` runs Python code; one that clears the list mid-copy leaves the
    hashes of what was read (as if the list had been that long), never a read past its end."""
    tokens: list = []

    class Evil:
        def __index__(self):
            tokens.clear()
            return 5

    tokens.extend(list(range(40)) + [Evil()] + list(range(40)))
    got = _pagehash.chain_list(b"s" * 16, tokens, 8, 0)
    assert got == keys._chain_page_hashes_py(b"s" * 16, list(range(40)) + [5], 8, 0)


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
    assert Divergence._apply(pages, a, other, add) == _apply_reference(pages, b, other, add)
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
