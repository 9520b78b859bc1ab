"""Review of session 46's policy page keys (core/keys.py ``chain_page_keys``, page_hashes.py)."""

from __future__ import annotations

import struct
from array import array

import pytest

from sglang_tiered.core import keys

needs_c = pytest.mark.skipif(keys._chain_page_keys_c is None, reason="C extension not built")


class _Int:  # not an int, with an ``__index__`` (the reference's struct.pack takes it)
    def __repr__(self):
        return "_Int()"

    def __index__(self):
        return 1


def _outcome(f, *args):
    try:
        return ("ok", f(*args))
    except Exception as e:  # noqa: BLE001 - the exception's type is what is compared
        return ("raised", type(e))


BAD_TOKENS = [2**64, -(2**63) - 1, 1.5, "a", _Int()]


@needs_c
@pytest.mark.parametrize("prev", [b"", b"x" * 15, b"x" * 17, b"x" * 32], ids=len)
@pytest.mark.parametrize("n", [0, 3, 15, 16, 40])
@pytest.mark.parametrize("kind", ["list", "array"])
def test_c_keys_refuse_a_wrong_seed_as_the_reference_does(prev, n, kind):
    """A wrong-length seed is a ValueError in the reference whatever the tokens; the C path gave
    ``[]`` for a run with no full page (the identity chain's shortcut, whose reference takes any
    seed)."""
    toks = list(range(n)) if kind == "list" else array("q", range(n))
    want = _outcome(keys._chain_page_keys_py, prev, toks, 16, 0)
    assert want == ("raised", ValueError)
    assert _outcome(keys._chain_page_keys_c, prev, toks, 16, 0) == want


@needs_c
@pytest.mark.parametrize("prev", [bytes(16), b"x" * 15, b""], ids=len)
@pytest.mark.parametrize("bad", BAD_TOKENS, ids=repr)
@pytest.mark.parametrize("page_size", [4, 16, 32])
def test_c_keys_raise_what_the_reference_raises_on_a_bad_token(prev, bad, page_size):
    """A token the C packing refuses, with a wrong seed: the reference's ValueError (its seed
    check comes first), not ``struct.error`` from the fallback packing; with a good seed, what
    the reference does."""
    toks = [bad] + list(range(20))
    want = _outcome(keys._chain_page_keys_py, prev, toks, page_size, 0)
    assert want[0] == "raised" or (len(prev) == 16 and isinstance(bad, _Int))
    assert _outcome(keys._chain_page_keys_c, prev, toks, page_size, 0) == want


@needs_c
@pytest.mark.parametrize("page_size", [1, 2, 3, 4, 5, 16])
@pytest.mark.parametrize("overlap", [0, 1])
def test_c_keys_equal_reference_on_numpy_and_bool_tokens(page_size, overlap):
    np = pytest.importorskip("numpy")
    seed = bytes(range(16))
    toks = [np.int64(7), True, False, 2**63 - 1, -(2**63)] + list(range(30))
    want = keys._chain_page_keys_py(seed, toks, page_size, overlap)
    assert keys._chain_page_keys_c(seed, toks, page_size, overlap) == want
    assert keys._chain_page_keys_c(seed, array("q", [int(t) for t in toks]), page_size, overlap) == want
    assert want == keys._chain_page_keys_py(seed, struct.unpack(f"<{len(toks)}q", keys._token_bytes(toks)),
                                            page_size, overlap)  # fmt: skip


def test_a_refused_attach_host_leaves_the_cache_as_it_was():
    """``attach_host`` on a tree already keyed by policy keys is refused (page_hashes.py H3);
    the refusal must not leave the policy counting every request for a T1 that never came
    (``read_sketch`` ran before the check: a forced order's server then hashed and counted
    every request, and its pages became "read")."""
    from sglang_tiered.core.policy import PolicyConfig
    from sglang_tiered.integration.tiered_radix_cache import TieredRadixCache

    cache = TieredRadixCache.create_simulated(4096, 16, policy_config=PolicyConfig(force_mode="all+lru"))
    cache.driver.run(list(range(64)))
    cache.hashes.ensure(next(iter(cache.root_node.children.values())))  # a node keyed by policy keys
    before = (cache.policy.sketch_read, cache.policy.reads_pages, cache.hashes_read())
    with pytest.raises(RuntimeError, match="before the first request"):
        cache.attach_host(object())
    assert (cache.policy.sketch_read, cache.policy.reads_pages, cache.hashes_read()) == before
    assert cache.t1 is None and not cache.hashes.identity


def test_trace_replay_reports_which_page_keys_ran():
    """A tree without T1 or the fleet index keys its pages by ``chain_page_keys`` (session 46):
    the replay's environment names that path too, not only the identity hashing's (a build from
    before session 46 has C hashing and pure-Python keys)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "trace_replay.py"
    spec = importlib.util.spec_from_file_location("_trace_replay_env", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    env = mod.environment()
    assert env["page_keys_impl"] == keys.KEYS_IMPL and env["page_hash_impl"] == keys.HASH_IMPL
