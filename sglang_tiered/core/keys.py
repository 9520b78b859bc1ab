"""Cache identity: what a cached page *is*.

A page's identity is a chained hash over 16-token pages, seeded by a ``CacheKey`` that holds
everything that changes the KV a model computes for the same tokens: tenant, model id, the exact
weights digest, KV dtype, RoPE configuration, attention implementation, online quantization, the
compute dtype, the model revision, and the versions of the code that computes the KV (sglang,
torch, sglang-tiered; ``SGLANG_TIERED_IDENTITY_VERSIONS``). The TP degree is *not* part of it: T1 stores pages in a
TP-independent layout.

The optional fields (``quantization``, ``model_dtype``, ``revision``, ``model_overrides``,
``lora``, ``software``, ``tenants``, ``compute``) were added later: they
enter the hashed blob only when set (not ``None``), so a key that leaves them unset (``CacheKey()``,
the simulator's and the benchmarks' key) has exactly the seeds and page hashes it had before.

    h[0] = H(seed(CacheKey), tokens[0:16])
    h[i] = H(h[i-1], tokens[16i:16i+16])

H is BLAKE2b-128 (hashlib: deterministic across processes and machines; Python's ``hash()`` is
salted per process). Token ids are packed as little-endian int64 on every platform.

``chain_page_hashes`` runs in the optional C extension ``_pagehash`` (BLAKE2b in C, one call per
token run: the Python loop cost ~1.1 us a page, most of it interpreter overhead; issue #11,
session 41) when it was built and ``SGLANG_TIERED_PURE_PYTHON`` is not ``1``; otherwise in
``_chain_page_hashes_py``, the reference that the C path is tested against
(tests/test_review41_pagehash.py). ``HASH_IMPL`` says which: ``"c"`` or ``"python"``.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from array import array
from dataclasses import asdict, dataclass, replace
from typing import Optional

DIGEST_SIZE = 16
_BIG_ENDIAN = sys.byteorder == "big"


@dataclass(frozen=True)
class CacheKey:
    tenant: str = "default"
    model_id: str = ""
    weights_digest: str = ""
    kv_dtype: str = ""
    rope_hash: str = ""
    attn_impl: str = ""
    # Optional identity fields: hashed only when set (``_identity``), see the module docstring.
    quantization: Optional[str] = None  # --quantization / modelopt / KV scales (integration/identity.py)
    model_dtype: Optional[str] = None  # compute dtype (--dtype, resolved): matters when kv_dtype is explicit
    revision: Optional[str] = None  # --revision (a remote model's weights_digest is its name only)
    model_overrides: Optional[str] = None  # digest of --json-model-override-args (review, session 18)
    lora: Optional[str] = None  # digests of the --lora-paths adapters' files (review, session 18)
    software: Optional[str] = None  # versions of the code that computes the KV (review, session 22)
    # where tenants come from, when not the client's own cache_salt ("header:<name>": a trusted
    # gateway's header): a server without the header shares one T2 with it, and any of its
    # clients named a header tenant as its salt and read that tenant's pages (a helper's hunt)
    tenants: Optional[str] = None
    # compute settings besides attention that change the KV computed for the same weights: the
    # model implementation (Transformers' modeling code), deterministic (batch-invariant) kernels,
    # TF32 matmuls, an RL on-policy target's numerics, ... (integration/identity.py ``compute_of``;
    # a helper's hunt, session 41)
    compute: Optional[str] = None

    def _identity(self) -> dict:
        """The fields that are hashed: every original field, and the optional ones that are set."""
        d = asdict(self)
        for name in _OPTIONAL_FIELDS:
            if d[name] is None:
                del d[name]
        return d

    def seed(self) -> bytes:
        blob = json.dumps(self._identity(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(b"sglang-tiered/v1|" + blob, digest_size=DIGEST_SIZE).digest()

    def for_tenant(self, tenant: str | None) -> "CacheKey":
        return replace(self, tenant=tenant or "default")

    def namespace_seed(self, cache_salt, extra_key) -> bytes:
        """Seed of one radix-tree namespace: (cache_salt or none, extra_key or none).

        SGLang's tree keeps every (extra_key, cache_salt) pair apart (``RadixKey.child_key_at``;
        an empty salt is no salt, ``io_struct._normalize_cache_salt``), so every tier must too.
        The pair is encoded structurally (JSON, ``null`` for none), never joined as text: salt
        ``"default"`` is not "no salt", and salt ``"a|x"`` is not salt ``a`` with extra key ``x``
        (issue #10, finding 4). ``extra_key`` carries SGLang's LoRA id: KV computed under one
        adapter must never serve another."""
        ns = [cache_salt or None, extra_key]
        blob = json.dumps({"key": self._identity(), "ns": ns}, sort_keys=True, separators=(",", ":"),
                          ensure_ascii=True, default=repr)  # fmt: skip
        return hashlib.blake2b(b"sglang-tiered/v2|" + blob.encode(), digest_size=DIGEST_SIZE).digest()


_OPTIONAL_FIELDS = ("quantization", "model_dtype", "revision", "model_overrides", "lora", "software", "tenants",
                   "compute")


def _token_bytes(tokens) -> bytes:
    """The tokens as little-endian int64s (struct.pack: twice as fast as ``array("q", list)``)."""
    if isinstance(tokens, array) and tokens.typecode == "q":
        if _BIG_ENDIAN:
            tokens = array("q", tokens)
            tokens.byteswap()
        return tokens.tobytes()
    return struct.pack(f"<{len(tokens)}q", *tokens)


_PAGE_HASH = hashlib.blake2b(digest_size=DIGEST_SIZE)  # copied per page: no parameter parsing


def _chain_page_hashes_py(prev: bytes, tokens, page_size: int = 16, overlap: int = 0) -> list[bytes]:
    """Hashes of the full pages of ``tokens``, chained from ``prev`` (the seed or the last hash
    of the preceding pages). A trailing partial page is not hashed. ``overlap`` 1: each page also
    takes the token after it (an EAGLE tree's bigram keys: ``page_size`` positions span
    ``page_size + 1`` tokens, and two nodes that differ only in that token are different
    entries; without it they had one hash: review, session 24). The pure-Python reference."""
    data = memoryview(_token_bytes(tokens))
    step = page_size * 8
    width = step + overlap * 8
    out: list[bytes] = []
    append, fresh = out.append, _PAGE_HASH.copy
    h = prev
    for off in range(0, max(0, (len(data) - overlap * 8) // step) * step, step):
        x = fresh()  # = blake2b(h + page, digest_size=DIGEST_SIZE), without the copies
        x.update(h)
        x.update(data[off : off + width])
        h = x.digest()
        append(h)
    return out


_M64 = (1 << 64) - 1
_MM_C1, _MM_C2 = 0x87C37B91114253D5, 0x4CF5AD432745937F


def _rotl64(w: int, c: int) -> int:
    return ((w << c) | (w >> (64 - c))) & _M64


def _fmix64(k: int) -> int:
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & _M64
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & _M64
    return k ^ (k >> 33)


def _page_key(prev: bytes, page: bytes) -> bytes:
    """One policy page key: MurmurHash3_x64_128's block, tail and finalization steps over
    ``page`` (a multiple of 8 bytes), the 128-bit state starting from ``prev`` instead of a seed."""
    h1, h2 = int.from_bytes(prev[:8], "little"), int.from_bytes(prev[8:16], "little")
    width, off = len(page), 0
    while off + 16 <= width:
        k1, k2 = int.from_bytes(page[off : off + 8], "little"), int.from_bytes(page[off + 8 : off + 16], "little")
        k1 = (_rotl64((k1 * _MM_C1) & _M64, 31) * _MM_C2) & _M64
        h1 = (_rotl64(h1 ^ k1, 27) + h2) & _M64
        h1 = (h1 * 5 + 0x52DCE729) & _M64
        k2 = (_rotl64((k2 * _MM_C2) & _M64, 33) * _MM_C1) & _M64
        h2 = (_rotl64(h2 ^ k2, 31) + h1) & _M64
        h2 = (h2 * 5 + 0x38495AB5) & _M64
        off += 16
    if off < width:
        k1 = int.from_bytes(page[off : off + 8], "little")
        h1 ^= (_rotl64((k1 * _MM_C1) & _M64, 31) * _MM_C2) & _M64
    h1 ^= width
    h2 ^= width
    h1 = (h1 + h2) & _M64
    h2 = (h2 + h1) & _M64
    h1, h2 = _fmix64(h1), _fmix64(h2)
    h1 = (h1 + h2) & _M64
    h2 = (h2 + h1) & _M64
    return h1.to_bytes(8, "little") + h2.to_bytes(8, "little")


def _chain_page_keys_py(prev: bytes, tokens, page_size: int = 16, overlap: int = 0) -> list[bytes]:
    """Policy page keys of the full pages of ``tokens``, chained from ``prev`` (16 bytes: a
    namespace seed or the last key of the preceding pages), shaped as ``chain_page_hashes``
    (``overlap``, a trailing partial page) but **not an identity**: a 128-bit MurmurHash3-style
    mix (``_page_key``), ~8x cheaper a page than BLAKE2b in C (~45 against ~370 ns, the bytes object included) and not collision resistant. A tree keys its
    pages by these only where nothing outside the process reads a page's identity (no T1, T2 or
    fleet index: ``integration/page_hashes.py``): the policy's sketch, samples, shadows and
    divergence, whose collisions cost an estimate, never a wrong page (the tree matches by
    tokens). The pure-Python reference of ``_pagehash.keys``."""
    if len(prev) != DIGEST_SIZE:
        raise ValueError(f"a page key chain's seed is {DIGEST_SIZE} bytes, not {len(prev)}")
    data = _token_bytes(tokens)
    step = page_size * 8
    width = step + overlap * 8
    out: list[bytes] = []
    h = prev
    for off in range(0, max(0, (len(data) - overlap * 8) // step) * step, step):
        h = _page_key(h, data[off : off + width])
        out.append(h)
    return out


def _c_chain(packed, listed, name: str, seed_size: int = 0):
    """A reference-shaped chain (``_chain_page_hashes_py``, ``_chain_page_keys_py``) with the
    per-page loop in C: ``packed`` on packed int64 bytes (``_pagehash.chain``, ``keys``), ``listed``
    on a list of ints (``chain_list``, ``keys_list``). A run with no full page returns ``[]``
    without reaching C, as the reference does; a ``page_size`` < 1 or an ``overlap`` other than
    0/1 raises ValueError. A list (the router's tokenizer output; SGLang's ``fill_ids`` are
    ``array("q")``, whose bytes need no packing) is packed in C (a quarter of the hashing time was
    ``struct.pack``'s, session 44) where every token is an int; a list it refuses (a token outside
    int64, or not an int: a numpy integer, anything whose ``__index__`` would run Python code) is
    packed here, as the reference packs it (its hashes, its ``struct.error``). ``seed_size``
    (policy keys: 16; the identity's reference takes any seed) checks ``prev``'s length first, as
    ``_chain_page_keys_py`` does: before, a wrong-length seed went unreported on a run with no full
    page (``[]``) and a bad token raised ``struct.error`` where the reference raises ValueError
    (review, session 46)."""

    def chain(prev: bytes, tokens, page_size: int = 16, overlap: int = 0) -> list[bytes]:
        if seed_size and len(prev) != seed_size:
            raise ValueError(f"a page key chain's seed is {seed_size} bytes, not {len(prev)}")
        if type(tokens) is list and len(tokens) >= page_size + overlap and listed is not None:
            try:
                return listed(prev, tokens, page_size, overlap)
            except (OverflowError, TypeError):
                pass  # (a bad token, or prev: the path below raises what the reference raises)
        data = _token_bytes(tokens)
        if len(data) < (page_size + overlap) * 8 and page_size >= 1 and overlap in (0, 1):
            return []
        return packed(prev, data, page_size, overlap)

    chain.__name__ = chain.__qualname__ = name
    chain.__doc__ = _c_chain.__doc__
    return chain


try:
    from sglang_tiered.core._pagehash import chain as _chain
except ImportError:  # not built (no compiler: setup.py's extension is optional)
    _chain = None
try:  # (a build from before session 44 has chain alone)
    from sglang_tiered.core._pagehash import chain_list as _chain_list
except ImportError:
    _chain_list = None
try:  # (a build from before session 46 has no policy keys)
    from sglang_tiered.core._pagehash import keys as _keys, keys_list as _keys_list
except ImportError:
    _keys = _keys_list = None

_chain_page_hashes_c = _c_chain(_chain, _chain_list, "_chain_page_hashes_c") if _chain is not None else None
_chain_page_keys_c = _c_chain(_keys, _keys_list, "_chain_page_keys_c", DIGEST_SIZE) if _keys is not None else None

# SGLANG_TIERED_PURE_PYTHON=1: the references even where the C extensions are built (read here
# alone: core/miniature.py and core/sketch.py take it from this module)
PURE_PYTHON = os.environ.get("SGLANG_TIERED_PURE_PYTHON") == "1"
HASH_IMPL = "c" if _chain is not None and not PURE_PYTHON else "python"
chain_page_hashes = _chain_page_hashes_c if HASH_IMPL == "c" else _chain_page_hashes_py
KEYS_IMPL = "c" if _keys is not None and not PURE_PYTHON else "python"
chain_page_keys = _chain_page_keys_c if KEYS_IMPL == "c" else _chain_page_keys_py
# Whether trees key their pages by policy keys where no identity is read (integration/
# page_hashes.py): only where the C chain is built. The pure-Python reference costs ~15x
# hashlib's BLAKE2b a page (~33 against ~2.3 us), so an install without the extension keys every
# tree by the identity hashes, as before session 46 (its sampled estimates, so its decisions,
# differ from a built install's); SGLANG_TIERED_PURE_PYTHON=1 with the extension built runs the
# reference itself, to prove it equal.
POLICY_KEYS = _keys is not None


def rope_config_hash(rope_theta, rope_scaling, max_position_embeddings, partial_rotary=None) -> str:
    blob = json.dumps(
        {"theta": rope_theta, "scaling": rope_scaling, "max_pos": max_position_embeddings,
         "partial": partial_rotary},
        sort_keys=True, default=str,
    )  # fmt: skip
    return hashlib.blake2b(blob.encode(), digest_size=8).hexdigest()


def client_extra_key(key: str) -> str:
    """A client's ``extra_key`` as the scheduler sees it: ``client:<key>:``. SGLang appends a LoRA
    adapter's id (32 hex digits) to the request's ``extra_key`` (schedule_batch.py, ``Req``), and
    adapter ids can be computed from what ``/v1/models`` lists; so a base-model request whose own
    key was an adapter's id would share that adapter's cache namespace and write base-model KV
    into it (review, session 22). A key ending in ``:`` never ends in an adapter id, and the
    mapping is one to one, so clients' namespaces stay apart from each other and from adapters."""
    return f"client:{key}:"
