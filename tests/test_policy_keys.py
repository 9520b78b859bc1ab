"""Policy page keys (``keys.chain_page_keys``, issue #11, session 46): where nothing outside the
process reads a page's identity (no T1, T2 or fleet index), a tree keys its pages by a cheap
128-bit chain instead of BLAKE2b (integration/page_hashes.py). These tests hold:
- the C chain (``_pagehash.keys``, ``keys_list``) equals the pure-Python reference, and the
  reference is MurmurHash3_x64_128's mixing exactly (known answers from the ``mmh3`` package);
- a tree keys its pages by policy keys until T1 or the fleet index is attached, by identity
  hashes after; attaching either to a tree that already keyed pages by policy keys is refused
  (the policy's state would hold one page under two keys), and so is T1 on a tree not switched;
- the invariant checker's H3 catches a tree that T1 or the index reads while it holds policy keys.
"""

from __future__ import annotations

import os
import pathlib
import struct
import subprocess
import sys
from array import array

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_tiered.core import keys
from sglang_tiered.integration.invariants import check_cache
from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache
from tests.test_review41_pagehash import TOKENS, _pagehash

ROOT = pathlib.Path(__file__).resolve().parents[1]

needs_c = pytest.mark.skipif(
    _pagehash is None or not hasattr(_pagehash, "keys"),
    reason="C extension sglang_tiered.core._pagehash not built (python setup.py build_ext --inplace)",
)


@needs_c
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prev=st.binary(min_size=16, max_size=16), tokens=TOKENS, page_size=st.integers(1, 64),
       overlap=st.sampled_from([0, 1]))  # fmt: skip
def test_c_keys_equal_python_reference(prev, tokens, page_size, overlap):
    want = keys._chain_page_keys_py(prev, tokens, page_size, overlap)
    assert keys._chain_page_keys_c(prev, tokens, page_size, overlap) == want
    assert keys._chain_page_keys_c(prev, array("q", tokens), page_size, overlap) == want
    assert _pagehash.keys(prev, keys._token_bytes(tokens), page_size, overlap) == want
    assert len(want) == max(0, (len(tokens) - overlap) // page_size)
    assert all(len(k) == 16 for k in want)


# MurmurHash3_x64_128(data, seed) from the ``mmh3`` package (``hash128(data, seed, True)``, as
# 16 little-endian bytes): with ``prev`` = the seed in both 64-bit lanes, a page key is exactly it
_WORD = 0x9E3779B97F4A7C15
KNOWN = [  # (seed, words, key)
    (0, 1, "cbc357ccb763df2852fee8c4fc7d55f2"),
    (0, 16, "a43d848db10b3238648fc27eb4adc9f6"),
    (1, 2, "40a97cd6e00b2eb57d071641ae2eb858"),
    (1, 17, "70eb0529cd1b7945af0b6ad95c4412de"),
    (0xDEADBEEF, 3, "9f3ca364572b15a9aa8403819269eec9"),
    (0xDEADBEEF, 16, "aab8f8a54e1ff439c5d0360722430608"),
]


@pytest.mark.parametrize("seed,n,want", KNOWN)
def test_page_key_is_murmur3_x64_128(seed, n, want):
    tokens = [(i * _WORD + seed) & 0x7FFFFFFFFFFFFFFF for i in range(n)]
    prev = seed.to_bytes(8, "little") * 2
    assert keys._page_key(prev, struct.pack(f"<{n}q", *tokens)).hex() == want
    assert keys._chain_page_keys_py(prev, tokens, n, 0) == [bytes.fromhex(want)]
    assert keys.chain_page_keys(prev, tokens, n, 0) == [bytes.fromhex(want)]


def test_keys_chain_and_differ_from_identity():
    """Chained as the identity hashes are (page i from page i-1's key), never equal to them."""
    seed = keys.CacheKey().seed()
    toks = list(range(64))
    k = keys.chain_page_keys(seed, toks, 16)
    assert k[1:] == [keys.chain_page_keys(k[i], toks[16 * (i + 1) : 16 * (i + 2)], 16)[0] for i in range(3)]
    assert not set(k) & set(keys.chain_page_hashes(seed, toks, 16))
    assert keys.chain_page_keys(seed, toks[:15], 16) == []


@pytest.mark.parametrize("impl", ["py", "c"])
def test_keys_seed_must_be_16_bytes(impl):
    if impl == "c" and keys._chain_page_keys_c is None:
        pytest.skip("C extension not built")
    f = keys._chain_page_keys_py if impl == "py" else keys._chain_page_keys_c
    for bad in (b"", b"x" * 15, b"x" * 17):
        with pytest.raises(ValueError, match="16 bytes"):
            f(bad, list(range(32)), 16)
        with pytest.raises(ValueError, match="16 bytes"):
            f(bad, array("q", range(32)), 16)


def _impl(env_value):
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_TIERED_PURE_PYTHON"}
    if env_value is not None:
        env["SGLANG_TIERED_PURE_PYTHON"] = env_value
    env["PYTHONPATH"] = str(ROOT)
    code = "from sglang_tiered.core import keys; print(keys.KEYS_IMPL, keys.chain_page_keys.__name__)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.split()  # fmt: skip


def test_pure_python_switch():
    assert _impl("1") == ["python", "_chain_page_keys_py"]


def test_an_install_without_the_c_chain_keys_trees_by_identity(monkeypatch):
    """The pure-Python reference of the policy keys costs ~15x hashlib's BLAKE2b a page: without
    the C chain (keys.POLICY_KEYS false) a tree keys its pages by the identity hashes."""
    from sglang_tiered.integration.page_hashes import PageHashes

    monkeypatch.setattr(keys, "POLICY_KEYS", False)
    h = PageHashes(keys.CacheKey(), 16)
    assert h.identity and h.chain is keys.chain_page_hashes
    monkeypatch.setattr(keys, "POLICY_KEYS", True)
    h = PageHashes(keys.CacheKey(), 16)
    assert not h.identity and h.chain is keys.chain_page_keys


@needs_c
def test_extension_used_when_built():
    assert _impl(None) == ["c", "_chain_page_keys_c"]


# ---------------------------------------------------------------------------- the tree's kind


def _tree_keys(cache) -> dict:
    """Every hashed node's (tokens from the root) -> its page keys."""
    out, stack = {}, [(c, []) for c in cache.root_node.children.values()]
    while stack:
        n, above = stack.pop()
        toks = above + list(n.key.raw_token_ids())
        stack.extend((c, toks) for c in n.children.values())
        if n.tiered_hashes is not None:
            out[tuple(toks)] = (n.tiered_end, list(n.tiered_hashes))
    return out


def _requests():
    base = list(range(1000, 1064))
    return [base + list(range(i * 100, i * 100 + 40)) for i in range(6)] + [base[:48]]


needs_keys = pytest.mark.skipif(not keys.POLICY_KEYS, reason="C extension not built: every tree keys pages by identity")


@needs_keys
@pytest.mark.parametrize("host_pages", [0, 64])
def test_tree_keys_pages_by_policy_keys_unless_identity_is_read(host_pages):
    cache = TieredRadixCache.create_simulated(4096, 16, host_pages=host_pages or None, debug_checks=True)
    assert cache.hashes.identity == bool(host_pages)
    chain = keys.chain_page_hashes if host_pages else keys.chain_page_keys
    for r in _requests():
        cache.driver.run(r)
    held = _tree_keys(cache)
    assert held, "the policy reads pages: checkpoint keys them"
    seed = cache.hashes.seed(None, None)
    for toks, (end, got) in held.items():
        assert end == len(toks)
        path = chain(seed, list(toks), 16)
        assert got == path[len(path) - len(got) :]
    check_cache(cache)


@needs_keys
def test_identity_readers_refuse_a_tree_keyed_by_policy_keys():
    cache = TieredRadixCache.create_simulated(4096, 16, debug_checks=True)
    cache.driver.run(list(range(64)))
    assert not cache.hashes.identity
    with pytest.raises(RuntimeError, match="before the first request"):
        cache.attach_index(object())
    assert not cache.hashes.identity and cache.index.listener is None
    with pytest.raises(RuntimeError, match="before the first request"):
        cache.use_identity("T1")
    # T1 itself refuses a tree not switched (whoever builds it past attach_host)
    from sglang_tiered.integration.t1 import T1Tier

    with pytest.raises(RuntimeError, match="identity hashes"):
        T1Tier(cache, host=None)


@needs_keys
def test_empty_tree_switches_and_h3_catches_a_reader_of_policy_keys():
    cache = TieredRadixCache.create_simulated(4096, 16, debug_checks=True)
    cache.use_identity("the fleet index")  # empty: switched
    assert cache.hashes.identity and cache.hashes.chain is keys.chain_page_hashes
    other = TieredRadixCache.create_simulated(4096, 16)
    other.driver.run(list(range(64)))
    other.index.listener = object()  # (past attach_index: what H3 is there for)
    with pytest.raises(AssertionError, match="H3 violated"):
        check_cache(other)


def test_every_tp_rank_keys_pages_alike_with_the_fleet_index(monkeypatch):
    """Only a tree's first rank publishes to the fleet index (``build.hint_rank``), yet every rank
    of a server with the index keys its pages by identity hashes: keys of two kinds sample two
    sets of estimates, and the TP ranks' trees, which must decide alike, would decide apart."""
    import types

    from sglang_tiered.dev.simulate import make_params
    from sglang_tiered.integration import build, identity

    monkeypatch.setenv("SGLANG_TIERED_INDEX_URL", "redis://127.0.0.1:1")
    monkeypatch.setenv("SGLANG_TIERED_SERVER_ID", "http://127.0.0.1:30001")
    monkeypatch.setattr(identity, "cache_key_from_context", lambda ctx, **kw: keys.CacheKey())
    monkeypatch.setattr(identity, "lifetime_tag", lambda sa: "a test")
    monkeypatch.setattr(build, "setup_host_tier", lambda cache, ctx, cfg: None)  # (T1: every rank or none)
    published = []
    monkeypatch.setattr("sglang_tiered.fleet.publisher.IndexPublisher.from_config",
                        classmethod(lambda cls, *a, **kw: published.append(kw.get("rank")) or object()))  # fmt: skip
    kinds = []
    for rank in (0, 1):
        params, _, _ = make_params(64 * 16, 16, 1 << 12)
        ctx = types.SimpleNamespace(params=params, tp_rank=rank, tp_size=2, server_args=types.SimpleNamespace())
        cache = build.from_build_context(TieredRadixCache, ctx)
        kinds.append(cache.hashes.identity)
        assert (cache.index.listener is not None) == (rank == 0)
    assert published == [""] and kinds == [True, True]
