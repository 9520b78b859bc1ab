"""The optional C page hasher (``sglang_tiered.core._pagehash``, issue #11, session 41) computes
exactly the pure-Python reference's chained hashes (``keys._chain_page_hashes_py``): same seed
chaining, the trailing partial page unhashed, ``overlap`` 1 (bigram keys: each page also takes
the next token), list or ``array('q')`` tokens, every int64 token id. Every recorded decision
digest rests on these hashes (tests/test_bookkeeping_digest.py), and T1/T2 keys written by one
path must be read by the other (a server built without a compiler shares T2 with one built with).

Skipped, with the reason, where the extension was not built (``python setup.py build_ext
--inplace``, or ``pip install -e .`` with a compiler)."""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys
from array import array

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_tiered.core import keys

ROOT = pathlib.Path(__file__).resolve().parents[1]

try:
    from sglang_tiered.core import _pagehash
except ImportError:  # pragma: no cover - depends on the build
    _pagehash = None

needs_c = pytest.mark.skipif(
    _pagehash is None,
    reason="C extension sglang_tiered.core._pagehash not built (python setup.py build_ext --inplace)",
)

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
TOKENS = st.one_of(st.lists(INT64, max_size=300), st.lists(st.integers(0, 200_000), max_size=300))


@needs_c
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prev=st.one_of(st.binary(min_size=16, max_size=16), st.binary(max_size=300)), tokens=TOKENS,
       page_size=st.integers(1, 64), overlap=st.sampled_from([0, 1]))  # fmt: skip
def test_c_chain_equals_python_reference(prev, tokens, page_size, overlap):
    want = keys._chain_page_hashes_py(prev, tokens, page_size, overlap)
    assert keys._chain_page_hashes_c(prev, tokens, page_size, overlap) == want
    assert keys._chain_page_hashes_c(prev, array("q", tokens), page_size, overlap) == want
    # the extension itself, no short cut in front of it
    assert _pagehash.chain(prev, keys._token_bytes(tokens), page_size, overlap) == want
    full = max(0, (len(tokens) - overlap) // page_size)
    assert len(want) == full


@needs_c
def test_c_chain_matches_hashlib_by_hand():
    """Independent of either implementation: h[i] = BLAKE2b-128(h[i-1] || page i (+1 token))."""
    seed = keys.CacheKey().seed()
    toks = list(range(-5, 45)) + [2**63 - 1, -(2**63)]  # 52 tokens: 3 pages of 16, 4 left over
    for overlap in (0, 1):
        h, want = seed, []
        for i in range(3):
            page = toks[16 * i : 16 * i + 16 + overlap]
            h = hashlib.blake2b(h + b"".join(t.to_bytes(8, "little", signed=True) for t in page),
                                digest_size=16).digest()  # fmt: skip
            want.append(h)
        assert _pagehash.chain(seed, keys._token_bytes(toks), 16, overlap) == want


@needs_c
def test_c_chain_block_boundaries():
    """Inputs whose hashed length (prev + page) falls on, just under and just over BLAKE2b's
    128-byte blocks (the last full block must be kept for the final compression)."""
    for plen in range(0, 40):
        prev = bytes(range(plen))
        for page_size in (1, 12, 13, 14, 15, 16, 30, 31, 32, 33):
            for overlap in (0, 1):
                toks = list(range(3 * page_size + overlap))
                assert _pagehash.chain(prev, keys._token_bytes(toks), page_size, overlap) == \
                    keys._chain_page_hashes_py(prev, toks, page_size, overlap), (plen, page_size, overlap)  # fmt: skip


@needs_c
def test_c_chain_rejects_bad_arguments():
    data = keys._token_bytes(list(range(32)))
    with pytest.raises(ValueError, match="multiple of 8"):
        _pagehash.chain(b"x" * 16, data[:-1], 16, 0)
    for ps in (0, -1, -16):
        with pytest.raises(ValueError, match="page_size"):
            _pagehash.chain(b"x" * 16, data, ps, 0)
        with pytest.raises(ValueError, match="page_size"):
            keys._chain_page_hashes_c(b"x" * 16, list(range(32)), ps, 0)
    for ov in (2, -1, 16):
        with pytest.raises(ValueError, match="overlap"):
            _pagehash.chain(b"x" * 16, data, 16, ov)
        with pytest.raises(ValueError, match="overlap"):
            keys._chain_page_hashes_c(b"x" * 16, [], 16, ov)
    with pytest.raises(TypeError):
        _pagehash.chain("not bytes", data, 16, 0)
    with pytest.raises(TypeError):
        _pagehash.chain(b"x" * 16, "not bytes", 16, 0)
    with pytest.raises(TypeError):
        _pagehash.chain(b"x" * 16, data, 16)


@needs_c
def test_c_path_packs_tokens_as_the_reference_does():
    """Tokens are packed in Python for both paths: an id outside int64, or a non-int, fails the
    same way; a run with no full page is [] whatever prev is (the reference never reads it)."""
    import struct

    for bad in ([2**63] * 16, [-(2**63) - 1] * 16, [1.5] * 16):
        with pytest.raises(struct.error):
            keys._chain_page_hashes_py(b"x" * 16, bad, 16)
        with pytest.raises(struct.error):
            keys._chain_page_hashes_c(b"x" * 16, bad, 16)
    assert keys._chain_page_hashes_c(None, list(range(15)), 16) == keys._chain_page_hashes_py(None, list(range(15)), 16) == []
    assert keys._chain_page_hashes_c(None, list(range(16)), 16, 1) == []


def _impl(env_value):
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_TIERED_PURE_PYTHON"}
    if env_value is not None:
        env["SGLANG_TIERED_PURE_PYTHON"] = env_value
    env["PYTHONPATH"] = str(ROOT)
    code = ("from sglang_tiered.core import keys; "
            "print(keys.HASH_IMPL, keys.chain_page_hashes.__name__)")  # fmt: skip
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.split()  # fmt: skip


def test_pure_python_switch():
    """SGLANG_TIERED_PURE_PYTHON=1 takes the reference, built extension or not; HASH_IMPL says so."""
    assert _impl("1") == ["python", "_chain_page_hashes_py"]


@needs_c
def test_extension_used_when_built():
    assert _impl(None) == ["c", "_chain_page_hashes_c"]
    assert _impl("0") == ["c", "_chain_page_hashes_c"]
    assert keys.HASH_IMPL == ("python" if os.environ.get("SGLANG_TIERED_PURE_PYTHON") == "1" else "c")
