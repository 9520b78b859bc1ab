"""Workloads for replay: the Mooncake trace mapped to token ids, and a seeded multi-tenant generator.

Pure Python. A workload is a list of ``Request(tokens, tenant, kind)``; token ids stay in
``[TOKEN_LO, TOKEN_HI)`` so they are valid for the tiny model's 2048-token vocabulary too.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import pathlib
import zlib
from array import array
from dataclasses import dataclass

from sglang_tiered.core.keys import chain_page_hashes

TOKEN_LO, TOKEN_HI = 16, 2000


@dataclass
class Request:
    tokens: array
    tenant: str | None = None
    kind: str = ""
    arrival_s: float = 0.0
    max_new_tokens: int = 1


def block_tokens(block_id, n: int, salt: str = "mooncake") -> list[int]:
    """Deterministic pseudo-random tokens for a block id (same id -> same tokens everywhere)."""
    out: list[int] = []
    ctr = 0
    while len(out) < n:
        d = hashlib.blake2b(f"{salt}:{block_id}:{ctr}".encode(), digest_size=64).digest()
        out += [TOKEN_LO + int.from_bytes(d[i : i + 2], "little") % (TOKEN_HI - TOKEN_LO) for i in range(0, 64, 2)]
        ctr += 1
    return out[:n]


def load_mooncake(path, tokens_per_block: int = 16, limit: int | None = None) -> list[Request]:
    """Read a Mooncake trace (JSONL, optionally gzipped; the repository's copy is
    bench/data/mooncake_conversation_trace.jsonl.gz). Each 512-token hash block maps to
    ``tokens_per_block`` tokens; the last, partial block is scaled in proportion (it always has
    its own id in the trace, so it is never shared)."""
    if not path:
        raise ValueError("load_mooncake needs the trace path (e.g. bench/data/mooncake_conversation_trace.jsonl.gz)")
    return load_trace(path, tokens_per_block, 512, limit, kind="mooncake")


def load_trace(path, tokens_per_block: int = 16, block_size: int = 512, limit: int | None = None,
               kind: str | None = None) -> list[Request]:  # fmt: skip
    """Read an operator's request trace (JSONL, optionally gzipped), one request per line, in
    either of two shapes (a file may mix them):

    - Mooncake's: ``hash_ids`` (one id per ``block_size``-token block of the prompt, equal ids
      for equal prefixes) and ``input_length``; each block maps to ``tokens_per_block``
      deterministic tokens (the last, partial block in proportion), as ``load_mooncake`` does;
    - token ids: ``input_ids`` (or ``tokens``), a list of non-negative integers, used as they are.

    Optional on both: ``tenant`` (or ``cache_salt``), a string, the request's tenant (replayed as
    its cache salt: tenants never share entries); ``timestamp`` (ms); ``output_length``. A line
    that is neither shape, or a bad field, raises ``ValueError`` naming the file and line, and so
    does a line that is not UTF-8 or a compressed file cut short or corrupt."""
    if tokens_per_block < 1 or block_size < 1:
        raise ValueError(f"tokens_per_block and block_size must be >= 1, got {tokens_per_block}, {block_size}")
    path = pathlib.Path(path)
    kind = kind or path.name.split(".")[0]
    opener = gzip.open if path.suffix == ".gz" else open
    reqs: list[Request] = []
    cache: dict = {}
    with opener(path, "rb") as f:
        for lineno, raw_line in _lines(f, path):
            if limit is not None and len(reqs) >= limit:
                break
            where = f"{path.name}:{lineno}"
            try:  # (each line decoded here: a byte that is not UTF-8 names its line)
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc.msg})") from None
            except (ValueError, RecursionError) as exc:  # (an integer past 4,300 digits; nesting)
                raise ValueError(f"{where}: not JSON this reader takes ({type(exc).__name__}: "
                                 f"{str(exc)[:80] or 'nested too deep'})") from None  # fmt: skip
            if not isinstance(r, dict):
                raise ValueError(f"{where}: a request is a JSON object, got {type(r).__name__}")
            tenant = r.get("tenant", r.get("cache_salt"))
            if tenant is not None and (not isinstance(tenant, str) or not _utf8(tenant)):
                raise ValueError(f"{where}: tenant must be a string (valid Unicode), got {tenant!r}")
            ids = r.get("hash_ids")
            if ids is not None:
                if not isinstance(ids, list) or not ids:
                    raise ValueError(f"{where}: hash_ids must be a non-empty list")
                length = r.get("input_length", block_size * len(ids))
                if not isinstance(length, int) or length < 1:
                    raise ValueError(f"{where}: input_length must be a positive integer, got {length!r}")
                toks: list[int] = []
                for j, h in enumerate(ids):
                    if not isinstance(h, (int, str)) or isinstance(h, bool) or (isinstance(h, str) and not _utf8(h)):
                        raise ValueError(f"{where}: hash_ids holds {h!r} (ids are integers or strings)")
                    if h not in cache:
                        cache[h] = block_tokens(h, tokens_per_block)
                    if j == len(ids) - 1:
                        rem = length - block_size * (len(ids) - 1)
                        k = max(1, min(tokens_per_block, math.ceil(rem * tokens_per_block / block_size)))
                        toks += cache[h][:k]
                    else:
                        toks += cache[h]
            else:
                raw = r.get("input_ids", r.get("tokens"))
                if raw is None:
                    raise ValueError(f"{where}: a request needs hash_ids (Mooncake's format) or input_ids")
                if (not isinstance(raw, list) or not raw
                        or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**63 for t in raw)):
                    raise ValueError(f"{where}: input_ids must be a non-empty list of non-negative integers")  # fmt: skip
                toks = raw
            ts = r.get("timestamp", 1000.0 * len(reqs))
            out = r.get("output_length", 1)
            if (isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0
                    or isinstance(out, bool) or not isinstance(out, int) or out < 0):
                raise ValueError(f"{where}: timestamp must be a finite number >= 0 (ms) and output_length a "
                                 f"whole number >= 0, got {ts!r} and {out!r}")  # fmt: skip
            reqs.append(Request(array("q", toks), tenant, kind, ts / 1000.0, max(1, min(out, 64))))
    if not reqs:
        raise ValueError(f"{path.name}: no requests")
    return reqs


def _lines(f, path):
    """(line number, bytes) of a trace file; a file that cannot be read on (a gzip cut short or
    corrupt) raises ``ValueError`` naming it and the line it stopped at."""
    lineno = 0
    try:
        for lineno, line in enumerate(f, 1):
            yield lineno, line
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise ValueError(f"{path.name}:{lineno + 1}: cannot read the file on ({type(exc).__name__}: {exc})") from None


def _utf8(text: str) -> bool:
    """``text`` encodes as UTF-8 (JSON's \\ud800 escapes decode to lone surrogates, which do not)."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


class _Rng:
    """Small deterministic PRNG (splitmix64), identical on every platform and Python version."""

    def __init__(self, seed: int):
        self.s = seed & (2**64 - 1)

    def next(self) -> int:
        self.s = (self.s + 0x9E3779B97F4A7C15) & (2**64 - 1)
        z = self.s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
        return z ^ (z >> 31)

    def random(self) -> float:
        return (self.next() >> 11) / float(1 << 53)

    def randint(self, lo: int, hi: int) -> int:  # inclusive
        return lo + self.next() % (hi - lo + 1)

    def zipf_index(self, n: int, s: float) -> int:
        weights = [1.0 / (i + 1) ** s for i in range(n)]
        x = self.random() * sum(weights)
        for i, w in enumerate(weights):
            x -= w
            if x <= 0:
                return i
        return n - 1


def multi_tenant(
    n_requests: int = 4000,
    seed: int = 0,
    n_tenants: int = 6,
    page: int = 16,
    scale: float = 1.0,
) -> list[Request]:
    """A seeded mix of what operators run all day, per tenant:

    * shared system prompts (Zipf popularity across a tenant's prompts),
    * multi-turn chats that grow turn by turn (a conversation is picked up again later),
    * agent loops (a long fixed tool preamble + a growing transcript, many quick steps),
    * RAG questions over a pool of documents (Zipf-popular documents, new question each time),
    * one-shot scans (long unique prompts: batch jobs, crawls) that must not flush the rest.
    """
    rng = _Rng(seed)
    uid = [0]

    def fresh(n: int) -> list[int]:
        uid[0] += 1
        return block_tokens(f"mt{seed}:{uid[0]}", n, salt="mt")

    L = lambda n: max(1, int(n * scale))  # noqa: E731
    tenants = [f"tenant-{i}" for i in range(n_tenants)]
    sys_prompts = {t: [fresh(L(rng.randint(320, 1280))) for _ in range(4)] for t in tenants}
    docs = {t: [fresh(L(rng.randint(300, 900))) for _ in range(30)] for t in tenants}
    agent_pre = {t: fresh(L(600)) for t in tenants}
    chats: dict[str, list[list[int]]] = {t: [] for t in tenants}
    agents: dict[str, list[list[int]]] = {t: [] for t in tenants}
    out: list[Request] = []
    for i in range(n_requests):
        t = tenants[rng.zipf_index(n_tenants, 0.8)]
        sp = sys_prompts[t][rng.zipf_index(4, 1.2)]
        x = rng.random()
        if x < 0.35:  # chat: continue a recent conversation or start one
            pool = chats[t]
            if pool and rng.random() < 0.7:
                j = len(pool) - 1 - min(len(pool) - 1, rng.zipf_index(min(len(pool), 40), 1.0))
                conv = pool[j]
                conv += fresh(L(rng.randint(40, 160)))  # previous answer + new user turn
                if len(conv) > 3000:
                    pool.pop(j)
            else:
                conv = list(sp) + fresh(L(rng.randint(30, 200)))
                pool.append(conv)
                if len(pool) > 200:
                    pool.pop(0)
            toks, kind = conv, "chat"
        elif x < 0.55:  # agent loop
            pool = agents[t]
            if pool and rng.random() < 0.8:
                run = pool[rng.randint(max(0, len(pool) - 6), len(pool) - 1)]
                run += fresh(L(rng.randint(20, 120)))
                if len(run) > 3500:
                    pool.remove(run)
            else:
                run = list(agent_pre[t]) + fresh(L(rng.randint(50, 150)))
                pool.append(run)
            toks, kind = run, "agent"
        elif x < 0.80:  # RAG
            d = docs[t][rng.zipf_index(len(docs[t]), 1.1)]
            toks, kind = list(sp) + d + fresh(L(rng.randint(20, 60))), "rag"
        else:  # one-shot scan
            toks, kind = fresh(L(rng.randint(400, 2500))), "scan"
        out.append(Request(array("q", toks), t, kind, float(i), 8))
    return out


def unique_pages(reqs: list[Request], page: int) -> int:
    """Number of distinct full pages (by tenant + prefix chain) across the workload."""
    seen: set[bytes] = set()
    for r in reqs:
        seen.update(chain_page_hashes(hashlib.blake2b((r.tenant or "").encode(), digest_size=16).digest(), r.tokens, page))
    return len(seen)
